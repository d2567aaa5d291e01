//! One PostgreSQL connection: its engine (settings, open transaction) and the two query
//! protocols over it.
//!
//! Simple queries run each statement in turn and stop at the first error. The extended
//! protocol plans a statement when it is parsed (so Describe can name its parameter and
//! result types) and runs it at Execute with the bound values; pgwire keeps prepared
//! statements and portals (and suspends a portal at its row limit).

use crate::errors::{sql_error, transaction_aborted, user_error};
use crate::results::{command_response, fields, response};
use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::common::ParamValues;
use datafusion::logical_expr::LogicalPlan;
use datafusion::sql::parser::Statement as DFStatement;
use datafusion::sql::sqlparser::ast::Statement;
use datafusion_pg_catalog::sql::PostgresCompatibilityParser;
use futures::{Sink, SinkExt};
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{FieldInfo, Response};
use pgwire::api::stmt::QueryParser;
use pgwire::api::store::PortalStore;
use pgwire::api::{ClientInfo, ClientPortalStore, Type};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::response::{NoticeResponse, TransactionStatus};
use pgwire::messages::PgWireBackendMessage;
use pgwire::types::format::FormatOptions;
use std::fmt::Debug;
use std::sync::Arc;
use tessera_sql::engine::MAX_SQL_BYTES;
use tessera_sql::Engine;

/// A statement as parsed (and planned) at Parse, kept under its name until closed.
#[derive(Debug, Clone)]
pub struct PgStatement {
    statement: Statement,
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
        let sql = tessera_sql::time_travel::rewrite_as_of_epoch(sql).map_err(sql_error)?;
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
        let mut statements = self.parse(sql)?;
        let statement = match statements.len() {
            0 => return Ok(None),
            1 => statements.pop().expect("one statement"),
            _ => {
                return Err(user_error(
                    "42601",
                    "cannot insert multiple commands into a prepared statement",
                ))
            }
        };
        if tessera_sql::engine::is_transaction_control(&statement) {
            return Ok(Some(PgStatement {
                statement,
                parameters: Vec::new(),
                result: None,
            }));
        }
        let plan = self
            .engine
            .plan_only(DFStatement::Statement(Box::new(statement.clone())))
            .await
            .map_err(sql_error)?;
        let parameters = parameter_types(&plan)?;
        let result = returns_rows(&plan).then(|| Arc::new(plan.schema().as_arrow().clone()));
        Ok(Some(PgStatement {
            statement,
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

/// The types of `$1..$n`, in order.
fn parameter_types(plan: &LogicalPlan) -> PgWireResult<Vec<Option<DataType>>> {
    let inferred = plan
        .get_parameter_types()
        .map_err(|e| sql_error(e.into()))?;
    let mut numbered: Vec<(usize, Option<DataType>)> = inferred
        .into_iter()
        .map(|(name, data_type)| {
            name.trim_start_matches('$')
                .parse::<usize>()
                .map(|n| (n, data_type))
                .map_err(|_| user_error("42P02", format!("parameter {name} is not of the form $n")))
        })
        .collect::<PgWireResult<_>>()?;
    numbered.sort_by_key(|(n, _)| *n);
    let count = numbered.last().map_or(0, |(n, _)| *n);
    let mut types = vec![None; count];
    for (n, data_type) in numbered {
        types[n - 1] = data_type;
    }
    Ok(types)
}

/// Whether a plan answers with rows (a query, EXPLAIN, SHOW) rather than a command tag.
fn returns_rows(plan: &LogicalPlan) -> bool {
    !matches!(
        plan,
        LogicalPlan::Dml(_)
            | LogicalPlan::Ddl(_)
            | LogicalPlan::Statement(_)
            | LogicalPlan::Copy(_)
    )
}

/// One connection's session.
pub struct PgSession {
    engine: Arc<Engine>,
    parser: Arc<PgParser>,
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
        }
    }

    /// Runs one statement and sends the notices it raised (a query that survived a node's
    /// death says how) ahead of its result.
    async fn run<C>(
        &self,
        client: &mut C,
        statement: Statement,
        params: Option<&ParamValues>,
        format: &Format,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
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
        let result = self
            .engine
            .execute_parsed(DFStatement::Statement(Box::new(statement)), params)
            .await;
        for message in self.engine.backend().take_notices() {
            let notice = ErrorInfo::new("NOTICE".to_string(), "01000".to_string(), message);
            client
                .feed(PgWireBackendMessage::NoticeResponse(NoticeResponse::from(
                    notice,
                )))
                .await?;
        }
        let options = Arc::new(FormatOptions::from_client_metadata(client.metadata()));
        response(result.map_err(sql_error)?, format, options)
    }
}

#[async_trait]
impl SimpleQueryHandler for PgSession {
    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let statements = self.parser.parse(query)?;
        if statements.is_empty() {
            return Ok(vec![Response::EmptyQuery]);
        }
        let mut responses = Vec::with_capacity(statements.len());
        for statement in statements {
            match self
                .run(client, statement, None, &Format::UnifiedText)
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
            statement.statement.clone(),
            params.as_ref(),
            &portal.result_column_format,
        )
        .await
    }
}
