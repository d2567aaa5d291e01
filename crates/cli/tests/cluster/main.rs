//! Multi-process clusters on loopback: real `tessera node` processes, real Raft, real
//! SIGKILL. Every node must answer every TPC-H query exactly as plain DataFusion does.
//!
//! Its tests share one cluster harness and one lock that keeps them from running their
//! clusters at once on a 2-core machine; those about where replicas live are in
//! `replicas.rs`.

use arrow::array::{Int64Array, RecordBatch};
use datafusion::prelude::SessionContext;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::{ClusterClient, NodeId};
use tessera_testkit::{kv_batch, LocalCluster};

#[path = "../common/mod.rs"]
mod common;
/// Where replicas live as the cluster changes: joins, losses, failover and failback,
/// standbys, and `tessera up`.
mod replicas;
use common::{flush_everywhere, load_tpch, load_tpch_tables, plan_text, wait_formed, wait_until};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// Clusters run one at a time: several at once would starve each other of the CPU and
/// make the timing checks (failure detection within 2 s) meaningless.
static ONE_CLUSTER_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    ONE_CLUSTER_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
const PARTITIONS: u32 = 16;

async fn leader_of(cluster: &LocalCluster, via: u64) -> u64 {
    let client = ClusterClient::new(cluster.addr(via));
    wait_until("a leader", Duration::from_secs(30), || async {
        client.status().await.ok()?.leader.map(|id| id.0)
    })
    .await
}

async fn assert_tpch_answers(cluster: &LocalCluster, nodes: &[u64], oracle: &SessionContext) {
    let mut failures = Vec::new();
    for q in 1..=22 {
        let sql = tessera_tpch::query(q);
        let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
        for &id in nodes {
            let client = ClusterClient::new(cluster.addr(id));
            let actual = client
                .query(sql)
                .await
                .unwrap_or_else(|e| panic!("Q{q} failed on node {id}: {e}"));
            if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
                failures.push(format!("Q{q} on node {id}: {diff}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "answers differ:\n{}",
        failures.join("\n")
    );
}

async fn tpch_cluster(nodes: usize) {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), nodes, PARTITIONS, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, nodes).await;
    load_tpch(&cluster, 0.1).await;
    let oracle = tessera_tpch::oracle::oracle(0.1).unwrap();
    assert_tpch_answers(&cluster, &cluster.node_ids(), &oracle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_answer_all_tpch_queries_exactly() {
    let _exclusive = exclusive();
    tpch_cluster(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_answer_all_tpch_queries_exactly() {
    let _exclusive = exclusive();
    tpch_cluster(5).await;
}

/// The text an EXPLAIN statement returns in the row of `plan_type`.
/// One stage of an `EXPLAIN ANALYZE` as its text says.
#[derive(Debug, Default)]
struct AnalyzedStage {
    id: usize,
    /// The stage's own line: channels per node, where its output goes.
    header: String,
    /// The stage its output goes to (none for stage 0).
    consumer: Option<usize>,
    first_input_ms: Option<f64>,
    finished_ms: f64,
    channel_rows: Vec<u64>,
    channel_batches: Vec<u64>,
    /// Per channel, the storage partitions its scans read (by any reader, here or on
    /// another node) and their component files.
    channel_partitions_read: Vec<u64>,
    channel_files_read: Vec<u64>,
    bytes_sent: u64,
    fragment: String,
}

/// Reads `key=value` from a line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(&format!("{key}=")))
        .map(|v| v.trim_end_matches([';', ',']))
}

fn parse_analyzed(text: &str) -> Vec<AnalyzedStage> {
    let mut stages: Vec<AnalyzedStage> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Stage ") {
            let id = rest.split(':').next().unwrap().parse().unwrap();
            let consumer = rest
                .split(" of stage ")
                .nth(1)
                .map(|s| s.split_whitespace().next().unwrap().parse().unwrap());
            // EXPLAIN has no metrics; EXPLAIN ANALYZE has them on every stage line.
            stages.push(AnalyzedStage {
                id,
                header: line.to_string(),
                consumer,
                first_input_ms: field(line, "first_input_ms").and_then(|v| v.parse().ok()),
                finished_ms: field(line, "finished_ms").map_or(0.0, |v| v.parse().unwrap()),
                bytes_sent: field(line, "bytes_sent").map_or(0, |v| v.parse().unwrap()),
                ..Default::default()
            });
        } else if let Some(stage) = stages.last_mut() {
            if line.trim_start().starts_with("channel ") {
                stage
                    .channel_rows
                    .push(field(line, "rows").unwrap().parse().unwrap());
                stage
                    .channel_batches
                    .push(field(line, "batches").unwrap().parse().unwrap());
                let count = |key| field(line, key).map_or(0, |v| v.parse::<u64>().unwrap());
                stage.channel_partitions_read.push(
                    [
                        "read_parquet",
                        "read_decoded",
                        "read_versioned",
                        "read_remote",
                    ]
                    .into_iter()
                    .map(count)
                    .sum(),
                );
                stage.channel_files_read.push(count("read_files"));
            } else {
                stage.fragment.push_str(line);
                stage.fragment.push('\n');
            }
        }
    }
    stages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_run_as_pipelined_stages_placed_over_every_node() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let loaded = load_tpch_tables(&cluster, 0.1, &["orders", "lineitem"]).await;
    // Every partition in component files, so the scans' reads below count files.
    flush_everywhere(&cluster).await;
    let client = ClusterClient::new(cluster.addr(2));
    let sql = "SELECT o_orderpriority, count(*) AS n FROM lineitem JOIN orders \
               ON l_orderkey = o_orderkey GROUP BY o_orderpriority ORDER BY o_orderpriority";
    // Both sides cross the network, to show an exchange pipelined (co-located, the join
    // would run in the scan stage and send only partial aggregates: tests/colocate.rs).
    let apart = "/*+ SET tessera.colocate = false */";

    // EXPLAIN: stages, where each channel runs, what goes where.
    let explain = plan_text(
        &client,
        &format!("{apart} EXPLAIN {sql}"),
        "distributed_plan",
    )
    .await;
    assert!(
        explain.contains("Stage 0: 1 channel(s) [node 2: 0]; answer gathered on node 2"),
        "{explain}"
    );
    assert!(explain.contains("Hash exchange into"), "{explain}");
    assert!(
        explain.contains("DistributedScanExec: table=lineitem"),
        "{explain}"
    );
    let planned = parse_analyzed(&explain);
    let scan = planned
        .iter()
        .find(|s| s.fragment.contains("DistributedScanExec: table=lineitem"))
        .unwrap_or_else(|| panic!("no lineitem scan stage:\n{explain}"));
    for node in 1..=3 {
        assert!(
            scan.header.contains(&format!("node {node}: ")),
            "lineitem is scanned on every node that holds it: {}",
            scan.header
        );
    }

    // EXPLAIN ANALYZE: what every stage and channel did.
    let analyzed = plan_text(
        &client,
        &format!("{apart} EXPLAIN ANALYZE {sql}"),
        "Plan with Metrics",
    )
    .await;
    let stages = parse_analyzed(&analyzed);
    let top = stages.iter().find(|s| s.id == 0).unwrap();
    assert_eq!(
        top.channel_rows,
        vec![5],
        "five order priorities:\n{analyzed}"
    );
    let lineitem = stages
        .iter()
        .find(|s| s.fragment.contains("DistributedScanExec: table=lineitem"))
        .unwrap();
    assert!(
        lineitem.channel_rows.len() >= 3,
        "a channel report per channel:\n{analyzed}"
    );
    if !lineitem.fragment.contains("HashJoinExec") {
        assert_eq!(
            lineitem.channel_rows.iter().sum::<u64>(),
            loaded["lineitem"] as u64,
            "every lineitem row leaves its scan channel exactly once:\n{analyzed}"
        );
    }
    assert!(
        lineitem.bytes_sent > 0,
        "scan channels send to other nodes:\n{analyzed}"
    );
    // How the scans read: every storage partition of lineitem once, by one reader, from
    // at least one component file each (every replica flushed).
    assert_eq!(
        lineitem.channel_partitions_read.iter().sum::<u64>(),
        PARTITIONS as u64,
        "each storage partition is read once:\n{analyzed}"
    );
    assert!(
        lineitem.channel_files_read.iter().sum::<u64>() >= PARTITIONS as u64,
        "every partition read here is in component files:\n{analyzed}"
    );

    // Pipelining: the stage that consumes the lineitem scan received its first batch
    // before the scan stage had finished.
    let consumer = stages
        .iter()
        .find(|s| Some(s.id) == lineitem.consumer)
        .unwrap();
    let first_input = consumer
        .first_input_ms
        .expect("the consumer read an exchange");
    assert!(
        first_input < lineitem.finished_ms,
        "stage {} received its first batch at {first_input} ms, after stage {} finished at {} ms:\n{analyzed}",
        consumer.id,
        lineitem.id,
        lineitem.finished_ms
    );

    // The session's execution settings reach every channel, wherever it runs: told to give
    // up partial aggregation at once (which DataFusion reads as the aggregation runs), the
    // scan channels on every node send on about a row per row read, not one per group.
    let grouped = "SELECT l_linenumber, count(*) AS n FROM lineitem GROUP BY l_linenumber";
    let no_partials = "/*+ SET datafusion.execution.skip_partial_aggregation_probe_rows_threshold = 1, \
                       SET datafusion.execution.skip_partial_aggregation_probe_ratio_threshold = 0.0 */";
    let scan_rows_sent = |analyzed: String| {
        let stages = parse_analyzed(&analyzed);
        let scan = stages
            .into_iter()
            .find(|s| s.fragment.contains("DistributedScanExec: table=lineitem"))
            .unwrap_or_else(|| panic!("no lineitem scan stage:\n{analyzed}"));
        assert!(
            scan.fragment.contains("mode=Partial"),
            "the scan stage aggregates:\n{analyzed}"
        );
        (scan.channel_rows, scan.channel_batches, analyzed)
    };
    let (partials, _, analyzed) = scan_rows_sent(
        plan_text(
            &client,
            &format!("EXPLAIN ANALYZE {grouped}"),
            "Plan with Metrics",
        )
        .await,
    );
    assert!(
        partials.iter().sum::<u64>() < 1000,
        "partial aggregation sends a row per group:\n{analyzed}"
    );
    let (skipped, batches, analyzed) = scan_rows_sent(
        plan_text(
            &client,
            &format!("{no_partials} EXPLAIN ANALYZE {grouped}"),
            "Plan with Metrics",
        )
        .await,
    );
    assert!(
        skipped.len() >= 3 && skipped.iter().all(|&rows| rows > 1000),
        "every scan channel, on every node, skipped partial aggregation:\n{analyzed}"
    );
    // The session's batch size holds across the exchanges too. Without one, the scan
    // channels gather what they send into the node's batches (`exec.send_batch_rows`,
    // 8192 rows); with `batch_size = 1000`, no batch sent holds more than 1000 rows.
    assert!(
        batches.iter().sum::<u64>() * 1000 < skipped.iter().sum::<u64>(),
        "without a session batch size, the channels send the node's larger batches:\n{analyzed}"
    );
    let (small_rows, small_batches, analyzed) = scan_rows_sent(
        plan_text(
            &client,
            &format!(
                "/*+ SET datafusion.execution.batch_size = 1000, {} EXPLAIN ANALYZE {grouped}",
                no_partials.trim_start_matches("/*+ ")
            ),
            "Plan with Metrics",
        )
        .await,
    );
    for (rows, batches) in small_rows.iter().zip(&small_batches) {
        assert!(
            batches * 1000 >= *rows && *rows > 8192,
            "a channel sent {rows} rows in {batches} batches, more than 1000 rows a batch:\n{analyzed}"
        );
    }
    let free = client.query(grouped).await.unwrap();
    let held = client
        .query(&format!("{no_partials} {grouped}"))
        .await
        .unwrap();
    tessera_tpch::compare::same_answer(&free, &held, 0.0)
        .unwrap_or_else(|diff| panic!("without partial aggregation: {diff}"));

    // Every node initiates, and the answer is the same.
    let oracle = SessionContext::new();
    for table in ["orders", "lineitem"] {
        let t = tessera_tpch::table(table).unwrap();
        let batches: Vec<RecordBatch> = t
            .generate(0.1, 64 * 1024)
            .collect::<Result<_, _>>()
            .unwrap();
        let mem = datafusion::datasource::MemTable::try_new(t.schema(), vec![batches]).unwrap();
        oracle
            .register_table(table, std::sync::Arc::new(mem))
            .unwrap();
    }
    let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
    for id in cluster.node_ids() {
        let actual = ClusterClient::new(cluster.addr(id))
            .query(sql)
            .await
            .unwrap();
        tessera_tpch::compare::same_answer(&expected, &actual, 0.0)
            .unwrap_or_else(|diff| panic!("node {id}: {diff}"));
    }

    // A bad query is refused by name, and leaves nothing running.
    let error = client
        .query("SELECT no_such_column FROM lineitem")
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("no_such_column"), "{error}");
}

/// A running 3-node cluster (`replication` copies) with an empty `kv` table, and a client
/// of node 1.
async fn kv_cluster(root: &Path, replication: u32) -> (LocalCluster, ClusterClient) {
    kv_cluster_with(root, replication, &[]).await
}

/// A 3-node cluster with table `kv`, each node configured with `options` (key, value).
async fn kv_cluster_with(
    root: &Path,
    replication: u32,
    options: &[(&str, &str)],
) -> (LocalCluster, ClusterClient) {
    common::kv_cluster_with(BINARY, root, PARTITIONS, replication, options).await
}

async fn count_and_sum(client: &ClusterClient) -> (i64, i64) {
    let batches = client
        .query("SELECT count(*) AS n, coalesce(sum(v), 0) AS s FROM kv")
        .await
        .unwrap();
    let n = batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap()
        .value(0);
    let s = batches[0]
        .column(1)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap()
        .value(0);
    (n, s)
}

/// The storage partitions a query's scans read, and their component files, from the
/// channel lines of its `EXPLAIN ANALYZE`.
async fn partitions_and_files_read(client: &ClusterClient, sql: &str) -> (u64, u64) {
    let analyzed = plan_text(
        client,
        &format!("EXPLAIN ANALYZE {sql}"),
        "Plan with Metrics",
    )
    .await;
    let stages = parse_analyzed(&analyzed);
    let partitions = stages.iter().flat_map(|s| &s.channel_partitions_read).sum();
    let files = stages.iter().flat_map(|s| &s.channel_files_read).sum();
    (partitions, files)
}

/// A table loaded in two publishes of unequal size keeps two components per partition
/// (the merge rules wait for more); settling every node, as a bulk load ends, leaves one
/// per partition on every replica, and `EXPLAIN ANALYZE` shows each layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_a_loaded_table_leaves_one_component_per_partition() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster(root.path(), 3).await;
    for (from, to) in [(0, 20_000), (20_000, 20_500)] {
        client
            .publish("kv", vec![kv_batch(from, to)], false)
            .await
            .unwrap();
        flush_everywhere(&cluster).await;
    }
    let sql = "SELECT count(*) FROM kv";
    let (partitions, files) = partitions_and_files_read(&client, sql).await;
    assert_eq!(partitions, PARTITIONS as u64, "each partition read once");
    assert_eq!(
        files,
        2 * PARTITIONS as u64,
        "two publishes, two components each"
    );

    for id in cluster.node_ids() {
        ClusterClient::new(cluster.addr(id)).settle().await.unwrap();
    }
    // Standbys take their primaries' settled components in the background; a query may
    // read any replica, so every node is asked.
    for id in cluster.node_ids() {
        let on = ClusterClient::new(cluster.addr(id));
        let one_file_each = (PARTITIONS as u64, PARTITIONS as u64);
        let what = format!("node {id}'s scans to read one file per partition");
        wait_until(&what, Duration::from_secs(30), || async {
            (partitions_and_files_read(&on, sql).await == one_file_each).then_some(())
        })
        .await;
        assert_eq!(count_and_sum(&on).await.0, 20_500);
    }
}

/// `tessera load tpch` into a cluster ends settled: right after it, with no flush and no
/// idle checkpoint, every node's scans read each partition from one component file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tpch_load_from_the_cli_ends_with_one_component_per_partition() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    // No idle checkpoints: only the load's own settle can have flushed its rows.
    let (cluster, _) = kv_cluster_with(root.path(), 3, &[("store.idle_checkpoint_ms", "0")]).await;
    let loaded = std::process::Command::new(BINARY)
        .args(["--node", cluster.addr(1)])
        .args(["load", "tpch", "--sf", "0.01", "--tables", "orders"])
        .output()
        .unwrap();
    assert!(
        loaded.status.success(),
        "{}",
        String::from_utf8_lossy(&loaded.stderr)
    );
    let sql = "SELECT count(*) FROM orders";
    let one_file_each = (PARTITIONS as u64, PARTITIONS as u64);
    // Standbys take the settled components in the background; a query may read any
    // replica, so every node is asked.
    for id in cluster.node_ids() {
        let on = ClusterClient::new(cluster.addr(id));
        let what = format!("node {id}'s scans to read one file per partition");
        wait_until(&what, Duration::from_secs(20), || async {
            (partitions_and_files_read(&on, sql).await == one_file_each).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_loses_no_committed_epoch() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, _) = kv_cluster(root.path(), 3).await;
    let mut rows = 0;
    for (i, id) in [1u64, 2, 3, 1, 2].into_iter().enumerate() {
        let client = ClusterClient::new(cluster.addr(id));
        let from = i as i64 * 1000;
        client
            .publish("kv", vec![kv_batch(from, from + 1000)], false)
            .await
            .unwrap();
        rows += 1000;
    }
    let leader = leader_of(&cluster, 1).await;
    cluster.kill9(leader);
    let killed_at = Instant::now();
    let survivor = cluster
        .node_ids()
        .into_iter()
        .find(|id| *id != leader)
        .unwrap();
    let client = ClusterClient::new(cluster.addr(survivor));
    // A new leader takes over and the dead node is declared failed within 2 s.
    let new_leader = wait_until("a new leader", Duration::from_secs(10), || async {
        let status = client.status().await.ok()?;
        status.leader.filter(|l| *l != NodeId(leader))
    })
    .await;
    wait_until(
        "the dead node declared failed",
        Duration::from_secs(5),
        || async {
            let status = client.status().await.ok()?;
            (!status.meta.nodes[&NodeId(leader)].alive).then_some(())
        },
    )
    .await;
    let detected = killed_at.elapsed();
    assert!(
        detected < Duration::from_secs(2),
        "the dead leader was declared failed after {detected:?}"
    );
    assert_ne!(new_leader, NodeId(leader));
    assert_eq!(
        count_and_sum(&client).await.0,
        rows,
        "committed rows survive the leader"
    );
    // Publishes and queries go on without the old leader.
    client
        .publish("kv", vec![kv_batch(5000, 6000)], false)
        .await
        .unwrap();
    rows += 1000;
    let expected_sum: i64 = (0..rows).map(|k| k * 10).sum();
    for id in cluster.node_ids().into_iter().filter(|id| *id != leader) {
        let node = ClusterClient::new(cluster.addr(id));
        assert_eq!(
            count_and_sum(&node).await,
            (rows, expected_sum),
            "node {id}"
        );
    }
    // The old leader rejoins and answers exactly, reading what it missed from its peers.
    cluster.start(leader);
    wait_formed(&cluster, survivor, 3).await;
    let returned = ClusterClient::new(cluster.addr(leader));
    let answer = wait_until(
        "the returned node to answer",
        Duration::from_secs(20),
        || async {
            returned
                .query("SELECT count(*) FROM kv")
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    let () = answer;
    assert_eq!(count_and_sum(&returned).await, (rows, expected_sum));
    // It missed an epoch, so it serves no partition until it has copied them back.
    wait_until(
        "the returned node to be up to date",
        Duration::from_secs(30),
        || async {
            let status = client.status().await.ok()?;
            status
                .meta
                .map
                .partitions
                .iter()
                .all(|p| p.stale.is_empty())
                .then_some(())
        },
    )
    .await;
    let local = returned.status().await.unwrap();
    let held = local
        .tables
        .iter()
        .find(|t| t.name == "kv")
        .map_or(0, |t| t.rows);
    assert_eq!(
        held as i64, rows,
        "with three replicas on three nodes it holds every row"
    );
    assert_eq!(count_and_sum(&returned).await, (rows, expected_sum));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_mid_publish_leaves_its_epoch_invisible() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = kv_cluster(root.path(), 3).await;
    client
        .publish("kv", vec![kv_batch(0, 100)], false)
        .await
        .unwrap();
    // A large publish coordinated by node 3, killed while it ships rows.
    let doomed = ClusterClient::new(cluster.addr(3));
    let publish = tokio::spawn(async move {
        let batches: Vec<RecordBatch> = (0..40)
            .map(|i| kv_batch(1_000 + i * 50_000, 1_000 + (i + 1) * 50_000))
            .collect();
        doomed.publish("kv", batches, false).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.kill9(3);
    let killed_at = Instant::now();
    let outcome = publish.await.unwrap();
    assert!(
        outcome.is_err(),
        "the coordinator died, so the publish cannot have been acknowledged"
    );
    wait_until(
        "the coordinator declared failed",
        Duration::from_secs(5),
        || async {
            let status = client.status().await.ok()?;
            (!status.meta.nodes[&NodeId(3)].alive && status.meta.open.is_empty()).then_some(())
        },
    )
    .await;
    let detected = killed_at.elapsed();
    assert!(
        detected < Duration::from_secs(2),
        "the dead coordinator was declared failed after {detected:?}"
    );
    assert_eq!(
        count_and_sum(&client).await.0,
        100,
        "no row of the aborted epoch is visible"
    );
    // The table takes writes again: the dead coordinator's lease went with its epoch.
    client
        .publish("kv", vec![kv_batch(100, 200)], false)
        .await
        .unwrap();
    assert_eq!(count_and_sum(&client).await.0, 200);
}

fn node_error(cluster: &LocalCluster, config: &Path, env: &[(&str, &str)]) -> String {
    let mut command = std::process::Command::new(BINARY);
    command.args(["node", "--config", config.to_str().unwrap()]);
    for (key, value) in env {
        command.env(key, value);
    }
    let child = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        !output.status.success(),
        "a bad node must not start ({})",
        cluster.cluster_id()
    );
    String::from_utf8_lossy(&output.stderr).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configurations_are_refused_with_clear_errors() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 3);
    let bad = root.path().join("bad.toml");

    // A voter that is not a peer.
    let text = format!(
        "voters = [1, 9]\n{}",
        cluster.config_text(1, cluster.cluster_id())
    );
    std::fs::write(&bad, text).unwrap();
    let error = node_error(&cluster, &bad, &[]);
    assert!(error.contains("voter 9 is not a known peer"), "{error}");

    // Unparseable values name the field.
    let text = cluster
        .config_text(1, cluster.cluster_id())
        .replace("partitions = 16", "partitions = \"many\"");
    std::fs::write(&bad, text).unwrap();
    let error = node_error(&cluster, &bad, &[]);
    assert!(error.contains("partitions"), "{error}");

    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;

    // A port in use: node 1's configuration again, in another data directory.
    let text = cluster
        .config_text(1, cluster.cluster_id())
        .replace("data_dir = \"data\"", "data_dir = \"other\"");
    std::fs::write(&bad, text).unwrap();
    let error = node_error(&cluster, &bad, &[]);
    assert!(
        error.contains("cannot listen on") && error.contains(cluster.addr(1)),
        "{error}"
    );

    // A fourth node configured for another cluster, next to this cluster's nodes.
    let mut other = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 3);
    let stranger = other.add_node();
    let text = other
        .config_text(stranger, "someone-else")
        .replace(other.addr(1), cluster.addr(1))
        .replace(other.addr(2), cluster.addr(2))
        .replace(other.addr(3), cluster.addr(3));
    std::fs::write(&bad, text).unwrap();
    let error = node_error(&cluster, &bad, &[]);
    assert!(
        error.contains("belongs to cluster") && error.contains("someone-else"),
        "{error}"
    );

    // A node speaking another protocol version.
    let newcomer = cluster.add_node();
    let error = node_error(
        &cluster,
        &cluster.config_path(newcomer),
        &[("TESSERA_PROTOCOL_VERSION_FOR_TESTS", "99")],
    );
    assert!(error.contains("protocol version"), "{error}");

    // A data directory of another node.
    let text = cluster.config_text(newcomer, cluster.cluster_id()).replace(
        "data_dir = \"data\"",
        &format!("data_dir = {:?}", root.path().join("node-1").join("data")),
    );
    std::fs::write(&bad, text).unwrap();
    let error = node_error(&cluster, &bad, &[]);
    assert!(error.contains("belongs to node 1"), "{error}");
}
