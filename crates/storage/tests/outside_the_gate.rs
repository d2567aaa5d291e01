//! A store that writes components keeps taking publishes meanwhile: components fetched from
//! a peer (a cold standby taking its primary's, a new replica copying a partition) and a
//! partition's merge are written and fsynced before the store's gate is taken, and the
//! gate is held only to put them in place. The component fsyncs of the stores under test
//! are slowed with the disk-fault layer (`TESSERA_DISK_FAULTS`), the way a loaded disk
//! slows them.
//!
//! One test per file: the fault rules are read once per process, at its first I/O.

mod common;

use common::{def, kv_rows, routed_kv, visible_keys};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tessera_common::{Epoch, PartitionId};
use tessera_storage::{PartitionChanges, Store, StoreConfig, TableDef};

const SLOW_FSYNC_MS: u64 = 1500;

fn commit(store: &Store, epoch: Epoch, from: i64, to: i64) {
    store
        .prepare_epoch(epoch, routed_kv(&kv_rows(from, to), 1))
        .unwrap();
    assert!(store.commit_epoch(epoch).unwrap());
}

fn config() -> StoreConfig {
    StoreConfig {
        partitions: 1,
        ..StoreConfig::default()
    }
}

/// Waits until this process is in the middle of an fsync of a file under `dir`.
fn wait_for_fsync_under(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tessera_common::disk::oldest_sync_in_flight()
        .is_some_and(|(_, path)| path.starts_with(dir))
    {
        assert!(
            Instant::now() < deadline,
            "nothing under {} was fsynced",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_store_takes_publishes_while_it_writes_components() {
    let dirs: Vec<tempfile::TempDir> = (0..5).map(|_| tempfile::tempdir().unwrap()).collect();
    let slowed: Vec<PathBuf> = dirs[1..]
        .iter()
        .map(|d| d.path().join("components"))
        .collect();
    let rules: Vec<String> = slowed
        .iter()
        .map(|dir| format!("fsync-slow:{}:ms={SLOW_FSYNC_MS}", dir.display()))
        .collect();
    std::env::set_var(tessera_common::disk::FAULTS_VAR, rules.join(";"));
    let primary = Store::open(dirs[0].path(), config()).unwrap();
    a_standby_takes_publishes_while_it_installs(&primary, dirs[1].path(), &slowed[0]);
    a_new_replica_takes_publishes_while_it_copies(&primary, dirs[2].path(), &slowed[1]);
    a_store_takes_publishes_while_it_merges(dirs[3].path(), &slowed[2]);
    a_merge_whose_inputs_were_replaced_meanwhile_is_dropped(dirs[4].path(), &slowed[3]);
    drop(dirs);
}

fn a_standby_takes_publishes_while_it_installs(
    primary: &Store,
    dir: &Path,
    standby_components: &Path,
) {
    let standby = Store::open(dir, config()).unwrap();
    standby.set_standby_partitions(BTreeSet::from([PartitionId(0)]));
    for store in [primary, &standby] {
        store.ensure_table(def()).unwrap();
        commit(store, Epoch(1), 0, 1000);
    }
    primary.checkpoint().unwrap();
    let (components, covered) = primary.shipped_manifest("kv", PartitionId(0)).unwrap();
    assert_eq!(covered, Epoch(1));
    let fetched = components
        .iter()
        .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
        .collect();

    let installing = {
        let standby = standby.clone();
        std::thread::spawn(move || {
            standby.install_shipped_components("kv", PartitionId(0), components, fetched, covered)
        })
    };
    // Once the install is in the middle of a component's (slowed) fsync, a publish runs
    // on the standby: it must not wait for the install to finish.
    wait_for_fsync_under(standby_components);
    commit(&standby, Epoch(2), 1000, 1100);
    assert!(
        !installing.is_finished(),
        "the publish waited for the install of the primary's components to end"
    );
    assert!(installing.join().unwrap().unwrap(), "the shipment installs");

    // The standby holds the shipped components for epoch 1 and only epoch 2 in its log;
    // promoted, it reads what the primary does.
    commit(primary, Epoch(2), 1000, 1100);
    let promoted = standby.set_standby_partitions(BTreeSet::new());
    standby.promote(&promoted).unwrap();
    for epoch in [Epoch(1), Epoch(2)] {
        assert_eq!(visible_keys(&standby, epoch), visible_keys(primary, epoch));
    }
    assert_eq!(
        visible_keys(&standby, Epoch(2)),
        (0..1100).collect::<Vec<_>>()
    );
}

/// A new replica copying `kv`'s partition from `primary` while a publish to another table
/// of its arrives.
fn a_new_replica_takes_publishes_while_it_copies(
    primary: &Store,
    dir: &Path,
    replica_components: &Path,
) {
    let replica = Store::open(dir, config()).unwrap();
    let other = TableDef::new("other", def().schema.clone(), vec!["k".into()], None).unwrap();
    replica.ensure_table(def()).unwrap();
    replica.ensure_table(other).unwrap();
    primary.checkpoint().unwrap();
    let (components, memtable) = primary.export_partition("kv", PartitionId(0)).unwrap();
    let fetched = components
        .iter()
        .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
        .collect();
    let copying = {
        let replica = replica.clone();
        std::thread::spawn(move || {
            replica.install_partition_components(
                "kv",
                PartitionId(0),
                components,
                fetched,
                memtable,
                None,
            )
        })
    };
    wait_for_fsync_under(replica_components);
    let rows = PartitionChanges {
        table: "other".into(),
        partition: PartitionId(0),
        upserts: vec![kv_rows(0, 10)],
        deletes: vec![],
        before_images: vec![],
    };
    replica.prepare_epoch(Epoch(3), vec![rows]).unwrap();
    assert!(replica.commit_epoch(Epoch(3)).unwrap());
    assert!(
        !copying.is_finished(),
        "the publish waited for the copy of the partition to end"
    );
    copying.join().unwrap().unwrap();
    assert_eq!(
        visible_keys(&replica, Epoch(2)),
        (0..1100).collect::<Vec<_>>()
    );
}

fn merging_config() -> StoreConfig {
    StoreConfig {
        merge_threshold: 2,
        tiered_merges: false,
        ..config()
    }
}

/// A store in `dir` whose one partition holds three components (one per flush) and
/// merges once it holds more than two. They are written in a directory beside it, whose
/// fsyncs are not slowed, and moved in.
fn store_with_three_components(dir: &Path) -> std::sync::Arc<Store> {
    let built = dir.with_extension("built");
    {
        let store = Store::open(&built, merging_config()).unwrap();
        store.ensure_table(def()).unwrap();
        for (epoch, from, to) in [(1, 0, 1000), (2, 500, 1500), (3, 2000, 2100)] {
            commit(&store, Epoch(epoch), from, to);
            store.flush().unwrap();
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::rename(&built, dir).unwrap();
    let store = Store::open(dir, merging_config()).unwrap();
    assert_eq!(components_of(&store).len(), 3);
    store
}

fn components_of(store: &Store) -> Vec<tessera_storage::component::ComponentMeta> {
    store.snapshot("kv", None).unwrap().partitions[0]
        .components
        .clone()
}

/// The checkpoint's merge, on a thread of its own, once it is in the middle of writing.
fn merging(
    store: &std::sync::Arc<Store>,
    components: &Path,
) -> std::thread::JoinHandle<Result<(), tessera_storage::StorageError>> {
    let handle = {
        let store = store.clone();
        std::thread::spawn(move || store.checkpoint())
    };
    wait_for_fsync_under(components);
    handle
}

fn a_store_takes_publishes_while_it_merges(dir: &Path, components: &Path) {
    let store = store_with_three_components(dir);
    let merge = merging(&store, components);
    commit(&store, Epoch(4), 3000, 3010);
    assert!(
        !merge.is_finished(),
        "the publish waited for the merge to end"
    );
    merge.join().unwrap().unwrap();
    assert_eq!(
        components_of(&store).len(),
        1,
        "the merge's current component replaces the three (no retention: no history)"
    );
    let mut expected: Vec<i64> = (0..1500).chain(2000..2100).chain(3000..3010).collect();
    expected.sort_unstable();
    assert_eq!(visible_keys(&store, Epoch(4)), expected);
}

/// A copy installed while a merge of the same partition writes: the merge's inputs are
/// gone when it comes to install, so its output is dropped, files included.
fn a_merge_whose_inputs_were_replaced_meanwhile_is_dropped(dir: &Path, components: &Path) {
    let store = store_with_three_components(dir);
    let before = components_of(&store);
    let merge = merging(&store, components);
    // The copy's one component is already here: it writes nothing, and goes in first.
    store
        .install_partition_components(
            "kv",
            PartitionId(0),
            vec![before[0].clone()],
            Default::default(),
            vec![],
            None,
        )
        .unwrap();
    merge.join().unwrap().unwrap();
    let after = components_of(&store);
    assert_eq!(
        after.iter().map(|c| c.hash).collect::<Vec<_>>(),
        vec![before[0].hash],
        "the copy's component alone, not the merge's"
    );
    let files = std::fs::read_dir(components)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.ends_with(".tmp"))
        .count();
    assert_eq!(files, 1, "the dropped merge's components were deleted");
    assert_eq!(
        visible_keys(&store, Epoch(3)),
        (0..1000).collect::<Vec<_>>()
    );
}
