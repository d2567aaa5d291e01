//! A transaction: one connection's writes between `BEGIN` and `COMMIT`, published together
//! as one epoch (atomic across tables, as any publish is).
//!
//! Reads inside the transaction see the epoch current at its first statement (the
//! statement view is pinned then and kept), plus the transaction's own writes
//! ([`crate::own_writes`]).
//! `ROLLBACK`, or dropping the engine (a closed connection), publishes nothing.

use crate::error::{Result, SqlError};
use arrow::array::{BooleanArray, RecordBatch};
use arrow::compute::filter_record_batch;
use arrow::row::{OwnedRow, RowConverter, SortField};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use tessera_common::{Epoch, ReadEpochs};
use tessera_storage::versions::{conform_to_schema, stored_user_schema};
use tessera_storage::{TableChanges, TableDef};

/// The writes of an open transaction, in statement order.
#[derive(Debug, Default)]
pub struct Transaction {
    changes: Vec<TableChanges>,
    /// For each table a statement wrote rows computed from what it read, the earliest
    /// epoch such a statement read it at: COMMIT is refused if the table changed since.
    read_at: ReadEpochs,
    /// Whether the statement view has been pinned for this transaction (at its first
    /// statement); later statements keep it.
    pub(crate) view_pinned: bool,
}

impl Transaction {
    /// Keeps a statement's changes; `read` is the epoch it read the table at, if its rows
    /// came from that read.
    pub fn record(&mut self, change: TableChanges, read: Option<Epoch>) {
        if let Some(read) = read {
            let earliest = self.read_at.entry(change.table.clone()).or_insert(read);
            *earliest = (*earliest).min(read);
        }
        self.changes.push(change);
    }

    /// The tables this transaction has written so far.
    pub fn written_tables(&self) -> BTreeSet<&str> {
        self.changes.iter().map(|c| c.table.as_str()).collect()
    }

    /// This transaction's changes to `def` so far, folded into one (the newest statement's
    /// row or delete per key), or `None` if it has not written the table.
    pub fn pending(&self, def: &TableDef) -> Result<Option<TableChanges>> {
        let changes: Vec<TableChanges> = self
            .changes
            .iter()
            .filter(|c| c.table == def.name)
            .cloned()
            .collect();
        if changes.is_empty() {
            return Ok(None);
        }
        merge_table_changes(def, changes).map(Some)
    }

    /// The primary keys of `def` this transaction has written live rows for so far (rows it
    /// inserted or updated and did not delete since): an INSERT of one of them violates the
    /// primary key, as it would after COMMIT.
    pub fn live_keys(&self, def: &TableDef) -> Result<Vec<RecordBatch>> {
        let Some(pending) = self.pending(def)? else {
            return Ok(Vec::new());
        };
        let key = def.primary_key_indices();
        pending
            .upserts
            .iter()
            .map(|b| Ok(conform_to_schema(def, b)?.project(&key)?))
            .collect()
    }

    /// Every primary key of `def` this transaction has written so far, live or deleted.
    pub fn written_keys(&self, def: &TableDef) -> Result<Vec<RecordBatch>> {
        let Some(pending) = self.pending(def)? else {
            return Ok(Vec::new());
        };
        let key = def.primary_key_indices();
        let mut keys = pending
            .upserts
            .iter()
            .map(|b| Ok(conform_to_schema(def, b)?.project(&key)?))
            .collect::<Result<Vec<_>>>()?;
        keys.extend(pending.deletes);
        Ok(keys)
    }

    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// The changes to publish at commit: one `TableChanges` per table, where a later
    /// statement's row for a key replaces an earlier one's (an INSERT then an UPDATE of the
    /// same key publishes the updated row; an INSERT then a DELETE, a tombstone).
    ///
    /// With them, the epoch each table was read at (see [`Transaction::record`]).
    pub fn into_publish(
        self,
        def_of: impl Fn(&str) -> Option<TableDef>,
    ) -> Result<(Vec<TableChanges>, ReadEpochs)> {
        let mut by_table: BTreeMap<String, Vec<TableChanges>> = BTreeMap::new();
        for change in self.changes {
            by_table
                .entry(change.table.clone())
                .or_default()
                .push(change);
        }
        let changes = by_table
            .into_iter()
            .map(|(table, changes)| {
                let def = def_of(&table).ok_or_else(|| {
                    SqlError::Storage(tessera_storage::StorageError::UnknownTable(table.clone()))
                })?;
                merge_table_changes(&def, changes)
            })
            .collect::<Result<_>>()?;
        Ok((changes, self.read_at))
    }
}

/// Folds one table's changes, oldest first, into one: for each key only the newest
/// statement's row (an upsert or a delete) is kept, and the oldest statement's before
/// image, if that statement read the key from the table (see [`first_before_images`]).
fn merge_table_changes(def: &TableDef, changes: Vec<TableChanges>) -> Result<TableChanges> {
    let key = def.primary_key_indices();
    let mut merged = TableChanges::upserts(&def.name, Vec::new());
    if key.is_empty() || changes.len() == 1 {
        // Append-only rows have no key to collide on; one statement has nothing to fold.
        for change in changes {
            merged.upserts.extend(change.upserts);
            merged.deletes.extend(change.deletes);
            merged.before_images.extend(change.before_images);
        }
        return Ok(merged);
    }
    let schema = stored_user_schema(def);
    let converter = RowConverter::new(
        key.iter()
            .map(|&i| SortField::new(schema.field(i).data_type().clone()))
            .collect(),
    )?;
    merged.before_images = first_before_images(def, &converter, &changes)?;
    // Keys written by statements newer than the one being looked at.
    let mut newer: HashSet<OwnedRow> = HashSet::new();
    for change in changes.into_iter().rev() {
        let mut this_statement: Vec<OwnedRow> = Vec::new();
        let mut keep_unwritten = |keys: &RecordBatch, rows: &RecordBatch| -> Result<RecordBatch> {
            let converted = converter.convert_columns(keys.columns())?;
            let keep: BooleanArray = converted
                .iter()
                .map(|row| {
                    let fresh = !newer.contains(&row.owned());
                    if fresh {
                        this_statement.push(row.owned());
                    }
                    Some(fresh)
                })
                .collect();
            Ok(filter_record_batch(rows, &keep)?)
        };
        for batch in change.upserts.iter().rev() {
            let rows = conform_to_schema(def, batch)?;
            let kept = keep_unwritten(&rows.project(&key)?, &rows)?;
            merged.upserts.push(kept);
        }
        for batch in change.deletes.iter().rev() {
            let kept = keep_unwritten(batch, batch)?;
            merged.deletes.push(kept);
        }
        newer.extend(this_statement);
    }
    merged.upserts.retain(|b| b.num_rows() > 0);
    merged.deletes.retain(|b| b.num_rows() > 0);
    Ok(merged)
}

/// The before images a transaction's publish carries: a key's row as the table held it
/// before the transaction, which only the first statement writing the key read from the
/// table (later ones read the transaction's own row). So an image is kept only from a
/// statement that wrote the key first; a key first written blind (an INSERT) has none.
fn first_before_images(
    def: &TableDef,
    converter: &RowConverter,
    changes: &[TableChanges],
) -> Result<Vec<RecordBatch>> {
    let key = def.primary_key_indices();
    // Keys written by statements older than the one being looked at.
    let mut written: HashSet<OwnedRow> = HashSet::new();
    let mut images = Vec::new();
    for change in changes {
        for batch in &change.before_images {
            let rows = conform_to_schema(def, batch)?;
            let keys = converter.convert_columns(rows.project(&key)?.columns())?;
            let first: BooleanArray = keys
                .iter()
                .map(|row| Some(!written.contains(&row.owned())))
                .collect();
            images.push(filter_record_batch(&rows, &first)?);
        }
        for batch in &change.upserts {
            let keys = conform_to_schema(def, batch)?.project(&key)?;
            written.extend(
                converter
                    .convert_columns(keys.columns())?
                    .iter()
                    .map(|r| r.owned()),
            );
        }
        for keys in &change.deletes {
            written.extend(
                converter
                    .convert_columns(keys.columns())?
                    .iter()
                    .map(|r| r.owned()),
            );
        }
    }
    images.retain(|b| b.num_rows() > 0);
    Ok(images)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn def() -> TableDef {
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("v", DataType::Utf8, true),
        ]);
        TableDef::new("t", schema, vec!["id".into()], None).unwrap()
    }

    fn rows(ids: &[i64], values: &[&str]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("v", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(ids.to_vec())),
                Arc::new(StringArray::from(values.to_vec())),
            ],
        )
        .unwrap()
    }

    fn keys(ids: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(ids.to_vec()))]).unwrap()
    }

    fn ids(batches: &[RecordBatch]) -> Vec<i64> {
        let mut out: Vec<i64> = batches
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn the_newest_statement_wins_per_key() {
        let mut tx = Transaction::default();
        tx.record(
            TableChanges::upserts("t", vec![rows(&[1, 2, 3], &["a", "b", "c"])]),
            None,
        );
        tx.record(
            TableChanges::upserts("t", vec![rows(&[2], &["B"])]),
            Some(Epoch(5)),
        );
        tx.record(
            TableChanges::deletes("t", vec![keys(&[3, 4])]),
            Some(Epoch(4)),
        );
        let (merged, read_at) = tx.into_publish(|_| Some(def())).unwrap();
        assert_eq!(
            read_at,
            ReadEpochs::from([("t".to_string(), Epoch(4))]),
            "the earliest read of the table is checked at COMMIT"
        );
        assert_eq!(merged.len(), 1);
        assert_eq!(ids(&merged[0].upserts), vec![1, 2]);
        assert_eq!(ids(&merged[0].deletes), vec![3, 4]);
        let updated = merged[0]
            .upserts
            .iter()
            .find_map(|b| {
                let id = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                (0..b.num_rows()).find(|&i| id.value(i) == 2).map(|i| {
                    b.column(1)
                        .as_any()
                        .downcast_ref::<StringArray>()
                        .unwrap()
                        .value(i)
                        .to_string()
                })
            })
            .unwrap();
        assert_eq!(updated, "B", "the UPDATE replaced the INSERT's row");
    }

    #[test]
    fn a_keys_before_image_comes_from_the_first_statement_that_wrote_it() {
        let mut tx = Transaction::default();
        // Key 1 inserted blind, then updated: the UPDATE read the transaction's own row.
        tx.record(TableChanges::upserts("t", vec![rows(&[1], &["new"])]), None);
        let mut update = TableChanges::upserts("t", vec![rows(&[1, 2], &["x", "y"])]);
        update.before_images = vec![rows(&[1, 2], &["new", "table's"])];
        tx.record(update, Some(Epoch(3)));
        // Key 2 deleted after its update: the image stays the table's row.
        let mut delete = TableChanges::deletes("t", vec![keys(&[2, 3])]);
        delete.before_images = vec![rows(&[2, 3], &["y", "three"])];
        tx.record(delete, Some(Epoch(3)));
        let (merged, _) = tx.into_publish(|_| Some(def())).unwrap();
        let images = &merged[0].before_images;
        assert_eq!(ids(images), vec![2, 3], "key 1 was first written blind");
        let values: Vec<(i64, String)> = images
            .iter()
            .flat_map(|b| {
                let id = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                let v = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
                (0..b.num_rows())
                    .map(|i| (id.value(i), v.value(i).to_string()))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert!(values.contains(&(2, "table's".to_string())), "{values:?}");
        assert!(values.contains(&(3, "three".to_string())), "{values:?}");
    }

    #[test]
    fn an_unknown_table_is_named() {
        let mut tx = Transaction::default();
        tx.record(
            TableChanges::upserts("gone", vec![rows(&[1], &["a"])]),
            None,
        );
        let error = tx.into_publish(|_| None).unwrap_err().to_string();
        assert!(error.contains("gone"), "{error}");
    }
}
