//! Errors a user, a peer or a disk can cause. Broken invariants panic instead.

use std::path::PathBuf;
use tessera_common::{ComponentHash, Epoch, PartitionId, PartitioningError};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StorageError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("Arrow error: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    #[error("Parquet error in {path}: {source}")]
    Parquet {
        path: PathBuf,
        source: parquet::errors::ParquetError,
    },
    #[error("table {0:?} does not exist")]
    UnknownTable(String),
    #[error("table {table:?} has no partition {partition} (it has {partitions})")]
    UnknownPartition {
        table: String,
        partition: PartitionId,
        partitions: usize,
    },
    /// A statement's rows were computed from what it read of a table that changed since:
    /// publishing them would lose that change (see `Store::publish_read_at`).
    #[error("write conflict: table {table:?} changed at epoch {changed}, after the statement read it at epoch {read}; run the statement again")]
    WriteConflict {
        table: String,
        read: Epoch,
        changed: Epoch,
    },
    #[error("partition {partition} of table {table:?} still holds epochs {epochs:?} prepared here and not yet decided; copied versions may include them, so the copy waits until this node has applied their outcome")]
    UndecidedEpochs {
        table: String,
        partition: PartitionId,
        epochs: Vec<Epoch>,
    },
    #[error("a copy of partition {partition} of table {table:?} made for the rebalance at epoch {fence} arrived after it: this node already holds epoch {newest} there (the rebalance was aborted and writes went on), so the copy's older versions are not installed")]
    CopyOutdated {
        table: String,
        partition: PartitionId,
        fence: Epoch,
        newest: Epoch,
    },
    #[error("rows of epoch {epoch} for partition {partition} of table {table:?} arrived after this node was copied every version through epoch {complete_through} there (the prepare was held up past its coordinator's deadline); they are not logged")]
    LatePrepare {
        table: String,
        partition: PartitionId,
        epoch: Epoch,
        complete_through: Epoch,
    },
    #[error("prepared rows shipped from their partition's primary are malformed: {0}")]
    MalformedRows(String),
    #[error("table {0:?} already exists")]
    TableExists(String),
    #[error("invalid table definition for {table:?}: {reason}")]
    InvalidTable { table: String, reason: String },
    #[error("batch for table {table:?} does not match its schema: {reason}")]
    SchemaMismatch { table: String, reason: String },
    #[error("before images of table {table:?} were sent without the epoch the table was read at: they could not be checked against changes made since that read")]
    UncheckedBeforeImages { table: String },
    #[error("duplicate primary key {key} in one publish to table {table:?}")]
    DuplicateKey { table: String, key: String },
    #[error("rows of table {table:?} sent to partition {sent_to} belong to partition {belongs_to}: the sender's partition map disagrees with this node's hash")]
    MisroutedRows {
        table: String,
        sent_to: PartitionId,
        belongs_to: PartitionId,
    },
    #[error("table {table:?} is append-only: {reason}")]
    AppendOnly { table: String, reason: String },
    #[error("{0}")]
    Partitioning(#[from] PartitioningError),
    #[error("publish of {bytes} bytes exceeds the limit of {limit} bytes (max_publish_bytes); split it into several publishes")]
    PublishTooLarge { bytes: usize, limit: usize },
    #[error("epoch {requested} is not visible yet: the visible epoch is {visible}")]
    EpochNotVisible { requested: Epoch, visible: Epoch },
    #[error("epoch {requested} of table {table:?} is no longer retained: versions older than epoch {retained_from} may have been merged away")]
    EpochNotRetained {
        table: String,
        requested: Epoch,
        retained_from: Epoch,
    },
    #[error(
        "epoch {epoch} was already decided here when these prepared rows arrived; they are refused"
    )]
    PrepareAfterDecision { epoch: Epoch },
    #[error("partition {partition} of table {table:?} cannot give the versions since epoch {since}: its retention horizon is epoch {horizon}, so some may have been merged away; copy the partition whole")]
    DeltaBeyondRetention {
        table: String,
        partition: PartitionId,
        since: Epoch,
        horizon: Epoch,
    },
    #[error("a diff runs from an older epoch to a newer one, not from epoch {from} to epoch {to}")]
    BackwardDiff { from: Epoch, to: Epoch },
    /// A point in a local store's history that does not exist, or a tag that cannot be
    /// made (see [`crate::history`]).
    #[error(transparent)]
    History(#[from] crate::history::HistoryRefusal),
    #[error("component {hash} is corrupt: {path} hashes to {actual}; the file's bytes do not match its name")]
    CorruptComponent {
        hash: ComponentHash,
        path: PathBuf,
        actual: ComponentHash,
    },
    #[error("component {hash} is missing: {path} does not exist")]
    MissingComponent { hash: ComponentHash, path: PathBuf },
    #[error("archive fragment {hash} is corrupt: {path} hashes to {actual}; the file's bytes do not match its name")]
    CorruptFragment {
        hash: ComponentHash,
        path: PathBuf,
        actual: ComponentHash,
    },
    #[error("archive fragment {hash} is missing: {path} does not exist")]
    MissingFragment { hash: ComponentHash, path: PathBuf },
    #[error("archive: {0}")]
    Archive(String),
    #[error("write-ahead log {path} is corrupt at byte {offset}: {reason}; valid records follow, so this is not a torn tail and recovery stops rather than lose acknowledged epochs")]
    CorruptLog {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("checkpoint {path} is unreadable: {reason}")]
    CorruptCheckpoint { path: PathBuf, reason: String },
    #[error("data directory {path} is in use by another Tessera process (lock held)")]
    Locked { path: PathBuf },
    #[error("the store stopped accepting writes after an I/O error ({0}); restart the node to recover from disk")]
    Poisoned(String),
}

impl StorageError {
    /// A delete aimed at an append-only table.
    pub fn delete_from_append_only(table: &str) -> StorageError {
        StorageError::AppendOnly {
            table: table.to_string(),
            reason: "rows cannot be deleted from an append-only table".into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> StorageError {
        StorageError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = StorageError> = std::result::Result<T, E>;
