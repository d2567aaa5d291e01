//! Reading a table snapshot.
//!
//! Each storage partition becomes one output partition of the scan. A partition whose rows
//! at the epoch are exactly one duplicate-free component is read straight from Parquet by
//! DataFusion's own reader (statistics pruning, projection and predicate pushdown); any
//! other partition goes through [`VersionedScanExec`], which resolves each key to its newest
//! version at or below the epoch.

use crate::decoded::DecodedComponents;
use crate::error::SqlError;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::stats::Precision;
use datafusion::common::{Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::statistics::StatisticsArgs;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_common::{Epoch, EPOCH_COLUMN, OP_COLUMN};
use tessera_storage::component::read_component;
use tessera_storage::versions::{stored_schema, visible_rows_in_batches, RowOrder};
use tessera_storage::{PartitionSnapshot, TableDef, TableSnapshot};

/// The rows of one partition visible at `epoch`, restricted to `columns` of the stored
/// schema (plus whatever the version resolution needs, dropped again at the end), in
/// batches of at most `batch_rows` rows, in `order`.
#[allow(clippy::too_many_arguments)]
pub fn read_visible_partition(
    components_dir: &Path,
    def: &TableDef,
    epoch: Epoch,
    partition: &PartitionSnapshot,
    columns: &[usize],
    decoded: Option<&DecodedComponents>,
    batch_rows: usize,
    order: RowOrder,
) -> Result<Vec<RecordBatch>, SqlError> {
    let stored = stored_schema(def);
    let epoch_index = stored
        .index_of(EPOCH_COLUMN)
        .expect("stored schema has the epoch column");
    let op_index = stored
        .index_of(OP_COLUMN)
        .expect("stored schema has the op column");
    let mut read: Vec<usize> = columns
        .iter()
        .copied()
        .chain(def.primary_key_indices())
        .chain([epoch_index, op_index])
        .collect();
    read.sort_unstable();
    read.dedup();
    // The first component, if it has one version per key and none above the epoch, is the
    // base the other versions are resolved against: a merge's current component comes
    // first among the live ones. Only the first, and the components in their order: the
    // rows then come in the order the partition's versions were logged in, whatever its
    // layout, so a replica that has not merged (or flushed) yet reads them in the same
    // order (`versions::SplitVersions`), as lineage recovery's re-run scans need. A read
    // below a merge's epochs keeps that order only in key order (`RowOrder::ByKey`).
    let base = partition
        .components
        .first()
        .is_some_and(|c| c.unique_keys && c.max_epoch <= epoch);
    let mut batches = Vec::new();
    let mut base_batches = 0;
    for (i, component) in partition.components.iter().enumerate() {
        match decoded.filter(|cache| cache.admits(component)) {
            Some(cache) => {
                batches.extend(cache.columns(components_dir, def, component, &read)?);
            }
            None => batches.extend(read_component(
                components_dir,
                def,
                &component.hash,
                Some(&read),
            )?),
        }
        if i == 0 && base {
            base_batches = batches.len();
        }
    }
    for batch in &partition.memtable {
        batches.push(batch.project(&read)?);
    }
    let position = |column: usize| {
        read.iter()
            .position(|&c| c == column)
            .expect("read covers every needed column")
    };
    let key: Vec<usize> = def
        .primary_key_indices()
        .into_iter()
        .map(position)
        .collect();
    let visible = visible_rows_in_batches(
        &batches,
        base_batches,
        &key,
        epoch,
        def.append_only,
        batch_rows,
        order,
    )?;
    let output: Vec<usize> = columns.iter().map(|&c| position(c)).collect();
    Ok(visible
        .into_iter()
        .map(|batch| batch.project(&output))
        .collect::<Result<_, _>>()?)
}

/// Scans partitions that need version resolution; one output partition per storage partition.
#[derive(Debug)]
pub struct VersionedScanExec {
    snapshot: Arc<TableSnapshot>,
    partitions: Vec<PartitionSnapshot>,
    /// Columns of the stored schema to output.
    projection: Vec<usize>,
    schema: SchemaRef,
    components_dir: PathBuf,
    /// Where small components are kept decoded (`None`: always read Parquet).
    decoded: Option<Arc<DecodedComponents>>,
    order: RowOrder,
    properties: Arc<PlanProperties>,
}

impl VersionedScanExec {
    pub fn new(
        snapshot: Arc<TableSnapshot>,
        partitions: Vec<PartitionSnapshot>,
        projection: Vec<usize>,
        components_dir: PathBuf,
        decoded: Option<Arc<DecodedComponents>>,
        order: RowOrder,
    ) -> Result<Self> {
        assert!(
            !partitions.is_empty(),
            "a versioned scan covers at least one partition"
        );
        let schema = Arc::new(stored_schema(&snapshot.def).project(&projection)?);
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(partitions.len()),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(VersionedScanExec {
            snapshot,
            partitions,
            projection,
            schema,
            components_dir,
            decoded,
            order,
            properties,
        })
    }
}

impl DisplayAs for VersionedScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let partitions: Vec<String> = self
            .partitions
            .iter()
            .map(|p| p.partition.to_string())
            .collect();
        write!(
            f,
            "VersionedScanExec: table={}, epoch={}, partitions=[{}]",
            self.snapshot.def.name,
            self.snapshot.epoch,
            partitions.join(", ")
        )?;
        if self.order == RowOrder::ByKey {
            write!(f, ", in key order")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for VersionedScanExec {
    crate::leaf_plan_methods!("VersionedScanExec", no_expressions);

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let part = self.partitions.get(partition).cloned().ok_or_else(|| {
            datafusion::error::DataFusionError::Internal(format!(
                "VersionedScanExec has no partition {partition}"
            ))
        })?;
        let snapshot = self.snapshot.clone();
        let projection = self.projection.clone();
        let dir = self.components_dir.clone();
        let decoded = self.decoded.clone();
        let order = self.order;
        let batch_rows = context.session_config().batch_size();
        let read = async move {
            let batches = tokio::task::spawn_blocking(move || {
                read_visible_partition(
                    &dir,
                    &snapshot.def,
                    snapshot.epoch,
                    &part,
                    &projection,
                    decoded.as_deref(),
                    batch_rows,
                    order,
                )
            })
            .await
            .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?
            .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
            Ok::<_, datafusion::error::DataFusionError>(batches)
        };
        let schema = self.schema.clone();
        // One read resolves the partition's versions; its batches then flow one by one.
        let stream = futures::StreamExt::flat_map(futures::stream::once(read), |read| {
            let batches: Vec<Result<RecordBatch>> = match read {
                Ok(batches) => batches.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e)],
            };
            futures::stream::iter(batches)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }

    fn statistics_from_inputs(
        &self,
        _input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        let rows: u64 = match args.partition() {
            Some(i) => self
                .partitions
                .get(i)
                .map(|p| p.estimated_rows())
                .unwrap_or(0),
            None => self.partitions.iter().map(|p| p.estimated_rows()).sum(),
        };
        let mut stats = Statistics::new_unknown(&self.schema);
        stats.num_rows = Precision::Inexact(rows as usize);
        Ok(Arc::new(stats))
    }
}
