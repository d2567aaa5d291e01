//! Exchanges between stages: the receiving end ([`Inbox`], [`ExchangeReadExec`]), the
//! sending end ([`ExchangeWriteExec`]) and the node's registry of both.
//!
//! An exchange has `buckets` input partitions on the consumer side. In a hash or
//! round-robin exchange every producer channel feeds every bucket; in a gather exchange
//! bucket `k` is exactly producer channel `k`'s output, in order (so a sort-preserving
//! merge above it still sees sorted inputs). A bucket goes to every node that hosts a
//! consumer channel reading it: normally one, several for a broadcast (the build side of
//! a join collected on each node).

use super::{now_us, ChannelReport, QueryId, StageId};
use crate::node::Node;
use crate::rpc::{CallError, ExchangeHeader, PutRequest};
use crate::NodeId;
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
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, Semaphore};

/// Bytes one bucket may hold unread before its producers wait (flow control).
pub const INBOX_BUDGET_BYTES: usize = 16 << 20;
/// Rows a producer gathers per destination bucket before sending a batch.
pub const SEND_BATCH_ROWS: usize = 8192;
/// Batches in flight per (producer channel, destination node) stream.
const LINK_DEPTH: usize = 8;
/// Queries remembered as ended, so late batches for them are dropped, not buffered.
const ENDED_QUERIES_KEPT: usize = 4096;

/// How an exchange routes a producer's rows to buckets.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ExchangeMode {
    /// By DataFusion's repartition hash of the expressions (the same on every node).
    Hash,
    /// Whole batches in turn, starting at a bucket that depends on the channel.
    RoundRobin,
    /// Bucket `k` is producer channel `k`'s whole output.
    Gather,
}

impl ExchangeMode {
    /// How many producer channels feed one bucket.
    pub fn senders_per_bucket(&self, producer_channels: usize) -> usize {
        match self {
            ExchangeMode::Gather => 1,
            ExchangeMode::Hash | ExchangeMode::RoundRobin => producer_channels,
        }
    }
}

/// One bucket of one exchange of one query, on the node that consumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InboxKey {
    pub query: QueryId,
    pub exchange: StageId,
    pub bucket: usize,
}

/// Where a batch in an exchange stream belongs: its bucket and its sequence number among
/// the batches its producer channel sent to that bucket.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct BatchTag {
    pub bucket: usize,
    pub seq: u64,
}

/// The batches of one bucket that arrived and are not yet read.
pub struct Inbox {
    key: InboxKey,
    state: Mutex<InboxState>,
    /// Free budget in KiB; a producer takes some per batch, the reader gives it back.
    space: Semaphore,
    arrived: Notify,
}

struct InboxState {
    expected_senders: usize,
    /// Each batch with its sender, sequence number and the budget (KiB) it holds.
    queue: VecDeque<(RecordBatch, usize, u64, u32)>,
    /// (sender, sequence) of every batch read, in the order read: with the producers'
    /// numbered outputs, the lineage that lets this input be replayed in the same order.
    consumed: Vec<(usize, u64)>,
    finished: BTreeSet<usize>,
    next_seq: HashMap<usize, u64>,
    /// The consumer needs no more: batches are dropped on arrival.
    closed: bool,
    failed: Option<String>,
    reader_taken: bool,
    first_batch_us: Option<u64>,
}

impl Inbox {
    fn new(key: InboxKey, expected_senders: usize) -> Inbox {
        Inbox {
            key,
            state: Mutex::new(InboxState {
                expected_senders,
                queue: VecDeque::new(),
                consumed: Vec::new(),
                finished: BTreeSet::new(),
                next_seq: HashMap::new(),
                closed: false,
                failed: None,
                reader_taken: false,
                first_batch_us: None,
            }),
            space: Semaphore::new(INBOX_BUDGET_BYTES >> 10),
            arrived: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        self.state.lock().expect("inbox lock")
    }

    /// Adds a batch from producer channel `sender`, waiting while the bucket is over its
    /// budget. Batches must come in sequence from each sender.
    pub async fn push(&self, sender: usize, seq: u64, batch: RecordBatch) -> Result<(), String> {
        let kib = ((batch.get_array_memory_size() >> 10) as u32)
            .clamp(1, (INBOX_BUDGET_BYTES >> 10) as u32);
        match self.space.acquire_many(kib).await {
            Ok(permit) => permit.forget(),
            // Closed: the consumer is done with this bucket.
            Err(_) => return Ok(()),
        }
        let mut state = self.lock();
        if state.closed {
            return Ok(());
        }
        if state.finished.contains(&sender) {
            return Err(format!(
                "exchange {} bucket {}: channel {sender} sent a batch after its end of stream",
                self.key.exchange, self.key.bucket
            ));
        }
        let expected = state.next_seq.entry(sender).or_insert(0);
        if seq != *expected {
            return Err(format!(
                "exchange {} bucket {} of query {:x}: batch {seq} from channel {sender} arrived where batch {} was due",
                self.key.exchange, self.key.bucket, self.key.query, *expected
            ));
        }
        *expected += 1;
        state.first_batch_us.get_or_insert_with(now_us);
        state.queue.push_back((batch, sender, seq, kib));
        drop(state);
        self.arrived.notify_one();
        Ok(())
    }

    /// Producer channel `sender` has sent everything it will send to this bucket.
    pub fn finish(&self, sender: usize) {
        self.lock().finished.insert(sender);
        self.arrived.notify_one();
    }

    /// The exchange broke (a producer or its node failed): the reader gets `reason`.
    pub fn fail(&self, reason: String) {
        let mut state = self.lock();
        if !state.closed {
            state.failed.get_or_insert(reason);
        }
        drop(state);
        self.arrived.notify_one();
    }

    /// The consumer needs nothing more: drop what is queued and whatever still arrives, so
    /// no producer waits on a bucket nobody reads.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.queue.clear();
        drop(state);
        self.space.close();
    }

    /// The (sender, sequence number) of every batch read so far, in reading order.
    pub fn consumed(&self) -> Vec<(usize, u64)> {
        self.lock().consumed.clone()
    }

    pub fn first_batch_us(&self) -> Option<u64> {
        self.lock().first_batch_us
    }

    /// The next batch; `None` once every sender has ended its stream and all was read.
    pub async fn next(&self) -> Option<Result<RecordBatch, String>> {
        loop {
            {
                let mut state = self.lock();
                if let Some(reason) = &state.failed {
                    return Some(Err(reason.clone()));
                }
                if let Some((batch, sender, seq, kib)) = state.queue.pop_front() {
                    state.consumed.push((sender, seq));
                    drop(state);
                    self.space.add_permits(kib as usize);
                    return Some(Ok(batch));
                }
                if state.closed || state.finished.len() >= state.expected_senders {
                    return None;
                }
            }
            // notify_one keeps a permit when nobody waits, so a push between the check
            // above and this wait is not missed.
            self.arrived.notified().await;
        }
    }
}

/// A node's exchanges and running channels, by query.
#[derive(Default)]
pub struct QueryRegistry {
    inboxes: Mutex<HashMap<InboxKey, Arc<Inbox>>>,
    ended: Mutex<(HashSet<QueryId>, VecDeque<QueryId>)>,
    running: Mutex<HashMap<QueryId, Vec<tokio::task::AbortHandle>>>,
    /// Component statistics read for scans on this node.
    pub statistics: Arc<tessera_sql::provider::ComponentStatistics>,
}

impl QueryRegistry {
    /// The inbox of `key`, made on first use by whichever end comes first. `None` if the
    /// query has ended here: whatever still arrives for it is not needed.
    pub fn inbox(&self, key: InboxKey, expected_senders: usize) -> Option<Arc<Inbox>> {
        if self.has_ended(key.query) {
            return None;
        }
        let mut inboxes = self.inboxes.lock().expect("inboxes lock");
        Some(
            inboxes
                .entry(key)
                .or_insert_with(|| Arc::new(Inbox::new(key, expected_senders)))
                .clone(),
        )
    }

    /// The inbox of `key` if it exists, without making one.
    pub fn peek(&self, key: InboxKey) -> Option<Arc<Inbox>> {
        self.inboxes
            .lock()
            .expect("inboxes lock")
            .get(&key)
            .cloned()
    }

    pub fn has_ended(&self, query: QueryId) -> bool {
        self.ended.lock().expect("ended lock").0.contains(&query)
    }

    /// The consumer of `key` on this node needs no more of it.
    pub fn close(&self, key: InboxKey) {
        if let Some(inbox) = self.inbox(key, 0) {
            inbox.close();
        }
    }

    /// Tracks a channel task so ending the query stops it.
    pub fn track(&self, query: QueryId, task: tokio::task::AbortHandle) {
        self.running
            .lock()
            .expect("running lock")
            .entry(query)
            .or_default()
            .push(task);
    }

    /// Ends `query` on this node: stops its channels, drops its inboxes, and remembers it
    /// so late batches are dropped. Idempotent.
    pub fn end_query(&self, query: QueryId) {
        {
            let mut ended = self.ended.lock().expect("ended lock");
            if ended.0.insert(query) {
                ended.1.push_back(query);
                if ended.1.len() > ENDED_QUERIES_KEPT {
                    if let Some(old) = ended.1.pop_front() {
                        ended.0.remove(&old);
                    }
                }
            }
        }
        if let Some(tasks) = self.running.lock().expect("running lock").remove(&query) {
            for task in tasks {
                task.abort();
            }
        }
        let mut inboxes = self.inboxes.lock().expect("inboxes lock");
        inboxes.retain(|key, inbox| {
            if key.query == query {
                inbox.close();
                false
            } else {
                true
            }
        });
    }

    /// Inboxes held now (for tests and status).
    pub fn open_inboxes(&self) -> usize {
        self.inboxes.lock().expect("inboxes lock").len()
    }
}

impl std::fmt::Debug for QueryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryRegistry")
            .field("open_inboxes", &self.open_inboxes())
            .finish()
    }
}

/// What a consumer stage reads from one exchange.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReadSpec {
    pub query: QueryId,
    pub exchange: StageId,
    pub mode: ExchangeMode,
    pub buckets: usize,
    pub producer_channels: usize,
}

/// The consumer end of an exchange: output partition `m` is bucket `m`'s batches, from
/// every producer channel that feeds it, as they arrive.
#[derive(Debug)]
pub struct ExchangeReadExec {
    pub spec: ReadSpec,
    schema: SchemaRef,
    registry: Arc<QueryRegistry>,
    properties: Arc<PlanProperties>,
}

impl ExchangeReadExec {
    pub fn new(spec: ReadSpec, schema: SchemaRef, registry: Arc<QueryRegistry>) -> Self {
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(spec.buckets),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        ExchangeReadExec {
            spec,
            schema,
            registry,
            properties,
        }
    }

    pub fn key(&self, bucket: usize) -> InboxKey {
        InboxKey {
            query: self.spec.query,
            exchange: self.spec.exchange,
            bucket,
        }
    }
}

impl DisplayAs for ExchangeReadExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "ExchangeReadExec: exchange={}, mode={:?}, buckets={}, from {} channel(s) of stage {}",
            self.spec.exchange,
            self.spec.mode,
            self.spec.buckets,
            self.spec.producer_channels,
            self.spec.exchange
        )
    }
}

/// Closes its inbox when the reader stops early, so producers never wait on it.
struct CloseOnDrop(Arc<Inbox>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl ExecutionPlan for ExchangeReadExec {
    tessera_sql::leaf_plan_methods!("ExchangeReadExec", no_expressions);

    fn execute(
        &self,
        bucket: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        if bucket >= self.spec.buckets {
            return Err(DataFusionError::Internal(format!(
                "exchange {} has {} buckets, not {bucket}",
                self.spec.exchange, self.spec.buckets
            )));
        }
        let senders = self
            .spec
            .mode
            .senders_per_bucket(self.spec.producer_channels);
        let key = self.key(bucket);
        let inbox = self.registry.inbox(key, senders).ok_or_else(|| {
            DataFusionError::Execution(format!("query {:x} has ended on this node", key.query))
        })?;
        {
            let mut state = inbox.lock();
            // One plan instance per node and stage reads each bucket at most once (shared
            // build sides are collected once per instance); a second reader would split
            // the bucket's rows between them.
            if state.reader_taken {
                return Err(DataFusionError::Internal(format!(
                    "exchange {} bucket {bucket} read twice on one node",
                    key.exchange
                )));
            }
            state.reader_taken = true;
        }
        let guard = CloseOnDrop(inbox);
        let stream = futures::stream::unfold(guard, |guard| async move {
            let next = guard.0.next().await?;
            Some((next.map_err(DataFusionError::Execution), guard))
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            stream,
        )))
    }
}

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
    node: Option<Arc<Node>>,
    reports: Arc<Mutex<HashMap<usize, ChannelReport>>>,
    properties: Arc<PlanProperties>,
}

impl ExchangeWriteExec {
    pub fn new(
        spec: WriteSpec,
        hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
        input: Arc<dyn ExecutionPlan>,
        node: Option<Arc<Node>>,
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

    /// What channel `k` did, once its stream has ended.
    pub fn report(&self, channel: usize) -> Option<ChannelReport> {
        self.reports
            .lock()
            .expect("reports lock")
            .get(&channel)
            .cloned()
    }
}

impl DisplayAs for ExchangeWriteExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let exprs: Vec<String> = self.hash_exprs.iter().map(|e| e.to_string()).collect();
        write!(
            f,
            "ExchangeWriteExec: exchange={}, mode={:?}{}, buckets={}",
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
        for expr in &self.hash_exprs {
            if f(expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = children
            .pop()
            .ok_or_else(|| DataFusionError::Internal("ExchangeWriteExec takes one input".into()))?;
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
        let input = self.input.execute(channel, context)?;
        let writer = ChannelWriter {
            node,
            spec: self.spec.clone(),
            hash_exprs: self.hash_exprs.clone(),
            channel,
            channels,
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
        tx: tokio::sync::mpsc::Sender<FlightData>,
        call: tokio::task::JoinHandle<Result<Bytes, CallError>>,
        dictionaries: DictionaryTracker,
    },
}

struct ChannelWriter {
    node: Arc<Node>,
    spec: WriteSpec,
    hash_exprs: Vec<Arc<dyn PhysicalExpr>>,
    channel: usize,
    channels: usize,
    schema: SchemaRef,
    /// Arrow IPC with LZ4 frames, the same for every batch this channel sends.
    options: IpcWriteOptions,
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
                        registry.inbox(key, senders).map(|inbox| (bucket, inbox))
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
                    sender: self.channel,
                    senders_per_bucket: senders,
                    buckets,
                };
                let (tx, rx) = tokio::sync::mpsc::channel(LINK_DEPTH);
                let clients = self.node.clients.clone();
                let first = FlightData::from(SchemaAsIpc::new(&self.schema, &self.options));
                let messages =
                    futures::stream::once(async move { first }).chain(tokio_stream_from(rx));
                let call = tokio::spawn(async move {
                    clients
                        .put_flight(&addr, PutRequest::Exchange(header), messages)
                        .await
                });
                Link::Remote {
                    node: dest,
                    tx,
                    call,
                    dictionaries: DictionaryTracker::new(false),
                }
            };
            links.insert(dest, link);
        }
        Ok(links)
    }

    /// The buckets this channel feeds.
    fn my_buckets(&self) -> Vec<usize> {
        match self.spec.mode {
            ExchangeMode::Gather => vec![self.channel],
            ExchangeMode::Hash | ExchangeMode::RoundRobin => (0..self.spec.buckets).collect(),
        }
    }

    async fn run(self, mut input: SendableRecordBatchStream) -> DfResult<ChannelReport> {
        let started_us = now_us();
        let mut report = ChannelReport {
            stage: self.spec.exchange,
            channel: self.channel,
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
        let mut links = self.open_links()?;
        let mut partitioner = match self.spec.mode {
            ExchangeMode::Hash => Some(BatchPartitioner::new_hash_partitioner(
                self.hash_exprs.clone(),
                self.spec.buckets,
                metrics::Time::new(),
            )?),
            ExchangeMode::RoundRobin => Some(BatchPartitioner::new_round_robin_partitioner(
                self.spec.buckets,
                metrics::Time::new(),
                self.channel,
                self.channels.max(1),
            )),
            ExchangeMode::Gather => None,
        };
        let mut pending: HashMap<usize, BatchCoalescer> = HashMap::new();
        let mut seqs: HashMap<usize, u64> = HashMap::new();
        while let Some(batch) = input.next().await {
            let batch = batch?;
            if batch.num_rows() == 0 {
                continue;
            }
            report.rows += batch.num_rows() as u64;
            let mut parts = Vec::new();
            match partitioner.as_mut() {
                Some(partitioner) => partitioner.partition(batch, |bucket, part| {
                    parts.push((bucket, part));
                    Ok(())
                })?,
                None => parts.push((self.channel, batch)),
            }
            for (bucket, part) in parts {
                let coalescer = pending
                    .entry(bucket)
                    .or_insert_with(|| BatchCoalescer::new(self.schema.clone(), SEND_BATCH_ROWS));
                coalescer.push_batch(part)?;
                while let Some(ready) = coalescer.next_completed_batch() {
                    self.send(&mut links, &mut seqs, bucket, ready, &mut report)
                        .await?;
                }
            }
        }
        let mut buckets: Vec<usize> = pending.keys().copied().collect();
        buckets.sort_unstable();
        for bucket in buckets {
            let coalescer = pending.get_mut(&bucket).expect("bucket is pending");
            coalescer.finish_buffered_batch()?;
            while let Some(ready) = coalescer.next_completed_batch() {
                self.send(&mut links, &mut seqs, bucket, ready, &mut report)
                    .await?;
            }
        }
        // End of stream: local inboxes at once; remote nodes when their streams end, each
        // answering only once it has put every batch in its inboxes (the acknowledgement).
        for (_, link) in links {
            match link {
                Link::Local(inboxes) => {
                    for inbox in inboxes.values() {
                        inbox.finish(self.channel);
                    }
                }
                Link::Remote { node, tx, call, .. } => {
                    drop(tx);
                    let acknowledged = call
                        .await
                        .map_err(|e| exec_error(format!("exchange stream task failed: {e}")))?;
                    acknowledged.map_err(|e| {
                        exec_error(format!(
                            "node {node} did not acknowledge exchange {} from channel {}: {e}",
                            self.spec.exchange, self.channel
                        ))
                    })?;
                }
            }
        }
        report.finished_us = now_us().saturating_sub(self.spec.started_at_us);
        Ok(report)
    }

    async fn send(
        &self,
        links: &mut BTreeMap<NodeId, Link>,
        seqs: &mut HashMap<usize, u64>,
        bucket: usize,
        batch: RecordBatch,
        report: &mut ChannelReport,
    ) -> DfResult<()> {
        let seq = seqs.entry(bucket).or_insert(0);
        let tag = BatchTag { bucket, seq: *seq };
        *seq += 1;
        report.batches += 1;
        for dest in &self.spec.destinations[bucket] {
            match links.get_mut(dest).expect("a link per destination") {
                Link::Local(inboxes) => {
                    if let Some(inbox) = inboxes.get(&bucket) {
                        inbox
                            .push(self.channel, tag.seq, batch.clone())
                            .await
                            .map_err(exec_error)?;
                    }
                }
                Link::Remote {
                    node,
                    tx,
                    dictionaries,
                    ..
                } => {
                    let (dicts, encoded) = IpcDataGenerator::default().encode(
                        &batch,
                        dictionaries,
                        &self.options,
                        &mut IpcWriteContext::default(),
                    )?;
                    let metadata = Bytes::from(serde_json::to_vec(&tag).expect("tags serialize"));
                    let mut messages: Vec<FlightData> =
                        dicts.into_iter().map(FlightData::from).collect();
                    messages.push(FlightData::from(encoded).with_app_metadata(metadata));
                    for message in messages {
                        report.bytes_sent +=
                            (message.data_header.len() + message.data_body.len()) as u64;
                        if tx.send(message).await.is_err() {
                            // The stream task ended early: its error says why.
                            return Err(exec_error(format!(
                                "the exchange stream to node {node} closed early"
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// A stream over a tokio channel's receiver.
fn tokio_stream_from<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// The receiving end of one `do_put` exchange stream: puts each batch into its bucket's
/// inbox (waiting while the bucket is full, which slows the sender through gRPC flow
/// control) and ends the sender's stream in every bucket it named once the stream ends.
pub async fn receive(
    registry: &QueryRegistry,
    header: &ExchangeHeader,
    mut messages: impl futures::Stream<
            Item = Result<
                arrow_flight::decode::DecodedFlightData,
                arrow_flight::error::FlightError,
            >,
        > + Unpin,
) -> Result<(), String> {
    let mut inboxes: HashMap<usize, Arc<Inbox>> = HashMap::new();
    for &bucket in &header.buckets {
        let key = InboxKey {
            query: header.query,
            exchange: header.exchange,
            bucket,
        };
        if let Some(inbox) = registry.inbox(key, header.senders_per_bucket) {
            inboxes.insert(bucket, inbox);
        }
    }
    let broke = |reason: String| {
        for inbox in inboxes.values() {
            inbox.fail(reason.clone());
        }
        reason
    };
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| {
            broke(format!(
                "exchange {} stream from channel {} broke: {e}",
                header.exchange, header.sender
            ))
        })?;
        let arrow_flight::decode::DecodedPayload::RecordBatch(batch) = message.payload else {
            continue;
        };
        let tag: BatchTag = serde_json::from_slice(&message.inner.app_metadata)
            .map_err(|e| format!("an exchange batch without a valid tag: {e}"))?;
        if !header.buckets.contains(&tag.bucket) {
            return Err(format!(
                "exchange {} channel {} sent bucket {} outside its header",
                header.exchange, header.sender, tag.bucket
            ));
        }
        // No inbox: the query ended here, the batch is not needed.
        if let Some(inbox) = inboxes.get(&tag.bucket) {
            inbox.push(header.sender, tag.seq, batch).await?;
        }
    }
    for inbox in inboxes.values() {
        inbox.finish(header.sender);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::time::Duration;

    fn batch(rows: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(
            schema,
            vec![Arc::new(Int64Array::from_iter_values(0..rows))],
        )
        .unwrap()
    }

    fn key(bucket: usize) -> InboxKey {
        InboxKey {
            query: 7,
            exchange: 1,
            bucket,
        }
    }

    #[tokio::test]
    async fn an_inbox_ends_only_when_every_sender_has_ended() {
        let inbox = Inbox::new(key(0), 2);
        inbox.push(0, 0, batch(3)).await.unwrap();
        inbox.finish(0);
        assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 3);
        // Sender 1 has not ended: the reader waits.
        let waiting = tokio::time::timeout(Duration::from_millis(100), inbox.next()).await;
        assert!(waiting.is_err(), "the inbox ended before sender 1 did");
        inbox.push(1, 0, batch(2)).await.unwrap();
        inbox.finish(1);
        assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 2);
        assert!(inbox.next().await.is_none());
        assert_eq!(
            inbox.consumed(),
            vec![(0, 0), (1, 0)],
            "the reading order is recorded"
        );
    }

    #[tokio::test]
    async fn batches_out_of_sequence_or_after_the_end_are_refused() {
        let inbox = Inbox::new(key(0), 1);
        inbox.push(0, 0, batch(1)).await.unwrap();
        let gap = inbox.push(0, 2, batch(1)).await.unwrap_err();
        assert!(
            gap.contains("batch 2 from channel 0 arrived where batch 1 was due"),
            "{gap}"
        );
        inbox.finish(0);
        let late = inbox.push(0, 1, batch(1)).await.unwrap_err();
        assert!(late.contains("after its end of stream"), "{late}");
    }

    #[tokio::test]
    async fn a_full_inbox_holds_its_sender_until_the_reader_takes_a_batch() {
        let inbox = Arc::new(Inbox::new(key(0), 1));
        // Each batch is a little over a quarter of the budget: three fit, a fourth does not.
        let rows = (INBOX_BUDGET_BYTES / 8 / 4 + 1024) as i64;
        for seq in 0..3 {
            inbox.push(0, seq, batch(rows)).await.unwrap();
        }
        let sender = {
            let inbox = inbox.clone();
            tokio::spawn(async move { inbox.push(0, 3, batch(rows)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !sender.is_finished(),
            "a sender went past the inbox's budget"
        );
        inbox.next().await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_secs(5), sender)
            .await
            .expect("reading made room")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn closing_an_inbox_releases_a_waiting_sender_and_drops_what_arrives() {
        let inbox = Arc::new(Inbox::new(key(0), 1));
        let rows = (INBOX_BUDGET_BYTES / 8) as i64;
        inbox.push(0, 0, batch(rows)).await.unwrap();
        let sender = {
            let inbox = inbox.clone();
            tokio::spawn(async move { inbox.push(0, 1, batch(rows)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!sender.is_finished());
        inbox.close();
        tokio::time::timeout(Duration::from_secs(5), sender)
            .await
            .expect("closing released the sender")
            .unwrap()
            .unwrap();
        assert!(
            inbox.next().await.is_none(),
            "a closed inbox yields nothing"
        );
    }

    #[tokio::test]
    async fn a_failed_exchange_reaches_the_reader() {
        let inbox = Inbox::new(key(0), 1);
        inbox.fail("node 3 went away".into());
        let error = inbox.next().await.unwrap().unwrap_err();
        assert_eq!(error, "node 3 went away");
    }

    #[test]
    fn an_ended_query_takes_no_more_batches() {
        let registry = QueryRegistry::default();
        let inbox = registry.inbox(key(0), 1).unwrap();
        registry.end_query(7);
        assert!(registry.inbox(key(0), 1).is_none());
        assert_eq!(registry.open_inboxes(), 0);
        drop(inbox);
        // Another query is unaffected.
        let other = InboxKey { query: 8, ..key(0) };
        assert!(registry.inbox(other, 1).is_some());
    }
}
