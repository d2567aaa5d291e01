//! Randomized SIGKILL chaos for replication (DESIGN §6): publishers keep publishing through
//! random coordinators while nodes are killed and restarted at random, up to r − 1 = 2 at
//! once. Afterwards every replica of every partition holds exactly the same rows, every
//! acknowledged publish is present, every publish refused as aborted is absent, and every
//! publish whose outcome the client could not learn (its coordinator died) is all or
//! nothing.
//!
//! The default run is short (CI). `TESSERA_CHAOS_SECONDS=600 cargo test --test
//! replication_chaos -- --nocapture` runs the long version and prints its counts.

use arrow::array::{Int64Array, RecordBatch};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_common::PartitionId;
use tessera_server::{ClusterClient, ClusterError};
use tessera_testkit::{kv_batch, LocalCluster};

mod common;
use common::wait_until;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const NODES: u64 = 5;
const PARTITIONS: u32 = 16;
const REPLICATION: u32 = 3;
const ROWS_PER_PUBLISH: i64 = 500;
const TABLES: [&str; 2] = ["kv_a", "kv_b"];

fn chaos_duration() -> Duration {
    let seconds = std::env::var("TESSERA_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    Duration::from_secs(seconds)
}

/// What the client learnt about one publish.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    /// Acknowledged: committed, must be everywhere.
    Acknowledged,
    /// Refused as aborted by a live coordinator: must be nowhere.
    Aborted,
    /// The reply never came (coordinator or connection died): all of it or none of it.
    InDoubt,
}

#[derive(Debug, Clone)]
struct Publish {
    table: &'static str,
    keys: std::ops::Range<i64>,
    outcome: Outcome,
    /// The epoch an acknowledged publish became (to find it in the nodes' logs).
    epoch: Option<tessera_common::Epoch>,
}

fn classify(result: &Result<tessera_common::Epoch, ClusterError>) -> Outcome {
    match result {
        Ok(_) => Outcome::Acknowledged,
        // The coordinator said so itself after aborting the epoch in the metadata.
        Err(ClusterError::PublishAborted { .. }) => Outcome::Aborted,
        Err(_) => Outcome::InDoubt,
    }
}

/// Publishes batches of fresh keys into `table` through random nodes until `stop`.
async fn publisher(
    table: &'static str,
    first_key: i64,
    addrs: Vec<String>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> Vec<Publish> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut log = Vec::new();
    let mut next = first_key;
    while !stop.load(Ordering::Relaxed) {
        let coordinator = &addrs[rng.random_range(0..addrs.len())];
        let keys = next..next + ROWS_PER_PUBLISH;
        next += ROWS_PER_PUBLISH;
        let client = ClusterClient::new(coordinator);
        let result = tokio::time::timeout(
            Duration::from_secs(60),
            client.publish(table, vec![kv_batch(keys.start, keys.end)], false),
        )
        .await
        .ok();
        // A publish the client gave up waiting on is in doubt, like a lost reply.
        let outcome = result.as_ref().map_or(Outcome::InDoubt, classify);
        if outcome != Outcome::Acknowledged {
            // Give a dead coordinator's failure time to be noticed.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        log.push(Publish {
            table,
            keys,
            outcome,
            epoch: result.and_then(Result::ok),
        });
    }
    log
}

fn keys_of(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    let mut rows = Vec::new();
    for batch in batches {
        let k = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let v = batch
            .column(1)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        rows.extend(k.values().iter().copied().zip(v.values().iter().copied()));
    }
    rows.sort_unstable();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_epochs_survive_random_kills() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(
        Path::new(BINARY),
        root.path(),
        NODES as usize,
        PARTITIONS,
        REPLICATION,
    );
    // Five voters, so the metadata keeps a majority with two nodes down.
    cluster.set_voters(&(1..=NODES).collect::<Vec<_>>());
    cluster.start_all();
    let admin = ClusterClient::new(cluster.addr(1));
    wait_until("the cluster to form", Duration::from_secs(60), || async {
        let status = admin.status().await.ok()?;
        (status.leader.is_some() && status.meta.live_nodes().count() == NODES as usize)
            .then_some(())
    })
    .await;
    for table in TABLES {
        admin
            .sql(&format!(
                "CREATE TABLE {table} (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)"
            ))
            .await
            .unwrap();
    }

    let seed: u64 = std::env::var("TESSERA_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("chaos seed {seed} (TESSERA_CHAOS_SEED reruns it)");
    let stop = Arc::new(AtomicBool::new(false));
    let addrs: Vec<String> = cluster
        .node_ids()
        .iter()
        .map(|id| cluster.addr(*id).to_string())
        .collect();
    let publishers: Vec<_> = TABLES
        .iter()
        .enumerate()
        .map(|(i, table)| {
            tokio::spawn(publisher(
                table,
                i as i64 * 1_000_000_000,
                addrs.clone(),
                stop.clone(),
                seed + i as u64,
            ))
        })
        .collect();

    // The killer: at most REPLICATION - 1 nodes down at once.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut down: BTreeSet<u64> = BTreeSet::new();
    let (mut kills, mut restarts) = (0, 0);
    let deadline = Instant::now() + chaos_duration();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2500))).await;
        let kill =
            down.is_empty() || (down.len() < REPLICATION as usize - 1 && rng.random_bool(0.5));
        if kill {
            let up: Vec<u64> = (1..=NODES).filter(|id| !down.contains(id)).collect();
            let victim = up[rng.random_range(0..up.len())];
            cluster.kill9(victim);
            down.insert(victim);
            kills += 1;
        } else {
            let back = *down.iter().nth(rng.random_range(0..down.len())).unwrap();
            cluster.start(back);
            down.remove(&back);
            restarts += 1;
        }
    }
    for id in std::mem::take(&mut down) {
        cluster.start(id);
        restarts += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let mut publishes: Vec<Publish> = Vec::new();
    for publisher in publishers {
        publishes.extend(publisher.await.unwrap());
    }

    // Every node back, every stale replica refreshed, no epoch left open, and the view
    // read from has applied every acknowledged epoch: `status` is the asked node's own
    // view, which lags the leader's while it catches up (it was perhaps just restarted),
    // and reading at an epoch from before the last acknowledgement would miss its rows.
    let last_acknowledged = publishes
        .iter()
        .filter_map(|p| p.epoch)
        .max()
        .unwrap_or_default();
    let status = wait_until(
        "the cluster to recover",
        Duration::from_secs(120),
        || async {
            let status = admin.status().await.ok()?;
            let recovered = status.leader.is_some()
                && status.meta.visible >= last_acknowledged
                && status.meta.live_nodes().count() == NODES as usize
                && status.meta.open.is_empty()
                && status
                    .meta
                    .map
                    .partitions
                    .iter()
                    .all(|p| p.stale.is_empty());
            recovered.then_some(status)
        },
    )
    .await;
    let epoch = status.meta.visible;

    // Every replica of every partition holds the same rows.
    let mut visible: BTreeMap<&str, BTreeSet<i64>> = BTreeMap::new();
    for table in TABLES {
        for (p, placement) in status.meta.map.partitions.iter().enumerate() {
            let mut first: Option<(tessera_server::NodeId, Vec<(i64, i64)>)> = None;
            for &replica in &placement.replicas {
                let client = ClusterClient::new(cluster.addr(replica.0));
                let rows = keys_of(
                    &client
                        .read_replica(cluster.cluster_id(), table, PartitionId(p as u32), epoch)
                        .await
                        .unwrap_or_else(|e| {
                            panic!("reading p{p} of {table} on node {replica}: {e}")
                        }),
                );
                assert!(
                    rows.iter().all(|(k, v)| *v == k * 10),
                    "{table} p{p} on node {replica} holds a wrong value"
                );
                match &first {
                    None => first = Some((replica, rows)),
                    Some((other, expected)) => assert!(
                        *expected == rows,
                        "{table} p{p}: node {replica} holds {} rows, node {other} holds {}",
                        rows.len(),
                        expected.len()
                    ),
                }
            }
            let (_, rows) = first.expect("every partition has a replica");
            let keys = visible.entry(table).or_default();
            for (k, _) in rows {
                assert!(keys.insert(k), "{table}: key {k} in two partitions");
            }
        }
    }

    let count = |outcome| publishes.iter().filter(|p| p.outcome == outcome).count();
    let mut in_doubt_committed = 0;
    let mut expected_rows: BTreeMap<&str, usize> = BTreeMap::new();
    for publish in &publishes {
        let keys = &visible[publish.table];
        let present = publish.keys.clone().filter(|k| keys.contains(k)).count() as i64;
        let all = publish.keys.end - publish.keys.start;
        match publish.outcome {
            Outcome::Acknowledged => assert_eq!(
                present,
                all,
                "acknowledged publish {publish:?} lost {} rows",
                all - present
            ),
            Outcome::Aborted => assert_eq!(present, 0, "aborted publish {publish:?} is visible"),
            Outcome::InDoubt => {
                assert!(
                    present == 0 || present == all,
                    "publish {publish:?} is partly visible ({present} of {all} rows)"
                );
                in_doubt_committed += usize::from(present == all);
            }
        }
        if present == all {
            *expected_rows.entry(publish.table).or_default() += all as usize;
        }
    }
    for table in TABLES {
        assert_eq!(
            visible[table].len(),
            expected_rows.get(table).copied().unwrap_or(0),
            "{table} holds rows no publish wrote"
        );
    }
    assert!(
        count(Outcome::Acknowledged) > 0,
        "no publish succeeded during the chaos run"
    );
    println!(
        "chaos: {:?}, {kills} kills, {restarts} restarts, {} publishes: {} acknowledged, {} aborted, {} in doubt ({in_doubt_committed} of them committed), visible epoch {epoch}",
        chaos_duration(),
        publishes.len(),
        count(Outcome::Acknowledged),
        count(Outcome::Aborted),
        count(Outcome::InDoubt),
    );
}
