//! Errors of the SQL layer, each naming what the user needs to fix.

use datafusion::error::DataFusionError;
use tessera_storage::StorageError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SqlError {
    #[error("{0}")]
    Storage(#[from] StorageError),
    #[error("{0}")]
    DataFusion(#[from] DataFusionError),
    #[error("{0}")]
    Arrow(#[from] arrow::error::ArrowError),
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A written row's key is taken (by another row of the table or of the statement).
    #[error("{0}")]
    DuplicateKey(String),
    /// A statement writes more rows than one statement may.
    #[error("statement writes {rows} rows, more than the limit of {limit}; use `tessera publish` for bulk loads")]
    TooManyRows { rows: usize, limit: usize },
    /// A failure of the cluster: an unreachable node, a lost leader, an aborted epoch.
    #[error("{0}")]
    Cluster(String),
    /// A table the statement (or transaction) read and then wrote changed in between: its
    /// rows would have overwritten that change unseen. Running it again reads the change.
    #[error("{0}")]
    WriteConflict(String),
    /// A publish committed (it will not be lost) but did not become visible in time.
    #[error("{0}")]
    CommittedNotVisible(String),
    #[error("SQL text of {bytes} bytes exceeds the limit of {limit} bytes")]
    TooLarge { bytes: usize, limit: usize },
    /// A statement Tessera parses itself (such as `CREATE USER`) is malformed.
    #[error("syntax error: {0}")]
    Syntax(String),
    /// The object (a user) exists already.
    #[error("{0}")]
    DuplicateObject(String),
    /// The object (a user) does not exist.
    #[error("{0}")]
    UndefinedObject(String),
    /// A statement's parameters are malformed, or bound values do not fit them.
    #[error("{0}")]
    UndefinedParameter(String),
    /// A value outside what it may be: a time-travel timestamp before the first epoch or
    /// in the future, an epoch that cannot be tagged.
    #[error("{0}")]
    InvalidValue(String),
    /// A date or time that does not parse.
    #[error("{0}")]
    InvalidDatetime(String),
    /// The user may not do this: it lacks the role, or another participant owns the table.
    #[error("{0}")]
    PermissionDenied(String),
    /// A query's error as the node that met it classified it (a channel that ran on
    /// another node: its error crossed the network as text and a SQLSTATE).
    #[error("{message}")]
    Query {
        sqlstate: &'static str,
        message: String,
    },
}

impl SqlError {
    /// Wraps a storage error for DataFusion's trait boundaries, keeping its message intact.
    pub fn to_datafusion(error: StorageError) -> DataFusionError {
        DataFusionError::External(Box::new(error))
    }

    /// Wraps this error for DataFusion's trait boundaries (a catalog lookup), so that
    /// [`from_datafusion`] gives it back as it was.
    pub fn into_datafusion(self) -> DataFusionError {
        match self {
            SqlError::Storage(storage) => Self::to_datafusion(storage),
            SqlError::DataFusion(error) => error,
            other => DataFusionError::External(Box::new(other)),
        }
    }
}

/// Unwraps storage errors that crossed DataFusion so users see the storage message.
pub fn from_datafusion(error: DataFusionError) -> SqlError {
    match error {
        DataFusionError::External(inner) => match inner.downcast::<StorageError>() {
            Ok(storage) => SqlError::Storage(*storage),
            Err(other) => match other.downcast::<SqlError>() {
                Ok(sql) => *sql,
                Err(other) => SqlError::DataFusion(DataFusionError::External(other)),
            },
        },
        DataFusionError::Context(context, inner) => match from_datafusion(*inner) {
            SqlError::DataFusion(inner) => {
                SqlError::DataFusion(DataFusionError::Context(context, Box::new(inner)))
            }
            storage => storage,
        },
        other => SqlError::DataFusion(other),
    }
}

pub type Result<T, E = SqlError> = std::result::Result<T, E>;

impl SqlError {
    /// The PostgreSQL error code (SQLSTATE) a client sees for this error: drivers and tools
    /// branch on these (a retry on 40001, "relation does not exist" on 42P01).
    pub fn sqlstate(&self) -> &'static str {
        match self {
            SqlError::Storage(storage) => storage_sqlstate(storage),
            SqlError::DataFusion(error) => datafusion_sqlstate(error),
            SqlError::Arrow(error) => arrow_sqlstate(error),
            SqlError::Unsupported(_) => "0A000",
            SqlError::DuplicateKey(_) => "23505",
            SqlError::TooManyRows { .. } => "54000",
            // Committed, but an acknowledgement also promises visibility, which did not come
            // in time: the client must look before it retries (a retry would write twice).
            SqlError::CommittedNotVisible(_) => "08007",
            // The cluster could not run the statement now (no leader, an aborted epoch, a
            // node out of reach): the client may retry, as after a serialization failure.
            SqlError::Cluster(_) => "40001",
            // PostgreSQL's serialization_failure: run the transaction again.
            SqlError::WriteConflict(_) => "40001",
            SqlError::TooLarge { .. } => "54000",
            SqlError::Syntax(_) => "42601",
            SqlError::DuplicateObject(_) => "42710",
            SqlError::UndefinedObject(_) => "42704",
            SqlError::UndefinedParameter(_) => "42P02",
            SqlError::InvalidValue(_) => "22023",
            SqlError::InvalidDatetime(_) => "22007",
            SqlError::PermissionDenied(_) => "42501",
            SqlError::Query { sqlstate, .. } => sqlstate,
        }
    }

    /// Whether the statement itself is at fault (bad data, a bad reference, a refusal), so
    /// that running it again, anywhere, fails the same way: no node's failure is to blame.
    pub fn is_statement_error(sqlstate: &str) -> bool {
        ["0A", "22", "23", "42", "53", "54"]
            .iter()
            .any(|class| sqlstate.starts_with(class))
    }
}

/// Every SQLSTATE this layer gives, so that one received as text (from another node) is
/// known again as the same code.
const SQLSTATES: &[&str] = &[
    "08007", "0A000", "22003", "22007", "22012", "22023", "22P02", "23502", "23505", "40001",
    "42000", "42501", "42601", "42702", "42703", "42704", "42710", "42804", "42883", "42P01",
    "42P02", "42P07", "42P16", "53200", "54000", "58030", "XX000", "XX001",
];

/// `code`, if it is a SQLSTATE this layer gives.
pub fn known_sqlstate(code: &str) -> Option<&'static str> {
    SQLSTATES.iter().copied().find(|known| *known == code)
}

fn storage_sqlstate(error: &StorageError) -> &'static str {
    match error {
        StorageError::UnknownTable(_) => "42P01",
        StorageError::TableExists(_) => "42P07",
        StorageError::InvalidTable { .. } => "42P16",
        StorageError::SchemaMismatch { reason, .. } if reason.contains("null") => "23502",
        StorageError::SchemaMismatch { .. } => "42804",
        StorageError::DuplicateKey { .. } => "23505",
        StorageError::AppendOnly { .. } => "0A000",
        StorageError::PublishTooLarge { .. } => "54000",
        StorageError::WriteConflict { .. } => "40001",
        StorageError::EpochNotVisible { .. } | StorageError::EpochNotRetained { .. } => "22023",
        StorageError::CorruptComponent { .. }
        | StorageError::MissingComponent { .. }
        | StorageError::CorruptLog { .. }
        | StorageError::CorruptCheckpoint { .. } => "XX001",
        StorageError::Io { .. } | StorageError::Poisoned(_) => "58030",
        _ => "XX000",
    }
}

fn arrow_sqlstate(error: &arrow::error::ArrowError) -> &'static str {
    use arrow::error::ArrowError;
    match error {
        ArrowError::DivideByZero => "22012",
        ArrowError::CastError(_) | ArrowError::ParseError(_) => "22P02",
        ArrowError::ComputeError(message) if message.contains("overflow") => "22003",
        _ => "XX000",
    }
}

fn datafusion_sqlstate(error: &DataFusionError) -> &'static str {
    use datafusion::common::SchemaError;
    match error {
        DataFusionError::SQL(..) => "42601",
        DataFusionError::SchemaError(error, _) => match error.as_ref() {
            SchemaError::FieldNotFound { .. } => "42703",
            SchemaError::AmbiguousReference { .. } => "42702",
            _ => "42P01",
        },
        DataFusionError::Plan(message)
            if message.contains("not found") && message.contains("table") =>
        {
            "42P01"
        }
        DataFusionError::Plan(message) if message.contains("does not exist") => "42P01",
        DataFusionError::Plan(message)
            if message.contains("No function matches") || message.contains("Invalid function") =>
        {
            "42883"
        }
        DataFusionError::Plan(_) => "42000",
        DataFusionError::NotImplemented(_) => "0A000",
        DataFusionError::ResourcesExhausted(_) => "53200",
        DataFusionError::ArrowError(error, _) => arrow_sqlstate(error),
        DataFusionError::Context(_, inner) | DataFusionError::Diagnostic(_, inner) => {
            datafusion_sqlstate(inner)
        }
        DataFusionError::Shared(inner) => datafusion_sqlstate(inner),
        DataFusionError::External(inner) => match inner.downcast_ref::<StorageError>() {
            Some(storage) => storage_sqlstate(storage),
            None => "XX000",
        },
        DataFusionError::Execution(message) if message.contains("Divide by zero") => "22012",
        DataFusionError::Execution(message) if message.contains("Cast error") => "22P02",
        _ => "XX000",
    }
}

/// The error as one message, each cause said once: DataFusion's category prefixes
/// ("Error during planning: ") and repeated context dropped.
pub fn one_message(error: &SqlError) -> String {
    match error {
        SqlError::DataFusion(error) => datafusion_message(error),
        other => other.to_string(),
    }
}

fn datafusion_message(error: &DataFusionError) -> String {
    match error {
        DataFusionError::Context(context, inner) => {
            let inner = datafusion_message(inner);
            if inner.contains(context.as_str()) {
                inner
            } else {
                format!("{context}: {inner}")
            }
        }
        DataFusionError::Diagnostic(_, inner) => datafusion_message(inner),
        DataFusionError::Shared(inner) => datafusion_message(inner),
        DataFusionError::External(inner) => inner.to_string(),
        DataFusionError::ArrowError(inner, _) => inner.to_string(),
        DataFusionError::SQL(inner, _) => inner.to_string(),
        other => other.message().trim().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::one_message;
    use crate::Engine;

    /// A code given here but missing from the list would reach a client as XX000 when its
    /// error was met on another node.
    #[test]
    fn every_sqlstate_given_is_known_again_as_text() {
        let source = include_str!("error.rs");
        let given: std::collections::BTreeSet<&str> = source
            .split("=> \"")
            .skip(1)
            .filter_map(|rest| rest.get(..6))
            .filter(|code| code.ends_with('"'))
            .map(|code| &code[..5])
            .collect();
        assert!(given.len() > 20, "{given:?}");
        for code in given {
            assert_eq!(
                super::known_sqlstate(code),
                Some(code),
                "{code} is not listed"
            );
        }
        assert_eq!(super::known_sqlstate("12345"), None);
    }

    /// What the engine itself raises reads as one message: no category prefix, no cause
    /// repeated.
    #[tokio::test]
    async fn engine_errors_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            tessera_storage::Store::open(dir.path(), tessera_storage::StoreConfig::default())
                .unwrap();
        let engine = Engine::new(store);
        for (sql, expected) in [
            (
                "SELECT * FROM nosuch",
                "table 'tessera.public.nosuch' not found",
            ),
            (
                "SELEC 1",
                "sql parser error: Expected: an SQL statement, found: SELEC at Line: 1, Column: 1",
            ),
            ("SELECT 1/0", "Divide by zero error"),
        ] {
            let error = engine.execute(sql).await.unwrap_err();
            assert_eq!(one_message(&error), expected, "{sql}: {error:?}");
        }
    }
}
