//! `tessera load tpch`: generate TPC-H in-process and publish each table as one epoch.

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Arc;
use std::time::Instant;
use tessera_sql::Engine;
use tessera_storage::{Store, TableChanges};

/// Rows per generated batch.
const GENERATE_BATCH_ROWS: usize = 64 * 1024;

pub async fn tpch(store: Arc<Store>, sf: f64, report: bool) -> Result<()> {
    if !(sf > 0.0 && sf <= 1000.0) {
        bail!("scale factor must be in (0, 1000], got {sf}");
    }
    let engine = Engine::new(store.clone());
    for table in tessera_tpch::TABLES {
        if store.table_def(table.name).is_some() {
            bail!(
                "table {:?} already exists; load into a fresh --data-dir or DROP TABLE {} first",
                table.name,
                table.name
            );
        }
    }
    let started = Instant::now();
    for table in tessera_tpch::TABLES {
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
        let store = store.clone();
        let epoch = tokio::task::spawn_blocking(move || {
            store.publish(vec![TableChanges {
                table: table.name.into(),
                upserts: batches,
                deletes: vec![],
            }])
        })
        .await??;
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
