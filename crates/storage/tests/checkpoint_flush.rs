//! A checkpoint's flush holds the store's gate only to freeze the memtables and to put the
//! written components in their place. Here every fsync of a component takes 300 ms more (a
//! slow disk, through the real fault layer), so writing them takes seconds: meanwhile an
//! epoch prepared before the freeze commits, another is prepared and committed, and reads
//! see every row once. After the checkpoint and a restart every row is still there, the
//! epoch committed mid-flush included (its rows were logged again ahead of its commit).
//! Where another hand takes the frozen rows meanwhile (a cold standby's primary ships the
//! components that cover them), the flush leaves them be.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_common::{Epoch, PartitionId};
use tessera_storage::{Store, StoreConfig};

mod common;
use common::{def, kv_rows, routed_kv, ship_partition, visible_keys};

const PARTITIONS: u32 = 8;
/// What each component's fsync takes more; the flush writes one component per partition.
const SLOW_FSYNC_MS: u64 = 300;

fn open(dir: &std::path::Path) -> Arc<Store> {
    open_with(dir, StoreConfig::default().memtable_flush_bytes)
}

fn open_with(dir: &std::path::Path, memtable_flush_bytes: usize) -> Arc<Store> {
    let store = Store::open(
        dir,
        StoreConfig {
            partitions: PARTITIONS,
            memtable_flush_bytes,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.ensure_table(def()).unwrap();
    store
}

fn prepare(store: &Store, epoch: Epoch, from: i64, to: i64) {
    store
        .prepare_epoch(epoch, routed_kv(&kv_rows(from, to), PARTITIONS))
        .unwrap();
}

/// Makes every component fsync of this process slow. The fault rules are read once per
/// process, at its first disk I/O: every test here calls this first.
fn slow_component_disk() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::env::set_var(
            tessera_common::disk::FAULTS_VAR,
            format!("fsync-slow:components:ms={SLOW_FSYNC_MS}"),
        )
    });
}

/// Rows of `table` the store holds in components and in memory.
fn rows_held(store: &Store, table: &str) -> (u64, u64) {
    let stats = store.table_stats();
    let held = stats.iter().find(|t| t.name == table).unwrap();
    (held.component_rows, held.memtable_rows)
}

/// Runs a checkpoint of `store` on a thread of its own; its time.
fn checkpoint_in_background(store: &Arc<Store>) -> std::thread::JoinHandle<Duration> {
    let store = store.clone();
    std::thread::spawn(move || {
        let started = Instant::now();
        store.checkpoint().unwrap();
        started.elapsed()
    })
}

#[test]
fn publishes_go_on_while_a_checkpoint_writes_its_components() {
    slow_component_disk();
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    prepare(&store, Epoch(1), 0, 800);
    assert!(store.commit_epoch(Epoch(1)).unwrap());
    // Undecided when the checkpoint freezes the memtables; committed while it writes.
    prepare(&store, Epoch(2), 800, 900);

    let checkpoint = checkpoint_in_background(&store);
    // The freeze takes a moment (no component fsync in it); the writes take seconds.
    std::thread::sleep(Duration::from_millis(SLOW_FSYNC_MS));
    let during = Instant::now();
    assert!(store.commit_epoch(Epoch(2)).unwrap());
    prepare(&store, Epoch(3), 900, 1000);
    assert!(store.commit_epoch(Epoch(3)).unwrap());
    let keys = visible_keys(&store, Epoch(3));
    let publishing = during.elapsed();
    assert!(
        !checkpoint.is_finished(),
        "the checkpoint ended before the publishes made during it did ({publishing:?}): nothing showed they went on during its writes"
    );
    assert_eq!(
        keys,
        (0..1000).collect::<Vec<_>>(),
        "every row once, mid-flush"
    );
    let flush_took = checkpoint.join().unwrap();
    assert!(
        publishing < flush_took / 2,
        "publishing during the checkpoint took {publishing:?}, the checkpoint {flush_took:?}"
    );
    assert!(
        flush_took >= Duration::from_millis(SLOW_FSYNC_MS * PARTITIONS as u64),
        "the checkpoint took {flush_took:?}: it wrote fewer components than there are partitions"
    );

    // After it: the frozen rows in components, the later ones in memory, each once.
    assert_eq!(
        visible_keys(&store, Epoch(3)),
        (0..1000).collect::<Vec<_>>()
    );
    assert_eq!(visible_keys(&store, Epoch(1)), (0..800).collect::<Vec<_>>());
    let (in_components, in_memory) = rows_held(&store, "kv");
    assert_eq!(in_components, 800, "the frozen rows became components");
    assert_eq!(
        in_memory, 200,
        "the rows of epochs 2 and 3 stayed in memory"
    );

    // A restart replays the new log segment over the checkpoint: epoch 2's rows, logged
    // again at the freeze, come before its commit there.
    drop(store);
    let store = open(dir.path());
    assert_eq!(
        visible_keys(&store, Epoch(3)),
        (0..1000).collect::<Vec<_>>()
    );
    assert_eq!(visible_keys(&store, Epoch(2)), (0..900).collect::<Vec<_>>());
    assert_eq!(visible_keys(&store, Epoch(1)), (0..800).collect::<Vec<_>>());
    // And another checkpoint covers what the first left in memory.
    store.checkpoint().unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(
        visible_keys(&store, Epoch(3)),
        (0..1000).collect::<Vec<_>>()
    );
}

/// Rows arriving faster than flushes write them do not grow memory without bound: once
/// the memtables hold `MEMTABLE_STALL_FACTOR` times the flush threshold, a prepare waits
/// for the flush under way to put them in components.
#[test]
fn new_rows_wait_for_the_flush_under_way_once_memory_is_full() {
    slow_component_disk();
    let dir = tempfile::tempdir().unwrap();
    let store = open_with(dir.path(), 16 << 10);
    prepare(&store, Epoch(1), 0, 20_000);
    assert!(store.commit_epoch(Epoch(1)).unwrap());
    assert_eq!(rows_held(&store, "kv"), (0, 20_000));

    let checkpoint = checkpoint_in_background(&store);
    std::thread::sleep(Duration::from_millis(SLOW_FSYNC_MS));
    let waited_from = Instant::now();
    prepare(&store, Epoch(2), 20_000, 20_100);
    let waited = waited_from.elapsed();
    assert_eq!(
        rows_held(&store, "kv"),
        (20_000, 0),
        "the prepare returned ({waited:?} after it began) before the flush put the full memtables in components"
    );
    assert!(
        waited >= Duration::from_millis(SLOW_FSYNC_MS),
        "the prepare waited {waited:?}"
    );
    checkpoint.join().unwrap();
    assert!(store.commit_epoch(Epoch(2)).unwrap());
    assert_eq!(
        visible_keys(&store, Epoch(2)),
        (0..20_100).collect::<Vec<_>>()
    );
}

/// A cold standby's checkpoint applies the rows its log holds and writes them as
/// components; meanwhile its primary's components covering those rows arrive and take their
/// place. The flush then installs nothing (its rows are gone from memory) and the standby
/// holds each row once, before and after a restart.
#[test]
fn a_standby_whose_primarys_components_arrive_during_its_flush_keeps_each_row_once() {
    slow_component_disk();
    let (primary_dir, standby_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let primary = open(primary_dir.path());
    let standby = open(standby_dir.path());
    let all: std::collections::BTreeSet<PartitionId> = (0..PARTITIONS).map(PartitionId).collect();
    standby.set_standby_partitions(all.clone());
    for store in [&primary, &standby] {
        prepare(store, Epoch(1), 0, 400);
        assert!(store.commit_epoch(Epoch(1)).unwrap());
        prepare(store, Epoch(2), 300, 600);
        assert!(store.commit_epoch(Epoch(2)).unwrap());
        store.advance_visible(Epoch(2));
    }
    primary.checkpoint().unwrap();
    // A second table, on the standby alone, whose flush keeps the checkpoint writing while
    // the primary's components of kv arrive (installing them writes as many components).
    let mut other = def();
    other.name = "other".into();
    standby.ensure_table(other).unwrap();
    let other_rows = routed_kv(&kv_rows(0, 400), PARTITIONS)
        .into_iter()
        .map(|mut changes| {
            changes.table = "other".into();
            changes
        })
        .collect();
    standby.prepare_epoch(Epoch(3), other_rows).unwrap();
    assert!(standby.commit_epoch(Epoch(3)).unwrap());

    let checkpoint = checkpoint_in_background(&standby);
    std::thread::sleep(Duration::from_millis(SLOW_FSYNC_MS));
    for &partition in &all {
        assert_eq!(ship_partition(&primary, &standby, partition), Epoch(2));
    }
    assert!(
        !checkpoint.is_finished(),
        "the standby's checkpoint ended before the primary's components arrived: the test raced nothing"
    );
    checkpoint.join().unwrap();

    assert_eq!(
        rows_held(&standby, "other").0,
        400,
        "the rest of the flush was installed"
    );
    assert_eq!(
        rows_held(&standby, "kv"),
        rows_held(&primary, "kv"),
        "the standby holds the primary's components, and no second copy of their rows"
    );
    let promoted = standby.set_standby_partitions(Default::default());
    standby.promote(&promoted).unwrap();
    for epoch in [Epoch(1), Epoch(2)] {
        assert_eq!(visible_keys(&standby, epoch), visible_keys(&primary, epoch));
    }
    drop(standby);
    let standby = open(standby_dir.path());
    for epoch in [Epoch(1), Epoch(2)] {
        assert_eq!(visible_keys(&standby, epoch), visible_keys(&primary, epoch));
    }
}
