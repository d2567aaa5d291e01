//! `tessera bench replication`: on a 3-node local cluster, in one run, publish throughput
//! with r = 1, 2, 3 (and the overhead against r = 1), failover time from a node's detection
//! to its partitions serving again, and failback time of the returning node with delta
//! recovery against a full copy of its stale partitions.

use super::bench_cluster::{median_publish_time, wait_formed, Nodes};
use super::up::UpOptions;
use anyhow::{Context, Result};
use arrow::array::{Int64Array, RecordBatch};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_cluster::ClusterClient;

const NODES: u64 = 3;
/// Rows of the small publish the killed node misses before it returns.
const DELTA_ROWS: usize = 1000;

struct Throughput {
    rows_per_second: f64,
}

struct Failover {
    detected: Duration,
    serving_after_detection: Duration,
    healthy_query: Duration,
}

struct Failback {
    /// From the restarted node being declared alive to no replica being stale.
    caught_up: Duration,
}

async fn start(root: &Path, partitions: u32, replication: u32, delta: bool) -> Result<Nodes> {
    let nodes = Nodes::start_with(
        root,
        UpOptions {
            nodes: NODES,
            base_port: 0,
            partitions,
            replication,
            delta_recovery: delta,
        },
    )?;
    wait_formed(&nodes.addrs, Duration::from_secs(60)).await?;
    let client = ClusterClient::new(&nodes.addrs[0]);
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    client
        .sql(&tessera_tpch::create_table_sql(&lineitem))
        .await?;
    Ok(nodes)
}

/// Median publish throughput of `rows` through node 1.
async fn publish_throughput(
    nodes: &Nodes,
    rows: &[RecordBatch],
    runs: usize,
) -> Result<Throughput> {
    let client = ClusterClient::new(&nodes.addrs[0]);
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    let median = median_publish_time(&client, rows, runs).await?;
    Ok(Throughput {
        rows_per_second: count as f64 / median.as_secs_f64(),
    })
}

async fn count_rows(client: &ClusterClient) -> Result<i64> {
    let batches = client.query("SELECT count(*) FROM lineitem").await?;
    Ok(batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .context("count(*) is a BIGINT")?
        .value(0))
}

/// Polls `check` every 5 ms until it holds; returns when it did.
async fn poll_until<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<Instant>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Instant::now())
}

/// SIGKILLs node 3 (not the metadata leader, so no election is timed) and measures how long
/// until it is declared failed and until a query over every partition answers exactly.
async fn failover(nodes: &mut Nodes, victim: u64) -> Result<Failover> {
    let client = ClusterClient::new(&nodes.addrs[0]);
    let healthy_started = Instant::now();
    let expected = count_rows(&client).await?;
    let healthy_query = healthy_started.elapsed();
    let killed = Instant::now();
    nodes.kill9(victim);
    let detected = poll_until(
        "the node declared failed",
        Duration::from_secs(10),
        || async {
            client
                .status()
                .await
                .is_ok_and(|s| s.meta.nodes.get(&victim).is_some_and(|n| !n.alive))
        },
    )
    .await?;
    let serving = poll_until(
        "partitions serving again",
        Duration::from_secs(30),
        || async { count_rows(&client).await.is_ok_and(|n| n == expected) },
    )
    .await?;
    Ok(Failover {
        detected: detected - killed,
        serving_after_detection: serving - detected,
        healthy_query,
    })
}

/// With `victim` down, publishes a small delta, restarts it and measures how long it takes
/// from being declared alive to holding every epoch again.
async fn failback(nodes: &mut Nodes, victim: u64, delta: &RecordBatch) -> Result<Failback> {
    let client = ClusterClient::new(&nodes.addrs[0]);
    client
        .publish("lineitem", vec![delta.clone()], false)
        .await?;
    let stale = client
        .status()
        .await?
        .meta
        .map
        .partitions
        .iter()
        .filter(|p| !p.stale.is_empty())
        .count();
    anyhow::ensure!(stale > 0, "the dead node should have missed the delta");
    nodes.spawn(victim)?;
    let alive = poll_until("the node back alive", Duration::from_secs(60), || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.meta.nodes.get(&victim).is_some_and(|n| n.alive))
    })
    .await?;
    let caught_up = poll_until("the node caught up", Duration::from_secs(600), || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.meta.map.partitions.iter().all(|p| p.stale.is_empty()))
    })
    .await?;
    Ok(Failback {
        caught_up: caught_up - alive,
    })
}

pub async fn run(data_dir: &Path, sf: f64, partitions: u32, runs: usize) -> Result<()> {
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    let rows: Vec<RecordBatch> = lineitem.generate(sf, 64 * 1024).collect::<Result<_, _>>()?;
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    let delta = rows[0].slice(0, DELTA_ROWS.min(rows[0].num_rows()));
    let root = data_dir.join(format!("bench-replication-{}", std::process::id()));
    println!("replication benchmark: {NODES} nodes on this machine, {partitions} partitions, lineitem SF {sf} ({count} rows), median of {runs} publishes");

    let result = async {
        let mut throughput = Vec::new();
        for r in 1..=3u32 {
            let nodes = start(&root.join(format!("r{r}")), partitions, r, true).await?;
            throughput.push(publish_throughput(&nodes, &rows, runs).await?);
        }
        let mut hot = start(&root.join("failover"), partitions, 3, true).await?;
        publish_throughput(&hot, &rows, 1).await?;
        let hot_failover = failover(&mut hot, 3).await?;
        let delta_failback = failback(&mut hot, 3, &delta).await?;
        drop(hot);
        let mut full = start(&root.join("full-copy"), partitions, 3, false).await?;
        publish_throughput(&full, &rows, 1).await?;
        failover(&mut full, 3).await?;
        let full_failback = failback(&mut full, 3, &delta).await?;
        anyhow::Ok((throughput, hot_failover, delta_failback, full_failback))
    }
    .await;
    let _ = std::fs::remove_dir_all(&root);
    let (throughput, failover, delta, full) = result?;

    println!();
    println!("{:<30} {:>12} {:>12} {:>12}", "", "r=1", "r=2", "r=3");
    println!(
        "{:<30} {:>12.0} {:>12.0} {:>12.0}",
        "publish throughput (rows/s)",
        throughput[0].rows_per_second,
        throughput[1].rows_per_second,
        throughput[2].rows_per_second
    );
    let overhead = |t: &Throughput| throughput[0].rows_per_second / t.rows_per_second;
    println!(
        "{:<30} {:>12.2} {:>12.2} {:>12.2}   (publish time / r=1 time; goal for r=3: <= 1.10)",
        "overhead vs r=1",
        1.0,
        overhead(&throughput[1]),
        overhead(&throughput[2])
    );
    println!();
    println!(
        "failover (r=3, SIGKILL of node 3): declared failed {:.0} ms after the kill; a count(*) over every partition answered exactly {:.0} ms after detection (the same query takes {:.0} ms on a healthy cluster)",
        failover.detected.as_secs_f64() * 1000.0,
        failover.serving_after_detection.as_secs_f64() * 1000.0,
        failover.healthy_query.as_secs_f64() * 1000.0
    );
    println!(
        "failback after missing one {DELTA_ROWS}-row publish, from declared alive to up to date: delta recovery {:.0} ms, full copy {:.0} ms, full/delta {:.2}",
        delta.caught_up.as_secs_f64() * 1000.0,
        full.caught_up.as_secs_f64() * 1000.0,
        full.caught_up.as_secs_f64() / delta.caught_up.as_secs_f64()
    );
    Ok(())
}
