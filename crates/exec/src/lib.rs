//! Distributed, pipelined query execution (DESIGN §7).
//!
//! The initiator (any node) plans a query with DataFusion, then [`plan::distribute`] cuts
//! the physical plan into *stages* at exchange boundaries: every hash or round-robin
//! repartition becomes an exchange between two stages, and every gather (coalesce or
//! sort-preserving merge) reads its input from the channels of the stage below. Each
//! stage runs as *channels*, one per output partition of its fragment: a channel that
//! reads a storage partition runs on that partition's primary in the query's snapshot of
//! the partition map; the others are spread over the nodes by hash range.
//!
//! Every stage's fragment ends in an [`exchange::ExchangeWriteExec`], which partitions the
//! channel's output by destination and pushes it, numbered in sequence and compressed, to
//! the nodes that consume it (Arrow Flight `do_put`, one stream per channel and node).
//! Consumers read through [`exchange::ExchangeReadExec`]; each input bucket is an
//! [`exchange::Inbox`] with a byte budget, so a slow consumer slows its producers (flow
//! control) rather than growing memory. A consumer's input ends only when every producer
//! channel has sent its end of stream, and a producer channel ends only when every node
//! it sends to has acknowledged its end of stream.
//!
//! Stages start together (pipelined): a consumer works on the first batches while its
//! producers still scan. Fragments travel serialized with datafusion-proto and
//! [`codec::TesseraCodec`] for Tessera's own operators.
//!
//! Channels are deterministic given their inputs: a channel's input order is the
//! producers' sequence numbers per sender, and its outputs are numbered per destination
//! bucket, so a channel can be re-run and its re-sent outputs recognised. Lineage
//! recovery (the `tessera-recovery` crate, called through the [`hooks`]) builds on that: it
//! logs the order inputs were read in, backs up what producers send, and rebuilds only a
//! dead node's channels.

pub mod answer;
pub mod archive_scan;
pub mod cache;
pub mod codec;
pub mod colocate;
pub mod error;
pub mod exchange;
pub mod existence;
pub mod explain;
pub mod hooks;
pub mod memory;
pub mod plan;
pub mod progress;
pub mod reachability;
pub mod remote_snapshot;
pub mod replica_read;
pub mod run;
pub mod scan;
pub mod scan_gate;
pub mod session;
pub mod settings;
pub mod split;
pub mod subquery;
pub mod wire;

pub use error::ExecError;
pub use tessera_common::{ChannelId, NodeId, QueryId, StageId};

use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What distributed execution uses of its node, and nothing more: the store it scans,
/// the metadata it plans against, connections to other nodes, the registry of the
/// exchanges and channels running here, the failure detector it reports dead peers to, and
/// the lineage hooks.
pub struct Exec {
    pub(crate) store: Arc<tessera_storage::Store>,
    pub(crate) meta: tessera_meta::MetaClient,
    pub(crate) clients: Arc<tessera_net::Clients>,
    pub(crate) queries: Arc<exchange::QueryRegistry>,
    pub(crate) lineage: Arc<dyn hooks::Lineage>,
    pub(crate) settings: tessera_common::config::ExecSettings,
    replication: Arc<tessera_replication::Replication>,
    /// Peers this node could not reach though the leader counts them alive.
    pub(crate) unreachable: reachability::Unreachable,
    /// The node's cache of components read from elsewhere: archived components rebuilt
    /// from fragments, and on a compute node the components of other nodes' partitions.
    pub(crate) cache: Option<Arc<cache::ComponentCache>>,
    /// Scans of partitions this node does not hold read their components through the
    /// cache (a compute node); otherwise they fetch rows from a replica.
    pub(crate) reads_through_cache: bool,
    /// The node's memory pool for queries; `None` runs channels unbounded.
    pub(crate) memory: Option<memory::NodeMemory>,
}

impl std::fmt::Debug for Exec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exec").field("node", &self.id()).finish()
    }
}

impl Exec {
    pub fn new(
        store: Arc<tessera_storage::Store>,
        meta: tessera_meta::MetaClient,
        clients: Arc<tessera_net::Clients>,
        replication: Arc<tessera_replication::Replication>,
        lineage: Arc<dyn hooks::Lineage>,
        settings: tessera_common::config::ExecSettings,
    ) -> Exec {
        Exec {
            store,
            meta,
            clients,
            queries: Arc::new(exchange::QueryRegistry::new(&settings)),
            lineage,
            settings,
            replication,
            unreachable: reachability::Unreachable::default(),
            cache: None,
            reads_through_cache: false,
            memory: None,
        }
    }

    /// Bounds the memory this node's queries hold (see [`memory`]).
    pub fn with_memory(mut self, memory: memory::NodeMemory) -> Exec {
        self.memory = Some(memory);
        self
    }

    /// The context one of `query`'s `channels` here runs in, with its session's `config`
    /// ([`settings::ExecutionSettings`]), sharing `query_limit` bytes with the others if set.
    pub(crate) fn task_context(
        &self,
        query: QueryId,
        query_limit: Option<u64>,
        channels: usize,
        config: &datafusion::execution::config::SessionConfig,
    ) -> Arc<datafusion::execution::TaskContext> {
        match &self.memory {
            Some(memory) => memory.task_context(query, query_limit, channels, config),
            None => run::task_context_with(config.clone(), run::task_context().runtime_env()),
        }
    }

    /// Keeps components read from elsewhere in `cache`; with `reads_through_cache` (a
    /// compute node), also those of the partitions its scans read from other nodes.
    pub fn with_cache(
        mut self,
        cache: Arc<cache::ComponentCache>,
        reads_through_cache: bool,
    ) -> Exec {
        self.cache = Some(cache);
        self.reads_through_cache = reads_through_cache;
        self
    }

    /// The component cache.
    pub fn cache_status(&self) -> Option<cache::CacheStatus> {
        self.cache.as_ref().map(|c| c.status())
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.meta.id()
    }

    pub fn meta(&self) -> &tessera_meta::MetaClient {
        &self.meta
    }

    pub fn clients(&self) -> &Arc<tessera_net::Clients> {
        &self.clients
    }

    pub fn store(&self) -> &Arc<tessera_storage::Store> {
        &self.store
    }

    /// The exchanges and channels of the queries running here.
    pub fn queries(&self) -> &exchange::QueryRegistry {
        &self.queries
    }

    /// Reports a broken connection to `node`: the metadata leader checks it at once.
    pub fn suspect(&self, node: NodeId) {
        self.replication.suspect(node);
    }

    /// Makes `node` suspect and waits for the metadata leader's verdict.
    pub async fn confirm_failed(&self, node: NodeId) -> bool {
        self.replication.confirm_failed(node).await
    }

    /// Remembers that `peer` did not answer this node although the metadata leader counts
    /// it alive (a partial partition): plans made here avoid it for a while.
    pub fn note_unreachable(&self, peer: NodeId) {
        tracing::warn!(
            peer = peer.0,
            "peer unreachable from here but alive to the leader: plans avoid it"
        );
        self.unreachable.note(peer);
    }

    /// Starts the upstream backup of a producer channel; an error once its query ended here.
    pub fn back_up(
        &self,
        key: hooks::BackupKey,
        schema: arrow_flight::FlightData,
    ) -> Result<Arc<dyn hooks::Backup>, hooks::LineageError> {
        if self.queries.has_ended(key.0) {
            return Err(hooks::LineageError::QueryEnded { query: key.0 });
        }
        self.lineage.back_up(key, schema)
    }

    /// Ends `query` on this node: stops its channels, drops its inboxes, its lineage logs
    /// and its backups. Idempotent.
    pub fn end_query(&self, query: QueryId) {
        self.queries.end_query(query);
        self.lineage.end_query(query);
    }
}

/// How a query survived the death of a node it ran on (or a build side too large for its
/// memory): the typed record behind the client's notice and `EXPLAIN ANALYZE`'s
/// `Recovery:` line (whose text is its `Display`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RecoveryOutcome {
    /// Only the dead node's channels ran again, on the survivors, replaying their logged
    /// inputs from the producers' spools (write-ahead lineage).
    Rebuilt {
        dead: NodeId,
        query: QueryId,
        /// Channels placed on survivors.
        channels: usize,
        /// Logged input batches the rebuilt channels replayed in their logged order.
        replayed_batches: u64,
        /// Where each rebuilt stage's channels went, e.g. "stage 2 channel(s) [1] on node 3".
        placed: Vec<String>,
        /// From noticing the death to sending the rebuilt channels.
        replan_ms: u64,
    },
    /// The whole query ran again on the survivors with a fresh partition map.
    Restarted {
        dead: NodeId,
        query: QueryId,
        /// 1 for the first restart of this statement, and so on.
        restart: usize,
        /// Set when lineage recovery was asked for but could not go on: why.
        lineage_gave_up: Option<String>,
    },
    /// A node stopped answering the initiator while the metadata leader still counted it
    /// alive (a partial partition): the query ran again with no channel on that node,
    /// reading its partitions from other replicas.
    Rerouted {
        unreachable: NodeId,
        initiator: NodeId,
        query: QueryId,
        restart: usize,
    },
    /// A hash join's build side did not fit in the memory the query may hold on a node
    /// (a build side cannot spill): the whole query ran again with sort-merge joins, which
    /// spill their sorts to disk.
    SpillingJoins {
        query: QueryId,
        /// The refusal, as the first run failed with it.
        refused: String,
    },
}

/// How one statement's runs survived node failures. A handle: the statement's answer keeps
/// a copy while it streams, since lineage recovery during a streamed answer is known only
/// when the answer ends, after the statement has returned.
#[derive(Debug, Clone, Default)]
pub struct Recoveries(Arc<std::sync::Mutex<Vec<RecoveryOutcome>>>);

impl Recoveries {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RecoveryOutcome>> {
        self.0.lock().expect("recoveries lock")
    }

    pub fn push(&self, recovery: RecoveryOutcome) {
        self.lock().push(recovery);
    }

    pub fn extend(&self, recoveries: impl IntoIterator<Item = RecoveryOutcome>) {
        self.lock().extend(recoveries);
    }

    /// The recoveries so far, left in place.
    pub fn snapshot(&self) -> Vec<RecoveryOutcome> {
        self.lock().clone()
    }

    /// The recoveries so far, taken out.
    pub fn take(&self) -> Vec<RecoveryOutcome> {
        std::mem::take(&mut *self.lock())
    }
}

impl RecoveryOutcome {
    /// The node the query went on without: dead, or unreachable from the initiator
    /// (`None`: the query ran again for want of memory, on every node).
    pub fn dead(&self) -> Option<NodeId> {
        match self {
            RecoveryOutcome::Rebuilt { dead, .. } | RecoveryOutcome::Restarted { dead, .. } => {
                Some(*dead)
            }
            RecoveryOutcome::Rerouted { unreachable, .. } => Some(*unreachable),
            RecoveryOutcome::SpillingJoins { .. } => None,
        }
    }
}

impl std::fmt::Display for RecoveryOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecoveryOutcome::Rebuilt {
                dead,
                query,
                channels,
                replayed_batches,
                placed,
                replan_ms,
            } => write!(
                f,
                "node {dead} died during query {query:x}; its {channels} channel(s) were rebuilt on the surviving nodes from write-ahead lineage (tessera.recovery = lineage), replaying {replayed_batches} logged input batch(es) in their logged order; surviving channels kept their work ({}; confirmed and replanned in {replan_ms} ms)",
                placed.join(", ")
            ),
            RecoveryOutcome::Restarted {
                dead,
                query,
                restart,
                lineage_gave_up,
            } => {
                let how = match lineage_gave_up {
                    Some(detail) => format!(
                        "tessera.recovery = lineage, whose rebuilding could not go on: {}",
                        clipped(detail, 300)
                    ),
                    None => "tessera.recovery = restart".to_string(),
                };
                write!(
                    f,
                    "node {dead} died during query {query:x}; the query was restarted on the surviving nodes ({how}; restart {restart}), recomputing every stage"
                )
            }
            RecoveryOutcome::Rerouted {
                unreachable,
                initiator,
                query,
                restart,
            } => write!(
                f,
                "node {unreachable} stopped answering node {initiator} during query {query:x} but the metadata leader still counts it alive (a partial partition); the query was restarted with no channel on node {unreachable}, reading its partitions from other replicas (restart {restart})"
            ),
            RecoveryOutcome::SpillingJoins { query, refused } => write!(
                f,
                "query {query:x} ran again with sort-merge joins, which spill to disk, after a hash join's build side did not fit in its memory ({})",
                clipped(refused, 300)
            ),
        }
    }
}

/// `text` cut to at most `limit` characters, marked when cut.
fn clipped(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// What a channel did, as its node reports it to the initiator.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ChannelReport {
    pub stage: StageId,
    pub channel: ChannelId,
    pub node: NodeId,
    /// Rows and batches the channel produced.
    pub rows: u64,
    pub batches: u64,
    /// Encoded bytes sent to other nodes (batches to this node itself cost nothing).
    pub bytes_sent: u64,
    /// Microseconds since the query started, by the node's clock.
    pub started_us: u64,
    /// When the first batch of any exchange input arrived (none for pure scans).
    pub first_input_us: Option<u64>,
    /// When the channel's output was acknowledged by every receiver.
    pub finished_us: u64,
    pub error: Option<String>,
    /// The SQLSTATE of `error`, as the node that ran the channel classified it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqlstate: Option<String>,
    /// Bytes the channel's sorts and aggregations spilled to disk to stay within the
    /// memory limits.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spilled_bytes: u64,
    /// How the channel's table scans read their storage partitions.
    #[serde(default, skip_serializing_if = "ScanReads::is_empty")]
    pub scanned: ScanReads,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How a channel's table scans read their storage partitions, each counted once, by the
/// reader that took it ([`tessera_sql::provider::ReadLayout`] on this node, or another
/// replica's answer): what `EXPLAIN ANALYZE` shows beside the channel's rows.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ScanReads {
    /// Partitions read here through DataFusion's Parquet reader.
    pub parquet: u64,
    /// Partitions read here from the decoded cache.
    pub decoded: u64,
    /// Partitions read here with their versions resolved as they were read.
    pub versioned: u64,
    /// The component files of the partitions read here.
    pub files: u64,
    /// Partitions whose rows a replica answered with: another node's answer (also for a
    /// diff, which a replica's store computes, this node's own included).
    pub remote: u64,
}

impl ScanReads {
    pub fn is_empty(&self) -> bool {
        *self == ScanReads::default()
    }

    pub fn add(&mut self, other: ScanReads) {
        self.parquet += other.parquet;
        self.decoded += other.decoded;
        self.versioned += other.versioned;
        self.files += other.files;
        self.remote += other.remote;
    }
}

/// Visits `exprs` in order for `ExecutionPlan::apply_expressions`, stopping where `f` says.
pub(crate) fn apply_to_each(
    exprs: &[Arc<dyn datafusion::physical_expr::PhysicalExpr>],
    f: &mut dyn FnMut(
        &Arc<dyn datafusion::physical_expr::PhysicalExpr>,
    ) -> datafusion::common::Result<
        datafusion::common::tree_node::TreeNodeRecursion,
    >,
) -> datafusion::common::Result<datafusion::common::tree_node::TreeNodeRecursion> {
    use datafusion::common::tree_node::TreeNodeRecursion;
    for expr in exprs {
        if f(expr)? == TreeNodeRecursion::Stop {
            return Ok(TreeNodeRecursion::Stop);
        }
    }
    Ok(TreeNodeRecursion::Continue)
}

/// The one input of an operator `name` that takes exactly one, from `with_new_children`.
pub(crate) fn only_input(
    mut children: Vec<Arc<dyn datafusion::physical_plan::ExecutionPlan>>,
    name: &str,
) -> datafusion::common::Result<Arc<dyn datafusion::physical_plan::ExecutionPlan>> {
    match (children.pop(), children.is_empty()) {
        (Some(input), true) => Ok(input),
        _ => Err(datafusion::common::DataFusionError::Internal(format!(
            "{name} takes one input"
        ))),
    }
}

/// The cores one node can use for channels: this machine's, shared among the live nodes
/// whose address names the same host as `node`'s (a local cluster on one machine, or
/// several nodes per server). At least one.
pub fn cores_per_node(state: &tessera_meta::MetaState, node: NodeId) -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let host = |addr: &str| {
        addr.rsplit_once(':')
            .map_or(addr, |(host, _)| host)
            .to_string()
    };
    let Some(mine) = state.nodes.get(&node).map(|n| host(&n.addr)) else {
        return cores;
    };
    let sharing = state
        .live_nodes()
        .filter(|n| host(&n.addr) == mine)
        .count()
        .max(1);
    (cores / sharing).max(1)
}

/// Microseconds since the Unix epoch by this machine's clock.
pub(crate) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
