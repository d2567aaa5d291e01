//! What `tessera status` and the console show of a node: its metadata view (the histories
//! cut to their newest entries), Raft's state, the rows it holds and what it copied.

use crate::meta::MetaState;
use crate::NodeId;
use serde::{Deserialize, Serialize};

/// What `tessera status` shows of one node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node_id: NodeId,
    pub listen: String,
    pub leader: Option<NodeId>,
    pub term: u64,
    pub applied_index: u64,
    /// The node's metadata, its histories cut to their newest entries (see
    /// [`HistorySizes`]).
    pub meta: MetaState,
    /// How long the histories are whole.
    #[serde(default)]
    pub history: HistorySizes,
    pub tables: Vec<TableCount>,
    /// What this node copied as a new or returning replica since it started.
    #[serde(default)]
    pub transfers: crate::rebalance::TransferCounts,
    /// Checkpoints this node's store wrote since it started: each writes and fsyncs every
    /// table's manifests, so work done in bulk (a returning replica's deltas) writes one,
    /// not one per partition.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub checkpoints_written: u64,
    /// The node's internal port is plaintext (`insecure = true`): anyone who reaches it
    /// can join, write metadata and read data.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
    /// The scrubber's last pass on this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scrub: Option<crate::scrub::ScrubReport>,
    /// The node's component cache (archived components; a compute node's reads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<tessera_exec::cache::CacheStatus>,
    /// The node's cache of decoded columns (absent from a node too old to report it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoded: Option<tessera_sql::decoded::DecodedUsage>,
    /// On the metadata leader: archives retention wants that could not be made yet, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub archive_waiting: Vec<String>,
    /// The metadata group's voters, as this node knows its membership (the other members
    /// are learners).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub voters: Vec<NodeId>,
    /// The metadata group is between two sets of voters (a membership change under way, or
    /// one a crashed leader left for the next to finish): both must agree to elect or write.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub membership_joint: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableCount {
    pub name: String,
    /// Committed rows this node holds, applied or not.
    pub rows: u64,
    /// Of `rows`, those a cold standby holds in its log only (not yet covered by
    /// components from their primary).
    #[serde(default)]
    pub logged_rows: u64,
    pub partitions_with_data: usize,
}

/// Entries of each history a status reply carries: the newest.
pub const STATUS_HISTORY: usize = 100;

/// How many epochs below the visible one a status looks through for recent aborts (which
/// the epoch log records by the epochs it lacks).
const ABORTS_LOOKED_BACK: u64 = 10_000;

/// How long the metadata's histories are (a status reply carries only the newest
/// [`STATUS_HISTORY`] entries of each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistorySizes {
    pub epochs: usize,
    pub aborted: usize,
    pub audited: usize,
}

impl HistorySizes {
    fn of(state: &MetaState) -> HistorySizes {
        HistorySizes {
            epochs: state.epoch_log.len(),
            aborted: state.aborted_count() as usize,
            audited: state.audit_log.len(),
        }
    }
}

/// `state` with its histories cut to their newest [`STATUS_HISTORY`] entries: whole, they
/// grow with every epoch ever committed (tens of MiB after 100 000), and `tessera status`
/// and the console ask every few seconds. [`crate::ClusterClient::current_metadata`]
/// answers the same way; SQL reads the whole epoch log (`tessera_epochs`).
pub(crate) fn newest_history(state: &MetaState) -> MetaState {
    let mut trimmed = state.clone();
    let cut = |len: usize| len.saturating_sub(STATUS_HISTORY);
    if let Some((&first, _)) = state.epoch_log.iter().nth(cut(state.epoch_log.len())) {
        trimmed.epoch_log = state
            .epoch_log
            .range(first..)
            .map(|(e, r)| (*e, r.clone()))
            .collect();
    }
    trimmed.aborted = state
        .recent_aborted(STATUS_HISTORY, ABORTS_LOOKED_BACK)
        .into_iter()
        .collect();
    trimmed.audit_log = state.audit_log.skip(cut(state.audit_log.len()));
    trimmed
}

/// What `tessera status` and the console show of a node: its metadata view, Raft's state,
/// the rows it holds and what it copied.
pub fn node_status(node: &crate::node::Node) -> NodeStatus {
    let metrics = node.meta.raft().metrics().borrow().clone();
    let view = node.meta.view();
    NodeStatus {
        node_id: node.id(),
        listen: node.config.listen.to_string(),
        leader: metrics.current_leader,
        term: metrics.current_term,
        applied_index: view.applied_index,
        meta: newest_history(&view.state),
        history: HistorySizes::of(&view.state),
        tables: node
            .store
            .table_stats()
            .into_iter()
            .map(|t| TableCount {
                name: t.name,
                rows: t.component_rows + t.memtable_rows + t.logged_rows,
                logged_rows: t.logged_rows,
                partitions_with_data: t.partitions_with_data,
            })
            .collect(),
        transfers: node.replication.transfers.counts(),
        checkpoints_written: node.store.checkpoints_written(),
        insecure: node.mtls.is_none(),
        last_scrub: crate::scrub::last_scrub(),
        cache: node.exec.cache_status(),
        decoded: Some(node.exec.queries().decoded().usage()),
        archive_waiting: node
            .archive_waiting
            .lock()
            .expect("archive waiting lock")
            .clone(),
        voters: metrics.membership_config.membership().voter_ids().collect(),
        membership_joint: metrics
            .membership_config
            .membership()
            .get_joint_config()
            .len()
            > 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_common::Epoch;

    #[test]
    fn a_status_carries_the_newest_history_and_how_long_it_is() {
        let mut state = MetaState::default();
        for n in 1..=250 {
            state.epoch_log.insert(
                Epoch(n),
                crate::meta::EpochRecord {
                    kind: crate::meta::EpochKind::Publish,
                    coordinator: NodeId(1),
                    tables: vec!["t".into()],
                    changes: Vec::new(),
                    visible_at_ms: n,
                    publisher: None,
                    participant: None,
                    seal: None,
                },
            );
            if n % 2 == 0 {
                state.aborted.insert(Epoch(1_000 + n));
            }
        }
        let trimmed = newest_history(&state);
        assert_eq!(trimmed.epoch_log.len(), STATUS_HISTORY);
        assert_eq!(trimmed.epoch_log.keys().next(), Some(&Epoch(151)));
        assert_eq!(trimmed.epoch_log.keys().last(), Some(&Epoch(250)));
        assert_eq!(trimmed.aborted.len(), STATUS_HISTORY);
        assert_eq!(trimmed.aborted.iter().last(), Some(&Epoch(1_250)));
        assert_eq!(
            HistorySizes::of(&state),
            HistorySizes {
                epochs: 250,
                aborted: 125,
                audited: 0
            }
        );
        // A short history is whole.
        let young = newest_history(&trimmed);
        assert_eq!(young, trimmed);
    }
}
