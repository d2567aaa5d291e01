//! Membership changes move whole partitions (DESIGN §3): when the members change, the
//! metadata leader computes the uniform map over them, has each new replica copy its
//! partitions from a current one (component replication: the components it lacks, fetched
//! by hash and checked against it, plus the versions still in the source's memory), and
//! switches the map in one Raft entry.
//!
//! While partitions move, the leader holds the ownership lease of every table (an open
//! epoch), so no publish can land between the copy and the switch; publishes wait.
//!
//! A replica that missed epochs while it was down is brought back the same way, but with
//! delta recovery: it fetches from the primary only the versions from the first epoch it
//! missed, and keeps everything older (DESIGN §6, failback). If it fails again midway, the
//! map still lists it as stale from the same epoch, and the next attempt redoes the delta.

use crate::error::{ReplicationError, Result};
use crate::wire::{
    CopyRequest, ExportRequest, PartitionMove, VersionsRequest, ACTION_COPY_PARTITIONS,
};
use crate::NodeId;
use crate::Replication;
use futures::TryStreamExt;
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
    /// Row versions those deltas fetched: only the epochs the replica missed.
    pub delta_versions: u64,
}

/// The running counters behind [`TransferCounts`].
#[derive(Debug, Default)]
pub struct TransferCounters {
    whole_copies: AtomicU64,
    whole_rows: AtomicU64,
    delta_copies: AtomicU64,
    delta_versions: AtomicU64,
}

impl TransferCounters {
    pub fn counts(&self) -> TransferCounts {
        TransferCounts {
            whole_copies: self.whole_copies.load(Ordering::Relaxed),
            whole_rows: self.whole_rows.load(Ordering::Relaxed),
            delta_copies: self.delta_copies.load(Ordering::Relaxed),
            delta_versions: self.delta_versions.load(Ordering::Relaxed),
        }
    }

    fn whole(&self, rows: u64) {
        self.whole_copies.fetch_add(1, Ordering::Relaxed);
        self.whole_rows.fetch_add(rows, Ordering::Relaxed);
    }

    fn delta(&self, versions: u64) {
        self.delta_copies.fetch_add(1, Ordering::Relaxed);
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
pub async fn rebalance(node: &Arc<Replication>, lost: &BTreeSet<NodeId>) -> Result<()> {
    let state = node.meta.view().state.clone();
    let Some(mut wanted) = wanted_map(&state, lost) else {
        return Ok(());
    };
    let tables: Vec<String> = state.tables.keys().cloned().collect();
    let epoch = crate::publish::allocate_epoch(node, tables, None).await?;
    // Copies may take long: heartbeats keep the epoch from timing out while they run.
    let _working = node.work_on(epoch);
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
                Some(first_missed)
                    if current.replicas.contains(replica) && node.settings.delta_recovery =>
                {
                    *first_missed
                }
                None if current.replicas.contains(replica) => continue,
                _ => Epoch::ZERO,
            };
            let Some(source) = current.primary else {
                let _ = abort(node, epoch, "a partition has no readable replica").await;
                return Err(ReplicationError::NoReadableReplica { partition });
            };
            copies.entry(*replica).or_default().push(PartitionMove {
                partition,
                source,
                since,
            });
        }
        // Replicas kept from the current map keep their staleness; copies are complete.
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
    let moved: usize = copies.values().map(Vec::len).sum();
    let leased_at = std::time::Instant::now();
    tracing::info!(%epoch, moved, "rebalancing partitions");
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
            let addr = node.meta.require_addr(target)?;
            let copy = node.clients.action(
                &addr,
                ACTION_COPY_PARTITIONS,
                request,
                Duration::from_secs(3600),
            );
            // The rebalance's epoch leases every table: a target that stops answering
            // (killed, paused, cut off) must not hold every publish for the copy's hour.
            // Once the failure detector declares it failed, the rebalance gives up and
            // is tried again without it.
            let target_failed = node.meta.wait_until_failed(target, Duration::from_secs(3600));
            let reply: std::result::Result<std::result::Result<(), Refusal>, CallError> = tokio::select! {
                reply = copy => reply,
                () = target_failed => Err(CallError::Transport(format!(
                    "node {target} was declared failed while copying"
                ))),
            };
            match reply {
                Ok(Ok(())) => Ok(()),
                Ok(Err(refusal)) => Err(ReplicationError::Refused {
                    node: target,
                    what: "a partition copy",
                    reason: format!("{refusal:?}"),
                }),
                Err(e) => Err(ReplicationError::Unreachable {
                    node: target,
                    addr,
                    reason: e.to_string(),
                }),
            }
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
        })
        .await?;
    tracing::info!(%epoch, moved, elapsed_ms = leased_at.elapsed().as_millis() as u64, "partition map switched");
    Ok(())
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
pub async fn copy_partitions(node: &Arc<Replication>, request: CopyRequest) -> Result<()> {
    // One copy into this node at a time, in the order they arrive (see `copying`).
    let _one_at_a_time = node.copying.lock().await;
    let started = std::time::Instant::now();
    let copied = copy_partitions_now(node, request).await;
    if copied.is_ok() {
        let metrics = tessera_common::metrics::metrics();
        metrics.failbacks.inc();
        tessera_common::metrics::observe_seconds(&metrics.failback_seconds, started.elapsed());
    }
    copied
}

async fn copy_partitions_now(node: &Arc<Replication>, request: CopyRequest) -> Result<()> {
    // The tables must exist here first: wait for the metadata that created them.
    let view = node
        .meta
        .read_linearizable(LINEARIZABLE_READ_PATIENCE)
        .await?;
    for (table, generation) in &request.tables {
        if !view
            .state
            .tables
            .get(table)
            .is_some_and(|d| d.generation == *generation)
        {
            return Err(ReplicationError::UnknownTable {
                table: table.clone(),
                generation: *generation,
                node: node.id(),
            });
        }
    }
    let started = std::time::Instant::now();
    for moved in &request.moves {
        let span = tracing::info_span!(
            "copy",
            partition = moved.partition.0,
            source = moved.source.0,
            since = %moved.since
        );
        let copy = async {
            for (table, generation) in &request.tables {
                // A delta needs every version since the replica left; merges keep those
                // only above the table's retention horizon.
                let delta_possible = moved.since > view.state.retention_horizon(table);
                if moved.since == Epoch::ZERO || !delta_possible {
                    copy_whole(node, moved, table, *generation, request.epoch).await?;
                } else {
                    copy_delta(node, moved, table, *generation, request.epoch).await?;
                }
            }
            Ok::<(), ReplicationError>(())
        };
        tracing::Instrument::instrument(copy, span).await?;
    }
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

fn copy_error(source: NodeId, error: impl std::fmt::Display) -> ReplicationError {
    ReplicationError::Copy {
        from: source,
        reason: error.to_string(),
    }
}

/// A new replica copies a partition by component: it fetches the components it lacks by
/// hash (checked on both ends), plus the versions still in the source's memory.
async fn copy_whole(
    node: &Arc<Replication>,
    moved: &PartitionMove,
    table: &str,
    generation: u64,
    fence: Option<Epoch>,
) -> Result<()> {
    let addr = node.meta.require_addr(moved.source)?;
    let request = ExportRequest {
        table: table.to_string(),
        generation,
        partition: moved.partition,
    };
    let (components, memtable) = crate::wire::export(&node.clients, &addr, &request)
        .await
        .map_err(|e| copy_error(moved.source, e))?;
    let fetched = fetch_missing_components(node, &addr, &components)
        .await
        .map_err(|e| copy_error(moved.source, e))?;
    let rows = components.iter().map(|c| c.rows).sum::<u64>()
        + memtable.iter().map(|b| b.num_rows() as u64).sum::<u64>();
    let (owned, partition) = (table.to_string(), moved.partition);
    node.on_store("installing a copied partition", move |store| {
        store.install_partition_components(&owned, partition, components, fetched, memtable, fence)
    })
    .await?;
    node.transfers.whole(rows);
    tracing::info!(%table, partition = moved.partition.0, source = moved.source.0, rows, "copied a whole partition");
    Ok(())
}

/// The bytes of those of `components` this node lacks, fetched by hash from `addr` (the
/// receiving store checks them against their names before it writes them).
pub(crate) async fn fetch_missing_components(
    node: &Replication,
    addr: &str,
    components: &[ComponentMeta],
) -> std::result::Result<HashMap<ComponentHash, Vec<u8>>, CallError> {
    let mut fetched = HashMap::new();
    for component in components {
        if node.store.has_component(&component.hash) || fetched.contains_key(&component.hash) {
            continue;
        }
        let bytes = crate::wire::component(&node.clients, addr, component.hash).await?;
        fetched.insert(component.hash, bytes);
    }
    Ok(fetched)
}

/// A returning replica fetches only the versions from the first epoch it missed.
async fn copy_delta(
    node: &Arc<Replication>,
    moved: &PartitionMove,
    table: &str,
    generation: u64,
    fence: Option<Epoch>,
) -> Result<()> {
    let addr = node.meta.require_addr(moved.source)?;
    let request = VersionsRequest {
        table: table.to_string(),
        generation,
        partition: moved.partition,
        since: moved.since,
    };
    let versions = node
        .clients
        .get(&addr, &request)
        .await
        .map_err(|e| copy_error(moved.source, e))?
        .try_collect::<Vec<_>>()
        .await
        .map_err(|e| copy_error(moved.source, e))?;
    let fetched = versions.iter().map(|b| b.num_rows() as u64).sum();
    let (owned, partition, since) = (table.to_string(), moved.partition, moved.since);
    node.on_store("installing a partition's missed versions", move |store| {
        store.install_partition_since(&owned, partition, since, versions, fence)
    })
    .await?;
    node.transfers.delta(fetched);
    tracing::info!(%table, partition = moved.partition.0, source = moved.source.0, since = %moved.since, rows = fetched, "copied a partition's missed versions");
    Ok(())
}
