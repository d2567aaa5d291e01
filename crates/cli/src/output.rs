//! Printing results for people (tables) and scripts (CSV, JSON).

use crate::Format;
use anyhow::{bail, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use futures::stream::BoxStream;
use futures::StreamExt;
use std::io::Write;
use tessera_server::sql_answers::SqlEvent;
use tessera_sql::StatementOutput;

/// A cluster's answers to statements, as they arrive.
pub type SqlEvents = BoxStream<'static, tessera_server::Result<SqlEvent>>;

/// Prints what a node answers to statements as it arrives. CSV and JSON print each batch
/// at once, so an answer larger than memory prints in little; a table needs every row for
/// its column widths, so its rows are gathered first.
pub async fn print_events(
    mut events: SqlEvents,
    format: Format,
    out: &mut impl Write,
) -> Result<()> {
    let mut next = events.next().await.transpose()?;
    while let Some(event) = next {
        next = match event {
            SqlEvent::Rows(schema) => {
                print_arriving_rows(&schema, &mut events, format, out).await?
            }
            SqlEvent::Done { tag, epoch } => {
                print_output(&StatementOutput::Done { tag, epoch }, format, out)?;
                events.next().await.transpose()?
            }
            SqlEvent::Notice(notice) => {
                eprintln!("NOTICE: {}", notice.message);
                events.next().await.transpose()?
            }
            SqlEvent::Batch(_) => bail!("internal: a node sent rows before their schema"),
        };
    }
    Ok(())
}

/// Prints one statement's rows as they arrive; returns the event that followed them.
async fn print_arriving_rows(
    schema: &SchemaRef,
    events: &mut SqlEvents,
    format: Format,
    out: &mut impl Write,
) -> Result<Option<SqlEvent>> {
    // The next event that is not a batch (notices are printed as they come).
    async fn next_batch(events: &mut SqlEvents) -> Result<Result<RecordBatch, Option<SqlEvent>>> {
        loop {
            return Ok(match events.next().await.transpose()? {
                Some(SqlEvent::Batch(batch)) => Ok(batch),
                Some(SqlEvent::Notice(notice)) => {
                    eprintln!("NOTICE: {}", notice.message);
                    continue;
                }
                other => Err(other),
            });
        }
    }
    match format {
        Format::Table => {
            let mut batches = Vec::new();
            loop {
                match next_batch(events).await? {
                    Ok(batch) => batches.push(batch),
                    Err(after) => {
                        print_rows(schema, &batches, format, out)?;
                        return Ok(after);
                    }
                }
            }
        }
        Format::Csv => {
            let mut writer = arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(&mut *out);
            let mut wrote = false;
            loop {
                match next_batch(events).await? {
                    Ok(batch) => {
                        writer.write(&batch)?;
                        wrote = true;
                    }
                    Err(after) => {
                        if !wrote {
                            writer.write(&RecordBatch::new_empty(schema.clone()))?;
                        }
                        return Ok(after);
                    }
                }
            }
        }
        Format::Json => {
            let mut writer = arrow::json::ArrayWriter::new(&mut *out);
            loop {
                match next_batch(events).await? {
                    Ok(batch) => writer.write(&batch)?,
                    Err(after) => {
                        writer.finish()?;
                        drop(writer);
                        writeln!(out)?;
                        return Ok(after);
                    }
                }
            }
        }
    }
}

pub fn print_output(output: &StatementOutput, format: Format, out: &mut impl Write) -> Result<()> {
    match output {
        StatementOutput::Rows { schema, batches } => print_rows(schema, batches, format, out),
        StatementOutput::Streaming { .. } => {
            anyhow::bail!(
                "internal: an answer still streaming reached the printer; read it whole first"
            )
        }
        StatementOutput::Done { tag, epoch } => {
            match epoch {
                Some(epoch) => writeln!(out, "{tag} (epoch {epoch})")?,
                None => writeln!(out, "{tag}")?,
            }
            Ok(())
        }
    }
}

pub fn print_rows(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    format: Format,
    out: &mut impl Write,
) -> Result<()> {
    match format {
        Format::Table => {
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            if rows == 0 {
                let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                writeln!(out, "({})\n(0 rows)", names.join(", "))?;
            } else {
                writeln!(
                    out,
                    "{}",
                    arrow::util::pretty::pretty_format_batches(batches)?
                )?;
                writeln!(out, "({rows} row{})", if rows == 1 { "" } else { "s" })?;
            }
        }
        Format::Csv => {
            let mut writer = arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(&mut *out);
            if batches.is_empty() {
                writer.write(&RecordBatch::new_empty(schema.clone()))?;
            }
            for batch in batches {
                writer.write(batch)?;
            }
        }
        Format::Json => {
            let mut writer = arrow::json::ArrayWriter::new(&mut *out);
            let refs: Vec<&RecordBatch> = batches.iter().collect();
            writer.write_batches(&refs)?;
            writer.finish()?;
            writeln!(out)?;
        }
    }
    Ok(())
}
