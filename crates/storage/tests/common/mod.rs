//! Helpers shared by the storage integration tests (each test file uses some of them).
#![allow(dead_code)]

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::{Store, StoreConfig, TableDef};

/// A batch of BIGINT columns named `names`, NOT NULL.
pub fn int64_batch(columns: Vec<Vec<i64>>, names: &[&str]) -> RecordBatch {
    let fields: Vec<Field> = names
        .iter()
        .map(|n| Field::new(*n, DataType::Int64, false))
        .collect();
    RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns
            .into_iter()
            .map(|c| Arc::new(Int64Array::from(c)) as _)
            .collect(),
    )
    .unwrap()
}

/// Table `kv`: a BIGINT key `k` and a BIGINT value `v`.
pub fn def() -> TableDef {
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

/// The rows of `table` a reader sees at `epoch`, read from every partition's components and
/// memory in a snapshot at that epoch (one batch per partition that has any).
pub fn live_rows(store: &Store, table: &str, epoch: Epoch) -> Vec<RecordBatch> {
    let def = store.table_def(table).unwrap();
    let snapshot = store.snapshot(table, Some(epoch)).unwrap();
    let mut live = Vec::new();
    for part in &snapshot.partitions {
        let mut batches: Vec<RecordBatch> = part.memtable.clone();
        for component in &part.components {
            batches.extend(
                tessera_storage::component::read_component(
                    store.components_dir(),
                    &def,
                    &component.hash,
                    None,
                )
                .unwrap(),
            );
        }
        live.extend(
            tessera_storage::versions::visible_rows(
                &batches,
                &def.primary_key_indices(),
                epoch,
                false,
            )
            .unwrap(),
        );
    }
    live
}

/// A store under `dir` with `partitions` partitions and otherwise default settings.
pub fn store_with_partitions(dir: &std::path::Path, partitions: u32) -> Arc<Store> {
    Store::open(
        dir,
        StoreConfig {
            partitions,
            ..StoreConfig::default()
        },
    )
    .unwrap()
}
