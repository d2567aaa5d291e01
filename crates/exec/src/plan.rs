//! Cutting a DataFusion physical plan into stages and placing their channels.
//!
//! - A hash or round-robin `RepartitionExec` becomes an exchange: the subtree below is a
//!   producer stage, and the repartition is replaced by an [`ExchangeReadExec`] with as
//!   many buckets as the repartition had output partitions. Before the cut, joins on a
//!   partition key are co-located (`crate::colocate`): a repartition over an input
//!   partitioned as the storage is removed, and one whose partner is becomes a
//!   `StorageRepartitionExec`, an exchange that hashes as the storage does.
//! - A `SortPreservingMergeExec` over several partitions stays, and reads its input
//!   through a gather exchange: bucket `k` is producer channel `k`'s output, so a merge
//!   still sees each input sorted. A `CoalescePartitionsExec` reads through a collect
//!   exchange: one bucket every producer feeds, whose reading order lineage can log.
//! - The top of the plan becomes stage 0, one channel on the initiator, which gathers the
//!   answer into the query's result exchange (exchange 0).
//!
//! Then every channel is placed: a channel that reads a storage partition runs on that
//! partition's first listed replica (its primary in the query's snapshot), any other on
//! a live compute-only node (in turn) if there is one, else on the primary of the
//! partition in the middle of its hash range, which spreads them over the nodes in ring
//! order. Finally each stage gets an [`ExchangeWriteExec`] root naming,
//! for each bucket, the nodes hosting a consumer channel that reads it.

use crate::colocate::{
    check as check_colocation, check_orderings, colocate, StorageRepartitionExec,
};
use crate::exchange::{ExchangeMode, ExchangeReadExec, ExchangeWriteExec, ReadSpec, WriteSpec};
use crate::existence::deduplicate_existence_sides;
use crate::scan::DistributedScanExec;
use crate::Exec;
use crate::NodeId;
use crate::{QueryId, StageId};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DataFusionError, JoinType, Result as DfResult};
use datafusion::physical_expr::{Distribution, OrderingRequirements, PhysicalExpr};
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::limit::{GlobalLimitExec, LocalLimitExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tessera_meta::MetaState;

/// A query cut into stages, placed, and ready to run.
#[derive(Debug)]
pub struct DistributedPlan {
    pub query: QueryId,
    /// Recovers from a node's death by write-ahead lineage (`tessera.recovery = lineage`).
    pub lineage: bool,
    /// The most memory the query may hold on each node (`tessera.query_memory_limit`).
    pub memory_limit: Option<u64>,
    /// The session's execution settings, which every channel runs with.
    pub execution: crate::settings::ExecutionSettings,
    pub initiator: NodeId,
    pub started_at_us: u64,
    pub map_version: u64,
    /// By stage id; stage 0 is the top and writes the answer to the initiator.
    pub stages: Vec<Stage>,
    pub addrs: BTreeMap<NodeId, String>,
}

#[derive(Debug)]
pub struct Stage {
    pub id: StageId,
    /// Rooted at an [`ExchangeWriteExec`].
    pub plan: Arc<dyn ExecutionPlan>,
    /// The node of each channel.
    pub channels: Vec<NodeId>,
    /// The stages whose exchanges this one reads.
    pub inputs: Vec<StageId>,
}

/// What one channel of a fragment reads at its leaves.
#[derive(Debug, Clone, PartialEq)]
pub enum Leaf {
    Exchange {
        exchange: StageId,
        bucket: usize,
    },
    /// A scan's output partition (a group of storage partitions), with its replicas best
    /// first, and how it has read them so far.
    Scan {
        replicas: Vec<NodeId>,
        reads: crate::ScanReads,
    },
}

/// The leaves that output partition `partition` of `plan` reads, following how each
/// operator maps its output partitions onto its children's.
pub fn leaves_of(plan: &Arc<dyn ExecutionPlan>, partition: usize, out: &mut Vec<Leaf>) {
    let any: &dyn ExecutionPlan = plan.as_ref();
    if let Some(demux) = any.downcast_ref::<crate::split::DemuxExec>() {
        // Every stream of a dealt bucket reads that one bucket.
        leaves_of(plan.children()[0], demux.bucket(), out);
        return;
    }
    if let Some(read) = any.downcast_ref::<ExchangeReadExec>() {
        out.push(Leaf::Exchange {
            exchange: read.spec.exchange,
            bucket: partition,
        });
        return;
    }
    if let Some(scan) = any.downcast_ref::<DistributedScanExec>() {
        if let Some(replicas) = scan.spec.replicas.get(partition) {
            out.push(Leaf::Scan {
                replicas: replicas.clone(),
                reads: scan.reads(Some(partition)),
            });
        }
        return;
    }
    let all = |child: &Arc<dyn ExecutionPlan>, out: &mut Vec<Leaf>| {
        for p in 0..child.output_partitioning().partition_count() {
            leaves_of(child, p, out);
        }
    };
    let children = plan.children();
    if any.is::<CoalescePartitionsExec>()
        || any.is::<SortPreservingMergeExec>()
        || any.is::<crate::split::SplitChannelExec>()
    {
        all(children[0], out);
    } else if let Some(join) = any.downcast_ref::<HashJoinExec>() {
        if join.mode == PartitionMode::CollectLeft {
            all(join.left(), out);
        } else {
            leaves_of(join.left(), partition, out);
        }
        leaves_of(join.right(), partition, out);
    } else if any.is::<CrossJoinExec>() || any.is::<NestedLoopJoinExec>() {
        // The left side is collected whole; the right streams partition by partition.
        all(children[0], out);
        leaves_of(children[1], partition, out);
    } else if any.is::<UnionExec>() {
        let mut offset = partition;
        for child in children {
            let count = child.output_partitioning().partition_count();
            if offset < count {
                leaves_of(child, offset, out);
                return;
            }
            offset -= count;
        }
    } else {
        let count = plan.output_partitioning().partition_count();
        for child in children {
            if child.output_partitioning().partition_count() == count {
                leaves_of(child, partition, out);
            } else {
                all(child, out);
            }
        }
    }
}

/// A stage before its exchange writer is attached.
struct Cut {
    root: Arc<dyn ExecutionPlan>,
    mode: ExchangeMode,
    hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
    buckets: usize,
    inputs: Vec<StageId>,
}

struct Cutter {
    query: QueryId,
    lineage: bool,
    node: Arc<Exec>,
    stages: Vec<Option<Cut>>,
}

impl Cutter {
    /// Makes `root` a producer stage of `mode` with `buckets` buckets; returns the reader
    /// that replaces it in the consumer.
    fn exchange(
        &mut self,
        root: Arc<dyn ExecutionPlan>,
        inputs: Vec<StageId>,
        mode: ExchangeMode,
        hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
        buckets: usize,
    ) -> (Arc<dyn ExecutionPlan>, StageId) {
        let id = StageId(self.stages.len());
        let producer_channels = root.output_partitioning().partition_count();
        let reader = ExchangeReadExec::new(
            ReadSpec {
                query: self.query,
                exchange: id,
                mode: mode.clone(),
                buckets,
                producer_channels,
                lineage: self.lineage,
                initiator: self.node.id(),
                replay: None,
            },
            root.schema(),
            self.node.clone(),
        );
        self.stages.push(Some(Cut {
            root,
            mode,
            hash_exprs,
            buckets,
            inputs,
        }));
        (Arc::new(reader), id)
    }

    /// Replaces the exchanges in `plan` by readers of new stages; returns the plan and the
    /// stages it reads directly.
    fn cut(
        &mut self,
        plan: Arc<dyn ExecutionPlan>,
    ) -> DfResult<(Arc<dyn ExecutionPlan>, Vec<StageId>)> {
        let any: &dyn ExecutionPlan = plan.as_ref();
        if let Some(repartition) = any.downcast_ref::<StorageRepartitionExec>() {
            let (input, inputs) = self.cut(repartition.input().clone())?;
            let mode = ExchangeMode::Storage {
                bucket_of_partition: repartition.layout.bucket_of_partition(),
            };
            let buckets = repartition.layout.groups.len();
            let (reader, id) =
                self.exchange(input, inputs, mode, repartition.exprs.clone(), buckets);
            return Ok((reader, vec![id]));
        }
        if let Some(repartition) = any.downcast_ref::<RepartitionExec>() {
            let (input, inputs) = self.cut(repartition.input().clone())?;
            let (mode, exprs, buckets) = match repartition.partitioning().clone() {
                Partitioning::Hash(exprs, n) => (ExchangeMode::Hash, exprs, n),
                Partitioning::RoundRobinBatch(n) => (ExchangeMode::RoundRobin, vec![], n),
                other => {
                    return Err(DataFusionError::NotImplemented(format!(
                        "distributed exchange for partitioning {other}"
                    )))
                }
            };
            if repartition.preserve_order() {
                return Err(DataFusionError::NotImplemented(
                    "order-preserving repartition across nodes".into(),
                ));
            }
            let (reader, id) = self.exchange(input, inputs, mode, exprs, buckets);
            return Ok((reader, vec![id]));
        }
        // A merge keeps one bucket per producer (each sorted); a coalesce reads all its
        // producers through one bucket, in an order lineage can log.
        let gather = if any.is::<CoalescePartitionsExec>() {
            Some(ExchangeMode::Collect)
        } else if any.is::<SortPreservingMergeExec>() {
            Some(ExchangeMode::Gather)
        } else {
            None
        };
        let mut children = Vec::new();
        let mut reads = Vec::new();
        for child in plan.children() {
            let (child, inputs) = self.cut(child.clone())?;
            let parts = child.output_partitioning().partition_count();
            if let Some(mode) = gather.clone().filter(|_| parts > 1) {
                let buckets = if mode == ExchangeMode::Collect {
                    1
                } else {
                    parts
                };
                let (reader, id) = self.exchange(child, inputs, mode, vec![], buckets);
                children.push(reader);
                reads.push(id);
            } else {
                children.push(child);
                reads.extend(inputs);
            }
        }
        if children.is_empty() {
            return Ok((plan, reads));
        }
        Ok((replace_children_if_necessary(plan, children)?, reads))
    }
}

/// The node of each channel of a stage rooted at `root`, never one in `avoid` (peers the
/// initiator cannot reach) while another will do. Channels that read no partition go to
/// the compute nodes first; scans too if `scans_on_compute`.
fn place(
    root: &Arc<dyn ExecutionPlan>,
    state: &MetaState,
    fallback: NodeId,
    avoid: &BTreeSet<NodeId>,
    scans_on_compute: bool,
) -> Vec<NodeId> {
    let channels = root.output_partitioning().partition_count();
    let partitions = state.map.partitions.len();
    let compute: Vec<NodeId> = state
        .live_compute_nodes()
        .into_iter()
        .filter(|id| !avoid.contains(id))
        .collect();
    (0..channels)
        .map(|channel| {
            if scans_on_compute && !compute.is_empty() {
                return compute[channel % compute.len()];
            }
            let mut leaves = Vec::new();
            leaves_of(root, channel, &mut leaves);
            let by_data = leaves.iter().find_map(|leaf| match leaf {
                Leaf::Scan { replicas, .. } => replicas
                    .iter()
                    .find(|r| !avoid.contains(r))
                    .or(replicas.first())
                    .copied(),
                Leaf::Exchange { .. } => None,
            });
            by_data.unwrap_or_else(|| {
                // Compute nodes first, in turn: they are there for exactly this work.
                if !compute.is_empty() {
                    return compute[channel % compute.len()];
                }
                // The middle of this channel's share of the ring, or the next primary
                // along it that is not avoided.
                let middle = (2 * channel + 1) * partitions / (2 * channels.max(1));
                (0..partitions)
                    .filter_map(|step| state.map.partitions[(middle + step) % partitions].primary)
                    .find(|primary| !avoid.contains(primary))
                    .unwrap_or(fallback)
            })
        })
        .collect()
}

/// True for joins whose collected (left) side emits rows at the end, after every probe
/// partition has marked what it matched: a bitmap DataFusion shares between the probe
/// partitions of one process.
fn emits_build_side_at_end(join_type: &JoinType) -> bool {
    matches!(
        join_type,
        JoinType::Left
            | JoinType::LeftAnti
            | JoinType::LeftSemi
            | JoinType::LeftMark
            | JoinType::Full
    )
}

fn single_partition(plan: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    if plan.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(plan))
    } else {
        plan
    }
}

/// The most rows a build side may be estimated at to be broadcast to every node (as
/// DataFusion's own threshold for collecting a build side).
const BROADCAST_MAX_ROWS: usize = 128 * 1024;

/// True if `build` is small enough to send whole to every node: a table read (filtered
/// and projected) estimated so, or a side derived from table reads whose shape bounds its
/// rows so ([`row_bound`]). Estimates past a join or an aggregate have no column
/// statistics behind them here, and a wrong guess broadcasts millions of rows: a derived
/// side without such a bound is hashed.
fn cheap_to_broadcast(build: &Arc<dyn ExecutionPlan>) -> bool {
    let derived = build
        .exists(|node| {
            Ok(!(node.is::<DistributedScanExec>()
                || node.is::<FilterExec>()
                || node.is::<ProjectionExec>()
                || node.is::<CoalescePartitionsExec>()))
        })
        .unwrap_or(true);
    if derived {
        return row_bound(build).is_some_and(|rows| rows <= BROADCAST_MAX_ROWS);
    }
    let rows = StatisticsContext::default()
        .compute(build.as_ref(), &StatisticsArgs::new())
        .ok()
        .and_then(|s| s.num_rows.get_value().copied());
    rows.is_some_and(|rows| rows <= BROADCAST_MAX_ROWS)
}

/// The most rows `plan` can yield as its shape bounds them, from the row counts of the
/// tables it reads: filters, projections, exchanges, sorts and aggregations (but for
/// grouping sets, a row per set) never add rows, a limit caps them, and a semi, anti or mark join yields at most its preserved
/// side's rows (TPC-H Q11's and Q2's suppliers of one nation or region, a semi join of
/// supplier, are at most supplier's rows). `None` past anything else: an inner or outer
/// join can multiply rows.
fn row_bound(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    if plan.is::<DistributedScanExec>() {
        let statistics = StatisticsContext::default()
            .compute(plan.as_ref(), &StatisticsArgs::new())
            .ok()?;
        return statistics.num_rows.get_value().copied();
    }
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        return match join.join_type() {
            JoinType::LeftSemi | JoinType::LeftAnti | JoinType::LeftMark => row_bound(join.left()),
            JoinType::RightSemi | JoinType::RightAnti | JoinType::RightMark => {
                row_bound(join.right())
            }
            _ => None,
        };
    }
    let keeps_or_drops_rows = plan.is::<FilterExec>()
        || plan.is::<ProjectionExec>()
        || plan.is::<CoalescePartitionsExec>()
        || plan.is::<RepartitionExec>()
        || plan.is::<StorageRepartitionExec>()
        || plan.is::<SortExec>()
        || plan.is::<SortPreservingMergeExec>()
        || plan.is::<GlobalLimitExec>()
        || plan.is::<LocalLimitExec>();
    let bound = match plan.children()[..] {
        [child] if keeps_or_drops_rows => row_bound(child)?,
        // One row per group and grouping set, and one with no groups even over no rows.
        [child] => {
            let aggregate = plan.downcast_ref::<AggregateExec>()?;
            let sets = aggregate.group_expr().groups().len().max(1);
            row_bound(child)?.max(1).checked_mul(sets)?
        }
        _ => return None,
    };
    Some(plan.fetch().map_or(bound, |fetch| fetch.min(bound)))
}

/// Rewrites joins for execution across nodes.
///
/// - A collected-left hash join becomes a partitioned join (both sides hashed on the keys
///   into `buckets`) when its build side is not cheap to broadcast, or when it emits
///   build-side rows at the end (outer, semi, anti joins: the matched-rows bitmap would be
///   split between nodes); each channel then owns its share of the build side.
/// - A null-aware anti join (`NOT IN`) must see every probe row, so its probe side is
///   gathered into one channel, as is a nested-loop join's that emits build-side rows.
fn adapt_joins_for_distribution(
    plan: Arc<dyn ExecutionPlan>,
    buckets: usize,
) -> DfResult<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let node = restore_input_distributions(node, buckets)?;
        if let Some(join) = node.data.downcast_ref::<HashJoinExec>() {
            let shared_bitmap = emits_build_side_at_end(join.join_type())
                && join.right().output_partitioning().partition_count() > 1;
            let keep = join.mode != PartitionMode::CollectLeft
                || (!shared_bitmap && (join.null_aware || cheap_to_broadcast(join.left())));
            if keep {
                return Ok(node);
            }
            let (left, right) = (join.left().clone(), join.right().clone());
            let children = if join.null_aware {
                vec![left, single_partition(right)]
            } else {
                let left = match left.downcast_ref::<CoalescePartitionsExec>() {
                    Some(coalesce) => coalesce.input().clone(),
                    None => left,
                };
                let (left_keys, right_keys): (Vec<_>, Vec<_>) = join.on().iter().cloned().unzip();
                let left: Arc<dyn ExecutionPlan> = Arc::new(RepartitionExec::try_new(
                    left,
                    Partitioning::Hash(left_keys, buckets),
                )?);
                let right: Arc<dyn ExecutionPlan> = Arc::new(RepartitionExec::try_new(
                    right,
                    Partitioning::Hash(right_keys, buckets),
                )?);
                vec![left, right]
            };
            let mode = if join.null_aware {
                PartitionMode::CollectLeft
            } else {
                PartitionMode::Partitioned
            };
            let rewritten = join
                .builder()
                .with_partition_mode(mode)
                .with_new_children(children)?
                .recompute_properties()
                .build_exec()?;
            return Ok(Transformed::yes(rewritten));
        }
        if let Some(join) = node.data.downcast_ref::<NestedLoopJoinExec>() {
            let children = node.data.children();
            if emits_build_side_at_end(join.join_type())
                && children[1].output_partitioning().partition_count() > 1
            {
                let children = vec![children[0].clone(), single_partition(children[1].clone())];
                return Ok(Transformed::yes(replace_children_if_necessary(
                    node.data.clone(),
                    children,
                )?));
            }
        }
        Ok(node)
    })
    .map(|t| t.data)
}

/// `node` with what it needs of its inputs' partitioning put back where an input below it
/// was rewritten. A collected join made partitioned is partitioned on its join keys, no
/// longer as its probe side was; the plan above may have relied on the probe side's
/// partitioning (an aggregation DataFusion planned `SinglePartitioned` over a scan
/// partitioned on the grouping key, with the join in between): that input is hashed
/// again on the keys the node needs, or gathered if it needs one partition. An ordering
/// the node requires and no longer gets is refused, never run unsorted.
#[allow(deprecated)] // `HashPartitioned` is matched alongside its new name.
fn restore_input_distributions(
    node: Arc<dyn ExecutionPlan>,
    buckets: usize,
) -> DfResult<Transformed<Arc<dyn ExecutionPlan>>> {
    let requirements = node.input_distribution_requirements();
    let children = node.children();
    // A subset of the keys keeps equal keys together for one input; inputs paired
    // partition by partition must be partitioned on all their keys alike.
    let allow_subset = children.len() == 1;
    let mut changed = false;
    let mut restored = Vec::with_capacity(children.len());
    for (index, child) in children.iter().enumerate() {
        let required = requirements
            .child_distribution(index)
            .cloned()
            .unwrap_or(Distribution::UnspecifiedDistribution);
        let satisfied = child
            .output_partitioning()
            .satisfaction(&required, child.equivalence_properties(), allow_subset)
            .is_satisfied();
        let child = (*child).clone();
        restored.push(match required {
            _ if satisfied => child,
            Distribution::SinglePartition => {
                changed = true;
                Arc::new(CoalescePartitionsExec::new(child)) as Arc<dyn ExecutionPlan>
            }
            Distribution::KeyPartitioned(keys) | Distribution::HashPartitioned(keys) => {
                changed = true;
                Arc::new(RepartitionExec::try_new(
                    child,
                    Partitioning::Hash(keys, buckets),
                )?)
            }
            Distribution::UnspecifiedDistribution => child,
        });
    }
    if !changed {
        return Ok(Transformed::no(node));
    }
    let node = replace_children_if_necessary(node, restored)?;
    for (child, ordering) in node.children().iter().zip(node.required_input_ordering()) {
        let Some(OrderingRequirements::Hard(alternatives)) = ordering else {
            continue;
        };
        let mut kept = false;
        for alternative in alternatives {
            kept |= child
                .equivalence_properties()
                .ordering_satisfy_requirement(alternative)?;
        }
        if !kept {
            return Err(DataFusionError::Internal(format!(
                "{} needs its input sorted, and the input was repartitioned for distribution",
                node.name()
            )));
        }
    }
    Ok(Transformed::yes(node))
}

/// How a query is cut and placed, from its session's settings.
#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    /// Recover from a node's death by write-ahead lineage (`tessera.recovery = lineage`).
    pub lineage: bool,
    /// Place scan channels on compute nodes too (`tessera.scans_on_compute`), reading the
    /// partitions from their replicas over the network.
    pub scans_on_compute: bool,
    /// The most memory the query may hold on each node (`tessera.query_memory_limit`).
    pub memory_limit: Option<u64>,
    /// The session's execution settings, which every channel runs with.
    pub execution: crate::settings::ExecutionSettings,
}

/// Cuts `plan` into stages for `query`, placed by the snapshot `state`.
pub fn distribute(
    node: &Arc<Exec>,
    query: QueryId,
    plan: Arc<dyn ExecutionPlan>,
    state: &MetaState,
    started_at_us: u64,
    buckets: usize,
    options: PlanOptions,
) -> DfResult<DistributedPlan> {
    let PlanOptions {
        lineage,
        scans_on_compute,
        memory_limit,
        execution,
    } = options;
    let initiator = node.id();
    let plan = adapt_joins_for_distribution(plan, buckets)?;
    let plan = colocate(plan)?;
    let plan = deduplicate_existence_sides(plan)?;
    check_colocation(&plan)?;
    check_orderings(&plan)?;
    let plan = single_partition(plan);
    let mut cutter = Cutter {
        query,
        lineage,
        node: node.clone(),
        stages: vec![None],
    };
    let (top, top_inputs) = cutter.cut(plan)?;
    cutter.stages[0] = Some(Cut {
        root: top,
        mode: ExchangeMode::Gather,
        hash_exprs: vec![],
        buckets: 1,
        inputs: top_inputs,
    });
    let cuts: Vec<Cut> = cutter
        .stages
        .into_iter()
        .map(|c| c.expect("every stage is cut"))
        .collect();

    // Placement, then who reads which bucket.
    let avoid = node.unreachable.current();
    if !avoid.is_empty() {
        tracing::info!(%query, ?avoid, "placing no channel on peers unreachable from here");
    }
    let placements: Vec<Vec<NodeId>> = cuts
        .iter()
        .enumerate()
        .map(|(id, cut)| match id {
            0 => vec![initiator],
            _ => place(&cut.root, state, initiator, &avoid, scans_on_compute),
        })
        .collect();
    let mut destinations: Vec<Vec<BTreeSet<NodeId>>> = cuts
        .iter()
        .map(|cut| vec![BTreeSet::new(); cut.buckets])
        .collect();
    destinations[0][0].insert(initiator);
    for (id, cut) in cuts.iter().enumerate() {
        for (channel, &node_id) in placements[id].iter().enumerate() {
            let mut leaves = Vec::new();
            leaves_of(&cut.root, channel, &mut leaves);
            for leaf in leaves {
                if let Leaf::Exchange { exchange, bucket } = leaf {
                    destinations[exchange.index()][bucket].insert(node_id);
                }
            }
        }
    }
    // Every bucket must have a reader, or its rows would silently go nowhere.
    for (id, buckets) in destinations.iter().enumerate() {
        if let Some(bucket) = buckets.iter().position(|d| d.is_empty()) {
            return Err(DataFusionError::Internal(format!(
                "bucket {bucket} of exchange {id} has no consumer channel"
            )));
        }
    }
    let addrs: BTreeMap<NodeId, String> = state
        .nodes
        .values()
        .map(|n| (n.id, n.addr.clone()))
        .collect();
    let stages = cuts
        .into_iter()
        .enumerate()
        .map(|(index, cut)| {
            let id = StageId(index);
            let spec = WriteSpec {
                query,
                exchange: id,
                mode: cut.mode,
                buckets: cut.buckets,
                destinations: destinations[index]
                    .iter()
                    .map(|d| d.iter().copied().collect())
                    .collect(),
                addrs: addrs.clone(),
                started_at_us,
                lineage,
                rebuilt: false,
                initiator: Some(initiator),
            };
            let root = ExchangeWriteExec::new(spec, cut.hash_exprs, cut.root, Some(node.clone()));
            Stage {
                id,
                plan: Arc::new(root),
                channels: placements[index].clone(),
                inputs: cut.inputs,
            }
        })
        .collect();
    Ok(DistributedPlan {
        query,
        lineage,
        memory_limit,
        execution,
        initiator,
        started_at_us,
        map_version: state.map.version,
        stages,
        addrs,
    })
}
