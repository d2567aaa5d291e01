//! Rows that stop arriving are checkpointed once they have waited `idle_checkpoint_ms`,
//! though they cross neither the memtable nor the log threshold: they would otherwise stay
//! in memory, and in the log, until more rows came, perhaps never. A checkpoint that leaves
//! the memtables as they are does not ask for another; new rows start the wait again; and
//! `idle_checkpoint_ms = 0` turns the idle checkpoint off.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_storage::{Store, StoreConfig, TableChanges};

mod common;
use common::{def, kv_rows};

const IDLE: Duration = Duration::from_millis(300);

fn open(dir: &std::path::Path, idle_checkpoint_ms: u64) -> Arc<Store> {
    let store = Store::open(
        dir,
        StoreConfig {
            partitions: 8,
            idle_checkpoint_ms,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.ensure_table(def()).unwrap();
    store
}

fn publish(store: &Store, from: i64, to: i64) {
    store
        .publish(vec![TableChanges::upserts("kv", vec![kv_rows(from, to)])])
        .unwrap();
}

/// Polls `wants_checkpoint` as a node's duty loop does, for up to `patience`: when it first
/// said yes, if it did.
fn wanted_within(store: &Store, patience: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < patience {
        if store.wants_checkpoint() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn memtable_rows(store: &Store) -> u64 {
    store.table_stats()[0].memtable_rows
}

#[test]
fn rows_idle_in_memory_are_checkpointed_once_and_again_after_new_rows() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), IDLE.as_millis() as u64);
    publish(&store, 0, 1000);
    assert!(
        store.memtable_bytes() < store.config().memtable_flush_bytes,
        "the rows cross no threshold"
    );
    let waited = wanted_within(&store, IDLE * 10).expect("idle rows ask for a checkpoint");
    assert!(
        waited >= IDLE,
        "only after they waited {IDLE:?}, not {waited:?}"
    );
    store.checkpoint().unwrap();
    assert_eq!(memtable_rows(&store), 0, "the checkpoint flushed them");
    assert_eq!(
        wanted_within(&store, IDLE * 3),
        None,
        "empty memtables ask for nothing"
    );
    publish(&store, 1000, 1010);
    assert!(
        wanted_within(&store, IDLE * 10).is_some(),
        "new rows start the wait again"
    );
}

#[test]
fn idle_checkpoint_ms_zero_leaves_rows_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 0);
    publish(&store, 0, 1000);
    assert_eq!(wanted_within(&store, IDLE * 4), None);
    assert_eq!(memtable_rows(&store), 1000);
}
