//! Printing results for people (tables) and scripts (CSV, JSON).

use crate::Format;
use anyhow::Result;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use std::io::Write;
use tessera_sql::StatementOutput;

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
