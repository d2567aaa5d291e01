//! A replica's side of log shipping: the head of a partition's log shipping checks, stamps
//! and encodes the rows once (`Store::encode_prepared`) and logs them
//! (`Store::log_prepared`); the other replicas log those very messages as they arrive
//! (`Store::prepare_received`). A replica that serves the partition decodes them; a cold
//! standby keeps them undecoded until a promotion replays its log.

use arrow::array::{Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use std::sync::Arc;
use tessera_common::{Epoch, PartitionId, PartitionRing};
use tessera_storage::prepared::EncodedRows;
use tessera_storage::routing::split_by_partition;
use tessera_storage::{PartitionChanges, StorageError, Store, StoreConfig, TableDef};

mod common;

const PARTITIONS: u32 = 4;

/// Table `notes`: a BIGINT key and a text note.
fn def() -> TableDef {
    TableDef::new(
        "notes",
        Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("note", DataType::Utf8, false),
        ]),
        vec!["k".into()],
        None,
    )
    .unwrap()
}

fn rows(from: i64, to: i64) -> RecordBatch {
    RecordBatch::try_new(
        Arc::new(def().schema.clone()),
        vec![
            Arc::new(Int64Array::from_iter_values(from..to)),
            Arc::new(StringArray::from_iter_values((from..to).map(|k| {
                format!("note number {k}, long enough to sit out of line")
            }))),
        ],
    )
    .unwrap()
}

fn routed(batch: &RecordBatch) -> Vec<PartitionChanges> {
    split_by_partition(&def(), &PartitionRing::new(PARTITIONS), batch)
        .unwrap()
        .into_iter()
        .map(|(partition, rows)| PartitionChanges {
            table: "notes".into(),
            partition,
            upserts: vec![rows],
            deletes: vec![],
            before_images: vec![],
        })
        .collect()
}

fn open(dir: &std::path::Path, cold: bool) -> Arc<Store> {
    let store = Store::open(
        dir,
        StoreConfig {
            partitions: PARTITIONS,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.ensure_table(def()).unwrap();
    if cold {
        store.set_standby_partitions((0..PARTITIONS).map(PartitionId).collect());
    }
    store
}

/// The (key, note) rows visible at `epoch`, sorted by key.
fn visible(store: &Store, epoch: Epoch) -> Vec<(i64, String)> {
    store.advance_visible(epoch);
    let mut rows: Vec<(i64, String)> = common::live_rows(store, "notes", epoch)
        .iter()
        .flat_map(|live| {
            let keys = live
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            let notes = arrow::compute::cast(live.column(1), &DataType::Utf8).unwrap();
            let notes = notes.as_any().downcast_ref::<StringArray>().unwrap();
            (0..live.num_rows())
                .map(|i| (keys.value(i), notes.value(i).to_string()))
                .collect::<Vec<_>>()
        })
        .collect();
    rows.sort();
    rows
}

/// The head prepares `batch` for `epoch`; returns what it ships to the other replicas.
fn prepare_at_head(
    head: &Store,
    epoch: Epoch,
    batch: &RecordBatch,
) -> Vec<(PartitionId, EncodedRows)> {
    let entries = head.encode_prepared(epoch, &routed(batch)).unwrap();
    let shipped = entries
        .iter()
        .map(|e| (e.partition, e.rows.clone()))
        .collect();
    head.log_prepared(epoch, entries).unwrap();
    shipped
}

#[test]
fn replicas_log_the_rows_their_head_encoded_and_read_them_as_it_does() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let head = open(dirs[0].path(), false);
    let hot = open(dirs[1].path(), false);
    let cold = open(dirs[2].path(), true);
    for (epoch, batch) in [(Epoch(1), rows(0, 200)), (Epoch(2), rows(150, 300))] {
        let shipped = prepare_at_head(&head, epoch, &batch);
        for replica in [&hot, &cold] {
            replica.prepare_received(epoch, "notes", &shipped).unwrap();
        }
        for store in [&head, &hot, &cold] {
            assert!(store.commit_epoch(epoch).unwrap());
        }
    }
    let expected = visible(&head, Epoch(2));
    assert_eq!(expected.len(), 300);
    assert_eq!(visible(&hot, Epoch(2)), expected);
    assert_eq!(visible(&head, Epoch(1)).len(), 200);
    assert_eq!(visible(&hot, Epoch(1)), visible(&head, Epoch(1)));

    // An undecided epoch whose rows stayed encoded is logged again by a checkpoint, and
    // survives it and a restart.
    let shipped = prepare_at_head(&head, Epoch(3), &rows(300, 320));
    cold.prepare_received(Epoch(3), "notes", &shipped).unwrap();
    cold.checkpoint().unwrap();
    drop(cold);
    let cold = open(dirs[2].path(), true);
    assert_eq!(cold.undecided_epochs(), vec![Epoch(3)]);
    assert!(cold.commit_epoch(Epoch(3)).unwrap());
    assert!(head.commit_epoch(Epoch(3)).unwrap());

    // Promoted, the cold standby replays the logged messages into the same rows.
    let promoted = cold.set_standby_partitions(Default::default());
    cold.promote(&promoted).unwrap();
    for epoch in 1..=3 {
        assert_eq!(visible(&cold, Epoch(epoch)), visible(&head, Epoch(epoch)));
    }
}

/// The head's rows for `epoch`, with the first byte of one note turned into invalid UTF-8.
fn damaged(head: &Store, epoch: Epoch) -> Vec<(PartitionId, EncodedRows)> {
    let mut shipped = prepare_at_head(head, epoch, &rows(0, 50));
    let (_, rows) = &mut shipped[0];
    let mut body = rows.body.to_vec();
    let at = body
        .windows(4)
        .position(|w| w == b"note")
        .expect("the notes are in the body");
    body[at] = 0xff;
    *rows = EncodedRows::received(rows.schema.clone(), rows.header.clone(), body.into()).unwrap();
    shipped
}

#[test]
fn a_cold_standby_logs_shipped_rows_without_decoding_them_but_a_serving_replica_checks_them() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let head = open(dirs[0].path(), false);
    let shipped = damaged(&head, Epoch(1));

    // A replica that serves the partition decodes what it logs, and so refuses rows that
    // are not valid Arrow data.
    let serving = open(dirs[1].path(), false);
    let refused = serving
        .prepare_received(Epoch(1), "notes", &shipped)
        .unwrap_err();
    let message = refused.to_string();
    assert!(
        message.contains("malformed: partition") && message.contains("Invalid UTF8"),
        "{message}"
    );
    assert!(serving.undecided_epochs().is_empty(), "nothing was logged");

    // A cold standby logs them as they are: it does not decode them (the head checked
    // them). That is the work log shipping saves it.
    let cold = open(dirs[2].path(), true);
    cold.prepare_received(Epoch(1), "notes", &shipped).unwrap();
    assert_eq!(cold.undecided_epochs(), vec![Epoch(1)]);
}

#[test]
fn shipped_rows_in_another_schema_are_refused_as_a_schema_mismatch() {
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let head = open(dirs[0].path(), false);
    let shipped = prepare_at_head(&head, Epoch(1), &rows(0, 10));
    let replica = open(dirs[1].path(), true);
    // Rows of a table whose stored schema differs (here: another table's).
    let other = TableDef::new(
        "other",
        Schema::new(vec![Field::new("k", DataType::Int64, false)]),
        vec!["k".into()],
        None,
    )
    .unwrap();
    replica.ensure_table(other).unwrap();
    match replica.prepare_received(Epoch(1), "other", &shipped) {
        Err(StorageError::SchemaMismatch { table, reason }) => {
            assert_eq!(table, "other");
            assert!(reason.contains("stored schema"), "{reason}");
        }
        other => panic!("expected a schema mismatch, got {other:?}"),
    }
    assert!(replica.undecided_epochs().is_empty());
}
