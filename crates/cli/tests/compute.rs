//! Compute-only nodes (`role = "compute"`) on a real cluster: 4 storage nodes (r = 3) and
//! 2 compute nodes, each its own process.
//! - The compute nodes join as metadata learners and are given no partition, also after a
//!   rebalance; a map placing one there is refused.
//! - All 22 TPC-H queries answer exactly as plain DataFusion on the same data, asked of a
//!   storage node and of a compute node, which plans with statistics it asks of a storage
//!   node (it holds none of its own) and so plans as a storage node does.
//! - The channels that read no partition run on the compute nodes: EXPLAIN places them
//!   there and EXPLAIN ANALYZE shows them producing rows.
//! - A compute node SIGKILLed in the middle of a query: the answer is still exact, and the
//!   recovery names it.

mod common;

use common::{flush_everywhere, load_tpch, wait_formed, wait_until};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::{ClusterClient, NodeId};
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const STORAGE: usize = 4;
const SCALE: f64 = 0.01;

/// A join of lineitem with itself on a column that is not its partition key, grouped by
/// that column: both sides are hashed, so the join and the aggregation run in channels
/// that read no partition (on the compute nodes), and long enough to kill one mid-way.
const HEAVY_JOIN: &str = "SELECT a.l_suppkey, count(*) AS pairs, sum(b.l_quantity) AS quantity \
     FROM lineitem a JOIN lineitem b ON a.l_suppkey = b.l_suppkey \
     GROUP BY a.l_suppkey ORDER BY a.l_suppkey";

fn pretty(batches: &[arrow::array::RecordBatch]) -> String {
    arrow::util::pretty::pretty_format_batches(batches)
        .unwrap()
        .to_string()
}

/// The nodes `EXPLAIN ANALYZE`'s channel lines say produced rows.
fn nodes_that_produced(explained: &str) -> BTreeSet<u64> {
    explained
        .lines()
        .filter_map(|line| {
            let at = line.find("channel ")?;
            let rest = &line[at..];
            let node: u64 = rest
                .split("on node ")
                .nth(1)?
                .split(':')
                .next()?
                .parse()
                .ok()?;
            let rows: u64 = rest
                .split("rows=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            (rows > 0).then_some(node)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_nodes_hold_nothing_run_channels_and_survive_being_killed() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), STORAGE, 16, 3);
    let compute = [cluster.add_compute_node(), cluster.add_compute_node()];
    let all = STORAGE + compute.len();
    cluster.start_all();
    for id in cluster.node_ids() {
        wait_formed(&cluster, id, all).await;
    }
    let storage_node = ClusterClient::new(cluster.addr(1));
    let compute_node = ClusterClient::new(cluster.addr(compute[0]));

    // Every node coordinates one of the loads, the compute nodes too.
    load_tpch(&cluster, SCALE).await;
    flush_everywhere(&cluster).await;
    // Statistics are each holder's view: let the standbys take their primaries' components
    // (no rows left only in their logs), so the views stop changing under the plans below.
    for id in 1..=STORAGE as u64 {
        let node = ClusterClient::new(cluster.addr(id));
        wait_until(
            &format!("node {id}'s standby rows shipped"),
            Duration::from_secs(60),
            || async {
                let status = node.status().await.ok()?;
                status
                    .tables
                    .iter()
                    .all(|t| t.logged_rows == 0)
                    .then_some(())
            },
        )
        .await;
    }

    // The metadata knows them as compute nodes, gives them nothing, and refuses a map
    // that would.
    let state = storage_node.current_metadata().await.unwrap();
    for id in compute {
        let node = &state.nodes[&NodeId(id)];
        assert!(node.compute && node.alive, "node {id}: {node:?}");
        assert!(
            state
                .map
                .partitions
                .iter()
                .all(|p| !p.replicas.contains(&NodeId(id))),
            "compute node {id} holds a partition: {:?}",
            state.map
        );
    }
    assert!(
        state
            .map
            .partitions
            .iter()
            .all(|p| p.replicas.iter().all(|r| r.0 <= STORAGE as u64)),
        "{:?}",
        state.map
    );

    // All 22 queries, asked of a storage node and of a compute node.
    let oracle = tessera_tpch::oracle::oracle(SCALE).unwrap();
    for q in 1..=22 {
        let sql = tessera_tpch::query(q);
        let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
        for (asked, client) in [("node 1", &storage_node), ("compute node", &compute_node)] {
            let actual = client
                .query(sql)
                .await
                .unwrap_or_else(|e| panic!("Q{q} through {asked}: {e}"));
            if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
                panic!("Q{q} through {asked}: wrong answer: {diff}");
            }
        }
    }

    // A compute node holds no statistics of its own: it plans with a holder's, as a storage
    // node does (without them it hashed every join of Q9 instead of broadcasting the
    // small tables).
    let plan_of = |text: String| -> (String, bool) {
        let stages = text
            .lines()
            .find_map(|l| l.split("Distributed plan: ").nth(1))
            .and_then(|rest| rest.split(',').next())
            .unwrap_or_default()
            .to_string();
        (stages, text.contains("broadcast"))
    };
    let explain_q9 = format!("EXPLAIN {}", tessera_tpch::query(9));
    let from_storage = plan_of(pretty(&storage_node.query(&explain_q9).await.unwrap()));
    let from_compute = plan_of(pretty(&compute_node.query(&explain_q9).await.unwrap()));
    assert!(
        from_storage.1,
        "node 1 broadcasts Q9's small tables: {from_storage:?}"
    );
    assert_eq!(
        from_compute, from_storage,
        "a compute node plans Q9 as a storage node does"
    );

    // The join's and aggregation's channels are placed on the compute nodes, and run there.
    let explained = pretty(
        &storage_node
            .query(&format!("EXPLAIN {HEAVY_JOIN}"))
            .await
            .unwrap(),
    );
    for id in compute {
        assert!(
            explained.contains(&format!("node {id}: ")),
            "EXPLAIN places no channel on compute node {id}:\n{explained}"
        );
    }
    let analyzed = pretty(
        &storage_node
            .query(&format!("EXPLAIN ANALYZE {HEAVY_JOIN}"))
            .await
            .unwrap(),
    );
    let producers = nodes_that_produced(&analyzed);
    for id in compute {
        assert!(
            producers.contains(&id),
            "no channel on compute node {id} produced rows ({producers:?}):\n{analyzed}"
        );
    }

    // With tessera.scans_on_compute, the scans move to the compute nodes too, reading the
    // partitions from their replicas: every stage but the answer's runs there.
    let on_compute = "/*+ SET tessera.scans_on_compute = true */ ";
    let explained = pretty(
        &storage_node
            .query(&format!("{on_compute}EXPLAIN {}", tessera_tpch::query(3)))
            .await
            .unwrap(),
    );
    let stages: Vec<&str> = explained
        .lines()
        .filter(|l| l.contains("Stage ") && l.contains("channel(s)") && !l.contains("Stage 0:"))
        .collect();
    assert!(!stages.is_empty(), "{explained}");
    for stage in &stages {
        assert!(
            (1..=STORAGE).all(|id| !stage.contains(&format!("node {id}: "))),
            "a stage runs on a storage node under scans_on_compute: {stage}\n{explained}"
        );
    }
    let scans_on_compute = [1, 3, 9, 18];
    let mut scan_answers = std::collections::BTreeMap::new();
    for q in scans_on_compute {
        let sql = tessera_tpch::query(q);
        scan_answers.insert(q, oracle.sql(sql).await.unwrap().collect().await.unwrap());
    }
    let run_on_compute = |round: &'static str| {
        let (client, answers) = (&storage_node, &scan_answers);
        async move {
            for (q, expected) in answers {
                let actual = client
                    .query(&format!("{on_compute}{}", tessera_tpch::query(*q)))
                    .await
                    .unwrap_or_else(|e| panic!("Q{q} with scans on compute ({round}): {e}"));
                if let Err(diff) = tessera_tpch::compare::same_answer(expected, &actual, 1e-9) {
                    panic!("Q{q} with scans on compute ({round}): wrong answer: {diff}");
                }
            }
        }
    };
    run_on_compute("cache filling").await;

    // Those scans read components through each compute node's cache: filled the first
    // time, read from it the second, nothing fetched again.
    let cache_of = |id: u64| {
        let client = ClusterClient::new(cluster.addr(id));
        async move {
            let status = client.status().await.unwrap();
            status
                .cache
                .unwrap_or_else(|| panic!("compute node {id} has no cache"))
        }
    };
    let mut filled = Vec::new();
    for id in compute {
        let cache = cache_of(id).await;
        assert!(
            cache.files > 0 && cache.miss_bytes > 0,
            "compute node {id}'s cache was not filled: {cache:?}"
        );
        filled.push(cache);
    }
    // A storage node's cache is for archived epochs only: its scans read its own replicas.
    let storage_cache = ClusterClient::new(cluster.addr(1))
        .status()
        .await
        .unwrap()
        .cache
        .expect("every node has a component cache");
    assert!(
        storage_cache.files == 0 && storage_cache.miss_bytes == 0,
        "a storage node fetched components into its cache: {storage_cache:?}"
    );
    run_on_compute("from the cache").await;
    for (id, before) in compute.into_iter().zip(&filled) {
        let after = cache_of(id).await;
        assert_eq!(
            after.miss_bytes, before.miss_bytes,
            "node {id} fetched again: {after:?}"
        );
        assert!(
            after.hit_bytes > before.hit_bytes,
            "node {id} read nothing from its cache: {after:?}"
        );
    }

    // A cached file damaged while its node was down is found when it is read next, and
    // fetched again; the answers stay exact.
    let cache_dir = root
        .path()
        .join(format!("node-{}", compute[0]))
        .join("data/cache");
    let cached_files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&cache_dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .collect()
    };
    let victim = cached_files()
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("a cached component");
    cluster.kill9(compute[0]);
    let mut bytes = std::fs::read(&victim).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&victim, bytes).unwrap();
    cluster.start(compute[0]);
    for id in cluster.node_ids() {
        wait_formed(&cluster, id, all).await;
    }
    run_on_compute("after a cached file was damaged").await;
    let name = victim.file_stem().unwrap().to_string_lossy().to_string();
    let now = std::fs::read(&victim).expect("the damaged file is fetched again");
    assert_eq!(
        tessera_common::ComponentHash::of_bytes(&now).to_hex(),
        name,
        "the cached file hashes to its name again"
    );

    // A compute node killed in the middle of the join: the exact answer, with the recovery
    // naming it. A kill that lands after the answer is retried.
    let expected = oracle
        .sql(HEAVY_JOIN)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let started = Instant::now();
    let answer = storage_node.query(HEAVY_JOIN).await.unwrap();
    let no_failure = started.elapsed();
    tessera_tpch::compare::same_answer(&expected, &answer, 1e-9).unwrap();
    let mut recovered = None;
    for attempt in 0..6u32 {
        let victim = compute[attempt as usize % compute.len()];
        let client = ClusterClient::new(cluster.addr(1));
        let query = tokio::spawn(async move { client.query_with_notices(HEAVY_JOIN).await });
        tokio::time::sleep(no_failure.mul_f64(0.3 + 0.1 * attempt as f64)).await;
        cluster.kill9(victim);
        let (actual, notices) = query.await.unwrap().unwrap_or_else(|e| {
            panic!("the join with compute node {victim} killed (attempt {attempt}): {e}")
        });
        if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
            panic!("compute node {victim} killed (attempt {attempt}): wrong answer: {diff}");
        }
        cluster.start(victim);
        for id in cluster.node_ids() {
            wait_formed(&cluster, id, all).await;
        }
        if let Some(recovery) = notices.iter().find_map(|n| n.recovery.clone()) {
            assert_eq!(
                recovery.dead(),
                Some(NodeId(victim)),
                "the recovery names the dead node"
            );
            recovered = Some(recovery);
            break;
        }
    }
    let recovery = recovered.expect("no kill of a compute node landed mid-query in 6 tries");
    println!("compute node killed mid-query: {recovery}");

    // Back, the compute node still holds nothing, and takes channels again.
    let state = wait_until(
        "the returning compute node to be live",
        Duration::from_secs(30),
        || async {
            let state = storage_node.current_metadata().await.ok()?;
            compute
                .iter()
                .all(|id| state.nodes[&NodeId(*id)].alive)
                .then_some(state)
        },
    )
    .await;
    assert!(state
        .map
        .partitions
        .iter()
        .all(|p| p.replicas.iter().all(|r| r.0 <= STORAGE as u64)));
    let again = storage_node.query(HEAVY_JOIN).await.unwrap();
    tessera_tpch::compare::same_answer(&expected, &again, 1e-9).unwrap();
}
