//! The initiator's copy of its queries' lineage (fate-sharing, as an object's owner keeps
//! its lineage in Ray's ownership model): every node logs the reading order of its
//! inboxes to the initiator of their query, and its output waits for the initiator's
//! acknowledgement instead of a Raft round.
//!
//! A query's lineage is needed only while its initiator runs it: if the initiator dies the
//! query fails whatever is logged, and if another node dies the initiator rebuilds that
//! node's channels from what it holds. So the initiator's memory is as durable as the
//! lineage needs to be, and one round trip to it replaces an fsynced Raft write on a
//! majority (about 10 ms on a busy machine, paid by the last output of every stage).
//!
//! Fencing: once the initiator starts rebuilding a dead node's channels it takes that
//! node's reading orders and refuses any stretch from it that arrives later, so what it
//! replays is exactly what the dead node could have been told was logged.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use tessera_common::{ChannelId, NodeId, StageId};
use tessera_exec::QueryId;
use tessera_meta::{InboxLineage, LineageEntry, QueryLineage};

/// Flight action a node sends its query's initiator: `(node, entries)`, the stretches of
/// reading order its inboxes read since its last round.
pub const ACTION_LOG_LINEAGE: &str = "log-lineage";

/// Flight action a node sends its query's initiator: `(node, (query, exchange, channel))`,
/// before anything of that producer channel leaves the node.
pub const ACTION_LOG_OUTPUT: &str = "log-output";

/// One running query's lineage, as its initiator holds it.
struct HeldQuery {
    lineage: QueryLineage,
    /// Nodes whose channels were rebuilt: nothing more from them is taken.
    fenced: BTreeSet<NodeId>,
    /// Producer channels whose output may have left their node, by the node running them.
    sending: BTreeSet<(NodeId, StageId, ChannelId)>,
}

/// What a dead node had logged when it was fenced out of a query.
#[derive(Debug, Default)]
pub struct Fenced {
    /// The reading orders of its inboxes.
    pub inboxes: Vec<InboxLineage>,
    /// Its producer channels whose output may have reached someone; the others gave
    /// nobody anything.
    pub sending: BTreeSet<(StageId, ChannelId)>,
}

/// The lineage of the queries this node initiates, while they run.
#[derive(Default)]
pub struct HeldLineage {
    queries: Mutex<HashMap<QueryId, HeldQuery>>,
}

impl HeldLineage {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<QueryId, HeldQuery>> {
        self.queries.lock().expect("held lineage lock")
    }

    /// `query` starts here, initiated by `initiator` (this node): its lineage is taken from
    /// now on. Called before any of its channels runs.
    pub fn begin(&self, query: QueryId, initiator: NodeId) {
        self.lock().entry(query).or_insert_with(|| HeldQuery {
            lineage: QueryLineage {
                initiator,
                inboxes: Vec::new(),
            },
            fenced: BTreeSet::new(),
            sending: BTreeSet::new(),
        });
    }

    /// Appends `node`'s stretches of reading order. Refused, naming why, for a query this
    /// node does not run (it ended, or it is not its initiator), from a fenced node, or
    /// with a gap: the sender's output then never leaves it.
    pub fn append(&self, node: NodeId, entries: &[LineageEntry]) -> Result<(), String> {
        let mut queries = self.lock();
        for entry in entries {
            let Some(held) = queries.get_mut(&entry.query) else {
                return Err(format!(
                    "query {} is not running with this node as its initiator (it ended, or node {node} sent its lineage to the wrong node)",
                    entry.query
                ));
            };
            if held.fenced.contains(&node) {
                return Err(format!(
                    "node {node} was declared failed and its channels of query {} rebuilt: its lineage is no longer taken",
                    entry.query
                ));
            }
            held.lineage.append(node, entry)?;
        }
        Ok(())
    }

    /// Records that producer channel `channel` of `exchange`, on `node`, starts sending:
    /// refused, naming why, for a query not running here or from a fenced node (whose
    /// output then never leaves it).
    pub fn output_starts(
        &self,
        node: NodeId,
        query: QueryId,
        exchange: StageId,
        channel: ChannelId,
    ) -> Result<(), String> {
        let mut queries = self.lock();
        let Some(held) = queries.get_mut(&query) else {
            return Err(format!(
                "query {query} is not running with this node as its initiator (it ended, or node {node} sent to the wrong node)"
            ));
        };
        if held.fenced.contains(&node) {
            return Err(format!(
                "node {node} was declared failed and its channels of query {query} rebuilt: its output is no longer taken"
            ));
        }
        held.sending.insert((node, exchange, channel));
        Ok(())
    }

    /// Fences `dead` out of `query` and returns what it logged.
    pub fn fence(&self, query: QueryId, dead: NodeId) -> Fenced {
        let mut queries = self.lock();
        let Some(held) = queries.get_mut(&query) else {
            tracing::debug!(%query, "no lineage held");
            return Fenced::default();
        };
        held.fenced.insert(dead);
        let logged: Vec<InboxLineage> = held
            .lineage
            .inboxes
            .iter()
            .filter(|inbox| inbox.node == dead)
            .cloned()
            .collect();
        let sending = held
            .sending
            .iter()
            .filter(|(node, _, _)| *node == dead)
            .map(|&(_, exchange, channel)| (exchange, channel))
            .collect();
        tracing::debug!(%query, dead = dead.0, inboxes = logged.len(), held = held.lineage.inboxes.len(), "fenced a dead node's lineage");
        Fenced {
            inboxes: logged,
            sending,
        }
    }

    /// `query` ended: its lineage goes.
    pub fn end(&self, query: QueryId) {
        self.lock().remove(&query);
    }

    /// How many queries' lineage is held.
    #[cfg(test)]
    fn running(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_common::StageId;

    fn entry(query: u64, bucket: usize, from: u64, runs: Vec<(u32, u32)>) -> LineageEntry {
        LineageEntry {
            query: QueryId(query),
            initiator: NodeId(1),
            exchange: StageId(2),
            bucket,
            from,
            runs,
        }
    }

    #[test]
    fn reading_orders_are_appended_in_stretches_and_retries_are_skipped() {
        let held = HeldLineage::default();
        held.begin(QueryId(7), NodeId(1));
        held.append(NodeId(2), &[entry(7, 0, 0, vec![(0, 2), (1, 1)])])
            .unwrap();
        // A retried round repeats what is held, then goes on.
        held.append(NodeId(2), &[entry(7, 0, 2, vec![(1, 1), (1, 2), (0, 1)])])
            .unwrap();
        held.append(NodeId(3), &[entry(7, 0, 0, vec![(2, 1)])])
            .unwrap();
        let logged = held.fence(QueryId(7), NodeId(2)).inboxes;
        assert_eq!(logged.len(), 1, "only node 2's inbox: {logged:?}");
        assert_eq!(logged[0].runs, vec![(0, 2), (1, 3), (0, 1)]);
        assert_eq!(logged[0].batches, 6);
    }

    #[test]
    fn gaps_unknown_queries_and_fenced_nodes_are_refused() {
        let held = HeldLineage::default();
        held.begin(QueryId(7), NodeId(1));
        let gap = held
            .append(NodeId(2), &[entry(7, 0, 3, vec![(0, 1)])])
            .unwrap_err();
        assert!(gap.contains("continues at batch 3"), "{gap}");
        let unknown = held
            .append(NodeId(2), &[entry(8, 0, 0, vec![(0, 1)])])
            .unwrap_err();
        assert!(unknown.contains("query"), "{unknown}");
        held.append(NodeId(2), &[entry(7, 0, 0, vec![(0, 1)])])
            .unwrap();
        held.fence(QueryId(7), NodeId(2));
        let fenced = held
            .append(NodeId(2), &[entry(7, 0, 1, vec![(0, 1)])])
            .unwrap_err();
        assert!(fenced.contains("declared failed"), "{fenced}");
        assert_eq!(
            held.fence(QueryId(7), NodeId(2)).inboxes[0].batches,
            1,
            "nothing taken after the fence"
        );
        held.end(QueryId(7));
        assert_eq!(held.running(), 0);
        assert!(held
            .output_starts(NodeId(3), QueryId(7), StageId(1), ChannelId(0))
            .is_err());
        assert!(held
            .append(NodeId(3), &[entry(7, 0, 0, vec![(0, 1)])])
            .is_err());
    }

    #[test]
    fn channels_that_started_sending_are_told_apart_from_those_that_did_not() {
        let held = HeldLineage::default();
        held.begin(QueryId(7), NodeId(1));
        held.output_starts(NodeId(2), QueryId(7), StageId(1), ChannelId(1))
            .unwrap();
        held.output_starts(NodeId(3), QueryId(7), StageId(1), ChannelId(2))
            .unwrap();
        held.output_starts(NodeId(2), QueryId(7), StageId(2), ChannelId(1))
            .unwrap();
        let fenced = held.fence(QueryId(7), NodeId(2));
        assert_eq!(
            fenced.sending.into_iter().collect::<Vec<_>>(),
            vec![(StageId(1), ChannelId(1)), (StageId(2), ChannelId(1))],
            "node 2's channels only"
        );
        let refused = held
            .output_starts(NodeId(2), QueryId(7), StageId(3), ChannelId(1))
            .unwrap_err();
        assert!(refused.contains("declared failed"), "{refused}");
        assert!(
            !held
                .fence(QueryId(7), NodeId(2))
                .sending
                .contains(&(StageId(3), ChannelId(1))),
            "nothing taken after the fence"
        );
        assert!(held
            .output_starts(NodeId(2), QueryId(8), StageId(1), ChannelId(1))
            .unwrap_err()
            .contains("not running"));
    }
}
