//! `tessera bench versions`: what the versions a table keeps cost a read of its newest
//! epoch. Lineitem is loaded, then a tenth of it is updated round after round with every
//! version kept; after each round (a publish and a checkpoint, which merges partitions
//! once they crowd) TPC-H Q1 and Q6 run at the newest epoch, and the table prints their
//! time as a ratio to the same queries run in the same process right after the load, when
//! the table had one version. At the end, the same queries `AS OF` the load's epoch.

use super::bench::median;
use crate::commands::load;
use anyhow::{bail, Result};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_common::Epoch;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

/// The TPC-H queries timed: both scan all of lineitem, one with a heavy aggregation.
const QUERIES: [usize; 2] = [1, 6];

pub async fn run(
    data_dir: &Path,
    config: StoreConfig,
    sf: f64,
    rounds: usize,
    runs: usize,
) -> Result<()> {
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    // Every run starts from one version: a directory of its own, removed at the end.
    let bench_dir = data_dir.join(format!("bench-versions-sf{sf}"));
    if bench_dir.exists() {
        std::fs::remove_dir_all(&bench_dir)?;
    }
    let merge_threshold = config.merge_threshold;
    let store = Store::open(&bench_dir, config)?;
    let engine = Engine::new(store.clone());
    println!("loading lineitem at SF {sf} into {}", bench_dir.display());
    load::lineitem_locally(&store, sf).await?;
    let loaded = store.visible_epoch();
    let one_version = time_queries(&engine, None, runs).await?;
    println!(
        "Q{} and Q{} on lineitem, median of {runs} run(s) each; a round updates a tenth of the rows (every version kept, merge threshold {merge_threshold})",
        QUERIES[0], QUERIES[1]
    );
    println!(
        "{:>6} {:>9} {:>12} {:>14} {:>10} {:>9}",
        "round", "versions", "components", "of them hist.", "ms", "ratio"
    );
    let one_version_ms = one_version.as_secs_f64() * 1e3;
    println!(
        "{:>6} {:>9} {:>12} {:>14} {:>10.1} {:>9}",
        "load",
        1,
        components(&store).0,
        0,
        one_version_ms,
        "1.00x"
    );
    for round in 1..=rounds {
        let remainder = round % 10;
        engine
            .execute(&format!(
                "UPDATE lineitem SET l_quantity = l_quantity + 1 WHERE l_orderkey % 10 = {remainder}"
            ))
            .await?;
        store.checkpoint()?;
        let newest = time_queries(&engine, None, runs).await?;
        let (all, history) = components(&store);
        let ms = newest.as_secs_f64() * 1e3;
        println!(
            "{round:>6} {:>9} {all:>12} {history:>14} {ms:>10.1} {:>8.2}x",
            // Rows updated in every round so far have that many versions plus one.
            1 + round.div_ceil(10),
            ms / one_version_ms
        );
    }
    let oldest = time_queries(&engine, Some(loaded), runs).await?;
    let oldest_ms = oldest.as_secs_f64() * 1e3;
    println!(
        "AS OF EPOCH {loaded} (the load): {oldest_ms:.1} ms, {:.2}x",
        oldest_ms / one_version_ms
    );
    drop(engine);
    drop(store);
    std::fs::remove_dir_all(&bench_dir)?;
    Ok(())
}

/// The table's components over all partitions, and how many of them are merges' history.
fn components(store: &Store) -> (usize, usize) {
    let snapshot = store
        .versions_snapshot("lineitem", None)
        .expect("lineitem exists");
    let all: Vec<_> = snapshot
        .partitions
        .iter()
        .flat_map(|p| &p.components)
        .collect();
    (all.len(), all.iter().filter(|c| c.is_history()).count())
}

/// The median time of the queries run one after the other, at `epoch` (the newest if
/// `None`); their answers are checked against the first run's.
async fn time_queries(engine: &Engine, epoch: Option<Epoch>, runs: usize) -> Result<Duration> {
    let sql: Vec<String> = QUERIES
        .iter()
        .map(|&q| {
            let text = tessera_tpch::query(q);
            match epoch {
                // Both queries name lineitem alone on a line of their FROM clause.
                Some(epoch) => text
                    .lines()
                    .map(|line| match line.trim() {
                        "lineitem" => format!("lineitem AS OF EPOCH {epoch}"),
                        _ => line.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                None => text.to_string(),
            }
        })
        .collect();
    if epoch.is_some() && sql.iter().any(|s| !s.contains("AS OF EPOCH")) {
        bail!("could not set the epoch of a TPC-H query's lineitem scan");
    }
    // Once untimed, to warm the caches.
    for s in &sql {
        engine.query(s).await?;
    }
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let started = Instant::now();
        for s in &sql {
            engine.query(s).await?;
        }
        times.push(started.elapsed());
    }
    Ok(median(&mut times))
}
