//! Two merges of one partition at once (a checkpoint's beside a client's settle, as after
//! a large update): the one that installs second finds its inputs gone from the manifest
//! and drops its output, but it must still be able to read them until it is done. The
//! first one's garbage collection used to delete their files under it, and the settle
//! failed with "component ... is missing".

mod common;

use common::{def, kv_rows, routed_kv, store_with_partitions, visible_keys};
use std::sync::{Arc, Barrier};
use tessera_common::Epoch;

const PARTITIONS: u32 = 8;
const ROUNDS: u64 = 12;
const COMPONENTS_PER_ROUND: u64 = 4;
const KEYS: i64 = 20_000;

#[test]
fn two_merges_of_a_partition_at_once_both_finish_and_keep_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with_partitions(dir.path(), PARTITIONS);
    store.ensure_table(def()).unwrap();
    let mut epoch = 0;
    for round in 0..ROUNDS {
        // New versions of every key, flushed into a new component of each partition
        // several times, so that each settle below has several inputs to read.
        for _ in 0..COMPONENTS_PER_ROUND {
            epoch += 1;
            store
                .prepare_epoch(Epoch(epoch), routed_kv(&kv_rows(0, KEYS), PARTITIONS))
                .unwrap();
            assert!(store.commit_epoch(Epoch(epoch)).unwrap());
            store.flush().unwrap();
        }
        let start = Arc::new(Barrier::new(2));
        let settles: Vec<_> = (0..2)
            .map(|_| {
                let (store, start) = (store.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    store.settle()
                })
            })
            .collect();
        let merged: usize = settles
            .into_iter()
            .map(|settle| {
                settle
                    .join()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("round {round}: a settle failed: {e}"))
            })
            .sum();
        // Each partition is merged once: by one settle, or partly by each.
        assert!(
            merged >= PARTITIONS as usize,
            "round {round}: {merged} merges"
        );
        assert_eq!(
            visible_keys(&store, Epoch(epoch)),
            (0..KEYS).collect::<Vec<_>>(),
            "round {round}"
        );
        // What the pins deferred was deleted by the last install: no file is left that no
        // manifest names (a dropped merge's output, inputs merged away).
        let referenced = store.held_components().len();
        let files = std::fs::read_dir(dir.path().join("components"))
            .unwrap()
            .filter(|entry| {
                let name = entry.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(".parquet")
            })
            .count();
        assert_eq!(
            files, referenced,
            "round {round}: component files left over"
        );
    }
}
