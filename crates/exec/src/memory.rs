//! Bounded memory for queries: one pool per node, a limit per query, spilling to disk.
//!
//! Every channel a node runs takes its memory (a sort's buffered rows, an aggregation's
//! groups, a join's build side) from the node's pool, a DataFusion `FairSpillPool` of
//! `[exec] memory_limit_bytes`; the channels of one query also share that query's limit,
//! `tessera.query_memory_limit` (per node; the node's whole pool if unset). Sorts and
//! aggregations that reach a limit spill sorted runs to `data_dir/spill` and go on. A hash
//! join's build side cannot spill: a query whose build side does not fit runs again with
//! sort-merge joins, which do ([`is_build_side_refusal`], `tessera_recovery::restart`). A
//! query that cannot go on even so fails with an error naming the query, the node and the
//! limit it would pass.
//!
//! Under a query limit, each of the query's channels on a node is held to an equal share
//! of it, and its spilling consumers to half of that: a sort merging its spilled runs
//! takes what its pool has left, and must not take what another stage's merge waits for.
//! A join's build side is the exception ([`holds_its_input_whole`]): it cannot spill or
//! make do with less, it is as large as its data, and the channels of a stage rarely need
//! the same, so it draws on whatever is left of the query's whole limit on the node (as
//! does a top-k heap, [`outside_the_share`], and an operator past the point where it can
//! spill, such as an aggregation reading back its spilled runs, [`replays_its_spill`]).
//! So does any consumer's first step
//! ([`takes_its_first_step`]): one that holds nothing has nothing to spill, and a share
//! can be smaller than one batch.

use crate::{NodeId, QueryId};
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::config::SessionConfig;
use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::{
    FairSpillPool, MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::TaskContext;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// A node's memory for queries and the runtime its channels share.
#[derive(Debug)]
pub struct NodeMemory {
    node: NodeId,
    limit: usize,
    pool: Arc<dyn MemoryPool>,
    /// The process's runtime (its Parquet metadata cache, spill files), with the node's pool.
    runtime: Arc<RuntimeEnv>,
    /// What each query with a limit of its own holds here, over all its channels; an entry
    /// lives as long as one of its channels' contexts.
    held_by_query: Mutex<HashMap<QueryId, Weak<AtomicUsize>>>,
}

/// Half of this machine's memory, or 4 GiB where it cannot be read.
fn default_limit() -> usize {
    tessera_common::memory::machine_memory_bytes().map_or(4 << 30, |bytes| bytes as usize / 2)
}

/// `bytes` for a person: `512.0 MiB`.
pub fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

impl NodeMemory {
    /// The pool of `limit` bytes (0: half of this machine's memory) spilling under
    /// `spill_dir`, which is emptied first (spill files of a process that died).
    pub fn new(node: NodeId, limit: u64, spill_dir: &Path) -> std::io::Result<NodeMemory> {
        let limit = match limit {
            0 => default_limit(),
            bytes => bytes as usize,
        };
        if spill_dir.exists() {
            std::fs::remove_dir_all(spill_dir)?;
        }
        std::fs::create_dir_all(spill_dir)?;
        let pool: Arc<dyn MemoryPool> = Arc::new(FairSpillPool::new(limit));
        let base = crate::run::task_context().runtime_env();
        let disk_manager = DiskManagerBuilder::default()
            .with_mode(DiskManagerMode::Directories(vec![spill_dir.to_path_buf()]))
            .build()
            .map_err(std::io::Error::other)?;
        let runtime = Arc::new(RuntimeEnv {
            memory_pool: pool.clone(),
            disk_manager: Arc::new(disk_manager),
            cache_manager: base.cache_manager.clone(),
            object_store_registry: base.object_store_registry.clone(),
        });
        Ok(NodeMemory {
            node,
            limit,
            pool,
            runtime,
            held_by_query: Mutex::default(),
        })
    }

    /// The node's limit, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes the node's queries hold now.
    pub fn reserved(&self) -> usize {
        self.pool.reserved()
    }

    /// The context one of `query`'s `channels` on this node runs in: its session's `config`
    /// (see `settings.rs`), and the node's runtime with a pool that holds the query to `query_limit` bytes over all its channels here,
    /// and the channel's spilling consumers to half of an equal share of it (no limit of
    /// its own if `None` or not below the node's limit). Shares for what spills, not one
    /// pool: a sort merging its spilled runs takes what its pool has left, and would leave
    /// nothing to the merge of another stage waiting on it.
    pub fn task_context(
        &self,
        query: QueryId,
        query_limit: Option<u64>,
        channels: usize,
        config: &SessionConfig,
    ) -> Arc<TaskContext> {
        let own = query_limit.is_some_and(|l| (l as usize) < self.limit);
        let query_limit = query_limit.map_or(self.limit, |l| (l as usize).min(self.limit));
        let limit = if own {
            query_limit / channels.max(1)
        } else {
            self.limit
        };
        let pool = Arc::new(QueryPool {
            node: self.node,
            query,
            limit,
            query_limit,
            query_held: own.then(|| self.held_by(query)),
            channels,
            // Spilling consumers share half of the limit fairly; the rest is
            // left for those that cannot spill (a merge, a join's build side), which
            // would otherwise find it all held by a sort that will not give it back.
            query_pool: own.then(|| FairSpillPool::new(limit / 2)),
            node_limit: self.limit,
            node_pool: self.pool.clone(),
            reserved: AtomicUsize::new(0),
            in_share: AtomicUsize::new(0),
            consumers: Mutex::default(),
        });
        let runtime = Arc::new(RuntimeEnv {
            memory_pool: pool,
            disk_manager: self.runtime.disk_manager.clone(),
            cache_manager: self.runtime.cache_manager.clone(),
            object_store_registry: self.runtime.object_store_registry.clone(),
        });
        let mut config = config.clone();
        // Each sort sets aside this much, unspillable, to merge its spilled runs: sized
        // for large pools by default, it would take a small limit whole.
        let execution = &mut config.options_mut().execution;
        execution.sort_spill_reservation_bytes =
            execution.sort_spill_reservation_bytes.min(limit / 16);
        crate::run::task_context_with(config, runtime)
    }

    /// The bytes `query` holds here over all its channels, shared with the contexts made
    /// for it before (forgetting queries none of whose contexts is left).
    fn held_by(&self, query: QueryId) -> Arc<AtomicUsize> {
        let mut queries = self.held_by_query.lock().expect("query memory lock");
        if let Some(held) = queries.get(&query).and_then(Weak::upgrade) {
            return held;
        }
        queries.retain(|_, held| held.strong_count() > 0);
        let held = Arc::new(AtomicUsize::new(0));
        queries.insert(query, Arc::downgrade(&held));
        held
    }
}

/// Whether a consumer named `name` draws on whatever is left of the query's whole limit
/// on the node rather than on its channel's share: a join's build side, a top-k heap and
/// a merge of sorted streams. A top-k holds k rows, but pins the batch its rows came in
/// until a later batch lets it compact, and an aggregation's output batch can pin the
/// buffers of many more rows; it cannot spill, and held in the share it would starve the
/// aggregation feeding it. A merge holds a batch of each stream it merges: bounded by its
/// fan-in, not by the data, but a merge of 16 partitions' sorted strings outgrew a
/// channel's share of 32 MB, and it cannot spill either.
fn outside_the_share(name: &str) -> bool {
    holds_its_input_whole(name)
        || ["TopK", "PartitionedTopK", "SortPreservingMergeExec"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// How a refusal of a join's build side ends its message (see [`is_build_side_refusal`]).
const BUILD_SIDE_REFUSED: &str = "and a hash join's build side cannot spill to disk";

/// Whether a query failed because a hash join's build side did not fit in its memory
/// limit: `detail` is the error's text, as it reached the initiator from any node. Such
/// a query can run again with joins that spill (sort-merge joins).
pub fn is_build_side_refusal(detail: &str) -> bool {
    detail.contains(BUILD_SIDE_REFUSED)
}

/// Whether a consumer named `name` must hold its whole input in memory (a join's build
/// side), so that it fails rather than adapt when refused; DataFusion names them so.
fn holds_its_input_whole(name: &str) -> bool {
    ["HashJoinInput", "NestedLoopJoinLoad", "CrossJoinExec"]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

/// Whether `reservation` holds nothing yet: such a consumer is granted the step it asks
/// for beyond its channel's share (never beyond the query's limit or the node's). It has
/// nothing to spill, so a refusal would fail the query while the query may hold far less
/// than its limit: split over many channels and halved for what spills, a share can be
/// smaller than one batch of wide rows (an aggregation's first groups, a sort's first
/// batch, a top-k's first batch, which pins the whole output its rows were sliced from).
/// Its next steps are held to the share again, so it spills from there.
fn takes_its_first_step(reservation: &MemoryReservation) -> bool {
    reservation.size() == 0
}

/// One channel's view of a node's pool. A query with a limit of its own is held to it in
/// total over its channels on the node, each channel to an equal share of it (a join's
/// build side, a top-k heap, an operator past spilling and a first step excepted), and
/// each channel's spilling consumers to half of that share;
/// every byte must also fit in the node's pool.
#[derive(Debug)]
struct QueryPool {
    node: NodeId,
    query: QueryId,
    /// The channel's share of the query's limit.
    limit: usize,
    query_limit: usize,
    /// What the query holds on this node over all its channels, if it has a limit of its own.
    query_held: Option<Arc<AtomicUsize>>,
    /// The query's channels on this node, which share its limit.
    channels: usize,
    /// The query's own pool, under `tessera.query_memory_limit`.
    query_pool: Option<FairSpillPool>,
    node_limit: usize,
    node_pool: Arc<dyn MemoryPool>,
    /// What the channel holds.
    reserved: AtomicUsize,
    /// What the channel holds but for what is placed outside its share: held to it.
    in_share: AtomicUsize,
    /// What each of the channel's consumers holds, by consumer id, if the query has a
    /// limit of its own.
    consumers: Mutex<HashMap<usize, ConsumerHeld>>,
}

impl QueryPool {
    fn refusal(
        &self,
        reservation: &MemoryReservation,
        additional: usize,
        why: String,
    ) -> DataFusionError {
        let consumer = reservation.consumer();
        let spills = if consumer.can_spill() {
            "even after spilling"
        } else if holds_its_input_whole(consumer.name()) {
            BUILD_SIDE_REFUSED
        } else {
            "and it cannot spill to disk"
        };
        DataFusionError::ResourcesExhausted(format!(
            "query {} needs more memory on node {} than {why}: {} asked for {} more while the {} held {}{} ({spills})",
            self.query,
            self.node,
            consumer.name(),
            human(additional),
            if self.channels > 1 { "channel" } else { "query" },
            human(self.reserved.load(Ordering::SeqCst)),
            self.largest_holders(),
        ))
    }

    /// What the channel's largest holders hold, for a refusal: `, of which TopK[2]
    /// 9.0 MiB, FinalHashAggregateStream[2] 5.7 MiB` (nothing without a query limit).
    fn largest_holders(&self) -> String {
        const NAMED: usize = 3;
        let consumers = self.consumers.lock().expect("query consumers lock");
        let mut holders: Vec<&ConsumerHeld> = consumers
            .values()
            .filter(|consumer| consumer.held > 0)
            .collect();
        holders.sort_by_key(|consumer| std::cmp::Reverse(consumer.held));
        let named: Vec<String> = holders
            .iter()
            .take(NAMED)
            .map(|consumer| format!("{} {}", consumer.name, human(consumer.held)))
            .collect();
        match named.is_empty() {
            true => String::new(),
            false => format!(", of which {}", named.join(", ")),
        }
    }
}

impl std::fmt::Display for QueryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "query {} on node {}: {} of {}",
            self.query,
            self.node,
            human(self.reserved.load(Ordering::SeqCst)),
            human(self.limit)
        )
    }
}

/// Where a consumer's step counts: in its channel's share, or only in the query's whole
/// limit on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    InShare,
    Outside,
}

/// What one consumer holds over all its reservations in a channel, and how much of that
/// it was granted outside the channel's share.
#[derive(Debug)]
struct ConsumerHeld {
    name: String,
    held: usize,
    outside: usize,
}

/// Whether `reservation`, whose consumer spills and holds `consumer_held` bytes over all
/// its reservations, is a step of an operator past the point where it can spill: another
/// reservation of the same consumer holds bytes. DataFusion gives an aggregation reading
/// back its spilled runs (a merge of them, and the table it aggregates them into) and a
/// sort emitting its sorted batches reservations of their operator's consumer; refused,
/// they fail the query, and they are bounded by the data, as a join's build side is. So
/// they draw on the query's whole limit on the node, not on the channel's share: held to
/// half of it, a final aggregation's replay failed TPC-H Q10 and Q16 at SF 1 under 24 MB.
fn replays_its_spill(reservation: &MemoryReservation, consumer_held: usize) -> bool {
    consumer_held > reservation.size()
}

impl QueryPool {
    /// Adds `bytes` to the counters `reservation`'s bytes count in: the channel's, its
    /// share's (unless `placement` is outside it), the query's and its consumer's. No
    /// allocation: this runs on every reservation change.
    fn count_in(&self, reservation: &MemoryReservation, bytes: usize, placement: Placement) {
        self.reserved.fetch_add(bytes, Ordering::SeqCst);
        if placement == Placement::InShare {
            self.in_share.fetch_add(bytes, Ordering::SeqCst);
        }
        if let Some(query_held) = &self.query_held {
            query_held.fetch_add(bytes, Ordering::SeqCst);
        }
        self.consumer_held(reservation, |consumer| {
            consumer.held += bytes;
            if placement == Placement::Outside {
                consumer.outside += bytes;
            }
        });
    }

    /// Takes `bytes` from the counters `reservation`'s bytes count in: from its share's as
    /// `placement` says (undoing a refused step); else from what its consumer was granted
    /// outside the share first (a shrink does not say which of its
    /// reservations' bytes it frees, and those outside are the ones to end first).
    fn count_out(
        &self,
        reservation: &MemoryReservation,
        bytes: usize,
        placement: Option<Placement>,
    ) {
        self.reserved.fetch_sub(bytes, Ordering::SeqCst);
        if let Some(query_held) = &self.query_held {
            query_held.fetch_sub(bytes, Ordering::SeqCst);
        }
        let from_outside = self
            .consumer_held(reservation, |consumer| {
                let from_outside = match placement {
                    Some(Placement::Outside) => bytes,
                    Some(Placement::InShare) => 0,
                    None => bytes.min(consumer.outside),
                };
                consumer.held -= bytes;
                consumer.outside -= from_outside;
                from_outside
            })
            .unwrap_or_else(|| match placement.unwrap_or(self.placement(reservation)) {
                Placement::Outside => bytes,
                Placement::InShare => 0,
            });
        self.in_share
            .fetch_sub(bytes - from_outside, Ordering::SeqCst);
    }

    /// Where a step of `reservation` counts: outside the channel's share for a join's
    /// build side and a top-k heap ([`outside_the_share`]), and for a spilling consumer
    /// past the point where it can spill ([`replays_its_spill`]).
    fn placement(&self, reservation: &MemoryReservation) -> Placement {
        let outside = outside_the_share(reservation.consumer().name())
            || (reservation.consumer().can_spill()
                && self
                    .consumer_held(reservation, |consumer| {
                        replays_its_spill(reservation, consumer.held)
                    })
                    .unwrap_or(false));
        if outside {
            Placement::Outside
        } else {
            Placement::InShare
        }
    }

    /// `change` applied to what `reservation`'s consumer holds here over all its
    /// reservations, if the query has a limit of its own (the entry its registration
    /// made; none without, where nothing is held to a share).
    fn consumer_held<R>(
        &self,
        reservation: &MemoryReservation,
        change: impl FnOnce(&mut ConsumerHeld) -> R,
    ) -> Option<R> {
        self.query_held.as_ref()?;
        let mut consumers = self.consumers.lock().expect("query consumers lock");
        consumers.get_mut(&reservation.consumer().id()).map(change)
    }

    /// The query's own pool, for a consumer that spills (the others are held to the
    /// query's total only).
    fn own_share(&self, consumer: &MemoryConsumer) -> Option<&FairSpillPool> {
        self.query_pool.as_ref().filter(|_| consumer.can_spill())
    }
}

impl MemoryPool for QueryPool {
    fn name(&self) -> &str {
        "tessera-query"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        if let Some(own) = self.own_share(consumer) {
            own.register(consumer);
        }
        if self.query_held.is_some() {
            let held = ConsumerHeld {
                name: consumer.name().to_string(),
                held: 0,
                outside: 0,
            };
            let mut consumers = self.consumers.lock().expect("query consumers lock");
            consumers.insert(consumer.id(), held);
        }
        self.node_pool.register(consumer);
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        if let Some(own) = self.own_share(consumer) {
            own.unregister(consumer);
        }
        if self.query_held.is_some() {
            let mut consumers = self.consumers.lock().expect("query consumers lock");
            consumers.remove(&consumer.id());
        }
        self.node_pool.unregister(consumer);
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        if let Some(own) = self.own_share(reservation.consumer()) {
            own.grow(reservation, additional);
        }
        self.node_pool.grow(reservation, additional);
        self.count_in(reservation, additional, self.placement(reservation));
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        if let Some(own) = self.own_share(reservation.consumer()) {
            own.shrink(reservation, shrink);
        }
        self.node_pool.shrink(reservation, shrink);
        self.count_out(reservation, shrink, None);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> DfResult<()> {
        let query_limit = || {
            let shared = match self.channels {
                0 | 1 => String::new(),
                channels => format!(", over its {channels} channels on the node"),
            };
            format!(
                "its limit of {} (tessera.query_memory_limit{shared})",
                human(self.query_limit)
            )
        };
        let channel_share = || {
            match self.channels {
            0 | 1 => query_limit(),
            channels => format!(
                "a channel's share, {}, of its limit of {} (tessera.query_memory_limit, shared by its {channels} channels on the node)",
                human(self.limit),
                human(self.query_limit)
            ),
        }
        };
        let placement = self.placement(reservation);
        self.count_in(reservation, additional, placement);
        let undo = || self.count_out(reservation, additional, Some(placement));
        let held = |counter: &AtomicUsize| counter.load(Ordering::SeqCst);
        let first_step = takes_its_first_step(reservation);
        if let Some(query_held) = &self.query_held {
            if held(query_held) > self.query_limit {
                undo();
                return Err(self.refusal(reservation, additional, query_limit()));
            }
            let in_share = placement == Placement::InShare;
            if in_share && !first_step && held(&self.in_share) > self.limit {
                undo();
                return Err(self.refusal(reservation, additional, channel_share()));
            }
        }
        let own = self.own_share(reservation.consumer());
        if let Some(own) = own {
            if first_step || placement == Placement::Outside {
                own.grow(reservation, additional);
            } else if own.try_grow(reservation, additional).is_err() {
                undo();
                let spilling_half = format!(
                    "what its spilling operators share, {}, of {}",
                    human(self.limit / 2),
                    channel_share()
                );
                return Err(self.refusal(reservation, additional, spilling_half));
            }
        }
        if self.node_pool.try_grow(reservation, additional).is_err() {
            if let Some(own) = own {
                own.shrink(reservation, additional);
            }
            undo();
            return Err(self.refusal(
                reservation,
                additional,
                format!(
                    "the node's limit of {} for all its queries ([exec] memory_limit_bytes)",
                    human(self.node_limit)
                ),
            ));
        }
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.reserved.load(Ordering::SeqCst)
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_held_to_its_limit_and_the_node_to_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let memory = NodeMemory::new(NodeId(2), 10 << 20, &dir.path().join("spill")).unwrap();
        let query = memory.task_context(QueryId(0xabc), Some(1 << 20), 1, &SessionConfig::new());
        let pool = query.memory_pool();
        let sort = MemoryConsumer::new("a sort")
            .with_can_spill(true)
            .register(pool);
        sort.try_grow(512 << 10).unwrap();
        let error = sort.try_grow(768 << 10).unwrap_err().to_string();
        assert!(error.contains("tessera.query_memory_limit"), "{error}");
        assert!(
            error.contains("1.0 MiB") && error.contains("node 2"),
            "{error}"
        );
        assert!(error.contains(&QueryId(0xabc).to_string()), "{error}");
        assert_eq!(
            memory.reserved(),
            512 << 10,
            "the node pool saw the query's bytes"
        );
        sort.free();
        assert_eq!(memory.reserved(), 0);

        // Without a limit of its own a query may take the node's whole pool, and no more.
        let big = memory.task_context(QueryId(1), None, 3, &SessionConfig::new());
        let join = MemoryConsumer::new("a join's build side").register(big.memory_pool());
        join.try_grow(9 << 20).unwrap();
        let error = join.try_grow(2 << 20).unwrap_err().to_string();
        assert!(error.contains("[exec] memory_limit_bytes"), "{error}");
        assert!(error.contains("cannot spill"), "{error}");
    }

    /// Under a limit of 1 MiB for 4 channels (256 KiB each), one channel's join builds
    /// 700 KiB and another's 200 KiB; then the query is full, whichever channel asks.
    /// Everything else is held to its channel's share: a merge (which cannot spill, but
    /// makes do with less) to 256 KiB, a sort to half of that.
    #[test]
    fn a_joins_build_side_draws_on_the_querys_whole_limit_across_its_channels() {
        let dir = tempfile::tempdir().unwrap();
        let memory = NodeMemory::new(NodeId(1), 64 << 20, &dir.path().join("spill")).unwrap();
        let channel = || memory.task_context(QueryId(7), Some(1 << 20), 4, &SessionConfig::new());
        let (first, second, third) = (channel(), channel(), channel());
        let consumer = |ctx: &Arc<TaskContext>, name: &str| {
            MemoryConsumer::new(name).register(ctx.memory_pool())
        };
        let big = consumer(&first, "HashJoinInput[0]");
        big.try_grow(700 << 10).unwrap();
        let small = consumer(&second, "HashJoinInput");
        small.try_grow(200 << 10).unwrap();
        let error = small.try_grow(200 << 10).unwrap_err().to_string();
        assert!(
            error.contains("its limit of 1.0 MiB") && error.contains("over its 4 channels"),
            "{error}"
        );
        assert!(is_build_side_refusal(&error), "{error}");
        // Another query's channels are not held by this one's bytes.
        let other = memory.task_context(QueryId(8), Some(1 << 20), 4, &SessionConfig::new());
        consumer(&other, "HashJoinInput[1]")
            .try_grow(900 << 10)
            .unwrap();

        big.free();
        let merge = consumer(&third, "ExternalSorterMerge[0]");
        merge.try_grow(200 << 10).unwrap();
        let error = merge.try_grow(100 << 10).unwrap_err().to_string();
        assert!(error.contains("a channel's share, 256.0 KiB"), "{error}");
        assert!(!is_build_side_refusal(&error), "{error}");
        merge.free();
        let sort = MemoryConsumer::new("ExternalSorter[0]")
            .with_can_spill(true)
            .register(third.memory_pool());
        sort.try_grow(100 << 10).unwrap();
        let error = sort.try_grow(100 << 10).unwrap_err().to_string();
        assert!(
            error.contains("what its spilling operators share, 128.0 KiB, of a channel's share"),
            "{error}"
        );
        small.free();
        sort.free();
        drop((first, second, third));
        let again = memory.task_context(QueryId(7), Some(1 << 20), 4, &SessionConfig::new());
        consumer(&again, "HashJoinInput[2]")
            .try_grow(1 << 20)
            .unwrap();
    }

    /// Under a limit of 1 MiB for 8 channels (128 KiB each, 64 KiB for what spills), an
    /// aggregation holding nothing takes a 300 KiB first step, a merge beside it another,
    /// and each is then held to the share again; a top-k and a merge of sorted streams are
    /// held to the query's limit only; a first step is still held to the query's limit.
    #[test]
    fn a_consumer_holding_nothing_takes_its_first_step_beyond_its_share() {
        let dir = tempfile::tempdir().unwrap();
        let memory = NodeMemory::new(NodeId(3), 64 << 20, &dir.path().join("spill")).unwrap();
        let channel = memory.task_context(QueryId(9), Some(1 << 20), 8, &SessionConfig::new());
        let aggregate = MemoryConsumer::new("FinalHashAggregateStream[0]")
            .with_can_spill(true)
            .register(channel.memory_pool());
        aggregate.try_grow(300 << 10).unwrap();
        let error = aggregate.try_grow(1 << 10).unwrap_err().to_string();
        assert!(error.contains("a channel's share, 128.0 KiB"), "{error}");
        assert!(error.contains("even after spilling"), "{error}");
        let merge = MemoryConsumer::new("ExternalSorterMerge[0]").register(channel.memory_pool());
        merge.try_grow(300 << 10).unwrap();
        let error = merge.try_grow(1 << 10).unwrap_err().to_string();
        assert!(error.contains("a channel's share, 128.0 KiB"), "{error}");
        merge.free();
        // A top-k is not held to the share at all, so the aggregation feeding it is not
        // starved by the batch it pins.
        let top_k = MemoryConsumer::new("TopK[0]").register(channel.memory_pool());
        top_k.try_grow(200 << 10).unwrap();
        top_k.try_grow(100 << 10).unwrap();
        // Nor is a merge of sorted streams, which holds a batch of each.
        let streams_merge =
            MemoryConsumer::new("SortPreservingMergeExec[0]").register(channel.memory_pool());
        streams_merge.try_grow(200 << 10).unwrap();
        streams_merge.try_grow(100 << 10).unwrap();
        streams_merge.free();
        // After spilling everything it held, the aggregation steps out again.
        aggregate.free();
        aggregate.try_grow(300 << 10).unwrap();

        let sort = MemoryConsumer::new("ExternalSorter[1]")
            .with_can_spill(true)
            .register(channel.memory_pool());
        let error = sort.try_grow(500 << 10).unwrap_err().to_string();
        assert!(error.contains("its limit of 1.0 MiB"), "{error}");
        assert_eq!(memory.reserved(), 600 << 10, "a refused step holds nothing");
        sort.try_grow(400 << 10).unwrap();
    }

    /// Under a limit of 1 MiB for 4 channels (256 KiB each, 128 KiB for what spills), a
    /// final aggregation is held to the spilling half while it can spill; reading back its
    /// runs (a merge and a table, both reservations of its consumer) it cannot, and grows
    /// to the query's limit; once it is done, its channel's share is whole again.
    #[test]
    fn an_aggregation_replaying_its_spill_draws_on_the_querys_whole_limit() {
        let dir = tempfile::tempdir().unwrap();
        let memory = NodeMemory::new(NodeId(4), 64 << 20, &dir.path().join("spill")).unwrap();
        let channel = memory.task_context(QueryId(11), Some(1 << 20), 4, &SessionConfig::new());
        let aggregate = MemoryConsumer::new("FinalHashAggregateStream[0]")
            .with_can_spill(true)
            .register(channel.memory_pool());
        aggregate.try_grow(100 << 10).unwrap();
        let error = aggregate.try_grow(100 << 10).unwrap_err().to_string();
        assert!(
            error.contains("what its spilling operators share, 128.0 KiB"),
            "{error}"
        );
        aggregate.free();

        let merge = aggregate.new_empty();
        merge.try_grow(100 << 10).unwrap();
        let table = aggregate.new_empty();
        table.try_grow(100 << 10).unwrap();
        table.try_grow(300 << 10).unwrap();
        table.try_grow(300 << 10).unwrap();
        assert_eq!(memory.reserved(), 800 << 10);
        let error = table.try_grow(300 << 10).unwrap_err().to_string();
        assert!(error.contains("its limit of 1.0 MiB"), "{error}");
        assert!(
            error.contains("held 800.0 KiB, of which FinalHashAggregateStream[0] 800.0 KiB"),
            "the refusal names what holds the channel's bytes: {error}"
        );
        table.try_resize(50 << 10).unwrap();
        table.try_grow(100 << 10).unwrap();
        merge.free();
        table.free();
        assert_eq!(memory.reserved(), 0);

        // Nothing of the replay is left counted in the channel's share.
        let sort_merge =
            MemoryConsumer::new("ExternalSorterMerge[0]").register(channel.memory_pool());
        sort_merge.try_grow(200 << 10).unwrap();
        sort_merge.try_grow(50 << 10).unwrap();
        let error = sort_merge.try_grow(10 << 10).unwrap_err().to_string();
        assert!(error.contains("a channel's share, 256.0 KiB"), "{error}");
    }
}
