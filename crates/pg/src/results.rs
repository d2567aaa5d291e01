//! A statement's output as PostgreSQL sends it: rows described and encoded in the format
//! the client asked for (text, or binary per column), or a command tag.

use arrow::datatypes::Schema;
use arrow_pg::datatypes::{arrow_schema_to_pg_fields, encode_recordbatch};
use futures::stream::{self, StreamExt};
use pgwire::api::portal::Format;
use pgwire::api::results::{FieldInfo, QueryResponse, Response, Tag};
use pgwire::error::PgWireResult;
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

pub(crate) fn response(
    output: StatementOutput,
    format: &Format,
    options: Arc<FormatOptions>,
) -> PgWireResult<Response> {
    match output {
        StatementOutput::Rows { schema, batches } => {
            let fields = Arc::new(fields(&schema, format, options)?);
            let encoding = fields.clone();
            let rows = stream::iter(batches)
                .flat_map(move |batch| stream::iter(encode_recordbatch(encoding.clone(), batch)));
            Ok(Response::Query(QueryResponse::new(fields, rows)))
        }
        StatementOutput::Done { tag, .. } => Ok(command_response(&tag)),
    }
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
