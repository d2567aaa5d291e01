//! Small components kept decoded in memory, and the scan that reads them.
//!
//! Every table is spread over the ring's storage partitions (64 by default), so a small
//! table is dozens of small Parquet files where a plain Parquet table is one. Opening a
//! file, planning its row groups and building its reader cost as much for 25 rows as for
//! 100 000: on the small-table TPC-H queries that fixed cost, not the rows, was the time.
//! Components never change (they are named by the hash of their bytes), so a small one's
//! decoded rows can be kept and served again for the price of a column selection.
//!
//! The cache keeps columns, not whole components: a query keeps the columns it reads, so
//! `o_orderkey, o_orderdate` of SF 1 orders (18 MB decoded) do not need room for
//! `o_comment` and the rest (about 250 MB with them), and the tables of one query fit the
//! budget together instead of evicting each other on every run.
//!
//! Plain components (a partition's rows at the epoch are exactly the component's: nothing
//! to resolve) are read through it, and so are the components of partitions whose versions
//! are resolved ([`crate::scan::VersionedScanExec`]). A plain scan goes through it when
//! every one of its components is at most `max_component_bytes` on disk (the fixed cost
//! per file is then most of the scan), or when the columns it reads, decoded, take at most
//! `max_scan_bytes` over all its components (SF 10's customer and part are 64 files of
//! 1-2 MiB, but a query reads two or three of their columns: tens of MB decoded). The
//! second bound keeps one large scan from taking the whole budget and evicting every other
//! table's columns; a scan of a large table's wide columns is read from Parquet as before.
//! All columns together hold at most `budget_bytes` of memory, the least recently read
//! going first. A component is decoded on its first read by a query, never while planning.
//! A scan with a filter skips the kept batches the filter cannot match ([`pruning`]), as
//! the Parquet reader skips row groups.

use crate::error::SqlError;
use arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow::compute::concat_batches;
use arrow::datatypes::SchemaRef;
use datafusion::common::{Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_optimizer::pruning::PruningPredicate;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{
    ExecutionPlanMetricsSet, MetricBuilder, MetricsSet, PruningMetrics,
};
use datafusion::physical_plan::statistics::StatisticsArgs;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use pruning::{KeptBatches, KeptColumn};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tessera_common::config::ExecSettings;
use tessera_common::ComponentHash;
use tessera_storage::component::{read_component, ComponentMeta};
use tessera_storage::versions::stored_schema;
use tessera_storage::{TableDef, TableSnapshot};

/// How much the decoded-component cache may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodedLimits {
    /// The most memory all decoded components hold together, in bytes (0: keep none).
    pub budget_bytes: u64,
    /// The largest component (its Parquet file, in bytes) that is kept decoded; larger
    /// ones are read from Parquet by every query, where the fixed cost per file is small
    /// next to decoding their rows.
    pub max_component_bytes: u64,
    /// The most memory the columns one scan reads may take decoded, over all of its
    /// components, for the scan to go through the cache whatever its files' sizes.
    pub max_scan_bytes: u64,
}

impl From<&ExecSettings> for DecodedLimits {
    fn from(settings: &ExecSettings) -> Self {
        DecodedLimits {
            budget_bytes: settings.decoded_cache_budget(),
            max_component_bytes: settings.decoded_component_max_bytes,
            max_scan_bytes: settings.decoded_scan_max(),
        }
    }
}

/// A quarter of this machine's memory, all of it for one scan (`[exec]`'s defaults).
impl Default for DecodedLimits {
    fn default() -> Self {
        DecodedLimits::from(&ExecSettings::default())
    }
}

/// Decoded columns of small components, by component hash, the table layout they were
/// conformed to, and column of that layout's stored schema.
#[derive(Debug)]
pub struct DecodedComponents {
    limits: DecodedLimits,
    state: Mutex<LruState>,
}

/// A component's column: its hash, the table layout it was conformed to, the column's
/// index in that layout's stored schema.
type DecodedKey = (ComponentHash, u32, usize);

#[derive(Debug, Default)]
struct LruState {
    entries: HashMap<DecodedKey, Entry>,
    /// Entries by the tick of their last read: the first is the least recently read.
    by_use: BTreeMap<u64, DecodedKey>,
    tick: u64,
    held_bytes: u64,
}

#[derive(Debug)]
struct Entry {
    column: Arc<KeptColumn>,
    bytes: u64,
    last_used: u64,
}

/// What the cache holds, for `tessera status`, the metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DecodedUsage {
    /// Components with at least one column kept.
    pub components: usize,
    /// Columns kept, over all components.
    pub columns: usize,
    pub bytes: u64,
    /// The most it may hold (`[exec] decoded_cache_bytes`).
    pub budget_bytes: u64,
}

impl Default for DecodedComponents {
    fn default() -> Self {
        DecodedComponents::new(DecodedLimits::default())
    }
}

impl DecodedComponents {
    pub fn new(limits: DecodedLimits) -> Self {
        DecodedComponents {
            limits,
            state: Mutex::default(),
        }
    }

    /// Whether `component` is small enough on disk to be read through the cache.
    pub fn admits(&self, component: &ComponentMeta) -> bool {
        self.limits.budget_bytes > 0 && component.bytes <= self.limits.max_component_bytes
    }

    /// Whether a scan whose columns take `decoded_bytes` of memory decoded, over all of
    /// its components, may be read through the cache.
    pub fn admits_scan(&self, decoded_bytes: u64) -> bool {
        self.limits.budget_bytes > 0
            && decoded_bytes <= self.limits.max_scan_bytes.min(self.limits.budget_bytes)
    }

    pub fn usage(&self) -> DecodedUsage {
        let state = self.state.lock().expect("decoded cache lock");
        let components: HashSet<(ComponentHash, u32)> = state
            .entries
            .keys()
            .map(|&(hash, layout, _)| (hash, layout))
            .collect();
        DecodedUsage {
            components: components.len(),
            columns: state.entries.len(),
            bytes: state.held_bytes,
            budget_bytes: self.limits.budget_bytes,
        }
    }

    /// Every row of `component` in `def`'s stored schema (see [`Self::columns`]).
    #[cfg(test)]
    pub(crate) fn rows(
        &self,
        components_dir: &std::path::Path,
        def: &TableDef,
        component: &ComponentMeta,
    ) -> Result<Vec<RecordBatch>> {
        let all: Vec<usize> = (0..stored_schema(def).fields().len()).collect();
        self.columns(components_dir, def, component, &all)
    }

    /// `columns` (indices into `def`'s stored schema, each at most once, in any order) of
    /// `component`'s rows, in batches with those columns in that order: the kept ones,
    /// and the rest read from `components_dir` together and kept, each on its own.
    pub(crate) fn columns(
        &self,
        components_dir: &std::path::Path,
        def: &TableDef,
        component: &ComponentMeta,
        columns: &[usize],
    ) -> Result<Vec<RecordBatch>> {
        let kept = self.kept_columns(components_dir, def, component, columns)?;
        let schema = Arc::new(stored_schema(def).project(columns)?);
        batches_of(&schema, component, &kept, None)
    }

    /// [`Self::columns`] in `scan`'s output schema, without the batches its predicate
    /// cannot match (by their bounds).
    fn matching_columns(
        &self,
        scan: &GroupReader,
        component: &ComponentMeta,
        predicate: &PruningPredicate,
        pruned: &PruningMetrics,
    ) -> Result<Vec<RecordBatch>> {
        let def = &scan.snapshot.def;
        let columns = &scan.projection;
        let kept = self.kept_columns(&scan.components_dir, def, component, columns)?;
        let matching = KeptBatches {
            stored: &scan.stored,
            columns,
            kept: &kept,
        }
        .matching(predicate);
        let matched = matching.iter().filter(|&&m| m).count();
        pruned.add_matched(matched);
        pruned.add_pruned(matching.len() - matched);
        batches_of(&scan.schema, component, &kept, Some(&matching))
    }

    /// `columns` of `component`, each kept or read (see [`Self::columns`]).
    fn kept_columns(
        &self,
        components_dir: &std::path::Path,
        def: &TableDef,
        component: &ComponentMeta,
        columns: &[usize],
    ) -> Result<Vec<Arc<KeptColumn>>> {
        let layout = def.layout();
        let mut found: Vec<Option<Arc<KeptColumn>>> = columns
            .iter()
            .map(|&column| self.lookup(&(component.hash, layout, column)))
            .collect();
        let mut missing: Vec<usize> = columns
            .iter()
            .zip(&found)
            .filter(|(_, kept)| kept.is_none())
            .map(|(&column, _)| column)
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if !missing.is_empty() {
            let read = read_component(components_dir, def, &component.hash, Some(&missing))
                .map_err(SqlError::to_datafusion)?;
            for (position, &column) in missing.iter().enumerate() {
                let arrays: Arc<[ArrayRef]> =
                    read.iter().map(|b| b.column(position).clone()).collect();
                let kept = Arc::new(KeptColumn::new(arrays));
                self.insert((component.hash, layout, column), kept.clone());
                for (wanted, slot) in columns.iter().zip(found.iter_mut()) {
                    if *wanted == column {
                        *slot = Some(kept.clone());
                    }
                }
            }
        }
        let found: Vec<Arc<KeptColumn>> = found
            .into_iter()
            .map(|kept| kept.expect("every column kept or read"))
            .collect();
        assert!(
            found
                .iter()
                .all(|k| k.arrays.len() == found[0].arrays.len()),
            "a component's columns are kept in the same batches"
        );
        Ok(found)
    }

    fn lookup(&self, key: &DecodedKey) -> Option<Arc<KeptColumn>> {
        let mut state = self.state.lock().expect("decoded cache lock");
        state.tick += 1;
        let tick = state.tick;
        let entry = state.entries.get_mut(key)?;
        let previous = std::mem::replace(&mut entry.last_used, tick);
        let column = entry.column.clone();
        state.by_use.remove(&previous);
        state.by_use.insert(tick, *key);
        Some(column)
    }

    fn insert(&self, key: DecodedKey, column: Arc<KeptColumn>) {
        let bytes: u64 = column
            .arrays
            .iter()
            .map(|a| a.get_array_memory_size() as u64)
            .sum();
        if bytes > self.limits.budget_bytes {
            return;
        }
        let mut state = self.state.lock().expect("decoded cache lock");
        if state.entries.contains_key(&key) {
            return; // another query decoded it meanwhile
        }
        while state.held_bytes + bytes > self.limits.budget_bytes {
            let (_, oldest) = state.by_use.pop_first().expect("held bytes are in entries");
            let evicted = state.entries.remove(&oldest).expect("indexed entry");
            state.held_bytes -= evicted.bytes;
        }
        state.tick += 1;
        let tick = state.tick;
        state.by_use.insert(tick, key);
        state.entries.insert(
            key,
            Entry {
                column,
                bytes,
                last_used: tick,
            },
        );
        state.held_bytes += bytes;
        debug_assert_eq!(state.entries.len(), state.by_use.len());
    }
}

/// `component`'s rows in batches of `schema` (the kept columns', in order) from their kept
/// values; only the batches `matching` says, where given.
fn batches_of(
    schema: &SchemaRef,
    component: &ComponentMeta,
    kept: &[Arc<KeptColumn>],
    matching: Option<&[bool]>,
) -> Result<Vec<RecordBatch>> {
    let Some(first) = kept.first() else {
        // No column at all (`count(*)`): the rows are only a count.
        let rows = usize::try_from(component.rows).expect("a component's rows fit usize");
        let count = RecordBatchOptions::new().with_row_count(Some(rows));
        return Ok(vec![RecordBatch::try_new_with_options(
            schema.clone(),
            vec![],
            &count,
        )?]);
    };
    (0..first.arrays.len())
        .filter(|&batch| matching.is_none_or(|m| m[batch]))
        .map(|batch| {
            let arrays: Vec<ArrayRef> = kept.iter().map(|k| k.arrays[batch].clone()).collect();
            assert!(
                arrays.iter().all(|a| a.len() == arrays[0].len()),
                "a component's columns are kept in the same batches"
            );
            Ok(RecordBatch::try_new(schema.clone(), arrays)?)
        })
        .collect()
}

/// Scans plain components through the decoded cache: each output partition reads a group
/// of whole components, in batches of about the session's batch size.
#[derive(Debug)]
pub struct DecodedScanExec {
    /// Keeps the components from being deleted until the scan is dropped.
    snapshot: Arc<TableSnapshot>,
    groups: Vec<Vec<ComponentMeta>>,
    components_dir: PathBuf,
    cache: Arc<DecodedComponents>,
    /// Columns of the stored schema to output.
    projection: Vec<usize>,
    limit: Option<usize>,
    /// The table's stored schema, which `projection` and the predicate refer to.
    stored: SchemaRef,
    /// Skips kept batches whose bounds it cannot match (see [`pruning`]).
    predicate: Option<Arc<PruningPredicate>>,
    schema: SchemaRef,
    /// The components' statistics, merged (in the stored schema, all columns).
    statistics: Arc<Statistics>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

/// What a [`DecodedScanExec`] reads.
pub struct DecodedScan {
    pub snapshot: Arc<TableSnapshot>,
    pub groups: Vec<Vec<ComponentMeta>>,
    pub components_dir: PathBuf,
    pub cache: Arc<DecodedComponents>,
    pub projection: Vec<usize>,
    pub limit: Option<usize>,
    /// A predicate over the stored schema, to skip kept batches (never to drop rows);
    /// `None` where it could skip nothing.
    pub predicate: Option<Arc<PruningPredicate>>,
    pub statistics: Statistics,
}

impl DecodedScanExec {
    pub fn new(scan: DecodedScan) -> Result<Self> {
        assert!(
            !scan.groups.is_empty() && scan.groups.iter().all(|g| !g.is_empty()),
            "a decoded scan reads at least one group, each of at least one component"
        );
        let stored = stored_schema(&scan.snapshot.def);
        let schema = Arc::new(stored.project(&scan.projection)?);
        let statistics = Arc::new(scan.statistics.project(Some(&scan.projection)));
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(scan.groups.len()),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(DecodedScanExec {
            snapshot: scan.snapshot,
            groups: scan.groups,
            components_dir: scan.components_dir,
            cache: scan.cache,
            projection: scan.projection,
            limit: scan.limit,
            stored,
            predicate: scan.predicate,
            schema,
            statistics,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }
}

impl DisplayAs for DecodedScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let components: usize = self.groups.iter().map(Vec::len).sum();
        write!(
            f,
            "DecodedScanExec: table={}, epoch={}, components={components}, groups={}",
            self.snapshot.def.name,
            self.snapshot.epoch,
            self.groups.len()
        )?;
        if let Some(limit) = self.limit {
            write!(f, ", limit={limit}")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for DecodedScanExec {
    crate::leaf_plan_methods!("DecodedScanExec", no_expressions);

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let components = self.groups.get(partition).cloned().ok_or_else(|| {
            datafusion::error::DataFusionError::Internal(format!(
                "DecodedScanExec has no partition {partition}"
            ))
        })?;
        let reader = GroupReader {
            snapshot: self.snapshot.clone(),
            components: components.into(),
            components_dir: self.components_dir.clone(),
            cache: self.cache.clone(),
            projection: self.projection.clone(),
            stored: self.stored.clone(),
            schema: self.schema.clone(),
            batch_rows: context.session_config().batch_size(),
            remaining: self.limit,
            predicate: self.predicate.clone().map(|predicate| {
                let pruned = MetricBuilder::new(&self.metrics)
                    .pruning_metrics("batches_pruned_statistics", partition);
                (predicate, pruned)
            }),
            pending: VecDeque::new(),
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            futures::stream::iter(reader),
        )))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn statistics_from_inputs(
        &self,
        _input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        match args.partition() {
            None => Ok(self.statistics.clone()),
            Some(i) => {
                let rows: u64 = self
                    .groups
                    .get(i)
                    .map(|g| g.iter().map(|c| c.rows).sum())
                    .unwrap_or(0);
                let mut stats = Statistics::new_unknown(&self.schema);
                stats.num_rows = datafusion::common::stats::Precision::Exact(rows as usize);
                Ok(Arc::new(stats))
            }
        }
    }
}

/// One output partition: its components' rows, decoded or kept, projected and gathered
/// into batches of about `batch_rows` (small components' rows would otherwise reach the
/// operators above as many tiny batches).
struct GroupReader {
    snapshot: Arc<TableSnapshot>,
    components: VecDeque<ComponentMeta>,
    components_dir: PathBuf,
    cache: Arc<DecodedComponents>,
    projection: Vec<usize>,
    stored: SchemaRef,
    /// `stored` projected: the batches' schema.
    schema: SchemaRef,
    batch_rows: usize,
    /// Rows still wanted under the scan's limit.
    remaining: Option<usize>,
    /// The scan's predicate, and the count of kept batches it skipped and matched.
    predicate: Option<(Arc<PruningPredicate>, PruningMetrics)>,
    /// Batches of the components read so far that have not gone out yet.
    pending: VecDeque<RecordBatch>,
}

impl GroupReader {
    fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        let wanted = self
            .remaining
            .map_or(self.batch_rows, |r| r.min(self.batch_rows));
        if wanted == 0 {
            return Ok(None);
        }
        while self
            .pending
            .iter()
            .map(RecordBatch::num_rows)
            .sum::<usize>()
            < wanted
        {
            let Some(component) = self.components.pop_front() else {
                break;
            };
            let decoded = match &self.predicate {
                Some((predicate, pruned)) => self
                    .cache
                    .matching_columns(self, &component, predicate, pruned)?,
                None => self.cache.columns(
                    &self.components_dir,
                    &self.snapshot.def,
                    &component,
                    &self.projection,
                )?,
            };
            self.pending.extend(decoded);
        }
        // The first pending batch goes out as it is, with the next ones only while they
        // fit in `wanted`: a large component's kept batches (as many rows as a batch is
        // read with) leave unchanged, and only small components' are copied together.
        // Gathering a large component's batches into one copied all its rows into fresh
        // memory on every scan (a 60 M-row lineitem scan through the cache took 1.7-2.3x
        // the time of decoding its Parquet, a third of it in that copy and page zeroing).
        let mut gathered: Vec<RecordBatch> = Vec::new();
        let mut rows = 0;
        while let Some(next) = self.pending.front() {
            if !gathered.is_empty() && rows + next.num_rows() > wanted {
                break;
            }
            let next = self.pending.pop_front().expect("a front batch");
            rows += next.num_rows();
            gathered.push(next);
        }
        let batch = match gathered.len() {
            0 => return Ok(None),
            1 => gathered.pop().expect("one batch"),
            _ => concat_batches(&self.schema, &gathered)?,
        };
        let batch = match self.remaining.as_mut() {
            Some(remaining) => {
                let take = batch.num_rows().min(*remaining);
                *remaining -= take;
                batch.slice(0, take)
            }
            None => batch,
        };
        Ok(Some(batch))
    }
}

impl Iterator for GroupReader {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().transpose()
    }
}

mod pruning;

#[cfg(test)]
pub(crate) mod tests;
