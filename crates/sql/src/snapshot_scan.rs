//! Planning the read of a table snapshot: which storage partitions DataFusion's own
//! Parquet reader (or the decoded cache) can read as they are, which need version
//! resolution ([`VersionedScanExec`]), and how the files are grouped into output
//! partitions.

use crate::decoded::{DecodedComponents, DecodedScan, DecodedScanExec};
use crate::error::SqlError;
use crate::provider::{ComponentFiles, ComponentStatistics};
use crate::scan::VersionedScanExec;
use datafusion::common::config::TableParquetOptions;
use datafusion::common::stats::Precision;
use datafusion::common::{Result, ScalarValue, Statistics};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::CachedParquetFileReaderFactory;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::pruning::PruningPredicateBuilder;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use std::cmp::Ordering;
use std::sync::Arc;
use tessera_common::PartitionId;
use tessera_storage::component::{component_path, ComponentMeta};
use tessera_storage::versions::{stored_schema, RowOrder};
use tessera_storage::{PartitionSnapshot, TableDef, TableSnapshot};

/// How plain components are grouped into output partitions.
#[derive(Debug, Clone, Copy)]
pub enum FileGrouping {
    /// One output partition per storage partition.
    PerStoragePartition,
    /// Packed into at most this many groups of about equal bytes.
    Packed(usize),
    /// By storage partition id: consecutive partitions the plain reader takes share one
    /// group, their files in id order; a partition that needs version resolution ends
    /// the run (see [`plan_in_id_order`]).
    InIdRuns,
}

/// What to read of a table snapshot, and how.
pub struct SnapshotScan<'a> {
    /// Where the snapshot's component files are.
    pub store: &'a dyn ComponentFiles,
    pub snapshot: &'a Arc<TableSnapshot>,
    /// The storage partitions to read (every one if `None`).
    pub partitions: Option<&'a [PartitionId]>,
    /// User column indices to return.
    pub projection: Vec<usize>,
    /// A predicate over the stored schema, used to prune plain components' row groups
    /// (never to drop rows: the plan above still filters).
    pub predicate: Option<Arc<dyn PhysicalExpr>>,
    pub limit: Option<usize>,
    pub grouping: FileGrouping,
    pub statistics: &'a ComponentStatistics,
    /// Where small plain components are kept decoded (`None`: always read Parquet).
    pub decoded: Option<&'a Arc<DecodedComponents>>,
    pub runtime: &'a Arc<RuntimeEnv>,
    pub parquet: TableParquetOptions,
    /// The order each storage partition's rows come in. [`RowOrder::ByKey`] sends every
    /// partition of a keyed table through version resolution, which sorts them: the plain
    /// readers give the order the rows were written in.
    pub order: RowOrder,
}

/// The physical plan that reads `scan`'s partitions of a snapshot: partitions whose
/// components can be read as written ([`read_as_written`]) go to DataFusion's Parquet scan
/// (projection, pruning by the predicate, the runtime's footer cache), or, when every such
/// component is small or the columns read are small decoded, to the decoded cache
/// ([`DecodedScanExec`]); the rest through
/// [`VersionedScanExec`]. Every component read is verified against its hash first.
pub fn plan_snapshot_scan(scan: SnapshotScan<'_>) -> Result<Arc<dyn ExecutionPlan>> {
    Ok(plan_readers(scan)?.plan)
}

/// A scan's plan and the order to read its output partitions in so that the storage
/// partitions come one after another, by id.
pub struct InIdOrder {
    pub plan: Arc<dyn ExecutionPlan>,
    /// The plan's output partitions, in the order of the storage partitions they read.
    pub reading_order: Vec<usize>,
    /// Which reader takes how many storage partitions, and their component files.
    pub layout: ReadLayout,
}

/// How a snapshot scan reads its storage partitions: each by exactly one reader.
/// `EXPLAIN ANALYZE` shows it per channel, since the same query reads differently from a
/// freshly loaded table (many components, versioned) than after its merges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadLayout {
    /// Partitions read as written through DataFusion's Parquet reader.
    pub parquet: usize,
    /// Partitions read as written from the decoded cache (all their components small, or
    /// the columns read small decoded).
    pub decoded: usize,
    /// Partitions whose versions are resolved as they are read ([`VersionedScanExec`]).
    pub versioned: usize,
    /// The component files of all of them.
    pub files: usize,
}

/// [`plan_snapshot_scan`] grouped [`FileGrouping::InIdRuns`] (whatever `scan` asks), and
/// the order that reads the storage partitions by id. The plan puts the partitions the
/// plain reader takes before those that need version resolution, and which those are
/// differs from replica to replica; read in this order, a partition's place in the output
/// does not. Where every partition is plain (the usual case once a load has settled),
/// they are one group, read as one stream of files.
pub fn plan_in_id_order(mut scan: SnapshotScan<'_>) -> Result<InIdOrder> {
    scan.grouping = FileGrouping::InIdRuns;
    let Readers {
        plan,
        plain,
        versioned,
        layout,
    } = plan_readers(scan)?;
    let mut by_id: Vec<(PartitionId, usize)> = plain
        .into_iter()
        .chain(versioned)
        .enumerate()
        .map(|(output, first)| (first, output))
        .collect();
    by_id.sort_unstable();
    let reading_order: Vec<usize> = by_id.into_iter().map(|(_, output)| output).collect();
    assert!(
        reading_order.is_empty()
            || reading_order.len() == plan.output_partitioning().partition_count(),
        "every output partition is read once"
    );
    Ok(InIdOrder {
        plan,
        reading_order,
        layout,
    })
}

/// A snapshot scan's plan, and, for each output partition of its plain and of its
/// versioned reader, the first storage partition it reads (meaningful when the plain
/// groups are storage partitions or runs of them).
struct Readers {
    plan: Arc<dyn ExecutionPlan>,
    plain: Vec<PartitionId>,
    versioned: Vec<PartitionId>,
    layout: ReadLayout,
}

fn plan_readers(scan: SnapshotScan<'_>) -> Result<Readers> {
    let SnapshotScan {
        store,
        snapshot,
        partitions,
        projection,
        predicate,
        limit,
        grouping,
        statistics,
        decoded,
        runtime,
        parquet,
        order,
    } = scan;
    let epoch = snapshot.epoch;
    let def = &snapshot.def;
    let stored = stored_schema(def);
    let wanted = |p: &PartitionSnapshot| partitions.is_none_or(|only| only.contains(&p.partition));
    // Per storage partition read as plain Parquet, its components.
    let mut plain: Vec<Vec<ComponentMeta>> = Vec::new();
    let mut versioned = Vec::new();
    let (mut plain_ids, mut versioned_ids) = (Vec::new(), Vec::new());
    // Per plain partition, the run of consecutive plain partitions it belongs to.
    let (mut plain_runs, mut run, mut in_run) = (Vec::new(), 0usize, false);
    for partition in snapshot
        .partitions
        .iter()
        .filter(|p| !p.is_empty() && wanted(p))
    {
        for component in &partition.components {
            store
                .verify(&component.hash)
                .map_err(SqlError::to_datafusion)?;
        }
        let as_written = match (order, def.append_only) {
            (RowOrder::ByKey, false) => None,
            _ => read_as_written(partition, epoch, def, store, statistics)?,
        };
        match as_written {
            Some(components) => {
                plain.push(components.to_vec());
                plain_ids.push(partition.partition);
                plain_runs.push(run);
                in_run = true;
            }
            None => {
                versioned.push(partition.clone());
                versioned_ids.push(partition.partition);
                run += usize::from(in_run);
                in_run = false;
            }
        }
    }
    let mut children: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
    // A table's plain components are read decoded all or none (all small on disk, or the
    // columns read small decoded over all of them): mixing the two readers would double
    // the scan's output partitions.
    // Every component's statistics, merged once for whichever reader takes them.
    let file_statistics = plain
        .iter()
        .flatten()
        .map(|c| statistics.get(store, &c.hash, &snapshot.def))
        .collect::<Result<Vec<_>>>()?;
    let merged_statistics =
        Statistics::try_merge_iter(file_statistics.iter().map(|s| s.as_ref()), &stored)?;
    let plain_decoded = decoded.filter(|cache| {
        plain.iter().flatten().all(|c| cache.admits(c))
            || decoded_bytes(&merged_statistics, &projection, &stored)
                .is_some_and(|bytes| cache.admits_scan(bytes))
    });
    let plain_read_decoded = plain_decoded.is_some();
    let layout = ReadLayout {
        parquet: if plain_read_decoded { 0 } else { plain.len() },
        decoded: if plain_read_decoded { plain.len() } else { 0 },
        versioned: versioned.len(),
        files: plain.iter().map(Vec::len).sum::<usize>()
            + versioned.iter().map(|p| p.components.len()).sum::<usize>(),
    };
    if let (Some(cache), false) = (plain_decoded, plain.is_empty()) {
        children.push(Arc::new(DecodedScanExec::new(DecodedScan {
            snapshot: snapshot.clone(),
            groups: group_files(plain, grouping, &plain_runs, |c| c.bytes),
            components_dir: store.dir().to_path_buf(),
            cache: cache.clone(),
            projection: projection.clone(),
            limit,
            predicate: predicate.clone().and_then(|predicate| {
                PruningPredicateBuilder::new()
                    .with_file_schema(stored.clone())
                    .build(predicate)
            }),
            statistics: merged_statistics,
        })?));
    } else if !plain.is_empty() {
        // The same reader settings as DataFusion's own Parquet tables: the session's
        // Parquet options and the runtime's footer cache (components never change, so a
        // cached footer is always valid).
        let object_store = runtime.object_store(ObjectStoreUrl::local_filesystem())?;
        let footer_cache = runtime.cache_manager.get_file_metadata_cache();
        let mut options = parquet;
        // Components are written with one row group per ~128k rows and are read whole
        // or pruned by row-group statistics; the page index would cost a read per file
        // per query for little pruning.
        options.global.enable_page_index = false;
        // Components are written without bloom filters: looking for them costs a predicate
        // evaluation per row group per query (about 0.1 ms each, 6 ms of a Q6 at SF 1)
        // and can prune nothing.
        options.global.bloom_filter_on_read = false;
        // Filters stay above the scan (the session's `pushdown_filters`, off by default):
        // evaluating them inside the Parquet decoder, with the hash joins' dynamic filters,
        // made TPC-H SF 10's Q3, Q4, Q9 and Q13 1.2-1.5x slower on a 2-core machine
        // (Q4 1039 -> 1557 ms, Q9 4984 -> 7067 ms; Q22 unchanged).
        let mut source = ParquetSource::new(stored.clone())
            .with_table_parquet_options(options)
            .with_parquet_file_reader_factory(Arc::new(CachedParquetFileReaderFactory::new(
                object_store,
                footer_cache,
            )));
        if let Some(predicate) = predicate {
            source = source.with_predicate(predicate);
        }
        let mut file_statistics = file_statistics.into_iter();
        let files = plain
            .iter()
            .map(|components| {
                components
                    .iter()
                    .map(|component| {
                        let stats = file_statistics.next().expect("one per component");
                        let path = component_path(store.dir(), &component.hash);
                        let location = path.to_string_lossy().trim_start_matches('/').to_string();
                        PartitionedFile::new(location, component.bytes).with_statistics(stats)
                    })
                    .collect()
            })
            .collect();
        let groups = group_files(files, grouping, &plain_runs, |f| f.object_meta.size)
            .into_iter()
            .map(FileGroup::new)
            .collect();
        // Groups that are storage partitions (or runs of them) are read each by its own
        // output partition, its files in order: DataFusion's work stealing would otherwise
        // let the first output partition executed take every group's files.
        let by_storage_partition = !matches!(grouping, FileGrouping::Packed(_));
        let config =
            FileScanConfigBuilder::new(ObjectStoreUrl::local_filesystem(), Arc::new(source))
                .with_file_groups(groups)
                .with_statistics(merged_statistics)
                .with_projection_indices(Some(projection.clone()))?
                .with_limit(limit)
                .with_preserve_order(by_storage_partition)
                .build();
        children.push(DataSourceExec::from_data_source(config));
    }
    if !versioned.is_empty() {
        let dir = store.dir().to_path_buf();
        children.push(Arc::new(VersionedScanExec::new(
            snapshot.clone(),
            versioned,
            projection.clone(),
            dir,
            decoded.cloned(),
            order,
        )?));
    }
    let plan = if children.is_empty() {
        Arc::new(EmptyExec::new(Arc::new(stored.project(&projection)?)))
    } else {
        UnionExec::try_new(children)?
    };
    // The first storage partition of each plain group.
    let plain_firsts = plain_ids
        .into_iter()
        .enumerate()
        .filter(|&(i, _)| starts_group(grouping, &plain_runs, i))
        .map(|(_, id)| id)
        .collect();
    Ok(Readers {
        plan,
        plain: plain_firsts,
        versioned: versioned_ids,
        layout,
    })
}

/// About how much memory `projection`'s columns (of the stored schema) take decoded, given
/// the scan's components' merged `statistics`; `None` where a size is not known.
/// DataFusion's statistics give a fixed-width column's size exactly and a variable-width
/// one's as its uncompressed Parquet bytes, which leave out the views or offsets every
/// row has once decoded (and, where the column is dictionary-encoded, nearly all of it).
fn decoded_bytes(
    statistics: &Statistics,
    projection: &[usize],
    stored: &arrow::datatypes::Schema,
) -> Option<u64> {
    let rows = *statistics.num_rows.get_value()? as u64;
    projection
        .iter()
        .map(|&column| {
            use arrow::datatypes::DataType::*;
            let per_row = match stored.field(column).data_type() {
                Utf8View | BinaryView => 16,
                Utf8 | Binary => 4,
                LargeUtf8 | LargeBinary => 8,
                _ => 0,
            };
            let bytes = *statistics
                .column_statistics
                .get(column)?
                .byte_size
                .get_value()?;
            Some(bytes as u64 + rows * per_row)
        })
        .sum()
}

/// Lays files, given per storage partition, out as `grouping` says: one group per storage
/// partition, or packed by bytes.
fn group_files<F: Clone>(
    by_partition: Vec<Vec<F>>,
    grouping: FileGrouping,
    runs: &[usize],
    bytes: impl Fn(&F) -> u64,
) -> Vec<Vec<F>> {
    if let FileGrouping::Packed(groups) = grouping {
        return pack_by_bytes(by_partition.into_iter().flatten().collect(), groups, bytes);
    }
    let mut grouped: Vec<Vec<F>> = Vec::new();
    for (i, files) in by_partition.into_iter().enumerate() {
        match grouped.last_mut() {
            Some(group) if !starts_group(grouping, runs, i) => group.extend(files),
            _ => grouped.push(files),
        }
    }
    grouped
}

/// Whether the `i`th plain storage partition (in id order) begins a group of its own: each
/// does under [`FileGrouping::PerStoragePartition`], the first of each run (`runs`: the
/// run of each) under [`FileGrouping::InIdRuns`]. Packed groups are not storage
/// partitions'.
fn starts_group(grouping: FileGrouping, runs: &[usize], i: usize) -> bool {
    match grouping {
        FileGrouping::PerStoragePartition => true,
        FileGrouping::InIdRuns => i == 0 || runs[i - 1] != runs[i],
        FileGrouping::Packed(_) => false,
    }
}

/// A partition's components, if a plain reader may read them as they were written: their
/// rows at `epoch` are all of their rows (see [`PartitionSnapshot::plain_components`]) and
/// no key occurs in two of them. A table loaded or appended to in several publishes of
/// new keys is such a partition until a merge makes it one component; without this, it
/// went through version resolution, about three times slower, in the meantime.
fn read_as_written<'p>(
    partition: &'p PartitionSnapshot,
    epoch: tessera_common::Epoch,
    def: &TableDef,
    store: &dyn ComponentFiles,
    statistics: &ComponentStatistics,
) -> Result<Option<&'p [ComponentMeta]>> {
    let Some(components) = partition.plain_components(epoch, def.layout()) else {
        return Ok(None);
    };
    if components.len() == 1 || def.append_only {
        return Ok(Some(components));
    }
    let Some(ranges) = components
        .iter()
        .map(|c| {
            let stats = statistics.get(store, &c.hash, def)?;
            Ok(first_key_range(&stats, def))
        })
        .collect::<Result<Option<Vec<_>>>>()?
    else {
        return Ok(None);
    };
    let whole_keys_apart = |a: usize, b: usize| -> Result<bool> {
        let bounds = |i: usize| statistics.key_bounds(store, &components[i].hash, def);
        Ok(match (bounds(a)?, bounds(b)?) {
            (Some(a), Some(b)) => a.all_before(&b),
            _ => false,
        })
    };
    Ok(keys_apart(ranges, whole_keys_apart)?.then_some(components))
}

/// The exact smallest and largest value of the key's first column in a component (none if
/// its statistics do not know them exactly).
fn first_key_range(stats: &Statistics, def: &TableDef) -> Option<(ScalarValue, ScalarValue)> {
    let first = *def.primary_key_indices().first()?;
    let column = stats.column_statistics.get(first)?;
    match (&column.min_value, &column.max_value) {
        (Precision::Exact(min), Precision::Exact(max)) if !min.is_null() && !max.is_null() => {
            Some((min.clone(), max.clone()))
        }
        _ => None,
    }
}

/// Whether no key is in two of the components whose first key column spans `ranges`
/// (one per component, in order). Ordered by their smallest values, each range must end
/// before the next begins; where one ends on the value the next begins with (an order's
/// lines split between two loads), `whole_keys_apart(a, b)` decides from the components'
/// whole keys whether every key of `a` is below every key of `b`. A chain of such steps
/// orders every component's keys before the next one's, so no key repeats.
fn keys_apart(
    ranges: Vec<(ScalarValue, ScalarValue)>,
    mut whole_keys_apart: impl FnMut(usize, usize) -> Result<bool>,
) -> Result<bool> {
    let mut comparable = true;
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&ranges[a], &ranges[b]);
        a.0.partial_cmp(&b.0)
            .and_then(|by_min| Some(by_min.then(a.1.partial_cmp(&b.1)?)))
            .unwrap_or_else(|| {
                comparable = false;
                Ordering::Equal
            })
    });
    if !comparable {
        return Ok(false);
    }
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        match ranges[a].1.partial_cmp(&ranges[b].0) {
            Some(Ordering::Less) => {}
            Some(Ordering::Equal) if whole_keys_apart(a, b)? => {}
            _ => return Ok(false),
        }
    }
    Ok(true)
}

/// Packs files into at most `groups` groups of about equal bytes (largest first, each into
/// the lightest group), keeping every file whole.
fn pack_by_bytes<F: Clone>(
    mut files: Vec<F>,
    groups: usize,
    bytes: impl Fn(&F) -> u64,
) -> Vec<Vec<F>> {
    let groups = groups.clamp(1, files.len().max(1));
    files.sort_by_key(|f| std::cmp::Reverse(bytes(f)));
    let mut packed: Vec<(u64, Vec<F>)> = vec![(0, Vec::new()); groups];
    for file in files {
        let lightest = packed
            .iter_mut()
            .min_by_key(|(held, _)| *held)
            .expect("at least one group");
        lightest.0 += bytes(&file);
        lightest.1.push(file);
    }
    packed
        .into_iter()
        .filter(|(_, f)| !f.is_empty())
        .map(|(_, f)| f)
        .collect()
}

#[cfg(test)]
mod tests;
