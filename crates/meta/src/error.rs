//! Why a metadata read or write did not happen, naming the node or epoch at fault.

use crate::NodeId;
use tessera_common::Epoch;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum MetaError {
    #[error("no metadata leader is known yet; the cluster may still be electing one (a majority of voters must be up)")]
    NoLeader,
    /// A node not yet in the metadata group asked every configured peer, and none took the
    /// request: each one's reason.
    #[error(
        "this node is not in the metadata group yet, and no configured peer took its request: {0}"
    )]
    NoPeerAnswered(String),
    /// A read that must be current could not be proven so: no leader confirmed an index
    /// this node then applied, in time. The read is refused, not answered from a view that
    /// may miss acknowledged epochs.
    #[error("node {node} cannot prove its metadata is current ({reason}); it refuses rather than answer from a view that may be stale")]
    NotCurrent { node: NodeId, reason: String },
    #[error("this node does not lead the metadata group (leader: {0:?})")]
    NotLeader(Option<NodeId>),
    /// A write was waiting on a leader that has since lost its lead (another node was
    /// elected, or this node was deposed): it is retried at the new one. The entry the old
    /// leader logged commits only if that node leads again with it, so callers retry
    /// idempotently, as after any write whose outcome is unknown.
    #[error("node {was} stopped leading the metadata group before the write was answered (leader now: {now:?})")]
    LeaderChanged { was: NodeId, now: Option<NodeId> },
    /// The metadata knows no address for a node (it never joined, or was retired).
    #[error("node {node} has no known address in the metadata or the configuration")]
    NoAddress { node: NodeId },
    /// A node asked to take a metadata write (the leader, or a peer a joining node asks)
    /// did not answer.
    #[error("node {node} ({addr}), asked to write metadata, is unreachable: {reason}")]
    Unreachable {
        node: NodeId,
        addr: String,
        reason: String,
    },
    #[error("metadata: {0}")]
    Raft(String),
    /// The state machine refused the command; the state is unchanged.
    #[error("{0}")]
    Refused(String),
    /// A table is leased to another writer; retrying later may succeed.
    #[error("{0}")]
    TableBusy(String),
    /// A table changed after the statement behind a publish read it: the statement must
    /// run again (see `AllocateEpoch::read_at`).
    #[error("write conflict: {0}")]
    WriteConflict(String),
    /// This node was declared failed, and may not take an epoch until it is alive again.
    #[error("this node was declared failed: {0}")]
    Fenced(String),
    #[error(
        "node {node} has not yet learnt that epoch {epoch} is visible (it sees epoch {visible})"
    )]
    EpochNotVisible {
        node: NodeId,
        epoch: Epoch,
        visible: Epoch,
    },
    #[error(
        "node {node} has not yet applied the creation of table {table:?} (metadata log index {generation}; it has applied up to {applied})"
    )]
    TableNotApplied {
        node: NodeId,
        table: String,
        generation: u64,
        applied: u64,
    },
    #[error("the metadata leader could not confirm its leadership for a linearizable read: {0}")]
    ReadIndex(String),
}

impl MetaError {
    pub fn raft(error: impl std::fmt::Display) -> MetaError {
        MetaError::Raft(error.to_string())
    }
}

pub type Result<T, E = MetaError> = std::result::Result<T, E>;
