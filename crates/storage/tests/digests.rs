//! Version ids must not depend on layout: the change digest of every (partition, epoch),
//! computed from the rows as they were published, must equal what `Store::partition_digests`
//! recomputes from the store later, after checkpoints have flushed and merged the versions
//! into other components, and after a column was added (older epochs keep the columns
//! they had). Otherwise `tessera verify` would call a healthy replica corrupt.

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use tessera_common::{ComponentHash, Epoch, PartitionId, RowOp};
use tessera_storage::digest::{change_digest, DigestFormat};
use tessera_storage::evolution::AlterColumn;
use tessera_storage::routing::split_by_partition;
use tessera_storage::versions::{conform_to_schema, stamp, tombstone_rows};
use tessera_storage::{Store, StoreConfig, TableChanges};

mod common;
use common::{def, int64_batch as batch};

type Digests = BTreeMap<(PartitionId, Epoch), ComponentHash>;
/// The rows each (partition, epoch) wrote, as sorted text: what a digest must tell apart.
type Contents = BTreeMap<(PartitionId, Epoch), Vec<String>>;

/// Each row's values and operation (not its epoch), sorted.
fn content(versions: &[RecordBatch]) -> Vec<String> {
    let mut rows = Vec::new();
    for batch in versions {
        let schema = batch.schema();
        for i in 0..batch.num_rows() {
            let row: Vec<String> = (0..batch.num_columns())
                .filter(|&c| schema.field(c).name() != tessera_common::EPOCH_COLUMN)
                .map(|c| arrow::util::display::array_value_to_string(batch.column(c), i).unwrap())
                .collect();
            rows.push(row.join(","));
        }
    }
    rows.sort();
    rows
}

/// Publishes one epoch and returns the digests its rows give, per partition, computed as
/// the publish coordinator does (from the rows routed, before the store sees them).
fn publish(
    store: &Store,
    format: DigestFormat,
    upserts: RecordBatch,
    deletes: RecordBatch,
    expected: &mut Digests,
    contents: &mut Contents,
) {
    let def = store.table_def("kv").unwrap();
    let ring = store.ring();
    let epoch = store.visible_epoch().next();
    let mut by_partition: BTreeMap<PartitionId, Vec<RecordBatch>> = BTreeMap::new();
    let rows = [
        (conform_to_schema(&def, &upserts).unwrap(), RowOp::Upsert),
        (tombstone_rows(&def, &deletes).unwrap(), RowOp::Delete),
    ];
    for (rows, op) in rows.iter().filter(|(rows, _)| rows.num_rows() > 0) {
        for (p, part) in split_by_partition(&def, &ring, rows).unwrap() {
            by_partition
                .entry(p)
                .or_default()
                .push(stamp(&def, &part, epoch, *op).unwrap());
        }
    }
    let published = store
        .publish(vec![TableChanges {
            table: "kv".into(),
            upserts: vec![upserts],
            deletes: vec![deletes],
            before_images: vec![],
        }])
        .unwrap();
    assert_eq!(published, epoch);
    for (p, versions) in by_partition {
        expected.insert(
            (p, epoch),
            change_digest(&def, epoch, format, &versions).unwrap(),
        );
        contents.insert((p, epoch), content(&versions));
    }
}

fn recomputed(store: &Store, format: DigestFormat) -> Digests {
    let mut digests = Digests::new();
    for p in store.ring().partitions() {
        let (horizon, by_epoch) = store.partition_digests("kv", p, |_| format).unwrap();
        assert_eq!(horizon, Epoch::ZERO);
        for (epoch, digest) in by_epoch {
            digests.insert((p, epoch), digest);
        }
    }
    digests
}

#[test]
fn digests_in_rows_survive_flushes_merges_and_an_added_column() {
    digests_survive_flushes_merges_and_an_added_column(DigestFormat::Rows);
}

#[test]
fn digests_in_columns_survive_flushes_merges_and_an_added_column() {
    digests_survive_flushes_merges_and_an_added_column(DigestFormat::Columns);
}

fn digests_survive_flushes_merges_and_an_added_column(format: DigestFormat) {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        partitions: 4,
        merge_threshold: 2,
        ..StoreConfig::default()
    };
    let store = Store::open(dir.path(), config).unwrap();
    store.create_table(def()).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut expected = Digests::new();
    let mut contents = Contents::new();
    let mut added = false;
    for step in 0..30 {
        let mut keys = Vec::new();
        while keys.len() < rng.random_range(1..10) {
            let k = rng.random_range(0..50);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let deletes: Vec<i64> = (0..rng.random_range(0..3))
            .map(|_| rng.random_range(50..60))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let values: Vec<i64> = keys.iter().map(|_| rng.random_range(0..1000)).collect();
        let upserts = if added {
            let extra: Vec<i64> = keys.iter().map(|k| k * 7).collect();
            batch(vec![keys, values, extra], &["k", "v", "w"])
        } else {
            batch(vec![keys, values], &["k", "v"])
        };
        publish(
            &store,
            format,
            upserts,
            batch(vec![deletes], &["k"]),
            &mut expected,
            &mut contents,
        );
        if step % 4 == 3 {
            store.checkpoint().unwrap();
        }
        if step == 15 {
            store
                .alter_table(
                    "kv",
                    &AlterColumn::Add {
                        field: Field::new("w", DataType::Int64, true),
                        default: Some("5".into()),
                    },
                )
                .unwrap();
            added = true;
        }
    }
    let stats = store.table_stats();
    assert!(
        stats[0].components > 0,
        "the checkpoints flushed components: {stats:?}"
    );
    // The digests tell change sets apart (a constant would also compare equal): equal
    // digests exactly where the rows written are equal.
    let pairs: std::collections::BTreeSet<(&Vec<String>, &ComponentHash)> = expected
        .iter()
        .map(|(at, digest)| (&contents[at], digest))
        .collect();
    let distinct_contents: std::collections::BTreeSet<&Vec<String>> = contents.values().collect();
    let distinct_digests: std::collections::BTreeSet<&ComponentHash> = expected.values().collect();
    assert_eq!(
        pairs.len(),
        distinct_contents.len(),
        "one digest per change set"
    );
    assert_eq!(
        distinct_digests.len(),
        distinct_contents.len(),
        "one change set per digest"
    );
    assert_eq!(recomputed(&store, format), expected, "before a restart");
    store.checkpoint().unwrap();
    drop(store);
    let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
    assert_eq!(
        recomputed(&store, format),
        expected,
        "after a checkpoint, merges and a restart"
    );
}
