//! `tessera bench recovery`: what surviving a node failure costs, on a local cluster with
//! TPC-H loaded (default 4 nodes, r = 3), in one run:
//!
//! - the normal-execution overhead of `tessera.recovery = lineage` against `none`;
//! - the total time of a query whose peer node is SIGKILLed at 50% of its no-failure
//!   time, under `restart` and under `lineage`, as ratios to the no-failure time (the
//!   median of `--runs` kills per mode, the victim rotating over node 1's peers).
//!
//! With `--as-of`, half of lineitem is updated after the load and every node settled (each
//! partition merged into its current versions and their history), and every query reads
//! its tables `AS OF` the load's epoch: the overhead column then also holds what key order
//! costs such a read under lineage (see `tessera_storage::versions::RowOrder`).
//!
//! Every answer is checked against plain DataFusion on the same data. The killed node is
//! restarted, and rejoins, before the next measurement; the query then runs once more,
//! timed on its own (the first query after a rejoin pays the restarted process's cold
//! start: components hashed on first read, caches empty), so that no kill is measured on a
//! node still paying for the previous one.

use super::bench::{chosen_queries, median, shared_baseline};
use super::bench_distributed::cluster;
use super::timing::timed;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::RecoveryOutcome;
use tessera_server::{ClusterClient, Notice};

/// Runs `sql` under recovery `mode` from `client`.
async fn query_in_mode(
    client: &ClusterClient,
    mode: &str,
    sql: &str,
) -> Result<(Vec<arrow::array::RecordBatch>, Vec<Notice>)> {
    let hinted = format!("/*+ SET tessera.recovery = {mode} */ {sql}");
    Ok(client.query_with_notices(&hinted).await?)
}

/// What one query took with a node killed part-way.
struct Killed {
    elapsed: Duration,
    /// How the query survived: rebuilt from lineage, restarted, or none at all.
    recovered: Option<&'static str>,
    /// For a rebuild: what ran again and how long replanning took.
    rebuilt: Option<String>,
    answer: Vec<arrow::array::RecordBatch>,
    /// The same query, run once more after the killed node rejoined: its time and answer.
    after_rejoin: Duration,
    answer_after_rejoin: Vec<arrow::array::RecordBatch>,
}

/// Runs `sql` under `mode` from node 1, SIGKILLs `victim` after `delay`, and restarts it
/// (waiting until it has rejoined) once the query answered; then runs `sql` once more.
async fn kill_midway(
    cluster: &mut super::local_cluster::LocalCluster,
    mode: &'static str,
    sql: &str,
    delay: Duration,
    victim: u64,
) -> Result<Killed> {
    let run = {
        let client = cluster.client(0);
        let sql = sql.to_string();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = query_in_mode(&client, mode, &sql).await;
            (started.elapsed(), result)
        })
    };
    tokio::time::sleep(delay).await;
    let killed = Instant::now();
    cluster.kill9(victim);
    // A killed process's sockets close as it exits: its peers hear of it no sooner.
    let exit_ms = killed.elapsed().as_millis() as u64;
    tracing::info!(victim, mode, exit_ms, "SIGKILLed, and exited");
    let (elapsed, result) = run.await?;
    let (answer, notices) = result?;
    let recovery = notices.iter().find_map(|n| n.recovery.as_ref());
    cluster.spawn(victim)?;
    cluster.wait_formed(Duration::from_secs(120)).await?;
    let client = cluster.client(0);
    let (after_rejoin, (answer_after_rejoin, _)) =
        timed(|| query_in_mode(&client, mode, sql)).await?;
    Ok(Killed {
        elapsed,
        recovered: recovery.map(|recovery| match recovery {
            RecoveryOutcome::Rebuilt { .. } => "rebuilt",
            RecoveryOutcome::Restarted { .. } => "restarted",
            RecoveryOutcome::Rerouted { .. } => "rerouted",
            RecoveryOutcome::SpillingJoins { .. } => "ran again with spilling joins",
        }),
        rebuilt: match recovery {
            Some(RecoveryOutcome::Rebuilt {
                channels,
                replayed_batches,
                replan_ms,
                placed,
                ..
            }) => Some(format!(
                "{channels} channels rebuilt ({} split over several streams), {replayed_batches} logged batches replayed, replanned in {replan_ms} ms",
                placed.iter().filter(|p| p.contains("split")).count()
            )),
            _ => None,
        },
        answer,
        after_rejoin,
        answer_after_rejoin,
    })
}

pub async fn run(
    data_dir: &Path,
    nodes: u64,
    partitions: u32,
    sf: f64,
    queries: &[usize],
    runs: usize,
    as_of: bool,
) -> Result<()> {
    if nodes < 3 {
        bail!("--nodes must be 3 or more: a node is killed and r = 3 replicas must survive it");
    }
    let queries = chosen_queries(queries, runs)?;
    let root = data_dir.join(format!("bench-recovery-sf{sf}-nodes{nodes}"));
    let (mut cluster, client) = cluster(&root, nodes, partitions, sf).await?;
    // `cluster` flushed every node: standbys take their primaries' components, so a scan
    // rebuilt on a replica reproduces the dead primary's output (they pull in the
    // background).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let baseline = shared_baseline(data_dir, sf).await?;
    let loaded = match as_of {
        true => Some(update_half_of_lineitem(&cluster, nodes).await?),
        false => None,
    };

    println!();
    println!(
        "TPC-H SF {sf} on {nodes} nodes (r = 3): medians of {runs} run(s) per mode, without failures and with a peer SIGKILLed at 50% of the no-failure time"
    );
    if let Some(epoch) = loaded {
        println!(
            "every table read AS OF EPOCH {epoch} (the load), below the update's merges: in key order under lineage, as logged under none and restart"
        );
    }
    println!(
        "{:>5} {:>10} {:>12} {:>9} {:>13} {:>9} {:>13} {:>9} {:>9}  answers",
        "query",
        "none (ms)",
        "lineage (ms)",
        "overhead",
        "restart+kill",
        "ratio",
        "lineage+kill",
        "ratio",
        "rejoined"
    );
    let (mut log_overhead, mut log_restart, mut log_lineage) = (0.0f64, 0.0f64, 0.0f64);
    let mut log_rejoined = 0.0f64;
    let mut failures = Vec::new();
    let mut rebuilds: Vec<String> = Vec::new();
    for (i, &q) in queries.iter().enumerate() {
        let query = tessera_tpch::query(q);
        let expected = baseline.sql(query).await?.collect().await?;
        let sql = &match loaded {
            Some(epoch) => tessera_tpch::read_as_of(query, epoch),
            None => query.to_string(),
        };
        let same = |actual: &[arrow::array::RecordBatch]| {
            tessera_tpch::compare::same_answer(&expected, actual, 1e-9).is_ok()
        };
        for mode in ["none", "lineage"] {
            let (actual, _) = query_in_mode(&client, mode, sql).await?;
            if !same(&actual) {
                failures.push(format!("Q{q} ({mode}, no failure) differs from DataFusion"));
            }
        }
        let (mut t_none, mut t_lineage) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            t_none.push(timed(|| query_in_mode(&client, "none", sql)).await?.0);
            t_lineage.push(timed(|| query_in_mode(&client, "lineage", sql)).await?.0);
        }
        let no_failure = median(&mut t_none);
        let with_lineage = median(&mut t_lineage);
        // Node 1 initiates; the victim rotates over its peers, kill after kill.
        let mut killed: [Vec<Killed>; 2] = Default::default();
        for kill in 0..runs {
            let victim = 2 + ((i * runs + kill) as u64 % (nodes - 1));
            for (m, mode) in ["restart", "lineage"].into_iter().enumerate() {
                let outcome = kill_midway(&mut cluster, mode, sql, no_failure / 2, victim).await?;
                if !same(&outcome.answer) {
                    failures.push(format!(
                        "Q{q} ({mode}, node {victim} killed) differs from DataFusion"
                    ));
                }
                if !same(&outcome.answer_after_rejoin) {
                    failures.push(format!(
                        "Q{q} ({mode}, node {victim} rejoined) differs from DataFusion"
                    ));
                }
                if let Some(detail) = &outcome.rebuilt {
                    rebuilds.push(format!("Q{q}: node {victim} killed: {detail}"));
                }
                killed[m].push(outcome);
            }
        }
        let killed_median =
            |ks: &[Killed]| median(&mut ks.iter().map(|k| k.elapsed).collect::<Vec<_>>());
        let (restart_killed, lineage_killed) =
            (killed_median(&killed[0]), killed_median(&killed[1]));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let ratio = |d: Duration| d.as_secs_f64() / no_failure.as_secs_f64();
        log_overhead += (with_lineage.as_secs_f64() / no_failure.as_secs_f64()).ln();
        log_restart += ratio(restart_killed).ln();
        log_lineage += ratio(lineage_killed).ln();
        // The first run after each rejoin, over both modes' kills.
        let rejoined = median(
            &mut killed
                .iter()
                .flatten()
                .map(|k| k.after_rejoin)
                .collect::<Vec<_>>(),
        );
        log_rejoined += ratio(rejoined).ln();
        // How the kills were survived, e.g. "rebuilt x3" or "rebuilt x2, restarted x1".
        let mark = |ks: &[Killed]| {
            let mut counts: Vec<(&str, usize)> = Vec::new();
            for k in ks {
                let how = match (k.recovered, same(&k.answer)) {
                    (_, false) => "DIFFERENT",
                    (Some(how), true) => how,
                    (None, true) => "finished first",
                };
                match counts.iter_mut().find(|(h, _)| *h == how) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((how, 1)),
                }
            }
            counts
                .iter()
                .map(|(how, n)| format!("{how} x{n}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "{:>5} {:>10.1} {:>12.1} {:>9.3} {:>13.1} {:>9.3} {:>13.1} {:>9.3} {:>9.3}  {}, {}",
            format!("Q{q}"),
            ms(no_failure),
            ms(with_lineage),
            with_lineage.as_secs_f64() / no_failure.as_secs_f64(),
            ms(restart_killed),
            ratio(restart_killed),
            ms(lineage_killed),
            ratio(lineage_killed),
            ratio(rejoined),
            mark(&killed[0]),
            mark(&killed[1]),
        );
    }
    let n = queries.len() as f64;
    println!(
        "geometric mean: lineage / none without failures {:.3}; with a node killed at 50%: restart {:.3}, lineage {:.3} of the no-failure time",
        (log_overhead / n).exp(),
        (log_restart / n).exp(),
        (log_lineage / n).exp()
    );
    println!(
        "first query after the killed node rejoined (the column rejoined): {:.3} of the no-failure time",
        (log_rejoined / n).exp()
    );
    for rebuild in &rebuilds {
        println!("  lineage+kill {rebuild}");
    }
    if !failures.is_empty() {
        bail!("answers differ: {}", failures.join("; "));
    }
    Ok(())
}

/// Updates every other order's lines (new versions of the same values) and settles every
/// node, so that each partition's versions at the load's epoch are split between a merge's
/// current and history components. Returns the load's epoch.
async fn update_half_of_lineitem(
    cluster: &super::local_cluster::LocalCluster,
    nodes: u64,
) -> Result<u64> {
    let client = cluster.client(0);
    let newest = client
        .query("SELECT max(epoch) FROM tessera_epochs")
        .await?;
    let loaded =
        super::answers::first_int64(&newest)?.context("tessera_epochs has no newest epoch")? as u64;
    println!("updating half of lineitem (every other order's lines) after epoch {loaded}");
    let (took, _) = timed(|| {
        client.sql("UPDATE lineitem SET l_quantity = l_quantity WHERE l_orderkey % 2 = 0")
    })
    .await?;
    println!(
        "updated in {:.1} s; settling every node",
        took.as_secs_f64()
    );
    for node in 0..nodes as usize {
        cluster.client(node).settle().await?;
    }
    Ok(loaded)
}
