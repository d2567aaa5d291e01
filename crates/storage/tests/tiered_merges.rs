//! Tiered merges: a table loaded in a few publishes of similar size is merged down to one
//! component per partition at the checkpoint that flushes the last of them, long before
//! its components number more than the merge threshold. A small change after a large base
//! waits for the count rule. With tiered merges off, the loads stay apart.

use std::sync::Arc;
use tessera_common::PartitionId;
use tessera_storage::{Store, StoreConfig, TableChanges};

mod common;
use common::{def, kv_rows, ship_partition, visible_keys};

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

/// A cold standby takes its primary's components, merged by the primary: it does not
/// merge them early itself. Its primary flushes (without merging) when the standby is
/// about to checkpoint, so without this the standby merged each load it was shipped, work
/// thrown away when the primary's own merge arrived.
/// Two stores with tiered merges, the second a cold standby of every partition of the
/// first (and the directories they live in).
fn primary_and_cold_standby() -> ([tempfile::TempDir; 2], Arc<Store>, Arc<Store>) {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let primary = open(dirs[0].path(), true);
    let standby = open(dirs[1].path(), true);
    standby.set_standby_partitions((0..PARTITIONS).map(PartitionId).collect());
    (dirs, primary, standby)
}

/// What a primary's announcement makes its cold standby do: take the primary's components
/// of every partition in place of its own.
fn ship(primary: &Store, standby: &Store) {
    for partition in (0..PARTITIONS).map(PartitionId) {
        ship_partition(primary, standby, partition);
    }
}

#[test]
fn a_cold_standby_leaves_tiered_merges_to_its_primary() {
    let (_dirs, primary, standby) = primary_and_cold_standby();
    let ship = || ship(&primary, &standby);
    for load_index in 0..3 {
        let rows = || kv_rows(load_index * 4_000, (load_index + 1) * 4_000);
        for store in [&primary, &standby] {
            store
                .publish(vec![TableChanges::upserts("kv", vec![rows()])])
                .unwrap();
        }
        // What a standby's checkpoint does: its primary flushes, it takes the components.
        primary.flush().unwrap();
        ship();
        standby.checkpoint().unwrap();
        let loads = load_index as usize + 1;
        assert_eq!(
            live_components(&standby),
            vec![loads; PARTITIONS as usize],
            "the standby merged what its primary had not"
        );
    }
    // The primary's own checkpoint merges; the standby takes the merged components.
    primary.checkpoint().unwrap();
    assert_eq!(live_components(&primary), vec![1; PARTITIONS as usize]);
    ship();
    assert_eq!(live_components(&standby), vec![1; PARTITIONS as usize]);
    let promoted = standby.set_standby_partitions(Default::default());
    standby.promote(&promoted).unwrap();
    let epoch = standby.snapshot("kv", None).unwrap().epoch;
    assert_eq!(
        visible_keys(&standby, epoch),
        (0..12_000).collect::<Vec<_>>()
    );
}

/// A load that ends with a small publish keeps a second component per partition under the
/// merge rules (the count rule waits for more). Settling, as a bulk load ends, merges each
/// partition a store holds down to one; a cold standby's partitions are left for its
/// primary's.
#[test]
fn settling_merges_each_partition_held_down_to_one_component() {
    let (_dirs, primary, standby) = primary_and_cold_standby();
    for (from, to) in [(0, 8_000), (8_000, 8_400)] {
        for store in [&primary, &standby] {
            store
                .publish(vec![TableChanges::upserts("kv", vec![kv_rows(from, to)])])
                .unwrap();
        }
        primary.checkpoint().unwrap();
    }
    assert_eq!(
        live_components(&primary),
        vec![2; PARTITIONS as usize],
        "the small last load is not merged by the rules"
    );
    ship(&primary, &standby);
    assert_eq!(primary.settle().unwrap(), PARTITIONS as usize);
    assert_eq!(live_components(&primary), vec![1; PARTITIONS as usize]);
    let epoch = primary.snapshot("kv", None).unwrap().epoch;
    assert_eq!(
        visible_keys(&primary, epoch),
        (0..8_400).collect::<Vec<_>>()
    );
    assert_eq!(primary.settle().unwrap(), 0, "nothing left to settle");

    // The standby holds the primary's two components per partition, and merges none.
    assert_eq!(standby.settle().unwrap(), 0);
    assert_eq!(live_components(&standby), vec![2; PARTITIONS as usize]);
    ship(&primary, &standby);
    assert_eq!(live_components(&standby), vec![1; PARTITIONS as usize]);
}
