//! Why a replication protocol step failed, naming the node, epoch or partition at fault.

use crate::NodeId;
use tessera_common::Epoch;
use tessera_meta::MetaError;
use tessera_net::CallError;
use tessera_storage::StorageError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ReplicationError {
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error("{0}")]
    Storage(#[from] StorageError),
    #[error("{0}")]
    Arrow(#[from] arrow::error::ArrowError),
    #[error("epoch {epoch} aborted: {reason}")]
    Aborted { epoch: Epoch, reason: String },
    #[error("epoch {epoch} could not commit: {reason}")]
    CommitRefused { epoch: Epoch, reason: String },
    /// The commit could not be confirmed either way, twice: the metadata leader was out of
    /// reach. The epoch was given up, so it is visible only if the commit got through.
    #[error("the commit of epoch {epoch} was not confirmed ({reason}): it is visible only if it got through; if not, the metadata leader aborts it on this node's next heartbeat, and the rows may be published again")]
    CommitUnknown { epoch: Epoch, reason: String },
    /// The publish needs a signature this node cannot make (see [`crate::seal`]).
    #[error("{0}")]
    Unsignable(String),
    #[error("epoch {epoch} is committed and will not be lost, but is not yet visible after {waited:?}: epoch {undecided} below it is still open; it becomes visible once that one is committed or aborted")]
    CommittedNotVisible {
        epoch: Epoch,
        undecided: Epoch,
        waited: std::time::Duration,
    },
    #[error("epoch {epoch} aborted: node {node}, a primary logging its rows, was lost: {reason}")]
    PrimaryLost {
        node: NodeId,
        epoch: Epoch,
        reason: String,
    },
    /// A primary the cluster counts alive made no progress logging an epoch's rows (a hung
    /// disk): the publish goes again without it, which then misses the epoch.
    #[error("epoch {epoch} aborted: node {node}, a primary logging its rows, made no progress: {reason}")]
    PrimaryStalled {
        node: NodeId,
        epoch: Epoch,
        reason: String,
    },
    #[error("partition {partition} has too few live replicas holding every committed epoch ({current:?} of {replicas:?}); a publish needs {needed} (replicas.min_copies), so it takes no writes until another replica returns or catches up")]
    TooFewCopies {
        partition: tessera_common::PartitionId,
        replicas: Vec<NodeId>,
        current: Vec<NodeId>,
        needed: usize,
    },
    /// Every replica a publish could still use made no progress on it and was left out of
    /// its retry (a hung disk, a node starved of memory): the partition itself is fine.
    #[error("partition {partition}: replicas {stalled:?} made no progress on this publish for failure.progress_timeout_ms and were left out of its retry, and the replicas left ({current:?}) are fewer than the {needed} a publish needs (replicas.min_copies); the publish is refused, and the partition takes writes again as soon as they make progress")]
    StalledCopies {
        partition: tessera_common::PartitionId,
        stalled: Vec<NodeId>,
        current: Vec<NodeId>,
        needed: usize,
    },
    #[error("partition {partition} has no readable replica to copy from")]
    NoReadableReplica {
        partition: tessera_common::PartitionId,
    },
    /// Another node answered a request of this protocol with a refusal.
    #[error("node {node} refused {what}: {reason}")]
    Refused {
        node: NodeId,
        what: &'static str,
        reason: String,
    },
    #[error("node {node} ({addr}) is unreachable: {reason}")]
    Unreachable {
        node: NodeId,
        addr: String,
        reason: String,
    },
    /// Copying a partition from another replica failed.
    #[error("copy from node {from}: {reason}")]
    Copy { from: NodeId, reason: String },
    /// A partition copy into this node that fetched and installed nothing for
    /// `failure.progress_timeout_ms` (a hung disk, a source that stopped sending).
    #[error("the partition copy into node {node} made no progress for {stalled_s:.1} s (failure.progress_timeout_ms): given up, so the rebalance releases every table's lease; it is tried again later")]
    CopyStalled { node: NodeId, stalled_s: f64 },
    /// A prepare stream that is not what log shipping sends.
    #[error("malformed prepare stream: {0}")]
    BadPrepare(String),
    /// A table named by a request is not (or not yet) on this node in that generation.
    #[error("table {table:?} generation {generation} is unknown on node {node}")]
    UnknownTable {
        table: String,
        generation: u64,
        node: NodeId,
    },
    /// Local work handed to a blocking thread did not finish (it panicked or was cancelled).
    #[error("{what} did not finish: {reason}")]
    Task { what: &'static str, reason: String },
    #[error("{0}")]
    Call(#[from] CallError),
}

impl ReplicationError {
    /// A blocking task's failure to finish.
    pub fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> ReplicationError {
        move |error| ReplicationError::Task {
            what,
            reason: error.to_string(),
        }
    }
}

pub type Result<T, E = ReplicationError> = std::result::Result<T, E>;

/// Why a prepare call to another node brought back no reply.
#[derive(Debug, thiserror::Error)]
pub enum PrepareFailed {
    #[error(transparent)]
    Call(#[from] tessera_net::CallError),
    /// The node, alive to the cluster, made no progress for `failure.progress_timeout_ms`.
    #[error("node {peer} made no progress on {what} of epoch {epoch} for {stalled_s:.1} s (failure.progress_timeout_ms)")]
    Stalled {
        peer: NodeId,
        what: &'static str,
        epoch: Epoch,
        stalled_s: f64,
    },
}

impl PrepareFailed {
    /// Whether the node is to be counted unreachable (rather than having refused).
    pub fn is_transport(&self) -> bool {
        match self {
            PrepareFailed::Call(error) => error.is_transport(),
            PrepareFailed::Stalled { .. } => true,
        }
    }
}
