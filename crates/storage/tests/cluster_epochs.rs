//! The store's side of a cluster publish: rows prepared under an epoch the metadata service
//! allocated stay invisible until committed, survive restarts and checkpoints while
//! undecided, and vanish when aborted.

use arrow::array::{Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use std::sync::Arc;
use tessera_common::{Epoch, PartitionId, PartitionRing};
use tessera_storage::versions::split_by_partition;
use tessera_storage::{PartitionChanges, Store, StoreConfig, TableDef};

fn def() -> TableDef {
    TableDef::new(
        "kv",
        Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
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
            Arc::new(Int64Array::from_iter_values((from..to).map(|k| k * 10))),
        ],
    )
    .unwrap()
}

fn config() -> StoreConfig {
    StoreConfig {
        partitions: 4,
        ..StoreConfig::default()
    }
}

/// Routes rows to their partitions as a coordinator does.
fn routed(batch: &RecordBatch) -> Vec<PartitionChanges> {
    split_by_partition(&def(), &PartitionRing::new(4), batch)
        .unwrap()
        .into_iter()
        .map(|(partition, rows)| PartitionChanges {
            table: "kv".into(),
            partition,
            upserts: vec![rows],
            deletes: vec![],
        })
        .collect()
}

/// Keys visible at `epoch`, sorted.
fn keys(store: &Store, epoch: Epoch) -> Vec<i64> {
    store.advance_visible(epoch);
    let def = store.table_def("kv").unwrap();
    let partitions: Vec<PartitionId> = (0..4).map(PartitionId).collect();
    let snapshot = store.snapshot("kv", Some(epoch)).unwrap();
    let mut keys = Vec::new();
    for partition in &partitions {
        let part = &snapshot.partitions[partition.0 as usize];
        let mut batches: Vec<RecordBatch> = part.memtable.clone();
        for component in &part.components {
            batches.extend(
                tessera_storage::component::read_component(
                    store.components_dir(),
                    &component.hash,
                    None,
                )
                .unwrap(),
            );
        }
        if let Some(live) = tessera_storage::versions::visible_rows(
            &batches,
            &def.primary_key_indices(),
            epoch,
            false,
        )
        .unwrap()
        {
            let column = live
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            keys.extend(column.values().iter().copied());
        }
    }
    keys.sort();
    keys
}

#[test]
fn prepared_rows_are_invisible_until_committed_and_survive_restarts() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path(), config()).unwrap();
        store.ensure_table(def()).unwrap();
        store.prepare_epoch(Epoch(3), routed(&rows(0, 10))).unwrap();
        // A large publish arrives in several calls; they add up.
        store
            .prepare_epoch(Epoch(3), routed(&rows(10, 20)))
            .unwrap();
        assert!(
            keys(&store, Epoch(3)).is_empty(),
            "prepared rows are not visible"
        );
        assert!(store.commit_epoch(Epoch(3)).unwrap());
        assert_eq!(keys(&store, Epoch(3)), (0..20).collect::<Vec<_>>());
        store
            .prepare_epoch(Epoch(5), routed(&rows(100, 110)))
            .unwrap();
        store
            .prepare_epoch(Epoch(6), routed(&rows(200, 210)))
            .unwrap();
        store.abort_epoch(Epoch(6)).unwrap();
    }
    // Restart: epoch 3 committed, 5 undecided, 6 aborted.
    let store = Store::open(dir.path(), config()).unwrap();
    assert_eq!(store.undecided_epochs(), vec![Epoch(5)]);
    assert_eq!(keys(&store, Epoch(6)), (0..20).collect::<Vec<_>>());
    // A checkpoint flushes what is committed and carries what is undecided forward.
    store.checkpoint().unwrap();
    drop(store);
    let store = Store::open(dir.path(), config()).unwrap();
    assert_eq!(store.undecided_epochs(), vec![Epoch(5)]);
    assert!(store.commit_epoch(Epoch(5)).unwrap());
    // Committing twice (a replayed metadata entry) changes nothing.
    assert!(!store.commit_epoch(Epoch(5)).unwrap());
    drop(store);
    let store = Store::open(dir.path(), config()).unwrap();
    let expected: Vec<i64> = (0..20).chain(100..110).collect();
    assert_eq!(keys(&store, Epoch(6)), expected);
    assert_eq!(
        keys(&store, Epoch(4)),
        (0..20).collect::<Vec<_>>(),
        "time travel below epoch 5"
    );
    assert!(store.undecided_epochs().is_empty());
}

#[test]
fn rows_sent_to_the_wrong_partition_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), config()).unwrap();
    store.ensure_table(def()).unwrap();
    let mut changes = routed(&rows(0, 50));
    let wrong = PartitionId((changes[0].partition.0 + 1) % 4);
    changes[0].partition = wrong;
    let error = store
        .prepare_epoch(Epoch(1), changes)
        .unwrap_err()
        .to_string();
    assert!(error.contains("belong to partition"), "{error}");
    assert!(store.undecided_epochs().is_empty(), "nothing was logged");
}

#[test]
fn a_replayed_create_or_drop_never_touches_a_newer_table() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), config()).unwrap();
    let mut old = def();
    old.generation = 10;
    let mut new = def();
    new.generation = 20;
    store.ensure_table(new.clone()).unwrap();
    store.prepare_epoch(Epoch(1), routed(&rows(0, 5))).unwrap();
    store.commit_epoch(Epoch(1)).unwrap();
    // Replaying the older table's create and drop is a no-op.
    store.ensure_table(old).unwrap();
    store.drop_table_generation("kv", 10).unwrap();
    assert_eq!(store.table_def("kv").unwrap().generation, 20);
    assert_eq!(keys(&store, Epoch(1)).len(), 5);
    store.drop_table_generation("kv", 20).unwrap();
    assert!(store.table_def("kv").is_none());
}
