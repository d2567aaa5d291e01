//! Version ids: what a table's content at an epoch hashes to, equal on every replica.
//!
//! A table version id must come out the same on any node holding the same data, yet
//! replicas flush and merge on their own, so their components and manifests differ. The id
//! is therefore built from content, not layout:
//!
//! - the **change digest** of one partition at one epoch hashes the row versions that epoch
//!   wrote there, in a canonical form (a [`DigestFormat`]): the columns the table had at
//!   that epoch (types as they were then, so later widenings and added columns do not
//!   change it), with each row's operation, in a canonical order; how the rows were
//!   batched, flushed or merged does not matter;
//! - the **table version id** at an epoch chains the previous version id with that epoch's
//!   change digests, per partition it touched. Each table's version ids form a hash chain
//!   (Pond's stream of versions): one changed row anywhere in its history changes every
//!   later id.
//!
//! The publish coordinator computes the digests from the rows it routes; `tessera verify`
//! recomputes them from the components and memory each replica holds, in the format the
//! epoch's seal records.
//!
//! Before images ([`RowOp::Before`]) are not versions and are left out: the content they
//! repeat (a key's previous version) is already in the chain, and the components holding
//! them are checked against their names like any other.

use crate::catalog::TableDef;
use crate::error::Result;
use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::compute::{cast, concat_batches, interleave, sort_to_indices, take_record_batch};
use arrow::datatypes::{DataType, UInt64Type, UInt8Type};
use arrow::row::{RowConverter, Rows, SortField};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tessera_common::{ComponentHash, Epoch, PartitionId, RowOp, EPOCH_COLUMN, OP_COLUMN};

const VERSION_DOMAIN: &[u8] = b"tessera table version v1";

/// Bytes gathered before each call to the hasher: hashing a few bytes at a time costs
/// more than the hashing itself. The bytes hashed, and so the digest, are the same.
const HASH_PIECE_BYTES: usize = 64 * 1024;

// Fixed-width values are hashed as their bytes in memory, which are little-endian here.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "change digests hash fixed-width values as little-endian bytes"
);

/// The version id a table has before its first publish.
pub const GENESIS: ComponentHash = ComponentHash([0; 32]);

/// How a change digest turns one epoch's rows of one partition into the bytes it hashes.
/// Each epoch's seal records the format its version ids were made in, so epochs sealed in
/// an older one stay checkable. Both are fixed: a changed form is a new format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum DigestFormat {
    /// Every row as Arrow's row encoding of all its columns, with its operation, sorted by
    /// that encoding. The encoding is about twice the data's size, and making and hashing
    /// it was most of a publish's sealing cost.
    Rows = 1,
    /// The rows sorted by their primary key (all columns for an append-only table) and
    /// operation; then the operations, then each column's values, in that order. Keys are
    /// unique within one epoch's partition (a publish repeating one is refused), so the
    /// key alone orders them; ties (possible only in damaged data) fall back to the whole row.
    Columns = 2,
}

impl DigestFormat {
    /// The format new epochs are sealed in.
    pub const CURRENT: DigestFormat = DigestFormat::Columns;

    fn domain(self) -> &'static [u8] {
        match self {
            DigestFormat::Rows => b"tessera change digest v1",
            DigestFormat::Columns => b"tessera change digest v2",
        }
    }
}

impl TryFrom<u8> for DigestFormat {
    type Error = String;
    fn try_from(value: u8) -> std::result::Result<Self, String> {
        match value {
            1 => Ok(DigestFormat::Rows),
            2 => Ok(DigestFormat::Columns),
            other => Err(format!(
                "unknown change digest format {other} (this node knows 1 and 2)"
            )),
        }
    }
}

impl From<DigestFormat> for u8 {
    fn from(format: DigestFormat) -> u8 {
        format as u8
    }
}

/// The change digest of the row versions `epoch` wrote to one partition of `def`.
/// `versions` are in the stored schema (the table's columns, then the epoch and operation
/// columns), all stamped with `epoch`.
pub fn change_digest(
    def: &TableDef,
    epoch: Epoch,
    format: DigestFormat,
    versions: &[RecordBatch],
) -> Result<ComponentHash> {
    let mut digester = ChangeDigester::new(def, epoch, format)?;
    for batch in versions {
        digester.add_versions(batch)?;
    }
    Ok(digester.finish())
}

/// Change digests of one table's partitions at one epoch, one partition after another: the
/// rows of a partition are added, then [`ChangeDigester::finish`] gives its digest and
/// starts the next. The row encoders and every buffer are kept from one partition to the
/// next, so a publish touching many partitions allocates them once, not once per partition.
pub struct ChangeDigester {
    epoch: Epoch,
    format: DigestFormat,
    /// The table's columns at `epoch`: position in the stored schema, and type then.
    columns: Vec<(usize, arrow::datatypes::Field)>,
    /// Which of `columns` order the rows: all of them ([`DigestFormat::Rows`], or a table
    /// without a primary key), or the key's.
    order_columns: Vec<usize>,
    /// Encodes `order_columns` in Arrow's row format, which orders like the values.
    converter: RowConverter,
    /// The rows added since the last `finish`, encoded by `converter`, and their operations.
    rows: Rows,
    ops: Vec<u8>,
    /// The added rows' columns (`columns`, cast to their types at `epoch`), batch by batch,
    /// and where each added row is: (batch, row). Kept only for [`DigestFormat::Columns`].
    batches: Vec<Vec<ArrayRef>>,
    locations: Vec<(usize, usize)>,
    /// (order prefix, row) of every added row, sorted by `finish`.
    order: Vec<(u128, u32)>,
    piece: Vec<u8>,
}

impl ChangeDigester {
    pub fn new(def: &TableDef, epoch: Epoch, format: DigestFormat) -> Result<ChangeDigester> {
        let columns = def.columns_at(Some(epoch));
        let key = def.primary_key_indices();
        let order_columns: Vec<usize> = match format {
            DigestFormat::Columns if !key.is_empty() => key
                .iter()
                .map(|position| {
                    columns
                        .iter()
                        .position(|(p, _)| p == position)
                        .expect("a primary key column exists at every epoch")
                })
                .collect(),
            _ => (0..columns.len()).collect(),
        };
        let converter = row_converter(order_columns.iter().map(|&c| &columns[c].1))?;
        let rows = converter.empty_rows(0, 0);
        Ok(ChangeDigester {
            epoch,
            format,
            columns,
            order_columns,
            converter,
            rows,
            ops: Vec::new(),
            batches: Vec::new(),
            locations: Vec::new(),
            order: Vec::new(),
            piece: Vec::with_capacity(HASH_PIECE_BYTES + 1024),
        })
    }

    /// Adds row versions in the stored schema, all stamped with this digester's epoch.
    pub fn add_versions(&mut self, batch: &RecordBatch) -> Result<()> {
        let batch = &crate::versions::without_before_images(batch.clone())?;
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let epochs = batch
            .column_by_name(EPOCH_COLUMN)
            .expect("stored schema")
            .as_primitive::<UInt64Type>();
        assert!(
            epochs.values().iter().all(|&e| e == self.epoch.0),
            "a change digest covers one epoch's versions"
        );
        let ops = batch
            .column_by_name(OP_COLUMN)
            .expect("stored schema")
            .as_primitive::<UInt8Type>();
        self.append(batch)?;
        self.ops.extend_from_slice(ops.values());
        Ok(())
    }

    /// Adds rows with the table's columns first (the stored schema's leading columns, as
    /// routed rows or tombstones have them), all written by `op` at this digester's epoch:
    /// the same as adding them stamped, without building the stamped batch.
    pub fn add(&mut self, batch: &RecordBatch, op: RowOp) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        self.append(batch)?;
        self.ops
            .extend(std::iter::repeat_n(op as u8, batch.num_rows()));
        Ok(())
    }

    /// Appends `batch`'s rows: their columns as the table had them at the epoch (types as
    /// they were then), and the encoding of the columns that order them.
    fn append(&mut self, batch: &RecordBatch) -> Result<()> {
        let arrays = self
            .columns
            .iter()
            .map(|(position, field)| {
                let column = batch.column(*position);
                if column.data_type() == field.data_type() {
                    Ok(column.clone())
                } else {
                    Ok(cast(column, field.data_type())?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let ordering: Vec<ArrayRef> = self
            .order_columns
            .iter()
            .map(|&c| arrays[c].clone())
            .collect();
        self.converter.append(&mut self.rows, &ordering)?;
        if self.format == DigestFormat::Columns {
            let at = self.batches.len();
            self.locations
                .extend((0..batch.num_rows()).map(|row| (at, row)));
            self.batches.push(arrays);
        }
        Ok(())
    }

    /// The digest of the rows added since the last call; the digester is then empty.
    pub fn finish(&mut self) -> ComponentHash {
        assert_eq!(
            self.rows.num_rows(),
            self.ops.len(),
            "one operation per row"
        );
        self.sort();
        let mut out = HashInput::new(self.format, self.order.len(), &mut self.piece);
        match self.format {
            DigestFormat::Rows => {
                // Each row is (operation, length, bytes).
                for &(_, at) in &self.order {
                    let bytes = self.rows.row(at as usize).data();
                    out.push(&[self.ops[at as usize]]);
                    out.push(&(bytes.len() as u32).to_le_bytes());
                    out.push(bytes);
                }
            }
            DigestFormat::Columns => {
                let ops: Vec<u8> = self
                    .order
                    .iter()
                    .map(|&(_, at)| self.ops[at as usize])
                    .collect();
                out.push(&ops);
                let sorted: Vec<(usize, usize)> = self
                    .order
                    .iter()
                    .map(|&(_, at)| self.locations[at as usize])
                    .collect();
                // Rows often come in key order already (one batch, in order): then each
                // column is hashed as it is, without gathering it.
                let in_order = self.batches.len() == 1
                    && sorted.iter().enumerate().all(|(i, &(_, row))| row == i);
                for (c, (_, field)) in self.columns.iter().enumerate() {
                    let column = if in_order {
                        self.batches[0][c].clone()
                    } else if self.batches.is_empty() {
                        arrow::array::new_empty_array(field.data_type())
                    } else {
                        // The column's values in canonical order, as one array, hashed a
                        // buffer at a time.
                        let arrays: Vec<&dyn Array> =
                            self.batches.iter().map(|batch| batch[c].as_ref()).collect();
                        interleave(&arrays, &sorted)
                            .expect("the batches' columns have one type, their type at the epoch")
                    };
                    hash_column(&column, &mut out);
                }
            }
        }
        let digest = out.finish();
        self.rows.clear();
        self.ops.clear();
        self.batches.clear();
        self.locations.clear();
        digest
    }

    /// Sorts the added rows into the canonical order: by the encoding of their ordering
    /// columns, then operation, then (only where those tie) the whole row.
    fn sort(&mut self) {
        let (rows, ops) = (&self.rows, &self.ops);
        self.order.clear();
        self.order.extend(
            (0..rows.num_rows() as u32).map(|i| (order_prefix(rows.row(i as usize).as_ref()), i)),
        );
        // The row encoding orders like the values: sorting by it gives one order however the
        // rows came. Each row's first bytes are compared as a number held in the sorted
        // vector itself, and the rows' bytes, scattered over memory, are read only where
        // those are equal: the same order, without a cache miss per comparison.
        let by_order_columns = |&(px, x): &(u128, u32), &(py, y): &(u128, u32)| {
            px.cmp(&py)
                .then_with(|| rows.row(x as usize).cmp(&rows.row(y as usize)))
                .then_with(|| ops[x as usize].cmp(&ops[y as usize]))
        };
        self.order.sort_unstable_by(by_order_columns);
        let whole_row = self.order_columns.len() == self.columns.len();
        let ties = self
            .order
            .windows(2)
            .any(|w| by_order_columns(&w[0], &w[1]).is_eq());
        if ties && !whole_row {
            let whole = self.whole_rows();
            self.order.sort_unstable_by(|a, b| {
                by_order_columns(a, b)
                    .then_with(|| whole.row(a.1 as usize).cmp(&whole.row(b.1 as usize)))
            });
        }
    }

    /// Every added row, all its columns, in the row encoding (added order).
    fn whole_rows(&self) -> Rows {
        let converter = row_converter(self.columns.iter().map(|(_, field)| field))
            .expect("the columns' types were encodable when the rows were added");
        let mut whole = converter.empty_rows(0, 0);
        for batch in &self.batches {
            converter
                .append(&mut whole, batch)
                .expect("the columns' types were encodable when the rows were added");
        }
        whole
    }
}

/// A row encoder of `fields`' types, in order.
fn row_converter<'a>(
    fields: impl Iterator<Item = &'a arrow::datatypes::Field>,
) -> Result<RowConverter> {
    let sort_fields = fields
        .map(|field| SortField::new(field.data_type().clone()))
        .collect();
    Ok(RowConverter::new(sort_fields)?)
}

/// The bytes a digest hashes, gathered into large pieces before each call to the hasher.
struct HashInput<'a> {
    hasher: blake3::Hasher,
    piece: &'a mut Vec<u8>,
}

impl<'a> HashInput<'a> {
    fn new(format: DigestFormat, rows: usize, piece: &'a mut Vec<u8>) -> HashInput<'a> {
        let mut hasher = blake3::Hasher::new();
        hasher.update(format.domain());
        hasher.update(&(rows as u64).to_le_bytes());
        piece.clear();
        HashInput { hasher, piece }
    }

    fn push(&mut self, bytes: &[u8]) {
        if bytes.len() >= HASH_PIECE_BYTES {
            // Large enough to hash as it is (the hasher's input is one stream, so where it
            // was cut does not change the digest).
            self.hasher.update(self.piece);
            self.piece.clear();
            self.hasher.update(bytes);
            return;
        }
        self.piece.extend_from_slice(bytes);
        if self.piece.len() >= HASH_PIECE_BYTES {
            self.hasher.update(self.piece);
            self.piece.clear();
        }
    }

    fn finish(mut self) -> ComponentHash {
        self.hasher.update(self.piece);
        self.piece.clear();
        ComponentHash(*self.hasher.finalize().as_bytes())
    }
}

/// Hashes one column's values, in canonical order, in [`DigestFormat::Columns`]' form:
/// whether any value is null (and if so, one validity byte per row), then the values:
/// fixed-width ones as their little-endian bytes (zeros where null), booleans as a byte
/// each, and variable-width ones (strings, binaries, and any other type as its row
/// encoding) as every value's length (4 bytes, little-endian; 0 where null), then every
/// value's bytes.
fn hash_column(column: &ArrayRef, out: &mut HashInput<'_>) {
    let nulls = column.logical_nulls().filter(|n| n.null_count() > 0);
    out.push(&[nulls.is_some() as u8]);
    if let Some(nulls) = &nulls {
        let valid: Vec<u8> = nulls.iter().map(u8::from).collect();
        out.push(&valid);
    }
    let is_valid = |row: usize| nulls.as_ref().is_none_or(|n| n.is_valid(row));
    let data_type = column.data_type();
    if let Some(width) = data_type.primitive_width() {
        let data = column.to_data();
        let start = data.offset() * width;
        let values = &data.buffers()[0].as_slice()[start..start + column.len() * width];
        if nulls.is_none() {
            out.push(values);
        } else {
            let mut values = values.to_vec();
            for (row, value) in values.chunks_exact_mut(width).enumerate() {
                if !is_valid(row) {
                    value.fill(0);
                }
            }
            out.push(&values);
        }
        return;
    }
    match data_type {
        DataType::Boolean => {
            let values = column.as_boolean();
            let bytes: Vec<u8> = (0..column.len())
                .map(|row| (is_valid(row) && values.value(row)) as u8)
                .collect();
            out.push(&bytes);
        }
        DataType::Utf8 => {
            let strings = column.as_string::<i32>();
            hash_offset_values(out, strings.value_offsets(), strings.values(), &nulls)
        }
        DataType::LargeUtf8 => {
            let strings = column.as_string::<i64>();
            hash_offset_values(out, strings.value_offsets(), strings.values(), &nulls)
        }
        // Each typed array is taken once, outside the per-value closures: taking it per
        // value (a dynamic downcast each time, twice a value) was most of a publish's
        // hashing time outside the hasher itself.
        DataType::Utf8View => {
            let strings = column.as_string_view();
            hash_values(out, column.len(), is_valid, |row| {
                strings.value(row).as_bytes()
            })
        }
        DataType::Binary => {
            let binaries = column.as_binary::<i32>();
            hash_offset_values(out, binaries.value_offsets(), binaries.values(), &nulls)
        }
        DataType::LargeBinary => {
            let binaries = column.as_binary::<i64>();
            hash_offset_values(out, binaries.value_offsets(), binaries.values(), &nulls)
        }
        DataType::BinaryView => {
            let binaries = column.as_binary_view();
            hash_values(out, column.len(), is_valid, |row| binaries.value(row))
        }
        DataType::FixedSizeBinary(_) => {
            let binaries = column.as_fixed_size_binary();
            hash_values(out, column.len(), is_valid, |row| binaries.value(row))
        }
        other => {
            // Nested and rare types: the row encoding of this column alone.
            let encoded = RowConverter::new(vec![SortField::new(other.clone())])
                .and_then(|converter| converter.convert_columns(std::slice::from_ref(column)))
                .expect("the column's type was encodable when its rows were added");
            hash_values(out, column.len(), |_| true, |row| encoded.row(row).data());
        }
    }
}

/// [`hash_values`] of an array of offsets into one buffer of values, a buffer at a time
/// where no value is null.
fn hash_offset_values<O: arrow::array::OffsetSizeTrait>(
    out: &mut HashInput<'_>,
    offsets: &[O],
    values: &[u8],
    nulls: &Option<arrow::buffer::NullBuffer>,
) {
    let rows = offsets.len() - 1;
    let is_valid = |row: usize| nulls.as_ref().is_none_or(|n| n.is_valid(row));
    let bounds = |row: usize| (offsets[row].as_usize(), offsets[row + 1].as_usize());
    if nulls.is_some() {
        return hash_values(out, rows, is_valid, |row| {
            let (start, end) = bounds(row);
            &values[start..end]
        });
    }
    let lengths: Vec<u8> = offsets
        .windows(2)
        .flat_map(|w| ((w[1].as_usize() - w[0].as_usize()) as u32).to_le_bytes())
        .collect();
    out.push(&lengths);
    out.push(&values[offsets[0].as_usize()..offsets[rows].as_usize()]);
}

/// Hashes the lengths (4 bytes each, little-endian; 0 where not valid) of `rows` values,
/// then their bytes, as `value` reads them.
fn hash_values<'a>(
    out: &mut HashInput<'_>,
    rows: usize,
    is_valid: impl Fn(usize) -> bool,
    value: impl Fn(usize) -> &'a [u8],
) {
    let value = |row: usize| if is_valid(row) { value(row) } else { &[][..] };
    let lengths: Vec<u8> = (0..rows)
        .flat_map(|row| (value(row).len() as u32).to_le_bytes())
        .collect();
    out.push(&lengths);
    for row in 0..rows {
        out.push(value(row));
    }
}

/// The first 16 bytes of an encoded row as a big-endian number, zero-padded: two rows
/// whose prefixes differ compare as their prefixes do (bytes compare lexicographically, and
/// a shorter row is a prefix of the longer where they agree), so only equal prefixes need
/// the rows themselves compared.
fn order_prefix(bytes: &[u8]) -> u128 {
    let mut prefix = [0u8; 16];
    let n = bytes.len().min(16);
    prefix[..n].copy_from_slice(&bytes[..n]);
    u128::from_be_bytes(prefix)
}

/// The change digest of every epoch found in one partition's row versions (stored schema),
/// by epoch, each in the format `format_of` gives for its epoch.
pub fn digests_by_epoch(
    def: &TableDef,
    versions: &[RecordBatch],
    format_of: impl Fn(Epoch) -> DigestFormat,
) -> Result<BTreeMap<Epoch, ComponentHash>> {
    let versions: Vec<&RecordBatch> = versions.iter().filter(|b| b.num_rows() > 0).collect();
    let Some(first) = versions.first() else {
        return Ok(BTreeMap::new());
    };
    let all = concat_batches(&first.schema(), versions.iter().copied())?;
    let epoch_column = all
        .column_by_name(EPOCH_COLUMN)
        .expect("stored schema")
        .clone();
    let order = sort_to_indices(&epoch_column, None, None)?;
    let sorted = take_record_batch(&all, &order)?;
    let epochs = sorted
        .column_by_name(EPOCH_COLUMN)
        .expect("stored schema")
        .as_primitive::<UInt64Type>()
        .clone();
    let mut digests = BTreeMap::new();
    let mut start = 0;
    while start < sorted.num_rows() {
        let epoch = epochs.value(start);
        let end = (start..sorted.num_rows())
            .find(|&i| epochs.value(i) != epoch)
            .unwrap_or(sorted.num_rows());
        let slice = sorted.slice(start, end - start);
        let epoch = Epoch(epoch);
        digests.insert(
            epoch,
            change_digest(def, epoch, format_of(epoch), &[slice])?,
        );
        start = end;
    }
    Ok(digests)
}

/// The version id of `table` at `epoch`, which changed the partitions in `digests` and
/// follows version `previous`.
pub fn table_version_id(
    table: &str,
    epoch: Epoch,
    previous: &ComponentHash,
    digests: &BTreeMap<PartitionId, ComponentHash>,
) -> ComponentHash {
    let mut hasher = blake3::Hasher::new();
    hasher.update(VERSION_DOMAIN);
    hasher.update(&(table.len() as u32).to_le_bytes());
    hasher.update(table.as_bytes());
    hasher.update(&epoch.0.to_le_bytes());
    hasher.update(&previous.0);
    hasher.update(&(digests.len() as u32).to_le_bytes());
    for (partition, digest) in digests {
        hasher.update(&partition.0.to_le_bytes());
        hasher.update(&digest.0);
    }
    ComponentHash(*hasher.finalize().as_bytes())
}

#[cfg(test)]
mod tests;
