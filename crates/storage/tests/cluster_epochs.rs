//! The store's side of a cluster publish: rows prepared under an epoch the metadata service
//! allocated stay invisible until committed, survive restarts and checkpoints while
//! undecided, and vanish when aborted.

use arrow::array::{Array, Int64Array, RecordBatch};
use std::sync::Arc;
use tessera_common::{ComponentHash, Epoch, PartitionId, PartitionRing};
use tessera_storage::routing::split_by_partition;
use tessera_storage::{PartitionChanges, Store, StoreConfig};

mod common;
use common::{def, kv_rows as rows, visible_keys as keys};

fn config() -> StoreConfig {
    StoreConfig {
        partitions: 4,
        ..StoreConfig::default()
    }
}

/// Routes rows to their partitions as a coordinator does.
fn routed(batch: &RecordBatch) -> Vec<PartitionChanges> {
    common::routed_kv(batch, 4)
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

/// Commits `batch` as `epoch` on `store`, as a replica does when the metadata commits it.
fn commit(store: &Store, epoch: Epoch, batch: &RecordBatch) {
    store.prepare_epoch(epoch, routed(batch)).unwrap();
    assert!(store.commit_epoch(epoch).unwrap());
}

/// Two stores holding the same table and the same epoch 1 (`first`), each in its own
/// directory (kept for restarts): a primary and a replica, or a source and a target.
fn two_stores_with_epoch_1(
    first: &RecordBatch,
) -> (
    (tempfile::TempDir, Arc<Store>),
    (tempfile::TempDir, Arc<Store>),
) {
    let open = || {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), config()).unwrap();
        store.ensure_table(def()).unwrap();
        commit(&store, Epoch(1), first);
        (dir, store)
    };
    (open(), open())
}

/// What a returning replica fetches and installs: every partition's versions since `since`.
fn fetch_delta(primary: &Store, replica: &Store, since: Epoch) -> u64 {
    let mut fetched = 0;
    for p in 0..4 {
        let delta = primary
            .partition_versions("kv", PartitionId(p), since)
            .unwrap();
        fetched += delta.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        replica
            .install_partition_since("kv", PartitionId(p), since, delta, None)
            .unwrap();
    }
    fetched
}

#[test]
fn a_returning_replica_fetches_only_the_epochs_it_missed() {
    let ((_primary_dir, primary), (replica_dir, replica)) = two_stores_with_epoch_1(&rows(0, 100));
    // The replica has part of epoch 1 on disk and part in memory, as after a crash.
    replica.checkpoint().unwrap();
    commit(&replica, Epoch(2), &rows(100, 110));
    commit(&primary, Epoch(2), &rows(100, 110));
    // The replica is down for epochs 3 and 4: new rows and a changed value.
    commit(&primary, Epoch(3), &rows(200, 230));
    commit(&primary, Epoch(4), &rows(5, 8));
    primary.checkpoint().unwrap();
    commit(&primary, Epoch(5), &rows(300, 301));
    let components_of = |store: &Store| -> Vec<Vec<ComponentHash>> {
        (0..4)
            .map(|p| {
                let (components, _) = store.export_partition("kv", PartitionId(p)).unwrap();
                components.iter().map(|c| c.hash).collect()
            })
            .collect()
    };
    let flushed_before = components_of(&replica);
    assert!(
        flushed_before.iter().all(|p| !p.is_empty()),
        "epoch 1 was flushed"
    );

    let fetched = fetch_delta(&primary, &replica, Epoch(3));
    assert_eq!(
        fetched,
        30 + 3 + 1,
        "only the versions of epochs 3 to 5 travel"
    );
    for epoch in 1..=5 {
        assert_eq!(
            keys(&replica, Epoch(epoch)),
            keys(&primary, Epoch(epoch)),
            "replica equals primary at epoch {epoch}"
        );
    }
    // Installing the same delta again (a failback that failed midway and retried, or its
    // second fetch under the rebalance's lease) and a restart change nothing. The second
    // install replaces the first one's versions, but the components older than the delta
    // stay as they were: only what is at or above its first epoch is rewritten.
    fetch_delta(&primary, &replica, Epoch(3));
    for (p, (before, now)) in flushed_before
        .iter()
        .zip(components_of(&replica))
        .enumerate()
    {
        assert!(
            before.iter().all(|hash| now.contains(hash)),
            "partition {p}: the components older than the delta were rewritten ({before:?} -> {now:?})"
        );
    }
    drop(replica);
    let replica = Store::open(replica_dir.path(), config()).unwrap();
    for epoch in 1..=5 {
        assert_eq!(keys(&replica, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
    let rows_at = |store: &Store| -> u64 {
        (0..4)
            .map(|p| {
                store
                    .partition_versions("kv", PartitionId(p), Epoch::ZERO)
                    .unwrap()
                    .iter()
                    .map(|b| b.num_rows() as u64)
                    .sum::<u64>()
            })
            .sum()
    };
    assert_eq!(rows_at(&replica), rows_at(&primary), "no version twice");
}

#[test]
fn a_delta_replaces_versions_the_replica_holds_from_the_missed_epochs_on() {
    let ((_primary_dir, primary), (_replica_dir, replica)) = two_stores_with_epoch_1(&rows(0, 50));
    // Epoch 2 missed the replica; epoch 3 reached it (it was prepared before it was marked
    // stale), so the replica holds versions above its first missed epoch.
    commit(&primary, Epoch(2), &rows(50, 60));
    commit(&primary, Epoch(3), &rows(60, 70));
    commit(&replica, Epoch(3), &rows(60, 70));
    replica.checkpoint().unwrap();
    fetch_delta(&primary, &replica, Epoch(2));
    for epoch in 1..=3 {
        assert_eq!(keys(&replica, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
}

#[test]
fn a_new_replica_copies_components_by_hash_and_refuses_corrupt_bytes() {
    let (primary_dir, replica_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let primary = Store::open(primary_dir.path(), config()).unwrap();
    let replica = Store::open(replica_dir.path(), config()).unwrap();
    primary.ensure_table(def()).unwrap();
    replica.ensure_table(def()).unwrap();
    commit(&primary, Epoch(1), &rows(0, 100));
    primary.checkpoint().unwrap();
    commit(&primary, Epoch(2), &rows(100, 120)); // still in memory
    for p in (0..4).map(PartitionId) {
        let (components, memtable) = primary.export_partition("kv", p).unwrap();
        assert!(!components.is_empty(), "epoch 1 was flushed");
        // A flipped byte in transit is refused, naming the component.
        let mut corrupt = std::collections::HashMap::new();
        for c in &components {
            let mut bytes = primary.component_bytes(&c.hash).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 1;
            corrupt.insert(c.hash, bytes);
        }
        let error = replica
            .install_partition_components(
                "kv",
                p,
                components.clone(),
                corrupt,
                memtable.clone(),
                None,
            )
            .unwrap_err();
        assert!(
            error.to_string().contains(&components[0].hash.to_hex()),
            "{error}"
        );
        let fetched = components
            .iter()
            .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
            .collect();
        replica
            .install_partition_components("kv", p, components.clone(), fetched, memtable, None)
            .unwrap();
        for c in &components {
            assert!(
                replica.has_component(&c.hash),
                "the same component, by hash"
            );
        }
    }
    drop(replica);
    let replica = Store::open(replica_dir.path(), config()).unwrap();
    for epoch in 1..=2 {
        assert_eq!(keys(&replica, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
}

/// How many row versions `store` holds for partition `p` (every epoch).
fn versions_of(store: &Store, p: PartitionId) -> usize {
    store
        .partition_versions("kv", p, Epoch(0))
        .unwrap()
        .iter()
        .map(|b| b.num_rows())
        .sum()
}

fn all_partitions() -> std::collections::BTreeSet<PartitionId> {
    (0..4).map(PartitionId).collect()
}

/// Row batches an epoch of `batch` logs on a replica: one per partition it touches.
fn batches_of(batch: &RecordBatch) -> usize {
    routed(batch).len()
}

#[test]
fn a_cold_standby_keeps_committed_rows_in_its_log_until_promoted() {
    let (primary_dir, standby_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let primary = Store::open(primary_dir.path(), config()).unwrap();
    let standby = Store::open(standby_dir.path(), config()).unwrap();
    standby.set_standby_partitions(all_partitions());
    let (first, second) = (rows(0, 100), rows(100, 150));
    for store in [&primary, &standby] {
        store.ensure_table(def()).unwrap();
        commit(store, Epoch(1), &first);
        commit(store, Epoch(2), &second);
        store.advance_visible(Epoch(2));
    }
    // Nothing was applied: the rows are in the log only, and a snapshot says so.
    let snapshot = standby.snapshot("kv", None).unwrap();
    assert!(snapshot.partitions.iter().all(|p| p.rows_in_log));
    assert!(snapshot
        .partitions
        .iter()
        .all(|p| p.memtable.is_empty() && p.components.is_empty()));
    assert_eq!(standby.standby_lag().len(), 4);
    drop(snapshot);
    // Promotion replays exactly the logged batches.
    let promoted = standby.set_standby_partitions(Default::default());
    assert_eq!(promoted, all_partitions());
    let replayed = standby.promote(&promoted).unwrap();
    assert_eq!(replayed, batches_of(&first) + batches_of(&second));
    assert!(standby.standby_lag().is_empty());
    for epoch in 1..=2 {
        assert_eq!(keys(&standby, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
    // Rows kept in the log survive a crash: recovery replays them like any others.
    standby.set_standby_partitions(all_partitions());
    commit(&standby, Epoch(3), &rows(150, 160));
    commit(&primary, Epoch(3), &rows(150, 160));
    drop(standby);
    let standby = Store::open(standby_dir.path(), config()).unwrap();
    for epoch in 1..=3 {
        assert_eq!(keys(&standby, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
}

#[test]
fn a_cold_standby_takes_its_primarys_components_and_drops_the_rows_they_cover() {
    let (primary_dir, standby_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let primary = Store::open(primary_dir.path(), config()).unwrap();
    let standby = Store::open(standby_dir.path(), config()).unwrap();
    standby.set_standby_partitions(all_partitions());
    let updates = rows(5, 8);
    for store in [&primary, &standby] {
        store.ensure_table(def()).unwrap();
        commit(store, Epoch(1), &rows(0, 100));
        commit(store, Epoch(2), &rows(100, 150));
    }
    primary.checkpoint().unwrap();
    for store in [&primary, &standby] {
        commit(store, Epoch(3), &updates);
        store.advance_visible(Epoch(3));
    }
    for p in all_partitions() {
        let (components, covered) = primary.shipped_manifest("kv", p).unwrap();
        assert_eq!(
            covered,
            Epoch(2),
            "the flushed epochs, not the one in memory"
        );
        let fetched = components
            .iter()
            .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
            .collect();
        assert!(standby
            .install_shipped_components("kv", p, components.clone(), fetched, covered)
            .unwrap());
        // The same shipment again changes nothing.
        assert!(!standby
            .install_shipped_components("kv", p, components, Default::default(), covered)
            .unwrap());
    }
    // Only epoch 3 is left in the log, so a promotion replays only its batches.
    assert_eq!(standby.standby_lag().len(), batches_of(&updates));
    let promoted = standby.set_standby_partitions(Default::default());
    assert_eq!(standby.promote(&promoted).unwrap(), batches_of(&updates));
    for epoch in 1..=3 {
        assert_eq!(keys(&standby, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
    // The installed components are durable and the dropped log records stay dropped.
    drop(standby);
    let standby = Store::open(standby_dir.path(), config()).unwrap();
    for epoch in 1..=3 {
        assert_eq!(keys(&standby, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
}

#[test]
fn a_cold_standby_never_drops_uncovered_rows_when_it_truncates_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let reference_dir = tempfile::tempdir().unwrap();
    let standby = Store::open(dir.path(), config()).unwrap();
    let reference = Store::open(reference_dir.path(), config()).unwrap();
    standby.set_standby_partitions(all_partitions());
    for store in [&standby, &reference] {
        store.ensure_table(def()).unwrap();
        commit(store, Epoch(1), &rows(0, 100));
        commit(store, Epoch(2), &rows(50, 120));
    }
    // No primary shipped anything: the checkpoint applies and flushes the rows itself.
    standby.checkpoint().unwrap();
    assert!(standby.standby_lag().is_empty());
    drop(standby);
    let standby = Store::open(dir.path(), config()).unwrap();
    for epoch in 1..=2 {
        assert_eq!(keys(&standby, Epoch(epoch)), keys(&reference, Epoch(epoch)));
    }
}

/// A standby whose primaries have not covered its logged rows yet (they came while the
/// primaries flushed for it) checkpoints keeping its log: the rows stay unapplied and
/// logged, for the primaries' components, and a restart recovers them from the log. Once the log has grown
/// to twice its checkpoint size, that is no longer offered.
#[test]
fn a_cold_standby_checkpoint_keeping_its_log_leaves_uncovered_rows_logged() {
    let dir = tempfile::tempdir().unwrap();
    let reference_dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        checkpoint_log_bytes: 64 << 10,
        ..config()
    };
    let standby = Store::open(dir.path(), config.clone()).unwrap();
    let reference = Store::open(reference_dir.path(), config.clone()).unwrap();
    standby.set_standby_partitions(all_partitions());
    for store in [&standby, &reference] {
        store.ensure_table(def()).unwrap();
        commit(store, Epoch(1), &rows(0, 100));
        commit(store, Epoch(2), &rows(50, 120));
        store.advance_visible(Epoch(2));
    }
    assert!(!standby.log_outgrew_its_checkpoints());
    standby.checkpoint_keeping_log().unwrap();
    assert_eq!(standby.standby_lag().len(), 4, "nothing applied");
    assert!(standby
        .snapshot("kv", None)
        .unwrap()
        .partitions
        .iter()
        .all(|p| p.rows_in_log && p.components.is_empty()));
    drop(standby);
    // The log kept them: a restart recovers them from it.
    let standby = Store::open(dir.path(), config.clone()).unwrap();
    for epoch in 1..=2 {
        assert_eq!(keys(&standby, Epoch(epoch)), keys(&reference, Epoch(epoch)));
    }
    // Past twice the checkpoint size of log, a standby applies what is uncovered.
    standby.set_standby_partitions(all_partitions());
    let mut next = 120;
    let mut epoch = 3;
    while !standby.log_outgrew_its_checkpoints() {
        commit(&standby, Epoch(epoch), &rows(next, next + 1000));
        (next, epoch) = (next + 1000, epoch + 1);
        assert!(epoch < 10_000, "the log never outgrew its bound");
    }
}

/// A shipment that covers an epoch this standby has prepared but not yet seen committed
/// (its metadata lags the primary's) is not installed: the epoch's rows, once its commit
/// arrives, would be applied a second time over components that already hold them,
/// duplicating its versions. Once the standby has committed the epoch, the shipment
/// installs, and the standby holds exactly the primary's versions.
#[test]
fn a_cold_standby_does_not_install_components_covering_an_epoch_it_has_only_prepared() {
    let (primary_dir, standby_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let primary = Store::open(primary_dir.path(), config()).unwrap();
    let standby = Store::open(standby_dir.path(), config()).unwrap();
    standby.set_standby_partitions(all_partitions());
    let (first, second) = (rows(0, 100), rows(50, 120));
    for store in [&primary, &standby] {
        store.ensure_table(def()).unwrap();
        commit(store, Epoch(1), &first);
        store.prepare_epoch(Epoch(2), routed(&second)).unwrap();
    }
    // The primary learns of the commit first, and flushes.
    assert!(primary.commit_epoch(Epoch(2)).unwrap());
    primary.advance_visible(Epoch(2));
    primary.checkpoint().unwrap();
    let shipments: Vec<_> = all_partitions()
        .into_iter()
        .map(|p| {
            let (components, covered) = primary.shipped_manifest("kv", p).unwrap();
            assert_eq!(covered, Epoch(2));
            let fetched: std::collections::HashMap<_, _> = components
                .iter()
                .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
                .collect();
            (p, components, fetched)
        })
        .collect();
    for (p, components, fetched) in &shipments {
        let installed = standby
            .install_shipped_components("kv", *p, components.clone(), fetched.clone(), Epoch(2))
            .unwrap();
        assert!(
            !installed,
            "partition {p}: installed components covering epoch 2, which it has only prepared"
        );
        for hash in fetched.keys() {
            let path = tessera_storage::component::component_path(standby.components_dir(), hash);
            assert!(
                !path.exists(),
                "partition {p}: the refused shipment left component {hash} behind"
            );
        }
    }
    assert!(standby.commit_epoch(Epoch(2)).unwrap());
    standby.advance_visible(Epoch(2));
    for (p, components, fetched) in shipments {
        assert!(standby
            .install_shipped_components("kv", p, components, fetched, Epoch(2))
            .unwrap());
    }
    let promoted = standby.set_standby_partitions(Default::default());
    standby.promote(&promoted).unwrap();
    for p in all_partitions() {
        assert_eq!(
            versions_of(&standby, p),
            versions_of(&primary, p),
            "partition {p}: the standby holds other versions than its primary"
        );
    }
    assert_eq!(keys(&standby, Epoch(2)), keys(&primary, Epoch(2)));
}

/// A returning replica that prepared an epoch whose commit it has not yet applied (its
/// metadata lags) must not install a delta that already holds that epoch: the commit,
/// applied afterwards, would add the epoch's rows a second time. The install is refused
/// naming the undecided epoch; once the replica has committed it, the same delta installs,
/// and the replica holds exactly the primary's versions.
#[test]
fn a_delta_is_not_installed_over_an_epoch_prepared_here_and_still_undecided() {
    let ((_primary_dir, primary), (_replica_dir, replica)) = two_stores_with_epoch_1(&rows(0, 100));
    // Epoch 2 the replica missed; epoch 3 it prepared, and has not yet seen committed.
    commit(&primary, Epoch(2), &rows(100, 150));
    primary
        .prepare_epoch(Epoch(3), routed(&rows(40, 60)))
        .unwrap();
    replica
        .prepare_epoch(Epoch(3), routed(&rows(40, 60)))
        .unwrap();
    assert!(primary.commit_epoch(Epoch(3)).unwrap());
    primary.advance_visible(Epoch(3));

    let touched: Vec<PartitionId> = routed(&rows(40, 60)).iter().map(|c| c.partition).collect();
    for p in all_partitions() {
        let delta = primary.partition_versions("kv", p, Epoch(2)).unwrap();
        let installed = replica.install_partition_since("kv", p, Epoch(2), delta, None);
        if touched.contains(&p) {
            let error = installed.expect_err("a delta was installed over an undecided epoch");
            assert!(
                error.to_string().contains("[Epoch(3)]") || error.to_string().contains("3"),
                "{error}"
            );
        } else {
            installed.unwrap();
        }
    }
    assert!(replica.commit_epoch(Epoch(3)).unwrap());
    replica.advance_visible(Epoch(3));
    for p in all_partitions() {
        let delta = primary.partition_versions("kv", p, Epoch(2)).unwrap();
        replica
            .install_partition_since("kv", p, Epoch(2), delta, None)
            .unwrap();
        assert_eq!(
            versions_of(&replica, p),
            versions_of(&primary, p),
            "partition {p}"
        );
    }
    for epoch in 1..=3 {
        assert_eq!(keys(&replica, Epoch(epoch)), keys(&primary, Epoch(epoch)));
    }
}

/// A replica the metadata counts as having missed an epoch for a partition (its prepare
/// arrived, but too late for the coordinator) gets that epoch from a failback copy; the
/// rows it prepared there are discarded at the commit, before and after a restart, or the
/// copy would store them a second time.
#[test]
fn a_commit_discards_the_rows_of_partitions_this_replica_missed() {
    let dir = tempfile::tempdir().unwrap();
    let all: Vec<i64> = (0..40).collect();
    let ring = PartitionRing::new(4);
    let missed = PartitionId(1);
    let expected: Vec<i64> = all
        .iter()
        .copied()
        .filter(|k| {
            let batch = rows(*k, *k + 1);
            split_by_partition(&def(), &ring, &batch).unwrap()[0].0 != missed
        })
        .collect();
    assert!(
        expected.len() < all.len(),
        "some keys fall in the missed partition"
    );
    {
        let store = Store::open(dir.path(), config()).unwrap();
        store.ensure_table(def()).unwrap();
        store.prepare_epoch(Epoch(2), routed(&rows(0, 40))).unwrap();
        let skip = std::collections::BTreeSet::from([missed]);
        assert!(store.commit_epoch_except(Epoch(2), &skip).unwrap());
        assert_eq!(keys(&store, Epoch(2)), expected);
    }
    let store = Store::open(dir.path(), config()).unwrap();
    assert_eq!(keys(&store, Epoch(2)), expected, "replay drops them too");
    assert!(store.undecided_epochs().is_empty());
}

/// A copy made for a rebalance at epoch 2 arrives after that rebalance was aborted and
/// epoch 3 committed here (the long fault run's seed 2612: a zombie copy replaced a
/// replica's versions with its source's older ones and lost two acknowledged epochs). The
/// install is refused naming both epochs, and the replica keeps epoch 3's rows; a copy
/// whose rebalance is still the newest epoch here installs.
#[test]
fn a_copy_from_an_aborted_rebalance_never_installs_over_newer_rows() {
    let ((_source_dir, source), (_replica_dir, replica)) = two_stores_with_epoch_1(&rows(0, 100));
    // The copy is made from the source at epoch 1, for the rebalance at epoch 2; then the
    // rebalance is aborted and epoch 3 commits on the replica before the copy arrives.
    let copies: Vec<(PartitionId, Vec<RecordBatch>)> = all_partitions()
        .into_iter()
        .map(|p| (p, source.partition_versions("kv", p, Epoch(1)).unwrap()))
        .collect();
    commit(&replica, Epoch(3), &rows(100, 200));
    let touched: Vec<PartitionId> = routed(&rows(100, 200))
        .iter()
        .map(|c| c.partition)
        .collect();
    for (p, delta) in copies {
        let installed = replica.install_partition_since("kv", p, Epoch(1), delta, Some(Epoch(2)));
        if touched.contains(&p) {
            let error = installed.expect_err("a late copy was installed over newer rows");
            assert!(
                error.to_string().contains("epoch 2") && error.to_string().contains("epoch 3"),
                "{error}"
            );
        } else {
            installed.unwrap();
        }
    }
    assert_eq!(
        keys(&replica, Epoch(3)).len(),
        200,
        "epoch 3's rows are all still here"
    );
    // A copy for a rebalance at epoch 3 (still the newest epoch here) installs.
    commit(&source, Epoch(3), &rows(100, 200));
    for p in all_partitions() {
        let delta = source.partition_versions("kv", p, Epoch(1)).unwrap();
        replica
            .install_partition_since("kv", p, Epoch(1), delta, Some(Epoch(3)))
            .unwrap();
    }
    assert_eq!(keys(&replica, Epoch(3)), keys(&source, Epoch(3)));
}

/// A replica misses epoch 2 (its prepare is held up in a cut link), is copied the epoch's
/// versions for the rebalance at epoch 3, and only then does the late prepare arrive; the
/// node crashes before anything decides it (the long fault run's seed 2611, run f: node 3
/// held two versions per key of epoch 1401 and its reads panicked). After the restart the
/// metadata, whose stale mark the copy cleared, commits epoch 2 here as if nothing was
/// missed. The copy already holds the epoch, so its rows are never applied again.
#[test]
fn a_prepare_arriving_after_a_copy_that_holds_its_epoch_never_adds_its_rows_again() {
    let ((_primary_dir, primary), (replica_dir, replica)) = two_stores_with_epoch_1(&rows(0, 100));
    let missed = rows(50, 150);
    commit(&primary, Epoch(2), &missed);
    primary.advance_visible(Epoch(2));
    for p in all_partitions() {
        let delta = primary.partition_versions("kv", p, Epoch(2)).unwrap();
        replica
            .install_partition_since("kv", p, Epoch(2), delta, Some(Epoch(3)))
            .unwrap();
    }
    // The late prepare is refused outright. (Were it logged, the commit after the restart
    // would discard it: either guard alone keeps this test green.)
    let late = replica.prepare_epoch(Epoch(2), routed(&missed));
    if let Err(error) = &late {
        assert!(
            error.to_string().contains("epoch 2") && error.to_string().contains("through epoch 3"),
            "{error}"
        );
    }
    drop(replica);
    let replica = Store::open(replica_dir.path(), config()).unwrap();
    replica
        .commit_epoch_except(Epoch(2), &Default::default())
        .unwrap();
    for p in all_partitions() {
        assert_eq!(
            versions_of(&replica, p),
            versions_of(&primary, p),
            "partition {p} holds each version once"
        );
    }
    assert_eq!(keys(&replica, Epoch(2)), keys(&primary, Epoch(2)));
    assert!(replica.undecided_epochs().is_empty());
}

/// A prepare that arrives after its epoch's decision was applied here is never left
/// pending: refused outright when the decision came first, and discarded by
/// `discard_late_prepare` when the decision landed while its rows were being logged (the
/// window the metadata view could not close: the fault run's orphan prepare of epoch 2,
/// which later held up a returning replica's copy for ever). A prepare before its
/// decision is untouched, and nothing of the late rows comes back after a restart.
#[test]
fn a_prepare_after_its_epochs_decision_never_stays_pending() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path(), config()).unwrap();
        store.ensure_table(def()).unwrap();
        // The decision first (nothing prepared here yet), then the late rows.
        assert!(!store.commit_epoch(Epoch(1)).unwrap());
        let refused = store
            .prepare_epoch(Epoch(1), routed(&rows(0, 10)))
            .unwrap_err();
        assert!(refused.to_string().contains("already decided"), "{refused}");
        assert!(store.undecided_epochs().is_empty());

        // Rows logged, then the decision applied before the check: discarded.
        store
            .prepare_epoch(Epoch(2), routed(&rows(10, 20)))
            .unwrap();
        assert!(
            !store.discard_late_prepare(Epoch(2)).unwrap(),
            "not decided yet"
        );
        assert!(store.commit_epoch(Epoch(2)).unwrap());
        store
            .prepare_epoch(Epoch(3), routed(&rows(20, 30)))
            .unwrap();
        store.advance_visible(Epoch(3));
        // Epoch 3 is decided as far as the metadata told this store (its visible epoch).
        assert!(store.discard_late_prepare(Epoch(3)).unwrap());
        assert!(store.undecided_epochs().is_empty());
        assert_eq!(keys(&store, Epoch(3)), (10..20).collect::<Vec<i64>>());
    }
    let store = Store::open(dir.path(), config()).unwrap();
    assert!(store.undecided_epochs().is_empty(), "replay drops them too");
    assert_eq!(keys(&store, Epoch(3)), (10..20).collect::<Vec<i64>>());
}

/// Appends records to the newest log segment of the store under `dir` (closed).
fn append_to_log(dir: &std::path::Path, records: &[tessera_storage::wal::WalRecord]) {
    use std::io::Write;
    let mut segments: Vec<_> = std::fs::read_dir(dir.join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    segments.sort();
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(segments.last().expect("a log segment"))
        .unwrap();
    for record in records {
        file.write_all(&record.encode_frame().unwrap()).unwrap();
    }
    file.sync_all().unwrap();
}

/// A prepare that arrived as its epoch's commit was applied can have its rows logged
/// before the commit record without being part of it. A restart must not take that for a
/// corrupt log: the commit applies the rows it names, the late ones stay undecided until
/// the abort logged for them (or the metadata) drops them.
#[test]
fn a_late_prepare_logged_before_its_commit_record_replays() {
    let dir = tempfile::tempdir().unwrap();
    let chunks = routed(&rows(0, 40));
    let (committed, late) = (chunks[0].clone(), chunks[1].clone());
    let committed_keys: Vec<i64> = {
        let batch = &committed.upserts[0];
        let keys = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let mut keys = keys.values().to_vec();
        keys.sort();
        keys
    };
    {
        let store = Store::open(dir.path(), config()).unwrap();
        store.ensure_table(def()).unwrap();
        store
            .prepare_epoch(Epoch(1), vec![committed.clone()])
            .unwrap();
        store.prepare_epoch(Epoch(1), vec![late.clone()]).unwrap();
    }
    // The commit record names the first entry only: the second arrived as it was applied.
    append_to_log(
        dir.path(),
        &[tessera_storage::wal::WalRecord::CommitPrepared {
            epoch: Epoch(1),
            lsns: vec![("kv".into(), committed.partition, tessera_common::Lsn(1))],
        }],
    );
    {
        let store = Store::open(dir.path(), config()).unwrap();
        assert_eq!(keys(&store, Epoch(1)), committed_keys);
        assert_eq!(
            store.undecided_epochs(),
            vec![Epoch(1)],
            "the late rows wait"
        );
    }
    append_to_log(
        dir.path(),
        &[tessera_storage::wal::WalRecord::Abort { epoch: Epoch(1) }],
    );
    let store = Store::open(dir.path(), config()).unwrap();
    assert_eq!(keys(&store, Epoch(1)), committed_keys);
    assert!(store.undecided_epochs().is_empty());
}
