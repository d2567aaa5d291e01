//! `tessera bench tpch`: TPC-H on Tessera against plain DataFusion over the same data, in
//! the same process, with the same session settings but one: a local Tessera engine
//! collects a hash join's build side into one shared table up to
//! `tessera_sql::LOCAL_COLLECT_JOIN_BYTES` (4 MiB) where DataFusion's default is 1 MiB.
//!
//! The baseline reads one Parquet file per table, written with the same writer settings as
//! Tessera's components. Each query runs once untimed on both engines (warming caches and
//! checking that the answers agree), then `runs` times alternately; medians are reported.

use crate::commands::load;
use anyhow::{bail, Result};
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use parquet::arrow::ArrowWriter;
use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_sql::Engine;
use tessera_storage::component::writer_properties;
use tessera_storage::{Store, StoreConfig};

pub async fn tpch(
    data_dir: &Path,
    config: StoreConfig,
    sf: f64,
    queries: &[usize],
    runs: usize,
    growth_from: Option<f64>,
    publishes: Option<usize>,
) -> Result<()> {
    let queries = chosen_queries(queries, runs)?;
    if publishes == Some(0) {
        bail!("--publishes-per-table must be at least 1");
    }
    let smaller = match growth_from {
        Some(from) if from >= sf => bail!("--growth-from {from} must be below --sf {sf}"),
        Some(from) => {
            Some(measure(data_dir, config.clone(), from, &queries, runs, publishes).await?)
        }
        None => None,
    };
    let timings = measure(data_dir, config, sf, &queries, runs, publishes).await?;
    println!();
    println!("TPC-H SF {sf}: median of {runs} run(s); ratio = Tessera / DataFusion");
    if let Some(publishes) = publishes {
        println!(
            "each table loaded as up to {publishes} publishes of consecutive rows, not merged"
        );
    }
    print!(
        "{:>5} {:>13} {:>15} {:>7}",
        "query", "tessera (ms)", "datafusion (ms)", "ratio"
    );
    if let Some(from) = growth_from {
        print!(
            " {:>12} {:>12}",
            format!("tessera/SF{from}"),
            format!("df/SF{from}")
        );
    }
    println!("  answer");
    let mut log_ratio_sum = 0.0;
    let mut log_growth_sums = (0.0, 0.0);
    for (i, timing) in timings.iter().enumerate() {
        let ratio = timing.tessera_ms / timing.datafusion_ms;
        log_ratio_sum += ratio.ln();
        print!(
            "{:>5} {:>13.1} {:>15.1} {:>7.3}",
            format!("Q{}", timing.query),
            timing.tessera_ms,
            timing.datafusion_ms,
            ratio
        );
        if let Some(smaller) = &smaller {
            let growth = (
                timing.tessera_ms / smaller[i].tessera_ms,
                timing.datafusion_ms / smaller[i].datafusion_ms,
            );
            log_growth_sums.0 += growth.0.ln();
            log_growth_sums.1 += growth.1.ln();
            print!(" {:>11.2}x {:>11.2}x", growth.0, growth.1);
        }
        println!("  {}", timing.answer);
    }
    let geomean = |log_sum: f64| (log_sum / timings.len() as f64).exp();
    println!("geometric mean ratio: {:.3}", geomean(log_ratio_sum));
    if let Some(from) = growth_from {
        println!(
            "time from SF {from} to SF {sf} ({:.0}x the data), geometric mean: Tessera {:.2}x, DataFusion {:.2}x",
            sf / from,
            geomean(log_growth_sums.0),
            geomean(log_growth_sums.1)
        );
    }
    let mismatches: Vec<usize> = timings
        .iter()
        .chain(smaller.iter().flatten())
        .filter(|t| t.answer != "same")
        .map(|t| t.query)
        .collect();
    if !mismatches.is_empty() {
        bail!("answers differ from DataFusion for queries {mismatches:?}");
    }
    Ok(())
}

/// One query's medians on both engines, and whether their answers agree.
struct QueryTiming {
    query: usize,
    tessera_ms: f64,
    datafusion_ms: f64,
    answer: String,
}

/// Loads TPC-H at `sf` (once: a later run reuses it) and times every query on both engines.
async fn measure(
    data_dir: &Path,
    config: StoreConfig,
    sf: f64,
    queries: &[usize],
    runs: usize,
    publishes: Option<usize>,
) -> Result<Vec<QueryTiming>> {
    let bench_dir = match publishes {
        None => data_dir.join(format!("bench-tpch-sf{sf}")),
        Some(n) => data_dir.join(format!("bench-tpch-sf{sf}-{n}-publishes")),
    };
    // A table loaded as several epochs (lineitem from SF 10 on) is merged to one component
    // per partition once loaded, as a store's merges leave a table that stopped changing:
    // the queries then read what an SF 1 table is read as. Asked to load each table as
    // several publishes, the bench keeps them apart, as a table appended to over time
    // holds them until its merges.
    let config = StoreConfig {
        merge_threshold: publishes.unwrap_or(1),
        tiered_merges: publishes.is_none(),
        ..config
    };
    let store = Store::open(&bench_dir.join("tessera"), config)?;
    if store.table_names().is_empty() {
        println!("loading TPC-H SF {sf} into {}", bench_dir.display());
        let target = super::target::Target::local(store.clone());
        load::tpch_in_publishes(&target, sf, &[], true, publishes).await?;
        store.checkpoint()?;
    }
    let baseline = baseline_context(&bench_dir.join("datafusion"), sf).await?;
    let engine = Engine::new(store);
    let mut timings = Vec::with_capacity(queries.len());
    for &q in queries {
        let sql = tessera_tpch::query(q);
        let ours = engine.query(sql).await?;
        let theirs = baseline.sql(sql).await?.collect().await?;
        let answer = match tessera_tpch::compare::same_answer(&theirs, &ours, 1e-9) {
            Ok(()) => "same".to_string(),
            Err(diff) => format!("DIFFERENT: {diff}"),
        };
        let mut tessera_times = Vec::with_capacity(runs);
        let mut datafusion_times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let started = Instant::now();
            engine.query(sql).await?;
            tessera_times.push(started.elapsed());
            let started = Instant::now();
            baseline.sql(sql).await?.collect().await?;
            datafusion_times.push(started.elapsed());
        }
        timings.push(QueryTiming {
            query: q,
            tessera_ms: median(&mut tessera_times).as_secs_f64() * 1e3,
            datafusion_ms: median(&mut datafusion_times).as_secs_f64() * 1e3,
            answer,
        });
    }
    Ok(timings)
}

/// The TPC-H queries a benchmark runs (all 22 if none are named), checked, with `runs`.
pub(super) fn chosen_queries(queries: &[usize], runs: usize) -> Result<Vec<usize>> {
    let queries: Vec<usize> = if queries.is_empty() {
        (1..=22).collect()
    } else {
        queries.to_vec()
    };
    if let Some(bad) = queries.iter().find(|q| !(1..=22).contains(*q)) {
        bail!("TPC-H has queries 1 to 22, not {bad}");
    }
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    Ok(queries)
}

pub(super) fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Plain DataFusion over one Parquet file per table, generated from the same data.
/// The plain-DataFusion baseline of the cluster benchmarks: the same directory the
/// single-store `bench tpch` writes its Parquet files to, so they are generated once.
pub(super) async fn shared_baseline(data_dir: &Path, sf: f64) -> Result<SessionContext> {
    let dir = data_dir
        .join(format!("bench-tpch-sf{sf}"))
        .join("datafusion");
    baseline_context(&dir, sf).await
}

pub(super) async fn baseline_context(dir: &Path, sf: f64) -> Result<SessionContext> {
    std::fs::create_dir_all(dir)?;
    let ctx = SessionContext::new();
    for table in tessera_tpch::TABLES {
        let path = dir.join(format!("{}.parquet", table.name));
        if !path.exists() {
            let tmp = path.with_extension("parquet.tmp");
            let mut writer = ArrowWriter::try_new(
                File::create(&tmp)?,
                table.schema(),
                Some(writer_properties()),
            )?;
            for batch in table.generate(sf, 64 * 1024) {
                writer.write(&batch?)?;
            }
            writer.close()?;
            std::fs::rename(&tmp, &path)?;
        }
        ctx.register_parquet(
            table.name,
            path.to_string_lossy().as_ref(),
            ParquetReadOptions::default(),
        )
        .await?;
    }
    Ok(ctx)
}
