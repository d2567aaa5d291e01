//! `tessera publish`: rows from Parquet or CSV files become one new epoch.

use super::target::Target;
use anyhow::{bail, Context, Result};
use arrow::array::RecordBatch;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_storage::versions::stored_user_schema;
use tessera_storage::{TableChanges, TableDef};

pub async fn run(target: Target, table: &str, delete: bool, files: &[PathBuf]) -> Result<()> {
    let Some(def) = target.table_def(table).await? else {
        bail!("table {table:?} does not exist; CREATE TABLE it first")
    };
    let mut batches = Vec::new();
    for file in files {
        batches.extend(
            read_file(&def, file, delete).with_context(|| format!("reading {}", file.display()))?,
        );
    }
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let changes = if delete {
        TableChanges {
            table: table.into(),
            upserts: vec![],
            deletes: batches,
        }
    } else {
        TableChanges {
            table: table.into(),
            upserts: batches,
            deletes: vec![],
        }
    };
    let epoch = target.publish(changes).await?;
    println!(
        "published {rows} {} to {table} as epoch {epoch}",
        if delete { "deletes" } else { "rows" }
    );
    Ok(())
}

fn read_file(def: &TableDef, path: &Path, delete: bool) -> Result<Vec<RecordBatch>> {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match extension.as_deref() {
        Some("parquet") => {
            let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(path)?)?.build()?;
            Ok(reader.collect::<Result<Vec<_>, _>>()?)
        }
        Some("csv") => {
            let schema = if delete {
                Arc::new(stored_user_schema(def).project(&def.primary_key_indices())?)
            } else {
                stored_user_schema(def)
            };
            let reader = arrow::csv::ReaderBuilder::new(schema)
                .with_header(true)
                .build(File::open(path)?)?;
            Ok(reader.collect::<Result<Vec<_>, _>>()?)
        }
        _ => bail!("unsupported file type: expected .parquet or .csv"),
    }
}
