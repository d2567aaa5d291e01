//! Storage-partitioned (co-located) joins and aggregations.
//!
//! Every table is hash-partitioned by its partition key on one ring of partitions
//! (`tessera_common::partitioning`), and a cluster scan's channels are groups of whole
//! partitions, the same groups for every table a statement reads (the scan channels of
//! one pinned partition map). A full scan of `orders` and one of `lineitem` are therefore
//! already partitioned alike on `o_orderkey` and `l_orderkey`: channel `k` of each holds
//! exactly the keys of group `k`'s partitions, on the same node. A scan says so to
//! DataFusion as `Hash([key columns], groups)` (only while the cluster plans, see
//! `TesseraOptions::planning_for_cluster`), and DataFusion's optimizer then leaves out
//! the repartition under a join or an aggregation on that key.
//!
//! DataFusion assumes one hash function per plan. A partitioned join whose one side is
//! partitioned by the storage and the other by a DataFusion repartition would pair
//! partitions that hold different keys, silently losing matches. [`colocate`] fixes every
//! such join before the plan is cut: the other side's repartition becomes a
//! [`StorageRepartitionExec`], an exchange that routes rows with the storage's own hash
//! and grouping ([`StorageRouter`]), so only that side moves; repartitions over two inputs
//! already partitioned alike are removed, so neither moves. [`check`] then refuses any
//! plan in which an operator that pairs its inputs' partitions still mixes the two.

use crate::scan::DistributedScanExec;
use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::{cast, take_record_batch};
use arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{Distribution, LexOrdering, PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode, SortMergeJoinExec};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::union::InterleaveExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties,
};
use std::fmt;
use std::sync::Arc;
use tessera_common::{partition_key_hashes, PartitionId, PartitionRing};

/// How the storage partitions a statement's scans: a ring of `ring` partitions read in
/// `groups`, channel `k` reading group `k`.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageLayout {
    pub ring: u32,
    pub groups: Vec<Vec<PartitionId>>,
}

impl StorageLayout {
    /// The group (bucket) of every partition of the ring.
    pub fn bucket_of_partition(&self) -> Vec<u32> {
        let mut buckets = vec![u32::MAX; self.ring as usize];
        for (group, partitions) in self.groups.iter().enumerate() {
            for partition in partitions {
                buckets[partition.0 as usize] = group as u32;
            }
        }
        assert!(
            buckets.iter().all(|&b| b != u32::MAX),
            "a storage layout's groups hold every partition of the ring"
        );
        buckets
    }
}

/// Where the hash partitioning of an operator's output comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// The storage's partition hash, grouped as the scans group partitions.
    Storage(StorageLayout),
    /// DataFusion's repartition hash (or a hash partitioning of unknown source).
    DataFusion,
    /// Not hash-partitioned.
    Unpartitioned,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Storage(layout) => write!(
                f,
                "the storage's hash over {} partitions in {} groups",
                layout.ring,
                layout.groups.len()
            ),
            Origin::DataFusion => f.write_str("DataFusion's repartition hash"),
            Origin::Unpartitioned => f.write_str("no hash partitioning"),
        }
    }
}

/// Where `plan`'s output partitioning comes from, following operators that keep their
/// input's hash partitioning down to the scan or repartition that made it.
pub fn origin(plan: &Arc<dyn ExecutionPlan>) -> Origin {
    if let Some(repartition) = plan.downcast_ref::<RepartitionExec>() {
        return match repartition.partitioning() {
            Partitioning::Hash(..) => Origin::DataFusion,
            _ => Origin::Unpartitioned,
        };
    }
    if let Some(repartition) = plan.downcast_ref::<StorageRepartitionExec>() {
        return Origin::Storage(repartition.layout.clone());
    }
    if let Some(scan) = plan.downcast_ref::<DistributedScanExec>() {
        return scan
            .storage_layout()
            .map_or(Origin::Unpartitioned, Origin::Storage);
    }
    let Partitioning::Hash(_, count) = plan.output_partitioning() else {
        return Origin::Unpartitioned;
    };
    plan.children()
        .into_iter()
        .filter(
            |child| matches!(child.output_partitioning(), Partitioning::Hash(_, n) if n == count),
        )
        .map(origin)
        .find(|o| *o != Origin::Unpartitioned)
        .unwrap_or(Origin::DataFusion)
}

/// One side of a partitioned join, without the DataFusion repartition above it.
struct Side {
    input: Arc<dyn ExecutionPlan>,
    /// The storage layout, if the input is partitioned by the storage exactly on this
    /// side's join keys, in their order.
    aligned: Option<StorageLayout>,
}

impl Side {
    fn of(child: &Arc<dyn ExecutionPlan>, keys: &[Arc<dyn PhysicalExpr>]) -> Side {
        let input = match child.downcast_ref::<RepartitionExec>() {
            Some(repartition) if matches!(repartition.partitioning(), Partitioning::Hash(..)) => {
                repartition.input().clone()
            }
            _ => child.clone(),
        };
        let aligned = match origin(&input) {
            Origin::Storage(layout) => input
                .output_partitioning()
                .satisfaction(
                    &Distribution::KeyPartitioned(keys.to_vec()),
                    input.equivalence_properties(),
                    false,
                )
                .is_satisfied()
                .then_some(layout),
            _ => None,
        };
        Side { input, aligned }
    }
}

/// If `input` is partitioned by the storage on some of the join `keys` (TPC-H Q2's parts
/// of one size and the cheapest supply cost per part, joined on the part key and the
/// cost, are both partitioned on the part key alone): its layout, and the positions among
/// `keys` of the columns it is partitioned on, in the partition key's order.
fn storage_key_positions(
    input: &Arc<dyn ExecutionPlan>,
    keys: &[Arc<dyn PhysicalExpr>],
) -> Option<(StorageLayout, Vec<usize>)> {
    let Origin::Storage(layout) = origin(input) else {
        return None;
    };
    let Partitioning::Hash(exprs, _) = input.output_partitioning() else {
        return None;
    };
    let equivalence = input.equivalence_properties().eq_group();
    let normalized = |expr: &Arc<dyn PhysicalExpr>| equivalence.normalize_expr(expr.clone());
    let keys: Vec<_> = keys.iter().map(normalized).collect();
    let positions = exprs
        .iter()
        .map(|expr| {
            let expr = normalized(expr);
            keys.iter().position(|key| key.eq(&expr))
        })
        .collect::<Option<Vec<usize>>>()?;
    Some((layout, positions))
}

/// Makes every partitioned join whose one side is partitioned by the storage on its keys
/// pair partitions that hold the same keys, moving as little as it can (see the module
/// documentation).
pub fn colocate(plan: Arc<dyn ExecutionPlan>) -> DfResult<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        if let Some(join) = node.downcast_ref::<HashJoinExec>() {
            let rewritten = match join.mode {
                PartitionMode::Partitioned => colocate_join(join)?,
                PartitionMode::CollectLeft => join_in_place(join)?,
                PartitionMode::Auto => None,
            };
            return Ok(match rewritten {
                Some(rewritten) => Transformed::yes(rewritten),
                None => Transformed::no(node),
            });
        }
        if let Some(join) = node.downcast_ref::<SortMergeJoinExec>() {
            return Ok(match colocate_sort_merge_join(&node, join)? {
                Some(rewritten) => Transformed::yes(rewritten),
                None => Transformed::no(node),
            });
        }
        if node.is::<InterleaveExec>() {
            return rehash_storage_inputs(node);
        }
        Ok(Transformed::no(node))
    })
    .map(|t| t.data)
}

/// The inputs of a join on `left_keys` = `right_keys`, partitioned so that partition `k`
/// of each holds the same keys, moving as little as it can: `None` if neither side is
/// partitioned by the storage on its keys (both then hash by DataFusion, as planned).
fn co_located_inputs(
    left: &Arc<dyn ExecutionPlan>,
    right: &Arc<dyn ExecutionPlan>,
    left_keys: Vec<Arc<dyn PhysicalExpr>>,
    right_keys: Vec<Arc<dyn PhysicalExpr>>,
) -> DfResult<Option<[Arc<dyn ExecutionPlan>; 2]>> {
    let left = Side::of(left, &left_keys);
    let right = Side::of(right, &right_keys);
    let storage_hashed = |input: Arc<dyn ExecutionPlan>, keys, layout: &StorageLayout| {
        StorageRepartitionExec::try_new(input, keys, layout.clone())
            .map(|exec| Arc::new(exec) as Arc<dyn ExecutionPlan>)
    };
    Ok(Some(match (&left.aligned, &right.aligned) {
        (Some(l), Some(r)) if l == r => [left.input, right.input],
        (Some(layout), _) => {
            let right = storage_hashed(right.input, right_keys, layout)?;
            [left.input, right]
        }
        (None, Some(layout)) => {
            let left = storage_hashed(left.input, left_keys, layout)?;
            [left, right.input]
        }
        (None, None) => {
            // Partitioned on a part of the keys, the same part on both sides: equal keys
            // still sit in partitions of the same group on both.
            let left_part = storage_key_positions(&left.input, &left_keys);
            let right_part = storage_key_positions(&right.input, &right_keys);
            match (left_part, right_part) {
                (Some(l), Some(r)) if l == r => [left.input, right.input],
                _ => return Ok(None),
            }
        }
    }))
}

/// The join with its inputs co-located ([`co_located_inputs`]), or `None`.
fn colocate_join(join: &HashJoinExec) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let (left_keys, right_keys): (Vec<_>, Vec<_>) = join.on().iter().cloned().unzip();
    let Some(inputs) = co_located_inputs(join.left(), join.right(), left_keys, right_keys)? else {
        return Ok(None);
    };
    let rewritten = join
        .builder()
        .with_new_children(inputs.to_vec())?
        .recompute_properties()
        .build_exec()?;
    Ok(Some(rewritten))
}

/// A sort-merge join (a query run again with joins that spill, or a session's choice)
/// with its inputs co-located as a hash join's are. Each side is sorted within its
/// partitions, so the exchange to change sits under the sort, which stays.
fn colocate_sort_merge_join(
    node: &Arc<dyn ExecutionPlan>,
    join: &SortMergeJoinExec,
) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let (left_keys, right_keys): (Vec<_>, Vec<_>) = join.on().iter().cloned().unzip();
    let (left_sort, left) = under_its_sort(join.left());
    let (right_sort, right) = under_its_sort(join.right());
    let Some([left, right]) =
        co_located_inputs(&left, &right, left_keys.clone(), right_keys.clone())?
    else {
        return Ok(None);
    };
    // An exchange put above a side's sort (one not directly under the join, such as a
    // sort under a projection) interleaves its producers' rows: that side is sorted again.
    let sorted = |sort: Option<Arc<dyn ExecutionPlan>>, input, keys: Vec<_>| {
        let input = match sort {
            Some(sort) => replace_children_if_necessary(sort, vec![input])?,
            None => input,
        };
        let ordering: Vec<PhysicalSortExpr> = keys
            .into_iter()
            .zip(join.sort_options())
            .map(|(expr, options)| PhysicalSortExpr::new(expr, *options))
            .collect();
        if input
            .equivalence_properties()
            .ordering_satisfy(ordering.clone())?
        {
            return Ok(input);
        }
        let ordering = LexOrdering::new(ordering).expect("a join has keys");
        let sort = SortExec::new(ordering, input).with_preserve_partitioning(true);
        Ok::<_, DataFusionError>(Arc::new(sort) as Arc<dyn ExecutionPlan>)
    };
    let children = vec![
        sorted(left_sort, left, left_keys)?,
        sorted(right_sort, right, right_keys)?,
    ];
    Ok(Some(replace_children_if_necessary(node.clone(), children)?))
}

/// A sort-merge join's input without the sort of each partition above it, if any, and
/// that sort.
fn under_its_sort(
    child: &Arc<dyn ExecutionPlan>,
) -> (Option<Arc<dyn ExecutionPlan>>, Arc<dyn ExecutionPlan>) {
    match child.downcast_ref::<SortExec>() {
        Some(sort) if sort.preserve_partitioning() => (Some(child.clone()), sort.input().clone()),
        _ => (None, child.clone()),
    }
}

/// A join planned to collect its (small) build side whole, whose two sides are both
/// partitioned by the storage on their join keys, alike: joined partition by partition
/// instead, where the rows are. Collecting would send every build row to every node and
/// make each probe wait for the slowest node's rows; partition `k` of each side already
/// holds the same keys. `None` if the sides are not so partitioned, or the join must see
/// its build side whole (a null-aware anti join, for `NOT IN`).
fn join_in_place(join: &HashJoinExec) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    if join.null_aware {
        return Ok(None);
    }
    let Some(collect) = join.left().downcast_ref::<CoalescePartitionsExec>() else {
        return Ok(None);
    };
    let (left_keys, right_keys): (Vec<_>, Vec<_>) = join.on().iter().cloned().unzip();
    let left = Side::of(collect.input(), &left_keys);
    let right = Side::of(join.right(), &right_keys);
    let (Some(left_layout), Some(right_layout)) = (&left.aligned, &right.aligned) else {
        return Ok(None);
    };
    // `Side::of` looks through a DataFusion repartition; a collected build side has none
    // above its storage partitioning, and a probe side with one is left as planned.
    if left_layout != right_layout
        || !Arc::ptr_eq(&left.input, collect.input())
        || !Arc::ptr_eq(&right.input, join.right())
    {
        return Ok(None);
    }
    let rewritten = join
        .builder()
        .with_partition_mode(PartitionMode::Partitioned)
        .with_new_children(vec![left.input, right.input])?
        .recompute_properties()
        .build_exec()?;
    Ok(Some(rewritten))
}

/// An interleave (a union of alike-partitioned inputs, partition by partition) over
/// inputs of mixed origins: the storage-partitioned ones are hashed again by DataFusion.
fn rehash_storage_inputs(
    node: Arc<dyn ExecutionPlan>,
) -> DfResult<Transformed<Arc<dyn ExecutionPlan>>> {
    let origins: Vec<Origin> = node.children().into_iter().map(origin).collect();
    let mixed = origins.iter().any(|o| matches!(o, Origin::Storage(_)))
        && origins.iter().any(|o| !matches!(o, Origin::Storage(_)));
    if !mixed {
        return Ok(Transformed::no(node));
    }
    let children = node
        .children()
        .into_iter()
        .zip(&origins)
        .map(|(child, origin)| match origin {
            Origin::Storage(_) => Ok(Arc::new(RepartitionExec::try_new(
                child.clone(),
                child.output_partitioning().clone(),
            )?) as Arc<dyn ExecutionPlan>),
            _ => Ok(child.clone()),
        })
        .collect::<DfResult<Vec<_>>>()?;
    Ok(Transformed::yes(replace_children_if_necessary(
        node, children,
    )?))
}

/// True if `node` pairs partition `k` of each input with partition `k` of the others.
#[allow(deprecated)] // `HashPartitioned` is matched alongside its new name.
fn pairs_partitions(node: &Arc<dyn ExecutionPlan>) -> bool {
    let keyed = node
        .required_input_distribution()
        .iter()
        .filter(|d| {
            matches!(
                d,
                Distribution::KeyPartitioned(_) | Distribution::HashPartitioned(_)
            )
        })
        .count();
    node.is::<InterleaveExec>() || keyed >= 2
}

/// The invariant: no operator that pairs its inputs' partitions pairs one partitioned by
/// the storage with one partitioned otherwise (or by another grouping): the same key
/// would sit in different partitions of the two and never meet.
pub fn check(plan: &Arc<dyn ExecutionPlan>) -> DfResult<()> {
    plan.apply(|node| {
        let children = node.children();
        if !pairs_partitions(node)
            || children
                .iter()
                .all(|c| c.output_partitioning().partition_count() <= 1)
        {
            return Ok(TreeNodeRecursion::Continue);
        }
        let origins: Vec<Origin> = children.into_iter().map(origin).collect();
        let storage = origins
            .iter()
            .filter(|o| matches!(o, Origin::Storage(_)))
            .count();
        if storage > 0 && (storage < origins.len() || origins.windows(2).any(|w| w[0] != w[1]))
        {
            let inputs: Vec<String> = origins.iter().map(|o| o.to_string()).collect();
            return Err(DataFusionError::Internal(format!(
                "{} pairs the partitions of inputs partitioned differently ({}): a key would sit in different partitions of each and never meet",
                node.name(),
                inputs.join("; ")
            )));
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .map(|_| ())
}

/// The other invariant of a plan [`colocate`] rewrote: every operator's inputs come in the
/// order it requires. A storage exchange interleaves its producers' rows, so a sort-merge
/// join's side behind a new one must be sorted again. (DataFusion's own sanity check
/// would also refuse joins paired on a part of their keys, which are exact.)
pub fn check_orderings(plan: &Arc<dyn ExecutionPlan>) -> DfResult<()> {
    plan.apply(|node| {
        let required = node.required_input_ordering();
        for (child, required) in node.children().into_iter().zip(required) {
            let Some(required) = required else {
                continue;
            };
            let required = required.into_single();
            let ordered = child
                .equivalence_properties()
                .ordering_satisfy_requirement(required.clone())?;
            if !ordered {
                let keys: Vec<String> = required.iter().map(|key| key.to_string()).collect();
                return Err(DataFusionError::Internal(format!(
                    "{} needs its input ordered by [{}], and its input {} is not",
                    node.name(),
                    keys.join(", "),
                    child.name()
                )));
            }
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .map(|_| ())
}

/// Rows hashed on `exprs` with the storage's partition hash into the storage layout's
/// groups: a plan node only the cluster's planner makes and `distribute` cuts into an
/// exchange (it does not run in one process).
#[derive(Debug)]
pub struct StorageRepartitionExec {
    input: Arc<dyn ExecutionPlan>,
    /// The key expressions over the input, in the partition key's order.
    pub exprs: Vec<Arc<dyn PhysicalExpr>>,
    pub layout: StorageLayout,
    properties: Arc<PlanProperties>,
}

impl StorageRepartitionExec {
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        layout: StorageLayout,
    ) -> DfResult<Self> {
        let schema = input.schema();
        for expr in &exprs {
            let data_type = key_type(&expr.data_type(&schema)?);
            if !tessera_common::is_key_type(&data_type) {
                return Err(DataFusionError::Internal(format!(
                    "cannot hash {expr} of type {data_type} as the storage does"
                )));
            }
        }
        // Each output partition interleaves rows of every input partition: no order and no
        // per-partition constant survives (as through a DataFusion repartition).
        let mut equivalence = input.equivalence_properties().clone();
        equivalence.clear_orderings();
        equivalence.clear_per_partition_constants();
        let properties = Arc::new(PlanProperties::new(
            equivalence,
            Partitioning::Hash(exprs.clone(), layout.groups.len()),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(StorageRepartitionExec {
            input,
            exprs,
            layout,
            properties,
        })
    }

    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for StorageRepartitionExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let exprs: Vec<String> = self.exprs.iter().map(|e| e.to_string()).collect();
        write!(
            f,
            "StorageRepartitionExec: [{}] into {} storage groups",
            exprs.join(", "),
            self.layout.groups.len()
        )
    }
}

impl ExecutionPlan for StorageRepartitionExec {
    fn name(&self) -> &str {
        "StorageRepartitionExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        crate::apply_to_each(&self.exprs, f)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = crate::only_input(children, "StorageRepartitionExec")?;
        Ok(Arc::new(StorageRepartitionExec::try_new(
            input,
            self.exprs.clone(),
            self.layout.clone(),
        )?))
    }

    fn execute(
        &self,
        _partition: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        Err(DataFusionError::Internal(
            "a storage repartition runs only as an exchange between a cluster's nodes".into(),
        ))
    }
}

/// The type a key value is hashed as: a dictionary's values.
fn key_type(data_type: &DataType) -> DataType {
    match data_type {
        DataType::Dictionary(_, values) => values.as_ref().clone(),
        other => other.clone(),
    }
}

/// Splits batches into the storage layout's groups by the storage's partition hash of the
/// key expressions: the sending end of a storage exchange.
#[derive(Debug)]
pub struct StorageRouter {
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// Each expression's text, naming it in an error.
    names: Vec<String>,
    ring: PartitionRing,
    bucket_of_partition: Vec<u32>,
    buckets: usize,
}

impl StorageRouter {
    pub fn new(
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        bucket_of_partition: Vec<u32>,
        buckets: usize,
    ) -> StorageRouter {
        assert!(
            bucket_of_partition.iter().all(|&b| (b as usize) < buckets),
            "every partition's bucket exists"
        );
        StorageRouter {
            names: exprs.iter().map(|e| e.to_string()).collect(),
            exprs,
            ring: PartitionRing::new(bucket_of_partition.len() as u32),
            bucket_of_partition,
            buckets,
        }
    }

    /// The batch's rows by bucket, buckets in order, empty ones left out.
    pub fn route(&self, batch: &RecordBatch) -> DfResult<Vec<(usize, RecordBatch)>> {
        let rows = batch.num_rows();
        let keys = self
            .exprs
            .iter()
            .map(|expr| {
                let values = expr.evaluate(batch)?.into_array(rows)?;
                let wanted = key_type(values.data_type());
                Ok(cast(&values, &wanted)?)
            })
            .collect::<DfResult<Vec<ArrayRef>>>()?;
        let named: Vec<(&str, &ArrayRef)> =
            self.names.iter().map(String::as_str).zip(&keys).collect();
        let hashes = partition_key_hashes(&named)
            .map_err(|e| DataFusionError::Execution(format!("storage exchange: {e}")))?;
        let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); self.buckets];
        for (row, hash) in hashes.into_iter().enumerate() {
            let partition = self.ring.partition_of(hash);
            let bucket = self.bucket_of_partition[partition.0 as usize] as usize;
            rows_of[bucket].push(row as u32);
        }
        rows_of
            .into_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(bucket, rows)| {
                let part = if rows.len() == batch.num_rows() {
                    batch.clone()
                } else {
                    take_record_batch(batch, &UInt32Array::from(rows))?
                };
                Ok((bucket, part))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
