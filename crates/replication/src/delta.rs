//! Fetching a returning replica's deltas (DESIGN §6, failback) and installing them in
//! batches.
//!
//! A returning replica refreshes every stale partition of every table: at 64 partitions
//! and a few tables, hundreds of small deltas, each fetched from its primary (which reads
//! the metadata linearizably first) and each installed as a component. Fetched and
//! installed one at a time, with a checkpoint of the whole store after each install, a
//! 1,000-row delta took longer than a full copy whose components the node still held
//! (`tessera bench replication`). So the fetches run a few at a time, and the fetched
//! deltas are installed together, with one checkpoint per batch
//! ([`Store::install_partitions_since`](tessera_storage::Store::install_partitions_since)),
//! a batch being bounded by the bytes it holds so that a long absence's delta does not
//! sit in memory whole.

use crate::error::{ReplicationError, Result};
use crate::stall::Progress;
use crate::wire::{PartitionMove, VersionsRequest};
use crate::Replication;
use arrow::array::RecordBatch;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::PartitionDelta;

/// Delta fetches in flight at once: enough to overlap the round trips (each source reads
/// the metadata linearizably before it answers), few enough not to crowd the sources.
const FETCHES_IN_FLIGHT: usize = 8;

/// Fetched rows installed together, at most (a batch holds at least one delta, however
/// large). The install holds the store's gate, which this node's prepares and commits
/// also take, while it writes the batch's components: a small batch keeps that hold
/// short, and small deltas, whose cost is the checkpoint, still share one.
const INSTALL_BATCH_BYTES: usize = 16 << 20;

/// One partition of one table to refresh from `moved.source`, from epoch `since` on.
#[derive(Debug, Clone)]
pub(crate) struct DeltaFetch {
    pub moved: PartitionMove,
    pub table: String,
    pub generation: u64,
    pub since: Epoch,
}

/// A delta installed: what was asked, and the row versions it fetched (before images not
/// counted).
#[derive(Debug)]
pub(crate) struct Installed {
    pub fetch: DeltaFetch,
    pub versions: u64,
}

/// Fetches each of `fetches` from its source and installs them here, in place of this
/// node's versions from each one's `since` on, with every install fenced at `fence` (see
/// [`Store::install_partitions_since`](tessera_storage::Store::install_partitions_since)).
/// `installed` is called after each batch, with the deltas that batch installed durably.
/// Stops at the first error: the batches before it stay installed.
pub(crate) async fn fetch_and_install(
    node: &Arc<Replication>,
    fetches: Vec<DeltaFetch>,
    fence: Option<Epoch>,
    progress: Option<&Progress>,
    mut installed: impl FnMut(Vec<Installed>),
) -> Result<u64> {
    let mut fetched = futures::stream::iter(fetches)
        .map(|fetch| async move {
            let versions = fetch_delta(node, &fetch, progress).await?;
            Ok::<_, ReplicationError>((fetch, versions))
        })
        .buffered(FETCHES_IN_FLIGHT);
    let mut batch: Vec<(DeltaFetch, Vec<RecordBatch>)> = Vec::new();
    let mut batch_bytes = 0;
    let mut total = 0;
    // A failed fetch ends the fetching, but what was fetched before it is installed.
    let fetching = loop {
        let (fetch, versions) = match fetched.try_next().await {
            Ok(Some(delta)) => delta,
            Ok(None) => break Ok(()),
            Err(error) => break Err(error),
        };
        batch_bytes += versions
            .iter()
            .map(RecordBatch::get_array_memory_size)
            .sum::<usize>();
        batch.push((fetch, versions));
        if batch_bytes >= INSTALL_BATCH_BYTES {
            let done = install(node, std::mem::take(&mut batch), fence).await?;
            total += done.iter().map(|d| d.versions).sum::<u64>();
            installed(done);
            batch_bytes = 0;
        }
    };
    if !batch.is_empty() {
        let done = install(node, batch, fence).await?;
        total += done.iter().map(|d| d.versions).sum::<u64>();
        installed(done);
    }
    fetching.map(|()| total)
}

/// The versions of one delta, fetched from its source.
async fn fetch_delta(
    node: &Arc<Replication>,
    fetch: &DeltaFetch,
    progress: Option<&Progress>,
) -> Result<Vec<RecordBatch>> {
    let source = fetch.moved.source;
    let addr = node.meta.require_addr(source)?;
    let request = VersionsRequest {
        table: fetch.table.clone(),
        generation: fetch.generation,
        partition: fetch.moved.partition,
        since: fetch.since,
    };
    let copy_error = |e: tessera_net::CallError| ReplicationError::Copy {
        from: source,
        reason: e.to_string(),
    };
    let versions = node
        .clients
        .get(&addr, &request)
        .await
        .map_err(copy_error)?
        .inspect_ok(|_| {
            progress.inspect(|p| p.advanced());
        })
        .try_collect::<Vec<_>>()
        .await
        .map_err(copy_error)?;
    progress.inspect(|p| p.advanced());
    Ok(versions)
}

/// Installs a batch of fetched deltas under one hold of the store's gate, with one
/// checkpoint.
async fn install(
    node: &Arc<Replication>,
    batch: Vec<(DeltaFetch, Vec<RecordBatch>)>,
    fence: Option<Epoch>,
) -> Result<Vec<Installed>> {
    let mut done = Vec::with_capacity(batch.len());
    let mut deltas = Vec::with_capacity(batch.len());
    for (fetch, versions) in batch {
        done.push(Installed {
            versions: versions
                .iter()
                .map(tessera_storage::versions::count_versions)
                .sum(),
            fetch: fetch.clone(),
        });
        deltas.push(PartitionDelta {
            table: fetch.table,
            partition: fetch.moved.partition,
            since: fetch.since,
            versions,
        });
    }
    node.on_store("installing partitions' missed versions", move |store| {
        store.install_partitions_since(deltas, fence)
    })
    .await?;
    Ok(done)
}
