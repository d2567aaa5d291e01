//! `tessera load tpch`: generate TPC-H in-process and publish each table as one epoch.

use super::target::Target;
use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;
use tessera_storage::TableChanges;

/// Rows per generated batch.
const GENERATE_BATCH_ROWS: usize = 64 * 1024;

/// Loads TPC-H lineitem alone into a local store and checkpoints it, as the benchmarks
/// of one table's versions start.
pub async fn lineitem_locally(
    store: &std::sync::Arc<tessera_storage::Store>,
    sf: f64,
) -> Result<()> {
    let target = super::target::Target::local(store.clone());
    tpch(&target, sf, &["lineitem".to_string()], true).await?;
    store.checkpoint()?;
    Ok(())
}

/// Loads the TPC-H tables named in `only` (all eight if empty).
pub async fn tpch(engine: &Target, sf: f64, only: &[String], report: bool) -> Result<()> {
    if !(sf > 0.0 && sf <= 1000.0) {
        bail!("scale factor must be in (0, 1000], got {sf}");
    }
    for name in only {
        if !tessera_tpch::TABLES.iter().any(|t| t.name == name) {
            bail!("{name:?} is not a TPC-H table");
        }
    }
    let tables: Vec<_> = tessera_tpch::TABLES
        .into_iter()
        .filter(|t| only.is_empty() || only.iter().any(|n| n == t.name))
        .collect();
    for table in &tables {
        if engine.table_def(table.name).await?.is_some() {
            bail!(
                "table {:?} already exists; load into a fresh --data-dir or DROP TABLE {} first",
                table.name,
                table.name
            );
        }
    }
    let started = Instant::now();
    for table in tables {
        engine
            .execute(&tessera_tpch::create_table_sql(&table))
            .await?;
        let progress = ProgressBar::new(table.estimated_rows(sf));
        progress.set_style(
            ProgressStyle::with_template(
                "{msg:>10} [{bar:40}] {human_pos}/{human_len} rows ({per_sec})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        progress.set_message(table.name);
        let mut batches = Vec::new();
        let mut rows = 0u64;
        for batch in table.generate(sf, GENERATE_BATCH_ROWS) {
            let batch = batch?;
            rows += batch.num_rows() as u64;
            progress.inc(batch.num_rows() as u64);
            batches.push(batch);
        }
        progress.set_message(format!("{} (publishing)", table.name));
        let epoch = engine
            .publish(TableChanges {
                table: table.name.into(),
                upserts: batches,
                deletes: vec![],
            })
            .await?;
        progress.finish_and_clear();
        if report {
            println!(
                "loaded {:>10} rows into {:<9} as epoch {epoch}",
                rows, table.name
            );
        }
    }
    if report {
        println!(
            "TPC-H SF {sf} loaded in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
