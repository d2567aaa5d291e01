//! Peers this node could not reach although the metadata leader still counts them alive: a
//! partial partition (this node is cut from a peer that the leader, and so the rest of the
//! cluster, still reaches). Such a peer is not failed over, so its partitions keep it as
//! primary; queries started here place their channels on other replicas of its partitions
//! for a while instead of failing on it again and again.

use crate::NodeId;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a peer found unreachable is kept out of this node's query plans. Long enough
/// for the leader to decide (a peer that is really down is failed over well within it),
/// short enough that a healed link is used again soon.
pub const UNREACHABLE_MEMORY: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub struct Unreachable {
    since: Mutex<BTreeMap<NodeId, Instant>>,
}

impl Unreachable {
    /// Remembers that `peer` did not answer this node although the leader counts it alive.
    pub fn note(&self, peer: NodeId) {
        self.since.lock().unwrap().insert(peer, Instant::now());
    }

    /// The peers noted within the last [`UNREACHABLE_MEMORY`].
    pub fn current(&self) -> BTreeSet<NodeId> {
        let mut since = self.since.lock().unwrap();
        since.retain(|_, at| at.elapsed() < UNREACHABLE_MEMORY);
        since.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_noted_peer_is_current_until_its_memory_runs_out() {
        let unreachable = Unreachable::default();
        assert!(unreachable.current().is_empty());
        unreachable.note(NodeId(2));
        assert_eq!(unreachable.current(), BTreeSet::from([NodeId(2)]));
        unreachable
            .since
            .lock()
            .unwrap()
            .insert(NodeId(2), Instant::now() - UNREACHABLE_MEMORY);
        assert!(
            unreachable.current().is_empty(),
            "forgotten after the memory"
        );
    }
}
