//! `tessera bench tpch`: TPC-H on Tessera against plain DataFusion over the same data, in
//! the same process, with the same session settings.
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
) -> Result<()> {
    let queries = chosen_queries(queries, runs)?;
    let bench_dir = data_dir.join(format!("bench-tpch-sf{sf}"));
    let store = Store::open(&bench_dir.join("tessera"), config)?;
    if store.table_names().is_empty() {
        println!("loading TPC-H SF {sf} into {}", bench_dir.display());
        load::tpch(&super::target::Target::local(store.clone()), sf, &[], true).await?;
    }
    let baseline = baseline_context(&bench_dir.join("datafusion"), sf).await?;
    let engine = Engine::new(store);

    println!();
    println!("TPC-H SF {sf}: median of {runs} run(s); ratio = Tessera / DataFusion");
    println!(
        "{:>5} {:>13} {:>15} {:>7}  answer",
        "query", "tessera (ms)", "datafusion (ms)", "ratio"
    );
    let mut log_ratio_sum = 0.0;
    let mut mismatches = Vec::new();
    for &q in &queries {
        let sql = tessera_tpch::query(q);
        let ours = engine.query(sql).await?;
        let theirs = baseline.sql(sql).await?.collect().await?;
        let answer = match tessera_tpch::compare::same_answer(&theirs, &ours, 1e-9) {
            Ok(()) => "same".to_string(),
            Err(diff) => {
                mismatches.push(q);
                format!("DIFFERENT: {diff}")
            }
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
        let ours_ms = median(&mut tessera_times).as_secs_f64() * 1e3;
        let theirs_ms = median(&mut datafusion_times).as_secs_f64() * 1e3;
        let ratio = ours_ms / theirs_ms;
        log_ratio_sum += ratio.ln();
        println!(
            "{:>5} {:>13.1} {:>15.1} {:>7.3}  {answer}",
            format!("Q{q}"),
            ours_ms,
            theirs_ms,
            ratio
        );
    }
    println!(
        "geometric mean ratio: {:.3}",
        (log_ratio_sum / queries.len() as f64).exp()
    );
    if !mismatches.is_empty() {
        bail!("answers differ from DataFusion for queries {mismatches:?}");
    }
    Ok(())
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
