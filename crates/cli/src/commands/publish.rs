//! `tessera publish`: rows from Parquet or CSV files become one new epoch.

use super::target::Target;
use anyhow::{bail, Context, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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
        TableChanges::deletes(table, batches)
    } else {
        TableChanges::upserts(table, batches)
    };
    let epoch = target.publish(changes).await?;
    println!(
        "published {rows} {} to {table} as epoch {epoch}",
        if delete { "deletes" } else { "rows" }
    );
    Ok(())
}

/// Rows per batch read from a file (the readers' default is 1024: each batch is split
/// over the partitions and pays per-batch costs all the way to the replicas' logs).
const READ_BATCH_ROWS: usize = 64 * 1024;

fn read_file(def: &TableDef, path: &Path, delete: bool) -> Result<Vec<RecordBatch>> {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match extension.as_deref() {
        Some("parquet") => {
            let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(path)?)?
                .with_batch_size(READ_BATCH_ROWS)
                .build()?;
            Ok(reader.collect::<Result<Vec<_>, _>>()?)
        }
        Some("csv") => {
            let schema = csv_schema(def, path, delete)?;
            let reader = arrow::csv::ReaderBuilder::new(schema)
                .with_header(true)
                .with_batch_size(READ_BATCH_ROWS)
                .build(File::open(path)?)?;
            Ok(reader.collect::<Result<Vec<_>, _>>()?)
        }
        _ => bail!("unsupported file type: expected .parquet or .csv"),
    }
}

/// The types of a CSV file's columns, named by its header: each must be one of the table's
/// columns as they are now (not one a schema change dropped), in any order; columns left
/// out are checked when the rows are stored (a key is required, a column ALTER TABLE
/// added takes its default). Deletes name the key columns only.
fn csv_schema(def: &TableDef, path: &Path, delete: bool) -> Result<SchemaRef> {
    let (header, _) = arrow::csv::reader::Format::default()
        .with_header(true)
        .infer_schema(File::open(path)?, Some(0))?;
    let columns = def.schema_at(None);
    let keys: Vec<&str> = def
        .primary_key_indices()
        .into_iter()
        .map(|i| def.schema.field(i).name().as_str())
        .collect();
    let mut fields = Vec::with_capacity(header.fields().len());
    for name in header.fields().iter().map(|f| f.name()) {
        let Ok(field) = columns.field_with_name(name) else {
            let names: Vec<&str> = columns.fields().iter().map(|f| f.name().as_str()).collect();
            bail!(
                "the header names column {name:?}, which table {:?} does not have (its columns: {})",
                def.name,
                names.join(", ")
            )
        };
        if delete && !keys.contains(&name.as_str()) {
            bail!(
                "a file of deletes names the key ({}) only, not {name:?}",
                keys.join(", ")
            )
        }
        fields.push(field.clone());
    }
    Ok(Arc::new(Schema::new(fields)))
}
