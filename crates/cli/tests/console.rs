//! The node's HTTP port (`http_listen`): Prometheus metrics, parsed by Prometheus's own
//! OpenMetrics parser, that move by exactly the work done through the node; and the web
//! console, loaded in a real (headless) Chromium against a live cluster.

mod common;

use common::kv_cluster_with;
use std::collections::BTreeMap;
use std::path::Path;
use tessera_server::ClusterClient;
use tessera_testkit::{kv_batch, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// A scrape: the response's content type and every sample, keyed `name{label=value,...}`.
struct Scrape {
    content_type: String,
    samples: BTreeMap<String, f64>,
}

impl Scrape {
    fn value(&self, key: &str) -> f64 {
        self.samples.get(key).copied().unwrap_or(0.0)
    }
}

async fn scrape(cluster: &LocalCluster, id: u64) -> Scrape {
    let url = format!("http://{}/metrics", cluster.http_addr(id).unwrap());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/scrape_metrics.py");
    let output = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(&url)
        .output()
        .await
        .expect("python3 runs");
    assert!(
        output.status.success(),
        "scraping {url} failed (is prometheus_client installed? pip install prometheus_client):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let parsed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    Scrape {
        content_type: parsed["content_type"].as_str().unwrap().to_string(),
        samples: parsed["samples"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap()))
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_openmetrics_and_move_with_the_work() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;

    let before = scrape(&cluster, 1).await;
    assert!(
        before
            .content_type
            .starts_with("application/openmetrics-text"),
        "{}",
        before.content_type
    );
    for i in 0..3 {
        client
            .publish("kv", vec![kv_batch(i * 100, (i + 1) * 100)], false)
            .await
            .unwrap();
    }
    // Flushed to components, the rows are scanned through each node's decoded cache.
    for id in cluster.node_ids() {
        ClusterClient::new(cluster.addr(id)).flush().await.unwrap();
    }
    for _ in 0..4 {
        client.query("SELECT sum(v) AS n FROM kv").await.unwrap();
    }
    client
        .query("SELECT * FROM nosuch")
        .await
        .expect_err("no such table");
    let pg = cluster.pg_addr(1).unwrap();
    let (host, port) = pg.rsplit_once(':').unwrap();
    let (_connected, connection) = tokio_postgres::connect(
        &format!("host={host} port={port} user=tessera dbname=tessera"),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let after = scrape(&cluster, 1).await;
    let moved = |key: &str| after.value(key) - before.value(key);

    assert_eq!(moved("tessera_publishes_total{outcome=acknowledged}"), 3.0);
    assert_eq!(moved("tessera_publish_rows_total{}"), 300.0);
    assert_eq!(moved("tessera_publish_seconds_count{}"), 3.0);
    assert!(moved("tessera_publish_bytes_total{}") > 0.0);
    assert_eq!(moved("tessera_queries_total{outcome=ok}"), 4.0);
    assert_eq!(moved("tessera_queries_total{outcome=failed}"), 1.0);
    assert_eq!(moved("tessera_query_seconds_count{}"), 5.0);
    assert!(
        moved("tessera_wal_fsync_seconds_count{}") >= 3.0,
        "every publish logs durably here"
    );
    assert!(
        moved("tessera_store_gate_wait_seconds_count{}") >= 3.0,
        "every publish's prepare and commit passed the store's gate here"
    );
    assert!(
        moved("tessera_exchange_bytes_total{}") > 0.0,
        "the counts gathered rows from the other nodes"
    );

    let status = client.status().await.unwrap();
    assert_eq!(
        after.value("tessera_visible_epoch{}"),
        status.meta.visible.0 as f64
    );
    assert_eq!(
        after.value("tessera_raft_leader{}"),
        status.leader.unwrap().0 as f64
    );
    assert!(after.value("tessera_raft_term{}") >= 1.0);
    let decoded = status.decoded.expect("the node reports its decoded cache");
    assert!(
        after.value("tessera_decoded_cache_bytes{}") > 0.0 && decoded.bytes > 0,
        "node 1's scans kept the columns they read: {decoded:?}"
    );
    let machine = tessera_common::memory::machine_memory_bytes().unwrap();
    assert_eq!(
        (
            after.value("tessera_decoded_cache_budget_bytes{}") as u64,
            decoded.budget_bytes
        ),
        (machine / 4, machine / 4),
        "unset, the cache takes a quarter of the machine's memory"
    );
    assert!(after.value("tessera_raft_applied_index{}") > 0.0);
    assert_eq!(
        after.value("tessera_pg_connections{}"),
        1.0,
        "one PostgreSQL client is connected"
    );
    for replica in 1..=3 {
        let key = format!("tessera_replica_lag_epochs{{replica={replica}}}");
        assert!(after.samples.contains_key(&key), "{key} is exported");
        assert_eq!(after.value(&key), 0.0, "no replica is behind");
    }
}

/// One HTTP/1.0 request (so the answer is neither chunked nor kept alive): the status code
/// and the body.
async fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

/// Runs headless Chromium on `url`: the page's DOM after its scripts ran, and a screenshot
/// written to `screenshot`.
async fn chromium(url: &str, screenshot: &Path, height: u32) -> String {
    let run = |extra: Vec<String>| {
        let url = url.to_string();
        async move {
            let output = tokio::process::Command::new("chromium")
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    &format!("--window-size=1440,{height}"),
                    "--virtual-time-budget=3000",
                ])
                .args(extra)
                .arg(url)
                .output()
                .await
                .expect("chromium is installed (apt: chromium)");
            assert!(
                output.status.success(),
                "chromium failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            String::from_utf8_lossy(&output.stdout).to_string()
        }
    };
    run(vec![format!("--screenshot={}", screenshot.display())]).await;
    run(vec!["--dump-dom".to_string()]).await
}

/// The console in a real browser shows every node with its liveness, every partition with
/// its replicas, and a statement while it runs; its SQL box answers through the cluster and
/// reports an error once. The screenshot is kept (target/tmp/console.png).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_nodes_partitions_and_a_running_statement_in_a_browser() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    client
        .publish("kv", vec![kv_batch(0, 100)], false)
        .await
        .unwrap();
    let http_addr = cluster.http_addr(1).unwrap().to_string();

    let (status, body) = http(
        &http_addr,
        "POST",
        "/api/sql",
        "SELECT count(*) AS n FROM kv",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer[0]["rows"][0]["n"], 100, "{body}");
    let (status, body) = http(&http_addr, "POST", "/api/sql", "SELECT * FROM nosuch").await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["error"],
        "table 'tessera.public.nosuch' not found"
    );

    // A distributed statement that runs for a long while, through node 1: its scans of kv
    // end at once, its cross join runs on.
    const LONG: &str = "SELECT count(*) AS n FROM kv a, kv b, kv c, kv d, kv e";
    let long = tokio::spawn(async move { client.query(LONG).await });
    let progress = common::wait_until(
        "the statement to show as running, with a finished channel",
        std::time::Duration::from_secs(60),
        || async {
            let (_, body) = http(&http_addr, "GET", "/api/status", "").await;
            let status: serde_json::Value = serde_json::from_str(&body).ok()?;
            let statement = status["running"]
                .as_array()?
                .iter()
                .find(|s| s["sql"].as_str().is_some_and(|sql| sql.contains("kv e")))?
                .clone();
            let query = status["queries"]
                .as_array()?
                .iter()
                .find(|q| q["statement"] == statement["id"])?
                .clone();
            let channels = || {
                query["stages"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|s| s["channels"].as_array().cloned().unwrap_or_default())
            };
            channels()
                .any(|c| c["done"] == true)
                .then_some(query.clone())
        },
    )
    .await;
    // Its stages are listed leaves first, ending with the answer's stage 0, each channel on
    // a node; the scans ran on every node.
    let stages = progress["stages"].as_array().unwrap();
    assert!(stages.len() >= 2, "{progress}");
    assert_eq!(stages.last().unwrap()["stage"], 0, "{progress}");
    let nodes: std::collections::BTreeSet<u64> = stages
        .iter()
        .flat_map(|s| s["channels"].as_array().unwrap().clone())
        .map(|c| c["node"].as_u64().unwrap())
        .collect();
    assert_eq!(nodes.len(), 3, "channels on every node: {progress}");
    assert!(
        stages[stages.len() - 1]["channels"][0]["done"] == false,
        "the answer's stage still runs: {progress}"
    );

    let screenshot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console.png");
    let dom = chromium(&format!("http://{http_addr}/"), &screenshot, 1300).await;
    long.abort();
    for node in 1..=3 {
        assert!(
            dom.contains(&format!("data-node=\"{node}\"")),
            "node {node} is on the page"
        );
    }
    // Drawn cells, not the page script's template (`data-partition="${i}"`).
    let drawn = dom
        .split("data-partition=\"")
        .skip(1)
        .filter(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert_eq!(drawn, 8, "every partition is drawn");
    assert!(dom.contains("alive"), "liveness is shown");
    let running = dom
        .split("id=\"running\"")
        .nth(1)
        .and_then(|rest| rest.split("</section>").next())
        .unwrap();
    assert!(
        running.contains("kv d, kv e"),
        "the running statement is listed: {running}"
    );
    assert!(
        running.contains("class=\"progress\"")
            && running.contains("data-stage=\"0\"")
            && running.contains("class=\"chip done\"")
            && running.contains("class=\"chip run\""),
        "its live progress is drawn, finished and running channels apart: {running}"
    );
    let publishes = dom
        .split("Publishes through this node")
        .nth(1)
        .and_then(|rest| rest.split("</section>").next())
        .unwrap();
    assert!(
        publishes.contains(">kv<") && publishes.contains(">100<"),
        "the publish of 100 rows into kv through node 1 is listed: {publishes}"
    );
    assert!(
        std::fs::metadata(&screenshot).unwrap().len() > 10_000,
        "a screenshot was taken"
    );
    println!("console screenshot: {}", screenshot.display());

    // A link that runs EXPLAIN ANALYZE draws the query's stages, each channel on its node.
    let explain = "EXPLAIN ANALYZE SELECT v % 3 AS r, count(*) AS n FROM kv GROUP BY v % 3";
    let encoded: String = explain
        .chars()
        .map(|c| match c.is_ascii_alphanumeric() {
            true => c.to_string(),
            false => format!("%{:02X}", c as u32),
        })
        .collect();
    let url = format!("http://{http_addr}/?sql={encoded}");
    let stages_png = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-stages.png");
    let dom = chromium(&url, &stages_png, 2000).await;
    let graph = dom
        .split("class=\"stage-graph\"")
        .nth(1)
        .expect("the stage graph is drawn");
    for stage in ["data-stage=\"0\"", "data-stage=\"1\"", "data-stage=\"2\""] {
        assert!(graph.contains(stage), "{stage} is drawn");
    }
    for node in 1..=3 {
        assert!(
            graph.contains(&format!("class=\"bar\" data-node=\"{node}\"")),
            "a channel on node {node} is drawn"
        );
    }
    println!("console stage graph: {}", stages_png.display());
}

/// The memtables' bytes on every node of `cluster`, as scraped.
async fn memtable_bytes(cluster: &LocalCluster) -> f64 {
    let mut total = 0.0;
    for id in cluster.node_ids() {
        total += scrape(cluster, id)
            .await
            .value("tessera_store_memtable_bytes{}");
    }
    total
}

/// `tessera_store_memtable_bytes` counts the memory a publish's rows hold once, and the
/// allocator's figures cover it. Rows reach
/// a primary as Arrow Flight messages, and every column of a decoded message points into
/// the message's one body: counted column by column (Arrow's own count), the wide rows
/// below were charged 95 MB for their 16 MB, which made checkpoints run on every publish
/// and held prepares back for memory that was not in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memtables_count_a_publishs_rows_once_and_the_allocator_holds_them() {
    use arrow::array::{ArrayRef, Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    const COLUMNS: usize = 16;
    const ROWS: i64 = 120_000;
    let root = tempfile::tempdir().unwrap();
    // No checkpoint: the rows stay in the memtables.
    let (cluster, client) = kv_cluster_with(
        BINARY,
        root.path(),
        6,
        1,
        &[
            ("store.memtable_flush_bytes", "4000000000"),
            ("store.idle_checkpoint_ms", "0"),
        ],
    )
    .await;
    let names: Vec<String> = (0..COLUMNS).map(|c| format!("c{c}")).collect();
    client
        .sql(&format!(
            "CREATE TABLE wide ({}, PRIMARY KEY (c0))",
            names
                .iter()
                .map(|n| format!("{n} BIGINT NOT NULL"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .await
        .unwrap();
    let schema = Arc::new(Schema::new(
        names
            .iter()
            .map(|n| Field::new(n, DataType::Int64, false))
            .collect::<Vec<_>>(),
    ));
    let batches: Vec<RecordBatch> = (0..ROWS)
        .step_by(10_000)
        .map(|from| {
            let columns: Vec<ArrayRef> = (0..COLUMNS as i64)
                .map(|c| {
                    Arc::new(Int64Array::from_iter_values(
                        (from..from + 10_000).map(|k| k * (c + 1)),
                    )) as ArrayRef
                })
                .collect();
            RecordBatch::try_new(schema.clone(), columns).unwrap()
        })
        .collect();
    let before = memtable_bytes(&cluster).await;
    client.publish("wide", batches, false).await.unwrap();
    let after = memtable_bytes(&cluster).await;
    // Each stored row: its 16 values, its epoch (8 bytes) and its operation (1 byte).
    let rows_bytes = (ROWS as usize * (COLUMNS * 8 + 8 + 1)) as f64;
    let counted = after - before;
    assert!(
        counted >= rows_bytes * 0.9 && counted <= rows_bytes * 1.5,
        "the memtables hold {rows_bytes} bytes of rows, and count {counted}"
    );

    // Nodes allocate with jemalloc (`tessera_common::allocator`), and say what it holds:
    // at least the rows in their memtables, all of it mapped.
    for id in cluster.node_ids() {
        let metrics = scrape(&cluster, id).await;
        let memtables = metrics.value("tessera_store_memtable_bytes{}");
        let allocated = metrics.value("tessera_allocator_allocated_bytes{}");
        let resident = metrics.value("tessera_allocator_resident_bytes{}");
        assert!(
            memtables > 0.0 && allocated >= memtables,
            "node {id}: the allocator has {allocated} bytes allocated, its memtables hold {memtables}"
        );
        assert!(
            resident >= allocated,
            "node {id}: {resident} bytes resident, fewer than the {allocated} allocated"
        );
    }
}
