//! A rebalance's partition copies, fetched a few at a time and installed in batches.
//!
//! A returning replica refreshes every stale partition of every table, and a new replica
//! copies every partition it takes on: at 64 partitions and a few tables, hundreds of
//! small copies, each fetched from its source (which reads the metadata linearizably
//! first) and each installed with a checkpoint of the whole store. Fetched and installed
//! one at a time, a 1,000-row failback by delta took longer than a full copy whose
//! components the node still held (`tessera bench replication`: 691 against 436 ms); the
//! returning node wrote two checkpoints per delta. So the fetches run a few at a time, and
//! what they fetched is installed together, under one hold of the store's gate and with
//! one checkpoint per batch
//! ([`Store::install_partitions_since`](tessera_storage::Store::install_partitions_since),
//! [`Store::install_partitions_components`](tessera_storage::Store::install_partitions_components)),
//! a batch being bounded by the bytes it holds, so that a long absence's delta or a large
//! partition does not sit in memory whole.

use crate::error::{ReplicationError, Result};
use crate::stall::Progress;
use crate::wire::{PartitionMove, VersionsRequest};
use crate::Replication;
use arrow::array::RecordBatch;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::{PartitionCopy, PartitionDelta};

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

/// Fetches each delta of `fetches` from its source and installs them here, in place of this
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
    let mut batches = Batches::new(
        fetches,
        |fetch| async move {
            let versions = fetch_delta(node, &fetch, progress).await?;
            Ok((fetch, versions))
        },
        |(_, versions): &(DeltaFetch, Vec<RecordBatch>)| {
            versions
                .iter()
                .map(RecordBatch::get_array_memory_size)
                .sum()
        },
    );
    let mut total = 0;
    while let Some(batch) = batches.next().await? {
        let done = install(node, batch, fence).await?;
        total += done.iter().map(|d| d.versions).sum::<u64>();
        installed(done);
    }
    Ok(total)
}

/// What `fetch` gets for each of a list of items, [`FETCHES_IN_FLIGHT`] at a time, handed
/// out in their order in batches of about [`INSTALL_BATCH_BYTES`] (as `bytes` counts
/// them). A failed fetch ends the fetching, but the batch fetched before it comes first.
struct Batches<'a, R, B> {
    fetched: BoxStream<'a, Result<R>>,
    bytes: B,
    failed: Option<ReplicationError>,
}

impl<'a, R: Send + 'a, B: Fn(&R) -> usize> Batches<'a, R, B> {
    fn new<T, F>(items: Vec<T>, fetch: impl Fn(T) -> F + Send + 'a, bytes: B) -> Self
    where
        T: Send + 'a,
        F: std::future::Future<Output = Result<R>> + Send + 'a,
    {
        Batches {
            fetched: futures::stream::iter(items)
                .map(fetch)
                .buffered(FETCHES_IN_FLIGHT)
                .boxed(),
            bytes,
            failed: None,
        }
    }

    /// The next batch; `None` once every item was fetched and handed out.
    async fn next(&mut self) -> Result<Option<Vec<R>>> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        let (mut batch, mut batch_bytes) = (Vec::new(), 0);
        while batch_bytes < INSTALL_BATCH_BYTES {
            match self.fetched.next().await {
                Some(Ok(fetched)) => {
                    batch_bytes += (self.bytes)(&fetched);
                    batch.push(fetched);
                }
                Some(Err(error)) if batch.is_empty() => return Err(error),
                Some(Err(error)) => {
                    self.failed = Some(error);
                    break;
                }
                None => break,
            }
        }
        Ok((!batch.is_empty()).then_some(batch))
    }
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
        let counted = versions
            .iter()
            .map(tessera_storage::versions::count_versions)
            .sum();
        deltas.push(PartitionDelta {
            table: fetch.table.clone(),
            partition: fetch.moved.partition,
            since: fetch.since,
            versions,
        });
        done.push(Installed {
            fetch,
            versions: counted,
        });
    }
    node.on_store("installing partitions' missed versions", move |store| {
        store.install_partitions_since(deltas, fence)
    })
    .await?;
    Ok(done)
}

/// One partition of one table a new replica copies whole from `moved.source`.
#[derive(Debug, Clone)]
pub(crate) struct WholeCopy {
    pub moved: PartitionMove,
    pub table: String,
    pub generation: u64,
}

/// Copies each of `copies` by component: its export from its source (components and
/// in-memory versions), the components this node lacks fetched by hash (checked on both
/// ends), installed in batches, each install fenced at `fence`.
pub(crate) async fn copy_whole(
    node: &Arc<Replication>,
    copies: Vec<WholeCopy>,
    fence: Option<Epoch>,
    progress: &Progress,
) -> Result<()> {
    let mut batches = Batches::new(
        copies,
        |copy| async move {
            let (components, memtable, fetched) = crate::rebalance::export_and_fetch(
                node,
                &copy.moved,
                &copy.table,
                copy.generation,
                Some(progress),
            )
            .await?;
            progress.advanced();
            Ok((
                copy.moved,
                PartitionCopy {
                    table: copy.table,
                    partition: copy.moved.partition,
                    components,
                    fetched,
                    memtable,
                },
            ))
        },
        |(_, copy): &(PartitionMove, PartitionCopy)| {
            copy.fetched.values().map(Vec::len).sum::<usize>()
                + copy
                    .memtable
                    .iter()
                    .map(RecordBatch::get_array_memory_size)
                    .sum::<usize>()
        },
    );
    while let Some(batch) = batches.next().await? {
        let mut copied = Vec::with_capacity(batch.len());
        let mut copies = Vec::with_capacity(batch.len());
        for (moved, copy) in batch {
            let rows = copy.components.iter().map(|c| c.rows).sum::<u64>()
                + copy
                    .memtable
                    .iter()
                    .map(|b| b.num_rows() as u64)
                    .sum::<u64>();
            copied.push((moved, copy.table.clone(), rows, copy.fetched.len() as u64));
            copies.push(copy);
        }
        node.on_store("installing copied partitions", move |store| {
            store.install_partitions_components(copies, fence)
        })
        .await?;
        for (moved, table, rows, fetched_components) in copied {
            node.transfers.whole(rows, fetched_components);
            tracing::info!(%table, partition = moved.partition.0, source = moved.source.0, rows, "copied a whole partition");
        }
    }
    Ok(())
}
