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
    #[error("{0}")]
    Constraint(String),
    /// A failure of the cluster: an unreachable node, a lost leader, an aborted epoch.
    #[error("{0}")]
    Cluster(String),
    #[error("SQL text of {bytes} bytes exceeds the limit of {limit} bytes")]
    TooLarge { bytes: usize, limit: usize },
}

impl SqlError {
    /// Wraps a storage error for DataFusion's trait boundaries, keeping its message intact.
    pub fn to_datafusion(error: StorageError) -> DataFusionError {
        DataFusionError::External(Box::new(error))
    }
}

/// Unwraps storage errors that crossed DataFusion so users see the storage message.
pub fn from_datafusion(error: DataFusionError) -> SqlError {
    match error {
        DataFusionError::External(inner) => match inner.downcast::<StorageError>() {
            Ok(storage) => SqlError::Storage(*storage),
            Err(other) => SqlError::DataFusion(DataFusionError::External(other)),
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
