//! The table scan of a cluster query: one output partition per storage partition, read on
//! whichever node runs it: from its own store when it holds a current replica (Parquet
//! with projection and row-group pruning, replaying a cold standby's log first), else from
//! a replica over Flight.

use crate::replica_read::read_remotely;
pub use crate::replica_read::{read_from, ReadRows};
use crate::Exec;
use crate::ExecError;
use crate::NodeId;
use crate::ScanReads;
use arrow::datatypes::SchemaRef;
use datafusion::common::config::TableParquetOptions;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result as DfResult, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricValue, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tessera_common::{ComponentHash, Epoch, PartitionId};
use tessera_sql::provider::{plan_in_id_order, FileGrouping, InIdOrder, ReadLayout, SnapshotScan};
use tessera_sql::SqlError;
use tessera_storage::versions::{stored_user_schema, RowOrder};
use tessera_storage::TableDef;

/// How long a node waits to learn of the query's epoch before it gives up on a scan.
const EPOCH_WAIT: Duration = Duration::from_secs(10);

/// What a scan reads; travels inside plan fragments.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScanSpec {
    pub def: TableDef,
    pub epoch: Epoch,
    /// User column indices to output.
    pub projection: Vec<usize>,
    /// The storage partitions each output partition (channel) reads: partitions with the
    /// same replicas, so that one node holds all of them.
    pub partitions: Vec<Vec<PartitionId>>,
    /// For each output partition, the replicas that hold its partitions, best first: the
    /// primary in the query's snapshot of the partition map, then the other current live
    /// replicas.
    pub replicas: Vec<Vec<NodeId>>,
    pub limit: Option<usize>,
    /// Rows of the whole table, estimated from the partitions the planning node holds.
    pub estimated_rows: Option<usize>,
    /// Read the table's changes from this epoch to `epoch` (a diff) instead of its rows at
    /// `epoch`; `projection` then indexes [`tessera_storage::changes::changes_schema`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changes_since: Option<Epoch>,
    /// The epoch is read from the archive: every partition's archived component (see
    /// `tessera_meta::archive`), not the replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive: Option<Vec<tessera_meta::archive::ArchivedComponent>>,
    /// The ring's partition count, when the scan declares its output partitioned as the
    /// storage is (on the table's partition key, channel `k` holding exactly the
    /// partitions of group `k`): set while the cluster plans with co-location on
    /// (`tessera.colocate`), and declared if the projection keeps every key column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_partitioned: Option<u32>,
    /// The order each storage partition's rows come in (see
    /// `tessera_storage::versions::RowOrder`): by key for a read at an older epoch under
    /// lineage recovery, so that a replica re-running a dead node's channel sends its
    /// batches again however it has merged.
    #[serde(default, skip_serializing_if = "RowOrder::is_logged")]
    pub order: RowOrder,
}

impl ScanSpec {
    /// The partition-key columns in the scan's output, in key order, if the scan declares
    /// its storage partitioning: a scan of rows (not a diff) keeping every key column,
    /// over groups that hold every partition of the ring once.
    fn declared_key_columns(&self, schema: &SchemaRef) -> Option<Vec<Arc<dyn PhysicalExpr>>> {
        let ring = self.key_partitioned?;
        if self.changes_since.is_some() || !covers_ring_once(&self.partitions, ring) {
            return None;
        }
        self.def
            .partition_key_indices()
            .into_iter()
            .map(|column| {
                let position = self.projection.iter().position(|&p| p == column)?;
                let key: Arc<dyn PhysicalExpr> =
                    Arc::new(datafusion::physical_expr::expressions::Column::new(
                        schema.field(position).name(),
                        position,
                    ));
                Some(key)
            })
            .collect()
    }

    /// The columns the scan outputs: the table's, or its diff's.
    pub fn schema(&self) -> DfResult<SchemaRef> {
        let full = match self.changes_since {
            Some(_) => tessera_storage::changes::changes_schema(&self.def),
            None => stored_user_schema(&self.def),
        };
        Ok(Arc::new(full.project(&self.projection)?))
    }
}

/// What the planning node knows of a whole table: rows extrapolated from the partitions
/// it holds, and their components' column statistics (min, max, nulls), over the user
/// columns. Only the optimizer uses them; they do not travel.
pub type TableStatistics = Arc<Statistics>;

#[derive(Debug)]
pub struct DistributedScanExec {
    pub spec: ScanSpec,
    /// Over the stored schema; prunes row groups of plain components (the plan above
    /// still filters every row).
    pub predicate: Option<Arc<dyn PhysicalExpr>>,
    statistics: Option<TableStatistics>,
    node: Arc<Exec>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    /// How each output partition read its storage partitions ([`ReadCounts`]).
    metrics: ExecutionPlanMetricsSet,
}

impl DistributedScanExec {
    pub fn try_new(
        spec: ScanSpec,
        predicate: Option<Arc<dyn PhysicalExpr>>,
        node: Arc<Exec>,
    ) -> DfResult<Self> {
        assert_eq!(
            spec.partitions.len(),
            spec.replicas.len(),
            "every scanned partition names its replicas"
        );
        let schema = spec.schema()?;
        let channels = spec.partitions.len().max(1);
        let partitioning = match spec.declared_key_columns(&schema) {
            Some(keys) => Partitioning::Hash(keys, channels),
            None => Partitioning::UnknownPartitioning(channels),
        };
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            partitioning,
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(DistributedScanExec {
            spec,
            predicate,
            statistics: None,
            node,
            schema,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }
}

/// True if `groups` hold every partition of a ring of `ring` partitions exactly once.
fn covers_ring_once(groups: &[Vec<PartitionId>], ring: u32) -> bool {
    let mut seen = vec![false; ring as usize];
    for partition in groups.iter().flatten() {
        match seen.get_mut(partition.0 as usize) {
            Some(slot) if !*slot => *slot = true,
            _ => return false,
        }
    }
    seen.iter().all(|&s| s)
}

impl DistributedScanExec {
    /// How the scan's output is partitioned, if it declares its storage partitioning.
    pub fn storage_layout(&self) -> Option<crate::colocate::StorageLayout> {
        match self.properties.output_partitioning() {
            Partitioning::Hash(..) => Some(crate::colocate::StorageLayout {
                ring: self.spec.key_partitioned?,
                groups: self.spec.partitions.clone(),
            }),
            _ => None,
        }
    }

    /// The same scan over `groups` of storage partitions, one output partition each, all
    /// held by `replicas` (a rebuilt channel split over several streams, `split.rs`). It
    /// declares no storage partitioning: its groups do not cover the ring.
    pub fn regrouped(
        &self,
        groups: Vec<Vec<PartitionId>>,
        replicas: Vec<NodeId>,
    ) -> DfResult<DistributedScanExec> {
        let mut spec = self.spec.clone();
        spec.replicas = vec![replicas; groups.len()];
        spec.partitions = groups;
        spec.key_partitioned = None;
        DistributedScanExec::try_new(spec, self.predicate.clone(), self.node.clone())
    }

    /// How output partition `partition` (every one, for `None`) read its storage
    /// partitions so far.
    pub fn reads(&self, partition: Option<usize>) -> ScanReads {
        let mut reads = ScanReads::default();
        for metric in self.metrics.clone_inner().iter() {
            if partition.is_some_and(|p| metric.partition() != Some(p)) {
                continue;
            }
            if let MetricValue::Count { name, count } = metric.value() {
                let value = count.value() as u64;
                match name.as_ref() {
                    READ_PARQUET => reads.parquet += value,
                    READ_DECODED => reads.decoded += value,
                    READ_VERSIONED => reads.versioned += value,
                    READ_FILES => reads.files += value,
                    READ_REMOTE => reads.remote += value,
                    _ => {}
                }
            }
        }
        reads
    }

    /// Gives the optimizer the table's statistics (on the planning node).
    pub fn with_statistics(mut self, statistics: Option<TableStatistics>) -> Self {
        self.statistics = statistics;
        self
    }
}

impl DisplayAs for DistributedScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let columns: Vec<&str> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        let epochs = match self.spec.changes_since {
            Some(from) => format!("changes from epoch {from} to epoch {}", self.spec.epoch),
            None => format!("epoch={}", self.spec.epoch),
        };
        write!(
            f,
            "DistributedScanExec: table={}, {epochs}, partitions={} in {} channel(s), columns=[{}]",
            self.spec.def.name,
            self.spec.partitions.iter().map(Vec::len).sum::<usize>(),
            self.spec.partitions.len(),
            columns.join(", ")
        )?;
        if let Some(predicate) = &self.predicate {
            write!(f, ", pruning_predicate={predicate}")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for DistributedScanExec {
    tessera_sql::leaf_plan_methods!("DistributedScanExec");

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        match &self.predicate {
            Some(predicate) => f(predicate),
            None => Ok(TreeNodeRecursion::Continue),
        }
    }

    fn partition_statistics(&self, partition: Option<usize>) -> DfResult<Arc<Statistics>> {
        let mut statistics = match &self.statistics {
            Some(table) => table.as_ref().clone().project(Some(&self.spec.projection)),
            None => Statistics::new_unknown(&self.schema),
        };
        if let Some(rows) = self.spec.estimated_rows {
            statistics.num_rows = Precision::Inexact(rows);
        }
        if partition.is_some() {
            // One channel's share: bounds still hold, counts are a fraction.
            let channels = self.spec.partitions.len().max(1);
            statistics = statistics.to_inexact();
            statistics.num_rows = statistics.num_rows.map(|rows| rows / channels);
            statistics.total_byte_size = statistics.total_byte_size.map(|b| b / channels);
            for column in &mut statistics.column_statistics {
                column.null_count = column.null_count.map(|n| n / channels);
            }
        }
        Ok(Arc::new(statistics))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        if self.spec.partitions.is_empty() && partition == 0 {
            return Ok(Box::pin(RecordBatchStreamAdapter::new(
                self.schema.clone(),
                futures::stream::empty(),
            )));
        }
        let storage_partitions = self
            .spec
            .partitions
            .get(partition)
            .cloned()
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "DistributedScanExec has no partition {partition}"
                ))
            })?;
        let replicas = self.spec.replicas[partition].clone();
        let node = self.node.clone();
        let spec = self.spec.clone();
        let predicate = self.predicate.clone();
        let reads = ReadCounts::new(&self.metrics, partition);
        let open = async move {
            crate::scan_gate::pass().await;
            if let Some(archive) = &spec.archive {
                return crate::archive_scan::read_archived(
                    &node,
                    &spec,
                    &storage_partitions,
                    archive,
                    predicate,
                    context,
                    &reads,
                )
                .await;
            }
            let read_elsewhere = |from: Vec<NodeId>| {
                let (node, spec, partitions, reads) = (&node, &spec, &storage_partitions, &reads);
                async move {
                    let stream = read_remotely(node, spec, partitions, &from).await?;
                    reads.read_elsewhere(partitions.len());
                    Ok::<_, DataFusionError>(stream)
                }
            };
            if spec.changes_since.is_some() && replicas.contains(&node.id()) {
                // A diff is computed by the store, not planned as a Parquet scan: read here
                // like a replica would answer, else from the others.
                let mut ordered = vec![node.id()];
                ordered.extend(replicas.iter().copied().filter(|&r| r != node.id()));
                return read_elsewhere(ordered).await;
            }
            if replicas.contains(&node.id()) {
                let partitions = storage_partitions.clone();
                match read_here(&node, &spec, partitions, predicate, context, &reads).await? {
                    Some(stream) => Ok(stream),
                    None => {
                        // Not held here (any more), or damaged and not repairable by hash:
                        // the rows are read from the other replicas instead.
                        let others: Vec<NodeId> = replicas
                            .iter()
                            .copied()
                            .filter(|&r| r != node.id())
                            .collect();
                        read_elsewhere(others).await
                    }
                }
            } else {
                if let (Some(cache), true, None) =
                    (&node.cache, node.reads_through_cache, spec.changes_since)
                {
                    match crate::remote_snapshot::read_through_cache(
                        &node,
                        cache,
                        &spec,
                        &storage_partitions,
                        &replicas,
                        predicate,
                        context,
                        &reads,
                    )
                    .await
                    {
                        Ok(stream) => return Ok(stream),
                        Err(why) => tracing::warn!(
                            table = %spec.def.name,
                            partitions = ?storage_partitions,
                            %why,
                            "reading rows from the replicas: the component cache could not be filled"
                        ),
                    }
                }
                read_elsewhere(replicas.clone()).await
            }
        };
        let stream = futures::stream::once(open).try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            stream,
        )))
    }
}

/// Reads partitions this node holds: waits for the query's epoch, replays a cold
/// standby's logged rows, replaces any component found damaged or missing with another
/// replica's copy, and streams the snapshot through DataFusion's Parquet reader. `None`
/// if this node no longer holds the partitions at the epoch, or a damaged component
/// could not be replaced: the caller reads elsewhere.
async fn read_here(
    node: &Arc<Exec>,
    spec: &ScanSpec,
    partitions: Vec<PartitionId>,
    predicate: Option<Arc<dyn PhysicalExpr>>,
    context: Arc<TaskContext>,
    reads: &ReadCounts,
) -> DfResult<Option<SendableRecordBatchStream>> {
    let snapshot = match replica_snapshot(
        node,
        &spec.def.name,
        spec.def.generation,
        spec.epoch,
        &partitions,
    )
    .await
    {
        Ok(snapshot) => snapshot,
        Err(ExecError::NotHeldHere { reason, .. }) => {
            tracing::warn!(?partitions, %reason, "reading partitions from other replicas: not held here");
            return Ok(None);
        }
        Err(e) => return Err(DataFusionError::External(Box::new(e))),
    };
    let store = node.store.clone();
    let (table, epoch, wanted) = (spec.def.name.clone(), spec.epoch, partitions.clone());
    let snapshot = tokio::task::spawn_blocking(move || {
        // Which versions this replica holds for the query's partitions: the trail a wrong
        // count leaves (`TESSERA_LOG=tessera_exec::scan=debug`).
        if tracing::enabled!(tracing::Level::DEBUG) {
            let versions: Vec<(u32, u64)> = snapshot
                .partitions
                .iter()
                .filter(|p| wanted.contains(&p.partition))
                .map(|p| {
                    let rows = p.components.iter().map(|c| c.rows).sum::<u64>()
                        + p.memtable.iter().map(|b| b.num_rows() as u64).sum::<u64>();
                    (p.partition.0, rows)
                })
                .collect();
            tracing::debug!(%table, %epoch, ?versions, "reading partitions here");
        }
        let damaged = find_damaged(&store, &snapshot, &wanted);
        Ok::<_, tessera_storage::StorageError>((snapshot, damaged))
    })
    .await
    .map_err(|e| DataFusionError::Execution(format!("scan task failed: {e}")))?
    .map_err(SqlError::to_datafusion)?;
    let (snapshot, damaged) = snapshot;
    let unrepaired = repair_damaged(node, damaged).await?;
    if !unrepaired.is_empty() {
        tracing::warn!(
            ?partitions,
            ?unrepaired,
            "reading partitions from other replicas: damaged here"
        );
        return Ok(None);
    }
    // The snapshot protects its components from deletion until the stream is done.
    let keep = snapshot.clone();
    stream_snapshot(
        node,
        node.store.as_ref(),
        spec,
        &partitions,
        snapshot,
        keep,
        predicate,
        context,
        reads,
    )
    .map(Some)
}

/// Streams `partitions` of `snapshot`, whose component files `files` holds, through
/// DataFusion's Parquet reader and the versioned reader; `keep` (what protects those files)
/// lives until the stream is done.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stream_snapshot<K: Send + Sync + 'static>(
    node: &Arc<Exec>,
    files: &dyn tessera_sql::provider::ComponentFiles,
    spec: &ScanSpec,
    partitions: &[PartitionId],
    snapshot: Arc<tessera_storage::TableSnapshot>,
    keep: K,
    predicate: Option<Arc<dyn PhysicalExpr>>,
    context: Arc<TaskContext>,
    reads: &ReadCounts,
) -> DfResult<SendableRecordBatchStream> {
    let mut parquet = TableParquetOptions::default();
    parquet.global = context.session_config().options().execution.parquet.clone();
    // One storage partition after another, by id, each read by whichever reader its layout
    // here allows. The rows then come in an order no layout changes (see
    // `tessera_sql::scan::read_visible_partition`): a replica re-running a dead node's scan
    // for lineage recovery sends the same rows in the same order, even where it has not yet
    // flushed or merged what the dead node had (read as the plan lists them, the plain
    // partitions would come first).
    let InIdOrder {
        plan,
        reading_order,
        layout,
    } = plan_in_id_order(SnapshotScan {
        store: files,
        snapshot: &snapshot,
        partitions: Some(partitions),
        projection: spec.projection.clone(),
        predicate,
        limit: spec.limit,
        grouping: FileGrouping::InIdRuns,
        statistics: node.queries.statistics(),
        decoded: Some(node.queries.decoded()),
        runtime: &context.runtime_env(),
        parquet,
        order: spec.order,
    })?;
    reads.read_here(layout);
    let schema = plan.schema();
    let stream = futures::stream::iter(reading_order)
        .map(move |i| {
            let _keep = &keep;
            plan.execute(i, context.clone())
        })
        .try_flatten();
    Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
}

const READ_PARQUET: &str = "read_parquet";
const READ_DECODED: &str = "read_decoded";
const READ_VERSIONED: &str = "read_versioned";
const READ_FILES: &str = "read_files";
const READ_REMOTE: &str = "read_remote";

/// One output partition's count of how it read its storage partitions, kept as the scan's
/// DataFusion metrics ([`DistributedScanExec::reads`] adds them up).
pub struct ReadCounts {
    parquet: Count,
    decoded: Count,
    versioned: Count,
    files: Count,
    remote: Count,
}

impl ReadCounts {
    fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> ReadCounts {
        let count = |name: &'static str| MetricBuilder::new(metrics).counter(name, partition);
        ReadCounts {
            parquet: count(READ_PARQUET),
            decoded: count(READ_DECODED),
            versioned: count(READ_VERSIONED),
            files: count(READ_FILES),
            remote: count(READ_REMOTE),
        }
    }

    /// Partitions read from components on this node, as `layout` planned them.
    pub(crate) fn read_here(&self, layout: ReadLayout) {
        self.parquet.add(layout.parquet);
        self.decoded.add(layout.decoded);
        self.versioned.add(layout.versioned);
        self.files.add(layout.files);
    }

    /// Partitions whose rows another node sent.
    fn read_elsewhere(&self, partitions: usize) {
        self.remote.add(partitions);
    }
}

/// Waits until this node has applied `epoch` (and `table`'s creation), then refuses
/// unless its metadata, from there on, says it holds every version of `partitions` up to
/// `epoch`. Every read of this node's own rows starts here: the reader chose this replica
/// from metadata that may be older than ours, and a replica that has since been wiped and
/// taken back, refused as corrupt or moved off a partition must send it elsewhere rather
/// than answer from what it has. It also waits (as long as for the epoch) until our view
/// includes this process's own start, and with it any replacement of this node's data.
pub async fn wait_to_hold(
    node: &Exec,
    table: &str,
    generation: u64,
    epoch: Epoch,
    partitions: &[PartitionId],
) -> Result<(), ExecError> {
    node.meta
        .wait_to_read(table, generation, epoch, EPOCH_WAIT)
        .await
        .map_err(|e| ExecError::Task {
            what: "waiting for the query's epoch",
            reason: e.to_string(),
        })?;
    let me = node.id();
    let not_held = |reason: String| ExecError::NotHeldHere {
        node: me,
        table: table.to_string(),
        epoch,
        reason,
    };
    // A process just started announces itself within moments: wait for that, not refuse.
    let incarnation = node.replication.incarnation();
    let started = |view: &Arc<tessera_meta::MetaView>| {
        view.state
            .nodes
            .get(&me)
            .is_some_and(|n| n.incarnation >= incarnation)
    };
    if !node.meta.wait_until(EPOCH_WAIT, started).await {
        return Err(not_held(format!(
            "its metadata does not show this process started after {EPOCH_WAIT:?} (it may have been taken back empty)"
        )));
    }
    let view = node.meta.view();
    for &partition in partitions {
        view.state
            .holds_through(me, partition, epoch)
            .map_err(not_held)?;
    }
    Ok(())
}

/// This node's snapshot of `table` at `epoch` for reading `wanted`, once it has applied
/// the epoch and found it holds the partitions ([`wait_to_hold`]), with a cold standby's
/// logged rows of those partitions replayed first.
pub(crate) async fn replica_snapshot(
    node: &Arc<Exec>,
    table: &str,
    generation: u64,
    epoch: Epoch,
    wanted: &[PartitionId],
) -> Result<Arc<tessera_storage::TableSnapshot>, ExecError> {
    wait_to_hold(node, table, generation, epoch, wanted).await?;
    let store = node.store.clone();
    let (table, wanted) = (table.to_string(), wanted.to_vec());
    tokio::task::spawn_blocking(move || {
        if store
            .table_def(&table)
            .is_none_or(|d| d.generation != generation)
        {
            return Err(tessera_storage::StorageError::UnknownTable(table));
        }
        // A commit may add logged rows between the replay and the snapshot: go round again.
        loop {
            store.replay_standby(&wanted)?;
            let snapshot = store.snapshot(&table, Some(epoch))?;
            let logged = wanted.iter().any(|p| {
                snapshot
                    .partitions
                    .get(p.0 as usize)
                    .is_some_and(|p| p.rows_in_log)
            });
            if !logged {
                return Ok(snapshot);
            }
        }
    })
    .await
    .map_err(|e| ExecError::Task {
        what: "taking a snapshot",
        reason: e.to_string(),
    })?
    .map_err(ExecError::from)
}

/// A component of a partition this node holds that is damaged or missing here, and why.
pub struct Damaged {
    pub partition: PartitionId,
    pub hash: ComponentHash,
    pub why: String,
}

/// The components of `partitions` in `snapshot` whose bytes here do not hash to their
/// name (bit rot, a torn copy) or are gone. Blocking: it reads them (once per process).
pub fn find_damaged(
    store: &tessera_storage::Store,
    snapshot: &tessera_storage::store::TableSnapshot,
    partitions: &[PartitionId],
) -> Vec<Damaged> {
    snapshot
        .partitions
        .iter()
        .filter(|p| partitions.contains(&p.partition))
        .flat_map(|p| p.components.iter().map(move |c| (p.partition, c.hash)))
        .filter_map(|(partition, hash)| {
            let check = store.verify_component(&hash);
            check.err().map(|e| Damaged {
                partition,
                hash,
                why: e.to_string(),
            })
        })
        .collect()
}

/// Replaces each damaged component with a good copy from another replica of its
/// partition. Returns what could not be replaced (no other replica holds the same
/// component: replicas that flushed on their own hold the same rows in other components),
/// each described; those partitions must be read elsewhere until they are copied again.
pub async fn repair_damaged(node: &Arc<Exec>, damaged: Vec<Damaged>) -> DfResult<Vec<String>> {
    let mut unrepaired = Vec::new();
    for Damaged {
        partition,
        hash,
        why,
    } in damaged
    {
        let replicas = node
            .meta
            .view()
            .state
            .map
            .partitions
            .get(partition.0 as usize)
            .map(|p| p.replicas.clone())
            .unwrap_or_default();
        if let Err(failed) = repair_component(node, hash, &why, &replicas).await {
            unrepaired.push(failed);
        }
    }
    Ok(unrepaired)
}

/// Replaces this node's damaged or missing copy of component `hash` (`why` says what is
/// wrong with it) with the first good copy another replica sends: components are named by
/// their hash, so any replica's copy that hashes right is the same component.
async fn repair_component(
    node: &Arc<Exec>,
    hash: ComponentHash,
    why: &str,
    replicas: &[NodeId],
) -> Result<(), String> {
    let mut tried = Vec::new();
    for &replica in replicas.iter().filter(|&&r| r != node.id()) {
        let Some(addr) = node.meta.addr_of(replica) else {
            continue;
        };
        let fetched = tessera_replication::wire::component(&node.clients, &addr, hash).await;
        let bytes = match fetched {
            Ok(bytes) => bytes,
            Err(e) => {
                tried.push(format!("node {replica}: {e}"));
                continue;
            }
        };
        let store = node.store.clone();
        let repaired = tokio::task::spawn_blocking(move || store.repair_component(&hash, &bytes))
            .await
            .map_err(|e| format!("repair task failed: {e}"))?;
        match repaired {
            Ok(()) => {
                tracing::warn!(%hash, %why, from = replica.0, "replaced a damaged component with a replica's copy");
                return Ok(());
            }
            Err(e) => tried.push(format!("node {replica}: {e}")),
        }
    }
    Err(format!(
        "component {hash} is damaged on node {} ({why}) and no other replica supplied a good copy ({})",
        node.id(),
        if tried.is_empty() { "none was reachable".to_string() } else { tried.join("; ") }
    ))
}
