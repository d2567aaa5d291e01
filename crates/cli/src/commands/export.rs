//! Exports to files on the machine running the CLI: `COPY (query) TO 'file'` typed into
//! `tessera sql`, and `tessera export --table t --as-of ...`.
//!
//! The query runs wherever the target runs it (a local store, or a cluster through a
//! node); its rows come back and are written here, as psql's `\copy` does. A node never
//! writes a file a client names: its files are not the client's (the PostgreSQL endpoint
//! refuses `COPY ... TO 'file'` and points here). The file appears whole or not at all:
//! it is written beside its final name and renamed once complete.

use super::target::Target;
use anyhow::{bail, Context, Result};
use arrow::array::RecordBatch;
use datafusion::sql::parser::{CopyToSource, DFParser, Statement as DFStatement};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use futures::stream::BoxStream;
use futures::StreamExt;
use std::path::{Path, PathBuf};

/// The file formats an export writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Parquet,
    Csv,
}

impl ExportFormat {
    fn named(name: &str) -> Option<ExportFormat> {
        match name.to_ascii_lowercase().as_str() {
            "parquet" => Some(ExportFormat::Parquet),
            "csv" => Some(ExportFormat::Csv),
            _ => None,
        }
    }

    /// The format a file name asks for by its extension.
    fn of_path(path: &Path) -> Option<ExportFormat> {
        ExportFormat::named(path.extension()?.to_str()?)
    }
}

/// One export: the rows of `query`, written to `path`.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    pub query: String,
    pub path: PathBuf,
    pub format: ExportFormat,
}

/// The statements of `sql`, each either an export (`COPY ... TO 'file'`) or SQL for the
/// target. `None` if `sql` holds no export (then it is sent as it is).
pub fn split_exports(sql: &str) -> Result<Option<Vec<Result<Export, String>>>> {
    if !sql.to_ascii_uppercase().contains("COPY") {
        return Ok(None);
    }
    let mut parts = Vec::new();
    let mut any = false;
    for text in tessera_sql::statements::split_statements(sql) {
        match copy_to_file(&text)? {
            Some(export) => {
                any = true;
                parts.push(Ok(export));
            }
            None => parts.push(Err(text)),
        }
    }
    Ok(any.then_some(parts))
}

/// The export one statement asks for, if it is a `COPY ... TO` a file.
fn copy_to_file(text: &str) -> Result<Option<Export>> {
    let rewritten = tessera_sql::time_travel::rewrite_as_of(text)?;
    let Ok(mut statements) = DFParser::parse_sql_with_dialect(&rewritten, &GenericDialect {})
    else {
        return Ok(None);
    };
    match statements.pop_front() {
        Some(DFStatement::CopyTo(copy)) if statements.is_empty() => Ok(Some(export_of(copy)?)),
        _ => Ok(None),
    }
}

fn export_of(copy: datafusion::sql::parser::CopyToStatement) -> Result<Export> {
    let path = PathBuf::from(&copy.target);
    if copy.target.eq_ignore_ascii_case("stdout") {
        bail!("COPY ... TO STDOUT is for PostgreSQL clients; here, name a file: COPY (query) TO 'out.parquet'");
    }
    if !copy.partitioned_by.is_empty() {
        bail!("COPY ... PARTITIONED BY: an export writes one file");
    }
    let option_format = copy
        .options
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case("format"))
        .map(|(_, value)| value.to_string().trim_matches('\'').to_string());
    let named = copy.stored_as.clone().or(option_format);
    let format = match named {
        Some(name) => ExportFormat::named(&name)
            .with_context(|| format!("COPY ... TO {:?}: format {name:?}; Tessera exports parquet or csv", copy.target))?,
        None => ExportFormat::of_path(&path).with_context(|| {
            format!(
                "COPY ... TO {:?}: name the format (STORED AS PARQUET or CSV) or end the file name in .parquet or .csv",
                copy.target
            )
        })?,
    };
    let query = match copy.source {
        CopyToSource::Query(query) => query.to_string(),
        CopyToSource::Relation(table) => format!("SELECT * FROM {table}"),
    };
    Ok(Export {
        query,
        path,
        format,
    })
}

/// Runs `export`'s query on `target` and writes its rows as they arrive; the number of
/// rows written.
pub async fn export(target: &Target, export: &Export) -> Result<usize> {
    let (schema, batches) = target
        .rows(&export.query)
        .await
        .with_context(|| format!("{} has no rows to export", export.query))?;
    let partial = partial_path(&export.path);
    // Rows written so far, on a terminal: an export of a large table takes minutes.
    let progress = indicatif::ProgressBar::new_spinner();
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} exporting to {msg}: {human_pos} rows, {per_sec:0}, {elapsed}",
        )
        .expect("valid template"),
    );
    progress.set_message(export.path.display().to_string());
    let batches = {
        let progress = progress.clone();
        batches
            .inspect(move |batch| {
                if let Ok(batch) = batch {
                    progress.inc(batch.num_rows() as u64);
                }
            })
            .boxed()
    };
    let written = write_file(&partial, export.format, &schema, batches).await;
    progress.finish_and_clear();
    let rows = match written {
        Ok(rows) => rows,
        Err(error) => {
            let _ = std::fs::remove_file(&partial);
            return Err(error.context(format!("writing {}", export.path.display())));
        }
    };
    std::fs::rename(&partial, &export.path)
        .with_context(|| format!("moving the export into place at {}", export.path.display()))?;
    Ok(rows)
}

/// Where a file is written until it is complete.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// Writes `batches` to `path` as they come, then makes the file durable; the rows written.
async fn write_file(
    path: &Path,
    format: ExportFormat,
    schema: &arrow::datatypes::SchemaRef,
    mut batches: BoxStream<'static, Result<RecordBatch>>,
) -> Result<usize> {
    let file = std::fs::File::create(path)?;
    let mut rows = 0;
    match format {
        ExportFormat::Parquet => {
            let mut writer = parquet::arrow::ArrowWriter::try_new(
                file,
                schema.clone(),
                Some(tessera_storage::component::writer_properties()),
            )?;
            while let Some(batch) = batches.next().await {
                let batch = batch?;
                rows += batch.num_rows();
                writer.write(&batch)?;
            }
            writer.into_inner()?.sync_all()?;
        }
        ExportFormat::Csv => {
            let mut writer = arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(file);
            while let Some(batch) = batches.next().await {
                let batch = batch?;
                rows += batch.num_rows();
                writer.write(&batch)?;
            }
            writer.into_inner().sync_all()?;
        }
    }
    Ok(rows)
}

/// `tessera export`: one table, at a point of its history, to a file.
pub async fn run(
    target: Target,
    table: &str,
    as_of: Option<&str>,
    output: &Path,
    format: Option<ExportFormat>,
) -> Result<()> {
    let format = match format.or_else(|| ExportFormat::of_path(output)) {
        Some(format) => format,
        None => bail!(
            "{}: give --format parquet or csv, or end the file name in .parquet or .csv",
            output.display()
        ),
    };
    let quoted = format!("\"{}\"", table.replace('"', "\"\""));
    let point = match as_of {
        None => String::new(),
        Some(point) if point.bytes().all(|b| b.is_ascii_digit()) => format!(" AS OF EPOCH {point}"),
        Some(point) if tessera_sql::time_travel::parse_timestamp_ms(point).is_ok() => {
            format!(" AS OF TIMESTAMP '{}'", point.replace('\'', "''"))
        }
        Some(tag) => {
            tessera_sql::tags::check_tag_name(tag)?;
            format!(" AS OF TAG \"{tag}\"")
        }
    };
    let export = Export {
        query: format!("SELECT * FROM {quoted}{point}"),
        path: output.to_path_buf(),
        format,
    };
    let rows = self::export(&target, &export).await?;
    println!(
        "exported {rows} rows of {table}{point} to {}",
        output.display()
    );
    Ok(())
}
