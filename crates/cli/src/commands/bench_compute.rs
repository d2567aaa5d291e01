//! `tessera bench compute`: what compute-only nodes add to TPC-H. Two local clusters hold
//! the same data: `nodes` storage nodes, and the same plus `compute` compute-only nodes,
//! which take the channels that read no partition, and, under `tessera.scans_on_compute`,
//! the scans too, reading through their component caches. Each query runs once untimed in
//! each way and on plain DataFusion (warming caches and checking the answers), then `runs`
//! times in turn; medians are reported, with the share of each query's channels that ran
//! on the compute nodes (from `EXPLAIN ANALYZE`) and the caches' hit rates. Every process shares this machine's cores, so
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
    let (compute_cluster, with_compute) = cluster(
        &root.join(format!("storage-{nodes}-compute-{compute}")),
        nodes,
        compute,
        partitions,
        sf,
    )
    .await?;
    let baseline = shared_baseline(data_dir, sf).await?;
    let on_compute = |sql: &str| format!("/*+ SET tessera.scans_on_compute = true */ {sql}");

    println!();
    println!(
        "TPC-H SF {sf}: median of {runs} run(s); {nodes} storage nodes alone vs with {compute} compute-only nodes (scans with their data, or on the compute nodes through their component caches), every process on this machine's {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>5} {:>14} {:>12} {:>14} {:>9} {:>9} {:>16}  answer",
        "query",
        format!("{nodes} storage (ms)"),
        format!("+{compute}c (ms)"),
        "+scans (ms)",
        "with/alone",
        "scans/alone",
        "channels on compute"
    );
    let (mut log_with, mut log_scans) = (0.0f64, 0.0f64);
    let (mut sum_alone, mut sum_with, mut sum_scans) = (0.0, 0.0, 0.0);
    let (mut compute_channels, mut all_channels) = (0, 0);
    let mut mismatches = Vec::new();
    for &q in &queries {
        let sql = tessera_tpch::query(q);
        let expected = baseline.sql(sql).await?.collect().await?;
        let mut answer = "same".to_string();
        for (name, client, text) in [
            ("storage only", &storage_only, sql.to_string()),
            ("with compute", &with_compute, sql.to_string()),
            ("scans on compute", &with_compute, on_compute(sql)),
        ] {
            let actual = client.query(&text).await?;
            if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
                mismatches.push(q);
                answer = format!("DIFFERENT {name}: {diff}");
            }
        }
        let (on, channels) = channels_on_compute(&with_compute, sql, nodes).await?;
        compute_channels += on;
        all_channels += channels;
        let (mut t_alone, mut t_with, mut t_scans) = (Vec::new(), Vec::new(), Vec::new());
        let scans_sql = on_compute(sql);
        for _ in 0..runs {
            t_alone.push(timed(|| storage_only.query(sql)).await?.0);
            t_with.push(timed(|| with_compute.query(sql)).await?.0);
            t_scans.push(timed(|| with_compute.query(&scans_sql)).await?.0);
        }
        let ms = |times: &mut Vec<Duration>| median(times).as_secs_f64() * 1e3;
        let (alone, with, scans) = (ms(&mut t_alone), ms(&mut t_with), ms(&mut t_scans));
        sum_alone += alone;
        sum_with += with;
        sum_scans += scans;
        log_with += (with / alone).ln();
        log_scans += (scans / alone).ln();
        println!(
            "{:>5} {:>14.1} {:>12.1} {:>14.1} {:>9.3} {:>9.3} {:>16}  {answer}",
            format!("Q{q}"),
            alone,
            with,
            scans,
            with / alone,
            scans / alone,
            format!("{on}/{channels}")
        );
    }
    let n = queries.len() as f64;
    println!(
        "{:>5} {:>14.1} {:>12.1} {:>14.1} {:>9.3} {:>9.3} {:>16}",
        "sum",
        sum_alone,
        sum_with,
        sum_scans,
        sum_with / sum_alone,
        sum_scans / sum_alone,
        format!("{compute_channels}/{all_channels}")
    );
    println!(
        "geometric mean ratio to storage only: with {compute} compute nodes {:.3}, with scans on them too {:.3}; {:.0}% of channels ran on compute nodes (scans with their data)",
        (log_with / n).exp(),
        (log_scans / n).exp(),
        100.0 * compute_channels as f64 / all_channels.max(1) as f64
    );
    for index in nodes as usize..(nodes + compute) as usize {
        let status = compute_cluster.client(index).status().await?;
        if let Some(cache) = status.cache {
            println!(
                "compute node {}: component cache {} in {} files; {} read from it, {} fetched into it: hit rate {}",
                status.node_id,
                super::scrub::human_bytes(cache.bytes),
                cache.files,
                super::scrub::human_bytes(cache.hit_bytes),
                super::scrub::human_bytes(cache.miss_bytes),
                cache
                    .hit_rate()
                    .map_or("-".to_string(), |rate| format!("{:.1}%", rate * 100.0))
            );
        }
    }
    if !mismatches.is_empty() {
        bail!("answers differ from DataFusion for queries {mismatches:?}");
    }
    Ok(())
}
