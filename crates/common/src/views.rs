//! String and binary *view* columns (`Utf8View`, `BinaryView`, what DataFusion and the
//! Parquet reader produce for strings) and what they cost on the wire.
//!
//! A view array keeps its longer values in data buffers that slices and `take` share
//! whole: a slice of ten rows, or the rows of one bucket of a hash split, still holds
//! every byte of the original's buffers. Arrow IPC writes a view array's data buffers as
//! they are, so such a batch sent as it is carries all of those bytes, and an Arrow
//! Flight encoder that splits a large batch into slices of about 2 MiB sends the whole
//! data buffers once per slice: a 64 K-row lineitem batch (15 MB) went as 8 slices each
//! with all of its comments. [`for_the_wire`] sends a batch whole instead (up to 32 MiB), and
//! compacts a batch whose views hold mostly others' values ([`compact_if_wasteful`]), or
//! each slice of a larger one: their values copied into buffers of their own.

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::DataType;
use arrow::error::ArrowError;
use std::sync::Arc;

/// Arrow Flight's default message size (arrow-flight's `FlightDataEncoderBuilder`), about
/// the size a publish's rows are gathered into per partition (`tessera_storage::routing`).
pub const FLIGHT_MESSAGE_BYTES: usize = 2 << 20;

/// Copies the values of every view column of `batch` into buffers of their own (holding
/// only what its views reference); other columns are kept as they are.
pub fn compact_views(batch: RecordBatch) -> Result<RecordBatch, ArrowError> {
    if !batch.columns().iter().any(|c| is_view(c.data_type())) {
        return Ok(batch);
    }
    let columns: Vec<ArrayRef> = batch.columns().iter().map(compact_column).collect();
    RecordBatch::try_new(batch.schema(), columns)
}

/// [`compact_views`] if the view columns' data buffers hold more than twice the bytes their
/// views reference (a slice or a `take`), else `batch` as it is: compacting copies every
/// referenced byte, worth it only when it saves more than it copies.
pub fn compact_if_wasteful(batch: RecordBatch) -> Result<RecordBatch, ArrowError> {
    let view_bytes = view_bytes(&batch);
    compact_if_wasteful_given(batch, view_bytes)
}

/// [`compact_if_wasteful`] with the batch's [`view_bytes`] already counted.
fn compact_if_wasteful_given(
    batch: RecordBatch,
    (held, used): (usize, usize),
) -> Result<RecordBatch, ArrowError> {
    if held > 2 * used {
        compact_views(batch)
    } else {
        Ok(batch)
    }
}

/// The most bytes of rows one Flight message carries: a batch up to this size travels
/// whole (no copy, and no slice to carry shared buffers); a larger one as slices of it.
pub const WIRE_BATCH_BYTES: usize = 32 << 20;

/// `batch` as the batches to send it as: whole up to [`WIRE_BATCH_BYTES`] (compacted first
/// if its views hold mostly others' values), else in slices of at most that, each with its
/// view columns compacted so no slice carries another's values. The encoder must not split
/// them again ([`WIRE_ENCODER_MESSAGE_BYTES`]): it measures a slice by the buffers it
/// shares, and its slices would carry whole string buffers.
pub fn for_the_wire(batch: RecordBatch) -> Result<Vec<RecordBatch>, ArrowError> {
    for_the_wire_within(batch, WIRE_BATCH_BYTES)
}

fn for_the_wire_within(batch: RecordBatch, most: usize) -> Result<Vec<RecordBatch>, ArrowError> {
    let view_bytes = view_bytes(&batch);
    let slices = (sliced_bytes(&batch) + view_bytes.1).div_ceil(most).max(1);
    if slices == 1 {
        return Ok(vec![compact_if_wasteful_given(batch, view_bytes)?]);
    }
    let rows = batch.num_rows();
    let per_slice = rows.div_ceil(slices).max(1);
    (0..rows)
        .step_by(per_slice)
        .map(|start| compact_views(batch.slice(start, per_slice.min(rows - start))))
        .collect()
}

/// The message size a Flight encoder fed by [`for_the_wire`] is given: none of its batches
/// is split again.
pub const WIRE_ENCODER_MESSAGE_BYTES: usize = usize::MAX;

/// The bytes the view columns' data buffers hold, and the bytes their views reference
/// outside the views themselves (values longer than 12 bytes).
fn view_bytes(batch: &RecordBatch) -> (usize, usize) {
    let mut held = 0;
    let mut used = 0;
    for column in batch.columns() {
        match column.data_type() {
            DataType::Utf8View => {
                let array = column.as_string_view();
                held += array.data_buffers().iter().map(|b| b.len()).sum::<usize>();
                used += array.total_buffer_bytes_used();
            }
            DataType::BinaryView => {
                let array = column.as_binary_view();
                held += array.data_buffers().iter().map(|b| b.len()).sum::<usize>();
                used += array.total_buffer_bytes_used();
            }
            _ => {}
        }
    }
    (held, used)
}

/// The bytes of a batch's rows: what its columns' values take, not the capacity of their
/// buffers (a batch sliced from a larger one, or built in a batch-sized buffer, holds more)
/// and not counted twice where columns share a buffer. A view column's values longer than
/// its views are counted as the bytes its views reference (Arrow's slice size leaves a
/// view array's data buffers out altogether).
pub fn rows_bytes(batch: &RecordBatch) -> usize {
    sliced_bytes(batch) + view_bytes(batch).1
}

/// Arrow's slice size of a batch's columns (a view column's views, not its values).
fn sliced_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|c| c.to_data().get_slice_memory_size().unwrap_or(0))
        .sum()
}

fn is_view(data_type: &DataType) -> bool {
    matches!(data_type, DataType::Utf8View | DataType::BinaryView)
}

fn compact_column(column: &ArrayRef) -> ArrayRef {
    match column.data_type() {
        DataType::Utf8View => Arc::new(column.as_string_view().gc()),
        DataType::BinaryView => Arc::new(column.as_binary_view().gc()),
        _ => column.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::{Field, Schema};

    /// `rows` rows, each with a 40-byte string (stored outside its view).
    fn batch(rows: usize) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8View, false),
        ]));
        let strings: StringViewArray = (0..rows)
            .map(|i| Some(format!("{i:040}")))
            .collect::<Vec<_>>()
            .into_iter()
            .collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows as i64)),
                Arc::new(strings),
            ],
        )
        .unwrap()
    }

    fn data_bytes(batch: &RecordBatch) -> usize {
        view_bytes(batch).0
    }

    #[test]
    fn a_slice_is_compacted_only_when_it_holds_others_values() {
        let whole = batch(10_000);
        assert_eq!(data_bytes(&whole), 400_000);
        let kept = compact_if_wasteful(whole.clone()).unwrap();
        assert_eq!(data_bytes(&kept), 400_000, "nothing to save");
        let slice = compact_if_wasteful(whole.slice(100, 10)).unwrap();
        assert_eq!(data_bytes(&slice), 400, "only its own ten values");
        assert_eq!(
            slice.column(1).as_string_view().value(0),
            format!("{:040}", 100)
        );
    }

    #[test]
    fn a_large_batch_travels_as_compact_slices_of_about_a_message_each() {
        let whole = batch(200_000); // 16 bytes of view, 8 of key and 40 of value per row
        assert_eq!(
            for_the_wire(whole.clone()).unwrap().len(),
            1,
            "12.8 MB goes whole"
        );
        let slices = for_the_wire_within(whole.clone(), FLIGHT_MESSAGE_BYTES).unwrap();
        assert!(slices.len() > 1, "{} slices", slices.len());
        assert_eq!(
            slices.iter().map(|s| s.num_rows()).sum::<usize>(),
            whole.num_rows()
        );
        let sent: usize = slices.iter().map(data_bytes).sum();
        assert_eq!(sent, data_bytes(&whole), "every value sent once");
        let per_slice = whole.num_rows().div_ceil(slices.len());
        for slice in &slices {
            assert!(slice.num_rows() <= per_slice);
            assert_eq!(
                data_bytes(slice),
                40 * slice.num_rows(),
                "its own values only"
            );
        }
        // 64 bytes a row: about 2 MiB a slice.
        assert_eq!(
            slices.len(),
            (whole.num_rows() * 64).div_ceil(FLIGHT_MESSAGE_BYTES)
        );
        let rejoined: Vec<String> = slices
            .iter()
            .flat_map(|s| {
                let values = s.column(1).as_string_view();
                (0..s.num_rows())
                    .map(|i| values.value(i).to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(rejoined[123_456], format!("{:040}", 123_456));
    }
}
