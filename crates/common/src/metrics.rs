//! The node's metrics, in one Prometheus registry, served at `/metrics` on the node's HTTP
//! port.
//!
//! A node is a process, so the registry is the process's: every layer records into
//! [`metrics()`] without threading a handle through its calls. Counters and histograms
//! move as work happens; gauges that describe state (Raft's term, the leader, replica
//! staleness) are set by the node just before each scrape.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

/// Label pairs, e.g. `[("outcome", "aborted")]`.
pub type Labels = Vec<(&'static str, String)>;

fn seconds_buckets() -> Histogram {
    // 100 µs to ~100 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

fn size_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 16))
}

/// Every metric a node exports. Names follow Prometheus's conventions (`_total` counters,
/// base units: seconds, bytes).
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Publishes this node coordinated, by outcome (`acknowledged`, `aborted`, `failed`).
    pub publishes: Family<Labels, Counter>,
    pub publish_rows: Counter,
    pub publish_bytes: Counter,
    /// From the request to the acknowledgement (visible), acknowledged publishes only.
    pub publish_seconds: Histogram,
    pub wal_fsync_seconds: Histogram,
    /// How long a prepare, commit or publish waited for the store's gate: for a checkpoint's
    /// freeze or install, a merge of one partition, a copy or DDL holding it exclusively.
    pub store_gate_wait_seconds: Histogram,
    /// Frames made durable by one fsync (group commit).
    pub wal_group_frames: Histogram,
    /// Statements run through this node, by outcome (`ok`, `failed`).
    pub queries: Family<Labels, Counter>,
    pub query_seconds: Histogram,
    /// Lineage recoveries that let a query finish after a node was lost.
    pub query_recoveries: Counter,
    /// Bytes this node received from other nodes' exchange channels.
    pub exchange_bytes: Counter,
    /// Connections to other nodes this node opened: one per peer, and one more after each
    /// that broke (queries and heartbeats reuse them).
    pub rpc_channels_opened: Counter,
    /// Partitions whose primary moved to this node's replica list after a failure.
    pub failovers: Counter,
    /// Times this node stepped down as metadata leader because no majority acknowledged it.
    pub raft_step_downs: Counter,
    /// Times the disk watcher found this process had been frozen (SIGSTOP, a paused VM).
    pub process_freezes: Counter,
    /// Partition copies (failbacks and moves) this node installed, and how long each took.
    pub failbacks: Counter,
    pub failback_seconds: Histogram,
    /// Component bytes the scrubber hashed again, and the damaged components it found.
    pub scrubbed_bytes: Counter,
    pub scrub_damaged: Counter,
    /// A compute node's component cache: bytes of components read from it (hits) and
    /// fetched into it from a replica (misses).
    pub component_cache_hit_bytes: Counter,
    pub component_cache_miss_bytes: Counter,
    pub raft_term: Gauge,
    /// The metadata leader's node id (0 while none is known).
    pub raft_leader: Gauge,
    pub raft_last_log_index: Gauge,
    pub raft_applied_index: Gauge,
    pub visible_epoch: Gauge,
    /// Per replica: the epochs it lacks on its most behind partition (0: up to date).
    pub replica_lag_epochs: Family<Labels, Gauge>,
    /// Rows this node logged as a cold standby and has not yet applied.
    pub standby_unapplied_rows: Gauge,
    /// PostgreSQL connections open now.
    pub pg_connections: Gauge,
    /// Queries with channels running on this node now.
    pub queries_running: Gauge,
    /// Memory held by components kept decoded for scans.
    pub decoded_cache_bytes: Gauge,
    /// The most memory the decoded cache may hold (`[exec] decoded_cache_bytes`).
    pub decoded_cache_budget_bytes: Gauge,
    /// Memory held by the store's memtables (rows not yet flushed to components).
    pub store_memtable_bytes: Gauge,
    /// The allocator's live allocations, and the memory it has mapped and touched (live,
    /// kept for reuse, its own): see [`crate::allocator`]. Absent where the process does not
    /// allocate with jemalloc.
    pub allocator_allocated_bytes: Gauge,
    pub allocator_resident_bytes: Gauge,
}

impl Metrics {
    fn new() -> Metrics {
        let metrics = Metrics {
            registry: Mutex::new(Registry::with_prefix("tessera")),
            publishes: Family::default(),
            publish_rows: Counter::default(),
            publish_bytes: Counter::default(),
            publish_seconds: seconds_buckets(),
            wal_fsync_seconds: seconds_buckets(),
            store_gate_wait_seconds: seconds_buckets(),
            wal_group_frames: size_buckets(),
            queries: Family::default(),
            query_seconds: seconds_buckets(),
            query_recoveries: Counter::default(),
            exchange_bytes: Counter::default(),
            rpc_channels_opened: Counter::default(),
            failovers: Counter::default(),
            raft_step_downs: Counter::default(),
            process_freezes: Counter::default(),
            failbacks: Counter::default(),
            failback_seconds: seconds_buckets(),
            scrubbed_bytes: Counter::default(),
            scrub_damaged: Counter::default(),
            component_cache_hit_bytes: Counter::default(),
            component_cache_miss_bytes: Counter::default(),
            raft_term: Gauge::default(),
            raft_leader: Gauge::default(),
            raft_last_log_index: Gauge::default(),
            raft_applied_index: Gauge::default(),
            visible_epoch: Gauge::default(),
            replica_lag_epochs: Family::default(),
            standby_unapplied_rows: Gauge::default(),
            pg_connections: Gauge::default(),
            queries_running: Gauge::default(),
            decoded_cache_bytes: Gauge::default(),
            decoded_cache_budget_bytes: Gauge::default(),
            store_memtable_bytes: Gauge::default(),
            allocator_allocated_bytes: Gauge::default(),
            allocator_resident_bytes: Gauge::default(),
        };
        {
            let mut r = metrics.registry.lock().expect("registry lock");
            r.register(
                "publishes",
                "Publishes coordinated by this node, by outcome",
                metrics.publishes.clone(),
            );
            r.register(
                "publish_rows",
                "Rows in acknowledged publishes",
                metrics.publish_rows.clone(),
            );
            r.register(
                "publish_bytes",
                "Arrow bytes in acknowledged publishes",
                metrics.publish_bytes.clone(),
            );
            r.register(
                "publish_seconds",
                "Publish latency, request to acknowledgement",
                metrics.publish_seconds.clone(),
            );
            r.register(
                "wal_fsync_seconds",
                "Write-ahead log fsync latency",
                metrics.wal_fsync_seconds.clone(),
            );
            r.register(
                "store_gate_wait_seconds",
                "Time prepares, commits and publishes waited for a checkpoint, merge or copy holding the store",
                metrics.store_gate_wait_seconds.clone(),
            );
            r.register(
                "wal_group_frames",
                "Log frames made durable by one fsync",
                metrics.wal_group_frames.clone(),
            );
            r.register(
                "queries",
                "Statements run through this node, by outcome",
                metrics.queries.clone(),
            );
            r.register(
                "query_seconds",
                "Statement latency",
                metrics.query_seconds.clone(),
            );
            r.register(
                "query_recoveries",
                "Lineage recoveries during queries",
                metrics.query_recoveries.clone(),
            );
            r.register(
                "exchange_bytes",
                "Bytes received over exchange channels",
                metrics.exchange_bytes.clone(),
            );
            r.register(
                "rpc_channels_opened",
                "Connections to other nodes this node opened (a new one replaces each that broke)",
                metrics.rpc_channels_opened.clone(),
            );
            r.register(
                "failovers",
                "Failovers this node's metadata applied (a failed node's partitions promoted)",
                metrics.failovers.clone(),
            );
            r.register(
                "failbacks",
                "Partition copies installed on this node (failbacks and moves)",
                metrics.failbacks.clone(),
            );
            r.register(
                "scrubbed_bytes",
                "Component bytes the scrubber hashed again",
                metrics.scrubbed_bytes.clone(),
            );
            r.register(
                "scrub_damaged",
                "Damaged or missing components the scrubber found",
                metrics.scrub_damaged.clone(),
            );
            r.register(
                "component_cache_hit_bytes",
                "Component bytes a compute node's scans found in its cache",
                metrics.component_cache_hit_bytes.clone(),
            );
            r.register(
                "component_cache_miss_bytes",
                "Component bytes a compute node fetched into its cache from a replica",
                metrics.component_cache_miss_bytes.clone(),
            );
            r.register(
                "failback_seconds",
                "Partition copy duration",
                metrics.failback_seconds.clone(),
            );
            r.register(
                "raft_step_downs",
                "Times this node stepped down as metadata leader: no majority acknowledged it",
                metrics.raft_step_downs.clone(),
            );
            r.register(
                "process_freezes",
                "Times this process was found frozen (SIGSTOP, a paused VM) by its disk watcher",
                metrics.process_freezes.clone(),
            );
            r.register("raft_term", "Current Raft term", metrics.raft_term.clone());
            r.register(
                "raft_leader",
                "Metadata leader node id, 0 if unknown",
                metrics.raft_leader.clone(),
            );
            r.register(
                "raft_last_log_index",
                "Highest Raft log index in this node's log",
                metrics.raft_last_log_index.clone(),
            );
            r.register(
                "raft_applied_index",
                "Highest Raft log index applied here",
                metrics.raft_applied_index.clone(),
            );
            r.register(
                "visible_epoch",
                "The visible epoch in this node's metadata",
                metrics.visible_epoch.clone(),
            );
            r.register(
                "replica_lag_epochs",
                "Epochs a replica lacks on its most behind partition",
                metrics.replica_lag_epochs.clone(),
            );
            r.register(
                "standby_unapplied_rows",
                "Rows logged here as a cold standby, not yet applied",
                metrics.standby_unapplied_rows.clone(),
            );
            r.register(
                "pg_connections",
                "Open PostgreSQL connections",
                metrics.pg_connections.clone(),
            );
            r.register(
                "queries_running",
                "Queries with channels running on this node",
                metrics.queries_running.clone(),
            );
            r.register(
                "decoded_cache_bytes",
                "Memory held by components kept decoded for scans",
                metrics.decoded_cache_bytes.clone(),
            );
            r.register(
                "decoded_cache_budget_bytes",
                "The most memory the decoded cache may hold ([exec] decoded_cache_bytes)",
                metrics.decoded_cache_budget_bytes.clone(),
            );
            r.register(
                "store_memtable_bytes",
                "Memory held by rows in the store's memtables, not yet flushed to components",
                metrics.store_memtable_bytes.clone(),
            );
            if crate::allocator::stats().is_some() {
                r.register(
                    "allocator_allocated_bytes",
                    "Memory in live allocations of this node's process (jemalloc's stats.allocated)",
                    metrics.allocator_allocated_bytes.clone(),
                );
                r.register(
                    "allocator_resident_bytes",
                    "Memory the allocator has mapped and touched: live allocations, freed memory kept for reuse, its own (jemalloc's stats.resident)",
                    metrics.allocator_resident_bytes.clone(),
                );
            }
        }
        metrics
    }

    /// The registry in Prometheus's text exposition format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry.lock().expect("registry lock"))
            .expect("writing to a String cannot fail");
        text
    }
}

/// This process's (this node's) metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);
    &METRICS
}

/// One label, for a family: `label("outcome", "aborted")`.
pub fn label(name: &'static str, value: impl Into<String>) -> Labels {
    vec![(name, value.into())]
}

/// Counts one event of `family` with `name=value`.
pub fn count(family: &Family<Labels, Counter>, name: &'static str, value: &str) {
    family.get_or_create(&label(name, value)).inc();
}

pub fn observe_seconds(histogram: &Histogram, took: Duration) {
    histogram.observe(took.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_encodes_in_the_text_format() {
        let m = metrics();
        count(&m.publishes, "outcome", "acknowledged");
        observe_seconds(&m.publish_seconds, Duration::from_millis(3));
        let text = m.encode();
        assert!(text.contains("# TYPE tessera_publishes counter"), "{text}");
        assert!(
            text.contains("tessera_publishes_total{outcome=\"acknowledged\"}"),
            "{text}"
        );
        assert!(
            text.contains("tessera_publish_seconds_bucket{le="),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
