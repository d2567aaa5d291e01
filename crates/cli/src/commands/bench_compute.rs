//! `tessera bench compute`: what compute-only nodes add to TPC-H. Two local clusters hold
//! the same data: `nodes` storage nodes, and the same plus `compute` compute-only nodes
//! (which take the channels that read no partition). Each query runs once untimed on both
//! and on plain DataFusion (warming caches and checking the answers), then `runs` times in
//! turn; medians are reported, with the share of each query's channels that ran on the
//! compute nodes (from `EXPLAIN ANALYZE`). Every process shares this machine's cores, so
//! on a small machine extra nodes add work rather than CPU: the figures say so honestly.

use super::bench::{chosen_queries, median, shared_baseline};
use super::bench_distributed::ensure_tpch;
use super::local_cluster::LocalCluster;
use super::timing::timed;
use super::up::UpOptions;
use anyhow::{bail, Result};
use arrow::array::{Array, StringArray};
use std::path::Path;
use std::time::Duration;
use tessera_server::ClusterClient;

/// A local cluster of `nodes` storage and `compute` compute-only nodes, with TPC-H loaded.
async fn cluster(
    root: &Path,
    nodes: u64,
    compute: u64,
    partitions: u32,
    sf: f64,
) -> Result<(LocalCluster, ClusterClient)> {
    let mut options = UpOptions::new(nodes, partitions, 3);
    options.compute = compute;
    let mut cluster = LocalCluster::start_on_free_ports(root, options)?;
    cluster.wait_formed(Duration::from_secs(60)).await?;
    let what = format!("{nodes} storage + {compute} compute node cluster");
    ensure_tpch(&cluster, sf, &what, root).await?;
    let client = cluster.client(0);
    Ok((cluster, client))
}

/// Of the channels `EXPLAIN ANALYZE` of `sql` lists, how many ran on a node whose id is
/// above `storage` (a compute node), and how many there were.
async fn channels_on_compute(
    client: &ClusterClient,
    sql: &str,
    storage: u64,
) -> Result<(usize, usize)> {
    let batches = client.query(&format!("EXPLAIN ANALYZE {sql}")).await?;
    let (mut on_compute, mut all) = (0, 0);
    for batch in &batches {
        let Some(plans) = batch.column(1).as_any().downcast_ref::<StringArray>() else {
            bail!("EXPLAIN ANALYZE returns its plan as text");
        };
        for i in 0..plans.len() {
            for line in plans.value(i).lines() {
                let node = line
                    .split_once("channel ")
                    .and_then(|(_, rest)| rest.split_once(" on node "))
                    .and_then(|(_, rest)| rest.split(':').next())
                    .and_then(|id| id.trim().parse::<u64>().ok());
                if let Some(node) = node {
                    all += 1;
                    if node > storage {
                        on_compute += 1;
                    }
                }
            }
        }
    }
    Ok((on_compute, all))
}

pub async fn run(
    data_dir: &Path,
    nodes: u64,
    compute: u64,
    partitions: u32,
    sf: f64,
    queries: &[usize],
    runs: usize,
) -> Result<()> {
    if compute == 0 {
        bail!("--compute 0 compares nothing: give 1 or more compute nodes");
    }
    let queries = chosen_queries(queries, runs)?;
    let root = data_dir.join(format!("bench-compute-sf{sf}"));
    let (_plain, storage_only) = cluster(
        &root.join(format!("storage-{nodes}")),
        nodes,
        0,
        partitions,
        sf,
    )
    .await?;
    let (_with, with_compute) = cluster(
        &root.join(format!("storage-{nodes}-compute-{compute}")),
        nodes,
        compute,
        partitions,
        sf,
    )
    .await?;
    let baseline = shared_baseline(data_dir, sf).await?;

    println!();
    println!(
        "TPC-H SF {sf}: median of {runs} run(s); {nodes} storage nodes alone vs with {compute} compute-only nodes, every process on this machine's {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let with = format!("+{compute}c (ms)");
    println!(
        "{:>5} {:>14} {:>12} {:>9} {:>16}  answer",
        "query",
        format!("{nodes} storage (ms)"),
        with,
        "with/alone",
        "channels on compute"
    );
    let mut log_ratio = 0.0f64;
    let (mut sum_alone, mut sum_with) = (0.0, 0.0);
    let (mut compute_channels, mut all_channels) = (0, 0);
    let mut mismatches = Vec::new();
    for &q in &queries {
        let sql = tessera_tpch::query(q);
        let expected = baseline.sql(sql).await?.collect().await?;
        let mut answer = "same".to_string();
        for (name, client) in [
            ("storage only", &storage_only),
            ("with compute", &with_compute),
        ] {
            let actual = client.query(sql).await?;
            if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
                mismatches.push(q);
                answer = format!("DIFFERENT {name}: {diff}");
            }
        }
        let (on_compute, channels) = channels_on_compute(&with_compute, sql, nodes).await?;
        compute_channels += on_compute;
        all_channels += channels;
        let (mut t_alone, mut t_with) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            t_alone.push(timed(|| storage_only.query(sql)).await?.0);
            t_with.push(timed(|| with_compute.query(sql)).await?.0);
        }
        let ms = |times: &mut Vec<Duration>| median(times).as_secs_f64() * 1e3;
        let (alone, with) = (ms(&mut t_alone), ms(&mut t_with));
        sum_alone += alone;
        sum_with += with;
        log_ratio += (with / alone).ln();
        println!(
            "{:>5} {:>14.1} {:>12.1} {:>9.3} {:>16}  {answer}",
            format!("Q{q}"),
            alone,
            with,
            with / alone,
            format!("{on_compute}/{channels}")
        );
    }
    let n = queries.len() as f64;
    println!(
        "{:>5} {:>14.1} {:>12.1} {:>9.3} {:>16}",
        "sum",
        sum_alone,
        sum_with,
        sum_with / sum_alone,
        format!("{compute_channels}/{all_channels}")
    );
    println!(
        "geometric mean ratio, with {compute} compute nodes / storage only: {:.3}; {:.0}% of channels ran on compute nodes; component cache: not built yet (compute nodes' scans read rows from the replicas)",
        (log_ratio / n).exp(),
        100.0 * compute_channels as f64 / all_channels.max(1) as f64
    );
    if !mismatches.is_empty() {
        bail!("answers differ from DataFusion for queries {mismatches:?}");
    }
    Ok(())
}
