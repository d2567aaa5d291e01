//! Diffs between two epochs of a table: per key that changed in `(from, to]`, the kind of
//! change and the row before and after.
//!
//! Only versions stamped in `(from, to]` can change a key, so a partition whose components
//! and memtable hold none has no changes, and its other components are never opened. The
//! row before is the key's newest version at or below `from`. An UPDATE or DELETE wrote it
//! beside its change as a before image ([`tessera_common::RowOp::Before`]), so for a key
//! whose first change in the range came with one, it is found among the range's own
//! rows; only the other keys (inserted, or written by a blind publish) are looked up in
//! older components, which are not opened at all when there are none.
//!
//! The output has a `change` column (`insert`, `update` or `delete`), the key columns, then
//! `before_<column>` and `after_<column>` for every other column (NULL where the row does
//! not exist on that side). A key updated back to its old row, or inserted and deleted
//! again within the range, is no change. Rows come in key order, so the output is
//! deterministic. An append-only table has no keys: every row added in the range is an
//! insert.

use crate::catalog::TableDef;
use crate::component::{read_component, read_component_rows, ComponentMeta};
use crate::error::{Result, StorageError};
use crate::store::PartitionSnapshot;
use crate::versions::{
    epochs, key_columns as columns, key_converter, ops, split_before_images, stored_schema,
    without_before_images, KeyProjection,
};
use arrow::array::{
    new_null_array, Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray,
};
use arrow::compute::{concat_batches, interleave};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef, UInt64Type};
use arrow::row::{RowConverter, Rows, SortField};
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::Path;
use std::sync::Arc;
use tessera_common::{Epoch, RowOp};

/// The name of the column that says what happened to a key.
pub const CHANGE_COLUMN: &str = "change";

/// What happened to one key between two epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Insert,
    Update,
    Delete,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Insert => "insert",
            ChangeKind::Update => "update",
            ChangeKind::Delete => "delete",
        }
    }
}

/// The columns of a table's diff: `change`, the key columns, then `before_` and `after_`
/// each other column.
pub fn changes_schema(def: &TableDef) -> SchemaRef {
    let mut fields = vec![Field::new(CHANGE_COLUMN, DataType::Utf8, false)];
    let (keys, values) = split_columns(def);
    fields.extend(keys.iter().map(|&i| def.schema.field(i).clone()));
    for side in ["before", "after"] {
        fields.extend(values.iter().map(|&i| {
            let field = def.schema.field(i);
            Field::new(
                format!("{side}_{}", field.name()),
                field.data_type().clone(),
                true,
            )
        }));
    }
    Arc::new(Schema::new(fields))
}

/// The key columns and the other columns (not those dropped), as indices into the user
/// schema.
fn split_columns(def: &TableDef) -> (Vec<usize>, Vec<usize>) {
    let keys = def.primary_key_indices();
    let values = (0..def.schema.fields().len())
        .filter(|i| !keys.contains(i) && !def.is_dropped(*i))
        .collect();
    (keys, values)
}

/// A fast hasher for encoded row keys (FxHash's multiply-rotate over 8-byte words): the
/// membership test of every older row's key runs once per row, and SipHash, the standard
/// map's defence against chosen keys, costs several times more here. Keys come from the
/// table's own rows, not from a client.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
        }
        for &byte in words.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(byte)).wrapping_mul(SEED);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type KeyMap<'a, V> = HashMap<arrow::row::Row<'a>, V, BuildHasherDefault<KeyHasher>>;

/// The changes of one partition snapshot (taken at `to`) between `from` and `to`, reading
/// its components from `components_dir` (verified by the caller). `None` if nothing
/// changed.
pub fn partition_changes(
    components_dir: &Path,
    def: &TableDef,
    partition: &PartitionSnapshot,
    from: Epoch,
    to: Epoch,
) -> Result<Option<RecordBatch>> {
    if from > to {
        return Err(StorageError::BackwardDiff { from, to });
    }
    let in_range = |e: u64| e > from.0 && e <= to.0;
    let mut recent = Vec::new();
    let mut older = Vec::new();
    let mut older_only: Vec<&ComponentMeta> = Vec::new();
    for component in &partition.components {
        if component.max_epoch <= from {
            // Cannot hold a change; read later, and only if some key changed.
            older_only.push(component);
            continue;
        }
        for batch in read_component(components_dir, def, &component.hash, None)? {
            split_by_epoch(batch, in_range, &mut recent, &mut older)?;
        }
    }
    for batch in &partition.memtable {
        // Snapshots hand out memtable rows in the definition's current layout already.
        split_by_epoch(batch.clone(), in_range, &mut recent, &mut older)?;
    }
    let schema = stored_schema(def);
    let (recent, images) = split_before_images(concat_batches(&schema, &recent)?)?;
    if recent.num_rows() == 0 {
        return Ok(None);
    }
    if def.append_only {
        return Ok(Some(appended_rows(def, &recent)?));
    }
    let key = def.primary_key_indices();
    let converter = key_converter(&schema, &key)?;
    let recent_keys = converter.convert_columns(&columns(&recent, &key))?;
    let image_keys = converter.convert_columns(&columns(&images, &key))?;
    let imaged = first_changes_with_images(&recent_keys, epochs(&recent), &image_keys, &images);
    // Keys whose first change in the range came with no image (an INSERT, a blind
    // publish): their rows before come from versions at or below `from`.
    let unimaged: KeyMap<'_, ()> = recent_keys
        .iter()
        .filter(|row| !imaged.contains_key(row))
        .map(|row| (row, ()))
        .collect();
    let older: Vec<RecordBatch> = older
        .into_iter()
        .map(without_before_images)
        .collect::<Result<_>>()?;
    let mut older = concat_batches(&schema, &older)?;
    if !unimaged.is_empty() {
        let mut batches = vec![older];
        batches.extend(rows_of_keys(
            components_dir,
            def,
            &converter,
            &older_only,
            &unimaged,
            &recent,
        )?);
        older = concat_batches(&schema, &batches)?;
    }
    let before = Before {
        older: &older,
        images: &images,
        imaged,
    };
    diff(def, &converter, (&recent, &recent_keys), before, from)
}

/// For each changed key whose first change in the range wrote a before image, that
/// image's row in `images`: the key's row at the range's start, since no publish changed
/// it between the range's start and that change.
fn first_changes_with_images<'a>(
    recent_keys: &'a Rows,
    recent_epochs: &arrow::array::PrimitiveArray<UInt64Type>,
    image_keys: &'a Rows,
    images: &RecordBatch,
) -> KeyMap<'a, usize> {
    if images.num_rows() == 0 {
        return KeyMap::default();
    }
    let mut first_change: KeyMap<'a, u64> = KeyMap::default();
    for (i, row) in recent_keys.iter().enumerate() {
        let epoch = recent_epochs.value(i);
        let slot = first_change.entry(row).or_insert(epoch);
        *slot = (*slot).min(epoch);
    }
    let image_epochs = epochs(images);
    let mut imaged = KeyMap::default();
    for (i, row) in image_keys.iter().enumerate() {
        if first_change.get(&row) == Some(&image_epochs.value(i)) {
            imaged.insert(row, i);
        }
    }
    imaged
}

/// The rows of `components` (none holding a version above the range's start) whose keys
/// are in `wanted`: their key columns are read first, then only the wanted rows, whole.
fn rows_of_keys(
    components_dir: &Path,
    def: &TableDef,
    converter: &RowConverter,
    components: &[&ComponentMeta],
    wanted: &KeyMap<'_, ()>,
    recent: &RecordBatch,
) -> Result<Vec<RecordBatch>> {
    let key = def.primary_key_indices();
    let KeyProjection {
        file_order,
        in_projected: projected_key,
    } = KeyProjection::of(&key);
    let first_key_values = FirstKeyValues::of(recent.column(key[0]));
    let mut rows = Vec::new();
    for component in components {
        let key_batches = read_component(components_dir, def, &component.hash, Some(&file_order))?;
        let mut selected = arrow::array::BooleanBuilder::with_capacity(component.rows as usize);
        for batch in &key_batches {
            let key_columns = columns(batch, &projected_key);
            let candidates = first_key_values
                .as_ref()
                .and_then(|values| values.may_match(&key_columns[0]));
            let Some(candidates) = candidates else {
                let keys = converter.convert_columns(&key_columns)?;
                selected.extend(keys.iter().map(|row| Some(wanted.contains_key(&row))));
                continue;
            };
            // Only the candidates' keys are encoded and looked up.
            let narrowed = key_columns
                .iter()
                .map(|c| arrow::compute::filter(c, &candidates))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let keys = converter.convert_columns(&narrowed)?;
            let mut hits = keys.iter().map(|row| wanted.contains_key(&row));
            selected.extend(candidates.iter().map(|candidate| {
                Some(candidate == Some(true) && hits.next().expect("a key per candidate"))
            }));
        }
        let selected = selected.finish();
        if selected.true_count() > 0 {
            let found = read_component_rows(components_dir, def, &component.hash, &selected)?;
            // A history component may hold before images stamped at or below the range's
            // start: not versions.
            for batch in found {
                rows.push(without_before_images(batch)?);
            }
        }
    }
    Ok(rows)
}

/// The distinct values of the first key column among the changed keys, when that column
/// holds integers: a row of an older component whose first key value is not among them
/// holds no changed key, and is ruled out without encoding its whole key. (Most rows of a
/// diff's older components are ruled out so, and the encoding and lookup of every row's
/// key cost more than reading the key columns.)
struct FirstKeyValues(HashSet<i64, BuildHasherDefault<KeyHasher>>);

impl FirstKeyValues {
    fn of(changed: &ArrayRef) -> Option<Self> {
        let values = as_i64(changed)?;
        Some(Self(values.iter().flatten().collect()))
    }

    /// Which rows of `column` (the first key column of an older component) may hold a
    /// changed key; `None` if the column is not one this filter reads.
    fn may_match(&self, column: &ArrayRef) -> Option<arrow::array::BooleanArray> {
        let values = as_i64(column)?;
        // A NULL is never ruled out here: the exact lookup decides it.
        Some(
            values
                .iter()
                .map(|v| Some(v.is_none_or(|v| self.0.contains(&v))))
                .collect(),
        )
    }
}

/// An integer column (or a date, stored as one) widened to `i64`, losslessly.
fn as_i64(column: &ArrayRef) -> Option<Int64Array> {
    use DataType::*;
    match column.data_type() {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | Date32 | Date64 => {
            let widened = arrow::compute::cast(column, &Int64).ok()?;
            Some(widened.as_primitive::<Int64Type>().clone())
        }
        _ => None,
    }
}

/// Appends the part of `batch` stamped in the range to `recent`, the rest to `older`.
fn split_by_epoch(
    batch: RecordBatch,
    in_range: impl Fn(u64) -> bool,
    recent: &mut Vec<RecordBatch>,
    older: &mut Vec<RecordBatch>,
) -> Result<()> {
    let epochs = epochs(&batch);
    let mask: arrow::array::BooleanArray =
        epochs.values().iter().map(|e| Some(in_range(*e))).collect();
    let not: arrow::array::BooleanArray = arrow::compute::not(&mask)?;
    recent.push(arrow::compute::filter_record_batch(&batch, &mask)?);
    older.push(arrow::compute::filter_record_batch(&batch, &not)?);
    Ok(())
}

fn is_upsert(batch: &RecordBatch, row: usize) -> bool {
    ops(batch).value(row) == RowOp::Upsert as u8
}

/// The newest version per key among `rows` at or below `at` (`None` bound: any).
fn newest_per_key<'a>(
    keys: &'a Rows,
    epochs: &arrow::array::PrimitiveArray<UInt64Type>,
    at: Option<Epoch>,
) -> KeyMap<'a, usize> {
    let mut newest: KeyMap<'a, (u64, usize)> = KeyMap::default();
    for (i, row) in keys.iter().enumerate() {
        let epoch = epochs.value(i);
        if at.is_some_and(|at| epoch > at.0) {
            continue;
        }
        let slot = newest.entry(row).or_insert((epoch, i));
        if epoch > slot.0 {
            *slot = (epoch, i);
        }
    }
    newest.into_iter().map(|(k, (_, i))| (k, i)).collect()
}

/// Where the changed keys' rows before the range are: versions at or below the range's
/// start (`older`), and the before images of keys whose first change wrote one.
struct Before<'a> {
    older: &'a RecordBatch,
    images: &'a RecordBatch,
    /// Key → its row in `images`; such a key's row in `older`, if any, is not needed.
    imaged: KeyMap<'a, usize>,
}

/// Pairs each changed key's newest version in `recent` with its row before the range: its
/// before image, or else its newest version at or below `from` in `older`.
fn diff(
    def: &TableDef,
    converter: &RowConverter,
    (recent, recent_keys): (&RecordBatch, &Rows),
    before: Before<'_>,
    from: Epoch,
) -> Result<Option<RecordBatch>> {
    let Before {
        older,
        images,
        imaged,
    } = before;
    let key = def.primary_key_indices();
    let older_keys = converter.convert_columns(&columns(older, &key))?;
    let after = newest_per_key(recent_keys, epochs(recent), None);
    let older_newest = newest_per_key(&older_keys, epochs(older), Some(from));
    let (_, values) = split_columns(def);
    // Whether two versions hold the same row: compared on every non-key column.
    let value_fields: Vec<SortField> = values
        .iter()
        .map(|&i| SortField::new(def.schema.field(i).data_type().clone()))
        .collect();
    let value_converter = RowConverter::new(value_fields)?;
    let recent_values = value_converter.convert_columns(&columns(recent, &values))?;
    let older_values = value_converter.convert_columns(&columns(older, &values))?;
    let image_values = value_converter.convert_columns(&columns(images, &values))?;

    let mut changed: Vec<(arrow::row::Row<'_>, usize)> = after.into_iter().collect();
    changed.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    // Per output row: the kind, and where its before and after rows are (None: absent).
    let mut out: Vec<(ChangeKind, Option<Side>, Option<usize>)> = Vec::new();
    for (row, after_index) in changed {
        let after_row = is_upsert(recent, after_index).then_some(after_index);
        let before_row = match imaged.get(&row) {
            Some(&i) => Some(Side::Image(i)),
            None => older_newest
                .get(&row)
                .copied()
                .filter(|&i| is_upsert(older, i))
                .map(Side::Older),
        };
        let before_values = |side: Side| match side {
            Side::Older(i) => older_values.row(i),
            Side::Image(i) => image_values.row(i),
        };
        let kind = match (before_row, after_row) {
            (None, Some(_)) => ChangeKind::Insert,
            (Some(_), None) => ChangeKind::Delete,
            (Some(b), Some(a)) if before_values(b) != recent_values.row(a) => ChangeKind::Update,
            _ => continue,
        };
        out.push((kind, before_row, after_row));
    }
    if out.is_empty() {
        return Ok(None);
    }
    let change = StringArray::from_iter_values(out.iter().map(|(kind, _, _)| kind.as_str()));
    let mut output: Vec<ArrayRef> = vec![Arc::new(change)];
    // Source 0: `older`, 1: `recent`, 2: `images`, 3: a single NULL.
    let pick = |column: usize, side: Option<bool>| -> Result<ArrayRef> {
        let null = new_null_array(recent.column(column).data_type(), 1);
        let sources: [&dyn Array; 4] = [
            older.column(column).as_ref(),
            recent.column(column).as_ref(),
            images.column(column).as_ref(),
            null.as_ref(),
        ];
        let before_at = |before: Side| match before {
            Side::Older(i) => (0, i),
            Side::Image(i) => (2, i),
        };
        let indices: Vec<(usize, usize)> = out
            .iter()
            .map(|&(_, before, after)| match side {
                Some(false) => before.map_or((3, 0), before_at),
                Some(true) => after.map_or((3, 0), |i| (1, i)),
                // A key: from whichever side has the row.
                None => after.map_or_else(
                    || before_at(before.expect("a change has a side")),
                    |i| (1, i),
                ),
            })
            .collect();
        Ok(interleave(&sources, &indices)?)
    };
    for &k in &key {
        output.push(pick(k, None)?);
    }
    for side in [false, true] {
        for &v in &values {
            output.push(pick(v, Some(side))?);
        }
    }
    Ok(Some(RecordBatch::try_new(changes_schema(def), output)?))
}

/// Where a changed key's row before the range is.
#[derive(Debug, Clone, Copy)]
enum Side {
    /// A version at or below the range's start, in `older`.
    Older(usize),
    /// A before image written with the key's first change in the range.
    Image(usize),
}

/// An append-only table's changes: every row added in the range, as an insert.
fn appended_rows(def: &TableDef, recent: &RecordBatch) -> Result<RecordBatch> {
    let rows = recent.num_rows();
    let mut output: Vec<ArrayRef> = vec![Arc::new(StringArray::from_iter_values(
        std::iter::repeat_n(ChangeKind::Insert.as_str(), rows),
    ))];
    let (_, values) = split_columns(def);
    for &v in &values {
        output.push(new_null_array(def.schema.field(v).data_type(), rows));
    }
    for &v in &values {
        output.push(recent.column(v).clone());
    }
    Ok(RecordBatch::try_new(changes_schema(def), output)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_key_filter_rules_out_only_values_no_changed_key_has() {
        let changed: ArrayRef = Arc::new(arrow::array::Int32Array::from(vec![3, 7, 7]));
        let values = FirstKeyValues::of(&changed).expect("an integer column");
        let older: ArrayRef = Arc::new(arrow::array::Int32Array::from(vec![
            Some(1),
            Some(3),
            None,
            Some(7),
            Some(8),
        ]));
        let candidates = values.may_match(&older).expect("an integer column");
        let kept: Vec<bool> = candidates.iter().map(|c| c == Some(true)).collect();
        assert_eq!(kept, [false, true, true, true, false]);
        let text: ArrayRef = Arc::new(StringArray::from(vec!["3"]));
        assert!(
            FirstKeyValues::of(&text).is_none(),
            "text keys take the full lookup"
        );
    }
}
