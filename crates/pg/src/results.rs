//! A statement's output as PostgreSQL sends it: rows described and encoded in the format
//! the client asked for (text, or binary per column), or a command tag.

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
use arrow_pg::datatypes::{arrow_schema_to_pg_fields, encode_recordbatch};
use futures::stream::{self, Stream, StreamExt};
use pgwire::api::portal::Format;
use pgwire::api::results::{FieldInfo, QueryResponse, Response, Tag};
use pgwire::api::ConnectionHandle;
use pgwire::error::{PgWireError, PgWireResult};
use pgwire::types::format::FormatOptions;
use std::sync::Arc;
use tessera_sql::StatementOutput;

/// The columns of `schema` as a row description.
pub(crate) fn fields(
    schema: &Schema,
    format: &Format,
    options: Arc<FormatOptions>,
) -> PgWireResult<Vec<FieldInfo>> {
    arrow_schema_to_pg_fields(schema, format, Some(options))
}

/// `output` as PostgreSQL sends it. A streaming answer is still running while its rows go
/// out, so the connection's cancel request (`connection`) stops it there too.
pub(crate) fn response(
    output: StatementOutput,
    format: &Format,
    options: Arc<FormatOptions>,
    connection: Option<Arc<ConnectionHandle>>,
) -> PgWireResult<Response> {
    let (schema, answer) = match output.into_rows() {
        Ok(rows) => rows,
        Err((tag, _)) => return Ok(command_response(&tag)),
    };
    let fields = Arc::new(fields(&schema, format, options)?);
    let encoding = fields.clone();
    let batches = answer.map(|batch| {
        batch.map_err(|error| crate::errors::sql_error(tessera_sql::error::from_datafusion(error)))
    });
    let batches = match connection {
        Some(connection) => cancellable(batches, connection).left_stream(),
        None => batches.right_stream(),
    };
    // A streaming answer's error arrives after its first rows: PostgreSQL sends such an
    // error in place of the rest, as it does for one raised mid-scan.
    let rows = batches.flat_map(move |batch| match batch {
        Ok(batch) => stream::iter(encode_recordbatch(encoding.clone(), batch)).left_stream(),
        Err(error) => stream::iter([Err(error)]).right_stream(),
    });
    Ok(Response::Query(QueryResponse::new(fields, rows)))
}

/// `batches`, ended by the connection's cancel request. pgwire listens for a cancel only
/// while a statement runs (`do_query`), and the rows of a streaming answer are read after
/// that, while they are sent: so the answer listens itself from its first read (a fresh
/// listener, which pgwire's has then stopped using).
fn cancellable(
    batches: impl Stream<Item = PgWireResult<RecordBatch>> + Send + Unpin + 'static,
    connection: Arc<ConnectionHandle>,
) -> impl Stream<Item = PgWireResult<RecordBatch>> + Send + 'static {
    struct Reading<S> {
        batches: S,
        connection: Arc<ConnectionHandle>,
        cancel: Option<futures::channel::oneshot::Receiver<()>>,
        /// No cancel can come any more (the connection's listener went elsewhere).
        deaf: bool,
        over: bool,
    }
    let reading = Reading {
        batches,
        connection,
        cancel: None,
        deaf: false,
        over: false,
    };
    stream::unfold(reading, |mut reading| async move {
        if reading.over {
            return None;
        }
        if reading.cancel.is_none() && !reading.deaf {
            reading.cancel = Some(reading.connection.start_query().await);
        }
        let cancelled = async {
            match reading.cancel.as_mut() {
                Some(cancel) if !reading.deaf => cancel.await.is_ok(),
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            cancelled = cancelled => {
                if cancelled {
                    reading.over = true;
                    return Some((Err(PgWireError::QueryCanceled), reading));
                }
                reading.deaf = true;
                let next = reading.batches.next().await?;
                Some((next, reading))
            }
            next = reading.batches.next() => Some((next?, reading)),
        }
    })
}

/// The engine's tags ("INSERT 3", "CREATE TABLE AS 5", "BEGIN") as PostgreSQL's: INSERT
/// carries an OID of 0, CREATE TABLE AS reports SELECT with its row count, and the
/// transaction commands change the connection's transaction status.
pub(crate) fn command_response(tag: &str) -> Response {
    let (command, rows) = tessera_sql::engine::split_tag(tag);
    match (command, rows) {
        ("BEGIN", _) => Response::TransactionStart(Tag::new("BEGIN")),
        ("COMMIT", _) => Response::TransactionEnd(Tag::new("COMMIT")),
        ("ROLLBACK", _) => Response::TransactionEnd(Tag::new("ROLLBACK")),
        ("INSERT", Some(rows)) => {
            Response::Execution(Tag::new("INSERT").with_oid(0).with_rows(rows))
        }
        ("CREATE TABLE AS", Some(rows)) => Response::Execution(Tag::new("SELECT").with_rows(rows)),
        (command, Some(rows)) => Response::Execution(Tag::new(command).with_rows(rows)),
        (command, None) => Response::Execution(Tag::new(command)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag_of(response: Response) -> String {
        match response {
            Response::Execution(tag)
            | Response::TransactionStart(tag)
            | Response::TransactionEnd(tag) => {
                let message: pgwire::messages::response::CommandComplete = tag.into();
                message.tag
            }
            _ => panic!("not a command response"),
        }
    }

    #[test]
    fn tags_read_as_postgresql_writes_them() {
        assert_eq!(tag_of(command_response("INSERT 3")), "INSERT 0 3");
        assert_eq!(tag_of(command_response("UPDATE 0")), "UPDATE 0");
        assert_eq!(tag_of(command_response("CREATE TABLE AS 5")), "SELECT 5");
        assert_eq!(tag_of(command_response("CREATE TABLE")), "CREATE TABLE");
        assert!(matches!(
            command_response("BEGIN"),
            Response::TransactionStart(_)
        ));
        assert!(matches!(
            command_response("ROLLBACK"),
            Response::TransactionEnd(_)
        ));
    }
}
