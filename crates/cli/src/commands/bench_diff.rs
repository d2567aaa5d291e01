//! `tessera bench diff`: the diff between two epochs of lineitem that differ by about 1% of
//! its rows, `tessera_changes`, against what a user would run without it in the same
//! process: a full scan of both epochs, and the same diff as a full outer join of the two
//! epochs on the key.

use super::bench::median;
use crate::commands::load;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_common::Epoch;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

/// Rows whose order key is `≡ CHANGED_REMAINDER (mod 100)` are updated: about 1%.
const CHANGED_REMAINDER: i64 = 7;

pub async fn run(data_dir: &Path, config: StoreConfig, sf: f64, runs: usize) -> Result<()> {
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    // `v2`: the UPDATE writes before images since then; data prepared before them would
    // measure the diff without them.
    let bench_dir = data_dir.join(format!("bench-diff-v2-sf{sf}"));
    let store = Store::open(&bench_dir, config)?;
    let engine = Engine::new(store.clone());
    let (from, to) = prepare(&bench_dir, &store, &engine, sf).await?;
    let rows = count(
        &engine,
        &format!("SELECT count(*) FROM lineitem AS OF EPOCH {to}"),
    )
    .await?;

    let diff = format!("SELECT * FROM tessera_changes('lineitem', {from}, {to})");
    let scan_both = [
        format!("SELECT * FROM lineitem AS OF EPOCH {from}"),
        format!("SELECT * FROM lineitem AS OF EPOCH {to}"),
    ];
    let join = join_diff(from, to);

    // Once untimed: warms the caches and checks that both diffs agree.
    let changed = rows_of(&engine, &diff).await?;
    let joined = rows_of(&engine, &join).await?;
    if changed != joined {
        bail!("tessera_changes found {changed} changed rows, the join {joined}");
    }
    let mut diff_times = Vec::with_capacity(runs);
    let mut scan_times = Vec::with_capacity(runs);
    let mut join_times = Vec::with_capacity(runs);
    for _ in 0..runs {
        diff_times.push(timed(&engine, &[diff.as_str()]).await?);
        scan_times.push(timed(&engine, &[scan_both[0].as_str(), scan_both[1].as_str()]).await?);
        join_times.push(timed(&engine, &[join.as_str()]).await?);
    }
    let ms = |times: &mut Vec<Duration>| median(times).as_secs_f64() * 1e3;
    let (diff_ms, scan_ms, join_ms) = (
        ms(&mut diff_times),
        ms(&mut scan_times),
        ms(&mut join_times),
    );
    println!();
    println!(
        "diff of lineitem (SF {sf}, {rows} rows) from epoch {from} to epoch {to}: {changed} rows changed ({:.2}%); median of {runs} run(s)",
        100.0 * changed as f64 / rows.max(1) as f64
    );
    println!("{:<42} {:>10} {:>9}", "", "ms", "speedup");
    println!("{:<42} {:>10.1} {:>9}", "tessera_changes", diff_ms, "");
    println!(
        "{:<42} {:>10.1} {:>8.1}x  (goal: at least 10x)",
        "full scan of both epochs",
        scan_ms,
        scan_ms / diff_ms
    );
    println!(
        "{:<42} {:>10.1} {:>8.1}x",
        "full outer join of both epochs on the key",
        join_ms,
        join_ms / diff_ms
    );
    Ok(())
}

/// Loads lineitem and updates about 1% of it, once per data directory; the two epochs.
async fn prepare(
    bench_dir: &Path,
    store: &Arc<Store>,
    engine: &Engine,
    sf: f64,
) -> Result<(Epoch, Epoch)> {
    let marker = bench_dir.join("diff-epochs");
    if let Ok(text) = std::fs::read_to_string(&marker) {
        let (from, to) = text
            .trim()
            .split_once(' ')
            .with_context(|| format!("{} is malformed", marker.display()))?;
        return Ok((Epoch(from.parse()?), Epoch(to.parse()?)));
    }
    println!("loading lineitem at SF {sf} into {}", bench_dir.display());
    load::lineitem_locally(store, sf).await?;
    let from = store.visible_epoch();
    println!("updating the rows whose order key is {CHANGED_REMAINDER} mod 100");
    let started = Instant::now();
    engine
        .execute(&format!(
            "UPDATE lineitem SET l_comment = 'changed', l_quantity = l_quantity + 1 WHERE l_orderkey % 100 = {CHANGED_REMAINDER}"
        ))
        .await?;
    println!(
        "the UPDATE (its rows and their before images) took {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    store.checkpoint()?;
    let to = store.visible_epoch();
    std::fs::write(&marker, format!("{} {}\n", from.0, to.0))?;
    Ok((from, to))
}

/// The diff a user would write without `tessera_changes`: both epochs joined on the key,
/// keeping keys on one side only or whose columns differ.
fn join_diff(from: Epoch, to: Epoch) -> String {
    let table = tessera_tpch::TABLES
        .into_iter()
        .find(|t| t.name == "lineitem")
        .expect("lineitem is a TPC-H table");
    let key = ["l_orderkey", "l_linenumber"];
    let schema = table.schema();
    let differs: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| f.name())
        .filter(|name| !key.contains(&name.as_str()))
        .map(|name| format!("(a.{name} IS DISTINCT FROM b.{name})"))
        .collect();
    format!(
        "SELECT * FROM lineitem AS OF EPOCH {from} a FULL OUTER JOIN lineitem AS OF EPOCH {to} b \
         ON a.l_orderkey = b.l_orderkey AND a.l_linenumber = b.l_linenumber \
         WHERE a.l_orderkey IS NULL OR b.l_orderkey IS NULL OR {}",
        differs.join(" OR ")
    )
}

async fn rows_of(engine: &Engine, sql: &str) -> Result<usize> {
    Ok(engine.query(sql).await?.iter().map(|b| b.num_rows()).sum())
}

async fn count(engine: &Engine, sql: &str) -> Result<i64> {
    let batches = engine.query(sql).await?;
    super::answers::first_int64(&batches)?.context("count(*) answers one number")
}

async fn timed(engine: &Engine, statements: &[&str]) -> Result<Duration> {
    let started = Instant::now();
    for sql in statements {
        engine.query(sql).await?;
    }
    Ok(started.elapsed())
}
