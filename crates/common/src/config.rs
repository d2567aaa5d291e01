//! A node's configuration (`node.toml`), typed: the node's identity and its cluster at the
//! top, then one section per layer. Every default is written once, in its section's
//! `Default`; every knob can be overridden when the node starts (`tessera node --set
//! failure.timeout_ms=3000`, the same dotted path as in the file).
//!
//! ```toml
//! cluster_id = "lab-cluster"
//! node_id = 1
//! listen = "127.0.0.1:7001"
//! data_dir = "tessera-data/node-1"
//! partitions = 64          # fixed when the cluster is created
//! replication = 3
//! voters = [1, 2, 3]       # default: the three lowest ids
//! # role = "compute"       # no partitions, never a voter: adds CPU to queries
//! # insecure = true        # plaintext internal port, development only; else [mtls]
//!
//! [[peers]]
//! id = 1
//! addr = "127.0.0.1:7001"
//! [[peers]]
//! id = 2
//! addr = "127.0.0.1:7002"
//!
//! [store]                  # the storage engine (defaults: the store's own)
//! memtable_flush_bytes = 67108864
//! checkpoint_log_bytes = 268435456
//! idle_checkpoint_ms = 10000  # rows idle in memory this long are checkpointed (0: never)
//! bulk_publish_bytes = 8388608
//! merge_threshold = 8
//! tiered_merges = true     # merge before the threshold once the smaller components reach half the largest
//! max_publish_bytes = 8589934592
//!
//! [replicas]               # how replicas follow their primaries
//! hot_standby = false
//! delta_recovery = true
//! version_ids = true       # seal publishes with version ids (false: benchmark baselines)
//! min_copies = 2           # current replicas a publish needs per partition (1: risk losing it)
//!
//! [failure]                # failure detection and re-replication
//! heartbeat_ms = 200
//! timeout_ms = 1500
//! rereplicate_after_ms = 300000
//! open_epoch_timeout_ms = 300000
//! disk_stall_ms = 20000    # an fsync this slow stops the node (a stalled disk)
//! progress_timeout_ms = 15000 # a replica stuck this long on a publish's rows or a copy is given up
//!
//! [mtls]                   # mutual TLS on the internal port (`tessera certs` makes these)
//! ca = "certs/ca.pem"
//! cert = "certs/node-1.pem"
//! key = "certs/node-1.key"
//!
//! [exec]                   # distributed query execution
//! inbox_budget_bytes = 16777216
//! send_batch_rows = 8192
//! spool_start_timeout_ms = 30000
//! cache_bytes = 1073741824 # a compute node's component cache
//!
//! [scrub]                  # hash components again and repair damaged ones
//! bytes_per_sec = 16777216 # 0: only `tessera scrub`
//! every_ms = 21600000      # a pass this long after the last one ended
//!
//! [archive]                # tagged epochs past retention, erasure-coded
//! data_fragments = 4       # k: any k fragments rebuild a component
//! parity_fragments = 2     # m: fragments a component may lose
//! collect_after_ms = 600000 # a fragment no archived epoch names is deleted this old
//! ```

use crate::{NodeId, DEFAULT_PARTITIONS};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

/// A configuration that cannot be used, naming the file (or flag) and the problem.
#[derive(Debug, Error)]
#[error("invalid node configuration {path}: {reason}")]
pub struct ConfigError {
    pub path: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    pub cluster_id: String,
    pub node_id: NodeId,
    /// Where this node serves RPC (Arrow Flight over gRPC).
    pub listen: SocketAddr,
    /// Where this node serves PostgreSQL clients (`psql`, drivers); none if unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pg_listen: Option<SocketAddr>,
    /// Where this node serves Arrow Flight SQL clients (ADBC, the Flight SQL JDBC driver);
    /// none if unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flightsql_listen: Option<SocketAddr>,
    /// Where this node serves HTTP: Prometheus metrics at `/metrics` and the web console;
    /// none if unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_listen: Option<SocketAddr>,
    /// PostgreSQL connections served at once; one more is refused (SQLSTATE 53300).
    #[serde(default = "default_pg_max_connections")]
    pub pg_max_connections: usize,
    /// The certificate chain (PEM) the client ports present: TLS on the PostgreSQL port
    /// for clients that ask for it, and on the Flight SQL port for all. With `tls_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `tls_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Plaintext on the internal port, for development only: any process that reaches the
    /// port can then join the cluster, write its metadata and read its data. Without it,
    /// `[mtls]` is required.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
    /// Flight SQL connections served at once (each carries any number of calls); one more
    /// is closed at once.
    #[serde(default = "default_flightsql_max_connections")]
    pub flightsql_max_connections: usize,
    pub data_dir: PathBuf,
    /// Every node the cluster starts with, this one included. A node joining a running
    /// cluster lists itself and at least one member.
    pub peers: Vec<Peer>,
    /// Nodes that vote in the metadata group; default: the three lowest peer ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub voters: Option<Vec<NodeId>>,
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    #[serde(default = "default_replication")]
    pub replication: u32,
    /// What this node is for: holding partitions (`storage`, the default) or only running
    /// queries (`compute`: a metadata learner given no partitions, whose channels read
    /// from the storage nodes).
    #[serde(default, skip_serializing_if = "NodeRole::is_storage")]
    pub role: NodeRole,
    #[serde(default)]
    pub store: StoreSettings,
    #[serde(default)]
    pub replicas: ReplicaSettings,
    #[serde(default)]
    pub failure: FailureSettings,
    #[serde(default)]
    pub exec: ExecSettings,
    #[serde(default)]
    pub scrub: ScrubSettings,
    #[serde(default)]
    pub archive: ArchiveSettings,
    /// Mutual TLS on the internal port (node to node, and the CLI): required unless
    /// `insecure = true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtls: Option<MtlsSettings>,
    /// `tessera node --replace`: this node's data is gone (a wiped or replaced disk) and it
    /// comes back empty; not a file setting.
    #[serde(skip)]
    pub replace: bool,
}

/// What a node is for (`role` in `node.toml`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// Holds partitions (replicas placed by the ring) and runs query channels.
    #[default]
    Storage,
    /// Holds no partitions and never votes in the metadata: it adds CPU to queries, its
    /// channels reading the storage nodes' partitions over the network.
    Compute,
}

impl NodeRole {
    pub fn is_storage(&self) -> bool {
        *self == NodeRole::Storage
    }

    pub fn is_compute(&self) -> bool {
        *self == NodeRole::Compute
    }
}

/// `[mtls]`: the cluster's CA and this node's certificate and key (PEM), as `tessera certs`
/// writes them. A peer must present a certificate of the same CA, and a node's certificate
/// must name the node id it claims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MtlsSettings {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    pub id: NodeId,
    pub addr: SocketAddr,
}

/// `[store]`: the storage engine's tuning; unset means the store's own default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSettings {
    /// Memtable bytes (all partitions) that start a checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memtable_flush_bytes: Option<usize>,
    /// A checkpoint also runs once this many bytes were logged since the last one. It
    /// bounds the log a cold standby replays when promoted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_log_bytes: Option<usize>,
    /// Rows that waited in memory this long with no more arriving are checkpointed too
    /// (0: never for that reason).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_checkpoint_ms: Option<u64>,
    /// Publishes at least this large bypass the log and write components directly.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bulk_publish_bytes: Option<usize>,
    /// A partition with more components than this is merged at the next checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merge_threshold: Option<usize>,
    /// Also merge a partition's components before they number more than the threshold,
    /// once all but the largest add up to half of it (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiered_merges: Option<bool>,
    /// The largest publish accepted, in bytes of its rows' Arrow data: by a single store,
    /// and by a cluster node coordinating a publish (which holds a few times that).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_publish_bytes: Option<usize>,
}

/// `[replicas]`: how replicas follow their primaries. Cluster-wide: the metadata leader's
/// (for `hot_standby`, the founding leader's) value applies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicaSettings {
    /// Replicas apply committed rows as they arrive (hot standby: a promotion replays
    /// nothing) instead of keeping them in the log until promoted (cold standby, the
    /// default: replicas do no flushing or merging; their primaries ship components).
    pub hot_standby: bool,
    /// A returning replica fetches only the versions it missed (true), or copies its stale
    /// partitions whole (false: for comparison).
    pub delta_recovery: bool,
    /// Publishes coordinated here record their tables' version ids, signed where the
    /// publisher's participant has a key (true). False is for benchmark baselines only:
    /// the tables' chains stop, `tessera verify` has nothing to check their epochs
    /// against, and a participant that signs refuses such publishes.
    pub version_ids: bool,
    /// A publish is acknowledged only once this many replicas of every partition it
    /// touches hold every committed epoch (at most the partition's replica count): with 2
    /// (the default) losing any one disk loses no acknowledged publish, and a partition
    /// with fewer current replicas alive takes no writes until another returns or catches
    /// up. 1 acknowledges with a single current copy: more writes while replicas are down,
    /// at the risk of losing them with that one disk. Give every node the same value.
    pub min_copies: u32,
}

impl Default for ReplicaSettings {
    fn default() -> Self {
        ReplicaSettings {
            hot_standby: false,
            delta_recovery: true,
            version_ids: true,
            min_copies: 2,
        }
    }
}

/// `[failure]`: failure detection and re-replication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailureSettings {
    /// Heartbeat period to the metadata leader.
    pub heartbeat_ms: u64,
    /// A node silent this long is declared failed.
    pub timeout_ms: u64,
    /// A node failed for this long loses its replicas: the metadata leader builds new ones
    /// on the other nodes so every partition has `replication` copies again. When the node
    /// returns it is given its share back.
    pub rereplicate_after_ms: u64,
    /// The metadata leader aborts an epoch open this long, its coordinator alive or not,
    /// so a coordinator that cannot commit (or is stalled) never holds its tables' lease
    /// for ever. A publish that takes longer fails as aborted, and may be retried.
    pub open_epoch_timeout_ms: u64,
    /// A node whose fsync has not returned after this long stops itself (exit status 74,
    /// as for a failed fsync): a stalled disk would otherwise hold every publish it is a
    /// replica of while the node still answers heartbeats. The cluster fails it over.
    pub disk_stall_ms: u64,
    /// A node that makes no progress for this long on a publish's rows or on a partition
    /// copy, while the cluster counts it alive (its disk or its handling hangs), is given
    /// up on: a primary forwarding rows reports it unreachable (it misses the epoch, is
    /// marked stale and catches up later); a coordinator waiting on a primary waits twice
    /// this long, then retries the publish; a copy into it under a rebalance's lease stops,
    /// so the lease is released, and is tried again later. Without it, one such node holds
    /// an epoch, and its tables' lease, open until it stops itself or is declared failed.
    /// A node the publish cannot go without (leaving it out would leave fewer current
    /// replicas than `replicas.min_copies`) is waited for up to `open_epoch_timeout_ms`
    /// instead: giving it up would only refuse the publish.
    pub progress_timeout_ms: u64,
}

impl Default for FailureSettings {
    fn default() -> Self {
        FailureSettings {
            heartbeat_ms: 200,
            timeout_ms: 1500,
            rereplicate_after_ms: 5 * 60 * 1000,
            open_epoch_timeout_ms: 5 * 60 * 1000,
            disk_stall_ms: 20_000,
            progress_timeout_ms: 15_000,
        }
    }
}

/// `[exec]`: distributed query execution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecSettings {
    /// Bytes one exchange bucket may hold unread before its producers wait (flow control).
    pub inbox_budget_bytes: usize,
    /// Rows a producer gathers per destination bucket before sending a batch (a query whose
    /// session sets its own `datafusion.execution.batch_size` uses that instead).
    pub send_batch_rows: usize,
    /// How long a rebuilt consumer's request for a producer's spool waits for that producer
    /// to start, before it fails naming the channel (a request for a query that never ran
    /// here must not wait for ever).
    pub spool_start_timeout_ms: u64,
    /// A compute node's cache of the components its scans fetch (under
    /// `data_dir/cache`), in bytes; the least recently used go first.
    pub cache_bytes: u64,
    /// The most memory all of this node's queries hold at once (sorts, aggregations,
    /// join build sides), in bytes; sorts and aggregations past it spill to
    /// `data_dir/spill`. 0: half of this machine's memory.
    pub memory_limit_bytes: u64,
    /// Memory for components kept decoded, so a scan does not pay a Parquet file's fixed
    /// cost per storage partition nor decode the same columns again (0: keep none).
    /// Unset: a quarter of this machine's memory ([`ExecSettings::decoded_cache_budget`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decoded_cache_bytes: Option<u64>,
    /// The largest component file (bytes) kept decoded.
    pub decoded_component_max_bytes: u64,
    /// The most memory (bytes) the columns one scan reads may take decoded for the scan to
    /// be kept decoded whatever its files' sizes. Unset: the cache's whole budget. A scan
    /// that misses costs about what reading its Parquet costs (its batches are kept as
    /// read), so even a scan that evicts every other column loses little; at TPC-H SF 10
    /// a third of the budget kept lineitem's price scans out and made them 1.2-3x slower.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decoded_scan_max_bytes: Option<u64>,
}

/// The decoded cache's budget where `[exec] decoded_cache_bytes` is unset: a quarter of the
/// machine's memory (the query pool takes half by default, and the rest is left to the
/// operating system's page cache, the memtables and the process), 1 GiB where the
/// machine's memory cannot be read.
fn default_decoded_cache_bytes() -> u64 {
    crate::memory::machine_memory_bytes().map_or(1 << 30, |bytes| bytes / 4)
}

impl ExecSettings {
    /// The most memory the decoded cache holds, in bytes.
    pub fn decoded_cache_budget(&self) -> u64 {
        self.decoded_cache_bytes
            .unwrap_or_else(default_decoded_cache_bytes)
    }

    /// The most memory one scan's columns may take decoded to be kept, in bytes.
    pub fn decoded_scan_max(&self) -> u64 {
        self.decoded_scan_max_bytes
            .unwrap_or_else(|| self.decoded_cache_budget())
    }

    /// The settings of one of `nodes` nodes that share this machine (a local cluster):
    /// each node's decoded cache takes its share of what one node would take alone.
    pub fn sharing_machine(nodes: usize) -> ExecSettings {
        ExecSettings {
            decoded_cache_bytes: Some(default_decoded_cache_bytes() / nodes.max(1) as u64),
            ..ExecSettings::default()
        }
    }
}

impl Default for ExecSettings {
    fn default() -> Self {
        ExecSettings {
            inbox_budget_bytes: 16 << 20,
            send_batch_rows: 8192,
            spool_start_timeout_ms: 30_000,
            cache_bytes: 1 << 30,
            memory_limit_bytes: 0,
            decoded_cache_bytes: None,
            decoded_component_max_bytes: 1 << 20,
            decoded_scan_max_bytes: None,
        }
    }
}

/// `[archive]`: how the metadata leader cuts archived components (Reed-Solomon: `k` data
/// and `m` parity fragments on `k + m` distinct storage nodes; stored bytes are
/// `(k + m) / k` of the component's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArchiveSettings {
    pub data_fragments: u32,
    pub parity_fragments: u32,
    /// The scrubber deletes a fragment that no archived epoch places on this node once
    /// its file is this old (younger ones may belong to an archive being made).
    pub collect_after_ms: u64,
}

impl Default for ArchiveSettings {
    fn default() -> Self {
        ArchiveSettings {
            data_fragments: 4,
            parity_fragments: 2,
            collect_after_ms: 600_000,
        }
    }
}

/// `[scrub]`: the background scrubber, which hashes this node's components again and
/// repairs the damaged ones from other replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScrubSettings {
    /// Bytes read per second at most (0: no background scrubbing; `tessera scrub` still
    /// runs on demand).
    pub bytes_per_sec: u64,
    /// A pass starts this long after the previous one ended.
    pub every_ms: u64,
}

impl Default for ScrubSettings {
    fn default() -> Self {
        ScrubSettings {
            bytes_per_sec: 16 << 20,
            every_ms: 6 * 3600 * 1000,
        }
    }
}

pub const DEFAULT_REPLICATION: u32 = 3;

fn default_pg_max_connections() -> usize {
    256
}

fn default_flightsql_max_connections() -> usize {
    256
}

fn default_partitions() -> u32 {
    DEFAULT_PARTITIONS
}

fn default_replication() -> u32 {
    DEFAULT_REPLICATION
}

/// Keys of the flat configuration that moved into a section: their new dotted path.
const MOVED: &[(&str, &str)] = &[
    ("memtable_flush_bytes", "store.memtable_flush_bytes"),
    ("checkpoint_log_bytes", "store.checkpoint_log_bytes"),
    ("hot_standby", "replicas.hot_standby"),
    ("delta_recovery", "replicas.delta_recovery"),
    ("heartbeat_ms", "failure.heartbeat_ms"),
    ("failure_timeout_ms", "failure.timeout_ms"),
    ("rereplicate_after_ms", "failure.rereplicate_after_ms"),
];

impl NodeConfig {
    pub fn load(path: &Path) -> Result<NodeConfig, ConfigError> {
        Self::load_with(path, &[])
    }

    /// Reads `path`, then applies `overrides` (each `section.key=value`, the value in TOML
    /// syntax or a bare string), then checks the result.
    pub fn load_with(path: &Path, overrides: &[String]) -> Result<NodeConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::parse_with(&text, path, overrides)
    }

    pub fn parse(text: &str, path: &Path) -> Result<NodeConfig, ConfigError> {
        Self::parse_with(text, path, &[])
    }

    pub fn parse_with(
        text: &str,
        path: &Path,
        overrides: &[String],
    ) -> Result<NodeConfig, ConfigError> {
        let error = |reason: String| ConfigError {
            path: path.display().to_string(),
            reason,
        };
        let mut table: toml::Table = toml::from_str(text).map_err(|e| error(e.to_string()))?;
        for assignment in overrides {
            apply_override(&mut table, assignment)
                .map_err(|reason| error(format!("override {assignment:?}: {reason}")))?;
        }
        for (old, new) in MOVED {
            if table.contains_key(*old) {
                return Err(error(format!(
                    "`{old}` moved into a section: write it as `{new}` (in [{}])",
                    new.split('.').next().unwrap_or_default()
                )));
            }
        }
        let config: NodeConfig = table.try_into().map_err(|e| error(e.to_string()))?;
        config.validate().map_err(error)?;
        Ok(config)
    }

    /// The voters: configured, or the three lowest peer ids. A compute node is never one
    /// (validation refuses it among configured voters; it leaves itself out of the default).
    pub fn voter_ids(&self) -> BTreeSet<NodeId> {
        match &self.voters {
            Some(voters) => voters.iter().copied().collect(),
            None => self
                .peers
                .iter()
                .map(|p| p.id)
                .filter(|id| !(self.role.is_compute() && *id == self.node_id))
                .take(3)
                .collect(),
        }
    }

    pub fn peer(&self, id: NodeId) -> Option<&Peer> {
        self.peers.iter().find(|p| p.id == id)
    }

    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.failure.heartbeat_ms)
    }

    pub fn failure_timeout(&self) -> Duration {
        Duration::from_millis(self.failure.timeout_ms)
    }

    pub fn rereplicate_after(&self) -> Duration {
        Duration::from_millis(self.failure.rereplicate_after_ms)
    }

    pub fn open_epoch_timeout(&self) -> Duration {
        Duration::from_millis(self.failure.open_epoch_timeout_ms)
    }

    pub fn disk_stall(&self) -> Duration {
        Duration::from_millis(self.failure.disk_stall_ms)
    }

    pub fn progress_timeout(&self) -> Duration {
        Duration::from_millis(self.failure.progress_timeout_ms)
    }

    fn validate(&self) -> Result<(), String> {
        if self.cluster_id.trim().is_empty() {
            return Err("cluster_id is empty".into());
        }
        if self.node_id.0 == 0 {
            return Err("node_id must be at least 1".into());
        }
        let mut ids = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        for peer in &self.peers {
            if peer.id.0 == 0 {
                return Err("peer ids must be at least 1".into());
            }
            if !ids.insert(peer.id) {
                return Err(format!("peer id {} is listed twice", peer.id));
            }
            if !addrs.insert(peer.addr) {
                return Err(format!("address {} is given to two peers", peer.addr));
            }
        }
        let Some(me) = self.peer(self.node_id) else {
            return Err(format!(
                "node_id {} is not among the peers (ids {:?}); list this node in [[peers]]",
                self.node_id, ids
            ));
        };
        if me.addr.port() != self.listen.port() {
            return Err(format!(
                "this node listens on {} but its [[peers]] entry says {}",
                self.listen, me.addr
            ));
        }
        if let Some(voters) = &self.voters {
            if voters.is_empty() {
                return Err("voters is empty; at least one node must vote".into());
            }
            for voter in voters {
                if !ids.contains(voter) {
                    return Err(format!(
                        "voter {voter} is not a known peer (peers are {ids:?})"
                    ));
                }
                if *voter == self.node_id && self.role.is_compute() {
                    return Err(format!(
                        "node {voter} is a compute node (role = \"compute\") and cannot be a voter: list only storage nodes in voters"
                    ));
                }
            }
        }
        if !(1..=1 << 16).contains(&self.partitions) {
            return Err(format!(
                "partitions = {} is out of range 1..=65536",
                self.partitions
            ));
        }
        if self.replication == 0 {
            return Err("replication must be at least 1".into());
        }
        if self.pg_max_connections == 0 {
            return Err("pg_max_connections must be at least 1".into());
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err("tls_cert and tls_key go together: set both or neither".into());
        }
        match (self.insecure, &self.mtls) {
            (false, None) => {
                return Err("the internal port needs mutual TLS: set [mtls] ca, cert and key (`tessera certs` makes them), or insecure = true for development (any process that reaches the port can then join)".into())
            }
            (true, Some(_)) => {
                return Err("insecure = true and [mtls] contradict each other: choose one".into())
            }
            _ => {}
        }
        if self.flightsql_max_connections == 0 {
            return Err("flightsql_max_connections must be at least 1".into());
        }
        let failure = &self.failure;
        if failure.heartbeat_ms == 0 || failure.timeout_ms <= failure.heartbeat_ms {
            return Err(format!(
                "failure.timeout_ms ({}) must exceed failure.heartbeat_ms ({}), which must be positive",
                failure.timeout_ms, failure.heartbeat_ms
            ));
        }
        if failure.open_epoch_timeout_ms <= failure.heartbeat_ms {
            return Err(format!(
                "failure.open_epoch_timeout_ms ({}) must exceed failure.heartbeat_ms ({})",
                failure.open_epoch_timeout_ms, failure.heartbeat_ms
            ));
        }
        if failure.disk_stall_ms == 0 {
            return Err("failure.disk_stall_ms must be positive".into());
        }
        if failure.progress_timeout_ms <= failure.heartbeat_ms {
            return Err(format!(
                "failure.progress_timeout_ms ({}) must exceed failure.heartbeat_ms ({})",
                failure.progress_timeout_ms, failure.heartbeat_ms
            ));
        }
        if failure.rereplicate_after_ms <= failure.timeout_ms {
            return Err(format!(
                "failure.rereplicate_after_ms ({}) must exceed failure.timeout_ms ({})",
                failure.rereplicate_after_ms, failure.timeout_ms
            ));
        }
        if self.archive.data_fragments == 0 || self.archive.parity_fragments == 0 {
            return Err(format!(
                "archive.data_fragments ({}) and archive.parity_fragments ({}) must both be at least 1",
                self.archive.data_fragments, self.archive.parity_fragments
            ));
        }
        if self.exec.inbox_budget_bytes < 1 << 10 || self.exec.send_batch_rows == 0 {
            return Err(format!(
                "exec.inbox_budget_bytes ({}) must be at least 1024 and exec.send_batch_rows ({}) positive",
                self.exec.inbox_budget_bytes, self.exec.send_batch_rows
            ));
        }
        Ok(())
    }
}

/// Sets `section.key=value` in `table`, creating the section if the file has none.
fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<(), String> {
    let (path, value) = assignment
        .split_once('=')
        .ok_or("expected section.key=value")?;
    let keys: Vec<&str> = path.trim().split('.').collect();
    if keys.iter().any(|k| k.is_empty()) {
        return Err(format!("{path:?} is not a dotted key"));
    }
    let value = value.trim();
    // A TOML value (number, bool, quoted string, array); anything else is a bare string.
    let value = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut parsed| parsed.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let (last, sections) = keys.split_last().expect("at least one key");
    let mut at = table;
    for section in sections {
        at = at
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| format!("`{section}` is not a section"))?;
    }
    at.insert(last.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        cluster_id = "c"
        node_id = 1
        listen = "127.0.0.1:7001"
        data_dir = "d"
        insecure = true
        [[peers]]
        id = 1
        addr = "127.0.0.1:7001"
        [[peers]]
        id = 2
        addr = "127.0.0.1:7002"
    "#;

    fn error(text: &str) -> String {
        NodeConfig::parse(text, Path::new("node.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_good_config_gets_defaults() {
        let config = NodeConfig::parse(GOOD, Path::new("node.toml")).unwrap();
        assert_eq!(config.partitions, 64);
        assert_eq!(config.replication, 3);
        assert_eq!(config.voter_ids(), BTreeSet::from([NodeId(1), NodeId(2)]));
        assert_eq!(config.failure, FailureSettings::default());
        assert_eq!(config.exec.send_batch_rows, 8192);
        assert!(config.replicas.delta_recovery && !config.replicas.hot_standby);
    }

    #[test]
    fn a_compute_node_never_votes() {
        // Node 2 of GOOD, as a compute node: the default voters leave it out.
        let compute = format!(
            "role = \"compute\"\n{}",
            GOOD.replace("node_id = 1", "node_id = 2")
        )
        .replace("listen = \"127.0.0.1:7001\"", "listen = \"127.0.0.1:7002\"");
        let config = NodeConfig::parse(&compute, Path::new("node.toml")).unwrap();
        assert!(config.role.is_compute());
        assert_eq!(config.voter_ids(), BTreeSet::from([NodeId(1)]));
        let named = error(&format!("voters = [1, 2]\n{compute}"));
        assert!(
            named.contains("node 2 is a compute node") && named.contains("cannot be a voter"),
            "{named}"
        );
        assert!(error(&format!("role = \"archive\"\n{GOOD}")).contains("unknown variant `archive`"));
        let storage = NodeConfig::parse(GOOD, Path::new("node.toml")).unwrap();
        assert!(storage.role.is_storage());
        assert!(
            !toml::to_string(&storage).unwrap().contains("role"),
            "the default is not written"
        );
    }

    #[test]
    fn sections_and_flags_set_every_knob() {
        let text = format!(
            "{GOOD}\n[failure]\ntimeout_ms = 4000\n[store]\ncheckpoint_log_bytes = 65536\n"
        );
        let overrides = [
            "failure.heartbeat_ms=300".to_string(),
            "replicas.hot_standby = true".to_string(),
            "exec.send_batch_rows=1024".to_string(),
        ];
        let config = NodeConfig::parse_with(&text, Path::new("node.toml"), &overrides).unwrap();
        assert_eq!(config.failure.timeout_ms, 4000, "from the file");
        assert_eq!(config.failure.heartbeat_ms, 300, "from a flag");
        assert_eq!(config.failure.rereplicate_after_ms, 300_000, "the default");
        assert_eq!(config.store.checkpoint_log_bytes, Some(65536));
        assert!(config.replicas.hot_standby);
        assert_eq!(config.exec.send_batch_rows, 1024);
        let round_trip = toml::to_string(&config).unwrap();
        assert_eq!(
            NodeConfig::parse(&round_trip, Path::new("x")).unwrap(),
            config
        );
    }

    #[test]
    fn the_decoded_cache_is_sized_by_the_machine_unless_set() {
        let machine = crate::memory::machine_memory_bytes().expect("/proc/meminfo here");
        let defaults = NodeConfig::parse(GOOD, Path::new("n")).unwrap().exec;
        assert_eq!(defaults.decoded_cache_budget(), machine / 4);
        assert_eq!(defaults.decoded_scan_max(), machine / 4);
        let shared = ExecSettings::sharing_machine(3);
        assert_eq!(shared.decoded_cache_budget(), machine / 4 / 3);
        assert_eq!(shared.decoded_scan_max(), machine / 4 / 3);
        // Written out and read back (a local cluster's node.toml), the share stays.
        let written = toml::to_string(&shared).unwrap();
        assert_eq!(toml::from_str::<ExecSettings>(&written).unwrap(), shared);
        assert!(!toml::to_string(&defaults)
            .unwrap()
            .contains("decoded_cache_bytes"));
        let none =
            NodeConfig::parse_with(GOOD, Path::new("n"), &["exec.decoded_cache_bytes=0".into()])
                .unwrap()
                .exec;
        assert_eq!(
            (none.decoded_cache_budget(), none.decoded_scan_max()),
            (0, 0)
        );
        let set = NodeConfig::parse(
            &format!("{GOOD}\n[exec]\ndecoded_cache_bytes = 3000\ndecoded_scan_max_bytes = 2000\n"),
            Path::new("n"),
        )
        .unwrap()
        .exec;
        assert_eq!(
            (set.decoded_cache_budget(), set.decoded_scan_max()),
            (3000, 2000)
        );
    }

    #[test]
    fn bad_configs_name_the_problem() {
        assert!(error(&GOOD.replace("node_id = 1", "node_id = 9"))
            .contains("node_id 9 is not among the peers"));
        assert!(error(&format!("voters = [1, 7]\n{GOOD}")).contains("voter 7 is not a known peer"));
        assert!(error(&GOOD.replace("id = 2", "id = 1")).contains("peer id 1 is listed twice"));
        assert!(error(&format!("bogus = 1\n{GOOD}")).contains("unknown field `bogus`"));
        assert!(
            error(&GOOD.replace("listen = \"127.0.0.1:7001\"", "listen = \"127.0.0.1:9999\""))
                .contains("its [[peers]] entry says")
        );
        assert!(
            error(&GOOD.replace("127.0.0.1:7002", "nonsense")).contains("invalid socket address")
        );
        let moved = error(&format!("failure_timeout_ms = 900\n{GOOD}"));
        assert!(
            moved.contains("write it as `failure.timeout_ms`"),
            "{moved}"
        );
        let typo = error(&format!("{GOOD}\n[failure]\ntimeout = 900\n"));
        assert!(typo.contains("unknown field `timeout`"), "{typo}");
        let bad_flag = NodeConfig::parse_with(GOOD, Path::new("n"), &["failure.timeout_ms".into()])
            .unwrap_err()
            .to_string();
        assert!(
            bad_flag.contains("expected section.key=value"),
            "{bad_flag}"
        );
        let wrong_type =
            NodeConfig::parse_with(GOOD, Path::new("n"), &["failure.timeout_ms=soon".into()])
                .unwrap_err()
                .to_string();
        assert!(wrong_type.contains("timeout_ms"), "{wrong_type}");
        let plaintext = error(&GOOD.replace("insecure = true", ""));
        assert!(
            plaintext.contains("the internal port needs mutual TLS: set [mtls]"),
            "{plaintext}"
        );
        let both = error(&format!(
            "{GOOD}\n[mtls]\nca = \"ca.pem\"\ncert = \"n.pem\"\nkey = \"n.key\"\n"
        ));
        assert!(both.contains("contradict"), "{both}");
        let mtls = GOOD.replace("insecure = true", "")
            + "\n[mtls]\nca = \"ca.pem\"\ncert = \"n.pem\"\nkey = \"n.key\"\n";
        let config = NodeConfig::parse(&mtls, Path::new("n")).unwrap();
        assert_eq!(config.mtls.unwrap().cert, PathBuf::from("n.pem"));
    }
}
