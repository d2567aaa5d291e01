//! What a record batch holds in memory, and how much memory this machine has.
//!
//! `RecordBatch::get_array_memory_size` adds up every array's buffers, each at the size of
//! its whole allocation. Arrays decoded from one Arrow IPC or Flight message all point into
//! that message's body, so each of a batch's columns is charged the whole body: rows a
//! primary received from a coordinator counted several times their size (lineitem's:
//! about 700 MB counted for the 45 MB of rows one SF 0.1 publish leaves a node), which
//! made a node's memtables look full after a fraction of their threshold (checkpoints on
//! every publish, prepares held back by the memory stall). [`held_bytes`] counts each
//! allocation once.

use arrow::array::{Array, ArrayData, RecordBatch};
use std::collections::HashSet;

/// This machine's memory (`MemTotal` in `/proc/meminfo`), in bytes, or `None` where it
/// cannot be read. Defaults sized by memory (the query pool, the decoded cache) start here.
/// Read once per process: it does not change, and every engine's cache asks for it.
pub fn machine_memory_bytes() -> Option<u64> {
    static MEM_TOTAL: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *MEM_TOTAL.get_or_init(|| {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let total = meminfo
            .lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))?;
        let kib: u64 = total.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    })
}

/// The bytes of memory `batch` keeps alive: every allocation its arrays (and their
/// children and null masks) point into, each counted once, at its capacity.
pub fn held_bytes(batch: &RecordBatch) -> usize {
    let mut seen = HashSet::new();
    let mut total = 0;
    for column in batch.columns() {
        add_allocations(&column.to_data(), &mut seen, &mut total);
    }
    total
}

fn add_allocations(data: &ArrayData, seen: &mut HashSet<usize>, total: &mut usize) {
    let nulls = data.nulls().map(|n| n.buffer());
    for buffer in data.buffers().iter().chain(nulls) {
        // `data_ptr` is the start of the allocation, shared by every slice of it.
        if seen.insert(buffer.data_ptr().as_ptr() as usize) {
            *total += buffer.capacity();
        }
    }
    for child in data.child_data() {
        add_allocations(child, seen, total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::ipc::reader::StreamReader;
    use arrow::ipc::writer::StreamWriter;
    use std::sync::Arc;

    fn batch(rows: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Int64, true),
            Field::new("c", DataType::Utf8View, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows)),
                Arc::new(Int64Array::from_iter(
                    (0..rows).map(|i| (i % 3 > 0).then_some(i)),
                )),
                Arc::new(StringViewArray::from_iter_values(
                    (0..rows).map(|i| format!("a value longer than twelve bytes {i}")),
                )),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_batch_of_its_own_buffers_holds_what_arrow_counts() {
        let batch = batch(10_000);
        // Arrow adds the size of its array structs; the buffers are the same.
        let arrow = batch.get_array_memory_size();
        let held = held_bytes(&batch);
        assert!(
            held <= arrow && arrow - held < 1024,
            "{held} against {arrow}"
        );
    }

    #[test]
    fn a_decoded_message_is_counted_once_however_many_columns_point_into_it() {
        let original = batch(10_000);
        let mut bytes = Vec::new();
        let mut writer = StreamWriter::try_new(&mut bytes, &original.schema()).unwrap();
        writer.write(&original).unwrap();
        writer.finish().unwrap();
        drop(writer);
        let decoded = StreamReader::try_new(std::io::Cursor::new(bytes), None)
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        let held = held_bytes(&decoded);
        let body = original.get_array_memory_size();
        assert!(
            held < body * 2,
            "one body of about {body} bytes, counted {held}"
        );
        assert!(
            decoded.get_array_memory_size() > 2 * held,
            "arrow's own count charges each column the whole body: {} against {held}",
            decoded.get_array_memory_size()
        );
        // A slice keeps the whole allocation alive.
        assert_eq!(held_bytes(&decoded.slice(0, 10)), held);
    }
}
