//! Errors as PostgreSQL clients expect them: a severity, a SQLSTATE code drivers branch on,
//! and one message that says what went wrong once.

use pgwire::error::{ErrorInfo, PgWireError};
use tessera_sql::SqlError;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

pub(crate) fn user_error(code: &str, message: impl Into<String>) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        code.to_string(),
        message.into(),
    )))
}

/// An engine error, with its SQLSTATE.
pub(crate) fn sql_error(error: SqlError) -> PgWireError {
    user_error(error.sqlstate(), tessera_sql::error::one_message(&error))
}

/// A statement refused because an earlier one failed inside the open transaction.
pub(crate) fn transaction_aborted() -> PgWireError {
    user_error(
        "25P02",
        "current transaction is aborted, commands ignored until end of transaction block",
    )
}

/// Tells a client over the connection limit so, in the protocol's own error message
/// (libpq shows it whether it sent a start-up packet or an SSL request), then closes.
pub(crate) async fn refuse_connection(mut socket: TcpStream, limit: usize) {
    let mut fields = Vec::new();
    for (tag, value) in [
        (b'S', "FATAL".to_string()),
        (b'V', "FATAL".to_string()),
        (b'C', "53300".to_string()),
        (
            b'M',
            format!("sorry, too many clients already (the limit is {limit} connections)"),
        ),
    ] {
        fields.push(tag);
        fields.extend_from_slice(value.as_bytes());
        fields.push(0);
    }
    fields.push(0);
    let mut message = vec![b'E'];
    message.extend_from_slice(&((fields.len() + 4) as u32).to_be_bytes());
    message.extend_from_slice(&fields);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
        let _ = socket.write_all(&message).await;
        let _ = socket.shutdown().await;
    })
    .await;
}
