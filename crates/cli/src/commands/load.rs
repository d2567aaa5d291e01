//! `tessera load tpch`: generate TPC-H in-process and publish each table as one epoch (a
//! table larger than [`LOAD_CHUNK_BYTES`], as one epoch per chunk: lineitem at SF 10 is
//! about 10 GB of Arrow, more than one publish may hold).

use super::target::Target;
use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;
use tessera_storage::TableChanges;

/// Rows per generated batch.
const GENERATE_BATCH_ROWS: usize = 64 * 1024;

/// Arrow bytes of generated rows published as one epoch, at most: every SF 1 table fits
/// in one (lineitem is about 1.3 GiB as generated; a table loaded as two epochs is read
/// with the versions of both merged until a merge joins them, which the benchmarks'
/// figures at SF 1 do not assume), and a chunk stays well below a store's largest publish
/// (`store.max_publish_bytes`, 8 GiB) and memory: a local bulk publish holds several times
/// its rows' Arrow bytes at its peak.
const LOAD_CHUNK_BYTES: usize = 3 << 29;

/// [`LOAD_CHUNK_BYTES`] for a cluster: its coordinator holds a publish's rows as received
/// and as routed to partitions, and logs them as a replica too, while the other nodes of a
/// local cluster share the same machine's memory. Lineitem at SF 1 as one epoch took a
/// coordinator from 3.2 to 8.1 GB; at SF 10, 1.5 GiB chunks had it killed for memory.
const CLUSTER_LOAD_CHUNK_BYTES: usize = 1 << 29;

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
    tpch_in_publishes(engine, sf, only, report, None).await
}

/// [`tpch`], each table published as about `publishes` epochs of consecutive rows if given
/// (as a table appended to over time holds them), else in as few as its size allows.
pub async fn tpch_in_publishes(
    engine: &Target,
    sf: f64,
    only: &[String],
    report: bool,
    publishes: Option<usize>,
) -> Result<()> {
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
    if tables.iter().any(|t| t.name == "partsupp") {
        if let Some(part) = tessera_tpch::partsupp_key_repeat(sf) {
            bail!(
                "TPC-H's generator repeats partsupp's key at scale factor {sf} (part {part} gets \
                 the same supplier twice, as it can below 0.025): choose another scale factor, \
                 such as 0.01 or 0.1"
            );
        }
    }
    for table in &tables {
        if engine.table_def(table.name).await?.is_some() {
            bail!(
                "table {:?} already exists; load into a fresh --data-dir or DROP TABLE {} first",
                table.name,
                table.name
            );
        }
    }
    let chunk_limit = match engine {
        Target::Local(..) => LOAD_CHUNK_BYTES,
        Target::Cluster(_) => CLUSTER_LOAD_CHUNK_BYTES,
    };
    let started = Instant::now();
    for table in tables {
        engine
            .execute(&tessera_tpch::create_table_sql(&table))
            .await?;
        let progress = ProgressBar::new(table.estimated_rows(sf));
        progress.set_style(
            ProgressStyle::with_template(
                "{msg:>10} [{bar:40}] {human_pos}/{human_len} rows ({per_sec:0})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        progress.set_message(table.name);
        let mut batches = Vec::new();
        let mut chunk_bytes = 0;
        let mut rows = 0u64;
        let mut epochs = Vec::new();
        let mut generated = table.generate(sf, GENERATE_BATCH_ROWS).peekable();
        // Where the next publish ends when a number of publishes is asked for.
        let cut = |published: usize| {
            publishes.map(|n| table.estimated_rows(sf) * (published as u64 + 1) / n.max(1) as u64)
        };
        while let Some(batch) = generated.next() {
            let batch = batch?;
            rows += batch.num_rows() as u64;
            progress.inc(batch.num_rows() as u64);
            chunk_bytes += batch.get_array_memory_size();
            batches.push(batch);
            if chunk_bytes >= chunk_limit
                || cut(epochs.len()).is_some_and(|cut| rows >= cut)
                || generated.peek().is_none()
            {
                progress.set_message(format!("{} (publishing)", table.name));
                let chunk = TableChanges::upserts(table.name, std::mem::take(&mut batches));
                epochs.push(engine.publish(chunk).await?);
                progress.set_message(table.name);
                chunk_bytes = 0;
            }
        }
        progress.finish_and_clear();
        if report {
            let epochs = match (epochs.first(), epochs.last()) {
                (Some(first), Some(last)) if first != last => {
                    format!("epochs {first}..={last}")
                }
                (Some(only), _) => format!("epoch {only}"),
                _ => "no epoch (no rows)".to_string(),
            };
            println!("loaded {rows:>10} rows into {:<9} as {epochs}", table.name);
        }
    }
    // A load in as few publishes as its size allows ends settled: one component per
    // partition. One asked to be cut into publishes keeps them apart, as a table appended
    // to over time would hold them.
    if publishes.is_none() {
        engine.settle().await?;
    }
    if report {
        println!(
            "TPC-H SF {sf} loaded in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
