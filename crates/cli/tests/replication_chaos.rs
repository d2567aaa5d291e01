//! Randomized SIGKILL chaos for replication (DESIGN §6): publishers keep publishing through
//! random coordinators while nodes are killed and restarted at random, up to r − 1 = 2 at
//! once. Afterwards every replica of every partition holds exactly the same rows, every
//! acknowledged publish is present, every publish refused as aborted is absent, and every
//! publish whose outcome the client could not learn (its coordinator died) is all or
//! nothing.
//!
//! The default run is short (CI). `TESSERA_CHAOS_SECONDS=600 cargo test --test
//! replication_chaos -- --nocapture` runs the long version and prints its counts.

use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

mod common;
use common::history::{self, Outcome, Publish};
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
    let acknowledged = history::AcknowledgedEpochs::default();
    let addrs = cluster.addrs();
    let publishers = history::spawn_publishers(
        &TABLES.map(|table| (table, history::Through::AnyNode)),
        ROWS_PER_PUBLISH,
        &addrs,
        &stop,
        seed,
        &acknowledged,
    );

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
    let status = history::wait_recovered(&cluster, 1, &publishes, Duration::from_secs(120)).await;
    let report = history::check_replicas(&cluster, &status, &TABLES, &publishes).await;
    let count = |outcome| report.by_outcome.get(&outcome).copied().unwrap_or(0);
    assert!(
        count(Outcome::Acknowledged) > 0,
        "no publish succeeded during the chaos run"
    );
    println!(
        "chaos: {:?}, {kills} kills, {restarts} restarts, {} publishes: {} acknowledged, {} aborted, {} in doubt ({} of them committed), visible epoch {}",
        chaos_duration(),
        publishes.len(),
        count(Outcome::Acknowledged),
        count(Outcome::Aborted),
        count(Outcome::InDoubt),
        report.in_doubt_committed,
        status.meta.visible,
    );
}
