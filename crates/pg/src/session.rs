//! One PostgreSQL connection: its engine (settings, open transaction) and the two query
//! protocols over it.
//!
//! Simple queries run each statement in turn and stop at the first error. The extended
//! protocol plans a statement when it is parsed (so Describe can name its parameter and
//! result types) and runs it at Execute with the bound values; pgwire keeps prepared
//! statements and portals (and suspends a portal at its row limit).

use crate::copy::{CopyFormat, MAX_COPY_BYTES};
use crate::errors::{sql_error, transaction_aborted, user_error};
use crate::results::{command_response, fields, response};
use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::common::ParamValues;
use datafusion::sql::parser::Statement as DFStatement;
use datafusion::sql::sqlparser::ast::{CopySource, CopyTarget, Statement};
use datafusion_pg_catalog::sql::PostgresCompatibilityParser;
use futures::{Sink, SinkExt, StreamExt};
use pgwire::api::copy::CopyHandler;
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{CopyResponse, FieldInfo, Response, Tag};
use pgwire::api::stmt::QueryParser;
use pgwire::api::store::PortalStore;
use pgwire::api::{ClientInfo, ClientPortalStore, Type};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::copy::{CopyData, CopyDone, CopyFail};
use pgwire::messages::extendedquery::Execute;
use pgwire::messages::response::{NoticeResponse, TransactionStatus};
use pgwire::messages::simplequery::Query;
use pgwire::messages::PgWireBackendMessage;
use pgwire::types::format::FormatOptions;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use tessera_sql::engine::MAX_SQL_BYTES;
use tessera_sql::statements::TesseraStatement;
use tessera_sql::{Engine, StatementOutput};

/// What a client sent, as this front end runs it: SQL for the engine, or one of Tessera's
/// own statements (`CREATE USER ... WITH PASSWORD`, `CREATE TAG`), which the engine's
/// parser does not read.
#[derive(Debug, Clone)]
pub enum PgCommand {
    Sql(Statement),
    Tessera(TesseraStatement),
}

/// A statement as parsed (and planned) at Parse, kept under its name until closed.
#[derive(Debug, Clone)]
pub struct PgStatement {
    command: PgCommand,
    /// What DataFusion inferred for `$1`, `$2`, ... (`None` where it could not).
    parameters: Vec<Option<DataType>>,
    /// The columns it returns, or `None` for a command.
    result: Option<SchemaRef>,
}

/// Parses with PostgreSQL's dialect plus the rewrites PostgreSQL clients need
/// (`::regclass`, `OPERATOR(pg_catalog.~)`, ...), after Tessera's `AS OF EPOCH`.
pub struct PgParser {
    engine: Arc<Engine>,
    sql: PostgresCompatibilityParser,
}

impl PgParser {
    /// The commands in `sql`: one of Tessera's own statements, or the SQL statements in it.
    fn parse_commands(&self, sql: &str) -> PgWireResult<Vec<PgCommand>> {
        if let Some(statement) = tessera_sql::statements::parse_tessera_statement(sql) {
            return Ok(vec![PgCommand::Tessera(statement.map_err(sql_error)?)]);
        }
        Ok(self.parse(sql)?.into_iter().map(PgCommand::Sql).collect())
    }

    fn parse(&self, sql: &str) -> PgWireResult<Vec<Statement>> {
        if sql.len() > MAX_SQL_BYTES {
            return Err(user_error(
                "54000",
                format!(
                    "SQL text of {} bytes exceeds the limit of {MAX_SQL_BYTES} bytes",
                    sql.len()
                ),
            ));
        }
        let sql = tessera_sql::time_travel::rewrite_as_of(sql).map_err(sql_error)?;
        self.sql
            .parse(&sql)
            .map_err(|error| user_error("42601", error.to_string()))
    }
}

#[async_trait]
impl QueryParser for PgParser {
    type Statement = PgStatement;

    async fn parse_sql<C>(
        &self,
        _client: &C,
        sql: &str,
        _types: &[Option<Type>],
    ) -> PgWireResult<Option<PgStatement>>
    where
        C: ClientInfo + Unpin + Send + Sync,
    {
        let mut commands = self.parse_commands(sql)?;
        let statement = match commands.len() {
            0 => return Ok(None),
            1 => match commands.pop().expect("one statement") {
                PgCommand::Sql(statement) => statement,
                tessera => {
                    return Ok(Some(PgStatement {
                        command: tessera,
                        parameters: Vec::new(),
                        result: None,
                    }))
                }
            },
            _ => {
                return Err(user_error(
                    "42601",
                    "cannot insert multiple commands into a prepared statement",
                ))
            }
        };
        // Transaction control has no plan; COPY is run by this crate, not planned.
        if tessera_sql::engine::is_transaction_control(&statement)
            || matches!(statement, Statement::Copy { .. })
        {
            return Ok(Some(PgStatement {
                command: PgCommand::Sql(statement),
                parameters: Vec::new(),
                result: None,
            }));
        }
        let plan = self
            .engine
            .plan_only(DFStatement::Statement(Box::new(statement.clone())))
            .await
            .map_err(sql_error)?;
        let parameters = tessera_sql::params::positional_types(&plan).map_err(sql_error)?;
        let result = tessera_sql::engine::result_schema(&plan);
        Ok(Some(PgStatement {
            command: PgCommand::Sql(statement),
            parameters,
            result,
        }))
    }

    fn get_parameter_types(&self, statement: &PgStatement) -> PgWireResult<Vec<Type>> {
        statement
            .parameters
            .iter()
            .map(|t| match t {
                Some(data_type) => arrow_pg::datatypes::into_pg_type(data_type),
                None => Ok(Type::UNKNOWN),
            })
            .collect()
    }

    fn get_result_schema(
        &self,
        statement: &PgStatement,
        format: Option<&Format>,
    ) -> PgWireResult<Vec<FieldInfo>> {
        match &statement.result {
            Some(schema) => fields(
                schema,
                format.unwrap_or(&Format::UnifiedText),
                Arc::new(FormatOptions::default()),
            ),
            None => Ok(Vec::new()),
        }
    }
}

/// One connection's session.
pub struct PgSession {
    pub(crate) engine: Arc<Engine>,
    parser: Arc<PgParser>,
    /// The `COPY ... FROM STDIN` under way: its rows arrive as CopyData messages.
    copy_in: Mutex<Option<CopyIn>>,
}

/// A `COPY table FROM STDIN` waiting for its rows.
struct CopyIn {
    table: String,
    schema: SchemaRef,
    /// The table's columns the rows hold, in the order they hold them.
    columns: Vec<usize>,
    format: CopyFormat,
    data: Vec<u8>,
}

impl PgSession {
    pub fn new(engine: Engine) -> PgSession {
        if let Err(error) = datafusion_pg_catalog::pg_catalog::setup_pg_catalog(
            engine.session(),
            "tessera",
            datafusion_pg_catalog::pg_catalog::context::EmptyContextProvider,
        ) {
            tracing::warn!(%error, "pg_catalog is unavailable on this connection");
        }
        let engine = Arc::new(engine);
        PgSession {
            parser: Arc::new(PgParser {
                engine: engine.clone(),
                sql: PostgresCompatibilityParser::new(),
            }),
            engine,
            copy_in: Mutex::new(None),
        }
    }

    /// The connection's engine (shared with its start-up, which tells it who logged in).
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.clone()
    }

    /// Runs one statement and sends the notices it raised (a query that survived a node's
    /// death says how) ahead of its result.
    async fn run<C>(
        &self,
        client: &mut C,
        command: PgCommand,
        params: Option<&ParamValues>,
        format: &Format,
        whole: Answers,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let statement = match command {
            PgCommand::Sql(statement) => statement,
            PgCommand::Tessera(statement) => {
                if client.transaction_status() == TransactionStatus::Error {
                    return Err(transaction_aborted());
                }
                let result = whole
                    .read(self.engine.execute_tessera(statement).await)
                    .await;
                let options = Arc::new(FormatOptions::from_client_metadata(client.metadata()));
                return response(
                    result.map_err(sql_error)?,
                    format,
                    options,
                    connection_handle(client),
                );
            }
        };
        if let Statement::Deallocate { name, .. } = &statement {
            // Drivers (psycopg after a rollback) drop their prepared statements. `ALL`
            // leaves them in place: a driver that prepares again reuses the names, which
            // replaces them.
            if !name.value.eq_ignore_ascii_case("all") {
                client.portal_store().rm_statement(&name.value);
            }
            return Ok(command_response("DEALLOCATE"));
        }
        let ends_transaction = matches!(
            statement,
            Statement::Commit { .. } | Statement::Rollback { .. }
        );
        if client.transaction_status() == TransactionStatus::Error {
            if !ends_transaction {
                return Err(transaction_aborted());
            }
            // As in PostgreSQL, COMMIT of a failed transaction rolls it back.
            self.engine.abandon_transaction();
            return Ok(command_response("ROLLBACK"));
        }
        if let Statement::Copy {
            source,
            to,
            target,
            options,
            legacy_options,
            ..
        } = statement
        {
            let format = CopyFormat::from_options(&options, &legacy_options)?;
            return match (to, target) {
                (false, CopyTarget::Stdin) => self.start_copy_in(source, format),
                (true, CopyTarget::Stdout) => self.copy_out(client, source, format).await,
                (_, target) => Err(user_error(
                    "0A000",
                    format!("COPY with {target}: only FROM STDIN and TO STDOUT (the node's files are not the client's; to write a file where you are, use psql's \\copy or tessera export)"),
                )),
            };
        }
        let result = self
            .engine
            .execute_parsed(DFStatement::Statement(Box::new(statement)), params)
            .await;
        let result = whole.read(result).await;
        self.send_notices(client).await?;
        let options = Arc::new(FormatOptions::from_client_metadata(client.metadata()));
        response(
            result.map_err(sql_error)?,
            format,
            options,
            connection_handle(client),
        )
    }

    /// Sends the notices the last statement raised (a query that survived a node's death
    /// says how).
    pub(crate) async fn send_notices<C>(&self, client: &mut C) -> PgWireResult<()>
    where
        C: Sink<PgWireBackendMessage> + Unpin + Send,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        for message in self.engine.backend().take_notices() {
            let notice = ErrorInfo::new("NOTICE".to_string(), "01000".to_string(), message);
            client
                .feed(PgWireBackendMessage::NoticeResponse(NoticeResponse::from(
                    notice,
                )))
                .await?;
        }
        Ok(())
    }

    /// `COPY table [(columns)] FROM STDIN`: checks the table and columns, then waits for
    /// the rows (see the [`CopyHandler`]).
    fn start_copy_in(&self, source: CopySource, format: CopyFormat) -> PgWireResult<Response> {
        let CopySource::Table {
            table_name,
            columns,
        } = source
        else {
            return Err(user_error("42601", "COPY FROM needs a table, not a query"));
        };
        let table = object_name(&table_name);
        let def = self
            .engine
            .backend()
            .table_def(&table)
            .ok_or_else(|| user_error("42P01", format!("table {table:?} does not exist")))?;
        let schema = def.schema_ref();
        let columns = if columns.is_empty() {
            (0..schema.fields().len()).collect()
        } else {
            columns
                .iter()
                .map(|c| {
                    schema.index_of(&c.value).map_err(|_| {
                        user_error(
                            "42703",
                            format!("column {:?} of table {table:?} does not exist", c.value),
                        )
                    })
                })
                .collect::<PgWireResult<Vec<_>>>()?
        };
        let count = columns.len();
        *self.copy_in.lock().expect("copy lock") = Some(CopyIn {
            table,
            schema,
            columns,
            format,
            data: Vec::new(),
        });
        Ok(Response::CopyIn(CopyResponse::new(
            0,
            count,
            futures::stream::empty(),
        )))
    }

    /// `COPY table TO STDOUT` or `COPY (query) TO STDOUT`: runs the query through the
    /// engine and sends its rows.
    async fn copy_out<C>(
        &self,
        client: &mut C,
        source: CopySource,
        format: CopyFormat,
    ) -> PgWireResult<Response>
    where
        C: Sink<PgWireBackendMessage> + Unpin + Send,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let query = match source {
            CopySource::Query(query) => Statement::Query(query),
            CopySource::Table {
                table_name,
                columns,
            } => {
                let list = if columns.is_empty() {
                    "*".to_string()
                } else {
                    columns
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let mut parsed = self
                    .parser
                    .parse(&format!("SELECT {list} FROM {table_name}"))?;
                parsed.pop().expect("one statement")
            }
        };
        let result = self
            .engine
            .execute_parsed(DFStatement::Statement(Box::new(query)), None)
            .await;
        self.send_notices(client).await?;
        let Ok((schema, answer)) = result.map_err(sql_error)?.into_rows() else {
            return Err(user_error(
                "42601",
                "COPY TO needs a query that returns rows",
            ));
        };
        let header = format.header_line(&schema).map(Ok);
        // Encoded a batch at a time as the answer arrives: an export of any size holds one.
        let body = answer.flat_map(move |batch| {
            let chunks = batch
                .map_err(|error| sql_error(tessera_sql::error::from_datafusion(error)))
                .and_then(|batch| format.encode(&batch));
            match chunks {
                Ok(chunks) => futures::stream::iter(chunks.into_iter().map(Ok)).left_stream(),
                Err(error) => futures::stream::iter([Err(error)]).right_stream(),
            }
        });
        let data = futures::stream::iter(header)
            .chain(body)
            .map(|chunk| chunk.map(|chunk| CopyData::new(bytes::Bytes::from(chunk))));
        Ok(Response::CopyOut(CopyResponse::new(
            0,
            schema.fields().len(),
            data,
        )))
    }
}

/// Whether a statement's answer is read whole before it is sent, or may stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answers {
    Whole,
    MayStream,
}

impl Answers {
    /// `result` as this asks: a whole answer is read now, while pgwire still listens for a
    /// cancel.
    async fn read(
        self,
        result: tessera_sql::error::Result<StatementOutput>,
    ) -> tessera_sql::error::Result<StatementOutput> {
        match result {
            Ok(output) if self == Answers::Whole => tessera_sql::answer::collected(output).await,
            other => other,
        }
    }
}

/// The connection's cancel handle, which pgwire keeps among the session's extensions.
fn connection_handle<C: ClientInfo>(client: &C) -> Option<Arc<pgwire::api::ConnectionHandle>> {
    client
        .session_extensions()
        .get::<Arc<pgwire::api::ConnectionHandle>>()
        .map(|handle| Arc::clone(&*handle))
}

/// `schema.table` or `table` as the engine names tables (schemas are not separate).
fn object_name(name: &datafusion::sql::sqlparser::ast::ObjectName) -> String {
    name.0
        .last()
        .and_then(|part| part.as_ident())
        .map_or_else(|| name.to_string(), |ident| ident.value.clone())
}

#[async_trait]
impl CopyHandler for PgSession {
    async fn on_copy_data<C>(&self, _client: &mut C, copy_data: CopyData) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let mut copy = self.copy_in.lock().expect("copy lock");
        let Some(pending) = copy.as_mut() else {
            return Err(user_error(
                "08P01",
                "CopyData with no COPY FROM STDIN under way",
            ));
        };
        if pending.data.len() + copy_data.data.len() > MAX_COPY_BYTES {
            let table = copy.take().expect("pending copy").table;
            return Err(user_error(
                "54000",
                format!("COPY into {table:?} sent more than {MAX_COPY_BYTES} bytes; split it into several COPYs"),
            ));
        }
        pending.data.extend_from_slice(&copy_data.data);
        Ok(())
    }

    async fn on_copy_done<C>(&self, client: &mut C, _done: CopyDone) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let pending = self.copy_in.lock().expect("copy lock").take();
        let Some(pending) = pending else {
            return Err(user_error(
                "08P01",
                "CopyDone with no COPY FROM STDIN under way",
            ));
        };
        let batch = pending
            .format
            .decode(&pending.data, &pending.columns, &pending.schema)?;
        let (rows, _epoch) = self
            .engine
            .insert_rows(&pending.table, vec![batch])
            .await
            .map_err(sql_error)?;
        client
            .send(PgWireBackendMessage::CommandComplete(
                Tag::new("COPY").with_rows(rows).into(),
            ))
            .await?;
        Ok(())
    }

    async fn on_copy_fail<C>(&self, _client: &mut C, fail: CopyFail) -> PgWireError
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let table = self
            .copy_in
            .lock()
            .expect("copy lock")
            .take()
            .map(|c| c.table);
        user_error(
            "57014",
            format!(
                "COPY into {:?} failed on the client's side, nothing was written: {}",
                table.unwrap_or_default(),
                fail.message
            ),
        )
    }
}

#[async_trait]
impl SimpleQueryHandler for PgSession {
    async fn on_query<C>(&self, client: &mut C, query: Query) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        crate::execute::on_query(self, client, query).await
    }

    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let commands = self.parser.parse_commands(query)?;
        if commands.is_empty() {
            return Ok(vec![Response::EmptyQuery]);
        }
        let mut responses = Vec::with_capacity(commands.len());
        let count = commands.len();
        for (i, command) in commands.into_iter().enumerate() {
            // Only the last statement's answer may stream: an earlier one's query would
            // still run beside the next statement.
            let answers = if i + 1 < count {
                Answers::Whole
            } else {
                Answers::MayStream
            };
            match self
                .run(client, command, None, &Format::UnifiedText, answers)
                .await
            {
                Ok(response) => responses.push(response),
                // What ran before the failed statement is reported; the rest never runs.
                Err(error) if !responses.is_empty() => {
                    responses.push(Response::Error(Box::new(ErrorInfo::from(error))));
                    break;
                }
                Err(error) => return Err(error),
            }
        }
        Ok(responses)
    }
}

#[async_trait]
impl ExtendedQueryHandler for PgSession {
    type Statement = PgStatement;
    type QueryParser = PgParser;

    fn query_parser(&self) -> Arc<PgParser> {
        self.parser.clone()
    }

    async fn on_execute<C>(&self, client: &mut C, message: Execute) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = PgStatement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        crate::execute::on_execute(self, client, message).await
    }

    async fn do_query<C>(
        &self,
        client: &mut C,
        portal: &Portal<PgStatement>,
        _max_rows: usize,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = PgStatement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let statement = &portal.statement.statement;
        let inferred: Vec<Option<&DataType>> =
            statement.parameters.iter().map(Option::as_ref).collect();
        let params = arrow_pg::datatypes::df::deserialize_parameters(portal, &inferred)?;
        let params = (portal.parameter_len() > 0).then_some(params);
        self.run(
            client,
            statement.command.clone(),
            params.as_ref(),
            &portal.result_column_format,
            Answers::MayStream,
        )
        .await
    }
}
