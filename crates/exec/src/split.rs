//! A rebuilt channel split over several streams: when a node dies, each of its channels
//! is run again from its first batch (lineage recovery, `tessera-recovery`'s
//! `rebuild.rs`). Run as one stream, that redo is the longest path of the query's
//! recovery: the dead node's whole share of a stage on one thread, which starts only when
//! the death is noticed. A channel that gave nobody any output before its node died may
//! instead be recomputed in any grouping of the same rows, so [`split_channel`] cuts its
//! scans' storage partitions into `ways` groups, runs the channel's operators once per
//! group, each on its own task, and merges the streams back into the one channel its
//! consumers expect ([`SplitChannelExec`]).
//!
//! A split is exact because every operator of a channel either works partition by
//! partition (a projection, a filter, a partial or co-located aggregation, a sort, a join
//! of co-located scans: rows of one storage partition never meet rows of another) or reads
//! a whole broadcast input once, shared by every partition (a `CollectLeft` join's build
//! side). A channel with anything else (a hash exchange's bucket, which has one reader; a
//! union; a merge of partitions) is not split, and is rebuilt as one stream.

use crate::colocate::StorageRouter;
use crate::exchange::{ExchangeMode, ExchangeReadExec};
use crate::scan::DistributedScanExec;
use crate::StageId;
use arrow::array::RecordBatch;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties,
};
use futures::StreamExt;
use std::sync::Arc;
use std::sync::Mutex;
use tessera_common::PartitionId;

/// Channel `channel` of a stage's plan (`input`, the operators under its exchange writer)
/// recomputed as `ways` streams, or `None` if the channel cannot be split that way (see
/// the module's notes) or reads fewer than `ways` storage partitions.
///
/// `storage_keys` gives, for an exchange the channel reads, the expressions its producers
/// hash rows by when the exchange routes them as the storage does: such a bucket holds
/// rows of the channel's storage partitions only, and is read once and its rows dealt to
/// the streams by partition ([`DemuxExec`]).
pub fn split_channel(
    input: &Arc<dyn ExecutionPlan>,
    channel: usize,
    ways: usize,
    storage_keys: &dyn Fn(StageId) -> Option<Vec<Arc<dyn PhysicalExpr>>>,
) -> Option<Arc<dyn ExecutionPlan>> {
    if ways < 2 {
        return None;
    }
    let mut splitting = Splitting {
        channel,
        ways,
        groups: None,
        storage_keys,
    };
    let split = splitting.split(input)?;
    let channels = input.output_partitioning().partition_count();
    Some(Arc::new(SplitChannelExec::new(channel, channels, split)))
}

/// The storage partitions of a channel, cut into groups: the first scan met decides, and
/// every other scan of the channel must read the same partitions (co-located tables).
struct Groups {
    partitions: Vec<PartitionId>,
    groups: Vec<Vec<PartitionId>>,
}

impl Groups {
    fn cut(mut partitions: Vec<PartitionId>, ways: usize) -> Option<Groups> {
        partitions.sort_unstable();
        if partitions.len() < ways {
            return None;
        }
        // Contiguous runs of nearly equal size, in partition order.
        let groups = (0..ways)
            .map(|g| {
                let (from, to) = (
                    g * partitions.len() / ways,
                    (g + 1) * partitions.len() / ways,
                );
                partitions[from..to].to_vec()
            })
            .collect();
        Some(Groups { partitions, groups })
    }
}

/// One channel's split under way: the groups are set by the first scan or storage
/// exchange met, and every other must read the same partitions.
struct Splitting<'a> {
    channel: usize,
    ways: usize,
    groups: Option<Groups>,
    storage_keys: &'a dyn Fn(StageId) -> Option<Vec<Arc<dyn PhysicalExpr>>>,
}

impl Splitting<'_> {
    /// The groups for a leaf over `partitions`, if they are the channel's.
    fn groups_for(&mut self, mut partitions: Vec<PartitionId>) -> Option<&Groups> {
        partitions.sort_unstable();
        if self.groups.is_none() {
            self.groups = Some(Groups::cut(partitions.clone(), self.ways)?);
        }
        let groups = self.groups.as_ref().expect("set above");
        (groups.partitions == partitions).then_some(groups)
    }

    fn split(&mut self, plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
        let channel = self.channel;
        let any: &dyn ExecutionPlan = plan.as_ref();
        if let Some(scan) = any.downcast_ref::<DistributedScanExec>() {
            let mine = scan.spec.partitions.get(channel)?.clone();
            let groups = self.groups_for(mine)?.groups.clone();
            let replicas = scan.spec.replicas.get(channel)?.clone();
            let regrouped = scan.regrouped(groups, replicas).ok()?;
            return Some(Arc::new(regrouped));
        }
        if let Some(read) = any.downcast_ref::<ExchangeReadExec>() {
            // A bucket of a storage exchange: its rows are the channel's partitions'.
            let ExchangeMode::Storage {
                bucket_of_partition,
            } = &read.spec.mode
            else {
                return None;
            };
            let keys = (self.storage_keys)(read.spec.exchange)?;
            let mine: Vec<PartitionId> = (0..bucket_of_partition.len())
                .filter(|&p| bucket_of_partition[p] as usize == channel)
                .map(|p| PartitionId(p as u32))
                .collect();
            let ring = bucket_of_partition.len();
            let groups = self.groups_for(mine)?;
            let mut group_of_partition = vec![0u32; ring];
            for (group, partitions) in groups.groups.iter().enumerate() {
                for partition in partitions {
                    group_of_partition[partition.0 as usize] = group as u32;
                }
            }
            let demux = DemuxExec::new(plan.clone(), channel, keys, group_of_partition, self.ways);
            return Some(Arc::new(demux));
        }
        if any.is::<CoalescePartitionsExec>()
            || any.is::<SortPreservingMergeExec>()
            || any.is::<UnionExec>()
        {
            return None;
        }
        let children = plan.children();
        if children.is_empty() {
            // Any other leaf (literal rows, an empty relation) would be read once per stream.
            return None;
        }
        // A side read whole once, shared by every partition of the operator.
        let shared_side = if let Some(join) = any.downcast_ref::<HashJoinExec>() {
            (join.mode == PartitionMode::CollectLeft).then_some(0)
        } else if any.is::<CrossJoinExec>() || any.is::<NestedLoopJoinExec>() {
            Some(0)
        } else {
            None
        };
        let count = plan.output_partitioning().partition_count();
        let mut split_children = Vec::with_capacity(children.len());
        for (index, child) in children.into_iter().enumerate() {
            if shared_side == Some(index) {
                // Read whole: it must not scan storage (each stream would read it again,
                // and differently split).
                if reads_storage(child) {
                    return None;
                }
                split_children.push(child.clone());
            } else if child.output_partitioning().partition_count() == count {
                split_children.push(self.split(child)?);
            } else {
                return None;
            }
        }
        replace_children_if_necessary(plan.clone(), split_children).ok()
    }
}

/// True if `plan` scans a table anywhere below it.
fn reads_storage(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let mut found = false;
    let _ = plan.apply(|node| {
        found |= node.as_ref().is::<DistributedScanExec>();
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    found
}

/// One channel of a stage computed as several streams, one per group of its storage
/// partitions, each on its own task, merged into the channel's one output: in order when
/// the streams are sorted (a sorted channel feeds a merge), else as batches come.
/// Its output has the stage's channel count; only `channel` runs.
#[derive(Debug)]
pub struct SplitChannelExec {
    channel: usize,
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
}

impl SplitChannelExec {
    pub fn new(channel: usize, channels: usize, input: Arc<dyn ExecutionPlan>) -> Self {
        let input_properties = input.properties();
        let properties = Arc::new(PlanProperties::new(
            input_properties.equivalence_properties().clone(),
            Partitioning::UnknownPartitioning(channels),
            input_properties.emission_type,
            input_properties.boundedness,
        ));
        SplitChannelExec {
            channel,
            input,
            properties,
        }
    }

    /// The channel it runs.
    pub fn channel(&self) -> usize {
        self.channel
    }

    /// How many streams it runs.
    pub fn ways(&self) -> usize {
        self.input.output_partitioning().partition_count()
    }
}

impl DisplayAs for SplitChannelExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "SplitChannelExec: channel={}, ways={}, {}",
            self.channel,
            self.ways(),
            if self.input.output_ordering().is_some() {
                "merged in order"
            } else {
                "merged as batches come"
            }
        )
    }
}

impl ExecutionPlan for SplitChannelExec {
    fn name(&self) -> &str {
        "SplitChannelExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = crate::only_input(children, "SplitChannelExec")?;
        Ok(Arc::new(SplitChannelExec::new(
            self.channel,
            self.properties.output_partitioning().partition_count(),
            input,
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        if partition != self.channel {
            return Err(DataFusionError::Internal(format!(
                "a split of channel {} was asked for channel {partition}",
                self.channel
            )));
        }
        // Both merges run each input stream on a task of its own.
        let merged: Arc<dyn ExecutionPlan> = match self.input.output_ordering() {
            Some(ordering) => Arc::new(SortPreservingMergeExec::new(
                ordering.clone(),
                self.input.clone(),
            )),
            None => Arc::new(CoalescePartitionsExec::new(self.input.clone())),
        };
        merged.execute(0, context)
    }
}

/// One bucket of a storage exchange read once and dealt to `ways` streams, each row to
/// the stream of its storage partition's group: the exchange's side of a split channel's
/// co-located join or aggregation. The streams are fed without bound, so that a stream
/// waiting on another (a merge in order takes a batch from each) never stalls the reading;
/// together they hold no more than the bucket.
#[derive(Debug)]
pub struct DemuxExec {
    input: Arc<dyn ExecutionPlan>,
    bucket: usize,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    group_of_partition: Vec<u32>,
    router: Arc<StorageRouter>,
    /// The streams not yet taken, and the task reading the bucket, once one is asked for.
    dealt: Mutex<Option<Dealt>>,
    properties: Arc<PlanProperties>,
}

type Dealt = (
    Vec<Option<tokio::sync::mpsc::UnboundedReceiver<DfResult<RecordBatch>>>>,
    SpawnedTask<()>,
);

impl DemuxExec {
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        bucket: usize,
        keys: Vec<Arc<dyn PhysicalExpr>>,
        group_of_partition: Vec<u32>,
        ways: usize,
    ) -> Self {
        let router = Arc::new(StorageRouter::new(
            keys.clone(),
            group_of_partition.clone(),
            ways,
        ));
        let input_properties = input.properties();
        let properties = Arc::new(PlanProperties::new(
            datafusion::physical_expr::EquivalenceProperties::new(input.schema()),
            Partitioning::UnknownPartitioning(ways),
            input_properties.emission_type,
            input_properties.boundedness,
        ));
        DemuxExec {
            input,
            bucket,
            keys,
            group_of_partition,
            router,
            dealt: Mutex::new(None),
            properties,
        }
    }

    /// The bucket it reads.
    pub fn bucket(&self) -> usize {
        self.bucket
    }

    /// The expressions rows are hashed by, over its input's columns.
    pub fn keys(&self) -> &[Arc<dyn PhysicalExpr>] {
        &self.keys
    }

    /// The stream of each storage partition of the ring.
    pub fn group_of_partition(&self) -> &[u32] {
        &self.group_of_partition
    }

    fn ways(&self) -> usize {
        self.properties.output_partitioning().partition_count()
    }

    /// Starts reading the bucket, dealing its rows to the streams.
    fn deal(&self, context: Arc<TaskContext>) -> DfResult<Dealt> {
        let mut input = self.input.execute(self.bucket, context)?;
        let router = self.router.clone();
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..self.ways())
            .map(|_| tokio::sync::mpsc::unbounded_channel())
            .unzip();
        let task = SpawnedTask::spawn(async move {
            while let Some(batch) = input.next().await {
                let routed = batch.and_then(|batch| router.route(&batch));
                match routed {
                    Ok(parts) => {
                        for (group, part) in parts {
                            let _ = senders[group].send(Ok(part));
                        }
                    }
                    Err(error) => {
                        let reason = error.to_string();
                        for sender in &senders {
                            let _ = sender.send(Err(DataFusionError::Execution(reason.clone())));
                        }
                        return;
                    }
                }
            }
        });
        Ok((receivers.into_iter().map(Some).collect(), task))
    }
}

impl DisplayAs for DemuxExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "DemuxExec: bucket={}, ways={}, by storage partition of [{}]",
            self.bucket,
            self.ways(),
            self.keys
                .iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

impl ExecutionPlan for DemuxExec {
    fn name(&self) -> &str {
        "DemuxExec"
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
        crate::apply_to_each(&self.keys, f)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = crate::only_input(children, "DemuxExec")?;
        Ok(Arc::new(DemuxExec::new(
            input,
            self.bucket,
            self.keys.clone(),
            self.group_of_partition.clone(),
            self.ways(),
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let mut dealt = self.dealt.lock().expect("demux lock");
        if dealt.is_none() {
            *dealt = Some(self.deal(context)?);
        }
        let (receivers, _) = dealt.as_mut().expect("dealt above");
        let mut receiver = receivers
            .get_mut(partition)
            .and_then(Option::take)
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "stream {partition} of a demultiplexed bucket was asked for twice, or does not exist"
                ))
            })?;
        let stream = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx));
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.input.schema(),
            stream,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::common::collect;
    use datafusion::physical_plan::sorts::sort::SortExec;
    use datafusion::prelude::SessionContext;

    /// One partition per slice of `values`, in one `Int64` column `v`.
    fn streams(values: &[&[i64]]) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let partitions: Vec<Vec<RecordBatch>> = values
            .iter()
            .map(|v| {
                let column = Arc::new(Int64Array::from(v.to_vec()));
                vec![RecordBatch::try_new(schema.clone(), vec![column]).unwrap()]
            })
            .collect();
        MemorySourceConfig::try_new_exec(&partitions, schema, None).unwrap()
    }

    fn values(batches: &[RecordBatch]) -> Vec<i64> {
        batches
            .iter()
            .flat_map(|b| {
                let column = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                column.values().to_vec()
            })
            .collect()
    }

    fn ids(ids: &[u32]) -> Vec<PartitionId> {
        ids.iter().copied().map(PartitionId).collect()
    }

    #[test]
    fn partitions_are_cut_into_contiguous_groups_of_nearly_equal_size() {
        let cut = Groups::cut(ids(&[9, 1, 5, 3, 7, 2, 8]), 3).unwrap();
        assert_eq!(
            cut.groups,
            vec![ids(&[1, 2]), ids(&[3, 5]), ids(&[7, 8, 9])]
        );
        assert_eq!(cut.partitions, ids(&[1, 2, 3, 5, 7, 8, 9]));
        assert!(
            Groups::cut(ids(&[1, 2]), 3).is_none(),
            "fewer partitions than streams"
        );
    }

    #[test]
    fn a_channel_that_scans_no_table_is_not_split() {
        let input = streams(&[&[1], &[2], &[3]]);
        let no_keys = |_: StageId| None;
        assert!(
            split_channel(&input, 0, 2, &no_keys).is_none(),
            "rows of another leaf"
        );
        assert!(
            split_channel(&input, 0, 1, &no_keys).is_none(),
            "one stream"
        );
    }

    #[tokio::test]
    async fn a_split_channel_merges_its_streams_in_order_when_they_are_sorted() {
        let ctx = SessionContext::new().task_ctx();
        let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new("v", 0));
        let ordering = LexOrdering::new(vec![PhysicalSortExpr::new_default(column)]).unwrap();
        let sorted = SortExec::new(ordering, streams(&[&[5, 1, 9], &[4, 8, 2], &[7, 3, 6]]))
            .with_preserve_partitioning(true);
        let split = SplitChannelExec::new(2, 4, Arc::new(sorted));
        assert_eq!(
            split.properties().output_partitioning().partition_count(),
            4,
            "the stage's channel count"
        );
        assert!(
            split.properties().output_ordering().is_some(),
            "it keeps the order"
        );
        let merged = collect(split.execute(2, ctx.clone()).unwrap())
            .await
            .unwrap();
        assert_eq!(values(&merged), (1..=9).collect::<Vec<_>>());
        assert!(
            split.execute(0, ctx.clone()).is_err(),
            "only its channel runs"
        );

        let unsorted = SplitChannelExec::new(1, 4, streams(&[&[5, 1], &[4], &[7, 3]]));
        let mut all = values(&collect(unsorted.execute(1, ctx).unwrap()).await.unwrap());
        all.sort_unstable();
        assert_eq!(all, vec![1, 3, 4, 5, 7], "every stream's rows, once");
    }

    #[tokio::test]
    async fn a_dealt_bucket_gives_each_stream_the_rows_of_its_partitions() {
        use tessera_common::{partition_key_hashes, PartitionRing};
        let ctx = SessionContext::new().task_ctx();
        let bucket: Vec<i64> = (0..200).collect();
        // Bucket 1 is read; bucket 0 must not be.
        let input = streams(&[&[-1, -2], &bucket]);
        let key: Arc<dyn PhysicalExpr> = Arc::new(Column::new("v", 0));
        // A ring of 8: partitions 0-2 to the first stream, 3-7 to the second.
        let group_of_partition = vec![0, 0, 0, 1, 1, 1, 1, 1];
        let demux = DemuxExec::new(input, 1, vec![key], group_of_partition.clone(), 2);
        let ring = PartitionRing::new(8);
        let mut all = Vec::new();
        for stream in 0..2 {
            let rows = values(
                &collect(demux.execute(stream, ctx.clone()).unwrap())
                    .await
                    .unwrap(),
            );
            let column: arrow::array::ArrayRef = Arc::new(Int64Array::from(rows.clone()));
            let hashes = partition_key_hashes(&[("v", &column)]).unwrap();
            for (value, hash) in rows.iter().zip(hashes) {
                let partition = ring.partition_of(hash);
                assert_eq!(
                    group_of_partition[partition.0 as usize] as usize, stream,
                    "{value} (partition {partition}) went to stream {stream}"
                );
            }
            assert!(!rows.is_empty(), "stream {stream} got rows");
            all.extend(rows);
        }
        all.sort_unstable();
        assert_eq!(all, bucket, "every row of the bucket once, none of another");
        assert!(
            demux.execute(0, ctx).is_err(),
            "a stream is taken once: a second reader would get nothing"
        );
    }
}
