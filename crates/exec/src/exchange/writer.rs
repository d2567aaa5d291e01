//! The producer end of an exchange: [`ExchangeWriteExec`], the root of every stage, runs
//! a channel and pushes its rows, partitioned by bucket, numbered and compressed, to the
//! nodes that consume them (this node's inboxes directly, others over `do_put`). Under
//! lineage recovery it backs up what it sends, gives up links to nodes that die, and holds
//! output until the reading order it was computed from is logged (the lineage hooks).

use super::{
    batch_digest, tokio_stream_from, BatchTag, ExchangeMode, Inbox, InboxKey, StreamEnd, StreamMark,
};
use crate::colocate::StorageRouter;
use crate::hooks::Backup;
use crate::wire::ExchangeHeader;
use crate::{now_us, ChannelId, ChannelReport, Exec, NodeId, QueryId, StageId};
use arrow::array::RecordBatch;
use arrow::compute::BatchCoalescer;
use arrow::datatypes::SchemaRef;
use arrow_flight::{FlightData, SchemaAsIpc};
use arrow_ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions};
use bytes::Bytes;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics;
use datafusion::physical_plan::repartition::BatchPartitioner;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties,
};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use tessera_net::CallError;

/// Batches in flight per (producer channel, destination node) stream.
const LINK_DEPTH: usize = 8;

/// What a producer stage sends, and to whom.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WriteSpec {
    pub query: QueryId,
    pub exchange: StageId,
    pub mode: ExchangeMode,
    pub buckets: usize,
    /// For each bucket, the nodes that consume it.
    pub destinations: Vec<Vec<NodeId>>,
    pub addrs: BTreeMap<NodeId, String>,
    /// When the query started, by the initiator's clock (µs since the Unix epoch).
    pub started_at_us: u64,
    /// Under lineage recovery: batches for other nodes are spooled, links to a node that
    /// dies are given up (its consumers are rebuilt and pull from the spool), and output
    /// waits until the reading order it was computed from is logged.
    #[serde(default)]
    pub lineage: bool,
    /// A channel rebuilt after a node died: it spools every batch (its consumers that
    /// died with it pull them), sends only to surviving consumers (which drop what they
    /// already have) and has no logged inputs of its own.
    #[serde(default)]
    pub rebuilt: bool,
    /// The query's initiator: under lineage recovery a channel records with it that its
    /// output starts before any of it leaves ([`crate::hooks::Lineage::log_output_starts`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initiator: Option<NodeId>,
}

impl WriteSpec {
    /// The buckets producer channel `channel` feeds.
    pub fn buckets_of(&self, channel: usize) -> Vec<usize> {
        match self.mode {
            ExchangeMode::Gather => vec![channel],
            ExchangeMode::Collect => vec![0],
            ExchangeMode::Hash | ExchangeMode::Storage { .. } | ExchangeMode::RoundRobin => {
                (0..self.buckets).collect()
            }
        }
    }

    /// True if channel `channel` sends to a consumer on `node`.
    pub fn feeds(&self, channel: usize, node: NodeId) -> bool {
        self.buckets_of(channel)
            .iter()
            .any(|&bucket| self.destinations[bucket].contains(&node))
    }
}

/// The root of every stage: runs its input's partition `k` (channel `k`) and pushes the
/// rows to the exchange's buckets. It outputs no rows itself; what it did is in
/// [`ExchangeWriteExec::report`].
#[derive(Debug)]
pub struct ExchangeWriteExec {
    pub spec: WriteSpec,
    /// The hash expressions of a hash exchange, over the input's schema.
    pub hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
    input: Arc<dyn ExecutionPlan>,
    node: Option<Arc<Exec>>,
    reports: Arc<Mutex<HashMap<usize, ChannelReport>>>,
    properties: Arc<PlanProperties>,
}

impl ExchangeWriteExec {
    pub fn new(
        spec: WriteSpec,
        hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
        input: Arc<dyn ExecutionPlan>,
        node: Option<Arc<Exec>>,
    ) -> Self {
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(input.schema()),
            Partitioning::UnknownPartitioning(input.output_partitioning().partition_count()),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        ExchangeWriteExec {
            spec,
            hash_exprs,
            input,
            node,
            reports: Arc::default(),
            properties,
        }
    }

    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// This stage rebuilt after `dead` died: over `input` (its readers replaying), sending
    /// only to the surviving consumers.
    pub fn rebuilt(&self, input: Arc<dyn ExecutionPlan>, dead: NodeId) -> ExchangeWriteExec {
        let mut spec = self.spec.clone();
        spec.rebuilt = true;
        for nodes in &mut spec.destinations {
            nodes.retain(|&node| node != dead);
        }
        ExchangeWriteExec::new(spec, self.hash_exprs.clone(), input, self.node.clone())
    }

    /// This stage rebuilt after `dead` died for consumers that died with it only: every
    /// surviving consumer has all its output already. It sends nothing; the rebuilt
    /// consumers pull its spool.
    pub fn rebuilt_for_the_dead_only(&self, input: Arc<dyn ExecutionPlan>) -> ExchangeWriteExec {
        let mut spec = self.spec.clone();
        spec.rebuilt = true;
        for nodes in &mut spec.destinations {
            nodes.clear();
        }
        ExchangeWriteExec::new(spec, self.hash_exprs.clone(), input, self.node.clone())
    }

    /// What channel `k` did, once its stream has ended.
    pub fn report(&self, channel: usize) -> Option<ChannelReport> {
        let mut report = self
            .reports
            .lock()
            .expect("reports lock")
            .get(&channel)
            .cloned()?;
        report.spilled_bytes = spilled_bytes(&self.input, channel);
        let mut leaves = Vec::new();
        crate::plan::leaves_of(&self.input, channel, &mut leaves);
        for leaf in leaves {
            if let crate::plan::Leaf::Scan { reads, .. } = leaf {
                report.scanned.add(reads);
            }
        }
        Some(report)
    }
}

impl DisplayAs for ExchangeWriteExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let exprs: Vec<String> = self.hash_exprs.iter().map(|e| e.to_string()).collect();
        write!(
            f,
            "ExchangeWriteExec: exchange={}, mode={}{}, buckets={}",
            self.spec.exchange,
            self.spec.mode,
            if exprs.is_empty() {
                String::new()
            } else {
                format!("([{}])", exprs.join(", "))
            },
            self.spec.buckets
        )
    }
}

impl ExecutionPlan for ExchangeWriteExec {
    fn name(&self) -> &str {
        "ExchangeWriteExec"
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
        crate::apply_to_each(&self.hash_exprs, f)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = crate::only_input(children, "ExchangeWriteExec")?;
        Ok(Arc::new(ExchangeWriteExec::new(
            self.spec.clone(),
            self.hash_exprs.clone(),
            input,
            self.node.clone(),
        )))
    }

    fn execute(
        &self,
        channel: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let node = self.node.clone().ok_or_else(|| {
            DataFusionError::Internal("an exchange writer runs only on a node".into())
        })?;
        let channels = self.input.output_partitioning().partition_count();
        let mut leaves = Vec::new();
        crate::plan::leaves_of(&self.input, channel, &mut leaves);
        let reads = leaves
            .into_iter()
            .filter_map(|leaf| match leaf {
                crate::plan::Leaf::Exchange { exchange, bucket } => Some(InboxKey {
                    query: self.spec.query,
                    exchange,
                    bucket,
                }),
                crate::plan::Leaf::Scan { .. } => None,
            })
            .collect();
        let batch_rows = send_batch_rows(
            node.settings.send_batch_rows,
            context.session_config().batch_size(),
        );
        let input = self.input.execute(channel, context)?;
        let writer = ChannelWriter {
            batch_rows,
            node,
            spec: self.spec.clone(),
            hash_exprs: self.hash_exprs.clone(),
            channel,
            channels,
            reads,
            schema: self.input.schema(),
            options: IpcWriteOptions::default()
                .try_with_compression(Some(arrow_ipc::CompressionType::LZ4_FRAME))?,
        };
        let reports = self.reports.clone();
        let run = async move {
            let report = writer.run(input).await?;
            reports
                .lock()
                .expect("reports lock")
                .insert(channel, report);
            Ok::<(), DataFusionError>(())
        };
        // No rows: the stream only carries the channel's failure, if any.
        let stream = futures::stream::once(run)
            .filter_map(|result| async move { result.err().map(Err::<RecordBatch, _>) });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.input.schema(),
            stream,
        )))
    }
}

/// Where one producer channel's batches for one node go.
enum Link {
    /// This node: straight into the inboxes.
    Local(HashMap<usize, Arc<Inbox>>),
    /// Another node: a `do_put` stream fed through a bounded queue.
    Remote {
        node: NodeId,
        /// The buckets its stream carries, which its end-of-stream mark counts.
        buckets: Vec<usize>,
        tx: tokio::sync::mpsc::Sender<FlightData>,
        call: tokio::task::JoinHandle<Result<Bytes, CallError>>,
    },
}

struct ChannelWriter {
    node: Arc<Exec>,
    spec: WriteSpec,
    hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
    channel: usize,
    channels: usize,
    /// The inboxes this channel reads: under lineage recovery its output waits for their
    /// reading order to be logged.
    reads: Vec<InboxKey>,
    schema: SchemaRef,
    /// Rows per batch sent ([`send_batch_rows`]).
    batch_rows: usize,
    /// Arrow IPC with LZ4 frames, the same for every batch this channel sends.
    options: IpcWriteOptions,
}

/// Output batches held while the lineage they depend on is being logged.
const HOLD_DEPTH: usize = 32;

/// A batch ready to go to `bucket`, once the reading order it was computed from (a
/// position in each logged inbox the channel reads) is in the metadata store.
struct Ready {
    bucket: usize,
    batch: RecordBatch,
    after: Vec<(InboxKey, usize)>,
}

/// The sending side's state while a channel runs.
struct Outbox {
    links: BTreeMap<NodeId, Link>,
    /// Destinations given up because their stream broke (lineage recovery).
    lost: BTreeSet<NodeId>,
    seqs: HashMap<usize, u64>,
    spool: Option<Arc<dyn Backup>>,
    /// The initiator has recorded that this channel's output starts (or need not).
    announced: bool,
    report: ChannelReport,
}

impl Outbox {
    /// How many batches this channel has sent to `bucket`.
    fn sent(&self, bucket: usize) -> u64 {
        self.seqs.get(&bucket).copied().unwrap_or(0)
    }
}

/// How many rows a channel gathers into each batch it sends: the node's `send_batch_rows`,
/// unless the query's session set its own `datafusion.execution.batch_size` (one that is
/// not DataFusion's default), which then holds across the exchanges too. A session that
/// asks for small batches to keep its operators' memory down gets them from every stage,
/// not only from the scans.
pub(super) fn send_batch_rows(node_send_batch_rows: usize, session_batch_size: usize) -> usize {
    if session_batch_size != crate::settings::default_batch_size() && session_batch_size > 0 {
        session_batch_size
    } else {
        node_send_batch_rows
    }
}

fn exec_error(message: String) -> DataFusionError {
    DataFusionError::Execution(message)
}

impl ChannelWriter {
    fn open_links(&self) -> DfResult<BTreeMap<NodeId, Link>> {
        let me = self.node.id();
        let senders = self.spec.mode.senders_per_bucket(self.channels);
        let mut buckets_by_node: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        for bucket in self.my_buckets() {
            for &dest in &self.spec.destinations[bucket] {
                buckets_by_node.entry(dest).or_default().push(bucket);
            }
        }
        let mut links = BTreeMap::new();
        for (dest, buckets) in buckets_by_node {
            let link = if dest == me {
                let registry = &self.node.queries;
                let inboxes = buckets
                    .iter()
                    .filter_map(|&bucket| {
                        let key = InboxKey {
                            query: self.spec.query,
                            exchange: self.spec.exchange,
                            bucket,
                        };
                        let inbox = registry.inbox(key, senders)?;
                        if self.spec.lineage {
                            inbox.expect_resends();
                        }
                        Some((bucket, inbox))
                    })
                    .collect();
                Link::Local(inboxes)
            } else {
                let addr = self.spec.addrs.get(&dest).cloned().ok_or_else(|| {
                    exec_error(format!(
                        "no address for node {dest} in the query's snapshot"
                    ))
                })?;
                let header = ExchangeHeader {
                    query: self.spec.query,
                    exchange: self.spec.exchange,
                    sender: ChannelId(self.channel),
                    senders_per_bucket: senders,
                    buckets: buckets.clone(),
                    lineage: self.spec.lineage,
                };
                let (tx, rx) = tokio::sync::mpsc::channel(LINK_DEPTH);
                let clients = self.node.clients.clone();
                let first = FlightData::from(SchemaAsIpc::new(&self.schema, &self.options));
                let messages =
                    futures::stream::once(async move { first }).chain(tokio_stream_from(rx));
                let call =
                    tokio::spawn(async move { clients.put_flight(&addr, &header, messages).await });
                Link::Remote {
                    node: dest,
                    buckets,
                    tx,
                    call,
                }
            };
            links.insert(dest, link);
        }
        Ok(links)
    }

    /// The buckets this channel feeds.
    fn my_buckets(&self) -> Vec<usize> {
        self.spec.buckets_of(self.channel)
    }

    /// Where each logged inbox this channel reads stands now: output computed so far
    /// depends on no more than that.
    fn reading_positions(&self) -> Vec<(InboxKey, usize)> {
        // Stage 0 runs on the initiator, whose death ends the query: it is never rebuilt,
        // so its output need not wait for its lineage. Nor a rebuilt channel's, which
        // logs none (a second failure restarts the query).
        if !self.spec.lineage || self.spec.rebuilt || self.spec.exchange == StageId::ANSWER {
            return Vec::new();
        }
        self.reads
            .iter()
            .filter_map(|key| self.node.queries.peek(*key))
            .filter(|inbox| self.node.lineage.logs_reading_order(inbox.key()))
            .map(|inbox| (inbox.key(), inbox.read_so_far()))
            .collect()
    }

    async fn run(self, input: SendableRecordBatchStream) -> DfResult<ChannelReport> {
        let started_us = now_us();
        let report = ChannelReport {
            stage: self.spec.exchange,
            channel: ChannelId(self.channel),
            node: self.node.id(),
            started_us: started_us.saturating_sub(self.spec.started_at_us),
            ..Default::default()
        };
        if self.spec.mode == ExchangeMode::Gather && self.channel >= self.spec.buckets {
            return Err(DataFusionError::Internal(format!(
                "gather exchange {} has {} buckets but channel {} writes to it",
                self.spec.exchange, self.spec.buckets, self.channel
            )));
        }
        let spool = if self.spec.lineage {
            let key = (self.spec.query, self.spec.exchange, ChannelId(self.channel));
            let schema = FlightData::from(SchemaAsIpc::new(&self.schema, &self.options));
            Some(
                self.node
                    .back_up(key, schema)
                    .map_err(|e| exec_error(e.to_string()))?,
            )
        } else {
            None
        };
        let mut outbox = Outbox {
            links: self.open_links()?,
            lost: BTreeSet::new(),
            seqs: HashMap::new(),
            spool: spool.clone(),
            announced: false,
            report,
        };
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<Ready>(HOLD_DEPTH);
        let produce = self.produce(input, ready_tx);
        let deliver = async {
            while let Some(ready) = ready_rx.recv().await {
                for &(inbox, position) in &ready.after {
                    self.node
                        .lineage
                        .wait_logged(inbox, position)
                        .await
                        .map_err(|e| exec_error(e.to_string()))?;
                }
                self.send(&mut outbox, ready.bucket, ready.batch).await?;
            }
            self.end_streams(&mut outbox).await?;
            Ok::<(), DataFusionError>(())
        };
        let result = futures::future::try_join(produce, deliver).await;
        if let Some(spool) = &spool {
            spool.finish(result.as_ref().err().map(|e| e.to_string()));
        }
        let (rows, ()) = result?;
        let mut report = outbox.report;
        report.rows = rows;
        report.finished_us = now_us().saturating_sub(self.spec.started_at_us);
        Ok(report)
    }

    /// Partitions the input into buckets and gathers full batches per bucket; returns the
    /// rows read.
    async fn produce(
        &self,
        mut input: SendableRecordBatchStream,
        ready: tokio::sync::mpsc::Sender<Ready>,
    ) -> DfResult<u64> {
        let mut router = match &self.spec.mode {
            ExchangeMode::Hash => Router::DataFusion(BatchPartitioner::new_hash_partitioner(
                self.hash_exprs.clone(),
                self.spec.buckets,
                metrics::Time::new(),
            )?),
            ExchangeMode::Storage {
                bucket_of_partition,
            } => Router::Storage(StorageRouter::new(
                self.hash_exprs.clone(),
                bucket_of_partition.clone(),
                self.spec.buckets,
            )),
            ExchangeMode::RoundRobin => {
                Router::DataFusion(BatchPartitioner::new_round_robin_partitioner(
                    self.spec.buckets,
                    metrics::Time::new(),
                    self.channel,
                    self.channels.max(1),
                ))
            }
            ExchangeMode::Gather | ExchangeMode::Collect => Router::Own,
        };
        let own_bucket = self.my_buckets()[0];
        let hand_over = |bucket: usize, batch: RecordBatch| {
            let after = self.reading_positions();
            let ready = ready.clone();
            async move {
                ready
                    .send(Ready {
                        bucket,
                        batch,
                        after,
                    })
                    .await
                    .map_err(|_| exec_error("the channel's sender stopped".into()))
            }
        };
        let mut rows = 0u64;
        let mut pending: HashMap<usize, BatchCoalescer> = HashMap::new();
        while let Some(batch) = input.next().await {
            let batch = batch?;
            if batch.num_rows() == 0 {
                continue;
            }
            rows += batch.num_rows() as u64;
            let mut parts = Vec::new();
            match &mut router {
                Router::DataFusion(partitioner) => {
                    partitioner.partition(batch, |bucket, part| {
                        parts.push((bucket, part));
                        Ok(())
                    })?
                }
                Router::Storage(router) => parts = router.route(&batch)?,
                Router::Own => parts.push((own_bucket, batch)),
            }
            for (bucket, part) in parts {
                let coalescer = pending
                    .entry(bucket)
                    .or_insert_with(|| BatchCoalescer::new(self.schema.clone(), self.batch_rows));
                coalescer.push_batch(part)?;
                while let Some(full) = coalescer.next_completed_batch() {
                    hand_over(bucket, full).await?;
                }
            }
        }
        let mut buckets: Vec<usize> = pending.keys().copied().collect();
        buckets.sort_unstable();
        for bucket in buckets {
            let coalescer = pending.get_mut(&bucket).expect("bucket is pending");
            coalescer.finish_buffered_batch()?;
            while let Some(full) = coalescer.next_completed_batch() {
                hand_over(bucket, full).await?;
            }
        }
        Ok(rows)
    }

    /// A link's stream ended early. Under lineage recovery a dead destination is given up
    /// (its consumers are rebuilt elsewhere and pull from the spool); anything else fails
    /// the channel.
    async fn link_broke(&self, outbox: &mut Outbox, dest: NodeId) -> DfResult<()> {
        let Some(Link::Remote { call, .. }) = outbox.links.remove(&dest) else {
            return Ok(());
        };
        let outcome = call
            .await
            .map_err(|e| exec_error(format!("exchange stream task failed: {e}")))?;
        match outcome {
            Err(error) if error.is_transport() && self.spec.lineage => {
                tracing::warn!(
                    query = %self.spec.query,
                    exchange = self.spec.exchange.0,
                    channel = self.channel,
                    dest = dest.0,
                    %error,
                    "exchange stream to a node broke; its batches stay spooled for its rebuilt consumers"
                );
                self.node.suspect(dest);
                outbox.lost.insert(dest);
                Ok(())
            }
            Err(error) => Err(exec_error(format!(
                "node {dest} did not take exchange {} from channel {}: {error}",
                self.spec.exchange, self.channel
            ))),
            Ok(_) => Err(exec_error(format!(
                "the exchange stream to node {dest} closed early"
            ))),
        }
    }

    /// End of stream: local inboxes at once; remote nodes when their streams end, each
    /// answering only once it has put every batch in its inboxes (the acknowledgement).
    /// Then every destination given up must be confirmed dead.
    async fn end_streams(&self, outbox: &mut Outbox) -> DfResult<()> {
        self.announce_output(outbox).await?;
        self.end_links(outbox).await?;
        // A stream given up must be a dead node's, whose consumers the initiator rebuilds;
        // a live node's consumers would wait for ever on what it did not get.
        for &dest in &outbox.lost {
            if !self.node.confirm_failed(dest).await {
                return Err(exec_error(format!(
                    "the exchange {} stream from channel {} to node {dest} broke, but node {dest} is alive",
                    self.spec.exchange, self.channel
                )));
            }
        }
        Ok(())
    }

    async fn end_links(&self, outbox: &mut Outbox) -> DfResult<()> {
        let dests: Vec<NodeId> = outbox.links.keys().copied().collect();
        for dest in dests {
            match outbox.links.remove(&dest).expect("listed above") {
                Link::Local(inboxes) => {
                    for (bucket, inbox) in &inboxes {
                        inbox
                            .finish(self.channel, outbox.sent(*bucket))
                            .map_err(exec_error)?;
                    }
                }
                Link::Remote {
                    node,
                    buckets,
                    tx,
                    call,
                } => {
                    let end = StreamEnd {
                        sent: buckets.iter().map(|&b| (b, outbox.sent(b))).collect(),
                    };
                    // A send fails only if the call already ended; its outcome says why.
                    for message in self.end_mark(end)? {
                        if tx.send(message).await.is_err() {
                            break;
                        }
                    }
                    drop(tx);
                    let acknowledged = call
                        .await
                        .map_err(|e| exec_error(format!("exchange stream task failed: {e}")))?;
                    match acknowledged {
                        Ok(_) => {}
                        Err(error) if error.is_transport() && self.spec.lineage => {
                            outbox.lost.insert(node);
                        }
                        Err(error) => {
                            return Err(exec_error(format!(
                            "node {node} did not acknowledge exchange {} from channel {}: {error}",
                            self.spec.exchange, self.channel
                        )))
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The messages of one batch, self-contained (its dictionaries travel with it), so a
    /// spooled copy can be replayed alone.
    fn encode(&self, batch: &RecordBatch, tag: BatchTag) -> DfResult<Vec<FlightData>> {
        self.encode_marked(batch, &StreamMark::Batch(tag))
    }

    /// A stream's end-of-stream mark: an empty batch whose metadata counts what was sent
    /// (with its empty dictionaries, so it decodes even when no batch came before it).
    fn end_mark(&self, end: StreamEnd) -> DfResult<Vec<FlightData>> {
        let empty = RecordBatch::new_empty(self.schema.clone());
        self.encode_marked(&empty, &StreamMark::End(end))
    }

    fn encode_marked(&self, batch: &RecordBatch, mark: &StreamMark) -> DfResult<Vec<FlightData>> {
        encode_marked(batch, mark, &self.options)
    }

    /// Before anything of this channel leaves it: under lineage recovery the initiator
    /// records that its output starts, so a rebuild knows whether anyone may hold part of
    /// it. A rebuilt channel records nothing (a second failure restarts the query), nor
    /// does the answer's stage, which runs on the initiator.
    async fn announce_output(&self, outbox: &mut Outbox) -> DfResult<()> {
        if outbox.announced {
            return Ok(());
        }
        outbox.announced = true;
        let initiator = match self.spec.initiator {
            Some(initiator)
                if self.spec.lineage
                    && !self.spec.rebuilt
                    && self.spec.exchange != StageId::ANSWER =>
            {
                initiator
            }
            _ => return Ok(()),
        };
        let key = (self.spec.query, self.spec.exchange, ChannelId(self.channel));
        self.node
            .lineage
            .log_output_starts(key, initiator)
            .await
            .map_err(|e| exec_error(e.to_string()))
    }

    async fn send(&self, outbox: &mut Outbox, bucket: usize, batch: RecordBatch) -> DfResult<()> {
        self.announce_output(outbox).await?;
        let seq = outbox.seqs.entry(bucket).or_insert(0);
        let tag = BatchTag { bucket, seq: *seq };
        *seq += 1;
        outbox.report.batches += 1;
        let me = self.node.id();
        let destinations = &self.spec.destinations[bucket];
        let remote = destinations.iter().any(|&dest| dest != me);
        let spooled = outbox
            .spool
            .as_ref()
            .filter(|_| remote || self.spec.rebuilt);
        let messages = if remote || spooled.is_some() {
            self.encode(&batch, tag)?
        } else {
            Vec::new()
        };
        if let Some(spool) = spooled {
            spool
                .append(tag, &messages)
                .map_err(|e| exec_error(format!("writing the spool: {e}")))?;
        }
        // A rebuilt channel's batches to this node's inboxes are checked like remote ones.
        let digest = match messages.last() {
            Some(message) if self.spec.rebuilt => Some(batch_digest(message)),
            _ => None,
        };
        for &dest in destinations {
            match outbox.links.get_mut(&dest) {
                // Given up: the node died and its consumers pull from the spool.
                None => {}
                Some(Link::Local(inboxes)) => {
                    if let Some(inbox) = inboxes.get(&bucket) {
                        inbox
                            .push(self.channel, tag.seq, batch.clone(), digest)
                            .await
                            .map_err(exec_error)?;
                    }
                }
                Some(Link::Remote { tx, .. }) => {
                    let mut broke = false;
                    for message in &messages {
                        outbox.report.bytes_sent +=
                            (message.data_header.len() + message.data_body.len()) as u64;
                        if tx.send(message.clone()).await.is_err() {
                            broke = true;
                            break;
                        }
                    }
                    if broke {
                        self.link_broke(outbox, dest).await?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// How a channel's output rows find their buckets.
enum Router {
    /// DataFusion's hash or round robin.
    DataFusion(BatchPartitioner),
    /// The storage's partition hash and grouping.
    Storage(StorageRouter),
    /// All into the channel's own bucket (gather, collect).
    Own,
}

/// Bytes the operators of `plan` spilled while computing output partition `channel`.
fn spilled_bytes(plan: &Arc<dyn ExecutionPlan>, channel: usize) -> u64 {
    let own = plan.metrics().map_or(0, |metrics| {
        metrics
            .iter()
            .filter(|m| m.partition() == Some(channel))
            .map(|m| match m.value() {
                metrics::MetricValue::SpilledBytes(count) => count.value() as u64,
                _ => 0,
            })
            .sum()
    });
    own + plan
        .children()
        .into_iter()
        .map(|child| spilled_bytes(child, channel))
        .sum::<u64>()
}

/// The messages of one batch marked with `mark`: its dictionaries, then the batch. A
/// bucket's rows taken from a larger batch share its string values' buffers, which IPC
/// would send whole with every bucket: they are compacted first.
pub(super) fn encode_marked(
    batch: &RecordBatch,
    mark: &StreamMark,
    options: &IpcWriteOptions,
) -> DfResult<Vec<FlightData>> {
    let batch = tessera_common::views::compact_if_wasteful(batch.clone())?;
    let (dicts, encoded) = IpcDataGenerator::default().encode(
        &batch,
        &mut DictionaryTracker::new(false),
        options,
        &mut IpcWriteContext::default(),
    )?;
    let metadata = Bytes::from(serde_json::to_vec(mark).expect("marks serialize"));
    let mut messages: Vec<FlightData> = dicts.into_iter().map(FlightData::from).collect();
    messages.push(FlightData::from(encoded).with_app_metadata(metadata));
    Ok(messages)
}
