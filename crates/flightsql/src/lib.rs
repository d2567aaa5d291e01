//! Arrow Flight SQL in front of Tessera's SQL engine, on its own port (`flightsql_listen`):
//! what ADBC's Flight SQL driver and the Flight SQL JDBC driver call. Results go out as
//! Arrow, with DataFusion's view types in their plain forms (see `plain_types`).
//!
//! Every request outside a transaction gets a fresh [`tessera_sql::Engine`] from a
//! [`Sessions`] source (the node's runs over the cluster: distributed, `AS OF EPOCH`,
//! lineage recovery), so Flight SQL answers exactly what `tessera sql` and PostgreSQL
//! clients answer. A statement's handle and ticket carry its SQL text (and bound values,
//! and transaction id: see [`handle`]): any node can serve a ticket outside a transaction,
//! and nothing but open transactions (`transactions.rs`) is kept between requests.
//!
//! Supported: queries (`GetFlightInfo` + `DoGet`), prepared statements (ADBC prepares every
//! query) with parameters, `?` or `$n`, bound by `DoPut` (an update bound to several rows
//! runs them as one transaction, one epoch), updates (`DoPut` with a statement: INSERT,
//! UPDATE, DELETE, DDL), bulk ingest into an existing table (`DoPut` with
//! `CommandStatementIngest`, one epoch), transactions (`BeginTransaction`,
//! `EndTransaction`), catalogs, schemas, tables and `SqlInfo`.

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionBeginTransactionRequest, ActionBeginTransactionResult,
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, ActionEndTransactionRequest, Any, CommandGetCatalogs,
    CommandGetDbSchemas, CommandGetSqlInfo, CommandGetTables, CommandPreparedStatementQuery,
    CommandPreparedStatementUpdate, CommandStatementIngest, CommandStatementQuery,
    CommandStatementUpdate, DoPutPreparedStatementResult, ProstMessageExt, SqlInfo,
    TicketStatementQuery,
};
use arrow_flight::{
    Action, FlightDescriptor, FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse,
    IpcMessage, SchemaAsIpc, Ticket,
};
use datafusion::physical_plan::SendableRecordBatchStream;
use futures::{Stream, StreamExt, TryStreamExt};
use prost::Message;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use tessera_sql::{Engine, SqlError, StatementOutput};
use tonic::{Request, Response, Status, Streaming};

pub use tessera_sql::Sessions;

mod connections;
mod handle;
mod login;
mod transactions;

use handle::Handle;

/// The largest message a client may send or receive (a bulk ingest's batches).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The catalog and schema every table is in.
const CATALOG: &str = "tessera";
const SCHEMA: &str = "public";

/// Serves Flight SQL on `listener` until the task is dropped, to at most `max_connections`
/// connections at once; over TLS only, with `tls` (certificate chain and key, PEM).
pub async fn serve(
    listener: tokio::net::TcpListener,
    sessions: Arc<dyn Sessions>,
    max_connections: usize,
    tls: Option<(Vec<u8>, Vec<u8>)>,
) {
    let logins = Arc::new(login::Logins::new(sessions.clone()));
    let service = FlightServiceServer::new(TesseraFlightSql {
        sessions,
        logins: logins.clone(),
        transactions: Default::default(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let incoming = connections::bounded(listener, max_connections);
    let require_login = tower::layer::layer_fn(move |inner| login::RequireLogin {
        inner,
        logins: logins.clone(),
    });
    let mut server = tonic::transport::Server::builder();
    if let Some((cert, key)) = tls {
        let identity = tonic::transport::Identity::from_pem(cert, key);
        let config = tonic::transport::ServerTlsConfig::new().identity(identity);
        server = match server.tls_config(config) {
            Ok(server) => server,
            Err(error) => {
                tracing::error!(%error, "the Flight SQL port's TLS identity is unusable; not serving");
                return;
            }
        };
    }
    if let Err(error) = server
        .layer(require_login)
        .add_service(service)
        .serve_with_incoming(incoming)
        .await
    {
        tracing::error!(%error, "the Flight SQL port stopped");
    }
}

struct TesseraFlightSql {
    sessions: Arc<dyn Sessions>,
    logins: Arc<login::Logins>,
    transactions: transactions::Transactions,
}

static SQL_INFO: LazyLock<SqlInfoData> = LazyLock::new(|| {
    let mut builder = SqlInfoDataBuilder::new();
    builder.append(SqlInfo::FlightSqlServerName, "Tessera");
    builder.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    // The Arrow IPC format version (Schema.fbs MetadataVersion V5 is 1.3).
    builder.append(SqlInfo::FlightSqlServerArrowVersion, "1.3");
    builder.append(SqlInfo::FlightSqlServerReadOnly, false);
    // SqlSupportedTransaction::Transaction: BeginTransaction/EndTransaction, no savepoints.
    builder.append(SqlInfo::FlightSqlServerTransaction, 1_i32);
    builder.build().expect("static SqlInfo")
});

/// An engine error as a gRPC status, said once, with a code a client can branch on.
fn status(error: SqlError) -> Status {
    let message = tessera_sql::error::one_message(&error);
    match error.sqlstate() {
        // The cluster could not run it now: retry.
        "40001" => Status::unavailable(message),
        code if code.starts_with("42") || code.starts_with("22") || code.starts_with("0A") => {
            Status::invalid_argument(message)
        }
        code if code.starts_with("23") => Status::already_exists(message),
        "54000" => Status::resource_exhausted(message),
        _ => Status::internal(message),
    }
}

/// A FlightInfo whose one endpoint's ticket is `ticket`, served by this node (no location:
/// the client asks the server it asked).
fn flight_info(
    schema: &Schema,
    ticket: Vec<u8>,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo, Status> {
    Ok(FlightInfo::new()
        .try_with_schema(&plain_types(schema))
        .map_err(|e| Status::internal(format!("encoding the schema: {e}")))?
        .with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(ticket)))
        .with_descriptor(descriptor))
}

/// The FlightInfo of a metadata command: its result's columns, and a ticket that is the
/// command itself.
fn command_info(
    schema: &Schema,
    command: &impl ProstMessageExt,
    request: Request<FlightDescriptor>,
) -> Result<Response<FlightInfo>, Status> {
    let info = flight_info(
        schema,
        command.as_any().encode_to_vec(),
        request.into_inner(),
    )?;
    Ok(Response::new(info))
}

/// A metadata answer: one built batch, streamed.
fn one_batch<E: std::fmt::Display>(
    schema: SchemaRef,
    batch: Result<RecordBatch, E>,
) -> Result<Response<FlightDataStream>, Status> {
    let batch = batch.map_err(|e| Status::internal(e.to_string()))?;
    Ok(Response::new(stream_batches(
        tessera_sql::answer::stream_of(schema, vec![batch]),
    )))
}

type FlightDataStream =
    Pin<Box<dyn Stream<Item = Result<arrow_flight::FlightData, Status>> + Send + 'static>>;

/// The answer of a command, or of a ticket whose command already ran: no columns, no rows.
fn empty_stream() -> FlightDataStream {
    stream_batches(tessera_sql::answer::stream_of(
        Arc::new(Schema::empty()),
        Vec::new(),
    ))
}

fn stream_batches(answer: SendableRecordBatchStream) -> FlightDataStream {
    let schema = plain_types(&answer.schema());
    let encoder = FlightDataEncoderBuilder::new().with_schema(schema.clone());
    let batches = answer.map(move |batch| {
        let batch = batch.map_err(|error| {
            FlightError::Tonic(Box::new(status(tessera_sql::error::from_datafusion(error))))
        })?;
        let columns = batch
            .columns()
            .iter()
            .zip(schema.fields())
            .map(|(column, field)| arrow::compute::cast(column, field.data_type()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RecordBatch::try_new(schema.clone(), columns)?)
    });
    Box::pin(encoder.build(batches).map_err(Status::from))
}

/// `schema` with the string and binary view types DataFusion computes with in their plain
/// forms (`Utf8View` as `Utf8`, the type a `VARCHAR` column is declared with): what every
/// Flight SQL client reads (the Flight SQL JDBC driver refuses view types).
fn plain_types(schema: &Schema) -> SchemaRef {
    use arrow::datatypes::{DataType, Field};
    let plain = |field: &arrow::datatypes::FieldRef| -> arrow::datatypes::FieldRef {
        match field.data_type() {
            DataType::Utf8View => Arc::new(Field::clone(field).with_data_type(DataType::Utf8)),
            DataType::BinaryView => Arc::new(Field::clone(field).with_data_type(DataType::Binary)),
            _ => field.clone(),
        }
    };
    Arc::new(Schema::new_with_metadata(
        schema.fields().iter().map(plain).collect::<Vec<_>>(),
        schema.metadata().clone(),
    ))
}

/// The batches a client sent with a `DoPut`, decoded.
async fn put_batches(
    request: Request<PeekableFlightDataStream>,
    what: &str,
) -> Result<Vec<RecordBatch>, Status> {
    arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
        request
            .into_inner()
            .map_err(|e| arrow_flight::error::FlightError::Tonic(Box::new(e))),
    )
    .try_collect()
    .await
    .map_err(|e| Status::invalid_argument(format!("reading {what}: {e}")))
}

/// A prepared statement's handle and the rows of parameter values a `DoPut` sent for it
/// (with their count).
async fn bound_rows(
    handle: &[u8],
    request: Request<PeekableFlightDataStream>,
) -> Result<(Handle, Vec<RecordBatch>, usize), Status> {
    let handle = Handle::decode(handle)?;
    let batches = put_batches(request, "the bound parameters").await?;
    let rows = batches.iter().map(|b| b.num_rows()).sum();
    Ok((handle, batches, rows))
}

/// The values of a bound handle's parameters.
fn bound_values(params: &RecordBatch) -> Result<datafusion::common::ParamValues, Status> {
    tessera_sql::params::row_values(params, 0, params.num_columns()).map_err(status)
}

/// "INSERT 3", "DELETE 0", "CREATE TABLE": the count, or 0 for a command without one, as
/// JDBC's `executeUpdate` answers for DDL. (Flight SQL allows -1, "unknown", but the Flight
/// SQL JDBC driver takes -1 for a query and fetches its results: it would run the command
/// a second time.)
fn affected_rows(output: &StatementOutput) -> i64 {
    match output {
        StatementOutput::Done { tag, .. } => tessera_sql::engine::split_tag(tag)
            .1
            .map_or(0, |rows| rows as i64),
        StatementOutput::Rows { batches, .. } => batches.iter().map(|b| b.num_rows() as i64).sum(),
        // A statement run for its count only: its answer is read whole first.
        StatementOutput::Streaming { .. } => unreachable!("affected_rows of a whole answer"),
    }
}

impl TesseraFlightSql {
    /// A fresh engine, acting as the user the call logged in as.
    fn open_engine(&self) -> Engine {
        let engine = self.sessions.open();
        engine.act_as(login::logged_in());
        engine
    }

    /// The session a statement runs in: its transaction's, or a fresh one.
    fn engine(&self, transaction: Option<&[u8]>) -> Result<Arc<Engine>, Status> {
        match transaction {
            Some(id) if !id.is_empty() => self.transactions.get(id),
            _ => Ok(Arc::new(self.open_engine())),
        }
    }

    /// Runs a statement's handle (one statement, with its bound values if it has some, in
    /// its transaction if it has one) and returns what it answered, read whole.
    async fn run(&self, handle: &Handle) -> Result<StatementOutput, Status> {
        let output = self.run_streaming(handle).await?;
        tessera_sql::answer::collected(output).await.map_err(status)
    }

    /// [`Self::run`], but an answer larger than the session's answer buffer streams.
    async fn run_streaming(&self, handle: &Handle) -> Result<StatementOutput, Status> {
        let engine = self.engine(handle.transaction.as_deref())?;
        match &handle.params {
            Some(params) => engine
                .execute_with(&handle.sql, &bound_values(params)?)
                .await
                .map_err(status),
            None => engine
                .execute_streaming(&handle.sql)
                .await
                .map_err(status)?
                .pop()
                .ok_or_else(|| Status::invalid_argument("no statement given")),
        }
    }

    /// Runs a statement's handle and streams its rows.
    async fn query(&self, handle: &Handle) -> Result<Response<FlightDataStream>, Status> {
        match self.run_streaming(handle).await?.into_rows() {
            Ok((_, answer)) => Ok(Response::new(stream_batches(answer))),
            Err(_) => Ok(Response::new(empty_stream())),
        }
    }

    /// A statement's columns (with its bound values, if any); a command (DDL, DML) runs
    /// now, as clients that only ask for its FlightInfo expect, and has none.
    async fn describe_or_run(&self, handle: &Handle) -> Result<SchemaRef, Status> {
        let engine = self.engine(handle.transaction.as_deref())?;
        let values = handle.params.as_ref().map(bound_values).transpose()?;
        match engine
            .describe_with(&handle.sql, values.as_ref())
            .await
            .map_err(status)?
            .0
        {
            Some(schema) => Ok(schema),
            None => {
                self.run(handle).await?;
                Ok(Arc::new(Schema::empty()))
            }
        }
    }

    fn table_names(&self) -> Vec<String> {
        let engine = self.open_engine();
        let mut names = engine
            .session()
            .catalog(CATALOG)
            .and_then(|c| c.schema(SCHEMA))
            .map(|s| s.table_names())
            .unwrap_or_default();
        names.sort();
        names
    }
}

#[tonic::async_trait]
impl FlightSqlService for TesseraFlightSql {
    type FlightService = TesseraFlightSql;

    /// Logs in with the `authorization: Basic ...` header; the answer's `authorization`
    /// header carries the bearer token later calls need (none while the cluster has no
    /// users).
    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<
        Response<Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>>,
        Status,
    > {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok());
        let token = self.logins.handshake(authorization)?;
        let response = HandshakeResponse {
            protocol_version: 0,
            payload: token.clone().unwrap_or_default().into(),
        };
        let mut response = Response::new(Box::pin(futures::stream::once(async { Ok(response) }))
            as Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>);
        if let Some(token) = token {
            let bearer = format!("Bearer {token}")
                .parse()
                .expect("a hex token is a valid header value");
            response.metadata_mut().insert("authorization", bearer);
        }
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let handle = Handle::new(query.query, query.transaction_id.map(|id| id.to_vec()));
        let schema = self.describe_or_run(&handle).await?;
        // A command has run already: its ticket fetches nothing.
        let handle = if schema.fields().is_empty() {
            Vec::new()
        } else {
            handle.encode()?
        };
        let ticket = TicketStatementQuery {
            statement_handle: handle.into(),
        };
        let info = flight_info(
            &schema,
            ticket.as_any().encode_to_vec(),
            request.into_inner(),
        )?;
        Ok(Response::new(info))
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        _request: Request<Ticket>,
    ) -> Result<Response<FlightDataStream>, Status> {
        if ticket.statement_handle.is_empty() {
            return Ok(Response::new(empty_stream()));
        }
        self.query(&Handle::decode(&ticket.statement_handle)?).await
    }

    /// The handle is the statement's SQL, its `?` placeholders numbered `$1..$n`; the
    /// parameter schema names them so, typed as planned (`Null` where the statement leaves
    /// a type open: the bound value's type is taken).
    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        _request: Request<Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        let sql = tessera_sql::params::number_question_marks(&query.query).map_err(status)?;
        let transaction = query.transaction_id.map(|id| id.to_vec());
        let (schema, parameters) = self
            .engine(transaction.as_deref())?
            .describe_with(&sql, None)
            .await
            .map_err(status)?;
        let ipc = |schema: &Schema| -> Result<prost::bytes::Bytes, Status> {
            let IpcMessage(bytes) = SchemaAsIpc::new(schema, &IpcWriteOptions::default())
                .try_into()
                .map_err(|e: arrow::error::ArrowError| Status::internal(e.to_string()))?;
            Ok(bytes)
        };
        let dataset_schema = ipc(&plain_types(
            &schema.unwrap_or_else(|| Arc::new(Schema::empty())),
        ))?;
        let parameter_schema = if parameters.is_empty() {
            Default::default()
        } else {
            ipc(&Schema::new(
                parameters
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        arrow::datatypes::Field::new(
                            format!("${}", i + 1),
                            t.clone().unwrap_or(arrow::datatypes::DataType::Null),
                            true,
                        )
                    })
                    .collect::<Vec<_>>(),
            ))?
        };
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: Handle::new(sql, transaction).encode()?.into(),
            dataset_schema,
            parameter_schema,
        })
    }

    /// Binds one row of values to a prepared query: the answer is a new handle carrying
    /// them (checked against the statement's parameters now, not at execution).
    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        let (handle, batches, rows) = bound_rows(&query.prepared_statement_handle, request).await?;
        if rows != 1 {
            return Err(Status::invalid_argument(format!(
                "a prepared query binds one row of parameters; {rows} were sent"
            )));
        }
        let params = batches
            .into_iter()
            .find(|b| b.num_rows() == 1)
            .expect("one row");
        let engine = self.engine(handle.transaction.as_deref())?;
        let (_, parameters) = engine
            .describe_with(&handle.sql, None)
            .await
            .map_err(status)?;
        let values =
            tessera_sql::params::row_values(&params, 0, parameters.len()).map_err(status)?;
        engine
            .describe_with(&handle.sql, Some(&values))
            .await
            .map_err(status)?;
        let bound = Handle {
            params: Some(params),
            ..handle
        };
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(bound.encode()?.into()),
        })
    }

    /// Runs a prepared update once per row of values sent (once, with none, for a
    /// statement without parameters); several rows run as one transaction: one epoch, all
    /// or nothing.
    async fn do_put_prepared_statement_update(
        &self,
        query: CommandPreparedStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let (handle, batches, rows) = bound_rows(&query.prepared_statement_handle, request).await?;
        if rows == 0 {
            return Ok(affected_rows(&self.run(&handle).await?));
        }
        let sql = &handle.sql;
        let engine = self.engine(handle.transaction.as_deref())?;
        let (_, parameters) = engine.describe_with(sql, None).await.map_err(status)?;
        // Inside the client's transaction the rows join it; otherwise they are one.
        let several = rows > 1 && handle.transaction.is_none();
        if several {
            engine.execute("BEGIN").await.map_err(status)?;
        }
        let mut affected = 0;
        let mut each = async || -> Result<(), Status> {
            for batch in &batches {
                for row in 0..batch.num_rows() {
                    let values = tessera_sql::params::row_values(batch, row, parameters.len())
                        .map_err(status)?;
                    let output = engine.execute_with(sql, &values).await.map_err(status)?;
                    affected += affected_rows(&output).max(0);
                }
            }
            Ok(())
        };
        let ran = each().await;
        if several {
            let end = if ran.is_ok() { "COMMIT" } else { "ROLLBACK" };
            let ended = engine.execute(end).await.map_err(status);
            ran?;
            ended?;
        } else {
            ran?;
        }
        Ok(affected)
    }

    /// Opens a transaction on this node: an engine session inside `BEGIN` (see
    /// `transactions.rs`), whose id the client's statements then carry.
    async fn do_action_begin_transaction(
        &self,
        _query: ActionBeginTransactionRequest,
        _request: Request<Action>,
    ) -> Result<ActionBeginTransactionResult, Status> {
        let engine = self.open_engine();
        engine.execute("BEGIN").await.map_err(status)?;
        let id = self.transactions.begin(engine)?;
        Ok(ActionBeginTransactionResult {
            transaction_id: id.into(),
        })
    }

    /// Commits the transaction's writes as one epoch, or rolls them back.
    async fn do_action_end_transaction(
        &self,
        query: ActionEndTransactionRequest,
        _request: Request<Action>,
    ) -> Result<(), Status> {
        use arrow_flight::sql::EndTransaction;
        let end = match EndTransaction::try_from(query.action) {
            Ok(EndTransaction::Commit) => "COMMIT",
            Ok(EndTransaction::Rollback) => "ROLLBACK",
            _ => {
                return Err(Status::invalid_argument(format!(
                    "EndTransaction needs COMMIT or ROLLBACK, got {}",
                    query.action
                )))
            }
        };
        let engine = self.transactions.end(&query.transaction_id)?;
        engine.execute(end).await.map_err(status)?;
        Ok(())
    }

    async fn do_action_close_prepared_statement(
        &self,
        _query: ActionClosePreparedStatementRequest,
        _request: Request<Action>,
    ) -> Result<(), Status> {
        // Nothing is kept for a prepared statement: its handle is its SQL.
        Ok(())
    }

    async fn get_flight_info_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let handle = Handle::decode(&query.prepared_statement_handle)?;
        let schema = self.describe_or_run(&handle).await?;
        let ticket = if schema.fields().is_empty() {
            // A command has run already: its ticket fetches nothing.
            TicketStatementQuery::default().as_any().encode_to_vec()
        } else {
            query.as_any().encode_to_vec()
        };
        let info = flight_info(&schema, ticket, request.into_inner())?;
        Ok(Response::new(info))
    }

    async fn do_get_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        _request: Request<Ticket>,
    ) -> Result<Response<FlightDataStream>, Status> {
        self.query(&Handle::decode(&query.prepared_statement_handle)?)
            .await
    }

    async fn do_put_statement_update(
        &self,
        update: CommandStatementUpdate,
        _request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let handle = Handle::new(update.query, update.transaction_id.map(|id| id.to_vec()));
        Ok(affected_rows(&self.run(&handle).await?))
    }

    /// Bulk ingest: the batches are inserted into an existing table as one statement (one
    /// epoch); keys already present are refused and nothing is written.
    async fn do_put_statement_ingest(
        &self,
        ingest: CommandStatementIngest,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let batches = put_batches(request, "the ingested batches").await?;
        let engine = self.engine(ingest.transaction_id.as_deref())?;
        let table = ingest.table;
        let def = engine.backend().table_def(&table).ok_or_else(|| {
            Status::not_found(format!("table {table:?} does not exist; create it first"))
        })?;
        let target = def.schema_ref();
        let batches = batches
            .into_iter()
            .map(|batch| {
                if batch.schema().fields().len() != target.fields().len() {
                    return Err(Status::invalid_argument(format!(
                        "ingest into {table:?}: {} columns, but the table has {}",
                        batch.schema().fields().len(),
                        target.fields().len()
                    )));
                }
                let columns = batch
                    .columns()
                    .iter()
                    .zip(target.fields())
                    .map(|(column, field)| {
                        arrow::compute::cast(column, field.data_type()).map_err(|e| {
                            Status::invalid_argument(format!(
                                "ingest into {table:?}, column {:?}: {e}",
                                field.name()
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, Status>>()?;
                RecordBatch::try_new(target.clone(), columns)
                    .map_err(|e| Status::invalid_argument(format!("ingest into {table:?}: {e}")))
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let (rows, _) = engine.insert_rows(&table, batches).await.map_err(status)?;
        Ok(rows as i64)
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        command_info(&query.clone().into_builder().schema(), &query, request)
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        _request: Request<Ticket>,
    ) -> Result<Response<FlightDataStream>, Status> {
        let mut builder = query.into_builder();
        builder.append(CATALOG);
        one_batch(builder.schema(), builder.build())
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        command_info(&query.clone().into_builder().schema(), &query, request)
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        _request: Request<Ticket>,
    ) -> Result<Response<FlightDataStream>, Status> {
        let mut builder = query.into_builder();
        builder.append(CATALOG, SCHEMA);
        one_batch(builder.schema(), builder.build())
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        command_info(&query.clone().into_builder().schema(), &query, request)
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        _request: Request<Ticket>,
    ) -> Result<Response<FlightDataStream>, Status> {
        let engine = self.open_engine();
        let mut builder = query.into_builder();
        for name in self.table_names() {
            let schema = engine
                .backend()
                .table_def(&name)
                .map(|def| def.schema_ref())
                .unwrap_or_else(|| Arc::new(Schema::empty()));
            builder
                .append(CATALOG, SCHEMA, &name, "TABLE", &schema)
                .map_err(Status::from)?;
        }
        one_batch(builder.schema(), builder.build())
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        command_info(
            &query.clone().into_builder(&SQL_INFO).schema(),
            &query,
            request,
        )
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        _request: Request<Ticket>,
    ) -> Result<Response<FlightDataStream>, Status> {
        let builder = query.into_builder(&SQL_INFO);
        one_batch(builder.schema(), builder.build())
    }

    async fn do_get_fallback(
        &self,
        _request: Request<Ticket>,
        message: Any,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        Err(Status::unimplemented(format!(
            "Flight SQL ticket {} is not supported",
            message.type_url
        )))
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}
