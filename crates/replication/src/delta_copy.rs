//! Returning replicas' deltas, fetched several at a time and installed in batches.
//!
//! A returning replica's copy is one delta per partition and table it missed. Fetched and
//! installed one after another, each paid a round trip and a checkpoint of the whole store,
//! and a rebalance holding every table's lease waited for all of them in turn (fault run
//! 5301: 70 deltas of about 450 rows each took 17 s, every publish waiting). Here up to
//! [`FETCHES_IN_FLIGHT`] deltas are fetched at once, and what has arrived is installed
//! together, with one checkpoint per batch of up to [`INSTALL_BATCH_BYTES`].

use crate::error::{ReplicationError, Result};
use crate::rebalance::copy_error;
use crate::stall::Progress;
use crate::wire::{PartitionMove, VersionsRequest};
use crate::Replication;
use arrow::array::RecordBatch;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::PartitionDelta;

/// Deltas fetched at once: enough to overlap their round trips (each source reads the
/// metadata linearizably before it answers one), few enough that the worst case, a replica
/// back after a long absence with partition-sized deltas, holds only a few in memory.
pub(crate) const FETCHES_IN_FLIGHT: usize = 4;

/// Fetched versions (in memory) installed together, with one checkpoint: large enough
/// that a rebalance's small deltas share a few, small enough to bound what waits in memory.
pub(crate) const INSTALL_BATCH_BYTES: usize = 64 << 20;

/// One partition's delta to fetch: the versions of `table` (of `generation`) from `since`
/// on, from `moved.source`.
#[derive(Debug, Clone)]
pub(crate) struct DeltaFetch {
    pub moved: PartitionMove,
    pub table: String,
    pub generation: u64,
    pub since: Epoch,
}

/// Fetches every delta of `fetches` and installs them (with the rebalance's `fence`, if
/// any), calling `installed` for each once it is durable here, with the versions it held.
/// Returns the versions fetched in all.
///
/// A failed fetch still installs the deltas fetched before it, then returns its error; a
/// refused install returns its error, and the batch's deltas count as not installed (those
/// the store did install are redone, idempotently, by the next copy).
pub(crate) async fn fetch_and_install_deltas(
    node: &Arc<Replication>,
    fetches: Vec<DeltaFetch>,
    fence: Option<Epoch>,
    progress: Option<&Progress>,
    mut installed: impl FnMut(&DeltaFetch, u64),
) -> Result<u64> {
    let mut arrived = futures::stream::iter(fetches)
        .map(|delta| async move {
            let versions = fetch_delta(node, &delta, progress).await?;
            Ok::<_, ReplicationError>((delta, versions))
        })
        .buffered(FETCHES_IN_FLIGHT);
    let mut batch = Batch::default();
    let mut total = 0;
    let mut failed = None;
    while let Some(result) = arrived.next().await {
        match result {
            Ok((delta, versions)) => {
                batch.add(delta, versions);
                if batch.bytes >= INSTALL_BATCH_BYTES {
                    total += std::mem::take(&mut batch)
                        .install(node, fence, &mut installed)
                        .await?;
                    progress.inspect(|p| p.advanced());
                }
            }
            Err(error) => {
                failed = Some(error);
                break;
            }
        }
    }
    drop(arrived);
    total += batch.install(node, fence, &mut installed).await?;
    match failed {
        Some(error) => Err(error),
        None => Ok(total),
    }
}

/// Deltas fetched and not yet installed.
#[derive(Default)]
struct Batch {
    deltas: Vec<(DeltaFetch, Vec<RecordBatch>)>,
    bytes: usize,
}

impl Batch {
    fn add(&mut self, delta: DeltaFetch, versions: Vec<RecordBatch>) {
        self.bytes += versions
            .iter()
            .map(|b| b.get_array_memory_size())
            .sum::<usize>();
        self.deltas.push((delta, versions));
    }

    /// Installs the batch in one store call; returns the versions it held.
    async fn install(
        self,
        node: &Arc<Replication>,
        fence: Option<Epoch>,
        installed: &mut impl FnMut(&DeltaFetch, u64),
    ) -> Result<u64> {
        if self.deltas.is_empty() {
            return Ok(0);
        }
        let mut counts = Vec::with_capacity(self.deltas.len());
        let mut store_deltas = Vec::with_capacity(self.deltas.len());
        for (delta, versions) in self.deltas {
            let rows = versions.iter().map(|b| b.num_rows() as u64).sum::<u64>();
            store_deltas.push(PartitionDelta {
                table: delta.table.clone(),
                partition: delta.moved.partition,
                since: delta.since,
                versions,
            });
            counts.push((delta, rows));
        }
        node.on_store("installing partitions' missed versions", move |store| {
            store.install_partitions_since(store_deltas, fence)
        })
        .await?;
        let mut total = 0;
        for (delta, rows) in &counts {
            installed(delta, *rows);
            total += rows;
        }
        Ok(total)
    }
}

/// The versions of one partition of `delta.table` from `delta.since` on, from its source.
async fn fetch_delta(
    node: &Arc<Replication>,
    delta: &DeltaFetch,
    progress: Option<&Progress>,
) -> Result<Vec<RecordBatch>> {
    let source = delta.moved.source;
    let addr = node.meta.require_addr(source)?;
    let request = VersionsRequest {
        table: delta.table.clone(),
        generation: delta.generation,
        partition: delta.moved.partition,
        since: delta.since,
    };
    node.clients
        .get(&addr, &request)
        .await
        .map_err(|e| copy_error(source, e))?
        .inspect_ok(|_| {
            progress.inspect(|p| p.advanced());
        })
        .try_collect::<Vec<_>>()
        .await
        .map_err(|e| copy_error(source, e))
}
