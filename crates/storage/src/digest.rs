//! Version ids: what a table's content at an epoch hashes to, equal on every replica.
//!
//! A table version id must come out the same on any node holding the same data, yet
//! replicas flush and merge on their own, so their components and manifests differ. The id
//! is therefore built from content, not layout:
//!
//! - the **change digest** of one partition at one epoch hashes the row versions that epoch
//!   wrote there, in a canonical form: each row as Arrow's row encoding of the columns the
//!   table had at that epoch (types as they were then, so later widenings and added
//!   columns do not change it), with its operation, sorted; how the rows were batched,
//!   flushed or merged does not matter;
//! - the **table version id** at an epoch chains the previous version id with that epoch's
//!   change digests, per partition it touched. Each table's version ids form a hash chain
//!   (Pond's stream of versions): one changed row anywhere in its history changes every
//!   later id.
//!
//! The publish coordinator computes the digests from the rows it routes; `tessera verify`
//! recomputes them from the components and memory each replica holds.

use crate::catalog::TableDef;
use crate::error::Result;
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::compute::{cast, concat_batches, sort_to_indices, take_record_batch};
use arrow::datatypes::{UInt64Type, UInt8Type};
use arrow::row::{RowConverter, SortField};
use std::collections::BTreeMap;
use tessera_common::{ComponentHash, Epoch, PartitionId, RowOp, EPOCH_COLUMN, OP_COLUMN};

/// Bumped if the canonical form ever changes (old ids stay checkable by their version).
const DIGEST_DOMAIN: &[u8] = b"tessera change digest v1";
const VERSION_DOMAIN: &[u8] = b"tessera table version v1";

/// Bytes of encoded rows gathered before each call to the hasher.
const HASH_PIECE_BYTES: usize = 64 * 1024;

/// The version id a table has before its first publish.
pub const GENESIS: ComponentHash = ComponentHash([0; 32]);

/// The change digest of the row versions `epoch` wrote to one partition of `def`.
/// `versions` are in the stored schema (the table's columns, then the epoch and operation
/// columns), all stamped with `epoch`.
pub fn change_digest(
    def: &TableDef,
    epoch: Epoch,
    versions: &[RecordBatch],
) -> Result<ComponentHash> {
    let mut digester = ChangeDigester::new(def, epoch)?;
    for batch in versions {
        digester.add_versions(batch)?;
    }
    Ok(digester.finish())
}

/// Change digests of one table's partitions at one epoch, one partition after another: the
/// rows of a partition are added, then [`ChangeDigester::finish`] gives its digest and
/// starts the next. The row encoder and every buffer (encoded rows, their order, the
/// hasher's input) are kept from one partition to the next, so a publish touching many
/// partitions allocates them once, not once per partition and batch.
pub struct ChangeDigester {
    epoch: Epoch,
    /// The table's columns at `epoch`: position in the stored schema, and type then.
    columns: Vec<(usize, arrow::datatypes::Field)>,
    converter: RowConverter,
    /// The rows added since the last `finish`, in the row encoding, and their operations.
    rows: arrow::row::Rows,
    ops: Vec<u8>,
    /// (order prefix, row) of every added row, sorted by `finish`.
    order: Vec<(u128, u32)>,
    piece: Vec<u8>,
}

impl ChangeDigester {
    pub fn new(def: &TableDef, epoch: Epoch) -> Result<ChangeDigester> {
        let columns = def.columns_at(Some(epoch));
        let converter = RowConverter::new(
            columns
                .iter()
                .map(|(_, field)| SortField::new(field.data_type().clone()))
                .collect(),
        )?;
        let rows = converter.empty_rows(0, 0);
        Ok(ChangeDigester {
            epoch,
            columns,
            converter,
            rows,
            ops: Vec::new(),
            order: Vec::new(),
            piece: Vec::with_capacity(HASH_PIECE_BYTES + 1024),
        })
    }

    /// Adds row versions in the stored schema, all stamped with this digester's epoch.
    pub fn add_versions(&mut self, batch: &RecordBatch) -> Result<()> {
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
        self.encode(batch)?;
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
        self.encode(batch)?;
        self.ops
            .extend(std::iter::repeat_n(op as u8, batch.num_rows()));
        Ok(())
    }

    /// Appends `batch`'s rows, in the row encoding of the columns the table had at the
    /// epoch (types as they were then), to the rows added so far.
    fn encode(&mut self, batch: &RecordBatch) -> Result<()> {
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
        self.converter.append(&mut self.rows, &arrays)?;
        Ok(())
    }

    /// The digest of the rows added since the last call; the digester is then empty.
    pub fn finish(&mut self) -> ComponentHash {
        let (rows, ops) = (&self.rows, &self.ops);
        assert_eq!(rows.num_rows(), ops.len(), "one operation per row");
        self.order.clear();
        self.order.extend(
            (0..rows.num_rows() as u32).map(|i| (order_prefix(rows.row(i as usize).as_ref()), i)),
        );
        // The row encoding orders like the values, key columns included: sorting by it gives
        // one order however the rows came. Each row's first bytes are compared as a number
        // held in the sorted vector itself, and the rows' bytes, scattered over memory, are
        // read only where those are equal: the same order, without a cache miss per
        // comparison (a million rows sorted several times faster).
        self.order.sort_unstable_by(|&(px, x), &(py, y)| {
            px.cmp(&py)
                .then_with(|| rows.row(x as usize).cmp(&rows.row(y as usize)))
                .then_with(|| ops[x as usize].cmp(&ops[y as usize]))
        });
        let mut hasher = blake3::Hasher::new();
        hasher.update(DIGEST_DOMAIN);
        hasher.update(&(self.order.len() as u64).to_le_bytes());
        // Each row is (operation, length, bytes); they are gathered into large pieces first,
        // since hashing a few bytes at a time costs more than the hashing itself. The bytes
        // hashed, and so the digest, are the same.
        let piece = &mut self.piece;
        piece.clear();
        for &(_, at) in &self.order {
            let bytes = rows.row(at as usize);
            let bytes: &[u8] = bytes.as_ref();
            piece.push(ops[at as usize]);
            piece.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            piece.extend_from_slice(bytes);
            if piece.len() >= HASH_PIECE_BYTES {
                hasher.update(piece);
                piece.clear();
            }
        }
        hasher.update(piece);
        piece.clear();
        self.rows.clear();
        self.ops.clear();
        ComponentHash(*hasher.finalize().as_bytes())
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
/// by epoch.
pub fn digests_by_epoch(
    def: &TableDef,
    versions: &[RecordBatch],
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
        digests.insert(Epoch(epoch), change_digest(def, Epoch(epoch), &[slice])?);
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
mod tests {
    use super::*;
    use crate::versions::{stamp, tombstone_rows};
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    use tessera_common::RowOp;

    fn def() -> TableDef {
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]);
        TableDef::new("t", schema, vec!["id".into()], None).unwrap()
    }

    fn rows(def: &TableDef, ids: &[i64], names: &[&str]) -> RecordBatch {
        RecordBatch::try_new(
            def.schema_ref(),
            vec![
                Arc::new(Int64Array::from(ids.to_vec())),
                Arc::new(StringArray::from(names.to_vec())),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_digest_ignores_batching_and_order_but_not_content() {
        let def = def();
        let e = Epoch(3);
        let whole = stamp(
            &def,
            &rows(&def, &[1, 2, 3], &["a", "b", "c"]),
            e,
            RowOp::Upsert,
        )
        .unwrap();
        let split = [
            stamp(&def, &rows(&def, &[3], &["c"]), e, RowOp::Upsert).unwrap(),
            stamp(&def, &rows(&def, &[2, 1], &["b", "a"]), e, RowOp::Upsert).unwrap(),
        ];
        let digest = change_digest(&def, e, &[whole]).unwrap();
        assert_eq!(change_digest(&def, e, &split).unwrap(), digest);
        let changed = stamp(
            &def,
            &rows(&def, &[1, 2, 3], &["a", "b", "C"]),
            e,
            RowOp::Upsert,
        )
        .unwrap();
        assert_ne!(change_digest(&def, e, &[changed]).unwrap(), digest);
        // A delete of a key is not an upsert of it.
        let keys = rows(&def, &[1], &["a"]).project(&[0]).unwrap();
        let delete = stamp(
            &def,
            &tombstone_rows(&def, &keys).unwrap(),
            e,
            RowOp::Delete,
        )
        .unwrap();
        let upsert_null = stamp(
            &def,
            &tombstone_rows(&def, &keys).unwrap(),
            e,
            RowOp::Upsert,
        )
        .unwrap();
        assert_ne!(
            change_digest(&def, e, &[delete]).unwrap(),
            change_digest(&def, e, &[upsert_null]).unwrap()
        );
    }

    /// A digester fed unstamped rows with their operation, partition after partition,
    /// gives each partition the digest of its stamped versions on their own.
    #[test]
    fn a_digester_reused_across_partitions_digests_each_as_its_stamped_rows() {
        let def = def();
        let e = Epoch(5);
        let first = rows(&def, &[1, 2, 3], &["a", "b", "c"]);
        let second = rows(&def, &[9, 8], &["i", "h"]);
        let deleted =
            tombstone_rows(&def, &rows(&def, &[4], &["d"]).project(&[0]).unwrap()).unwrap();
        let mut digester = ChangeDigester::new(&def, e).unwrap();
        digester.add(&first, RowOp::Upsert).unwrap();
        digester.add(&deleted, RowOp::Delete).unwrap();
        let first_digest = digester.finish();
        digester.add(&second, RowOp::Upsert).unwrap();
        let second_digest = digester.finish();
        let stamped = |batch: &RecordBatch, op| stamp(&def, batch, e, op).unwrap();
        assert_eq!(
            first_digest,
            change_digest(
                &def,
                e,
                &[
                    stamped(&first, RowOp::Upsert),
                    stamped(&deleted, RowOp::Delete)
                ]
            )
            .unwrap()
        );
        assert_eq!(
            second_digest,
            change_digest(&def, e, &[stamped(&second, RowOp::Upsert)]).unwrap()
        );
        assert_ne!(first_digest, second_digest);
        // Finished and fed nothing: the digest of no rows, not of the last partition's.
        assert_eq!(digester.finish(), change_digest(&def, e, &[]).unwrap());
    }

    /// Rows whose first 16 encoded bytes agree are ordered by their whole encoding: the
    /// digest still does not depend on the order they came in.
    #[test]
    fn rows_sharing_a_long_prefix_still_digest_the_same_in_any_order() {
        let schema = Schema::new(vec![
            Field::new("name", DataType::Utf8, false),
            Field::new("id", DataType::Int64, false),
        ]);
        let def = TableDef::new("t", schema, vec!["name".into()], None).unwrap();
        let names: Vec<String> = (0..2000)
            .map(|i| format!("a long shared prefix, then {}", (i * 7919) % 2000))
            .collect();
        let batch = |order: &[usize]| {
            let rows = RecordBatch::try_new(
                def.schema_ref(),
                vec![
                    Arc::new(StringArray::from_iter_values(
                        order.iter().map(|&i| names[i].as_str()),
                    )),
                    Arc::new(Int64Array::from_iter_values(
                        order.iter().map(|&i| i as i64),
                    )),
                ],
            )
            .unwrap();
            stamp(&def, &rows, Epoch(2), RowOp::Upsert).unwrap()
        };
        let forward: Vec<usize> = (0..2000).collect();
        let backward: Vec<usize> = (0..2000).rev().collect();
        let shuffled: Vec<usize> = (0..2000).map(|i| (i * 1237) % 2000).collect();
        let digest = change_digest(&def, Epoch(2), &[batch(&forward)]).unwrap();
        assert_eq!(
            change_digest(&def, Epoch(2), &[batch(&backward)]).unwrap(),
            digest
        );
        let (a, b) = shuffled.split_at(700);
        assert_eq!(
            change_digest(&def, Epoch(2), &[batch(b), batch(a)]).unwrap(),
            digest
        );
    }

    /// The canonical form is fixed (a changed one is a new `DIGEST_DOMAIN`): this digest
    /// was computed when the form was defined, and signed chains on disk depend on it.
    #[test]
    fn the_canonical_form_is_pinned() {
        let def = def();
        let e = Epoch(7);
        let ids: Vec<i64> = (0..5000).rev().collect();
        let names: Vec<String> = ids.iter().map(|i| format!("name-{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let upserts = stamp(&def, &rows(&def, &ids, &names), e, RowOp::Upsert).unwrap();
        let keys = rows(&def, &[9001], &["x"]).project(&[0]).unwrap();
        let delete = stamp(
            &def,
            &tombstone_rows(&def, &keys).unwrap(),
            e,
            RowOp::Delete,
        )
        .unwrap();
        let digest = change_digest(&def, e, &[upserts, delete]).unwrap();
        assert_eq!(
            digest.to_hex(),
            "141077b9530a30b19536e92bb04aab7c0a3228debbfc4961a50234daaa3be49e"
        );
    }

    #[test]
    fn digests_by_epoch_match_each_epoch_on_its_own() {
        let def = def();
        let first = stamp(
            &def,
            &rows(&def, &[1, 2], &["a", "b"]),
            Epoch(1),
            RowOp::Upsert,
        )
        .unwrap();
        let second = stamp(&def, &rows(&def, &[2], &["B"]), Epoch(2), RowOp::Upsert).unwrap();
        let mixed = concat_batches(&first.schema(), [&second, &first]).unwrap();
        let digests = digests_by_epoch(&def, &[mixed]).unwrap();
        assert_eq!(digests.len(), 2);
        assert_eq!(
            digests[&Epoch(1)],
            change_digest(&def, Epoch(1), &[first]).unwrap()
        );
        assert_eq!(
            digests[&Epoch(2)],
            change_digest(&def, Epoch(2), &[second]).unwrap()
        );
    }

    #[test]
    fn a_version_id_chains_its_predecessor() {
        let digests = BTreeMap::from([(PartitionId(4), ComponentHash([7; 32]))]);
        let one = table_version_id("t", Epoch(1), &GENESIS, &digests);
        let two = table_version_id("t", Epoch(2), &one, &digests);
        assert_ne!(one, two);
        assert_ne!(two, table_version_id("t", Epoch(2), &GENESIS, &digests));
        assert_ne!(one, table_version_id("u", Epoch(1), &GENESIS, &digests));
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use crate::versions::stamp;
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    use tessera_common::RowOp;

    /// `cargo test --release -p tessera-storage digest_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn digest_timing() {
        let schema = Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("line", DataType::Int64, false),
            Field::new("qty", DataType::Float64, false),
            Field::new("price", DataType::Float64, false),
            Field::new("comment", DataType::Utf8, false),
        ]);
        let def = TableDef::new("t", schema, vec!["k".into(), "line".into()], None).unwrap();
        let n = 1_000_000i64;
        let mut x: u64 = 12345;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let keys: Vec<i64> = (0..n).map(|_| (next() % 10_000_000) as i64).collect();
        let batch = RecordBatch::try_new(
            def.schema_ref(),
            vec![
                Arc::new(Int64Array::from(keys.clone())),
                Arc::new(Int64Array::from((0..n).map(|i| i % 7).collect::<Vec<_>>())),
                Arc::new(Float64Array::from(
                    (0..n).map(|i| i as f64).collect::<Vec<_>>(),
                )),
                Arc::new(Float64Array::from(
                    (0..n).map(|i| i as f64 * 1.5).collect::<Vec<_>>(),
                )),
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|i| format!("a comment of some length, row {i}")),
                )),
            ],
        )
        .unwrap();
        let e = Epoch(3);
        let stamped = stamp(&def, &batch, e, RowOp::Upsert).unwrap();
        let batches: Vec<RecordBatch> = (0..10)
            .map(|i| stamped.slice(i * 100_000, 100_000))
            .collect();
        for _ in 0..3 {
            let started = std::time::Instant::now();
            let digest = change_digest(&def, e, &batches).unwrap();
            println!(
                "change_digest of {n} rows: {:?} ({digest})",
                started.elapsed()
            );
        }
        let started = std::time::Instant::now();
        let mut bytes = 0;
        for b in &batches {
            let mut w = arrow::ipc::writer::StreamWriter::try_new(Vec::new(), &b.schema()).unwrap();
            w.write(b).unwrap();
            w.finish().unwrap();
            bytes += w.into_inner().unwrap().len();
        }
        println!(
            "IPC encoding of the same rows ({bytes} bytes): {:?}",
            started.elapsed()
        );
    }
}
