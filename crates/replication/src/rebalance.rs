//! Membership changes move whole partitions (DESIGN §3): when the members change, the
//! metadata leader computes the uniform map over them, has each new replica copy its
//! partitions from a current one (component replication: the components it lacks, fetched
//! by hash and checked against it, plus the versions still in the source's memory), and
//! switches the map in one Raft entry.
//!
//! While partitions move, the leader holds the ownership lease of every table (an open
//! epoch), so no publish can land between the copy and the switch; publishes wait. To keep
//! that wait short, each new replica first fetches the components its copies will need
//! without any lease ([`prefetch_components`]); the leased copy then fetches only what
//! changed since, and the source's in-memory versions.
//!
//! A replica that missed epochs while it was down is brought back the same way, but with
//! delta recovery: it fetches from the primary only the versions from the first epoch it
//! missed, and keeps everything older (DESIGN §6, failback). If it fails again midway, the
//! map still lists it as stale from the same epoch, and the next attempt redoes the delta.
//! It too fetches most of its delta before the lease ([`crate::catch_up`]): the leased copy
//! fetches only the epochs published since.

use crate::batched::{DeltaFetch, WholeCopy};
use crate::error::{ReplicationError, Result};
use crate::stall::Progress;
use crate::wire::{
    CopyRequest, ExportRequest, PartitionMove, ACTION_COPY_PARTITIONS, ACTION_PREFETCH_COMPONENTS,
};
use crate::NodeId;
use crate::Replication;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tessera_common::{ComponentHash, Epoch, PartitionId};
use tessera_meta::{
    MetaCommand, MetaResponse, MetaState, PartitionMap, LINEARIZABLE_READ_PATIENCE,
};
use tessera_net::{CallError, Refusal};
use tessera_storage::ComponentMeta;

/// What this node fetched to become or return as a replica, since it started: `tessera
/// status` shows it, and tests tell a delta failback from a whole copy by it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferCounts {
    /// Partitions (of one table each) copied whole, as a new replica.
    pub whole_copies: u64,
    /// Rows those copies installed: the source's components and in-memory versions.
    pub whole_rows: u64,
    /// Partitions (of one table each) refreshed by delta, as a returning replica.
    pub delta_copies: u64,
    /// Row versions those deltas fetched: only the epochs the replica missed, before the
    /// rebalance took every table's lease and under it.
    pub delta_versions: u64,
    /// Of `delta_versions`, those fetched while the rebalance held every table's lease: the
    /// epochs published after the replica caught up before it (all, when that failed).
    #[serde(default)]
    pub leased_delta_versions: u64,
    /// Components fetched for whole copies before the rebalance took every table's lease.
    #[serde(default)]
    pub prefetched_components: u64,
    /// Components whole copies fetched while the rebalance held every table's lease: those
    /// the sources wrote after the prefetch (or all, when the prefetch failed).
    #[serde(default)]
    pub leased_components: u64,
}

/// The running counters behind [`TransferCounts`].
#[derive(Debug, Default)]
pub struct TransferCounters {
    whole_copies: AtomicU64,
    whole_rows: AtomicU64,
    delta_copies: AtomicU64,
    delta_versions: AtomicU64,
    leased_delta_versions: AtomicU64,
    prefetched_components: AtomicU64,
    leased_components: AtomicU64,
}

impl TransferCounters {
    pub fn counts(&self) -> TransferCounts {
        TransferCounts {
            whole_copies: self.whole_copies.load(Ordering::Relaxed),
            whole_rows: self.whole_rows.load(Ordering::Relaxed),
            delta_copies: self.delta_copies.load(Ordering::Relaxed),
            delta_versions: self.delta_versions.load(Ordering::Relaxed),
            leased_delta_versions: self.leased_delta_versions.load(Ordering::Relaxed),
            prefetched_components: self.prefetched_components.load(Ordering::Relaxed),
            leased_components: self.leased_components.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn whole(&self, rows: u64, fetched_components: u64) {
        self.whole_copies.fetch_add(1, Ordering::Relaxed);
        self.whole_rows.fetch_add(rows, Ordering::Relaxed);
        self.leased_components
            .fetch_add(fetched_components, Ordering::Relaxed);
    }

    fn prefetched(&self, components: u64) {
        self.prefetched_components
            .fetch_add(components, Ordering::Relaxed);
    }

    fn delta(&self, versions: u64) {
        self.delta_copies.fetch_add(1, Ordering::Relaxed);
        self.delta_versions.fetch_add(versions, Ordering::Relaxed);
        self.leased_delta_versions
            .fetch_add(versions, Ordering::Relaxed);
    }

    pub(crate) fn caught_up_before_lease(&self, versions: u64) {
        self.delta_versions.fetch_add(versions, Ordering::Relaxed);
    }
}

/// The members that should hold partitions: every storage node that is not leaving,
/// retired, or `lost` (failed for so long that its replicas are rebuilt elsewhere).
/// Compute nodes hold none.
fn members(state: &MetaState, lost: &BTreeSet<NodeId>) -> Vec<NodeId> {
    state
        .nodes
        .values()
        .filter(|n| !n.compute && !n.decommissioned && !n.leaving && !lost.contains(&n.id))
        .map(|n| n.id)
        .collect()
}

/// The map the members should have: the uniform map over them when every member is alive
/// and it differs from the current one (moving data off or onto a dead node has to wait for
/// it); otherwise the current map, if a live replica in it is stale (it missed epochs while
/// it was away) and can be refreshed now, without waiting for the other nodes.
pub fn wanted_map(state: &MetaState, lost: &BTreeSet<NodeId>) -> Option<PartitionMap> {
    let members = members(state, lost);
    if members.is_empty() {
        return None;
    }
    let stale_but_back = state.map.partitions.iter().any(|p| {
        p.stale
            .keys()
            .any(|id| state.nodes.get(id).is_some_and(|n| n.alive))
    });
    if members.iter().all(|id| state.nodes[id].alive) {
        let wanted = PartitionMap::uniform(state.partition_count, state.replication, &members);
        let same = wanted
            .partitions
            .iter()
            .zip(&state.map.partitions)
            .all(|(w, c)| w.replicas == c.replicas);
        if !same || stale_but_back {
            return Some(wanted);
        }
    }
    stale_but_back.then(|| state.map.clone())
}

/// Moves partitions to match [`wanted_map`]; run by the metadata leader.
///
/// Returning replicas that missed only some epochs catch up first, in a leased epoch of
/// their own, when the plan also copies partitions whole (onto a wiped or new node): the
/// deltas take a moment, the whole copies as long as the data takes to move, and until a
/// stale replica is current again its partitions may lack the copies a publish needs
/// (`replicas.min_copies`). The whole copies follow in the next rebalance.
pub async fn rebalance(node: &Arc<Replication>, lost: &BTreeSet<NodeId>) -> Result<()> {
    let state = node.meta.view().state.clone();
    let Some(wanted) = wanted_map(&state, lost) else {
        return Ok(());
    };
    if catches_up_first(&state, &wanted, node.settings.delta_recovery) {
        fetch_before_lease_everywhere(node, &state, &state.map, Copies::CatchUpsOnly).await;
        return switch_map(node, state.map.clone(), Copies::CatchUpsOnly).await;
    }
    fetch_before_lease_everywhere(node, &state, &wanted, Copies::All).await;
    switch_map(node, wanted, Copies::All).await
}

/// Which of a plan's copies one leased rebalance epoch makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copies {
    All,
    /// Only returning replicas' deltas; replicas to be copied whole stay stale.
    CatchUpsOnly,
}

/// Whether the copies from `state`'s map to `wanted` mix deltas with whole copies, so the
/// deltas go first (see [`rebalance`]).
fn catches_up_first(state: &MetaState, wanted: &PartitionMap, delta_recovery: bool) -> bool {
    let Ok(copies) = plan_copies(state, &mut wanted.clone(), delta_recovery, Copies::All) else {
        return false;
    };
    let mut moves = copies.values().flatten();
    let catch_up = |moved: &&PartitionMove| is_catch_up(moved, state);
    moves.clone().any(|m| catch_up(&m)) && moves.any(|m| !catch_up(&m))
}

/// Whether `moved` fetches only the epochs a returning replica missed, of every table.
fn is_catch_up(moved: &PartitionMove, state: &MetaState) -> bool {
    moved.since > Epoch::ZERO
        && state
            .tables
            .keys()
            .all(|table| !copies_whole(moved, state, table))
}

/// Takes every table's lease in a new epoch, makes the `which` copies that turn the map
/// into `wanted`, and switches the map to it in the same epoch.
async fn switch_map(
    node: &Arc<Replication>,
    mut wanted: PartitionMap,
    which: Copies,
) -> Result<()> {
    let state = node.meta.view().state.clone();
    let tables: Vec<String> = state.tables.keys().cloned().collect();
    // Copies may take long: heartbeats keep the epoch from timing out while they run, and
    // once this returns without deciding it, the leader aborts it.
    let working = crate::publish::allocate_epoch(node, tables, None, &Default::default()).await?;
    let epoch = working.epoch();
    // Every epoch before ours is decided (we hold every table's lease): copy as of then.
    let state = match node
        .meta
        .read_linearizable(LINEARIZABLE_READ_PATIENCE)
        .await
    {
        Ok(view) => view.state.clone(),
        Err(error) => {
            // Release every table's lease at once, not when this node is declared failed.
            if let Err(abort_error) = abort(node, epoch, &error.to_string()).await {
                tracing::warn!(%epoch, %abort_error, "could not abort the rebalance epoch");
            }
            return Err(error.into());
        }
    };
    let generations: Vec<(String, u64)> = state
        .tables
        .values()
        .map(|d| (d.name.clone(), d.generation))
        .collect();
    let copies = match plan_copies(&state, &mut wanted, node.settings.delta_recovery, which) {
        Ok(copies) => copies,
        Err(partition) => {
            let _ = abort(node, epoch, "a partition has no readable replica").await;
            return Err(ReplicationError::NoReadableReplica { partition });
        }
    };
    let moved: usize = copies.values().map(Vec::len).sum();
    let leased_at = std::time::Instant::now();
    tracing::info!(%epoch, moved, ?which, "rebalancing partitions");
    let sends = copies.into_iter().map(|(target, moves)| {
        let request = CopyRequest {
            moves,
            tables: generations.clone(),
            epoch: Some(epoch),
        };
        async move {
            if target == node.id() {
                return copy_partitions(node, request).await;
            }
            ask_target(
                node,
                target,
                ACTION_COPY_PARTITIONS,
                request,
                "a partition copy",
                COPY_PATIENCE,
            )
            .await
        }
    });
    if let Err(error) = futures::future::try_join_all(sends).await {
        let _ = abort(node, epoch, &error.to_string()).await;
        return Err(error);
    }
    // Refused if the map went out of date while the copies ran (a replica lost its data):
    // the leases are released at once and the next rebalance plans again.
    if let Err(error) = node
        .meta
        .write(MetaCommand::SetPartitionMap {
            map: wanted,
            rebalance: Some(epoch),
        })
        .await
    {
        let _ = abort(node, epoch, &error.to_string()).await;
        return Err(error.into());
    }
    node.meta
        .write(MetaCommand::CommitEpoch {
            epoch,
            missed: vec![],
            changes: None,
            seal: None,
            min_copies: None,
        })
        .await?;
    tracing::info!(%epoch, moved, elapsed_ms = leased_at.elapsed().as_millis() as u64, "partition map switched");
    Ok(())
}

/// The copies that turn `state`'s map into `wanted`: per target node, the partitions it
/// copies and from where (a returning stale replica by delta, when `delta_recovery`).
/// Sets each wanted partition's stale replicas: those kept from the current map keep their
/// staleness, copies are complete. `Err` names a partition with no readable replica.
fn plan_copies(
    state: &MetaState,
    wanted: &mut PartitionMap,
    delta_recovery: bool,
    which: Copies,
) -> std::result::Result<BTreeMap<NodeId, Vec<PartitionMove>>, PartitionId> {
    let mut copies: BTreeMap<NodeId, Vec<PartitionMove>> = BTreeMap::new();
    for (i, (target, current)) in wanted
        .partitions
        .iter_mut()
        .zip(&state.map.partitions)
        .enumerate()
    {
        let partition = PartitionId(i as u32);
        for replica in &target.replicas {
            if !state.nodes.get(replica).is_some_and(|n| n.alive) {
                continue; // a dead stale replica stays stale until it returns
            }
            let since = match current.stale.get(replica) {
                Some(first_missed) if current.replicas.contains(replica) && delta_recovery => {
                    *first_missed
                }
                None if current.replicas.contains(replica) => continue,
                _ => Epoch::ZERO,
            };
            let source = current.primary.ok_or(partition)?;
            let moved = PartitionMove {
                partition,
                source,
                since,
            };
            if which == Copies::CatchUpsOnly && !is_catch_up(&moved, state) {
                continue; // stays stale until the whole copies' rebalance
            }
            copies.entry(*replica).or_default().push(moved);
        }
        target.stale = current
            .stale
            .iter()
            .map(|(id, since)| (*id, *since))
            .filter(|(id, _)| {
                target.replicas.contains(id)
                    && copies
                        .get(id)
                        .is_none_or(|m| !m.iter().any(|m| m.partition == partition))
            })
            .collect();
    }
    Ok(copies)
}

/// How long the leader waits for a target's leased copy (unless the target is declared
/// failed first).
const COPY_PATIENCE: Duration = Duration::from_secs(3600);

/// How long the leader waits for a target's fetch before the lease: it holds no lease, but
/// the next rebalance waits for it.
const PREFETCH_PATIENCE: Duration = Duration::from_secs(600);

/// Before a rebalance takes every table's lease, has each target fetch what its `which`
/// copies will need: the components of its whole copies, and its deltas up to the epochs
/// decided now. The leased copies then fetch only what the sources wrote since. Best
/// effort: a target that fails or refuses (an older node) copies everything under the
/// lease, as before.
async fn fetch_before_lease_everywhere(
    node: &Arc<Replication>,
    state: &MetaState,
    wanted: &PartitionMap,
    which: Copies,
) {
    let delta_recovery = node.settings.delta_recovery;
    let Ok(copies) = plan_copies(state, &mut wanted.clone(), delta_recovery, which) else {
        return;
    };
    let tables: Vec<(String, u64)> = state
        .tables
        .values()
        .map(|d| (d.name.clone(), d.generation))
        .collect();
    let sends = copies.into_iter().map(|(target, moves)| {
        let request = CopyRequest {
            moves,
            tables: tables.clone(),
            epoch: None,
        };
        async move {
            let fetched = if target == node.id() {
                fetch_before_lease(node, request).await
            } else {
                ask_target(
                    node,
                    target,
                    ACTION_PREFETCH_COMPONENTS,
                    request,
                    "a fetch before the lease",
                    PREFETCH_PATIENCE,
                )
                .await
            };
            if let Err(error) = fetched {
                tracing::info!(target = target.0, %error, "a fetch before the lease failed; the leased copy fetches what it lacks");
            }
        }
    });
    futures::future::join_all(sends).await;
}

/// Asks `target` to run `action` (a copy or a prefetch), giving up once the failure
/// detector declares the target failed: the rebalance's epoch leases every table, and a
/// target that stops answering (killed, paused, cut off) must not hold every publish for
/// the call's hour. The rebalance is then tried again without it.
async fn ask_target(
    node: &Arc<Replication>,
    target: NodeId,
    action: &str,
    request: CopyRequest,
    what: &'static str,
    patience: Duration,
) -> Result<()> {
    let addr = node.meta.require_addr(target)?;
    let call = node.clients.action(&addr, action, request, patience);
    let target_failed = node.meta.wait_until_failed(target, patience);
    let reply: std::result::Result<std::result::Result<(), Refusal>, CallError> = tokio::select! {
        reply = call => reply,
        () = target_failed => Err(CallError::Transport(format!(
            "node {target} was declared failed during {what}"
        ))),
    };
    match reply {
        Ok(Ok(())) => Ok(()),
        Ok(Err(refusal)) => Err(ReplicationError::Refused {
            node: target,
            what,
            reason: format!("{refusal:?}"),
        }),
        Err(e) => Err(ReplicationError::Unreachable {
            node: target,
            addr,
            reason: e.to_string(),
        }),
    }
}

async fn abort(
    node: &Arc<Replication>,
    epoch: tessera_common::Epoch,
    reason: &str,
) -> Result<MetaResponse> {
    Ok(node
        .meta
        .write(MetaCommand::AbortEpoch {
            epoch,
            reason: reason.to_string(),
        })
        .await?)
}

/// Copies the named partitions of every table from their sources into this node's store.
///
/// Gives up once it has fetched and installed nothing for `failure.progress_timeout_ms`
/// (see [`crate::stall`]): the rebalance waiting on it holds every table's lease, and a
/// node whose disk hangs would otherwise hold it until it stops itself. An install still
/// running on a blocking thread then is refused by its fence if anything newer has been
/// installed by the time it gets to run.
pub async fn copy_partitions(node: &Arc<Replication>, request: CopyRequest) -> Result<()> {
    let started = std::time::Instant::now();
    let copied = copy_into_this_node(node, "a partition copy", |progress| async move {
        copy_partitions_now(node, request, &progress).await
    })
    .await;
    if copied.is_ok() {
        let metrics = tessera_common::metrics::metrics();
        metrics.failbacks.inc();
        tessera_common::metrics::observe_seconds(&metrics.failback_seconds, started.elapsed());
    }
    copied
}

/// Runs `copy` (which reports its progress) once the copies into this node before it are
/// done: one at a time, in the order they arrive (see [`Replication::copying`]). Gives it
/// up once it has made no progress for `failure.progress_timeout_ms`; waiting on an
/// earlier copy that is stuck is no progress either.
pub(crate) async fn copy_into_this_node<T, F, Fut>(
    node: &Arc<Replication>,
    what: &'static str,
    copy: F,
) -> Result<T>
where
    F: FnOnce(Progress) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let progress = Progress::new();
    let one_at_a_time = async {
        let _one_at_a_time = node.copying.lock().await;
        progress.advanced();
        copy(progress.clone()).await
    };
    tokio::select! {
        copied = one_at_a_time => copied,
        stalled = progress.stalled(node.settings.progress_timeout) => {
            let error = ReplicationError::CopyStalled { node: node.id(), stalled_s: stalled.as_secs_f64() };
            tracing::warn!(%error, what, "giving up");
            Err(error)
        }
    }
}

async fn copy_partitions_now(
    node: &Arc<Replication>,
    request: CopyRequest,
    progress: &Progress,
) -> Result<()> {
    // The tables must exist here first: wait for the metadata that created them.
    let view = node
        .meta
        .read_linearizable(LINEARIZABLE_READ_PATIENCE)
        .await?;
    for (table, generation) in &request.tables {
        if view
            .state
            .tables
            .get(table)
            .is_none_or(|d| d.generation != *generation)
        {
            return Err(ReplicationError::UnknownTable {
                table: table.clone(),
                generation: *generation,
                node: node.id(),
            });
        }
    }
    let started = std::time::Instant::now();
    // Fetched a few at a time and installed in batches (see `crate::batched`).
    let (mut whole, mut deltas) = (Vec::new(), Vec::new());
    for moved in &request.moves {
        for (table, generation) in &request.tables {
            let copy = WholeCopy {
                moved: *moved,
                table: table.clone(),
                generation: *generation,
            };
            if copies_whole(moved, &view.state, table) {
                whole.push(copy);
            } else {
                let stale = crate::catch_up::StalePartition::of(moved, table, *generation);
                deltas.push(DeltaFetch {
                    // Past what was fetched before the lease, if anything was.
                    since: node.caught_up.leased_since(&stale),
                    moved: copy.moved,
                    table: copy.table,
                    generation: copy.generation,
                });
            }
        }
    }
    crate::batched::copy_whole(node, whole, request.epoch, progress).await?;
    copy_deltas(node, deltas, request.epoch, progress).await?;
    tracing::info!(
        partitions = request.moves.len(),
        deltas = request
            .moves
            .iter()
            .filter(|m| m.since > Epoch::ZERO)
            .count(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "partitions copied"
    );
    Ok(())
}

/// Whether `moved` copies `table` whole: a new replica does, and so does a returning one
/// whose delta is gone (a delta needs every version since the replica left; merges keep
/// those only above the table's retention horizon).
pub(crate) fn copies_whole(moved: &PartitionMove, state: &MetaState, table: &str) -> bool {
    moved.since == Epoch::ZERO || moved.since <= state.retention_horizon(table)
}

/// Refuses unless, by `state` (read linearizably), node `me`'s process `incarnation` may
/// serve `partition`'s versions to a copy: the metadata has heard from this process (a
/// node wiped and restarted is marked replaced when it announces itself; before that it
/// would serve a delta without what it lost, and the copy would count it held: fault run
/// 5001, kv_a p7 copied to node 4 from a just-wiped node 3 lacked epochs 36022 and 36028
/// for good), and `me` is a current replica of the partition.
pub fn may_serve_a_copy(
    state: &MetaState,
    me: NodeId,
    incarnation: u64,
    partition: PartitionId,
) -> std::result::Result<(), String> {
    let announced = state
        .nodes
        .get(&me)
        .is_some_and(|n| n.incarnation >= incarnation);
    if !announced {
        return Err(format!(
            "node {me} cannot serve partition {partition} to a copy yet: the metadata has not heard from this process since it started (its data may have been lost)"
        ));
    }
    state.holds_through(me, partition, state.visible)
}

/// What a target does before a rebalance takes every table's lease: it prefetches the
/// components of its whole copies, then fetches its deltas up to the epochs decided now
/// ([`crate::catch_up`]).
pub async fn fetch_before_lease(node: &Arc<Replication>, request: CopyRequest) -> Result<()> {
    // Either one failing leaves more to the leased copy, not the other undone.
    let prefetched = prefetch_components(node, &request).await;
    let caught_up = crate::catch_up::catch_up_before_lease(node, &request).await;
    prefetched.and(caught_up.map(|_| ()))
}

/// Fetches, by hash, the components the whole copies of `request` need and this node lacks,
/// and keeps them without installing anything: the leased copy that follows finds them
/// here. (What no copy installs in the end is deleted when the node next starts.)
async fn prefetch_components(node: &Arc<Replication>, request: &CopyRequest) -> Result<()> {
    let state = node.meta.view().state.clone();
    let mut prefetched = 0;
    for moved in &request.moves {
        for (table, generation) in &request.tables {
            if !copies_whole(moved, &state, table) {
                continue;
            }
            let (components, _in_memory, fetched) =
                export_and_fetch(node, moved, table, *generation, None).await?;
            let count = fetched.len() as u64;
            node.on_store("keeping prefetched components", move |store| {
                store.keep_fetched_components(&components, &fetched)
            })
            .await?;
            node.transfers.prefetched(count);
            prefetched += count;
        }
    }
    tracing::info!(
        partitions = request.moves.len(),
        components = prefetched,
        "prefetched components for a rebalance"
    );
    Ok(())
}

fn copy_error(source: NodeId, error: impl std::fmt::Display) -> ReplicationError {
    ReplicationError::Copy {
        from: source,
        reason: error.to_string(),
    }
}

/// A partition's export from `moved.source` (its components and in-memory versions) and
/// the bytes of the components this node lacks.
pub(crate) async fn export_and_fetch(
    node: &Arc<Replication>,
    moved: &PartitionMove,
    table: &str,
    generation: u64,
    progress: Option<&Progress>,
) -> Result<(
    Vec<ComponentMeta>,
    Vec<arrow::array::RecordBatch>,
    HashMap<ComponentHash, Vec<u8>>,
)> {
    let addr = node.meta.require_addr(moved.source)?;
    let request = ExportRequest {
        table: table.to_string(),
        generation,
        partition: moved.partition,
    };
    let (components, in_memory) = crate::wire::export(&node.clients, &addr, &request)
        .await
        .map_err(|e| copy_error(moved.source, e))?;
    progress.inspect(|p| p.advanced());
    let fetched = fetch_missing_components(node, &addr, &components, progress)
        .await
        .map_err(|e| copy_error(moved.source, e))?;
    Ok((components, in_memory, fetched))
}

/// The bytes of those of `components` this node lacks, fetched by hash from `addr` (the
/// receiving store checks them against their names before it writes them).
pub(crate) async fn fetch_missing_components(
    node: &Replication,
    addr: &str,
    components: &[ComponentMeta],
    progress: Option<&Progress>,
) -> std::result::Result<HashMap<ComponentHash, Vec<u8>>, CallError> {
    let mut fetched = HashMap::new();
    for component in components {
        if node.store.has_component(&component.hash) || fetched.contains_key(&component.hash) {
            continue;
        }
        let bytes = crate::wire::component(&node.clients, addr, component.hash).await?;
        fetched.insert(component.hash, bytes);
        progress.inspect(|p| p.advanced());
    }
    Ok(fetched)
}

/// A returning replica fetches only the versions from the first epoch it missed, or from
/// past those it fetched before the lease.
async fn copy_deltas(
    node: &Arc<Replication>,
    deltas: Vec<DeltaFetch>,
    fence: Option<Epoch>,
    progress: &Progress,
) -> Result<()> {
    if deltas.is_empty() {
        return Ok(());
    }
    crate::batched::fetch_and_install(node, deltas, fence, Some(progress), |installed| {
        for delta in installed {
            let fetch = &delta.fetch;
            let stale =
                crate::catch_up::StalePartition::of(&fetch.moved, &fetch.table, fetch.generation);
            node.caught_up.forget(&stale);
            node.transfers.delta(delta.versions);
            tracing::info!(table = %fetch.table, partition = fetch.moved.partition.0, source = fetch.moved.source.0, missed_since = %fetch.moved.since, since = %fetch.since, rows = delta.versions, "copied a partition's missed versions");
        }
    })
    .await
    .map(|_| ())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field, Schema};
    use tessera_storage::TableDef;

    /// Three live nodes, r = 3, `partitions` partitions and one table `t`, every replica
    /// current.
    pub(crate) fn three_nodes_one_table(partitions: u32) -> MetaState {
        let mut state = MetaState::default();
        state.apply(
            1,
            MetaCommand::Bootstrap {
                cluster_id: "c".into(),
                partition_count: partitions,
                replication: 3,
                hot_standby: false,
                nodes: (1..=3)
                    .map(|id| (NodeId(id), format!("127.0.0.1:{id}")))
                    .collect(),
            },
        );
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, false)]);
        let def = TableDef::new("t", schema, vec!["k".into()], None).unwrap();
        state.apply(2, MetaCommand::CreateTable { def });
        state
    }

    /// [`three_nodes_one_table`] with 4 partitions, and a map where node 1 came back wiped
    /// (stale from the first epoch) and node 2 missed epochs from 7 on.
    fn wiped_and_stale() -> MetaState {
        let mut state = three_nodes_one_table(4);
        for placement in &mut state.map.partitions {
            placement.stale.insert(NodeId(1), Epoch::ZERO);
            placement.stale.insert(NodeId(2), Epoch(7));
        }
        state
    }

    fn moves_by_target(copies: &BTreeMap<NodeId, Vec<PartitionMove>>) -> BTreeMap<u64, Vec<u64>> {
        copies
            .iter()
            .map(|(id, moves)| (id.0, moves.iter().map(|m| m.since.0).collect()))
            .collect()
    }

    #[test]
    fn returning_replicas_catch_up_before_a_wiped_node_is_copied_whole() {
        let state = wiped_and_stale();
        let wanted = wanted_map(&state, &BTreeSet::new()).expect("stale replicas are back");
        assert!(catches_up_first(&state, &wanted, true));
        // The first rebalance fetches node 2's missed epochs only; node 1 stays stale.
        let mut first = state.map.clone();
        let copies = plan_copies(&state, &mut first, true, Copies::CatchUpsOnly).unwrap();
        assert_eq!(moves_by_target(&copies), BTreeMap::from([(2, vec![7; 4])]));
        for placement in &first.partitions {
            assert_eq!(
                placement.stale,
                BTreeMap::from([(NodeId(1), Epoch::ZERO)]),
                "only the wiped node stays stale"
            );
        }
        // The next one copies node 1 whole, and nothing else.
        let mut caught_up = state.clone();
        caught_up.map = first;
        let wanted = wanted_map(&caught_up, &BTreeSet::new()).expect("node 1 is still stale");
        assert!(!catches_up_first(&caught_up, &wanted, true));
        let mut second = wanted.clone();
        let copies = plan_copies(&caught_up, &mut second, true, Copies::All).unwrap();
        assert_eq!(moves_by_target(&copies), BTreeMap::from([(1, vec![0; 4])]));
        assert!(second.partitions.iter().all(|p| p.stale.is_empty()));
    }

    #[test]
    fn without_delta_recovery_or_without_whole_copies_one_rebalance_does_everything() {
        let state = wiped_and_stale();
        let wanted = wanted_map(&state, &BTreeSet::new()).unwrap();
        // Without deltas every copy is whole: nothing to put first.
        assert!(!catches_up_first(&state, &wanted, false));
        // Only deltas: no whole copy to wait behind.
        let mut only_stale = state.clone();
        for placement in &mut only_stale.map.partitions {
            placement.stale.remove(&NodeId(1));
        }
        let wanted = wanted_map(&only_stale, &BTreeSet::new()).unwrap();
        assert!(!catches_up_first(&only_stale, &wanted, true));
    }

    #[test]
    fn a_partition_with_too_few_current_replicas_refuses_publishes() {
        use crate::publish::partition_refusing_publishes;
        let mut state = three_nodes_one_table(4);
        assert_eq!(partition_refusing_publishes(&state, 2), None);
        // p2 keeps one current replica: node 1 is stale there, node 3 dead.
        state.map.partitions[2].stale.insert(NodeId(1), Epoch(7));
        assert_eq!(partition_refusing_publishes(&state, 2), None, "two current");
        state.nodes.get_mut(&NodeId(3)).unwrap().alive = false;
        assert_eq!(
            partition_refusing_publishes(&state, 2),
            Some(PartitionId(2))
        );
        // One copy is all a publish asks for with `min_copies = 1`.
        assert_eq!(partition_refusing_publishes(&state, 1), None);
        // Stale everywhere on p0 (a wiped node and a returning one) refuses even one copy.
        state.map.partitions[0].stale.insert(NodeId(1), Epoch::ZERO);
        state.map.partitions[0].stale.insert(NodeId(2), Epoch(3));
        assert_eq!(
            partition_refusing_publishes(&state, 1),
            Some(PartitionId(0))
        );
    }

    #[test]
    fn a_retry_short_of_replicas_only_because_they_stalled_says_so() {
        use crate::publish::writable_replicas;
        let state = three_nodes_one_table(4);
        let p1 = PartitionId(1);
        let left_out: BTreeSet<NodeId> = [NodeId(1), NodeId(2), NodeId(3)].into();
        let error = writable_replicas(&state, p1, 1, &left_out).unwrap_err();
        assert!(
            matches!(error, ReplicationError::StalledCopies { ref stalled, .. } if stalled.len() == 3),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .contains("made no progress on this publish"),
            "{error}"
        );
        // One left out of three: the other two are enough.
        let one: BTreeSet<NodeId> = [NodeId(2)].into();
        assert_eq!(writable_replicas(&state, p1, 2, &one).unwrap().len(), 2);
        // Short of replicas for another reason (two dead): the partition itself refuses.
        let mut dead = state.clone();
        for id in [2, 3] {
            dead.nodes.get_mut(&NodeId(id)).unwrap().alive = false;
        }
        let error = writable_replicas(&dead, p1, 2, &BTreeSet::new()).unwrap_err();
        assert!(
            matches!(error, ReplicationError::TooFewCopies { .. }),
            "{error}"
        );
    }

    #[test]
    fn only_an_announced_current_replica_serves_a_copy() {
        let mut state = three_nodes_one_table(2);
        state.visible = Epoch(9);
        state.nodes.get_mut(&NodeId(2)).unwrap().incarnation = 4;
        let p0 = PartitionId(0);
        assert_eq!(may_serve_a_copy(&state, NodeId(2), 4, p0), Ok(()));
        // Node 2 restarted (process 5, perhaps with its data wiped): until the metadata
        // has heard from this process, it serves nothing to a copy.
        let refused = may_serve_a_copy(&state, NodeId(2), 5, p0).unwrap_err();
        assert!(
            refused.contains("has not heard from this process"),
            "{refused}"
        );
        // Heard from, and found to have lost its data: stale from the first epoch.
        state.nodes.get_mut(&NodeId(2)).unwrap().incarnation = 5;
        state.map.partitions[0].stale.insert(NodeId(2), Epoch::ZERO);
        let refused = may_serve_a_copy(&state, NodeId(2), 5, p0).unwrap_err();
        assert!(refused.contains("lacks the versions"), "{refused}");
    }
}
