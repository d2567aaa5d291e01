//! Reading a scan's partitions from other replicas: the query's planned replicas first,
//! then, if the partitions moved while the query ran, wherever this node's current metadata
//! places them; and the read a replica answers ([`read_from`]).

use crate::scan::{wait_to_hold, ScanSpec};
use crate::{Exec, ExecError, NodeId};
use arrow::array::RecordBatch;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::TryStreamExt;
use std::sync::Arc;
use std::time::Duration;
use tessera_common::{Epoch, PartitionId};
use tessera_storage::versions::RowOrder;
use tessera_storage::TableDef;

/// Reads partitions from the first of the query's replicas that answers. If none can (the
/// partitions moved while the query ran: a node joined, left or was decommissioned, and
/// the old replicas no longer answer for them), each is read from its replicas in this
/// node's current metadata instead.
pub(crate) async fn read_remotely(
    node: &Arc<Exec>,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    replicas: &[NodeId],
) -> DfResult<SendableRecordBatchStream> {
    let schema = spec.schema()?;
    let batches = match read_from_first(node, spec, partitions, replicas).await {
        Ok(batches) => batches,
        Err(planned) => read_where_placed_now(node, spec, partitions, replicas)
            .await
            .map_err(|now| {
                DataFusionError::Execution(format!(
                    "no replica of partitions {partitions:?} of {:?} could be read: {planned}{now}",
                    spec.def.name
                ))
            })?,
    };
    Ok(Box::pin(RecordBatchStreamAdapter::new(
        schema,
        futures::stream::iter(batches.into_iter().map(Ok)),
    )))
}

/// How many times a read re-placed by the current metadata looks again after the
/// metadata moves on: replicas apply a map change moments apart, so the one this node's map
/// names may not know yet that it holds a partition.
const REPLACED_READ_TRIES: usize = 3;
/// How long such a read waits for the metadata to move on before it looks again.
const MAP_CHANGE_WAIT: Duration = Duration::from_secs(2);

/// The rows of `partitions` from the first of `replicas` that answers; `Err` names the
/// last refusal.
async fn read_from_first(
    node: &Arc<Exec>,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    replicas: &[NodeId],
) -> Result<Vec<RecordBatch>, String> {
    let mut last = format!(
        "partitions {partitions:?} have no live replica holding epoch {}",
        spec.epoch
    );
    for &replica in replicas {
        let read = ReadRows {
            epoch: spec.epoch,
            changes_since: spec.changes_since,
            order: spec.order,
        };
        match read_from(node, replica, &spec.def, read, partitions, &spec.projection).await {
            Ok(batches) => return Ok(batches),
            Err(error) => {
                if matches!(error, ExecError::Unreachable { .. }) {
                    node.suspect(replica);
                }
                last = error.to_string();
            }
        }
    }
    Err(last)
}

/// Reads `partitions` from where this node's current metadata places them, for a read
/// whose planned `replicas` could not serve them. Consecutive partitions with the same
/// readers are read together, in id order, so the rows come as one replica's read gives
/// them. `Err` (to append to the planned read's error) if the partitions did not move, or
/// no current reader answered within a few metadata changes.
async fn read_where_placed_now(
    node: &Arc<Exec>,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    planned: &[NodeId],
) -> Result<Vec<RecordBatch>, String> {
    let mut view = node.meta.view();
    let mut last = String::new();
    for _ in 0..REPLACED_READ_TRIES {
        let runs = runs_by_readers(&view.state, partitions, spec.epoch, node.id());
        if let [(readers, _)] = runs.as_slice() {
            if readers.iter().all(|r| planned.contains(r)) {
                // Nothing moved: the planned replicas' refusal stands.
                return Err(last);
            }
        }
        tracing::warn!(
            table = %spec.def.name,
            epoch = %spec.epoch,
            ?partitions,
            ?runs,
            "reading partitions where the current metadata places them: the query's replicas no longer serve them"
        );
        match read_runs(node, spec, &runs).await {
            Ok(batches) => return Ok(batches),
            Err(why) => last = format!("; where the metadata now places them: {why}"),
        }
        let seen = view.applied_index;
        node.meta
            .wait_until(MAP_CHANGE_WAIT, |v| v.applied_index > seen)
            .await;
        view = node.meta.view();
    }
    Err(last)
}

/// `partitions` in id order, in runs of consecutive partitions with the same readers at
/// `epoch` (this node first among them, as its read needs no network).
fn runs_by_readers(
    state: &tessera_meta::MetaState,
    partitions: &[PartitionId],
    epoch: Epoch,
    me: NodeId,
) -> Vec<(Vec<NodeId>, Vec<PartitionId>)> {
    let mut sorted = partitions.to_vec();
    sorted.sort();
    let mut runs: Vec<(Vec<NodeId>, Vec<PartitionId>)> = Vec::new();
    for partition in sorted {
        let mut readers = state.readers_at(partition, epoch);
        if let Some(at) = readers.iter().position(|&r| r == me) {
            readers[..=at].rotate_right(1);
        }
        match runs.last_mut() {
            Some((held_by, run)) if *held_by == readers => run.push(partition),
            _ => runs.push((readers, vec![partition])),
        }
    }
    runs
}

async fn read_runs(
    node: &Arc<Exec>,
    spec: &ScanSpec,
    runs: &[(Vec<NodeId>, Vec<PartitionId>)],
) -> Result<Vec<RecordBatch>, String> {
    let mut batches = Vec::new();
    for (readers, run) in runs {
        batches.extend(read_from_first(node, spec, run, readers).await?);
    }
    Ok(batches)
}

/// What a read of partitions returns: the live rows at `epoch`, or with `changes_since`
/// the changes from that epoch to `epoch`.
#[derive(Debug, Clone, Copy)]
pub struct ReadRows {
    pub epoch: Epoch,
    pub changes_since: Option<Epoch>,
    /// The order each partition's rows come in.
    pub order: RowOrder,
}

impl ReadRows {
    /// The live rows at `epoch`.
    pub fn at(epoch: Epoch) -> ReadRows {
        ReadRows {
            epoch,
            changes_since: None,
            order: RowOrder::Logged,
        }
    }
}

/// The live rows (or changes) of `partitions` held by node `from` (this node or another).
pub async fn read_from(
    node: &Arc<Exec>,
    from: NodeId,
    def: &TableDef,
    read: ReadRows,
    partitions: &[PartitionId],
    columns: &[usize],
) -> Result<Vec<RecordBatch>, ExecError> {
    let ReadRows {
        epoch,
        changes_since,
        order,
    } = read;
    if from == node.id() {
        wait_to_hold(node, &def.name, def.generation, epoch, partitions).await?;
        let (store, def, partitions, columns) = (
            node.store.clone(),
            def.clone(),
            partitions.to_vec(),
            columns.to_vec(),
        );
        return tokio::task::spawn_blocking(move || {
            tessera_sql::backend::read_local(
                &store,
                &def,
                Some(epoch),
                changes_since,
                &partitions,
                &columns,
                order,
            )
        })
        .await
        .map_err(|e| ExecError::Task {
            what: "reading local partitions",
            reason: e.to_string(),
        })?
        .map_err(ExecError::from);
    }
    let addr = node
        .meta
        .addr_of(from)
        .ok_or_else(|| ExecError::Unreachable {
            node: from,
            addr: "?".into(),
            reason: "no known address".into(),
        })?;
    let unreachable = |reason: String| ExecError::Unreachable {
        node: from,
        addr: addr.clone(),
        reason,
    };
    let request = crate::wire::ScanRequest {
        table: def.name.clone(),
        generation: def.generation,
        epoch,
        partitions: partitions.to_vec(),
        columns: columns.to_vec(),
        changes_since,
        order,
    };
    let classify = |e: tessera_net::CallError| {
        if e.is_transport() {
            unreachable(e.to_string())
        } else {
            ExecError::Refused {
                node: from,
                error: e,
            }
        }
    };
    let stream = node.clients.get(&addr, &request).await.map_err(classify)?;
    stream.map_err(classify).try_collect().await
}
