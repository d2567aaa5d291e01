//! Running SQL statements against the store.
//!
//! Reads go to DataFusion unchanged. Writes are planned by DataFusion (so INSERT casts,
//! UPDATE expressions and DELETE predicates mean what DataFusion says they mean) and then
//! executed here: their input rows are collected and published as one epoch.

use crate::access::AccessStatement;
use crate::backend::{Backend, LocalBackend};
use crate::error::{from_datafusion, Result, SqlError};
use crate::provider::ScanLayout;
use crate::statements::TesseraStatement;
use crate::tags::TagStatement;
use crate::time_travel::rewrite_as_of;
use crate::transaction::Transaction;
use crate::users::{UserChange, UserStatement};
use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::{CatalogProvider, MemoryCatalogProvider};
use datafusion::common::Constraint;
use datafusion::common::ParamValues;
use datafusion::logical_expr::{DdlStatement, LogicalPlan};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion::sql::parser::{DFParser, Statement as DFStatement};
use datafusion::sql::sqlparser::ast::{AlterTable, Expr as SqlExpr, Statement as SqlStatement};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use std::sync::{Arc, Mutex};
use tessera_common::Epoch;
use tessera_storage::{Store, TableDef};

/// The longest SQL text accepted.
pub const MAX_SQL_BYTES: usize = 16 << 20;
/// The most rows one INSERT, UPDATE or DELETE may write.
pub const MAX_DML_ROWS: usize = 50_000_000;

mod writes;

/// Whether a caller reads answers whole or as they come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answers {
    Whole,
    MayStream,
}

/// What one statement produced.
pub enum StatementOutput {
    /// An answer, whole.
    Rows {
        schema: SchemaRef,
        batches: Vec<RecordBatch>,
    },
    /// An answer larger than the session's answer buffer, arriving as the query runs (see
    /// [`crate::answer`]); an error can end it after rows were sent. Only
    /// [`Engine::execute_streaming`], [`Engine::execute_parsed`] and
    /// [`Engine::execute_with`] return one.
    Streaming {
        schema: SchemaRef,
        stream: datafusion::physical_plan::SendableRecordBatchStream,
    },
    /// A statement that returns no rows: a tag such as `INSERT 3` and, for writes, the epoch
    /// that made them visible.
    Done { tag: String, epoch: Option<Epoch> },
}

impl std::fmt::Debug for StatementOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StatementOutput::Rows { schema, batches } => f
                .debug_struct("Rows")
                .field("schema", schema)
                .field("batches", batches)
                .finish(),
            StatementOutput::Streaming { schema, .. } => f
                .debug_struct("Streaming")
                .field("schema", schema)
                .finish_non_exhaustive(),
            StatementOutput::Done { tag, epoch } => f
                .debug_struct("Done")
                .field("tag", tag)
                .field("epoch", epoch)
                .finish(),
        }
    }
}

/// A setting's value as `SET` would take it back, if it has one.
fn setting_value(config: &SessionConfig, name: &str) -> Option<String> {
    let name = name.to_ascii_lowercase();
    config
        .options()
        .entries()
        .into_iter()
        .find(|entry| entry.key == name)
        .and_then(|entry| entry.value)
}

pub struct Engine {
    backend: Arc<dyn Backend>,
    ctx: SessionContext,
    /// The open transaction, between `BEGIN` and `COMMIT`/`ROLLBACK`.
    transaction: Mutex<Option<Transaction>>,
}

/// The largest build side (by the planner's estimate of its bytes) a local engine's hash
/// join collects once into one table that every partition probes (`CollectLeft`), rather
/// than repartitioning both sides by the key; DataFusion's default is 1 MiB.
///
/// On one node a shared table costs nothing to hand to each partition, while a
/// repartition copies every row of the probe side: at TPC-H SF 10, Q8 and Q9 repartitioned
/// all 60 M rows of lineitem (4.2 GB) to meet a few thousand parts whose filter the planner
/// guessed at a fifth of the table (400 K rows, 3.2 MB), and took 2-3x their SF 1 time per
/// row. At 4 MiB those joins collect the parts (Q8 0.57 -> 0.32 of DataFusion's time at
/// SF 10). A larger bound misjudges other joins by the same guessed selectivity: at 16 MiB
/// Q13 at SF 1 collected 1.48 M orders (a filter keeping 99%, guessed at a fifth) into
/// one table on one thread and took 1.6x DataFusion's time. A cluster's engine keeps
/// DataFusion's bound: there a collected side is sent to every node.
pub const LOCAL_COLLECT_JOIN_BYTES: usize = 4 << 20;

/// `config` with [`LOCAL_COLLECT_JOIN_BYTES`] where it holds DataFusion's default bound.
fn with_local_join_selection(mut config: SessionConfig) -> SessionConfig {
    let default =
        datafusion::config::OptimizerOptions::default().hash_join_single_partition_threshold;
    let optimizer = &mut config.options_mut().optimizer;
    if optimizer.hash_join_single_partition_threshold == default {
        optimizer.hash_join_single_partition_threshold = LOCAL_COLLECT_JOIN_BYTES;
    }
    config
}

impl Engine {
    /// An engine over one local store.
    pub fn new(store: Arc<Store>) -> Engine {
        Self::with_config(store, SessionConfig::new())
    }

    pub fn with_config(store: Arc<Store>, config: SessionConfig) -> Engine {
        Self::with_layout(store, config, ScanLayout::default())
    }

    pub fn with_layout(store: Arc<Store>, config: SessionConfig, layout: ScanLayout) -> Engine {
        let config = with_local_join_selection(config);
        Self::with_backend(Arc::new(LocalBackend::new(store, layout)), config)
    }

    /// An engine over any backend: a local store or a cluster.
    pub fn with_backend(backend: Arc<dyn Backend>, config: SessionConfig) -> Engine {
        let config = crate::options::with_tessera_options(config)
            .with_information_schema(true)
            .with_default_catalog_and_schema("tessera", "public");
        let ctx = SessionContext::new_with_config(config);
        ctx.add_optimizer_rule(Arc::new(crate::semi_join_pushdown::PushSemiJoins));
        let catalog = MemoryCatalogProvider::new();
        catalog
            .register_schema("public", backend.schema_provider())
            .expect("a fresh catalog accepts a schema");
        ctx.register_catalog("tessera", Arc::new(catalog));
        ctx.register_udtf(
            crate::changes::CHANGES_FUNCTION,
            Arc::new(crate::changes::ChangesFunction {
                backend: backend.clone(),
            }),
        );
        Engine {
            backend,
            ctx,
            transaction: Mutex::new(None),
        }
    }

    /// Ends the open transaction, if any, publishing nothing (a failed transaction's
    /// COMMIT, or a connection that closes in the middle of one).
    pub fn abandon_transaction(&self) {
        self.transaction.lock().expect("transaction lock").take();
    }

    /// Whether a transaction is open (`BEGIN` without its `COMMIT` or `ROLLBACK` yet).
    pub fn in_transaction(&self) -> bool {
        self.transaction.lock().expect("transaction lock").is_some()
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn session(&self) -> &SessionContext {
        &self.ctx
    }

    /// Runs every statement in `sql`, in order, stopping at the first error. Every answer
    /// is whole ([`StatementOutput::Rows`]).
    pub async fn execute(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        let mut outputs = self.execute_answering(sql, Answers::Whole).await?;
        crate::answer::read_last_whole(&mut outputs).await?;
        Ok(outputs)
    }

    /// [`Engine::execute`], but the last statement's answer may stream
    /// ([`StatementOutput::Streaming`]) when it outgrows the session's answer buffer. The
    /// earlier statements' answers are whole.
    pub async fn execute_streaming(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        self.execute_answering(sql, Answers::MayStream).await
    }

    async fn execute_answering(&self, sql: &str, answers: Answers) -> Result<Vec<StatementOutput>> {
        if sql.len() > MAX_SQL_BYTES {
            return Err(SqlError::TooLarge {
                bytes: sql.len(),
                limit: MAX_SQL_BYTES,
            });
        }
        let (mut hints, sql) = crate::options::split_hints(sql)?;
        if answers == Answers::Whole {
            // Read whole anyway, so kept whole: a query that loses a node can then always
            // be run again unseen, however large its answer.
            hints.insert(0, ("tessera.answer_buffer".into(), "none".into()));
        }
        if hints.is_empty() {
            return self.execute_statements(sql).await;
        }
        // The hints hold for this request only: the settings they name come back after
        // (and only those: a `SET` among the statements stays, as it would without hints).
        let saved = self.ctx.state().config().clone();
        let hinted: Vec<(String, Option<String>)> = hints
            .iter()
            .map(|(name, _)| (name.clone(), setting_value(&saved, name)))
            .collect();
        for (name, value) in &hints {
            let set = self
                .ctx
                .state_ref()
                .write()
                .config_mut()
                .options_mut()
                .set(name, value);
            if let Err(error) = set {
                *self.ctx.state_ref().write().config_mut() = saved;
                return Err(from_datafusion(error));
            }
        }
        let result = self.execute_statements(sql).await;
        let state = self.ctx.state_ref();
        let mut state = state.write();
        let restored = hinted.iter().all(|(name, value)| {
            value
                .as_ref()
                .is_some_and(|value| state.config_mut().options_mut().set(name, value).is_ok())
        });
        if !restored {
            // A setting without a value to write back (an unset optional one): the whole
            // session's settings as they were.
            *state.config_mut() = saved;
        }
        result
    }

    async fn execute_statements(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        let texts = crate::statements::split_statements(sql);
        if texts.len() <= 1 {
            if let Some(statement) = crate::statements::parse_tessera_statement(sql) {
                return Ok(vec![self.execute_tessera(statement?).await?]);
            }
        } else {
            // Tessera's own statements may sit among others: each text on its own.
            let mut outputs = Vec::with_capacity(texts.len());
            for text in texts {
                crate::answer::read_last_whole(&mut outputs).await?;
                outputs.extend(Box::pin(self.execute_statements(&text)).await?);
            }
            return Ok(outputs);
        }
        let statements = parse_statements(sql)?;
        let mut outputs = Vec::with_capacity(statements.len());
        for statement in statements {
            // An answer still streaming would run beside the next statement: read it first.
            crate::answer::read_last_whole(&mut outputs).await?;
            outputs.push(self.execute_statement(statement, None).await?);
        }
        Ok(outputs)
    }

    /// Runs one statement a front end has parsed itself (the PostgreSQL wire protocol
    /// parses with PostgreSQL's dialect), with values for its `$n` placeholders. The
    /// `AS OF EPOCH` rewrite must already have been applied to the SQL text.
    pub async fn execute_parsed(
        &self,
        statement: DFStatement,
        params: Option<&ParamValues>,
    ) -> Result<StatementOutput> {
        self.execute_statement(statement, params).await
    }

    /// Plans a statement without running it: for a client that asks what a prepared
    /// statement's parameters and result columns are.
    pub async fn plan_only(&self, statement: DFStatement) -> Result<LogicalPlan> {
        self.ctx
            .state()
            .statement_to_plan(statement)
            .await
            .map_err(from_datafusion)
    }

    /// Inserts rows a front end decoded itself (PostgreSQL's `COPY table FROM STDIN`), in
    /// the table's columns, as one INSERT statement: one epoch, or kept for COMMIT inside
    /// a transaction; keys already present are refused.
    pub async fn insert_rows(
        &self,
        table: &str,
        batches: Vec<RecordBatch>,
    ) -> Result<(usize, Option<Epoch>)> {
        self.begin_statement().await?;
        self.insert(table, batches).await
    }

    /// The columns one statement would return, without running it, or `None` for a command
    /// (DDL, DML, transaction control): for a client that asks before it fetches (Flight
    /// SQL's `GetFlightInfo`).
    pub async fn describe(&self, sql: &str) -> Result<Option<SchemaRef>> {
        Ok(self.describe_with(sql, None).await?.0)
    }

    /// [`Engine::describe`] with values bound to the statement's `$n` placeholders (or
    /// none yet), and the types of those placeholders as planned (`None` where the
    /// statement leaves one open).
    pub async fn describe_with(
        &self,
        sql: &str,
        params: Option<&ParamValues>,
    ) -> Result<(Option<SchemaRef>, Vec<Option<DataType>>)> {
        // Tessera's own statements are commands, and DataFusion's parser does not read them.
        if let Some(statement) = crate::statements::parse_tessera_statement(sql) {
            return statement.map(|_| (None, Vec::new()));
        }
        let statement = parse_one_statement(sql)?;
        if transaction_control(&statement).is_some() || is_alter_table(&statement) {
            return Ok((None, Vec::new()));
        }
        self.begin_statement().await?;
        let plan = self.plan_only(statement).await?;
        let types = crate::params::positional_types(&plan)?;
        let plan = match params {
            Some(values) => plan
                .replace_params_with_values(values)
                .map_err(from_datafusion)?,
            None => plan,
        };
        Ok((result_schema(&plan), types))
    }

    /// Runs one statement with values for its `$n` placeholders.
    pub async fn execute_with(&self, sql: &str, params: &ParamValues) -> Result<StatementOutput> {
        let statement = parse_one_statement(sql)?;
        self.execute_statement(statement, Some(params)).await
    }

    /// Runs SQL whose last statement returns rows, and returns them.
    pub async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>> {
        match self.execute(sql).await?.pop() {
            Some(StatementOutput::Rows { batches, .. }) => Ok(batches),
            Some(StatementOutput::Streaming { .. }) => {
                unreachable!("Engine::execute reads every answer whole")
            }
            Some(StatementOutput::Done { tag, .. }) => Err(SqlError::Unsupported(format!(
                "expected a query returning rows, got {tag}"
            ))),
            None => Err(SqlError::Unsupported("no statement given".into())),
        }
    }

    /// Runs one of Tessera's own statements (which a front end may have recognized itself:
    /// see [`crate::statements`]). A user statement is shown only with its password masked.
    pub async fn execute_tessera(&self, statement: TesseraStatement) -> Result<StatementOutput> {
        self.observed(statement.redacted(), async {
            if self.in_transaction() {
                return Err(SqlError::Unsupported(format!(
                    "{} inside a transaction; run it on its own",
                    statement.tag()
                )));
            }
            match statement {
                TesseraStatement::User(user) => self.run_user(user).await,
                TesseraStatement::Tag(tag) => self.run_tag(tag).await,
                TesseraStatement::Access(access) => self.run_access(access).await,
                TesseraStatement::Retention(retention) => {
                    self.backend.change_retention(&retention).await?;
                    Ok(done(retention.command_tag(), None))
                }
            }
        })
        .await
    }

    async fn run_tag(&self, statement: TagStatement) -> Result<StatementOutput> {
        let exists = self.backend.tag_exists(statement.name());
        let skip = statement.tolerant()
            && match statement {
                TagStatement::Create { .. } => exists,
                TagStatement::Drop { .. } => !exists,
            };
        let epoch = match skip {
            true => None,
            false => self.backend.change_tag(statement.clone()).await?,
        };
        Ok(done(statement.command_tag(), epoch))
    }

    async fn run_access(&self, statement: AccessStatement) -> Result<StatementOutput> {
        let skip = match &statement {
            AccessStatement::CreateParticipant { name, tolerant } => {
                *tolerant && self.backend.participant_exists(name)
            }
            AccessStatement::DropParticipant { name, tolerant } => {
                *tolerant && !self.backend.participant_exists(name)
            }
            _ => false,
        };
        if !skip {
            self.backend.change_access(statement.clone()).await?;
        }
        Ok(done(statement.command_tag(), None))
    }

    /// Statements run for `user` from now on (`None`: the cluster's operator), as the
    /// front end authenticated it: the cluster checks each against the user's rights.
    pub fn act_as(&self, user: Option<String>) {
        self.backend.act_as(user);
    }

    async fn run_user(&self, statement: UserStatement) -> Result<StatementOutput> {
        let exists = self.backend.user_exists(statement.name());
        let skip = statement.tolerant
            && match statement.change {
                UserChange::Create { .. } => exists,
                UserChange::Drop { .. } => !exists,
                UserChange::Alter { .. } => false,
            };
        if !skip {
            self.backend.change_user(statement.change.clone()).await?;
        }
        Ok(done(statement.tag(), None))
    }

    /// Runs one statement, counting it and its latency in the node's metrics.
    async fn execute_statement(
        &self,
        statement: DFStatement,
        params: Option<&ParamValues>,
    ) -> Result<StatementOutput> {
        self.observed(statement.to_string(), self.run_statement(statement, params))
            .await
    }

    /// Runs a statement shown as `text` among the node's running and recent statements,
    /// counting it and its latency in the node's metrics.
    async fn observed(
        &self,
        text: String,
        run: impl std::future::Future<Output = Result<StatementOutput>>,
    ) -> Result<StatementOutput> {
        let started = std::time::Instant::now();
        let tracked = crate::activity::Tracked::start(text);
        // The distributed queries the statement starts list themselves under it.
        let result = tessera_common::statement::within(tracked.id(), run).await;
        let end = move |error: Option<String>| {
            let metrics = tessera_common::metrics::metrics();
            tessera_common::metrics::observe_seconds(&metrics.query_seconds, started.elapsed());
            let outcome = if error.is_none() { "ok" } else { "failed" };
            tessera_common::metrics::count(&metrics.queries, "outcome", outcome);
            tracked.end(error);
        };
        match result {
            // A streaming answer's statement runs until its last row is read.
            Ok(StatementOutput::Streaming { schema, stream }) => {
                let stream = crate::answer::on_end(stream, move |how| match how {
                    crate::answer::End::Finished => end(None),
                    crate::answer::End::Failed(error) => end(Some(error)),
                    // Dropping the record ends it as cancelled.
                    crate::answer::End::Dropped => {}
                });
                Ok(StatementOutput::Streaming { schema, stream })
            }
            result => {
                end(result.as_ref().err().map(crate::error::one_message));
                result
            }
        }
    }

    /// Runs one statement. An UPDATE or DELETE on its own that meets a write conflict
    /// (the table changed after it read it) is planned and run again, reading the change,
    /// up to [`WRITE_CONFLICT_ATTEMPTS`] times in all; inside a transaction the conflict
    /// fails the COMMIT instead, and the client runs the transaction again.
    async fn run_statement(
        &self,
        statement: DFStatement,
        params: Option<&ParamValues>,
    ) -> Result<StatementOutput> {
        let rewrites_read_rows = matches!(&statement, DFStatement::Statement(s)
            if matches!(s.as_ref(), SqlStatement::Update { .. } | SqlStatement::Delete(_)));
        let retried = rewrites_read_rows && !self.in_transaction();
        let mut attempt = 1;
        loop {
            match self.run_statement_once(statement.clone(), params).await {
                Err(SqlError::WriteConflict(reason))
                    if retried && attempt < WRITE_CONFLICT_ATTEMPTS =>
                {
                    tracing::info!(attempt, %reason, "a write conflict: running the statement again");
                    // Apart, so that statements that conflicted do not meet again at once.
                    let jitter = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| u64::from(d.subsec_nanos()));
                    let pause = jitter % (20 * u64::from(attempt));
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    async fn run_statement_once(
        &self,
        mut statement: DFStatement,
        params: Option<&ParamValues>,
    ) -> Result<StatementOutput> {
        let mut partition_by = None;
        if let DFStatement::Statement(inner) = &mut statement {
            match inner.as_mut() {
                SqlStatement::CreateTable(create) => {
                    partition_by = create
                        .partition_by
                        .take()
                        .map(|e| partition_columns(&e))
                        .transpose()?
                }
                _ => {}
            }
        }
        if let Some(control) = transaction_control(&statement) {
            return self.execute_transaction_control(control).await;
        }
        self.begin_statement().await?;
        if let DFStatement::Statement(inner) = &statement {
            if let SqlStatement::AlterTable(alter) = inner.as_ref() {
                return self.alter_table(alter).await;
            }
        }
        let plan = self.plan_only(statement).await?;
        let plan = match params {
            Some(values) => plan
                .replace_params_with_values(values)
                .map_err(from_datafusion)?,
            None => plan,
        };
        let plan = self.within_transaction(plan)?;
        match plan {
            LogicalPlan::Ddl(DdlStatement::CreateMemoryTable(create)) => {
                let name = create.name.table().to_string();
                crate::system::check_user_table_name(&name)?;
                if create.or_replace {
                    return Err(SqlError::Unsupported(
                        "CREATE OR REPLACE TABLE; drop the table first".into(),
                    ));
                }
                if create.if_not_exists && self.backend.table_def(&name).is_some() {
                    return Ok(done("CREATE TABLE", None));
                }
                let schema = create.input.schema().as_arrow().clone();
                let primary_key: Vec<String> = create
                    .constraints
                    .iter()
                    .find_map(|c| match c {
                        Constraint::PrimaryKey(indices) => Some(
                            indices
                                .iter()
                                .map(|&i| schema.field(i).name().clone())
                                .collect(),
                        ),
                        Constraint::Unique(_) => None,
                    })
                    .unwrap_or_default();
                let def = TableDef::new(&name, schema, primary_key, partition_by)?;
                self.backend.create_table(def).await?;
                if matches!(create.input.as_ref(), LogicalPlan::EmptyRelation(_)) {
                    return Ok(done("CREATE TABLE", None));
                }
                let batches = self.collect(create.input.as_ref().clone()).await?;
                let (rows, epoch) = self.insert(&name, batches).await?;
                Ok(done(&format!("CREATE TABLE AS {rows}"), epoch))
            }
            LogicalPlan::Ddl(DdlStatement::DropTable(drop)) => {
                let name = drop.name.table().to_string();
                if drop.if_exists && self.backend.table_def(&name).is_none() {
                    return Ok(done("DROP TABLE", None));
                }
                self.backend.drop_table(&name).await?;
                Ok(done("DROP TABLE", None))
            }
            LogicalPlan::Dml(dml) => self.execute_dml(dml).await,
            plan => self.backend.run_query(&self.ctx, plan).await,
        }
    }

    /// ALTER TABLE's column changes, one after the other.
    async fn alter_table(&self, alter: &AlterTable) -> Result<StatementOutput> {
        let (table, changes) = crate::alter::column_changes(&self.ctx, alter).await?;
        if self
            .transaction
            .lock()
            .expect("transaction lock")
            .as_ref()
            .is_some_and(|t| !t.is_empty())
        {
            return Err(SqlError::Unsupported(
                "ALTER TABLE after writes in the same transaction (it would take effect before them); COMMIT or ROLLBACK first".into(),
            ));
        }
        if self.backend.table_def(&table).is_none() {
            if alter.if_exists {
                return Ok(done("ALTER TABLE", None));
            }
            return Err(tessera_storage::StorageError::UnknownTable(table).into());
        }
        for change in changes {
            self.backend.alter_table(&table, change).await?;
        }
        Ok(done("ALTER TABLE", None))
    }

    /// Fixes the view a statement sees (before it is planned): a fresh one for each
    /// statement, or inside a transaction the one taken at its first statement.
    async fn begin_statement(&self) -> Result<()> {
        let pin = match self.transaction.lock().expect("transaction lock").as_mut() {
            None => true,
            Some(open) => !std::mem::replace(&mut open.view_pinned, true),
        };
        if pin {
            self.backend.begin_statement().await?;
        }
        Ok(())
    }

    /// Inside a transaction, refuses DDL once the transaction has written (a CREATE or
    /// DROP takes effect at once, not at COMMIT; drivers open a transaction before any
    /// statement, so DDL before the first write runs), and makes reads of tables the
    /// transaction has written see its own writes.
    fn within_transaction(&self, plan: LogicalPlan) -> Result<LogicalPlan> {
        let transaction = self.transaction.lock().expect("transaction lock");
        let Some(open) = transaction.as_ref() else {
            return Ok(plan);
        };
        if open.is_empty() {
            return Ok(plan);
        }
        if matches!(plan, LogicalPlan::Ddl(_)) {
            return Err(SqlError::Unsupported(
                "CREATE or DROP after writes in the same transaction (it would take effect before them); COMMIT or ROLLBACK first".into(),
            ));
        }
        let written = open.written_tables();
        crate::own_writes::overlay(plan, &|table| {
            if !written.contains(table) {
                return Ok(None);
            }
            let def = self.backend.table_def(table).ok_or_else(|| {
                SqlError::Storage(tessera_storage::StorageError::UnknownTable(table.into()))
            })?;
            Ok(open.pending(&def)?.map(|changes| (def, changes)))
        })
    }

    async fn execute_transaction_control(&self, control: TxControl) -> Result<StatementOutput> {
        match control {
            TxControl::Begin => {
                let mut transaction = self.transaction.lock().expect("transaction lock");
                // As in PostgreSQL, a BEGIN inside a transaction changes nothing.
                transaction.get_or_insert_with(Transaction::default);
                Ok(done("BEGIN", None))
            }
            TxControl::Rollback => {
                self.abandon_transaction();
                Ok(done("ROLLBACK", None))
            }
            TxControl::Commit => {
                let open = self.transaction.lock().expect("transaction lock").take();
                match open {
                    Some(open) if !open.is_empty() => {
                        let (changes, read_at) =
                            open.into_publish(|t| self.backend.table_def(t))?;
                        let epoch = self.backend.publish(changes, &read_at).await?;
                        Ok(done("COMMIT", Some(epoch)))
                    }
                    _ => Ok(done("COMMIT", None)),
                }
            }
        }
    }
}

/// How many times, in all, an UPDATE or DELETE outside a transaction runs when it meets
/// write conflicts (see [`Engine::run_statement`]) before the conflict is the client's.
const WRITE_CONFLICT_ATTEMPTS: u32 = 10;

/// A statement that opens or ends a transaction.
enum TxControl {
    Begin,
    Commit,
    Rollback,
}

/// Tessera's `AS OF EPOCH` rewritten, then parsed as DataFusion parses.
/// The one statement `sql` holds; several are refused, as a prepared statement is one.
fn parse_one_statement(sql: &str) -> Result<DFStatement> {
    let mut statements = parse_statements(sql)?;
    if statements.len() != 1 {
        return Err(SqlError::Unsupported(format!(
            "{} statements in one request; send one at a time",
            statements.len()
        )));
    }
    Ok(statements.pop_front().expect("one statement"))
}

fn parse_statements(sql: &str) -> Result<std::collections::VecDeque<DFStatement>> {
    let sql = rewrite_as_of(sql)?;
    DFParser::parse_sql_with_dialect(&sql, &GenericDialect {})
        .map_err(|e| SqlError::DataFusion(e.into()))
}

/// The columns a plan answers with, or `None` for a command (DDL, DML, a statement such as
/// SET, COPY), which answers with a tag.
pub fn result_schema(plan: &LogicalPlan) -> Option<SchemaRef> {
    let command = matches!(
        plan,
        LogicalPlan::Dml(_)
            | LogicalPlan::Ddl(_)
            | LogicalPlan::Statement(_)
            | LogicalPlan::Copy(_)
    );
    (!command).then(|| Arc::new(plan.schema().as_arrow().clone()))
}

/// A command tag split into its command and row count: `INSERT 3` is (`INSERT`, 3),
/// `CREATE TABLE` has no count.
pub fn split_tag(tag: &str) -> (&str, Option<usize>) {
    match tag.rsplit_once(' ') {
        Some((command, count)) if count.bytes().all(|b| b.is_ascii_digit()) => {
            (command, count.parse().ok())
        }
        _ => (tag, None),
    }
}

/// Whether a statement opens or ends a transaction: the engine runs these itself, and
/// DataFusion has no plan for them.
pub fn is_transaction_control(statement: &SqlStatement) -> bool {
    sql_transaction_control(statement).is_some()
}

fn is_alter_table(statement: &DFStatement) -> bool {
    matches!(statement, DFStatement::Statement(inner) if matches!(inner.as_ref(), SqlStatement::AlterTable(_)))
}

fn transaction_control(statement: &DFStatement) -> Option<TxControl> {
    match statement {
        DFStatement::Statement(statement) => sql_transaction_control(statement),
        _ => None,
    }
}

fn sql_transaction_control(statement: &SqlStatement) -> Option<TxControl> {
    match statement {
        SqlStatement::StartTransaction { .. } => Some(TxControl::Begin),
        SqlStatement::Commit { .. } => Some(TxControl::Commit),
        SqlStatement::Rollback { .. } => Some(TxControl::Rollback),
        _ => None,
    }
}

fn done(tag: &str, epoch: Option<Epoch>) -> StatementOutput {
    StatementOutput::Done {
        tag: tag.to_string(),
        epoch,
    }
}

/// `PARTITION BY (a, b)` or `PARTITION BY a` in CREATE TABLE: the partition key columns.
fn partition_columns(expr: &SqlExpr) -> Result<Vec<String>> {
    let column = |e: &SqlExpr| match e {
        SqlExpr::Identifier(ident) => Ok(if ident.quote_style.is_some() {
            ident.value.clone()
        } else {
            ident.value.to_lowercase()
        }),
        other => Err(SqlError::Unsupported(format!(
            "PARTITION BY takes column names, got {other}"
        ))),
    };
    match expr {
        SqlExpr::Nested(inner) => partition_columns(inner),
        SqlExpr::Tuple(items) => items.iter().map(column).collect(),
        single => Ok(vec![column(single)?]),
    }
}
