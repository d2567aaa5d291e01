//! Helpers shared by the storage integration tests (each test file uses some of them).
#![allow(dead_code)]

use arrow::array::Array;
use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use std::sync::Arc;
use tessera_common::{Epoch, PartitionId, PartitionRing};
use tessera_storage::routing::split_by_partition;
use tessera_storage::{PartitionChanges, Store, StoreConfig, TableDef};

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

/// Rows of `kv` for keys `from..to`, each value ten times its key.
pub fn kv_rows(from: i64, to: i64) -> RecordBatch {
    RecordBatch::try_new(
        Arc::new(def().schema.clone()),
        vec![
            Arc::new(Int64Array::from_iter_values(from..to)),
            Arc::new(Int64Array::from_iter_values((from..to).map(|k| k * 10))),
        ],
    )
    .unwrap()
}

/// `kv` rows routed to their partitions (of `partitions`) as a coordinator does.
pub fn routed_kv(batch: &RecordBatch, partitions: u32) -> Vec<PartitionChanges> {
    split_by_partition(&def(), &PartitionRing::new(partitions), batch)
        .unwrap()
        .into_iter()
        .map(|(partition, rows)| PartitionChanges {
            table: "kv".into(),
            partition,
            upserts: vec![rows],
            deletes: vec![],
            before_images: vec![],
        })
        .collect()
}

/// What a primary's announcement makes a cold standby do for one partition of `kv`: take
/// the primary's components in place of its own. Returns the epoch they cover.
pub fn ship_partition(primary: &Store, standby: &Store, partition: PartitionId) -> Epoch {
    let (components, covered) = primary.shipped_manifest("kv", partition).unwrap();
    let fetched = components
        .iter()
        .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
        .collect();
    standby
        .install_shipped_components("kv", partition, components, fetched, covered)
        .unwrap();
    covered
}

/// The keys of `kv` visible at `epoch`, sorted.
pub fn visible_keys(store: &Store, epoch: Epoch) -> Vec<i64> {
    store.advance_visible(epoch);
    let mut keys: Vec<i64> = live_rows(store, "kv", epoch)
        .iter()
        .flat_map(|live| {
            let column = live
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            column.values().to_vec()
        })
        .collect();
    keys.sort();
    keys
}
