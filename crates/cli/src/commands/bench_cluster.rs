//! `tessera bench cluster`: time to form a cluster, leader failover time, and publish
//! throughput on 1 node against 3 nodes, measured in the same run on this machine.

use super::up::{local_configs, UpOptions};
use anyhow::{bail, Context, Result};
use arrow::array::RecordBatch;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tessera_server::{ClusterClient, NodeConfig};

/// A local cluster of node processes for a benchmark, killed when dropped.
pub(super) struct Nodes {
    children: Vec<(u64, Child)>,
    configs: Vec<PathBuf>,
    pub(super) addrs: Vec<String>,
}

impl Nodes {
    fn start(root: &Path, nodes: u64, partitions: u32) -> Result<Nodes> {
        Self::start_with(root, UpOptions::new(nodes, partitions, 3))
    }

    /// Starts a cluster as `options` say (its `base_port` is replaced by a free one).
    pub(super) fn start_with(root: &Path, mut options: UpOptions) -> Result<Nodes> {
        options.base_port = free_base_port(options.nodes)?;
        let configs: Vec<PathBuf> = local_configs(root, &options)?;
        let mut nodes = Nodes {
            children: Vec::new(),
            addrs: Vec::new(),
            configs: configs.clone(),
        };
        for (i, config) in configs.iter().enumerate() {
            nodes
                .addrs
                .push(NodeConfig::load(config)?.listen.to_string());
            nodes.spawn(i as u64 + 1)?;
        }
        Ok(nodes)
    }

    /// Starts node `id` (again).
    pub(super) fn spawn(&mut self, id: u64) -> Result<()> {
        let child = Command::new(std::env::current_exe()?)
            .args(["node", "--config"])
            .arg(&self.configs[id as usize - 1])
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting node {id}"))?;
        self.children.push((id, child));
        Ok(())
    }

    pub(super) fn kill9(&mut self, id: u64) {
        if let Some(pos) = self.children.iter().position(|(n, _)| *n == id) {
            let (_, mut child) = self.children.remove(pos);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A run of `n` consecutive free ports.
/// The first of `n` consecutive free ports on 127.0.0.1.
pub(super) fn free_base_port(n: u64) -> Result<u16> {
    for _ in 0..100 {
        let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
        let base = probe.local_addr()?.port();
        drop(probe);
        if base as u64 + n >= u16::MAX as u64 {
            continue;
        }
        let all_free =
            (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i as u16)).is_ok());
        if all_free {
            return Ok(base);
        }
    }
    bail!("found no run of {n} free ports")
}

pub(super) async fn wait_formed(addrs: &[String], timeout: Duration) -> Result<()> {
    let clients: Vec<ClusterClient> = addrs.iter().map(|a| ClusterClient::new(a)).collect();
    let deadline = Instant::now() + timeout;
    while !super::up::formed(&clients).await {
        if Instant::now() > deadline {
            bail!("the cluster did not form within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

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
    let mut cluster = Nodes::start(root, nodes, partitions)?;
    let client = ClusterClient::new(&cluster.addrs[0]);
    wait_formed(&cluster.addrs, Duration::from_secs(60)).await?;
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
        let survivor = ClusterClient::new(&cluster.addrs[survivor as usize - 1]);
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
