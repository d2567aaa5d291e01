//! A scan of an archived epoch (see `tessera_meta::archive`): the partitions' archived
//! components, rebuilt from any `k` of their fragments into the node's component cache
//! (or found there), read with the same Parquet and versioned readers as a replica's.
//! Fragments found missing or damaged on the way are rebuilt on their holders at once.

use crate::cache::ComponentCache;
use crate::scan::ScanSpec;
use crate::Exec;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use std::sync::Arc;
use tessera_common::PartitionId;
use tessera_meta::archive::ArchivedComponent;
use tessera_net::Refusal;
use tessera_replication::archive::{RebuildFragmentRequest, ACTION_REBUILD_FRAGMENT};
use tessera_storage::{PartitionSnapshot, TableSnapshot};

/// Streams `partitions` of the archived epoch `spec` reads, whose components are `archive`.
pub async fn read_archived(
    node: &Arc<Exec>,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    archive: &[ArchivedComponent],
    predicate: Option<Arc<dyn PhysicalExpr>>,
    context: Arc<TaskContext>,
    reads: &crate::scan::ReadCounts,
) -> DfResult<SendableRecordBatchStream> {
    let cache: &Arc<ComponentCache> = node.cache.as_ref().ok_or_else(|| {
        DataFusionError::Execution("reading the archive needs the node's component cache".into())
    })?;
    let wanted: Vec<&ArchivedComponent> = archive
        .iter()
        .filter(|c| partitions.contains(&c.partition))
        .collect();
    let hashes: Vec<_> = wanted.iter().map(|c| c.component.hash).collect();
    let (mut pins, missing) = cache.pin(&hashes);
    for hash in missing {
        let component = *wanted
            .iter()
            .find(|c| c.component.hash == hash)
            .expect("a missing hash is a wanted one");
        let meta = node.meta.clone();
        let addr_of = move |id| meta.addr_of(id);
        let (bytes, bad) =
            tessera_replication::archive::reconstruct(&node.clients, &addr_of, component)
                .await
                .map_err(DataFusionError::Execution)?;
        if !bad.is_empty() {
            repair_fragments(node, component, &bad);
        }
        pins = cache
            .insert_blocking(pins, hash, bytes)
            .await
            .map_err(|e| DataFusionError::Execution(format!("archived component {hash}: {e}")))?;
    }
    tracing::debug!(table = %spec.def.name, epoch = %spec.epoch, ?partitions, "reading archived partitions");
    let snapshots = partitions
        .iter()
        .map(|&partition| PartitionSnapshot {
            partition,
            components: wanted
                .iter()
                .filter(|c| c.partition == partition)
                .map(|c| c.component.clone())
                .collect(),
            memtable: Vec::new(),
            rows_in_log: false,
        })
        .collect();
    let snapshot = Arc::new(TableSnapshot::detached(
        spec.def.clone(),
        spec.epoch,
        snapshots,
    ));
    crate::scan::stream_snapshot(
        node,
        cache.as_ref(),
        spec,
        partitions,
        snapshot.clone(),
        (snapshot, pins),
        predicate,
        context,
        reads,
    )
}

/// Has each fragment a read found bad rebuilt by its holder, in the background (a holder
/// that is down is left to re-replication).
fn repair_fragments(
    node: &Arc<Exec>,
    component: &ArchivedComponent,
    bad: &[(u32, tessera_common::NodeId, String)],
) {
    for (index, holder, why) in bad {
        tracing::warn!(component = %component.component.hash, index, %holder, %why, "archive fragment unreadable; asking its holder to rebuild it");
        let Some(addr) = node.meta.addr_of(*holder) else {
            continue;
        };
        let request = RebuildFragmentRequest {
            component: component.clone(),
            index: *index,
        };
        let clients = node.clients.clone();
        tokio::spawn(async move {
            let rebuilt = clients
                .action::<_, Result<(), Refusal>>(
                    &addr,
                    ACTION_REBUILD_FRAGMENT,
                    request,
                    std::time::Duration::from_secs(120),
                )
                .await;
            if let Err(error) = rebuilt {
                tracing::debug!(%error, "rebuilding a fragment on its holder failed");
            }
        });
    }
}
