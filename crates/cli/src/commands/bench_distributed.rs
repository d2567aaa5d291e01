//! `tessera bench tpch --nodes N`: TPC-H on an N-node local cluster against a 1-node
//! cluster and plain DataFusion over the same data, in one run on this machine.
//!
//! Both clusters run the same distributed engine (on one node every exchange stays in
//! the process). Each query runs once untimed on every engine (warming caches, checking
//! the answers agree, and measuring the bytes the N-node run exchanged through
//! `EXPLAIN ANALYZE`, with co-located joins and without), then `runs` times in turn;
//! medians are reported.

use super::bench::{chosen_queries, median, shared_baseline};
use super::local_cluster::LocalCluster;
use super::target::Target;
use super::timing::timed;
use super::up::UpOptions;
use anyhow::{bail, Context, Result};
use arrow::array::{Array, StringArray};
use std::path::Path;
use std::time::Duration;
use tessera_server::{ClusterClient, RecoveryOutcome};

/// One local cluster for the benchmark, with TPC-H loaded.
pub(super) async fn cluster(
    root: &Path,
    nodes: u64,
    partitions: u32,
    sf: f64,
) -> Result<(LocalCluster, ClusterClient)> {
    let options = UpOptions::new(nodes, partitions, 3);
    let mut cluster = LocalCluster::start_on_free_ports(root, options)?;
    cluster.wait_formed(Duration::from_secs(60)).await?;
    let client = cluster.client(0);
    ensure_tpch(&cluster, sf, &format!("{nodes}-node cluster"), root).await?;
    Ok((cluster, client))
}

/// Loads TPC-H SF `sf` into `cluster` (called `what`, under `root`) unless a run before
/// this one did.
pub(super) async fn ensure_tpch(
    cluster: &LocalCluster,
    sf: f64,
    what: &str,
    root: &Path,
) -> Result<()> {
    let target = Target::Cluster(cluster.client(0));
    if target.table_def("lineitem").await?.is_none() {
        println!(
            "loading TPC-H SF {sf} into the {what} under {}",
            root.display()
        );
        // The load ends settled.
        super::load::tpch(&target, sf, &[], true).await?;
    } else {
        // Every node settles what it holds (flushes, merges each partition down to one
        // component, ships them to the standbys), as a bulk load ends: each cluster a
        // benchmark compares then scans one file per partition, however an earlier run's
        // load was cut into publishes and whenever its checkpoints ran.
        target.settle().await?;
    }
    Ok(())
}

/// Turns co-located joins off for one request, to compare.
const APART: &str = "/*+ SET tessera.colocate = false */";

/// The bytes an `EXPLAIN ANALYZE` of `sql` (after `hint`) reports as exchanged between
/// nodes.
async fn bytes_exchanged(client: &ClusterClient, hint: &str, sql: &str) -> Result<u64> {
    analyzed_number(client, hint, sql, "bytes exchanged ").await
}

/// The number that follows `label` in an `EXPLAIN ANALYZE` of `sql` (after `hint`).
async fn analyzed_number(
    client: &ClusterClient,
    hint: &str,
    sql: &str,
    label: &str,
) -> Result<u64> {
    let batches = client
        .query(&format!("{hint} EXPLAIN ANALYZE {sql}"))
        .await?;
    for batch in &batches {
        let plans = batch
            .column(1)
            .as_any()
            .downcast_ref::<StringArray>()
            .context("EXPLAIN ANALYZE returns its plan as text")?;
        for i in 0..plans.len() {
            if let Some(rest) = plans.value(i).split(label).nth(1) {
                let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                return Ok(digits.parse()?);
            }
        }
    }
    bail!("EXPLAIN ANALYZE did not report {}", label.trim())
}

/// Each node process's peak resident memory since the last [`reset_peak_memory`], in
/// bytes (`VmHWM` of `/proc/<pid>/status`); `None` where it cannot be read.
fn peak_memory(cluster: &LocalCluster, nodes: u64) -> Vec<Option<u64>> {
    (1..=nodes)
        .map(|id| {
            let status =
                std::fs::read_to_string(format!("/proc/{}/status", cluster.pid(id)?)).ok()?;
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .collect()
}

/// Starts each node process's peak memory afresh (`clear_refs` 5), so the peak printed
/// is the queries', not the load's. Best effort: an older kernel keeps the load's peak.
fn reset_peak_memory(cluster: &LocalCluster, nodes: u64) {
    for id in 1..=nodes {
        if let Some(pid) = cluster.pid(id) {
            let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
        }
    }
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("?".to_string(), |b| {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    })
}

/// A memory-limited run of the N-node cluster: each query again under
/// `tessera.query_memory_limit`, its answer checked and its spilled bytes counted.
struct Limited {
    limit: String,
    hint: String,
    spilled: u64,
    /// Queries that failed under the limit.
    failed: Vec<usize>,
    /// Queries that ran again with sort-merge joins: a hash join's build side did not fit.
    spilling_joins: Vec<usize>,
}

impl Limited {
    fn new(limit: &str) -> Limited {
        Limited {
            limit: limit.to_string(),
            hint: format!("/*+ SET tessera.query_memory_limit = '{limit}' */"),
            spilled: 0,
            failed: Vec::new(),
            spilling_joins: Vec::new(),
        }
    }
}

pub async fn run(
    data_dir: &Path,
    nodes: u64,
    partitions: u32,
    sf: f64,
    queries: &[usize],
    runs: usize,
    memory_limit: Option<&str>,
) -> Result<()> {
    if nodes < 2 {
        bail!("--nodes compares a cluster with one node: give 2 or more");
    }
    let queries = chosen_queries(queries, runs)?;
    let root = data_dir.join(format!("bench-tpch-cluster-sf{sf}"));
    let (many_nodes, many) =
        cluster(&root.join(format!("nodes-{nodes}")), nodes, partitions, sf).await?;
    let (one_node, one) = cluster(&root.join("nodes-1"), 1, partitions, sf).await?;
    let baseline = shared_baseline(data_dir, sf).await?;
    let mut limited = memory_limit.map(Limited::new);
    reset_peak_memory(&many_nodes, nodes);
    reset_peak_memory(&one_node, 1);

    println!();
    println!(
        "TPC-H SF {sf}: median of {runs} run(s); {nodes} node processes and 1 share this machine's {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>5} {:>12} {:>12} {:>15} {:>11} {:>11} {:>14} {:>14}  answer",
        "query",
        format!("{nodes}-node (ms)"),
        "1-node (ms)",
        "datafusion (ms)",
        format!("{nodes}n/df"),
        format!("{nodes}n/1n"),
        "bytes exch.",
        "not colocated"
    );
    let (mut log_vs_df, mut log_vs_one) = (0.0f64, 0.0f64);
    let (mut sum_many, mut sum_one, mut sum_df) = (0.0, 0.0, 0.0);
    let (mut total_bytes, mut total_apart) = (0u64, 0u64);
    let mut mismatches = Vec::new();
    for &q in &queries {
        let sql = tessera_tpch::query(q);
        let expected = baseline.sql(sql).await?.collect().await?;
        let mut answer = "same".to_string();
        for (name, client) in [("cluster", &many), ("1-node", &one)] {
            let actual = client.query(sql).await?;
            if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
                mismatches.push(q);
                answer = format!("DIFFERENT on {name}: {diff}");
            }
        }
        let bytes = bytes_exchanged(&many, "", sql).await?;
        let apart = bytes_exchanged(&many, APART, sql).await?;
        let mut limited_ms = None;
        if let Some(limited) = limited.as_mut() {
            let hinted = format!("{} {sql}", limited.hint);
            match timed(|| many.query_with_notices(&hinted)).await {
                Ok((elapsed, (actual, notices))) => {
                    let ran_again = notices
                        .iter()
                        .any(|n| matches!(n.recovery, Some(RecoveryOutcome::SpillingJoins { .. })));
                    if ran_again {
                        limited.spilling_joins.push(q);
                    }
                    if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9)
                    {
                        mismatches.push(q);
                        answer = format!("DIFFERENT under {}: {diff}", limited.limit);
                    }
                    limited.spilled +=
                        analyzed_number(&many, &limited.hint, sql, "bytes spilled ").await?;
                    limited_ms = Some(elapsed.as_secs_f64() * 1e3);
                }
                // A query that cannot fit even so is reported, and the benchmark goes on.
                Err(error) => {
                    limited.failed.push(q);
                    answer = format!("{answer}; FAILED under {}: {error}", limited.limit);
                }
            }
        }
        total_bytes += bytes;
        total_apart += apart;
        let (mut t_many, mut t_one, mut t_df) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            t_many.push(timed(|| many.query(sql)).await?.0);
            t_one.push(timed(|| one.query(sql)).await?.0);
            t_df.push(
                timed(|| async { baseline.sql(sql).await?.collect().await })
                    .await?
                    .0,
            );
        }
        let ms = |times: &mut Vec<Duration>| median(times).as_secs_f64() * 1e3;
        let (m, o, d) = (ms(&mut t_many), ms(&mut t_one), ms(&mut t_df));
        sum_many += m;
        sum_one += o;
        sum_df += d;
        log_vs_df += (m / d).ln();
        log_vs_one += (m / o).ln();
        println!(
            "{:>5} {:>12.1} {:>12.1} {:>15.1} {:>11.3} {:>11.3} {:>14} {:>14}  {answer}",
            format!("Q{q}"),
            m,
            o,
            d,
            m / d,
            m / o,
            bytes,
            apart
        );
        if let Some(ms) = limited_ms {
            println!("{:>5} {ms:>12.1} under tessera.query_memory_limit", "");
        }
    }
    let n = queries.len() as f64;
    println!(
        "{:>5} {:>12.1} {:>12.1} {:>15.1} {:>11.3} {:>11.3} {:>14} {:>14}",
        "sum",
        sum_many,
        sum_one,
        sum_df,
        sum_many / sum_df,
        sum_many / sum_one,
        total_bytes,
        total_apart
    );
    println!(
        "geometric mean ratio: {nodes}-node / DataFusion {:.3}, {nodes}-node / 1-node {:.3}; total bytes exchanged {total_bytes} ({:.2} of the {total_apart} exchanged without co-located joins)",
        (log_vs_df / n).exp(),
        (log_vs_one / n).exp(),
        total_bytes as f64 / total_apart.max(1) as f64
    );
    let peaks: Vec<String> = peak_memory(&many_nodes, nodes)
        .into_iter()
        .enumerate()
        .map(|(i, peak)| format!("node {} {}", i + 1, mib(peak)))
        .collect();
    println!(
        "peak memory per node while querying (VmHWM): {nodes}-node cluster {}; 1-node cluster {}",
        peaks.join(", "),
        mib(peak_memory(&one_node, 1)[0])
    );
    if let Some(limited) = &limited {
        println!(
            "with tessera.query_memory_limit = '{}': every answer checked, {} bytes spilled in all, ran again with sort-merge joins: {:?}, failed: {:?}",
            limited.limit, limited.spilled, limited.spilling_joins, limited.failed
        );
    }
    if !mismatches.is_empty() {
        bail!("answers differ from DataFusion for queries {mismatches:?}");
    }
    Ok(())
}
