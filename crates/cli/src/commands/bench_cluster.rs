//! `tessera bench cluster`: time to form a cluster, leader failover time, and publish
//! throughput on 1 node against 3 nodes, measured in the same run on this machine.

use super::local_cluster::LocalCluster;
use super::up::UpOptions;
use anyhow::{Context, Result};
use arrow::array::RecordBatch;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::ClusterClient;

/// The median time of `runs` publishes of `rows` into `lineitem` through `client`.
pub(super) async fn median_publish_time(
    client: &ClusterClient,
    rows: &[RecordBatch],
    runs: usize,
) -> Result<Duration> {
    let mut times = Vec::new();
    for _ in 0..runs.max(1) {
        let started = Instant::now();
        client.publish("lineitem", rows.to_vec(), false).await?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

struct Measured {
    formation: Duration,
    rows_per_second: f64,
    /// After SIGKILL of the leader: a new leader elected, the old one declared failed, the
    /// next publish acknowledged.
    failover: Option<(Duration, Duration, Duration)>,
}

async fn measure(
    root: &Path,
    nodes: u64,
    partitions: u32,
    rows: &[RecordBatch],
    runs: usize,
) -> Result<Measured> {
    let started = Instant::now();
    let mut cluster =
        LocalCluster::start_on_free_ports(root, UpOptions::new(nodes, partitions, 3))?;
    let client = cluster.client(0);
    cluster.wait_formed(Duration::from_secs(60)).await?;
    let formation = started.elapsed();
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    client
        .sql(&tessera_tpch::create_table_sql(&lineitem))
        .await?;
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    let median = median_publish_time(&client, rows, runs).await?;
    let failover = if nodes >= 3 {
        let leader = client.status().await?.leader.context("no leader")?;
        let survivor = (1..=nodes)
            .find(|id| *id != leader.0)
            .expect("another node");
        let survivor = cluster.client(survivor as usize - 1);
        let killed = Instant::now();
        cluster.kill9(leader.0);
        let elected = loop {
            if let Ok(status) = survivor.status().await {
                if status.leader.is_some_and(|l| l != leader) {
                    break killed.elapsed();
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let declared = loop {
            if let Ok(status) = survivor.status().await {
                if status.meta.nodes.get(&leader).is_some_and(|n| !n.alive) {
                    break killed.elapsed();
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        survivor
            .publish("lineitem", vec![rows[0].slice(0, 100)], false)
            .await?;
        Some((elected, declared, killed.elapsed()))
    } else {
        None
    };
    Ok(Measured {
        formation,
        rows_per_second: count as f64 / median.as_secs_f64(),
        failover,
    })
}

pub async fn run(data_dir: &Path, sf: f64, partitions: u32, runs: usize) -> Result<()> {
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    let rows: Vec<RecordBatch> = lineitem.generate(sf, 64 * 1024).collect::<Result<_, _>>()?;
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    let root = data_dir.join(format!("bench-cluster-{}", std::process::id()));
    println!("cluster benchmark: {partitions} partitions, replication 3 (capped at the node count), lineitem SF {sf} ({count} rows), median of {runs} publishes");
    let one = measure(&root.join("one"), 1, partitions, &rows, runs).await;
    let three = measure(&root.join("three"), 3, partitions, &rows, runs).await;
    let _ = std::fs::remove_dir_all(&root);
    let (one, three) = (one?, three?);
    println!();
    println!("{:<34} {:>12} {:>12} {:>8}", "", "1 node", "3 nodes", "3/1");
    println!(
        "{:<34} {:>10.2} s {:>10.2} s {:>8.2}",
        "time to form the cluster",
        one.formation.as_secs_f64(),
        three.formation.as_secs_f64(),
        three.formation.as_secs_f64() / one.formation.as_secs_f64()
    );
    println!(
        "{:<34} {:>12.0} {:>12.0} {:>8.2}",
        "publish throughput (rows/s)",
        one.rows_per_second,
        three.rows_per_second,
        three.rows_per_second / one.rows_per_second
    );
    if let Some((elected, declared, resumed)) = three.failover {
        println!(
            "leader failover (3 nodes), after SIGKILL: new leader in {:.0} ms, old leader declared failed in {:.0} ms, next publish acknowledged in {:.0} ms",
            elected.as_secs_f64() * 1000.0,
            declared.as_secs_f64() * 1000.0,
            resumed.as_secs_f64() * 1000.0
        );
    }
    Ok(())
}
