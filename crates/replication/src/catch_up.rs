//! A returning replica's delta, fetched before the rebalance takes every table's lease.
//!
//! Delta failback (DESIGN §6) refreshes a stale replica inside a leased epoch: every table's
//! lease is held from the first fetch to the map switch, so no publish anywhere lands while
//! the replica downloads what it missed. Over a slow link, or after a long absence, that is
//! long. So before the lease, the replica fetches its delta up to an epoch `T` below which
//! everything is decided, installs it, and remembers `T` ([`CaughtUp`]); the leased copy then
//! fetches only the versions from `T + 1` on: those published since.
//!
//! Why the unleased part is safe:
//! - Every epoch at or below `T` (the metadata's visible epoch, read linearizably here) is
//!   committed or aborted, and the source reads the metadata linearizably after this node
//!   did, so it has applied all of them: its versions at or below `T` are complete and final.
//! - The partition stays marked stale until the leased copy ends, so no publish sends it
//!   rows and no query reads it in between, and only a copy into this node can clear the
//!   mark. Copies into this node take [`Replication::copying`] one at a time, and this one
//!   checks the mark (stale from the same epoch) under it.
//! - What it installs from `T + 1` on may be older than the source's latest; the leased
//!   copy replaces every version from `T + 1` on with the source's, as of the lease.
//! - The mark can clear while the catch-up runs: another rebalance's leased copy (a deposed
//!   leader's, say, which waited for [`Replication::copying`] ahead of this one) ends, its
//!   map switch commits, and publishes send this node rows again. Installing the delta then
//!   would put the source's older versions over those rows (fault run 5301, third run: kv_a
//!   p4 on node 2 lost acknowledged epoch 74025, committed while this node's catch-up,
//!   planned at `T` = 74018, was frozen between its fetch and its install). So every
//!   install is fenced at `T`: the store refuses it, under the gate that commits take,
//!   once the partition holds anything newer than `T`, prepared or committed. Before the
//!   mark clears nothing newer than `T` reaches it but what an earlier catch-up installed,
//!   and a refusal only leaves the rest to the leased copy.
//! - The record lives in memory: after a restart the leased copy fetches the whole delta.

use crate::batched::DeltaFetch;
use crate::error::Result;
use crate::rebalance::{copies_whole, copy_into_this_node};
use crate::stall::Progress;
use crate::wire::{CopyRequest, PartitionMove};
use crate::Replication;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tessera_common::{Epoch, NodeId, PartitionId};
use tessera_meta::{MetaState, LINEARIZABLE_READ_PATIENCE};

/// One stale partition of one table (of one generation), stale from `since`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct StalePartition {
    pub table: String,
    pub generation: u64,
    pub partition: PartitionId,
    pub since: Epoch,
}

impl StalePartition {
    /// The partition `moved` refreshes, of `table` in `generation`.
    pub(crate) fn of(moved: &PartitionMove, table: &str, generation: u64) -> StalePartition {
        StalePartition {
            table: table.to_string(),
            generation,
            partition: moved.partition,
            since: moved.since,
        }
    }

    /// Whether `state` still marks this partition stale on `node` from the same epoch: the
    /// same absence, with nothing copied into it since.
    fn still_stale(&self, state: &MetaState, node: NodeId) -> bool {
        state
            .tables
            .get(&self.table)
            .is_some_and(|d| d.generation == self.generation)
            && state
                .map
                .partitions
                .get(self.partition.0 as usize)
                .and_then(|p| p.stale.get(&node))
                == Some(&self.since)
    }
}

/// Whether this node (`me`) fetches `stale`'s versions from `since` on from `moved.source`
/// before the lease, by `state` (read linearizably just now; every epoch at or below its
/// visible one is decided).
///
/// The source must be the partition's primary in `state`, not just the primary the leader
/// planned with, as the leased copy's source is:
/// - a replica that missed an epoch at or below the visible one is marked stale by that
///   epoch's commit, and would serve a delta without it, which this node would then count
///   as held (fault run 4902: a primary planned with missed epochs while the plan
///   travelled; the replica it was catching up lacked them for good);
/// - a current replica that is not the primary may be a cold standby, which keeps the rows
///   of epochs committed since it stopped being primary in its log, not in its store, so
///   its delta lacks them too (fault run 5001: the planned primary had handed the
///   partition back to its returning owner; kv_a p7 on node 4 lacked epochs 36022 and
///   36028 for good).
fn worth_fetching(
    state: &MetaState,
    me: NodeId,
    moved: &PartitionMove,
    stale: &StalePartition,
    since: Epoch,
) -> bool {
    let source_is_primary = state
        .map
        .partitions
        .get(moved.partition.0 as usize)
        .is_some_and(|p| {
            p.primary == Some(moved.source)
                && p.replicas.contains(&moved.source)
                && !p.stale.contains_key(&moved.source)
        });
    // A whole copy (a first missed epoch of zero, or one below the retention horizon) has
    // no delta to fetch.
    since <= state.visible
        && source_is_primary
        && !copies_whole(moved, state, &stale.table)
        && stale.still_stale(state, me)
}

/// Per stale partition, the epoch through which this node already holds every version,
/// fetched before a rebalance's lease.
#[derive(Debug, Default)]
pub struct CaughtUp(Mutex<HashMap<StalePartition, Epoch>>);

impl CaughtUp {
    /// The first epoch a leased delta of `partition` must fetch: its first missed epoch, or
    /// past what was fetched before the lease.
    pub(crate) fn leased_since(&self, partition: &StalePartition) -> Epoch {
        let through = self.records().get(partition).copied();
        match through {
            Some(through) if through >= partition.since => Epoch(through.0 + 1),
            _ => partition.since,
        }
    }

    /// Drops the record of `partition`: its leased copy ended, so it is current.
    pub(crate) fn forget(&self, partition: &StalePartition) {
        self.records().remove(partition);
    }

    fn record(&self, partition: StalePartition, through: Epoch) {
        self.records().insert(partition, through);
    }

    /// Keeps only the records of partitions `state` still marks stale on `node`.
    fn prune(&self, state: &MetaState, node: NodeId) {
        self.records().retain(|p, _| p.still_stale(state, node));
    }

    fn records(&self) -> std::sync::MutexGuard<'_, HashMap<StalePartition, Epoch>> {
        self.0.lock().expect("caught-up lock")
    }
}

/// Fetches and installs, for each delta move of `request`, the missed versions up to the
/// metadata's visible epoch, and records how far it got. Returns the versions fetched.
/// Given up, like a leased copy, once it makes no progress for a while.
pub(crate) async fn catch_up_before_lease(
    node: &Arc<Replication>,
    request: &CopyRequest,
) -> Result<u64> {
    copy_into_this_node(node, "a catch-up before the lease", |progress| async move {
        catch_up_now(node, request, &progress).await
    })
    .await
}

async fn catch_up_now(
    node: &Arc<Replication>,
    request: &CopyRequest,
    progress: &Progress,
) -> Result<u64> {
    let view = node
        .meta
        .read_linearizable(LINEARIZABLE_READ_PATIENCE)
        .await?;
    let state = &view.state;
    node.caught_up.prune(state, node.id());
    let deltas = plan_catch_up(state, node.id(), request, &node.caught_up);
    // Every delta is fenced where the plan found every epoch decided.
    let decided_through = state.visible;
    let fetches = deltas
        .into_iter()
        .map(|delta| {
            debug_assert_eq!(delta.decided_through, decided_through);
            DeltaFetch {
                moved: delta.moved,
                table: delta.stale.table,
                generation: delta.stale.generation,
                since: delta.since,
            }
        })
        .collect();
    let fetched = crate::batched::fetch_and_install(
        node,
        fetches,
        Some(decided_through),
        Some(progress),
        |installed| {
            for delta in installed {
                let fetch = &delta.fetch;
                let stale = StalePartition::of(&fetch.moved, &fetch.table, fetch.generation);
                node.caught_up.record(stale, decided_through);
            }
        },
    )
    .await;
    let fetched = fetched?;
    node.transfers.caught_up_before_lease(fetched);
    tracing::info!(
        partitions = request.moves.len(),
        versions = fetched,
        through = %state.visible,
        "fetched missed versions before a rebalance's lease"
    );
    Ok(fetched)
}

/// One delta a catch-up fetches before the lease.
#[derive(Debug)]
struct CatchUpDelta {
    moved: PartitionMove,
    stale: StalePartition,
    /// The first epoch fetched.
    since: Epoch,
    /// Every epoch at or below it was decided when the catch-up was planned; the install is
    /// fenced there (see the module's notes).
    decided_through: Epoch,
}

/// The deltas this node (`me`) fetches before the lease for `request`, by `state` (read
/// linearizably just now).
fn plan_catch_up(
    state: &MetaState,
    me: NodeId,
    request: &CopyRequest,
    caught_up: &CaughtUp,
) -> Vec<CatchUpDelta> {
    let mut deltas = Vec::new();
    for moved in &request.moves {
        for (table, generation) in &request.tables {
            let stale = StalePartition::of(moved, table, *generation);
            let since = caught_up.leased_since(&stale);
            if worth_fetching(state, me, moved, &stale, since) {
                deltas.push(CatchUpDelta {
                    moved: *moved,
                    stale,
                    since,
                    decided_through: state.visible,
                });
            }
        }
    }
    deltas
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three nodes, r = 3, one table, node 1 stale on every partition from epoch 5 (node 2
    /// its primary), and every epoch through 9 decided.
    fn node_1_stale() -> MetaState {
        let mut state = crate::rebalance::tests::three_nodes_one_table(2);
        for placement in &mut state.map.partitions {
            placement.stale.insert(NodeId(1), Epoch(5));
            placement.primary = Some(NodeId(2));
        }
        state.visible = Epoch(9);
        state
    }

    /// Whether node 1 fetches partition 0's versions from `since` on from `source`.
    fn fetches(state: &MetaState, source: u64, since: u64) -> bool {
        let moved = PartitionMove {
            partition: PartitionId(0),
            source: NodeId(source),
            since: Epoch(5),
        };
        let stale = StalePartition::of(&moved, "t", state.tables["t"].generation);
        worth_fetching(state, NodeId(1), &moved, &stale, Epoch(since))
    }

    #[test]
    fn every_delta_fetched_before_the_lease_is_fenced_at_the_epoch_decided_when_planned() {
        let state = node_1_stale();
        let request = CopyRequest {
            moves: (0..2)
                .map(|p| PartitionMove {
                    partition: PartitionId(p),
                    source: NodeId(2),
                    since: Epoch(5),
                })
                .collect(),
            tables: vec![("t".into(), state.tables["t"].generation)],
            epoch: None,
        };
        let caught_up = CaughtUp::default();
        let planned = plan_catch_up(&state, NodeId(1), &request, &caught_up);
        assert_eq!(planned.len(), 2);
        for delta in &planned {
            assert_eq!(delta.since, Epoch(5), "from the first missed epoch");
            // Installed unfenced, a delta whose install waited past the map switch that
            // made this replica current would replace the rows published to it since.
            assert_eq!(delta.decided_through, Epoch(9));
        }
        for delta in planned {
            caught_up.record(delta.stale, delta.decided_through);
        }
        let mut later = state.clone();
        later.visible = Epoch(12);
        let planned = plan_catch_up(&later, NodeId(1), &request, &caught_up);
        assert!(planned
            .iter()
            .all(|d| d.since == Epoch(10) && d.decided_through == Epoch(12)));
    }

    #[test]
    fn a_stale_replica_fetches_before_the_lease_from_a_current_one() {
        let state = node_1_stale();
        assert!(fetches(&state, 2, 5));
        assert!(fetches(&state, 2, 9), "epochs 6 to 9 fetched already");
        assert!(!fetches(&state, 2, 10), "it holds every decided epoch");
    }

    #[test]
    fn nothing_is_fetched_from_a_source_that_missed_epochs_since_the_plan() {
        let mut state = node_1_stale();
        state.map.partitions[0].stale.insert(NodeId(2), Epoch(8));
        state.map.partitions[0].primary = Some(NodeId(3));
        assert!(!fetches(&state, 2, 5));
        assert!(fetches(&state, 3, 5), "node 3 is the primary now");
    }

    #[test]
    fn nothing_is_fetched_from_a_current_replica_that_is_not_the_primary() {
        // Node 2 was the primary the leader planned with; node 3 is primary now, and node 2
        // a cold standby: the epochs committed since are in its log, not its store.
        let mut state = node_1_stale();
        state.map.partitions[0].primary = Some(NodeId(3));
        assert!(!fetches(&state, 2, 5));
        assert!(fetches(&state, 3, 5));
    }

    #[test]
    fn nothing_is_fetched_once_the_partition_is_current_or_stale_from_another_epoch() {
        let mut state = node_1_stale();
        state.map.partitions[0].stale.insert(NodeId(1), Epoch(7));
        assert!(
            !fetches(&state, 2, 5),
            "a later absence: its first missed epoch is 7"
        );
        state.map.partitions[0].stale.remove(&NodeId(1));
        assert!(!fetches(&state, 2, 5), "a copy made it current");
    }
}
