//! `tessera bench security`: what mutual TLS on the internal port costs. Two 3-node
//! clusters (r = 3) on this machine hold the same data, one under mutual TLS and one in
//! plaintext (`insecure = true`); each publish and each TPC-H query runs on both in turn,
//! in the same run, and the medians are compared.

use super::bench::{chosen_queries, median};
use super::bench_cluster::median_publish_time;
use super::bench_distributed::ensure_tpch;
use super::local_cluster::LocalCluster;
use super::timing::timed;
use super::up::UpOptions;
use anyhow::{bail, Result};
use arrow::array::RecordBatch;
use std::path::Path;
use std::time::Duration;
use tessera_server::ClusterClient;

const NODES: u64 = 3;

/// A 3-node cluster under `root`, plaintext or not, with TPC-H SF `sf` loaded.
async fn cluster(
    root: &Path,
    insecure: bool,
    partitions: u32,
    sf: f64,
) -> Result<(LocalCluster, ClusterClient)> {
    let mut options = UpOptions::new(NODES, partitions, 3);
    options.insecure = insecure;
    let mut cluster = LocalCluster::start_on_free_ports(root, options)?;
    cluster.wait_formed(Duration::from_secs(60)).await?;
    let what = if insecure { "plaintext" } else { "mutual TLS" };
    ensure_tpch(&cluster, sf, &format!("{what} cluster"), root).await?;
    let client = cluster.client(0);
    Ok((cluster, client))
}

pub async fn run(
    data_dir: &Path,
    partitions: u32,
    sf: f64,
    queries: &[usize],
    runs: usize,
) -> Result<()> {
    let queries = chosen_queries(queries, runs)?;
    let root = data_dir.join(format!("bench-security-sf{sf}"));
    let (_secure, secure) = cluster(&root.join("mtls"), false, partitions, sf).await?;
    let (_plain, plain) = cluster(&root.join("insecure"), true, partitions, sf).await?;

    // Publishes: the same lineitem rows (upserts of existing keys) on both, in turn.
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    let rows: Vec<RecordBatch> = lineitem
        .generate(0.02, 64 * 1024)
        .collect::<Result<_, _>>()?;
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    let (mut publish_tls, mut publish_plain) = (Vec::new(), Vec::new());
    for _ in 0..runs.max(3) {
        publish_tls.push(median_publish_time(&secure, &rows, 1).await?);
        publish_plain.push(median_publish_time(&plain, &rows, 1).await?);
    }
    let (publish_tls, publish_plain) = (median(&mut publish_tls), median(&mut publish_plain));

    println!();
    println!(
        "mutual TLS on the internal port vs plaintext: two {NODES}-node clusters (r = 3) on this machine's {} cores, TPC-H SF {sf}, median of {runs} run(s) each, in turn",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>5} {:>10} {:>15} {:>9}  answer",
        "query", "mTLS (ms)", "plaintext (ms)", "mTLS/pt"
    );
    let mut log_ratio = 0.0f64;
    let mut mismatches = Vec::new();
    for &q in &queries {
        let sql = tessera_tpch::query(q);
        let expected = plain.query(sql).await?;
        let actual = secure.query(sql).await?;
        let answer = match tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
            Ok(()) => "same".to_string(),
            Err(diff) => {
                mismatches.push(q);
                format!("DIFFERENT: {diff}")
            }
        };
        let (mut t_tls, mut t_plain) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            t_tls.push(timed(|| secure.query(sql)).await?.0);
            t_plain.push(timed(|| plain.query(sql)).await?.0);
        }
        let (tls, pt) = (median(&mut t_tls), median(&mut t_plain));
        let ratio = tls.as_secs_f64() / pt.as_secs_f64();
        log_ratio += ratio.ln();
        println!(
            "{:>5} {:>10.1} {:>15.1} {:>8.2}x  {answer}",
            format!("Q{q}"),
            tls.as_secs_f64() * 1e3,
            pt.as_secs_f64() * 1e3,
            ratio
        );
    }
    let geomean = (log_ratio / queries.len() as f64).exp();
    println!("TPC-H geomean, mTLS / plaintext: {geomean:.3}x (goal: at most 1.05x)");
    println!(
        "publish of {count} lineitem rows: mTLS {:.1} ms, plaintext {:.1} ms: {:.3}x ({:.0} vs {:.0} rows/s)",
        publish_tls.as_secs_f64() * 1e3,
        publish_plain.as_secs_f64() * 1e3,
        publish_tls.as_secs_f64() / publish_plain.as_secs_f64(),
        count as f64 / publish_tls.as_secs_f64(),
        count as f64 / publish_plain.as_secs_f64()
    );
    if !mismatches.is_empty() {
        bail!("queries {mismatches:?} answered differently under mutual TLS");
    }
    Ok(())
}
