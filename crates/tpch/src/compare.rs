//! Deciding whether two query answers are the same: the same multiset of rows, with
//! floating-point values equal to a relative tolerance and everything else exactly equal.

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float32Type, Float64Type};
use arrow::util::display::{ArrayFormatter, FormatOptions};

#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Null,
    Float(f64),
    Exact(String),
}

impl Cell {
    /// A key that sorts equal values together even when floats differ in the last bits.
    fn sort_key(&self) -> String {
        match self {
            Cell::Null => "\u{0}".into(),
            Cell::Float(f) => format!("{f:.6e}"),
            Cell::Exact(s) => s.clone(),
        }
    }

    fn matches(&self, other: &Cell, rel_tol: f64) -> bool {
        match (self, other) {
            (Cell::Float(a), Cell::Float(b)) => {
                a == b
                    || (a - b).abs() <= rel_tol * a.abs().max(b.abs())
                    || (a.is_nan() && b.is_nan())
            }
            (a, b) => a == b,
        }
    }
}

fn cells(column: &ArrayRef) -> Result<Vec<Cell>, String> {
    let len = column.len();
    match column.data_type() {
        DataType::Float64 => {
            let a = column.as_primitive::<Float64Type>();
            Ok((0..len)
                .map(|i| {
                    if a.is_null(i) {
                        Cell::Null
                    } else {
                        Cell::Float(a.value(i))
                    }
                })
                .collect())
        }
        DataType::Float32 => {
            let a = column.as_primitive::<Float32Type>();
            Ok((0..len)
                .map(|i| {
                    if a.is_null(i) {
                        Cell::Null
                    } else {
                        Cell::Float(a.value(i) as f64)
                    }
                })
                .collect())
        }
        _ => {
            let formatter = ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())
                .map_err(|e| e.to_string())?;
            Ok((0..len)
                .map(|i| {
                    if column.is_null(i) {
                        Cell::Null
                    } else {
                        Cell::Exact(formatter.value(i).to_string())
                    }
                })
                .collect())
        }
    }
}

fn rows(batches: &[RecordBatch]) -> Result<Vec<Vec<Cell>>, String> {
    let mut out: Vec<Vec<Cell>> = Vec::new();
    for batch in batches {
        let columns: Vec<Vec<Cell>> = batch
            .columns()
            .iter()
            .map(cells)
            .collect::<Result<_, _>>()?;
        for row in 0..batch.num_rows() {
            out.push(columns.iter().map(|c| c[row].clone()).collect());
        }
    }
    out.sort_by_cached_key(|row| row.iter().map(Cell::sort_key).collect::<Vec<_>>());
    Ok(out)
}

/// `Ok` if `actual` holds the same rows as `expected`; otherwise the first difference.
pub fn same_answer(
    expected: &[RecordBatch],
    actual: &[RecordBatch],
    rel_tol: f64,
) -> Result<(), String> {
    compare_rows(&rows(expected)?, &rows(actual)?, rel_tol)
}

/// As [`same_answer`], where `actual` is rows of text as a client such as `psql` prints
/// them (`None` for NULL): a value of a float column of `expected` is parsed as a float,
/// any other is compared as Arrow displays it.
pub fn same_text_answer(
    expected: &[RecordBatch],
    actual: &[Vec<Option<String>>],
    rel_tol: f64,
) -> Result<(), String> {
    let float_columns: Vec<bool> = match expected.first() {
        Some(batch) => batch
            .schema()
            .fields()
            .iter()
            .map(|f| matches!(f.data_type(), DataType::Float64 | DataType::Float32))
            .collect(),
        None => Vec::new(),
    };
    let mut actual: Vec<Vec<Cell>> = actual
        .iter()
        .map(|row| {
            row.iter()
                .enumerate()
                .map(|(i, text)| match text {
                    None => Ok(Cell::Null),
                    Some(text) if float_columns.get(i).copied().unwrap_or(false) => text
                        .parse::<f64>()
                        .map(Cell::Float)
                        .map_err(|e| format!("column {i}: {text:?} is not a float: {e}")),
                    Some(text) => Ok(Cell::Exact(text.clone())),
                })
                .collect::<Result<Vec<Cell>, String>>()
        })
        .collect::<Result<_, _>>()?;
    actual.sort_by_cached_key(|row| row.iter().map(Cell::sort_key).collect::<Vec<_>>());
    compare_rows(&rows(expected)?, &actual, rel_tol)
}

fn compare_rows(expected: &[Vec<Cell>], actual: &[Vec<Cell>], rel_tol: f64) -> Result<(), String> {
    if expected.len() != actual.len() {
        return Err(format!(
            "expected {} rows, got {}",
            expected.len(),
            actual.len()
        ));
    }
    for (i, (e, a)) in expected.iter().zip(actual).enumerate() {
        if e.len() != a.len() {
            return Err(format!(
                "row {i}: expected {} columns, got {}",
                e.len(),
                a.len()
            ));
        }
        if !e.iter().zip(a).all(|(x, y)| x.matches(y, rel_tol)) {
            return Err(format!("row {i} differs: expected {e:?}, got {a:?}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array};
    use arrow::datatypes::{Field, Schema};
    use std::sync::Arc;

    fn batch(k: Vec<i64>, v: Vec<f64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Float64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(k)),
                Arc::new(Float64Array::from(v)),
            ],
        )
        .unwrap()
    }

    #[test]
    fn order_and_float_noise_do_not_matter_but_values_do() {
        let a = batch(vec![1, 2], vec![0.1 + 0.2, 5.0]);
        let b = batch(vec![2, 1], vec![5.0, 0.3]);
        assert!(same_answer(&[a.clone()], &[b], 1e-9).is_ok());
        let c = batch(vec![1, 2], vec![0.31, 5.0]);
        assert!(same_answer(&[a.clone()], &[c], 1e-9).is_err());
        let d = batch(vec![1], vec![0.3]);
        assert!(same_answer(&[a], &[d], 1e-9)
            .unwrap_err()
            .contains("expected 2 rows"));
    }
}
