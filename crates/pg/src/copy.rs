//! `COPY`: PostgreSQL's bulk paths. `COPY table FROM STDIN` decodes the client's rows
//! (PostgreSQL's text format or CSV) into the table's columns and inserts them as one
//! statement would: one publish, so one epoch (or part of the open transaction's).
//! `COPY table TO STDOUT` and `COPY (query) TO STDOUT` run the query through the engine
//! and send its rows in the same formats.

use crate::errors::user_error;
use arrow::array::{new_null_array, Array, ArrayRef, RecordBatch, StringArray};
use arrow::compute::{cast_with_options, CastOptions};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::sql::sqlparser::ast::{CopyLegacyCsvOption, CopyLegacyOption, CopyOption};
use pgwire::error::PgWireResult;
use std::sync::Arc;

/// The most bytes one `COPY FROM STDIN` may send: its rows are held in memory until the
/// client's CopyDone, then published at once.
pub(crate) const MAX_COPY_BYTES: usize = 1 << 30;

/// How the rows are laid out.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CopyFormat {
    csv: bool,
    delimiter: u8,
    /// The text that stands for NULL: `\N` in text format, an unquoted empty field in CSV.
    null: String,
    header: bool,
    quote: u8,
}

impl CopyFormat {
    /// From `WITH (FORMAT csv, HEADER, DELIMITER ';', NULL 'x')` or the pre-9.0 spelling
    /// (`CSV HEADER`, what psql's `\copy ... csv header` sends). Binary is refused.
    pub(crate) fn from_options(
        options: &[CopyOption],
        legacy: &[CopyLegacyOption],
    ) -> PgWireResult<CopyFormat> {
        let mut csv = false;
        let (mut delimiter, mut null, mut header, mut quote) = (None, None, false, b'"');
        let unsupported = |what: String| user_error("0A000", format!("COPY option {what}"));
        for option in options {
            match option {
                CopyOption::Format(name) => match name.value.to_ascii_lowercase().as_str() {
                    "csv" => csv = true,
                    "text" => csv = false,
                    "binary" => return Err(unsupported("FORMAT binary (use text or csv)".into())),
                    other => {
                        return Err(user_error(
                            "22023",
                            format!("COPY format \"{other}\" not recognized"),
                        ))
                    }
                },
                CopyOption::Delimiter(c) => delimiter = Some(single_byte(*c, "delimiter")?),
                CopyOption::Null(text) => null = Some(text.clone()),
                CopyOption::Header(on) => header = *on,
                CopyOption::Quote(c) => quote = single_byte(*c, "quote")?,
                other => return Err(unsupported(other.to_string())),
            }
        }
        for option in legacy {
            match option {
                CopyLegacyOption::Csv(csv_options) => {
                    csv = true;
                    for csv_option in csv_options {
                        match csv_option {
                            CopyLegacyCsvOption::Header => header = true,
                            CopyLegacyCsvOption::Quote(c) => quote = single_byte(*c, "quote")?,
                            other => return Err(unsupported(other.to_string())),
                        }
                    }
                }
                CopyLegacyOption::Delimiter(c) => delimiter = Some(single_byte(*c, "delimiter")?),
                CopyLegacyOption::Null(text) => null = Some(text.clone()),
                CopyLegacyOption::Header => header = true,
                CopyLegacyOption::Binary => {
                    return Err(unsupported("BINARY (use text or csv)".into()))
                }
                other => return Err(unsupported(other.to_string())),
            }
        }
        if header && !csv {
            return Err(user_error(
                "0A000",
                "COPY HEADER available only in CSV mode",
            ));
        }
        Ok(CopyFormat {
            csv,
            delimiter: delimiter.unwrap_or(if csv { b',' } else { b'\t' }),
            null: null.unwrap_or_else(|| if csv { String::new() } else { "\\N".into() }),
            header,
            quote,
        })
    }

    /// Decodes `data` into rows of `schema` (the table's columns named by the COPY, in its
    /// order); other columns of `table` are NULL.
    pub(crate) fn decode(
        &self,
        data: &[u8],
        columns: &[usize],
        table: &SchemaRef,
    ) -> PgWireResult<RecordBatch> {
        let text = std::str::from_utf8(data).map_err(|e| {
            user_error(
                "22021",
                format!("COPY data is not valid UTF-8 (at byte {})", e.valid_up_to()),
            )
        })?;
        let mut records = if self.csv {
            self.csv_records(text)?
        } else {
            self.text_records(text)?
        };
        if self.header && !records.is_empty() {
            records.remove(0);
        }
        let mut values: Vec<Vec<Option<String>>> =
            vec![Vec::with_capacity(records.len()); columns.len()];
        for (line, record) in records.into_iter().enumerate() {
            if record.len() != columns.len() {
                return Err(user_error(
                    "22P04",
                    format!(
                        "COPY row {}: {} columns, but {} were expected",
                        line + 1,
                        record.len(),
                        columns.len()
                    ),
                ));
            }
            for (column, value) in values.iter_mut().zip(record) {
                column.push(value);
            }
        }
        let rows = values.first().map_or(0, Vec::len);
        let mut arrays: Vec<ArrayRef> = table
            .fields()
            .iter()
            .map(|f| new_null_array(f.data_type(), rows))
            .collect();
        let strict = CastOptions {
            safe: false,
            ..Default::default()
        };
        for (&index, column) in columns.iter().zip(values) {
            let field = table.field(index);
            let strings: ArrayRef = Arc::new(StringArray::from(column));
            arrays[index] =
                cast_with_options(&strings, field.data_type(), &strict).map_err(|error| {
                    user_error("22P02", format!("COPY column {:?}: {error}", field.name()))
                })?;
        }
        RecordBatch::try_new(table.clone(), arrays)
            .map_err(|error| user_error("22P02", format!("COPY rows: {error}")))
    }

    /// PostgreSQL's text format: a row per line, fields split by the delimiter, `\N` for
    /// NULL, backslash escapes; a line `\.` ends the data.
    fn text_records(&self, text: &str) -> PgWireResult<Vec<Vec<Option<String>>>> {
        // The newline ending the last row ends it; it does not start another.
        let text = text.strip_suffix('\n').unwrap_or(text);
        let mut records = Vec::new();
        if text.is_empty() {
            return Ok(records);
        }
        for line in text.split('\n') {
            let line = line.strip_suffix('\r').unwrap_or(line);
            if line == "\\." {
                break;
            }
            let fields = line
                .split(self.delimiter as char)
                .map(|field| (field != self.null).then(|| unescape(field)))
                .collect();
            records.push(fields);
        }
        Ok(records)
    }

    /// CSV: quoted fields may hold delimiters, newlines and doubled quotes; an unquoted
    /// field equal to the NULL text is NULL (a quoted one never is).
    fn csv_records(&self, text: &str) -> PgWireResult<Vec<Vec<Option<String>>>> {
        let (quote, delimiter) = (self.quote as char, self.delimiter as char);
        let mut records = Vec::new();
        let mut record: Vec<Option<String>> = Vec::new();
        let mut field = String::new();
        let (mut quoted, mut in_quotes, mut any) = (false, false, false);
        let mut chars = text.chars().peekable();
        let finish_field =
            |field: &mut String, quoted: &mut bool, record: &mut Vec<Option<String>>| {
                let value = std::mem::take(field);
                record.push((*quoted || value != self.null).then_some(value));
                *quoted = false;
            };
        while let Some(c) = chars.next() {
            any = true;
            if in_quotes {
                if c == quote {
                    if chars.peek() == Some(&quote) {
                        field.push(quote);
                        chars.next();
                    } else {
                        in_quotes = false;
                    }
                } else {
                    field.push(c);
                }
            } else if c == quote {
                in_quotes = true;
                quoted = true;
            } else if c == delimiter {
                finish_field(&mut field, &mut quoted, &mut record);
            } else if c == '\n' || c == '\r' {
                if c == '\r' && chars.peek() == Some(&'\n') {
                    chars.next();
                }
                if record.is_empty() && field.is_empty() && !quoted {
                    continue; // a blank line
                }
                finish_field(&mut field, &mut quoted, &mut record);
                if record == [Some("\\.".to_string())] {
                    return Ok(records);
                }
                records.push(std::mem::take(&mut record));
            } else {
                field.push(c);
            }
        }
        if in_quotes {
            return Err(user_error(
                "22P04",
                "COPY CSV data ends inside a quoted field",
            ));
        }
        if any && (!field.is_empty() || quoted || !record.is_empty()) {
            finish_field(&mut field, &mut quoted, &mut record);
            if record != [Some("\\.".to_string())] {
                records.push(record);
            }
        }
        Ok(records)
    }

    /// Encodes `batch` as rows, one chunk of bytes per row (a CopyData message each).
    pub(crate) fn encode(&self, batch: &RecordBatch) -> PgWireResult<Vec<Vec<u8>>> {
        let options = FormatOptions::new()
            .with_null("")
            .with_timestamp_format(Some("%Y-%m-%d %H:%M:%S%.f"))
            .with_timestamp_tz_format(Some("%Y-%m-%d %H:%M:%S%.f%:z"));
        let formatters = batch
            .columns()
            .iter()
            .map(|column| ArrayFormatter::try_new(column.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| user_error("XX000", format!("COPY TO: {error}")))?;
        let mut rows = Vec::with_capacity(batch.num_rows());
        for row in 0..batch.num_rows() {
            let mut line = String::new();
            for (i, (column, formatter)) in batch.columns().iter().zip(&formatters).enumerate() {
                if i > 0 {
                    line.push(self.delimiter as char);
                }
                if column.is_null(row) {
                    line.push_str(if self.csv { "" } else { &self.null });
                    continue;
                }
                let value = match column.data_type() {
                    // PostgreSQL writes booleans as t and f.
                    DataType::Boolean => {
                        let b = column
                            .as_any()
                            .downcast_ref::<arrow::array::BooleanArray>()
                            .expect("boolean column");
                        (if b.value(row) { "t" } else { "f" }).to_string()
                    }
                    _ => formatter.value(row).to_string(),
                };
                if self.csv {
                    self.push_csv_field(&mut line, &value);
                } else {
                    push_escaped(&mut line, &value, self.delimiter as char);
                }
            }
            line.push('\n');
            rows.push(line.into_bytes());
        }
        Ok(rows)
    }

    /// The header line of `COPY ... TO STDOUT (FORMAT csv, HEADER)`, if asked for.
    pub(crate) fn header_line(&self, schema: &Schema) -> Option<Vec<u8>> {
        self.header.then(|| {
            let mut line = String::new();
            for (i, field) in schema.fields().iter().enumerate() {
                if i > 0 {
                    line.push(self.delimiter as char);
                }
                self.push_csv_field(&mut line, field.name());
            }
            line.push('\n');
            line.into_bytes()
        })
    }

    fn push_csv_field(&self, line: &mut String, value: &str) {
        let (quote, delimiter) = (self.quote as char, self.delimiter as char);
        // An empty string is quoted so it does not read back as NULL.
        let needs_quotes = value.is_empty()
            || value == self.null
            || value.contains([quote, delimiter, '\n', '\r']);
        if needs_quotes {
            line.push(quote);
            for c in value.chars() {
                if c == quote {
                    line.push(quote);
                }
                line.push(c);
            }
            line.push(quote);
        } else {
            line.push_str(value);
        }
    }
}

fn single_byte(c: char, what: &str) -> PgWireResult<u8> {
    u8::try_from(c).ok().filter(u8::is_ascii).ok_or_else(|| {
        user_error(
            "22023",
            format!("COPY {what} must be a single one-byte character"),
        )
    })
}

/// Undoes the text format's backslash escapes.
fn unescape(field: &str) -> String {
    if !field.contains('\\') {
        return field.to_string();
    }
    let mut out = String::with_capacity(field.len());
    let mut chars = field.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('b') => out.push('\u{8}'),
            Some('f') => out.push('\u{c}'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('v') => out.push('\u{b}'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// Applies the text format's escapes to one value.
fn push_escaped(line: &mut String, value: &str, delimiter: char) {
    for c in value.chars() {
        match c {
            '\\' => line.push_str("\\\\"),
            '\n' => line.push_str("\\n"),
            '\r' => line.push_str("\\r"),
            '\t' if delimiter == '\t' => line.push_str("\\t"),
            c if c == delimiter => {
                line.push('\\');
                line.push(c);
            }
            c => line.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::Field;

    fn kv_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]))
    }

    fn text() -> CopyFormat {
        CopyFormat::from_options(&[], &[]).unwrap()
    }

    fn csv(header: bool) -> CopyFormat {
        let mut options = vec![CopyOption::Format("csv".into())];
        if header {
            options.push(CopyOption::Header(true));
        }
        CopyFormat::from_options(&options, &[]).unwrap()
    }

    fn names(batch: &RecordBatch) -> Vec<Option<String>> {
        let names = batch
            .column(1)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        (0..names.len())
            .map(|i| names.is_valid(i).then(|| names.value(i).to_string()))
            .collect()
    }

    #[test]
    fn text_format_reads_nulls_escapes_and_the_end_marker() {
        let data = b"1\tplain\n2\t\\N\n3\ttab\\there\\\\\n\\.\n9\tafter the end\n";
        let batch = text().decode(data, &[0, 1], &kv_schema()).unwrap();
        let keys = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(keys.values().to_vec(), vec![1, 2, 3]);
        assert_eq!(
            names(&batch),
            vec![Some("plain".into()), None, Some("tab\there\\".into())]
        );
    }

    #[test]
    fn csv_reads_quotes_newlines_headers_and_tells_empty_from_null() {
        let data = b"k,name\n1,\"a, \"\"quoted\"\"\nline\"\n2,\n3,\"\"\n";
        let batch = csv(true).decode(data, &[0, 1], &kv_schema()).unwrap();
        assert_eq!(
            names(&batch),
            vec![
                Some("a, \"quoted\"\nline".into()),
                None,
                Some(String::new())
            ]
        );
    }

    #[test]
    fn bad_rows_name_the_problem() {
        let wrong_count = text().decode(b"1\ta\textra\n", &[0, 1], &kv_schema());
        assert!(format!("{:?}", wrong_count.unwrap_err()).contains("3 columns, but 2"));
        let not_a_number = text().decode(b"x\ta\n", &[0, 1], &kv_schema());
        let message = format!("{:?}", not_a_number.unwrap_err());
        assert!(
            message.contains("22P02") && message.contains("COPY column") && message.contains("'x'"),
            "{message}"
        );
        let open_quote = csv(false).decode(b"1,\"never closed\n", &[0, 1], &kv_schema());
        assert!(format!("{:?}", open_quote.unwrap_err()).contains("inside a quoted field"));
        let binary = CopyFormat::from_options(&[CopyOption::Format("binary".into())], &[]);
        assert!(format!("{:?}", binary.unwrap_err()).contains("0A000"));
    }

    #[test]
    fn what_is_encoded_decodes_back_to_the_same_rows() {
        let schema = kv_schema();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
                Arc::new(StringArray::from(vec![
                    Some("tab\tnew\nline\\"),
                    None,
                    Some(""),
                    Some("a,\"b\""),
                ])),
            ],
        )
        .unwrap();
        for format in [text(), csv(false), csv(true)] {
            let mut bytes = format.header_line(&schema).unwrap_or_default();
            bytes.extend(format.encode(&batch).unwrap().concat());
            let back = format.decode(&bytes, &[0, 1], &schema).unwrap();
            assert_eq!(back, batch, "{format:?}");
        }
    }

    #[test]
    fn columns_left_out_of_a_copy_are_null() {
        let batch = text().decode(b"7\n", &[0], &kv_schema()).unwrap();
        assert_eq!(names(&batch), vec![None]);
    }
}
