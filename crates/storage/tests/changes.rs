//! Diffs between epochs against a model: random upserts and deletes published to a store
//! whose checkpoints flush and merge components between them; every diff between two
//! retained epochs must equal the model's, whichever components hold the versions.

use arrow::array::{Array, AsArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::changes::partition_changes;
use tessera_storage::{Store, StoreConfig, TableChanges, TableDef};

mod common;
use common::{def, int64_batch as batch};

type Rows = BTreeMap<i64, i64>;
/// (change, key, before, after)
type Change = (String, i64, Option<i64>, Option<i64>);

fn model_diff(before: &Rows, after: &Rows) -> Vec<Change> {
    let mut keys: Vec<i64> = before.keys().chain(after.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| match (before.get(&k), after.get(&k)) {
            (None, Some(&a)) => Some(("insert".into(), k, None, Some(a))),
            (Some(&b), None) => Some(("delete".into(), k, Some(b), None)),
            (Some(&b), Some(&a)) if a != b => Some(("update".into(), k, Some(b), Some(a))),
            _ => None,
        })
        .collect()
}

fn store_diff(store: &Store, from: Epoch, to: Epoch) -> Vec<Change> {
    let def = store.table_def("kv").unwrap();
    let snapshot = store.changes_snapshot("kv", from, to).unwrap();
    let mut changes = Vec::new();
    for partition in &snapshot.partitions {
        let Some(batch) =
            partition_changes(store.components_dir(), &def, partition, from, to).unwrap()
        else {
            continue;
        };
        let schema = batch.schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["change", "k", "before_v", "after_v"]);
        let kind = batch.column(0).as_string::<i32>();
        let k = batch.column(1).as_primitive::<Int64Type>();
        let (b, a) = (
            batch.column(2).as_primitive::<Int64Type>(),
            batch.column(3).as_primitive::<Int64Type>(),
        );
        let value =
            |c: &arrow::array::PrimitiveArray<Int64Type>, i| (!c.is_null(i)).then(|| c.value(i));
        for i in 0..batch.num_rows() {
            changes.push((
                kind.value(i).to_string(),
                k.value(i),
                value(b, i),
                value(a, i),
            ));
        }
    }
    changes.sort_by_key(|c| c.1);
    changes
}

/// Publishes `upserts` and `deletes` to `kv` as one epoch, and applies them to the model.
/// Written as a blind publish would write them.
fn publish_kv(
    store: &Store,
    upserts: Vec<(i64, i64)>,
    deletes: Vec<i64>,
    rows: &mut Rows,
) -> Epoch {
    publish_kv_as(store, upserts, deletes, rows, false)
}

/// [`publish_kv`]; `read_first` writes them as an UPDATE or DELETE would, having read the
/// keys it changes: with the before image of every key that existed, and the read epoch.
fn publish_kv_as(
    store: &Store,
    upserts: Vec<(i64, i64)>,
    deletes: Vec<i64>,
    rows: &mut Rows,
    read_first: bool,
) -> Epoch {
    let read = store.visible_epoch();
    let (image_keys, image_values): (Vec<i64>, Vec<i64>) = upserts
        .iter()
        .map(|(k, _)| k)
        .chain(&deletes)
        .filter_map(|k| rows.get(k).map(|v| (*k, *v)))
        .unzip();
    for &(k, v) in &upserts {
        rows.insert(k, v);
    }
    for k in &deletes {
        rows.remove(k);
    }
    let (keys, values): (Vec<i64>, Vec<i64>) = upserts.into_iter().unzip();
    let mut changes = TableChanges {
        table: "kv".into(),
        upserts: vec![batch(vec![keys, values], &["k", "v"])],
        deletes: vec![batch(vec![deletes], &["k"])],
        before_images: vec![],
    };
    let mut read_at = tessera_common::ReadEpochs::new();
    if read_first {
        changes.before_images = vec![batch(vec![image_keys, image_values], &["k", "v"])];
        read_at.insert("kv".into(), read);
    }
    store.publish_read_at(vec![changes], &read_at).unwrap()
}

/// A store of table `kv` over 4 partitions that merges as soon as a partition has more
/// than 2 components.
fn merging_store(dir: &std::path::Path) -> std::sync::Arc<Store> {
    merging_store_of(dir, 4)
}

/// A store of table `kv` over `partitions` partitions that merges as soon as a partition
/// has more than 2 components, and only then (no tiered merges: the tests here say which
/// components a diff may open).
fn merging_store_of(dir: &std::path::Path, partitions: u32) -> std::sync::Arc<Store> {
    let config = StoreConfig {
        partitions,
        merge_threshold: 2,
        tiered_merges: false,
        ..StoreConfig::default()
    };
    let store = Store::open(dir, config).unwrap();
    store.create_table(def()).unwrap();
    store
}

#[test]
fn every_diff_equals_the_models_through_flushes_and_merges() {
    let dir = tempfile::tempdir().unwrap();
    let store = merging_store(dir.path());
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut history: Vec<(Epoch, Rows)> = vec![(store.visible_epoch(), Rows::new())];
    for step in 0..40 {
        let mut rows = history.last().unwrap().1.clone();
        let mut upserts = Vec::new();
        for _ in 0..rng.random_range(1..12) {
            let (k, v) = (rng.random_range(0..60), rng.random_range(0..5));
            if !upserts.iter().any(|(key, _)| *key == k) {
                upserts.push((k, v));
            }
        }
        let mut deletes = Vec::new();
        for _ in 0..rng.random_range(0..4) {
            let k = rng.random_range(0..60);
            if !upserts.iter().any(|(key, _)| *key == k) && !deletes.contains(&k) {
                deletes.push(k);
            }
        }
        // Some epochs written as UPDATEs and DELETEs write them, with before images, some
        // blind: a diff pairs either kind.
        let epoch = publish_kv_as(&store, upserts, deletes, &mut rows, step % 3 != 0);
        history.push((epoch, rows));
        if step % 5 == 4 {
            store.checkpoint().unwrap();
        }
    }
    for (i, (from, before)) in history.iter().enumerate() {
        for (to, after) in &history[i..] {
            assert_eq!(
                store_diff(&store, *from, *to),
                model_diff(before, after),
                "diff from epoch {from} to epoch {to}"
            );
        }
    }
    let backwards = store
        .changes_snapshot("kv", Epoch(5), Epoch(3))
        .unwrap_err();
    assert!(
        backwards.to_string().contains("from epoch 5 to epoch 3"),
        "{backwards}"
    );
}

/// The point of before images: a diff of epochs that only UPDATEs and DELETEs wrote takes
/// every row before from those epochs' own rows, and never opens an older component.
#[test]
fn a_diff_of_updates_and_deletes_opens_no_older_component() {
    let dir = tempfile::tempdir().unwrap();
    let store = merging_store(dir.path());
    let mut rows = Rows::new();
    publish_kv(&store, (0..40).map(|k| (k, k)).collect(), vec![], &mut rows);
    store.checkpoint().unwrap();
    let from = store.visible_epoch();
    let before = rows.clone();
    let loaded: Vec<std::path::PathBuf> = std::fs::read_dir(store.components_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert!(!loaded.is_empty(), "the load was flushed to components");
    publish_kv_as(&store, vec![(3, 30), (7, 70)], vec![11], &mut rows, true);
    store.checkpoint().unwrap();
    publish_kv_as(&store, vec![(3, 31), (12, 120)], vec![7], &mut rows, true);
    let to = store.visible_epoch();
    // The loaded components are gone: a diff that opened one would fail.
    for path in &loaded {
        std::fs::remove_file(path).unwrap();
    }
    let diff = store_diff(&store, from, to);
    assert_eq!(diff, model_diff(&before, &rows));
    assert_eq!(
        diff.iter().map(|c| c.1).collect::<Vec<_>>(),
        [3, 7, 11, 12],
        "key 7, updated and then deleted, is one delete of its loaded row"
    );
}

/// Before images are trusted only with the read epoch the write-conflict check holds them
/// to: a publish carrying them without one is refused, and publishes nothing.
#[test]
fn before_images_without_a_read_epoch_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = merging_store(dir.path());
    let mut rows = Rows::new();
    publish_kv(&store, vec![(1, 1)], vec![], &mut rows);
    let visible = store.visible_epoch();
    let error = store
        .publish(vec![TableChanges {
            table: "kv".into(),
            upserts: vec![batch(vec![vec![1], vec![2]], &["k", "v"])],
            deletes: vec![],
            before_images: vec![batch(vec![vec![1], vec![1]], &["k", "v"])],
        }])
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("before images") && error.contains("read at"),
        "{error}"
    );
    assert_eq!(store.visible_epoch(), visible, "nothing was published");
}

#[test]
fn a_key_declared_out_of_column_order_finds_its_rows_before() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_with_partitions(dir.path(), 2);
    let def = TableDef::new(
        "t",
        Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Int64, false),
            Field::new("c", DataType::Int64, false),
        ]),
        vec!["b".into(), "a".into()],
        None,
    )
    .unwrap();
    store.create_table(def.clone()).unwrap();
    let publish = |a: Vec<i64>, b: Vec<i64>, c: Vec<i64>| {
        store
            .publish(vec![TableChanges::upserts(
                "t",
                vec![batch(vec![a, b, c], &["a", "b", "c"])],
            )])
            .unwrap()
    };
    let from = publish(vec![1, 2, 3], vec![10, 20, 30], vec![100, 200, 300]);
    store.checkpoint().unwrap();
    let to = publish(vec![2], vec![20], vec![222]);
    let snapshot = store.changes_snapshot("t", from, to).unwrap();
    let mut updates = Vec::new();
    for partition in &snapshot.partitions {
        if let Some(changes) =
            partition_changes(store.components_dir(), &def, partition, from, to).unwrap()
        {
            let schema = changes.schema();
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            assert_eq!(
                names,
                ["change", "b", "a", "before_c", "after_c"],
                "key columns in key order"
            );
            let column = |i: usize| changes.column(i).as_primitive::<Int64Type>().value(0);
            updates.push((column(1), column(2), column(3), column(4)));
        }
    }
    assert_eq!(
        updates,
        [(20, 2, 200, 222)],
        "the row before, found by its two-column key"
    );
}

/// Keys that share their first column's value with a changed key (an integer, which the
/// diff rules rows out by first), or whose first column is text (which it does not): only
/// the changed key's row before is taken, whatever its first column.
#[test]
fn keys_sharing_a_first_column_value_with_a_changed_key_are_not_changes() {
    use arrow::array::{Int32Array, StringArray};
    for first in [DataType::Int32, DataType::Utf8] {
        let dir = tempfile::tempdir().unwrap();
        let store = common::store_with_partitions(dir.path(), 1);
        let schema = Arc::new(Schema::new(vec![
            Field::new("g", first.clone(), false),
            Field::new("name", DataType::Utf8, false),
            Field::new("v", DataType::Int64, false),
        ]));
        let def = TableDef::new(
            "t",
            schema.as_ref().clone(),
            vec!["g".into(), "name".into()],
            None,
        )
        .unwrap();
        store.create_table(def.clone()).unwrap();
        let rows = |g: Vec<i32>, names: Vec<&str>, v: Vec<i64>| {
            let g: arrow::array::ArrayRef = match first {
                DataType::Int32 => Arc::new(Int32Array::from(g)),
                _ => Arc::new(StringArray::from_iter_values(
                    g.iter().map(|g| g.to_string()),
                )),
            };
            let columns: Vec<arrow::array::ArrayRef> = vec![
                g,
                Arc::new(StringArray::from(names)),
                Arc::new(arrow::array::Int64Array::from(v)),
            ];
            arrow::array::RecordBatch::try_new(schema.clone(), columns).unwrap()
        };
        let publish = |batch| {
            store
                .publish(vec![TableChanges::upserts("t", vec![batch])])
                .unwrap()
        };
        let from = publish(rows(
            vec![1, 1, 1, 2],
            vec!["a", "b", "c", "b"],
            vec![10, 20, 30, 40],
        ));
        store.checkpoint().unwrap();
        let to = publish(rows(vec![1, 3], vec!["b", "b"], vec![21, 50]));
        let snapshot = store.changes_snapshot("t", from, to).unwrap();
        let changes = partition_changes(
            store.components_dir(),
            &def,
            &snapshot.partitions[0],
            from,
            to,
        )
        .unwrap()
        .expect("changes");
        let kinds = changes.column(0).as_string::<i32>();
        let names = changes.column(2).as_string::<i32>();
        let before = changes.column(3).as_primitive::<Int64Type>();
        let after = changes.column(4).as_primitive::<Int64Type>();
        let found: Vec<(String, String, Option<i64>, i64)> = (0..changes.num_rows())
            .map(|i| {
                (
                    kinds.value(i).to_string(),
                    names.value(i).to_string(),
                    (!before.is_null(i)).then(|| before.value(i)),
                    after.value(i),
                )
            })
            .collect();
        assert_eq!(
            found,
            [
                ("update".to_string(), "b".to_string(), Some(20), 21),
                ("insert".to_string(), "b".to_string(), None, 50),
            ],
            "first key column {first}"
        );
    }
}

/// The live rows at `epoch`.
fn rows_at(store: &Store, epoch: Epoch) -> Rows {
    let mut rows = Rows::new();
    for live in common::live_rows(store, "kv", epoch) {
        let k = live.column(0).as_primitive::<Int64Type>();
        let v = live.column(1).as_primitive::<Int64Type>();
        for i in 0..live.num_rows() {
            rows.insert(k.value(i), v.value(i));
        }
    }
    rows
}

/// Row versions the store holds for the table, over every partition.
fn stored_versions(store: &Store) -> usize {
    (0..4)
        .map(|p| {
            store
                .partition_versions("kv", tessera_common::PartitionId(p), Epoch::ZERO)
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum::<usize>()
        })
        .sum()
}

#[test]
fn merges_drop_only_versions_below_the_retention_horizon() {
    let dir = tempfile::tempdir().unwrap();
    let store = merging_store(dir.path());
    let mut history: Vec<(Epoch, Rows)> = Vec::new();
    let mut rows = Rows::new();
    let mut published = 0;
    // The same 20 keys rewritten every epoch, some deleted: many versions per key. Every
    // publish reaches every partition, and every checkpoint merges them all.
    for step in 0..30i64 {
        if step == 20 {
            let horizon = history[19].0;
            store.set_retention_horizons(vec![("kv".into(), horizon)]);
        }
        let keys: Vec<i64> = (0..20).collect();
        let values: Vec<i64> = keys.iter().map(|k| k * 100 + step).collect();
        let deletes: Vec<i64> = if step % 7 == 6 {
            vec![step % 20]
        } else {
            vec![]
        };
        let upserts: Vec<(i64, i64)> = keys
            .into_iter()
            .zip(values)
            .filter(|(k, _)| !deletes.contains(k))
            .collect();
        published += upserts.len() + deletes.len();
        let epoch = publish_kv(&store, upserts, deletes, &mut rows);
        history.push((epoch, rows.clone()));
        store.checkpoint().unwrap();
    }
    let horizon = history[19].0;
    let stored = stored_versions(&store);
    assert!(
        stored < published / 2,
        "merges should drop the versions below the horizon: {published} versions published, {stored} stored"
    );
    // Every retained epoch still reads exactly, and every diff between retained epochs.
    for (epoch, rows) in &history[19..] {
        assert_eq!(&rows_at(&store, *epoch), rows, "rows at epoch {epoch}");
    }
    for (from, before) in &history[19..] {
        let (to, after) = history.last().unwrap();
        assert_eq!(store_diff(&store, *from, *to), model_diff(before, after));
    }
    // Below the horizon: refused, naming it; and no delta that would reach below it.
    let refused = store
        .snapshot("kv", Some(history[18].0))
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("no longer retained") && refused.contains(&horizon.to_string()),
        "{refused}"
    );
    let refused = store
        .partition_versions("kv", tessera_common::PartitionId(0), horizon)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("copy the partition whole"), "{refused}");
    assert!(store
        .partition_versions("kv", tessera_common::PartitionId(0), horizon.next())
        .is_ok());
    // A horizon never falls, even if asked.
    store.set_retention_horizons(vec![("kv".into(), Epoch(1))]);
    assert_eq!(store.retention_horizon("kv"), horizon);
}

/// A merge under retention keeps a key's newest tombstone at or below the horizon while a
/// history component that reads above the horizon still open holds an older version of
/// the key: dropping it brought the deleted row back `AS OF` epochs between the horizon and
/// that component's `superseded_at` (the versioned cluster model test saw deleted keys
/// again after a restart, under eager merges).
#[test]
fn a_merge_under_retention_never_brings_a_deleted_key_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = merging_store_of(dir.path(), 1);
    let mut rows = Rows::new();
    let mut history: Vec<(Epoch, Rows)> = Vec::new();
    let mut step = |upserts: Vec<(i64, i64)>, deletes: Vec<i64>, rows: &mut Rows| {
        let epoch = publish_kv(&store, upserts, deletes, rows);
        store.checkpoint().unwrap();
        history.push((epoch, rows.clone()));
        epoch
    };
    // Key 1 written, then deleted; a third component merges the three: the tombstone is
    // current, key 1's row goes to a history component superseded at the third epoch.
    step(vec![(1, 10)], vec![], &mut rows);
    let deleted_at = step(vec![], vec![1], &mut rows);
    step(vec![(2, 20)], vec![], &mut rows);
    // The horizon reaches the delete but not the history component's superseded epoch;
    // more components make the live ones merge again under it.
    store.set_retention_horizons(vec![("kv".into(), deleted_at)]);
    for k in 3..8 {
        step(vec![(k, k * 10)], vec![], &mut rows);
    }
    for (epoch, expected) in history.iter().filter(|(e, _)| *e >= deleted_at) {
        assert_eq!(&rows_at(&store, *epoch), expected, "rows at epoch {epoch}");
    }
}
