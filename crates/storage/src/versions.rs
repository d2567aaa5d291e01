//! Row versions: stamping rows with their epoch and operation, routing them to partitions,
//! and choosing, per key, the version a reader at an epoch sees.

use crate::catalog::TableDef;
use crate::error::{Result, StorageError};
use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, UInt32Array, UInt64Array, UInt8Array};
use arrow::compute::{concat_batches, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt64Type, UInt8Type};
use arrow::row::{RowConverter, SortField};
use std::collections::HashMap;
use std::sync::Arc;
use tessera_common::{Epoch, RowOp, EPOCH_COLUMN, OP_COLUMN};

/// The table's columns as stored: non-key columns are nullable, because a delete tombstone
/// carries only its key.
pub fn stored_user_schema(def: &TableDef) -> SchemaRef {
    Arc::new(Schema::new(stored_user_fields(def)))
}

fn stored_user_fields(def: &TableDef) -> Vec<Field> {
    def.schema
        .fields()
        .iter()
        .map(|f| {
            let is_key = def.primary_key.iter().any(|k| k == f.name());
            f.as_ref().clone().with_nullable(f.is_nullable() || !is_key)
        })
        .collect()
}

/// The stored schema of a table: its columns, then the epoch and operation columns.
pub fn stored_schema(def: &TableDef) -> SchemaRef {
    let mut fields = stored_user_fields(def);
    fields.push(Field::new(EPOCH_COLUMN, DataType::UInt64, false));
    fields.push(Field::new(OP_COLUMN, DataType::UInt8, false));
    Arc::new(Schema::new(fields))
}

/// The row versions (stored schema) whose epoch is at or above `since`.
pub fn versions_since(batches: Vec<RecordBatch>, since: Epoch) -> Result<Vec<RecordBatch>> {
    filter_by_epoch(batches, |epoch| epoch >= since.0)
}

/// The row versions (stored schema) whose epoch is below `before`.
pub fn versions_before(batches: Vec<RecordBatch>, before: Epoch) -> Result<Vec<RecordBatch>> {
    filter_by_epoch(batches, |epoch| epoch < before.0)
}

fn filter_by_epoch(
    batches: Vec<RecordBatch>,
    keep: impl Fn(u64) -> bool,
) -> Result<Vec<RecordBatch>> {
    let mut kept = Vec::with_capacity(batches.len());
    for batch in batches {
        let index = batch.schema().index_of(EPOCH_COLUMN)?;
        let epochs = batch.column(index).as_primitive::<UInt64Type>();
        let mask: arrow::array::BooleanArray =
            epochs.values().iter().map(|e| Some(keep(*e))).collect();
        match mask.true_count() {
            0 => {}
            n if n == batch.num_rows() => kept.push(batch),
            _ => kept.push(arrow::compute::filter_record_batch(&batch, &mask)?),
        }
    }
    Ok(kept)
}

/// Tombstone rows for the given keys: key columns from `keys`, NULL elsewhere.
pub fn tombstone_rows(def: &TableDef, keys: &RecordBatch) -> Result<RecordBatch> {
    let mismatch = |reason: String| StorageError::SchemaMismatch {
        table: def.name.clone(),
        reason,
    };
    let schema = stored_user_schema(def);
    let mut columns = Vec::with_capacity(schema.fields().len());
    for field in schema.fields() {
        if def.primary_key.iter().any(|k| k == field.name()) {
            let index = keys
                .schema()
                .index_of(field.name())
                .map_err(|_| mismatch(format!("delete keys lack key column {:?}", field.name())))?;
            let column = arrow::compute::cast(keys.column(index), field.data_type())
                .map_err(|e| mismatch(format!("delete key column {:?}: {e}", field.name())))?;
            if column.null_count() > 0 {
                return Err(mismatch(format!(
                    "delete key column {:?} has NULLs",
                    field.name()
                )));
            }
            columns.push(column);
        } else {
            columns.push(arrow::array::new_null_array(
                field.data_type(),
                keys.num_rows(),
            ));
        }
    }
    Ok(RecordBatch::try_new(schema, columns)?)
}

/// Appends the version columns to a batch of the table's columns.
pub fn stamp(def: &TableDef, batch: &RecordBatch, epoch: Epoch, op: RowOp) -> Result<RecordBatch> {
    let rows = batch.num_rows();
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::new(UInt64Array::from(vec![epoch.0; rows])));
    columns.push(Arc::new(UInt8Array::from(vec![op as u8; rows])));
    Ok(RecordBatch::try_new(stored_schema(def), columns)?)
}

pub(crate) fn key_converter(schema: &Schema, key: &[usize]) -> Result<RowConverter> {
    let fields = key
        .iter()
        .map(|&i| SortField::new(schema.field(i).data_type().clone()))
        .collect();
    Ok(RowConverter::new(fields)?)
}

/// How to read only a table's key columns from a component: the columns to ask the reader
/// for (ascending, as files store them) and, for each key column in key order, where it
/// lands in a batch so projected.
#[derive(Debug, Clone)]
pub struct KeyProjection {
    pub file_order: Vec<usize>,
    pub in_projected: Vec<usize>,
}

impl KeyProjection {
    pub fn of(key: &[usize]) -> KeyProjection {
        let mut file_order = key.to_vec();
        file_order.sort_unstable();
        let in_projected = key
            .iter()
            .map(|k| {
                file_order
                    .iter()
                    .position(|c| c == k)
                    .expect("a key column")
            })
            .collect();
        KeyProjection {
            file_order,
            in_projected,
        }
    }
}

pub(crate) fn key_columns(batch: &RecordBatch, key: &[usize]) -> Vec<ArrayRef> {
    key.iter().map(|&i| batch.column(i).clone()).collect()
}

pub use tessera_common::views::rows_bytes;

/// Refuses a publish that names one key of `def` twice across `rows` (upserts and
/// tombstones alike); append-only tables have no keys to repeat.
pub fn reject_duplicate_keys(def: &TableDef, rows: &[RecordBatch]) -> Result<()> {
    if def.append_only || rows.is_empty() {
        return Ok(());
    }
    let key = def.primary_key_indices();
    let keys: Vec<RecordBatch> = rows
        .iter()
        .map(|batch| batch.project(&key))
        .collect::<std::result::Result<_, _>>()?;
    reject_duplicate_key_columns(def, &keys)
}

/// [`reject_duplicate_keys`] over rows already narrowed to the table's key columns (in the
/// order of `TableDef::primary_key_indices`): only they are concatenated, not a publish's
/// rows whole, which would copy all of them once more at the publish's peak of memory.
pub fn reject_duplicate_key_columns(def: &TableDef, keys: &[RecordBatch]) -> Result<()> {
    if def.append_only || keys.is_empty() {
        return Ok(());
    }
    debug_assert!(keys
        .iter()
        .all(|k| k.num_columns() == def.primary_key.len()));
    let combined = concat_batches(&keys[0].schema(), keys)?;
    let all: Vec<usize> = (0..combined.num_columns()).collect();
    match find_duplicate_key(&combined, &all)? {
        Some(key) => Err(StorageError::DuplicateKey {
            table: def.name.clone(),
            key,
        }),
        None => Ok(()),
    }
}

/// Describes the first repeated key in `batch`, if any.
pub fn find_duplicate_key(batch: &RecordBatch, key: &[usize]) -> Result<Option<String>> {
    let converter = key_converter(&batch.schema(), key)?;
    let rows = converter.convert_columns(&key_columns(batch, key))?;
    let mut seen = std::collections::HashSet::with_capacity(rows.num_rows());
    for (i, row) in rows.iter().enumerate() {
        if !seen.insert(row) {
            let values: Vec<String> = key
                .iter()
                .map(|&c| {
                    arrow::util::display::array_value_to_string(batch.column(c), i)
                        .unwrap_or_default()
                })
                .collect();
            return Ok(Some(format!("({})", values.join(", "))));
        }
    }
    Ok(None)
}

pub(crate) fn epochs(batch: &RecordBatch) -> &arrow::array::PrimitiveArray<UInt64Type> {
    let index = batch
        .schema()
        .index_of(EPOCH_COLUMN)
        .expect("stored batches carry the epoch column");
    batch.column(index).as_primitive::<UInt64Type>()
}

pub(crate) fn ops(batch: &RecordBatch) -> &arrow::array::PrimitiveArray<UInt8Type> {
    let index = batch
        .schema()
        .index_of(OP_COLUMN)
        .expect("stored batches carry the op column");
    batch.column(index).as_primitive::<UInt8Type>()
}

/// Which rows of `batch` are before images ([`RowOp::Before`]); `None` if none are.
fn before_image_mask(batch: &RecordBatch) -> Result<Option<arrow::array::BooleanArray>> {
    let ops = ops(batch);
    if !ops.values().contains(&(RowOp::Before as u8)) {
        return Ok(None);
    }
    let before = UInt8Array::new_scalar(RowOp::Before as u8);
    Ok(Some(arrow::compute::kernels::cmp::eq(ops, &before)?))
}

/// `batch` without its before images: only the row versions.
pub fn without_before_images(batch: RecordBatch) -> Result<RecordBatch> {
    match before_image_mask(&batch)? {
        None => Ok(batch),
        Some(images) => Ok(arrow::compute::filter_record_batch(
            &batch,
            &arrow::compute::not(&images)?,
        )?),
    }
}

/// How many of `batch`'s rows are of kind `op`.
pub(crate) fn count_ops(batch: &RecordBatch, op: RowOp) -> u64 {
    ops(batch)
        .values()
        .iter()
        .filter(|&&o| o == op as u8)
        .count() as u64
}

/// How many of `batch`'s rows are row versions (not before images).
pub fn count_versions(batch: &RecordBatch) -> u64 {
    batch.num_rows() as u64 - count_ops(batch, RowOp::Before)
}

/// `batch` split into its row versions and its before images.
pub fn split_before_images(batch: RecordBatch) -> Result<(RecordBatch, RecordBatch)> {
    match before_image_mask(&batch)? {
        None => {
            let none = batch.slice(0, 0);
            Ok((batch, none))
        }
        Some(images) => Ok((
            arrow::compute::filter_record_batch(&batch, &arrow::compute::not(&images)?)?,
            arrow::compute::filter_record_batch(&batch, &images)?,
        )),
    }
}

/// Facts about a batch of row versions that decide how it may be read.
pub struct VersionStats {
    pub min_epoch: Epoch,
    pub max_epoch: Epoch,
    pub unique_keys: bool,
    pub tombstones: u64,
}

pub fn version_stats(
    batch: &RecordBatch,
    key: &[usize],
    append_only: bool,
) -> Result<VersionStats> {
    let epochs = epochs(batch);
    let min_epoch = Epoch(arrow::compute::min(epochs).unwrap_or(0));
    let max_epoch = Epoch(arrow::compute::max(epochs).unwrap_or(0));
    let tombstones = count_ops(batch, RowOp::Delete);
    // Before images share their keys with the versions written beside them, so a batch
    // holding any is never read as one version per key.
    let unique_keys = append_only
        || (before_image_mask(batch)?.is_none() && find_duplicate_key(batch, key)?.is_none());
    Ok(VersionStats {
        min_epoch,
        max_epoch,
        unique_keys,
        tombstones,
    })
}

/// The rows a reader at `epoch` sees: for each key its newest version at or below `epoch`,
/// unless that version is a tombstone; never a before image. Append-only tables keep every
/// row at or below `epoch`. Output keeps input order, so it is deterministic.
pub fn visible_rows(
    batches: &[RecordBatch],
    key: &[usize],
    epoch: Epoch,
    append_only: bool,
) -> Result<Option<RecordBatch>> {
    visible_rows_over_base(batches, 0, key, epoch, append_only)
}

/// [`visible_rows`], where the first `base` batches are a *base*: one version per key
/// among them, every one at or below `epoch` (a partition's merged current component, as
/// a read at or after the merge has it). Only the other versions are gathered per key;
/// each base row is then kept unless a newer version of its key is among them, a lookup
/// in a map as small as the changes since the base, so a partition with a large base and
/// a few changes costs little more than its base alone. The same rows, in the same order,
/// as [`visible_rows`] over the same batches.
pub fn visible_rows_over_base(
    batches: &[RecordBatch],
    base: usize,
    key: &[usize],
    epoch: Epoch,
    append_only: bool,
) -> Result<Option<RecordBatch>> {
    let Some((batch, keep)) = visible_row_indices(batches, base, key, epoch, append_only)? else {
        return Ok(None);
    };
    if keep.len() == batch.num_rows() {
        return Ok(Some(batch));
    }
    Ok(Some(take_record_batch(&batch, &UInt32Array::from(keep))?))
}

/// The order a read gives a partition's visible rows in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum RowOrder {
    /// The order their versions were logged in: free, and the same on every replica for a
    /// read at or above the epochs its components were merged at (see [`SplitVersions`]).
    /// Below them it is not: a merge splits each key's newest version from its older
    /// ones, and a read at an older epoch then finds some of its rows among the current
    /// versions and some among the history, no longer interleaved as they were logged.
    #[default]
    Logged,
    /// By primary key (append-only tables, which have none and no history, keep
    /// [`RowOrder::Logged`]): the same on every replica at any epoch, whatever it has
    /// flushed or merged, at the cost of a sort. Lineage recovery's re-run of a dead
    /// node's scan at an older epoch (`AS OF`) needs that to send the same batches.
    ByKey,
}

impl RowOrder {
    /// For serde's `skip_serializing_if`: messages from before orders existed mean this.
    pub fn is_logged(&self) -> bool {
        *self == RowOrder::Logged
    }
}

/// [`visible_rows_over_base`], cut into batches of at most `batch_rows` rows, each with
/// buffers of its own, in `order`. A reader hands these to operators that account memory
/// per batch (a sort, a spill): one batch for a whole partition held in memtables would
/// not fit a small share, and slices of it would each be charged for the whole buffer. No
/// batch when no row is visible.
pub fn visible_rows_in_batches(
    batches: &[RecordBatch],
    base: usize,
    key: &[usize],
    epoch: Epoch,
    append_only: bool,
    batch_rows: usize,
    order: RowOrder,
) -> Result<Vec<RecordBatch>> {
    assert!(batch_rows > 0, "batches hold at least one row");
    let Some((batch, mut keep)) = visible_row_indices(batches, base, key, epoch, append_only)?
    else {
        return Ok(Vec::new());
    };
    if keep.is_empty() {
        return Ok(Vec::new());
    }
    if order == RowOrder::ByKey && !append_only {
        sort_by_key(&batch, key, &mut keep)?;
    }
    let every_row_in_order = keep.len() == batch.num_rows()
        && keep.iter().enumerate().all(|(i, &row)| i == row as usize);
    if batch.num_rows() <= batch_rows && every_row_in_order {
        return Ok(vec![batch]);
    }
    keep.chunks(batch_rows)
        .map(|chunk| {
            Ok(take_record_batch(
                &batch,
                &UInt32Array::from(chunk.to_vec()),
            )?)
        })
        .collect()
}

/// Puts `rows` (indices into `batch`, one per key) in the order of their keys.
fn sort_by_key(batch: &RecordBatch, key: &[usize], rows: &mut [u32]) -> Result<()> {
    let indices = UInt32Array::from(rows.to_vec());
    let keys: Vec<ArrayRef> = key_columns(batch, key)
        .iter()
        .map(|column| arrow::compute::take(column, &indices, None))
        .collect::<std::result::Result<_, _>>()?;
    let converted = key_converter(&batch.schema(), key)?.convert_columns(&keys)?;
    let mut by_key: Vec<usize> = (0..rows.len()).collect();
    // The stable sort finds the runs already in key order and merges them, in about one
    // pass where there are few: a load in key order logs one, and a read below a merge
    // takes its history's rows and its current ones, each such a run. (A key has one
    // visible row, so either sort gives the same order.)
    by_key.sort_by(|&a, &b| converted.row(a).cmp(&converted.row(b)));
    let sorted: Vec<u32> = by_key.into_iter().map(|i| rows[i]).collect();
    rows.copy_from_slice(&sorted);
    Ok(())
}

/// The versions of `batches` in one batch, and the rows of it a reader at `epoch` sees, in
/// order (see [`visible_rows_over_base`]).
fn visible_row_indices(
    batches: &[RecordBatch],
    base: usize,
    key: &[usize],
    epoch: Epoch,
    append_only: bool,
) -> Result<Option<(RecordBatch, Vec<u32>)>> {
    let Some(first) = batches.first() else {
        return Ok(None);
    };
    let base_rows: usize = batches[..base].iter().map(|b| b.num_rows()).sum();
    // A base holds one version per key, so no before image; the other batches may.
    let mut versions = batches[..base].to_vec();
    for batch in &batches[base..] {
        versions.push(without_before_images(batch.clone())?);
    }
    let batch = concat_batches(&first.schema(), &versions)?;
    let epochs = epochs(&batch);
    let ops = ops(&batch);
    let is_upsert = |i: u32| ops.value(i as usize) == RowOp::Upsert as u8;
    let mut keep: Vec<u32> = Vec::new();
    if append_only {
        keep.extend((0..batch.num_rows() as u32).filter(|&i| epochs.value(i as usize) <= epoch.0));
        return Ok(Some((batch, keep)));
    }
    let converter = key_converter(&batch.schema(), key)?;
    let others = batch.slice(base_rows, batch.num_rows() - base_rows);
    let other_keys = converter.convert_columns(&key_columns(&others, key))?;
    // Converted only where some other version needs looking up; declared here to outlive
    // the map its rows are looked up in.
    let base_keys: arrow::row::Rows;
    // key -> (epoch, row) of the newest version at or below `epoch` outside the base
    let mut newest: HashMap<arrow::row::Row<'_>, (u64, u32)> =
        HashMap::with_capacity(others.num_rows());
    for (offset, row) in other_keys.iter().enumerate() {
        let i = base_rows + offset;
        let version = epochs.value(i);
        if version > epoch.0 {
            continue;
        }
        let slot = newest.entry(row).or_insert((version, i as u32));
        // Two versions of one key in one epoch cannot exist: publishes reject them.
        debug_assert!(
            slot.1 == i as u32 || slot.0 != version,
            "one version per key per epoch"
        );
        if version > slot.0 {
            *slot = (version, i as u32);
        }
    }
    /// Marks a version outside the base that a newer base version shadows.
    const SHADOWED: u32 = u32::MAX;
    if newest.is_empty() {
        keep.extend((0..base_rows as u32).filter(|&i| is_upsert(i)));
    } else if base_rows > 0 {
        base_keys = converter.convert_columns(&key_columns(&batch.slice(0, base_rows), key))?;
        for (i, row) in base_keys.iter().enumerate() {
            let version = epochs.value(i);
            debug_assert!(version <= epoch.0, "a base holds no version above the read");
            let newer_elsewhere = match newest.get_mut(&row) {
                None => false,
                Some(slot) if slot.0 > version => true,
                Some(slot) => {
                    slot.1 = SHADOWED;
                    false
                }
            };
            if !newer_elsewhere && is_upsert(i as u32) {
                keep.push(i as u32);
            }
        }
    }
    keep.extend(
        newest
            .into_values()
            .map(|(_, i)| i)
            .filter(|&i| i != SHADOWED && is_upsert(i)),
    );
    keep.sort_unstable();
    Ok(Some((batch, keep)))
}

/// Merges row versions, dropping only those no retained epoch (`>= retain_from`) can see:
/// a key keeps every version above `retain_from` plus its newest version at or below it,
/// unless that is a tombstone; before images are kept above `retain_from`. Output is
/// ordered by key, then epoch.
pub fn merge_versions(
    batches: &[RecordBatch],
    key: &[usize],
    retain_from: Epoch,
    append_only: bool,
) -> Result<RecordBatch> {
    let first = batches.first().expect("a merge has inputs");
    let batch = concat_batches(&first.schema(), batches)?;
    if append_only {
        return Ok(batch);
    }
    let kept: Vec<u32> = kept_versions(&batch, key, retain_from, true)?
        .into_iter()
        .map(|(i, _)| i)
        .collect();
    Ok(take_record_batch(&batch, &UInt32Array::from(kept))?)
}

/// A merge's output split in two, each in the order its rows had among the merged
/// versions (the log's order, as a partition's components hold them), not in key order:
/// a read of the current component then gives its rows in the order a read of the merged
/// components gave them (versions read in input order keep it, see [`visible_rows`]), so
/// a scan's output does not depend on whether a replica has merged yet. Lineage recovery
/// re-runs a dead node's scan on another replica and needs the same batches again.
#[derive(Debug)]
pub struct SplitVersions {
    /// Each key's newest version (a tombstone included): all a read at or after the
    /// merge's newest epoch needs of the merged components.
    pub current: RecordBatch,
    /// Every other version kept: what only reads at older epochs, diffs and copies need.
    pub history: RecordBatch,
}

/// Merges row versions as [`merge_versions`] does, and splits each key's newest version
/// from its older ones. Every row of an append-only table is current.
///
/// `drop_tombstones` false keeps a key's newest tombstone at or below the horizon: another
/// component (a history component a read at or after the horizon still opens) may hold an
/// older version of the key, which the tombstone must go on hiding.
pub fn merge_and_split_versions(
    batches: &[RecordBatch],
    key: &[usize],
    retain_from: Epoch,
    append_only: bool,
    drop_tombstones: bool,
) -> Result<SplitVersions> {
    let first = batches.first().expect("a merge has inputs");
    let batch = concat_batches(&first.schema(), batches)?;
    if append_only {
        let history = batch.slice(0, 0);
        return Ok(SplitVersions {
            current: batch,
            history,
        });
    }
    let (current, history): (Vec<_>, Vec<_>) =
        kept_versions(&batch, key, retain_from, drop_tombstones)?
            .into_iter()
            .partition(|&(_, newest)| newest);
    // Back in the order the versions were read in (see [`SplitVersions`]).
    let take = |rows: Vec<(u32, bool)>| {
        let mut indices: Vec<u32> = rows.into_iter().map(|(i, _)| i).collect();
        indices.sort_unstable();
        take_record_batch(&batch, &UInt32Array::from(indices))
    };
    Ok(SplitVersions {
        current: take(current)?,
        history: take(history)?,
    })
}

/// The rows of `batch` a merge keeps (see [`merge_versions`]), ordered by key, then epoch,
/// each with whether it is its key's newest version.
fn kept_versions(
    batch: &RecordBatch,
    key: &[usize],
    retain_from: Epoch,
    drop_tombstones: bool,
) -> Result<Vec<(u32, bool)>> {
    let epochs = epochs(batch);
    let ops = ops(batch);
    let converter = key_converter(&batch.schema(), key)?;
    let rows = converter.convert_columns(&key_columns(batch, key))?;
    let mut order: Vec<u32> = (0..batch.num_rows() as u32).collect();
    order.sort_by(|&a, &b| {
        rows.row(a as usize)
            .cmp(&rows.row(b as usize))
            .then(epochs.value(a as usize).cmp(&epochs.value(b as usize)))
    });
    let is_image = |i: u32| ops.value(i as usize) == RowOp::Before as u8;
    let mut keep = Vec::with_capacity(order.len());
    for (pos, &i) in order.iter().enumerate() {
        let version = epochs.value(i as usize);
        if is_image(i) {
            // Not a version: kept, never as a key's newest, while a diff from a retained
            // epoch may start below it.
            if version > retain_from.0 {
                keep.push((i, false));
            }
            continue;
        }
        let next_same_key = order[pos + 1..]
            .iter()
            .find(|&&n| !is_image(n))
            .filter(|&&n| rows.row(n as usize) == rows.row(i as usize));
        let superseded_before_retention =
            next_same_key.is_some_and(|&n| epochs.value(n as usize) <= retain_from.0);
        // Every version above the horizon; at or below it, only a key's newest live one
        // (or its newest tombstone, where older versions may live on outside the merge).
        let newest_at_horizon = !superseded_before_retention
            && (ops.value(i as usize) == RowOp::Upsert as u8 || !drop_tombstones);
        if version > retain_from.0 || newest_at_horizon {
            keep.push((i, next_same_key.is_none()));
        }
    }
    Ok(keep)
}

/// Casts a user batch to the table's schema, naming the first column that does not fit.
pub fn conform_to_schema(def: &TableDef, batch: &RecordBatch) -> Result<RecordBatch> {
    let mismatch = |reason: String| StorageError::SchemaMismatch {
        table: def.name.clone(),
        reason,
    };
    let given = batch.schema();
    let mut columns = Vec::with_capacity(def.schema.fields().len());
    for (position, field) in def.schema.fields().iter().enumerate() {
        if def.is_dropped(position) {
            columns.push(arrow::array::new_null_array(
                field.data_type(),
                batch.num_rows(),
            ));
            continue;
        }
        let index = match given.index_of(field.name()) {
            Ok(index) => index,
            // A column ALTER TABLE added may be left out: it takes its default.
            Err(_) if def.was_added(position) => {
                columns.push(crate::evolution::missing_column(
                    def,
                    position,
                    batch.num_rows(),
                )?);
                continue;
            }
            Err(_) => return Err(mismatch(format!("column {:?} is missing", field.name()))),
        };
        let column = batch.column(index);
        let column = if column.data_type() == field.data_type() {
            column.clone()
        } else if arrow::compute::can_cast_types(column.data_type(), field.data_type()) {
            let options = arrow::compute::CastOptions {
                safe: false,
                ..Default::default()
            };
            arrow::compute::cast_with_options(column, field.data_type(), &options).map_err(|e| {
                mismatch(format!(
                    "column {:?} of type {} cannot be stored as {}: {e}",
                    field.name(),
                    column.data_type(),
                    field.data_type()
                ))
            })?
        } else {
            return Err(mismatch(format!(
                "column {:?} has type {}, expected {}",
                field.name(),
                column.data_type(),
                field.data_type()
            )));
        };
        if !field.is_nullable() && column.null_count() > 0 {
            let what = if def.primary_key.iter().any(|k| k == field.name()) {
                "a primary key column"
            } else {
                "NOT NULL"
            };
            return Err(mismatch(format!(
                "column {:?} is {what} but {} rows are NULL",
                field.name(),
                column.null_count()
            )));
        }
        columns.push(column);
    }
    if let Some(extra) = given
        .fields()
        .iter()
        .find(|f| def.schema.field_with_name(f.name()).is_err())
    {
        return Err(mismatch(format!(
            "column {:?} is not in the table",
            extra.name()
        )));
    }
    Ok(RecordBatch::try_new(stored_user_schema(def), columns)?)
}

#[cfg(test)]
mod tests;
