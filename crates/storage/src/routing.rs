//! Routing rows to the partitions their partition key hashes to: one batch split
//! ([`split_by_partition`]), or a publish's batches gathered, each partition's rows from all
//! of them in one batch ([`gather_by_partition`]).

use crate::catalog::TableDef;
use crate::error::Result;
use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::{concat_batches, take_record_batch};
use std::collections::BTreeMap;
use tessera_common::parallel::{map_in_parallel, threads_for};
use tessera_common::views::{compact_views, rows_bytes, FLIGHT_MESSAGE_BYTES};
use tessera_common::{partition_key_hashes, PartitionId, PartitionRing};

/// Where a batch's partition-key columns are: in rows with all of the table's columns
/// first (as given, as stored), or in rows of its primary key only (delete keys), whose
/// prefix the partition key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsOf {
    TableColumns,
    KeyColumns,
}

/// The partition of each row of `batch`.
fn partitions_of_rows(
    def: &TableDef,
    ring: &PartitionRing,
    batch: &RecordBatch,
    rows_of: RowsOf,
) -> Result<Vec<PartitionId>> {
    debug_assert!(
        rows_of == RowsOf::TableColumns || !def.append_only,
        "an append-only table has no key rows"
    );
    let key_columns: Vec<(&str, &ArrayRef)> = def
        .partition_key
        .iter()
        .enumerate()
        .map(|(position, name)| {
            let index = match rows_of {
                RowsOf::TableColumns => def.column_index(name),
                RowsOf::KeyColumns => position,
            };
            (name.as_str(), batch.column(index))
        })
        .collect();
    Ok(partition_key_hashes(&key_columns)?
        .into_iter()
        .map(|hash| ring.partition_of(hash))
        .collect())
}

/// Splits a batch of the table's columns (stamped or not) into one batch per partition it
/// touches, in partition order.
pub fn split_by_partition(
    def: &TableDef,
    ring: &PartitionRing,
    batch: &RecordBatch,
) -> Result<Vec<(PartitionId, RecordBatch)>> {
    let partitions = partitions_of_rows(def, ring, batch, RowsOf::TableColumns)?;
    // Rows that arrive already split (a replica's prepare stream, one partition per
    // batch) are checked and kept as they are, not copied.
    if let Some(&first) = partitions.first() {
        if partitions.iter().all(|&partition| partition == first) {
            return Ok(vec![(first, batch.clone())]);
        }
    }
    let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); ring.partition_count() as usize];
    for (row, partition) in partitions.into_iter().enumerate() {
        rows_of[partition.0 as usize].push(row as u32);
    }
    let mut out = Vec::new();
    for (partition, rows) in rows_of.into_iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let indices = UInt32Array::from(rows);
        out.push((
            PartitionId(partition as u32),
            compact_views(take_record_batch(batch, &indices)?)?,
        ));
    }
    Ok(out)
}

/// The most bytes of rows [`gather_by_partition`] gathers at once: each partition's rows of
/// a window are copied into a batch of their own, so a window is what is held twice.
pub const GATHER_WINDOW_MOST_BYTES: usize = 128 << 20;

/// The rows a window of [`gather_by_partition`] takes: enough for about a Flight message
/// per partition (so the prepare streams, the replicas' logs and their memtables handle a
/// few large batches, not thousands of small ones), at most [`GATHER_WINDOW_MOST_BYTES`].
fn gather_window_bytes(ring: &PartitionRing) -> usize {
    (ring.partition_count() as usize * FLIGHT_MESSAGE_BYTES)
        .clamp(FLIGHT_MESSAGE_BYTES, GATHER_WINDOW_MOST_BYTES)
}

/// Routes `batches` (one schema, laid out as `rows_of` says) to their partitions: for each
/// partition it touches, its rows in the order given, one batch per window of
/// [`gather_window_bytes`] of input. Each batch's rows are put in partition order once,
/// and each partition's runs of them joined across the window into one batch, its view
/// columns' values copied into buffers of its own: rather than each batch split into a
/// piece per partition (a `take` each, and the pieces' views compacted each) that are
/// then joined and compacted again. A batch is let go once its window is gathered.
pub fn gather_by_partition(
    def: &TableDef,
    ring: &PartitionRing,
    batches: Vec<RecordBatch>,
    rows_of: RowsOf,
) -> Result<BTreeMap<PartitionId, Vec<RecordBatch>>> {
    let window_bytes = gather_window_bytes(ring);
    let mut out: BTreeMap<PartitionId, Vec<RecordBatch>> = BTreeMap::new();
    let mut window: Vec<RecordBatch> = Vec::new();
    let mut held = 0;
    for batch in batches.into_iter().filter(|b| b.num_rows() > 0) {
        let size = rows_bytes(&batch);
        if held + size > window_bytes && !window.is_empty() {
            gather_window(
                def,
                ring,
                std::mem::take(&mut window),
                held,
                rows_of,
                &mut out,
            )?;
            held = 0;
        }
        held += size;
        window.push(batch);
    }
    if !window.is_empty() {
        gather_window(def, ring, window, held, rows_of, &mut out)?;
    }
    Ok(out)
}

/// Below this many bytes a window is gathered on the calling thread alone: starting
/// threads would cost more than they save.
const PARALLEL_WINDOW_BYTES: usize = 4 << 20;

fn gather_window(
    def: &TableDef,
    ring: &PartitionRing,
    window: Vec<RecordBatch>,
    window_bytes: usize,
    rows_of: RowsOf,
    out: &mut BTreeMap<PartitionId, Vec<RecordBatch>>,
) -> Result<()> {
    let partitions = ring.partition_count() as usize;
    let threads = |pieces: usize| match window_bytes >= PARALLEL_WINDOW_BYTES {
        true => threads_for(pieces),
        false => 1,
    };
    // Each batch with its rows put in partition order (one `take`, reading only within
    // the batch, which stays in cache), and where each partition's rows begin in it.
    // Gathering each partition's rows straight from a window of batches instead read the
    // window's columns at random: at a window of 120 MB, slower than splitting batch by
    // batch.
    let sort = |batch: RecordBatch| in_partition_order(def, ring, &batch, rows_of);
    let batches = window.len();
    let sorted: Vec<(RecordBatch, Vec<usize>)> = map_in_parallel(window, threads(batches), sort)
        .into_iter()
        .collect::<Result<_>>()?;
    // One batch, all of one partition (a replica's prepare stream, or a publish of one
    // key): kept as it is, not copied.
    if let [(batch, starts)] = sorted.as_slice() {
        let mut touched = (0..partitions).filter(|&p| starts[p + 1] > starts[p]);
        if let (Some(partition), None) = (touched.next(), touched.next()) {
            out.entry(PartitionId(partition as u32))
                .or_default()
                .push(batch.clone());
            return Ok(());
        }
    }
    let schema = sorted[0].0.schema();
    let join = |partition: usize| -> Result<Option<RecordBatch>> {
        let pieces: Vec<RecordBatch> = sorted
            .iter()
            .filter_map(|(batch, starts)| {
                let (start, end) = (starts[partition], starts[partition + 1]);
                (end > start).then(|| batch.slice(start, end - start))
            })
            .collect();
        if pieces.is_empty() {
            return Ok(None);
        }
        // Joined (copied) even when one piece: a slice would keep its whole batch's
        // buffers alive, and be counted by them, wherever it is held.
        let joined = concat_batches(&schema, &pieces)?;
        Ok(Some(compact_views(joined)?))
    };
    let joined = map_in_parallel((0..partitions).collect(), threads(partitions), join);
    for (partition, rows) in joined.into_iter().enumerate() {
        if let Some(rows) = rows? {
            out.entry(PartitionId(partition as u32))
                .or_default()
                .push(rows);
        }
    }
    Ok(())
}

/// `batch`'s rows in partition order (a batch whose rows are all of one partition as it
/// is), and where each partition's rows begin in them (one more entry: where they end).
fn in_partition_order(
    def: &TableDef,
    ring: &PartitionRing,
    batch: &RecordBatch,
    rows_of: RowsOf,
) -> Result<(RecordBatch, Vec<usize>)> {
    let partitions = ring.partition_count() as usize;
    let of_rows = partitions_of_rows(def, ring, batch, rows_of)?;
    let mut starts = vec![0usize; partitions + 1];
    for partition in &of_rows {
        starts[partition.0 as usize + 1] += 1;
    }
    for p in 0..partitions {
        starts[p + 1] += starts[p];
    }
    if of_rows.iter().all(|&p| p == of_rows[0]) {
        return Ok((batch.clone(), starts));
    }
    let mut next = starts.clone();
    let mut order = vec![0u32; of_rows.len()];
    for (row, partition) in of_rows.iter().enumerate() {
        let at = &mut next[partition.0 as usize];
        order[*at] = row as u32;
        *at += 1;
    }
    let in_order = take_record_batch(batch, &UInt32Array::from(order))?;
    Ok((in_order, starts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{AsArray, Int64Array, StringViewArray};
    use arrow::datatypes::{DataType, Field, Int64Type, Schema};
    use std::sync::Arc;

    fn def() -> TableDef {
        let schema = Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8View, true),
        ]);
        TableDef::new("t", schema, vec!["k".into()], None).unwrap()
    }

    /// Rows `keys`, each with a 40-byte string (stored outside its view).
    fn rows(keys: std::ops::Range<i64>) -> RecordBatch {
        let strings: StringViewArray = keys.clone().map(|k| Some(format!("{k:040}"))).collect();
        RecordBatch::try_new(
            Arc::new(def().schema.clone()),
            vec![
                Arc::new(Int64Array::from_iter_values(keys)),
                Arc::new(strings),
            ],
        )
        .unwrap()
    }

    fn keys_of(batch: &RecordBatch) -> Vec<i64> {
        batch
            .column(0)
            .as_primitive::<Int64Type>()
            .values()
            .to_vec()
    }

    #[test]
    fn gathering_gives_each_partition_its_rows_in_order_as_split_does() {
        let def = def();
        let ring = PartitionRing::new(8);
        let given: Vec<RecordBatch> = (0..10).map(|i| rows(i * 100..i * 100 + 100)).collect();
        let gathered =
            gather_by_partition(&def, &ring, given.clone(), RowsOf::TableColumns).unwrap();
        let mut split: BTreeMap<PartitionId, Vec<i64>> = BTreeMap::new();
        for batch in &given {
            for (partition, part) in split_by_partition(&def, &ring, batch).unwrap() {
                split.entry(partition).or_default().extend(keys_of(&part));
            }
        }
        assert_eq!(gathered.len(), 8, "1,000 keys touch every partition");
        for (partition, batches) in &gathered {
            assert_eq!(batches.len(), 1, "one window: one batch per partition");
            let batch = &batches[0];
            assert_eq!(keys_of(batch), split[partition], "partition {partition}");
            for (row, key) in keys_of(batch).into_iter().enumerate() {
                let value = batch.column(1).as_string_view().value(row);
                assert_eq!(value, format!("{key:040}"));
            }
            let data: usize = batch
                .column(1)
                .as_string_view()
                .data_buffers()
                .iter()
                .map(|b| b.len())
                .sum();
            assert_eq!(data, 40 * batch.num_rows(), "only its own values");
        }
    }

    #[test]
    fn delete_keys_are_routed_where_their_rows_are() {
        let def = def();
        let ring = PartitionRing::new(8);
        let full =
            gather_by_partition(&def, &ring, vec![rows(0..500)], RowsOf::TableColumns).unwrap();
        let keys = rows(0..500).project(&[0]).unwrap();
        let by_key = gather_by_partition(&def, &ring, vec![keys], RowsOf::KeyColumns).unwrap();
        let partitions = |routed: &BTreeMap<PartitionId, Vec<RecordBatch>>| {
            routed
                .iter()
                .map(|(p, b)| (*p, b.iter().flat_map(keys_of).collect::<Vec<_>>()))
                .collect::<Vec<_>>()
        };
        assert_eq!(partitions(&full), partitions(&by_key));
    }

    #[test]
    fn a_large_publish_is_gathered_window_by_window() {
        let def = def();
        let ring = PartitionRing::new(1);
        // 1 partition: windows of one Flight message (2 MiB); 40,000 rows of ~56 bytes.
        let given: Vec<RecordBatch> = (0..40).map(|i| rows(i * 1000..i * 1000 + 1000)).collect();
        let gathered = gather_by_partition(&def, &ring, given, RowsOf::TableColumns).unwrap();
        let batches = &gathered[&PartitionId(0)];
        assert!(batches.len() > 1, "more than one window");
        assert!(batches
            .iter()
            .all(|b| rows_bytes(b) <= FLIGHT_MESSAGE_BYTES));
        let keys: Vec<i64> = batches.iter().flat_map(keys_of).collect();
        assert_eq!(keys, (0..40_000).collect::<Vec<_>>());
    }
}
