//! A compute node's scan: it reads other nodes' partitions through its component cache
//! rather than asking a replica for rows. It asks a replica (the primary first) what its
//! snapshot of the partitions is at the query's epoch ([`ACTION_SNAPSHOT_MANIFEST`]: the
//! components, named by hash, and the row versions still in memory), fetches the
//! components it lacks by hash from that replica into the cache (each checked against its
//! name), and reads them with the same Parquet and versioned readers as a replica does.
//! Whatever goes wrong there (no replica answers, a component was merged away meanwhile)
//! the scan reads rows from the replicas instead.

use crate::cache::{ComponentCache, Pins};
use crate::scan::ScanSpec;
use crate::{Exec, NodeId};
use arrow::array::RecordBatch;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tessera_common::{Epoch, PartitionId};
use tessera_net::Refusal;
use tessera_storage::{ComponentMeta, PartitionSnapshot, TableSnapshot};

pub const ACTION_SNAPSHOT_MANIFEST: &str = "snapshot-manifest";

/// How long a compute node waits for a replica's manifest.
const MANIFEST_PATIENCE: Duration = Duration::from_secs(15);

/// What some partitions of a table are made of on a replica, at an epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ManifestRequest {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
    pub partitions: Vec<PartitionId>,
}

/// One partition of a replica's snapshot: its components, and its row versions still in
/// memory as an Arrow IPC stream (hex), if any.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartitionManifest {
    pub partition: PartitionId,
    pub components: Vec<ComponentMeta>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memtable_ipc_hex: Option<String>,
}

/// Answers a compute node: this replica's snapshot of the partitions, once it has applied
/// the epoch, its cold-standby log replayed and damaged components repaired (a component
/// it cannot vouch for is refused, and the asker tries another replica).
pub async fn serve(
    node: &Arc<Exec>,
    request: ManifestRequest,
) -> Result<Vec<PartitionManifest>, Refusal> {
    let refused = |e: &dyn std::fmt::Display| Refusal::Failed(e.to_string());
    let snapshot = crate::scan::replica_snapshot(
        node,
        &request.table,
        request.generation,
        request.epoch,
        &request.partitions,
    )
    .await
    .map_err(|e| refused(&e))?;
    let store = node.store.clone();
    let (checked, partitions) = (snapshot.clone(), request.partitions.clone());
    let damaged = tokio::task::spawn_blocking(move || {
        crate::scan::find_damaged(&store, &checked, &partitions)
    })
    .await
    .map_err(|e| refused(&e))?;
    let unrepaired = crate::scan::repair_damaged(node, damaged)
        .await
        .map_err(|e| refused(&e))?;
    if !unrepaired.is_empty() {
        return Err(Refusal::Failed(unrepaired.join("; ")));
    }
    snapshot
        .partitions
        .iter()
        .filter(|p| request.partitions.contains(&p.partition))
        .map(|p| {
            Ok(PartitionManifest {
                partition: p.partition,
                components: p.components.clone(),
                memtable_ipc_hex: encode_rows(&p.memtable).map_err(|e| refused(&e))?,
            })
        })
        .collect()
}

/// A partition's row versions in memory, as they travel: an IPC stream in hex, if any.
fn encode_rows(batches: &[RecordBatch]) -> Result<Option<String>, arrow::error::ArrowError> {
    match batches.first() {
        Some(first) => tessera_common::hex::batches_to_ipc_hex(&first.schema(), batches).map(Some),
        None => Ok(None),
    }
}

/// Reads `partitions` through `cache` from the first replica that describes them and
/// supplies the components missing here; `Err` names why none did (the caller then reads
/// rows from the replicas).
#[allow(clippy::too_many_arguments)]
pub async fn read_through_cache(
    node: &Arc<Exec>,
    cache: &Arc<ComponentCache>,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    replicas: &[NodeId],
    predicate: Option<Arc<dyn PhysicalExpr>>,
    context: Arc<TaskContext>,
    reads: &crate::scan::ReadCounts,
) -> Result<SendableRecordBatchStream, String> {
    let mut tried = Vec::new();
    for &replica in replicas {
        // A cached file found damaged when first read is dropped: the second round
        // fetches it again.
        for _round in 0..2 {
            let read = match fill_from(node, cache, spec, partitions, replica).await {
                // The pins hold the snapshot's files until the stream is done.
                Ok((snapshot, pins)) => crate::scan::stream_snapshot(
                    node,
                    cache.as_ref(),
                    spec,
                    partitions,
                    snapshot.clone(),
                    (snapshot, pins),
                    predicate.clone(),
                    context.clone(),
                    reads,
                )
                .map_err(|e| format!("reading cached components: {e}")),
                Err(why) => Err(why),
            };
            match read {
                Ok(stream) => return Ok(stream),
                Err(why) => tried.push(format!("node {replica}: {why}")),
            }
        }
    }
    Err(tried.join("; "))
}

/// `replica`'s snapshot of `partitions`, with every component it names in the cache and
/// pinned there.
async fn fill_from(
    node: &Arc<Exec>,
    cache: &Arc<ComponentCache>,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    replica: NodeId,
) -> Result<(Arc<TableSnapshot>, Pins), String> {
    let addr = node.meta.addr_of(replica).ok_or("no known address")?;
    let request = ManifestRequest {
        table: spec.def.name.clone(),
        generation: spec.def.generation,
        epoch: spec.epoch,
        partitions: partitions.to_vec(),
    };
    let manifests: Vec<PartitionManifest> = node
        .clients
        .action::<_, Result<Vec<PartitionManifest>, Refusal>>(
            &addr,
            ACTION_SNAPSHOT_MANIFEST,
            request,
            MANIFEST_PATIENCE,
        )
        .await
        .map_err(|e| e.to_string())?
        .map_err(|refusal| format!("{refusal:?}"))?;
    let hashes: Vec<_> = manifests
        .iter()
        .flat_map(|m| m.components.iter().map(|c| c.hash))
        .collect();
    let (mut pins, missing) = cache.pin(&hashes);
    for hash in missing {
        let bytes = tessera_replication::wire::component(&node.clients, &addr, hash)
            .await
            .map_err(|e| format!("fetching component {hash}: {e}"))?;
        pins = cache
            .insert_blocking(pins, hash, bytes)
            .await
            .map_err(|e| format!("component {hash} from node {replica}: {e}"))?;
    }
    let mut snapshots = Vec::with_capacity(manifests.len());
    for manifest in manifests {
        snapshots.push(PartitionSnapshot {
            partition: manifest.partition,
            components: manifest.components,
            memtable: match &manifest.memtable_ipc_hex {
                Some(hex) => tessera_common::hex::batches_from_ipc_hex(hex)
                    .map_err(|e| format!("memtable rows: {e}"))?,
                None => Vec::new(),
            },
            rows_in_log: false,
        });
    }
    tracing::debug!(
        table = %spec.def.name,
        epoch = %spec.epoch,
        from = replica.0,
        "reading partitions through the component cache"
    );
    let snapshot = TableSnapshot::detached(spec.def.clone(), spec.epoch, snapshots);
    Ok((Arc::new(snapshot), pins))
}
