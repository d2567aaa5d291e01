//! Errors of the cluster layer, each naming the node, address or setting at fault.

use tessera_common::NodeId;
use tessera_storage::StorageError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClusterError {
    #[error(transparent)]
    Config(#[from] tessera_common::ConfigError),
    #[error("cannot listen on {addr}: {reason}")]
    Listen { addr: String, reason: String },
    #[error("node {node} at {addr} belongs to cluster {theirs:?}, but this node is configured for cluster {ours:?}")]
    WrongCluster {
        node: NodeId,
        addr: String,
        ours: String,
        theirs: String,
    },
    #[error("node {node} at {addr} speaks protocol version {theirs}, this node speaks version {ours}; run the same Tessera release on every node")]
    VersionMismatch {
        node: NodeId,
        addr: String,
        ours: u32,
        theirs: u32,
    },
    #[error("the address {addr} answers as node {theirs}, but the configuration says node {expected} is there")]
    WrongNode {
        addr: String,
        expected: NodeId,
        theirs: NodeId,
    },
    /// The client ports' TLS certificate or key cannot be used.
    #[error("TLS: {0}")]
    Tls(String),
    #[error("data directory {dir}: {reason}")]
    DataDir { dir: String, reason: String },
    /// The data directory is new, but the cluster knows this node as one that ran before:
    /// its data (rows, metadata log, votes) is gone.
    #[error("data directory {dir} is new, but node {peer} knows node {node} as a member that has run before (process {incarnation}): its data is gone, a wiped or replaced disk. Starting it empty would answer queries without the rows it held and could confuse the metadata group, so it does not start. Bring it back empty with `tessera node --config ... --replace`: the cluster then forgets what it held and copies its partitions to it from the other replicas")]
    DataLost {
        dir: String,
        node: NodeId,
        peer: NodeId,
        incarnation: u64,
    },
    /// A client could not reach the node it was given (whose id it does not know).
    #[error("the node at {addr} is unreachable: {reason}")]
    AddressUnreachable { addr: String, reason: String },
    #[error("node {node} ({addr}) is unreachable: {reason}")]
    Unreachable {
        node: NodeId,
        addr: String,
        reason: String,
    },
    /// The metadata group could not read or write (no leader, a refused command, a
    /// fenced node, a busy table).
    #[error(transparent)]
    Meta(#[from] tessera_meta::MetaError),
    /// A call to another node failed.
    #[error("{0}")]
    Call(#[from] tessera_net::CallError),
    /// A publish whose epoch was aborted: nothing of it is visible; it may be retried.
    #[error("{detail}")]
    PublishAborted {
        epoch: tessera_common::Epoch,
        detail: String,
    },
    /// A node answered with something this client cannot read.
    #[error("node at {addr} sent undecodable {what}: {reason}")]
    Undecodable {
        addr: String,
        what: &'static str,
        reason: String,
    },
    /// A statement answered with another kind of output than the caller asked for.
    #[error("expected {expected}, got {got}")]
    UnexpectedOutput { expected: &'static str, got: String },
    #[error("no table {table:?}")]
    UnknownTable { table: String },
    /// Only non-voting nodes can leave: a voter's departure would change the quorum.
    #[error(
        "node {node} votes in the metadata group; only non-voting nodes can be decommissioned"
    )]
    VoterCannotLeave { node: NodeId },
    /// A task of this node's failed (panicked or was cancelled).
    #[error("{what} failed: {reason}")]
    Task { what: &'static str, reason: String },
    /// Distributed execution failed (a node lost under a query, a plan that cannot run).
    #[error(transparent)]
    Exec(#[from] tessera_exec::ExecError),
    /// A replication protocol step failed (a publish aborted, a copy refused, ...).
    #[error(transparent)]
    Replication(#[from] tessera_replication::ReplicationError),
    #[error("{0}")]
    Storage(#[from] StorageError),
    #[error("{0}")]
    Arrow(#[from] arrow::error::ArrowError),
    #[error("{0}")]
    Sql(#[from] tessera_sql::SqlError),
}

impl ClusterError {
    pub fn raft(error: impl std::fmt::Display) -> ClusterError {
        ClusterError::Meta(tessera_meta::MetaError::raft(error))
    }
}

impl From<ClusterError> for tessera_sql::SqlError {
    fn from(error: ClusterError) -> Self {
        match error {
            ClusterError::Storage(e) => tessera_sql::SqlError::Storage(e),
            ClusterError::Sql(e) => e,
            ClusterError::Exec(e) => e.into(),
            // The metadata refused a user's command for want of a right: not a failure
            // that a retry could get past.
            ClusterError::Meta(tessera_meta::MetaError::Refused(reason))
            | ClusterError::Replication(tessera_replication::ReplicationError::Meta(
                tessera_meta::MetaError::Refused(reason),
            )) if reason.starts_with(tessera_meta::DENIED) => {
                tessera_sql::SqlError::PermissionDenied(reason)
            }
            ClusterError::Replication(
                committed @ tessera_replication::ReplicationError::CommittedNotVisible { .. },
            ) => tessera_sql::SqlError::CommittedNotVisible(committed.to_string()),
            other => tessera_sql::SqlError::Cluster(other.to_string()),
        }
    }
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A client branches on the SQLSTATE: a retry after 40001 is safe, after 08007 (the
    /// publish committed, its visibility did not come in time) it would write twice.
    #[test]
    fn a_committed_but_unseen_publish_is_not_a_retryable_failure() {
        let committed =
            ClusterError::Replication(tessera_replication::ReplicationError::CommittedNotVisible {
                epoch: tessera_common::Epoch(9),
                undecided: tessera_common::Epoch(8),
                waited: std::time::Duration::from_secs(30),
            });
        let error = tessera_sql::SqlError::from(committed);
        assert_eq!(error.sqlstate(), "08007", "{error}");
        assert!(
            error.to_string().contains("epoch 9 is committed"),
            "{error}"
        );
        let aborted = ClusterError::Replication(tessera_replication::ReplicationError::Aborted {
            epoch: tessera_common::Epoch(9),
            reason: "a primary was lost".into(),
        });
        assert_eq!(tessera_sql::SqlError::from(aborted).sqlstate(), "40001");
    }
}
