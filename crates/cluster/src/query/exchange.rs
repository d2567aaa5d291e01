//! Exchanges between stages: the receiving end ([`Inbox`], [`ExchangeReadExec`]), the
//! sending end ([`ExchangeWriteExec`]) and the node's registry of both.
//!
//! An exchange has `buckets` input partitions on the consumer side. In a hash or
//! round-robin exchange every producer channel feeds every bucket; in a gather exchange
//! bucket `k` is exactly producer channel `k`'s output, in order (so a sort-preserving
//! merge above it still sees sorted inputs). A bucket goes to every node that hosts a
//! consumer channel reading it: normally one, several for a broadcast (the build side of
//! a join collected on each node).
//!
//! Why this file is long (over 1000 lines): inbox, registry, reader, writer and receive
//! still live together, with lineage state woven through them. Splitting them apart, with
//! lineage as hooks a recovery crate implements, is a redesign of its own (the next step of
//! the crate-per-layer work), not a move of code; its tests already live in `exchange/`.

use super::spool::{Spool, SpoolKey};
use super::Exec;
use super::{now_us, ChannelReport, QueryId, StageId};
use crate::rpc::{CallError, ExchangeHeader};
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
    /// Every producer channel's whole output goes to bucket 0, the only one: a
    /// coalesce's input, read in arrival order (which lineage records, so a rebuilt
    /// consumer replays it; a coalesce over one bucket per producer would interleave
    /// them nondeterministically).
    Collect,
}

impl ExchangeMode {
    /// How many producer channels feed one bucket.
    pub fn senders_per_bucket(&self, producer_channels: usize) -> usize {
        match self {
            ExchangeMode::Gather => 1,
            ExchangeMode::Hash | ExchangeMode::RoundRobin | ExchangeMode::Collect => {
                producer_channels
            }
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

/// A short content hash of one encoded exchange batch: a re-sent batch must match the
/// one first received, or the rebuilt producer did not reproduce its output.
pub type Digest = [u8; 16];

/// The digest of an encoded batch message (its IPC header and body).
pub fn batch_digest(message: &FlightData) -> Digest {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&message.data_header);
    hasher.update(&message.data_body);
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
    digest
}

/// The batches of one bucket that arrived and are not yet read.
pub struct Inbox {
    key: InboxKey,
    state: Mutex<InboxState>,
    /// Free budget in KiB; a producer takes some per batch, the reader gives it back.
    space: Semaphore,
    arrived: Notify,
    /// How many entries of the reading order the metadata store holds (lineage inboxes),
    /// or why logging them failed.
    committed: tokio::sync::watch::Sender<Result<usize, String>>,
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
    /// Under lineage recovery: re-sent batches (a rebuilt producer starts again from
    /// sequence 0) are checked against these digests and dropped.
    resends_expected: bool,
    digests: HashMap<usize, Vec<Option<Digest>>>,
    /// Set when the reading order is logged: the node's lineage committer, woken when
    /// output waits on it, and the query's initiator.
    lineage: Option<(Arc<Notify>, crate::NodeId)>,
    /// Entries of `consumed` handed to the committer.
    logged: usize,
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
                resends_expected: false,
                digests: HashMap::new(),
                lineage: None,
                logged: 0,
                closed: false,
                failed: None,
                reader_taken: false,
                first_batch_us: None,
            }),
            space: Semaphore::new(INBOX_BUDGET_BYTES >> 10),
            arrived: Notify::new(),
            committed: tokio::sync::watch::Sender::new(Ok(0)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        self.state.lock().expect("inbox lock")
    }

    pub fn key(&self) -> InboxKey {
        self.key
    }

    /// Producers may re-send batches (lineage recovery): keep digests to check them.
    pub fn expect_resends(&self) {
        self.lock().resends_expected = true;
    }

    /// Adds a batch from producer channel `sender`, waiting while the bucket is over its
    /// budget. Batches must come in sequence from each sender; under lineage recovery a
    /// batch already received is dropped if its digest matches the first copy's.
    pub async fn push(
        &self,
        sender: usize,
        seq: u64,
        batch: RecordBatch,
        digest: Option<Digest>,
    ) -> Result<(), String> {
        if self.is_resent(sender, seq, digest)? {
            return Ok(());
        }
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
        if state.resends_expected {
            state.digests.entry(sender).or_default().push(digest);
        }
        state.first_batch_us.get_or_insert_with(now_us);
        state.queue.push_back((batch, sender, seq, kib));
        drop(state);
        self.arrived.notify_one();
        Ok(())
    }

    /// True if batch `seq` of `sender` arrived before (a rebuilt producer re-sending it);
    /// an error if it differs from the first copy.
    fn is_resent(&self, sender: usize, seq: u64, digest: Option<Digest>) -> Result<bool, String> {
        let state = self.lock();
        let received = state.next_seq.get(&sender).copied().unwrap_or(0);
        if seq >= received || !state.resends_expected {
            return Ok(false);
        }
        let first = state
            .digests
            .get(&sender)
            .and_then(|d| d.get(seq as usize))
            .copied()
            .flatten();
        match (first, digest) {
            (Some(first), Some(again)) if first == again => Ok(true),
            _ => Err(format!(
                "exchange {} bucket {} of query {:x}: channel {sender} re-sent batch {seq} different from the first time (its rebuilt producer is not deterministic)",
                self.key.exchange, self.key.bucket, self.key.query
            )),
        }
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
        // What was read stays to be logged: output computed from it may still wait.
        self.space.close();
    }

    /// The (sender, sequence number) of every batch read so far, in reading order.
    pub fn consumed(&self) -> Vec<(usize, u64)> {
        self.lock().consumed.clone()
    }

    pub fn first_batch_us(&self) -> Option<u64> {
        self.lock().first_batch_us
    }

    /// Logs this inbox's reading order: `committer` is woken when output waits on it.
    pub fn log_lineage(&self, committer: Arc<Notify>, initiator: crate::NodeId) {
        self.lock().lineage = Some((committer, initiator));
    }

    /// True if this inbox's reading order is logged.
    pub fn logs_lineage(&self) -> bool {
        self.lock().lineage.is_some()
    }

    /// The entries of the reading order not yet handed to the committer: where they
    /// start, the runs of (sender, batches), and the query's initiator. Marks them handed.
    pub fn take_unlogged(&self) -> Option<(usize, Vec<(u32, u32)>, crate::NodeId)> {
        let mut state = self.lock();
        let initiator = state.lineage.as_ref()?.1;
        let from = state.logged;
        if from >= state.consumed.len() {
            return None;
        }
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &(sender, _) in &state.consumed[from..] {
            match runs.last_mut() {
                Some((last, count)) if *last == sender as u32 => *count += 1,
                _ => runs.push((sender as u32, 1)),
            }
        }
        state.logged = state.consumed.len();
        Some((from, runs, initiator))
    }

    /// How many batches have been read so far (a position in the reading order).
    pub fn read_so_far(&self) -> usize {
        self.lock().consumed.len()
    }

    /// The metadata store holds the reading order up to `position`.
    pub fn committed_up_to(&self, position: usize) {
        self.committed
            .send_if_modified(|committed| match committed {
                Ok(at) if *at < position => {
                    *at = position;
                    true
                }
                _ => false,
            });
    }

    /// Logging the reading order failed: whoever waits on it fails with `reason`.
    pub fn commit_failed(&self, reason: String) {
        let _ = self.committed.send_replace(Err(reason));
    }

    /// Waits until the reading order up to `position` is in the metadata store: output
    /// computed from those batches may then be sent (write-ahead lineage).
    pub async fn wait_committed(&self, position: usize) -> Result<(), String> {
        let mut watch = self.committed.subscribe();
        let behind = matches!(&*watch.borrow(), Ok(at) if *at < position);
        if behind {
            // Logged on demand: a round covers whatever every logged inbox here has read,
            // so a channel that only emits at its end costs one round, not one per batch.
            if let Some((committer, _)) = &self.lock().lineage {
                committer.notify_one();
            }
        }
        let reached = watch
            .wait_for(|committed| match committed {
                Ok(at) => *at >= position,
                Err(_) => true,
            })
            .await
            .map_err(|_| "the inbox is gone".to_string())?;
        match &*reached {
            Ok(_) => Ok(()),
            Err(reason) => Err(format!(
                "logging the lineage of exchange {} bucket {} failed: {reason}",
                self.key.exchange, self.key.bucket
            )),
        }
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
    /// Woken whenever a query ends here.
    ended_now: Notify,
    running: Mutex<HashMap<QueryId, Vec<tokio::task::AbortHandle>>>,
    /// Producers' upstream backups, kept until their query ends.
    spools: Mutex<HashMap<SpoolKey, Arc<Spool>>>,
    spool_dir: Mutex<Option<std::path::PathBuf>>,
    /// Inboxes whose reading order is logged, and the committer they wake.
    lineage_inboxes: Mutex<Vec<Arc<Inbox>>>,
    pub lineage_committer: Arc<Notify>,
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

    /// Waits until `query` ends on this node.
    pub async fn wait_ended(&self, query: QueryId) {
        loop {
            let ended = self.ended_now.notified();
            if self.has_ended(query) {
                return;
            }
            ended.await;
        }
    }

    /// The consumer of `key` on this node needs no more of it.
    pub fn close(&self, key: InboxKey) {
        if let Some(inbox) = self.inbox(key, 0) {
            inbox.close();
        }
    }

    /// Where spools are written (the node's data directory; a temporary one by default).
    pub fn set_spool_dir(&self, dir: std::path::PathBuf) {
        *self.spool_dir.lock().expect("spool dir lock") = Some(dir);
    }

    /// The spool of `key`, made on first use by the producer or a follower. `None` once
    /// the query has ended here.
    pub fn spool(&self, key: SpoolKey) -> Option<Arc<Spool>> {
        if self.has_ended(key.0) {
            return None;
        }
        let dir = self
            .spool_dir
            .lock()
            .expect("spool dir lock")
            .clone()
            .unwrap_or_else(|| {
                std::env::temp_dir().join(format!("tessera-spool-{}", std::process::id()))
            });
        let mut spools = self.spools.lock().expect("spools lock");
        Some(
            spools
                .entry(key)
                .or_insert_with(|| Arc::new(Spool::new(&dir, key)))
                .clone(),
        )
    }

    /// Logs the reading order of `inbox` through this node's lineage committer.
    pub fn log_lineage(&self, inbox: &Arc<Inbox>, initiator: crate::NodeId) {
        inbox.log_lineage(self.lineage_committer.clone(), initiator);
        self.lineage_inboxes
            .lock()
            .expect("lineage inboxes lock")
            .push(inbox.clone());
    }

    /// The inboxes whose reading order is logged, of queries still running here.
    pub fn lineage_inboxes(&self) -> Vec<Arc<Inbox>> {
        self.lineage_inboxes
            .lock()
            .expect("lineage inboxes lock")
            .clone()
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

    /// Ends `query` on this node: stops its channels, drops its inboxes and spools, and
    /// remembers it so late batches are dropped. Idempotent.
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
        self.ended_now.notify_waiters();
        if let Some(tasks) = self.running.lock().expect("running lock").remove(&query) {
            for task in tasks {
                task.abort();
            }
        }
        {
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
        self.lineage_inboxes
            .lock()
            .expect("lineage inboxes lock")
            .retain(|inbox| inbox.key().query != query);
        self.spools
            .lock()
            .expect("spools lock")
            .retain(|key, spool| {
                if key.0 == query {
                    spool.drop_file();
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
    /// Under lineage recovery: the reading order of buckets with several senders is
    /// logged, and re-sent batches are checked and dropped.
    #[serde(default)]
    pub lineage: bool,
    /// The query's initiator (its lineage is dropped if the initiator dies).
    #[serde(default)]
    pub initiator: NodeId,
    /// A rebuilt consumer reads its buckets from the producers' spools instead.
    #[serde(default)]
    pub replay: Option<Replay>,
}

/// Where a rebuilt consumer's input comes from, and in what order it was first read.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Replay {
    /// The node that now holds each producer channel's spool.
    pub producers: Vec<NodeId>,
    pub addrs: BTreeMap<NodeId, String>,
    /// For each bucket with a logged reading order: runs of (sender, batches).
    pub scripts: BTreeMap<usize, Vec<(u32, u32)>>,
}

/// The consumer end of an exchange: output partition `m` is bucket `m`'s batches, from
/// every producer channel that feeds it, as they arrive.
#[derive(Debug)]
pub struct ExchangeReadExec {
    pub spec: ReadSpec,
    schema: SchemaRef,
    node: Arc<Exec>,
    properties: Arc<PlanProperties>,
}

impl ExchangeReadExec {
    pub fn new(spec: ReadSpec, schema: SchemaRef, node: Arc<Exec>) -> Self {
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(spec.buckets),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        ExchangeReadExec {
            spec,
            schema,
            node,
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

    /// The same reader, rebuilt to replay its input from spools.
    pub fn replaying(&self, replay: Replay) -> ExchangeReadExec {
        let mut spec = self.spec.clone();
        spec.replay = Some(replay);
        ExchangeReadExec::new(spec, self.schema.clone(), self.node.clone())
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
        if let Some(replay) = &self.spec.replay {
            return Ok(super::lineage::replay_bucket(
                &self.node,
                &self.spec,
                replay,
                bucket,
                self.schema.clone(),
            ));
        }
        let key = self.key(bucket);
        let registry = &self.node.queries;
        let inbox = registry.inbox(key, senders).ok_or_else(|| {
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
        if self.spec.lineage {
            inbox.expect_resends();
            if senders > 1 {
                registry.log_lineage(&inbox, self.spec.initiator);
            }
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
        let mut leaves = Vec::new();
        super::plan::leaves_of(&self.input, channel, &mut leaves);
        let reads = leaves
            .into_iter()
            .filter_map(|leaf| match leaf {
                super::plan::Leaf::Exchange { exchange, bucket } => Some(InboxKey {
                    query: self.spec.query,
                    exchange,
                    bucket,
                }),
                super::plan::Leaf::Scan { .. } => None,
            })
            .collect();
        let input = self.input.execute(channel, context)?;
        let writer = ChannelWriter {
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
    after: Vec<(Arc<Inbox>, usize)>,
}

/// The sending side's state while a channel runs.
struct Outbox {
    links: BTreeMap<NodeId, Link>,
    /// Destinations given up because their stream broke (lineage recovery).
    lost: BTreeSet<NodeId>,
    seqs: HashMap<usize, u64>,
    spool: Option<Arc<Spool>>,
    report: ChannelReport,
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
                    sender: self.channel,
                    senders_per_bucket: senders,
                    buckets,
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
        match self.spec.mode {
            ExchangeMode::Gather => vec![self.channel],
            ExchangeMode::Collect => vec![0],
            ExchangeMode::Hash | ExchangeMode::RoundRobin => (0..self.spec.buckets).collect(),
        }
    }

    /// Where each logged inbox this channel reads stands now: output computed so far
    /// depends on no more than that.
    fn reading_positions(&self) -> Vec<(Arc<Inbox>, usize)> {
        // Stage 0 runs on the initiator, whose death ends the query: it is never rebuilt,
        // so its output need not wait for its lineage. Nor a rebuilt channel's, which
        // logs none (a second failure restarts the query).
        if !self.spec.lineage || self.spec.rebuilt || self.spec.exchange == 0 {
            return Vec::new();
        }
        self.reads
            .iter()
            .filter_map(|key| self.node.queries.peek(*key))
            .filter(|inbox| inbox.logs_lineage())
            .map(|inbox| {
                let at = inbox.read_so_far();
                (inbox, at)
            })
            .collect()
    }

    async fn run(self, input: SendableRecordBatchStream) -> DfResult<ChannelReport> {
        let started_us = now_us();
        let report = ChannelReport {
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
        let spool = if self.spec.lineage {
            let key = (self.spec.query, self.spec.exchange, self.channel);
            let spool =
                self.node.queries.spool(key).ok_or_else(|| {
                    exec_error(format!("query {:x} has ended on this node", key.0))
                })?;
            spool
                .start(FlightData::from(SchemaAsIpc::new(
                    &self.schema,
                    &self.options,
                )))
                .map_err(|e| exec_error(format!("starting a spool: {e}")))?;
            Some(spool)
        } else {
            None
        };
        let mut outbox = Outbox {
            links: self.open_links()?,
            lost: BTreeSet::new(),
            seqs: HashMap::new(),
            spool: spool.clone(),
            report,
        };
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<Ready>(HOLD_DEPTH);
        let produce = self.produce(input, ready_tx);
        let deliver = async {
            while let Some(ready) = ready_rx.recv().await {
                for (inbox, position) in &ready.after {
                    inbox.wait_committed(*position).await.map_err(exec_error)?;
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
            ExchangeMode::Gather | ExchangeMode::Collect => None,
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
            match partitioner.as_mut() {
                Some(partitioner) => partitioner.partition(batch, |bucket, part| {
                    parts.push((bucket, part));
                    Ok(())
                })?,
                None => parts.push((own_bucket, batch)),
            }
            for (bucket, part) in parts {
                let coalescer = pending
                    .entry(bucket)
                    .or_insert_with(|| BatchCoalescer::new(self.schema.clone(), SEND_BATCH_ROWS));
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
                    query = self.spec.query,
                    exchange = self.spec.exchange,
                    channel = self.channel,
                    dest,
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
                    for inbox in inboxes.values() {
                        inbox.finish(self.channel);
                    }
                }
                Link::Remote { node, tx, call } => {
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
        let (dicts, encoded) = IpcDataGenerator::default().encode(
            batch,
            &mut DictionaryTracker::new(false),
            &self.options,
            &mut IpcWriteContext::default(),
        )?;
        let metadata = Bytes::from(serde_json::to_vec(&tag).expect("tags serialize"));
        let mut messages: Vec<FlightData> = dicts.into_iter().map(FlightData::from).collect();
        messages.push(FlightData::from(encoded).with_app_metadata(metadata));
        Ok(messages)
    }

    async fn send(&self, outbox: &mut Outbox, bucket: usize, batch: RecordBatch) -> DfResult<()> {
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

/// A stream over a tokio channel's receiver.
pub(crate) fn tokio_stream_from<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// The receiving end of one `do_put` exchange stream: puts each batch into its bucket's
/// inbox (waiting while the bucket is full, which slows the sender through gRPC flow
/// control) and ends the sender's stream in every bucket it named once the stream ends.
///
/// Under lineage recovery a broken stream fails nothing: the sender's node died, and its
/// rebuilt channel sends again from the first batch (whose copies are checked and dropped).
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
            if header.lineage {
                inbox.expect_resends();
            }
            inboxes.insert(bucket, inbox);
        }
    }
    let broke = |reason: String| {
        if !header.lineage {
            for inbox in inboxes.values() {
                inbox.fail(reason.clone());
            }
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
            let digest = header.lineage.then(|| batch_digest(&message.inner));
            inbox.push(header.sender, tag.seq, batch, digest).await?;
        }
    }
    for inbox in inboxes.values() {
        inbox.finish(header.sender);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
