//! Queries that survive node failures (DESIGN §8): a 4-node cluster with r = 3 runs TPC-H
//! queries while a random peer of the initiating node is SIGKILLed at a random moment of
//! each, from the first scans to the final aggregation. Every answer must equal plain
//! DataFusion's: no duplicate, no missing row. Rounds alternate `tessera.recovery =
//! restart` and `lineage`; one round with `none` must fail naming the dead node. A
//! lineage round either rebuilds the dead node's channels or, when a rebuilt channel
//! cannot reproduce what it had sent (its notice says so), restarts the query; but the
//! default mode under EXPLAIN ANALYZE must rebuild, and at least one rebuilt round must
//! replay logged input batches (lineage rounds are added until one does, up to a limit).
//! Steered kills show a rebuild splitting a dead node's silent channels over several
//! streams, leaving alone one that had delivered all its output to survivors, and
//! re-running a scan that had begun to send on a replica whose components are laid out
//! otherwise (its rows come in the same order: a rebuild, not a restart).
//!
//! The default run is short (CI). `TESSERA_QUERY_CHAOS_ROUNDS=200 cargo test --release
//! --test query_chaos -- --nocapture` runs the long version and prints its counts;
//! `TESSERA_QUERY_CHAOS_MODES=lineage` runs one mode only; `TESSERA_QUERY_CHAOS_LATE_ROUNDS`
//! sets the rounds of the late-kill sweep.

use arrow::array::{AsArray, RecordBatch};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::ClusterClient;
use tessera_server::RecoveryOutcome;
use tessera_testkit::LocalCluster;

mod common;
use common::{flush_everywhere, load_tpch, short_panics, wait_formed};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const NODES: usize = 4;
const PARTITIONS: u32 = 16;
const REPLICATION: u32 = 3;
const SCALE: f64 = 0.1;
/// Scans with aggregation (1, 6), joins building and probing (3, 5, 9, 10), and large
/// final aggregations over joins (18).
const QUERIES: [usize; 7] = [1, 3, 5, 6, 9, 10, 18];

/// The recovery modes the rounds take in turn.
fn modes() -> Vec<String> {
    std::env::var("TESSERA_QUERY_CHAOS_MODES")
        .unwrap_or_else(|_| "restart,lineage".into())
        .split(',')
        .map(|m| m.trim().to_string())
        .collect()
}

/// How a round's query survived, from its notice's typed outcome.
fn outcome(recovery: &RecoveryOutcome) -> &'static str {
    match recovery {
        RecoveryOutcome::Rebuilt { .. } => "rebuilt from lineage",
        RecoveryOutcome::Restarted { .. } => "restarted",
        RecoveryOutcome::Rerouted { .. } => "rerouted around an unreachable node",
        RecoveryOutcome::SpillingJoins { .. } => "ran again with spilling joins",
    }
}

/// Lineage rounds run after the drawn ones, at most, until one has replayed logged input
/// batches. Lineage is logged when a channel's output waits on it, so a kill replays
/// logged input only where the dead node's channels had already emitted output; TPC-H's
/// aggregations mostly emit at their end, so the drawn rounds rarely replay. The extra
/// rounds run [`STREAMING_JOIN`] instead, with the kill steered to where its join
/// streams output. That window is narrow on this machine (a kill must come after a dead
/// channel's first output and before the query ends): runs took 13 to 21 extra rounds to
/// land in it, so the limit leaves room for four times that.
const EXTRA_LINEAGE_ROUNDS: usize = 80;

/// A join whose channels stream their output to the initiator, batch after batch long
/// before they end, each batch waiting on the logged reading order of its input. The join
/// is on part key, not on lineitem's partition key, so lineitem's rows come to it hashed
/// from every scan channel (an input whose reading order is logged); a join on the order
/// key would be co-located, read its scans directly and log nothing. It does not
/// aggregate: a GROUP BY puts a partial aggregation after the join in the same stage,
/// which emits (and so logs) only at its end, and then only kills in the last moments of
/// the query replayed logged input (the runs that reached the round limit without one).
const STREAMING_JOIN: &str = "SELECT l_orderkey, l_linenumber, ps_suppkey, ps_availqty \
     FROM lineitem JOIN partsupp ON l_partkey = ps_partkey AND l_suppkey = ps_suppkey \
     WHERE l_quantity < 10";
const STREAMING: usize = 0;

/// A union whose first half (nation's rows) is delivered to the initiator within the
/// query's first third, while its second (an aggregation over a join on a key that is not
/// lineitem's partition key) runs on: both halves are channels of one stage, which only the
/// initiator reads.
const DELIVERED_UNION: &str = "SELECT n_name AS name, CAST(n_nationkey AS BIGINT) AS n \
     FROM nation \
     UNION ALL \
     SELECT CAST(ps_availqty % 10 AS VARCHAR) AS name, count(*) AS n \
     FROM lineitem JOIN partsupp ON l_partkey = ps_partkey AND l_suppkey = ps_suppkey \
     GROUP BY ps_availqty % 10";
const DELIVERED: usize = 100;

/// The SQL of query `q` (a TPC-H number, [`STREAMING`] or [`DELIVERED`]).
fn sql_of(q: usize) -> &'static str {
    match q {
        STREAMING => STREAMING_JOIN,
        DELIVERED => DELIVERED_UNION,
        q => tessera_tpch::query(q),
    }
}

fn rounds() -> usize {
    std::env::var("TESSERA_QUERY_CHAOS_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
}

/// The phase of a query a kill at `fraction` of its no-failure time most likely hit.
fn phase(fraction: f64) -> &'static str {
    match fraction {
        f if f < 0.35 => "scans",
        f if f < 0.8 => "joins' build and probe",
        _ => "final aggregation",
    }
}

/// Restarts `victim` and waits until it and every other node see all nodes live.
async fn rejoin(cluster: &mut LocalCluster, victim: u64) {
    cluster.start(victim);
    for id in cluster.node_ids() {
        wait_formed(cluster, id, NODES).await;
    }
}

/// The 4-node cluster with TPC-H loaded and flushed everywhere.
async fn loaded_cluster(root: &Path) -> LocalCluster {
    short_panics();
    let mut cluster =
        LocalCluster::configure(Path::new(BINARY), root, NODES, PARTITIONS, REPLICATION);
    cluster.start_all();
    wait_formed(&cluster, 1, NODES).await;
    load_tpch(&cluster, SCALE).await;
    // Standbys take their primaries' components (in the background), as after any load
    // that has settled. (A scan re-run on a replica laid out otherwise reproduces the dead
    // primary's output too: `a_scan_rerun_on_a_replica_laid_out_otherwise_...`.)
    flush_everywhere(&cluster).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster
}

/// A node killed after its channels ended while producers elsewhere still send to it: a
/// consumer may end before reading all its input (Q18's semi join ends at once on a
/// partition where the subquery found no order, without reading its probe side), so its
/// node reports all its channels ended while a producer on another node still streams
/// batches to it. Killing that node fails the producer, and with it the consumers it was
/// still feeding. The initiator must take the node's loss as the cause (and restart the
/// query), not report the broken stream as the query's own error. The kills sweep the end
/// of Q18's no-failure time, from 60% to 110%. This is a sweep, not a reproduction: the window is narrow,
/// and a run lands in it a few times in thirty rounds or not at all (the runs that found
/// it failed 2 rounds in 40; with the fix, runs that landed in it up to 4 times answered
/// exactly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_as_its_channels_end_is_taken_as_the_cause() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = loaded_cluster(root.path()).await;
    let q = 18;
    let oracle = tessera_tpch::oracle::oracle(SCALE).unwrap();
    let expected = oracle
        .sql(sql_of(q))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let initiator = 3;
    let client = ClusterClient::new(cluster.addr(initiator));
    client.query(sql_of(q)).await.unwrap();
    let started = Instant::now();
    client.query(sql_of(q)).await.unwrap();
    let no_failure = started.elapsed();
    let rounds = late_kill_rounds();
    let mut recovered = 0;
    for round in 0..rounds {
        let victim = [1, 2, 4][round % 3];
        let fraction = 0.6 + 0.5 * (round as f64 / rounds as f64);
        let delay = no_failure.mul_f64(fraction);
        let sql = format!("/*+ SET tessera.recovery = restart */ {}", sql_of(q));
        let client = ClusterClient::new(cluster.addr(initiator));
        let query = tokio::spawn(async move { client.query_with_notices(&sql).await });
        tokio::time::sleep(delay).await;
        cluster.kill9(victim);
        let (actual, notices) = query.await.unwrap().unwrap_or_else(|e| {
            panic!("round {round}: Q{q} from node {initiator}, node {victim} killed at {delay:?} of {no_failure:?}: {e}")
        });
        if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
            panic!("round {round}: node {victim} killed at {delay:?}: wrong answer: {diff}");
        }
        if let Some(recovery) = notices.iter().find_map(|n| n.recovery.as_ref()) {
            assert_eq!(
                recovery.dead(),
                Some(tessera_server::NodeId(victim)),
                "{recovery}"
            );
            recovered += 1;
        }
        rejoin(&mut cluster, victim).await;
    }
    println!("late kills: {rounds} rounds of Q{q} ({no_failure:?} without failure), every answer exact, {recovered} restarted");
}

/// Runs query `q` (see [`sql_of`]) under lineage recovery and kills a peer of its
/// initiator at `fraction` of its no-failure time, earlier each try, until a rebuild
/// places the dead node's channels as `wanted` asks (`what` says how, for the failure
/// message); every answer must be exact. Returns where the rebuild placed the channels.
async fn kill_until(
    cluster: &mut LocalCluster,
    q: usize,
    fraction: f64,
    what: &str,
    wanted: impl Fn(&[String]) -> bool,
    expected: &[RecordBatch],
    no_failure: &BTreeMap<usize, Duration>,
) -> Vec<String> {
    for attempt in 0..6u64 {
        let (initiator, victim) = (1, 2 + attempt % 3);
        let sql = format!("/*+ SET tessera.recovery = lineage */ {}", sql_of(q));
        let client = ClusterClient::new(cluster.addr(initiator));
        // Once without a kill first: a node restarted after the last attempt opens its
        // components on its first query, which would put it behind the measured timing.
        client.query(sql_of(q)).await.unwrap();
        let query = tokio::spawn(async move { client.query_with_notices(&sql).await });
        let at = fraction * 0.8f64.powi(attempt as i32);
        tokio::time::sleep(no_failure[&q].mul_f64(at)).await;
        cluster.kill9(victim);
        let (actual, notices) = query.await.unwrap().unwrap_or_else(|e| {
            panic!("attempt {attempt}: Q{q}, node {victim} killed at {at:.2}: {e}")
        });
        rejoin(cluster, victim).await;
        if let Err(diff) = tessera_tpch::compare::same_answer(expected, &actual, 1e-9) {
            panic!("attempt {attempt}: Q{q}, node {victim} killed: wrong answer: {diff}");
        }
        let recovery = notices.iter().find_map(|n| n.recovery.as_ref());
        println!("attempt {attempt}: Q{q}, node {victim} killed at {at:.2}: {recovery:?}");
        if let Some(RecoveryOutcome::Rebuilt { placed, .. }) = recovery {
            if wanted(placed) {
                return placed.clone();
            }
        }
    }
    panic!("no kill in Q{q} had {what}")
}

/// True if at least `n` of the dead node's channels were split over several streams.
fn split_at_least(n: usize) -> impl Fn(&[String]) -> bool {
    move |placed| placed.iter().filter(|p| p.contains("split")).count() >= n
}

fn late_kill_rounds() -> usize {
    std::env::var("TESSERA_QUERY_CHAOS_LATE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_answer_exactly_when_a_peer_is_killed_at_random() {
    let seed: u64 = std::env::var("TESSERA_QUERY_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("query chaos seed {seed} (TESSERA_QUERY_CHAOS_SEED={seed} repeats this run)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let root = tempfile::tempdir().unwrap();
    let mut cluster = loaded_cluster(root.path()).await;
    let oracle = tessera_tpch::oracle::oracle(SCALE).unwrap();

    // The no-failure time of each query, measured once (the kill moments are drawn from it).
    let mut no_failure: BTreeMap<usize, Duration> = BTreeMap::new();
    let mut expected = BTreeMap::new();
    for q in QUERIES.into_iter().chain([STREAMING, DELIVERED]) {
        let sql = sql_of(q);
        expected.insert(q, oracle.sql(sql).await.unwrap().collect().await.unwrap());
        let client = ClusterClient::new(cluster.addr(1));
        // The second run: the first also warms caches.
        client.query(sql).await.unwrap();
        let started = Instant::now();
        client.query(sql).await.unwrap();
        no_failure.insert(q, started.elapsed());
    }

    // `none`: the query fails, naming the node that died. A kill that lands after the
    // dead node's part of the query was done (the run can be faster than the measured
    // one) is not noticed, and the answer must then be exact; it is tried again, earlier.
    let mut failed = None;
    for attempt in 1..=5u32 {
        let (initiator, victim) = (1, 2);
        let sql = format!(
            "/*+ SET tessera.recovery = none */ {}",
            tessera_tpch::query(9)
        );
        let client = ClusterClient::new(cluster.addr(initiator));
        let query = tokio::spawn(async move { client.query(&sql).await });
        tokio::time::sleep(no_failure[&9] / (2 + attempt)).await;
        cluster.kill9(victim);
        let answer = query.await.unwrap();
        rejoin(&mut cluster, victim).await;
        match answer {
            Ok(actual) => {
                if let Err(diff) = tessera_tpch::compare::same_answer(&expected[&9], &actual, 1e-9)
                {
                    panic!(
                        "attempt {attempt}: a kill too late to matter, and a wrong answer: {diff}"
                    );
                }
            }
            Err(error) => {
                failed = Some((victim, error));
                break;
            }
        }
    }
    let (victim, error) = failed.expect("a query without recovery never failed in 5 kills");
    assert!(
        error.to_string().contains(&format!("node {victim} died")),
        "the error names the dead node: {error}"
    );

    // The default recovery (lineage), under EXPLAIN ANALYZE: its plan ends with what was
    // recomputed, and that must be a rebuild of the dead node's channels, not a restart. A
    // kill that lands after the answer is retried, a few times.
    let mut explained = None;
    for attempt in 0..5u64 {
        let (initiator, victim) = (1, 2 + attempt % 3);
        let sql = format!("EXPLAIN ANALYZE {}", tessera_tpch::query(9));
        let client = ClusterClient::new(cluster.addr(initiator));
        let query = tokio::spawn(async move { client.query_with_notices(&sql).await });
        tokio::time::sleep(no_failure[&9] * 2 / 5).await;
        cluster.kill9(victim);
        let (batches, notices) = query.await.unwrap().unwrap_or_else(|e| {
            panic!("EXPLAIN ANALYZE attempt {attempt}: Q9 from node {initiator}, node {victim} killed: {e}")
        });
        rejoin(&mut cluster, victim).await;
        let text = arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string();
        let line = text.lines().find(|l| l.contains("Recovery:"));
        let recovery = notices.iter().find_map(|n| n.recovery.clone());
        match (line, recovery) {
            (None, None) => continue,
            (Some(line), Some(recovery)) => {
                assert_eq!(recovery.dead(), Some(tessera_server::NodeId(victim)), "the recovery names the dead node");
                assert!(
                    line.contains(&format!("node {victim} died")),
                    "the recovery line names the dead node: {line}"
                );
                explained = Some((line.to_string(), recovery));
                break;
            }
            (line, recovery) => panic!(
                "EXPLAIN ANALYZE's recovery line ({line:?}) and the typed notice ({recovery:?}) disagree"
            ),
        }
    }
    let (line, recovery) =
        explained.expect("EXPLAIN ANALYZE never recovered from a kill in 5 tries");
    assert!(
        matches!(recovery, RecoveryOutcome::Rebuilt { .. }),
        "the default recovery must rebuild the dead node's channels, not restart: {recovery}"
    );
    assert!(line.contains("rebuilt on the surviving nodes"), "{line}");
    println!("EXPLAIN ANALYZE under the default recovery: {line}");

    // A dead node's channel that had given nobody anything is redone split over several
    // streams: Q1's scan channels send only their partial aggregates, at their end, so a
    // kill early in Q1 finds the dead node's scan channel silent. So is one whose
    // surviving consumers had all its output: Q3's customer scan channels broadcast their
    // rows and end within its first tenth, so a kill at half of Q3 finds the dead node's
    // done, and its join channel silent; both are split.
    let one_split = "one of the dead node's channels split over several streams";
    let placed = kill_until(
        &mut cluster,
        1,
        0.4,
        one_split,
        split_at_least(1),
        &expected[&1],
        &no_failure,
    )
    .await;
    println!("a silent channel rebuilt split: {placed:?}");
    let two_split = "two of the dead node's channels split over several streams";
    let placed = kill_until(
        &mut cluster,
        3,
        0.5,
        two_split,
        split_at_least(2),
        &expected[&3],
        &no_failure,
    )
    .await;
    println!("a delivered channel and a silent one rebuilt split: {placed:?}");
    // A dead node's channel that had sent all its output to consumers that all survive is
    // not run again: DELIVERED_UNION's nation channels feed only the initiator and end at
    // once, long before its join does.
    let not_rebuilt = "a delivered channel of the dead node left as it was";
    let delivered = |placed: &[String]| placed.iter().any(|p| p.contains("not rebuilt"));
    let placed = kill_until(
        &mut cluster,
        DELIVERED,
        0.6,
        not_rebuilt,
        delivered,
        &expected[&DELIVERED],
        &no_failure,
    )
    .await;
    println!("a delivered channel not rebuilt: {placed:?}");

    let modes = modes();
    let mut recovered = BTreeMap::<(&str, &str, &str), usize>::new();
    let mut finished_first = 0;
    // Rebuilt rounds whose dead node had logged lineage, and the batches replayed by it.
    let (mut replaying_rounds, mut replayed) = (0, 0u64);
    let lineage_tested = modes.iter().any(|m| m == "lineage");
    let mut round = 0;
    // Where in STREAMING_JOIN the extra rounds kill, as a fraction of its no-failure time:
    // earlier after a kill that came too late, later after one that came before any output
    // (its time varies run to run, so it is steered rather than drawn).
    let mut streaming_at = 0.7f64;
    while round < rounds()
        || (lineage_tested && replaying_rounds == 0 && round < rounds() + EXTRA_LINEAGE_ROUNDS)
    {
        let extra = round >= rounds();
        let q = if extra {
            STREAMING
        } else {
            QUERIES[rng.random_range(0..QUERIES.len())]
        };
        let mode = if extra {
            "lineage"
        } else {
            modes[round % modes.len()].as_str()
        };
        let initiator = rng.random_range(1..=NODES as u64);
        let victim = loop {
            let v = rng.random_range(1..=NODES as u64);
            if v != initiator {
                break v;
            }
        };
        let fraction = if extra {
            streaming_at
        } else {
            rng.random_range(0.05..0.95)
        };
        let delay = no_failure[&q].mul_f64(fraction);
        let sql = format!("/*+ SET tessera.recovery = {mode} */ {}", sql_of(q));
        let client = ClusterClient::new(cluster.addr(initiator));
        let query = tokio::spawn(async move { client.query_with_notices(&sql).await });
        tokio::time::sleep(delay).await;
        cluster.kill9(victim);
        let (actual, notices) = query.await.unwrap().unwrap_or_else(|e| {
            panic!("round {round}: Q{q} ({mode}) from node {initiator}, node {victim} killed at {delay:?}: {e}")
        });
        if let Err(diff) = tessera_tpch::compare::same_answer(&expected[&q], &actual, 1e-9) {
            panic!("round {round}: Q{q} ({mode}) from node {initiator}, node {victim} killed at {delay:?}: wrong answer: {diff}");
        }
        let recovery = notices.iter().find_map(|n| n.recovery.as_ref());
        println!(
            "round {round}: Q{q} {mode} from node {initiator}, node {victim} killed at {:.0}% ({}): {}",
            fraction * 100.0,
            phase(fraction),
            recovery.map_or("answered before the kill was noticed".to_string(), |r| r.to_string())
        );
        match recovery {
            Some(recovery) => {
                assert_eq!(
                    recovery.dead(),
                    Some(tessera_server::NodeId(victim)),
                    "the notice names the dead node: {recovery}"
                );
                let how = outcome(recovery);
                if let RecoveryOutcome::Rebuilt {
                    replayed_batches, ..
                } = recovery
                {
                    if *replayed_batches > 0 {
                        replaying_rounds += 1;
                        replayed += replayed_batches;
                    } else if extra {
                        streaming_at = (streaming_at * 1.1).min(0.95);
                    }
                }
                if mode == "restart" {
                    assert_eq!(how, "restarted", "restart mode rebuilt: {recovery}");
                }
                *recovered.entry((mode, how, phase(fraction))).or_default() += 1;
            }
            None => {
                finished_first += 1;
                if extra {
                    streaming_at *= 0.8;
                }
            }
        }
        rejoin(&mut cluster, victim).await;
        round += 1;
    }
    println!(
        "query chaos: {round} rounds, every answer exact; recovered by mode and phase: {recovered:?}; {finished_first} finished before the kill was noticed; {replaying_rounds} rebuilt round(s) replayed {replayed} logged batch(es)"
    );
    assert!(
        !recovered.is_empty(),
        "no round recovered from a failure: the kills all came too late"
    );
    let lineage_rounds: usize = recovered
        .iter()
        .filter(|((mode, _, _), _)| *mode == "lineage")
        .map(|(_, n)| n)
        .sum();
    let rebuilt: usize = recovered
        .iter()
        .filter(|((_, how, _), _)| *how == "rebuilt from lineage")
        .map(|(_, n)| n)
        .sum();
    // A fallback to restart is allowed (a rebuilt channel that could not reproduce its
    // output), but lineage recovery must actually work.
    assert!(
        lineage_rounds == 0 || rebuilt > 0,
        "{lineage_rounds} lineage round(s) recovered, none by rebuilding from lineage"
    );
    // Rebuilding must replay logged input in its logged order, not only rerun scans.
    assert!(
        !lineage_tested || replaying_rounds > 0,
        "no rebuilt round replayed a logged input batch in {round} rounds"
    );
}

/// A dead node's scan re-run on a replica that holds the same rows laid out otherwise
/// sends the same batches again, so its recovery is a rebuild, never a restart. Hot
/// standbys apply and flush on their own, and each node here flushes (and then merges) at
/// its own threshold: every 1, 8 or 48 MiB, or never (node 4). After the load, a
/// partition's rows are laid out differently on each of its replicas: many small merged
/// components, a few larger ones, or memory. Kills of the streaming join's scans mid-way
/// must then rebuild a scan channel whole, its surviving consumers checking every batch it
/// sends again against what they had.
///
/// Then the same `AS OF` the load's epoch, after an update of half of lineitem that node 1
/// merged (each partition into its current versions and a history of the ones they
/// supersede) and node 4 holds in memory: the read at the older epoch finds some rows among
/// node 1's current versions and some in its history, and must still send node 4's
/// batches again (it failed with a restart, "re-sent batch 0 different", before scans at
/// an older epoch came in key order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_rerun_on_a_replica_laid_out_otherwise_sends_the_same_batches() {
    short_panics();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(
        Path::new(BINARY),
        root.path(),
        NODES,
        PARTITIONS,
        REPLICATION,
    );
    cluster.set_option("replicas.hot_standby", "true");
    cluster.set_option("store.idle_checkpoint_ms", "0");
    cluster.set_option("store.checkpoint_log_bytes", "1073741824");
    cluster.set_option("store.merge_threshold", "2");
    for (id, flush_bytes) in [(1, 1 << 20), (2, 8 << 20), (3, 48 << 20), (4, 1 << 30)] {
        cluster.set_node_option(id, "store.memtable_flush_bytes", &flush_bytes.to_string());
    }
    cluster.start_all();
    wait_formed(&cluster, 1, NODES).await;
    load_tpch(&cluster, SCALE).await;
    let oracle = tessera_tpch::oracle::oracle(SCALE).unwrap();
    let expected = oracle
        .sql(STREAMING_JOIN)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let client = ClusterClient::new(cluster.addr(1));
    let rebuilt = kill_until_a_scan_is_rebuilt_whole(&mut cluster, STREAMING_JOIN, &expected).await;
    println!("rebuilt whole, its batches sent again and checked: {rebuilt}");

    let loaded = client
        .query("SELECT max(epoch) FROM tessera_epochs")
        .await
        .unwrap();
    let loaded = loaded[0]
        .column(0)
        .as_primitive::<arrow::datatypes::Int64Type>()
        .value(0);
    client
        .sql("UPDATE lineitem SET l_quantity = l_quantity WHERE l_orderkey % 2 = 0")
        .await
        .unwrap();
    client.settle().await.unwrap();
    let as_of = STREAMING_JOIN
        .replace(
            "FROM lineitem",
            &format!("FROM lineitem AS OF EPOCH {loaded}"),
        )
        .replace(
            "JOIN partsupp",
            &format!("JOIN partsupp AS OF EPOCH {loaded}"),
        );
    let rebuilt = kill_until_a_scan_is_rebuilt_whole(&mut cluster, &as_of, &expected).await;
    println!("AS OF epoch {loaded}: rebuilt whole, its batches sent again and checked: {rebuilt}");
}

/// Runs `sql` from node 1, killing node 4 early in it, until a kill catches one of its
/// scan channels sending and the recovery rebuilds that channel whole on node 1, whose
/// layout differs from node 4's. Every answer must equal `expected`, and no recovery may
/// restart the query. Returns the rebuilt channel's placement.
async fn kill_until_a_scan_is_rebuilt_whole(
    cluster: &mut LocalCluster,
    sql: &str,
    expected: &[RecordBatch],
) -> String {
    let initiator = 1;
    let client = ClusterClient::new(cluster.addr(initiator));
    client.query(sql).await.unwrap();
    let started = Instant::now();
    client.query(sql).await.unwrap();
    let no_failure = started.elapsed();
    // Node 4 holds its rows in memory; its scan channel's first surviving replica is node
    // 1, whose merged components hold them in another layout.
    let (victim, host) = (4, 1);
    let mut rebuilt_whole = None;
    for attempt in 0..34u64 {
        // A scan channel is rebuilt whole (not split) only once it has begun to send, and
        // its batches are checked only where they had arrived: from early (a scan of the
        // current rows sends at once) to late (one at an older epoch resolves and sorts a
        // whole partition first).
        let at = 0.1 + 0.05 * (attempt % 17) as f64;
        let lineage = format!("/*+ SET tessera.recovery = lineage */ {sql}");
        client.query(sql).await.unwrap();
        let query = {
            let client = ClusterClient::new(cluster.addr(initiator));
            tokio::spawn(async move { client.query_with_notices(&lineage).await })
        };
        tokio::time::sleep(no_failure.mul_f64(at)).await;
        cluster.kill9(victim);
        let (actual, notices) = query
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("attempt {attempt}: node {victim} killed at {at:.2}: {e}"));
        rejoin(cluster, victim).await;
        if let Err(diff) = tessera_tpch::compare::same_answer(expected, &actual, 1e-9) {
            panic!("attempt {attempt}: node {victim} killed: wrong answer: {diff}");
        }
        let recovery = notices.iter().find_map(|n| n.recovery.as_ref());
        println!("attempt {attempt}: node {victim} killed at {at:.2}: {recovery:?}");
        match recovery {
            Some(RecoveryOutcome::Restarted { .. }) => {
                panic!(
                    "attempt {attempt}: restarted instead of rebuilt: {}",
                    recovery.unwrap()
                )
            }
            // Its consumer on the dead node had taken logged input (replayed now): the
            // scan channel had sent batches, to the surviving consumers too.
            Some(RecoveryOutcome::Rebuilt {
                placed,
                replayed_batches,
                ..
            }) if *replayed_batches > 0 => {
                rebuilt_whole = placed
                    .iter()
                    .find(|p| p.starts_with("stage 1 channel(s)"))
                    .cloned();
            }
            _ => {}
        }
        if rebuilt_whole.is_some() {
            break;
        }
    }
    let rebuilt_whole = rebuilt_whole.expect("no kill caught a scan channel sending");
    assert!(
        rebuilt_whole.ends_with(&format!("on node {host}")),
        "rebuilt on the replica laid out otherwise: {rebuilt_whole}"
    );
    rebuilt_whole
}
