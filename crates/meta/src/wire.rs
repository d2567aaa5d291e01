//! The metadata's requests between nodes (Flight actions), and what they carry.

use crate::NodeId;
use serde::{Deserialize, Serialize};

pub const ACTION_RAFT_APPEND: &str = "raft-append";
pub const ACTION_RAFT_VOTE: &str = "raft-vote";
pub const ACTION_RAFT_SNAPSHOT: &str = "raft-snapshot";
/// A [`crate::MetaCommand`] for the leader to write; answered `Result<MetaResponse, Refusal>`.
pub const ACTION_META_WRITE: &str = "meta-write";
/// The leader's commit index, once it has confirmed it still leads (a read index).
pub const ACTION_READ_INDEX: &str = "read-index";
/// A node's [`Heartbeat`] to the leader, with the nodes it suspects.
pub const ACTION_HEARTBEAT: &str = "heartbeat";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Heartbeat {
    pub node_id: NodeId,
    /// The open epochs this node is still coordinating (a long publish or partition copy):
    /// the leader renews their open-epoch timeout. An epoch its coordinator gave up on is
    /// not listed, and times out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub working_on: Vec<tessera_common::Epoch>,
    /// The requests of the epoch allocations this node has sent and not yet heard back
    /// from (`MetaCommand::AllocateEpoch::request`): the epoch each opens is being worked
    /// on before the node knows its number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allocating: Vec<u64>,
    /// The metadata log index this node had applied when it listed the two above (read
    /// before them). An open epoch of this node allocated at or below it, listed in
    /// neither, is one the node has given up on: the leader aborts it at once. Zero (a
    /// node that does not say) proves nothing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub applied_index: u64,
}

fn is_zero(index: &u64) -> bool {
    *index == 0
}
