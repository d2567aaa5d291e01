//! Tiered merges: a table loaded in a few publishes of similar size is merged down to one
//! component per partition at the checkpoint that flushes the last of them, long before
//! its components number more than the merge threshold. A small change after a large base
//! waits for the count rule. With tiered merges off, the loads stay apart.

use std::sync::Arc;
use tessera_storage::{Store, StoreConfig, TableChanges};

mod common;
use common::{def, kv_rows, visible_keys};

const PARTITIONS: u32 = 4;

fn open(dir: &std::path::Path, tiered_merges: bool) -> Arc<Store> {
    let store = Store::open(
        dir,
        StoreConfig {
            partitions: PARTITIONS,
            tiered_merges,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.ensure_table(def()).unwrap();
    store
}

/// Publishes keys `from..to` and checkpoints them into components.
fn load(store: &Store, from: i64, to: i64) {
    store
        .publish(vec![TableChanges::upserts("kv", vec![kv_rows(from, to)])])
        .unwrap();
    store.checkpoint().unwrap();
}

/// How many live (not history) components each partition of `kv` has.
fn live_components(store: &Store) -> Vec<usize> {
    let snapshot = store.snapshot("kv", None).unwrap();
    snapshot
        .partitions
        .iter()
        .map(|p| p.components.iter().filter(|c| !c.is_history()).count())
        .collect()
}

#[test]
fn loads_of_similar_size_merge_into_one_component_per_partition() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), true);
    load(&store, 0, 4_000);
    assert_eq!(live_components(&store), vec![1; PARTITIONS as usize]);
    load(&store, 4_000, 8_000);
    assert_eq!(live_components(&store), vec![1; PARTITIONS as usize]);
    load(&store, 8_000, 12_000);
    assert_eq!(live_components(&store), vec![1; PARTITIONS as usize]);
    let epoch = store.snapshot("kv", None).unwrap().epoch;
    assert_eq!(visible_keys(&store, epoch), (0..12_000).collect::<Vec<_>>());

    // A small change after the large base is left for the count rule.
    load(&store, 12_000, 12_040);
    assert_eq!(live_components(&store), vec![2; PARTITIONS as usize]);
    let epoch = store.snapshot("kv", None).unwrap().epoch;
    assert_eq!(visible_keys(&store, epoch), (0..12_040).collect::<Vec<_>>());
}

#[test]
fn without_tiered_merges_loads_stay_apart_until_they_crowd() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), false);
    for load_index in 0..3 {
        load(&store, load_index * 4_000, (load_index + 1) * 4_000);
    }
    assert_eq!(live_components(&store), vec![3; PARTITIONS as usize]);
}
