//! Reading a one-number answer (a `count(*)`, a `max(...)` over a BIGINT) out of a query's
//! batches.

use anyhow::{Context, Result};
use arrow::array::{Array, Int64Array, RecordBatch};

/// The first column's value in the first row of `batches`, a BIGINT; `None` where no row
/// came back or the value is NULL (a `max` over no rows).
pub fn first_int64(batches: &[RecordBatch]) -> Result<Option<i64>> {
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Ok(None);
    };
    let column = batch.column(0);
    let values = column
        .as_any()
        .downcast_ref::<Int64Array>()
        .with_context(|| format!("expected a BIGINT answer, got {}", column.data_type()))?;
    Ok((!values.is_null(0)).then(|| values.value(0)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::StringArray;
    use std::sync::Arc;

    fn batch(column: arrow::array::ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter([("n", column)]).unwrap()
    }

    #[test]
    fn a_one_number_answer_is_read_and_its_absence_named() {
        let empty = batch(Arc::new(Int64Array::from(Vec::<i64>::new())));
        let seven = batch(Arc::new(Int64Array::from(vec![7])));
        assert_eq!(first_int64(&[empty.clone(), seven]).unwrap(), Some(7));
        assert_eq!(first_int64(&[empty]).unwrap(), None);
        let null = batch(Arc::new(Int64Array::from(vec![None])));
        assert_eq!(first_int64(&[null]).unwrap(), None);
        let text = batch(Arc::new(StringArray::from(vec!["7"])));
        let error = first_int64(&[text]).unwrap_err().to_string();
        assert!(
            error.contains("expected a BIGINT answer, got Utf8"),
            "{error}"
        );
    }
}
