use super::*;
use crate::decoded::tests::rows_of;
use crate::Engine;
use datafusion::physical_plan::{collect, displayable};
use datafusion::prelude::SessionContext;
use tessera_storage::{Store, StoreConfig};

/// A store of 8 partitions whose table `t` (`ddl`) was loaded in one publish per range of
/// `loads` (`v = 10 k`), each checkpointed into components of its own.
async fn loaded(ddl: &str, loads: &[(i64, i64)]) -> (tempfile::TempDir, Arc<Store>, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 8,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let engine = Engine::new(store.clone());
    engine.execute(ddl).await.unwrap();
    for (from, to) in loads {
        engine
            .execute(&format!(
                "INSERT INTO t SELECT value, value * 10 FROM generate_series({from}, {to})"
            ))
            .await
            .unwrap();
        store.checkpoint().unwrap();
    }
    (dir, store, engine)
}

/// Plans a scan of `t` (v, k) at its newest epoch, one output partition per storage
/// partition, and runs it: the plan as shown, its output partitions and the rows by key.
async fn scan(store: &Arc<Store>) -> (String, usize, Vec<(i64, i64)>) {
    let ctx = SessionContext::new();
    let snapshot = store.snapshot("t", None).unwrap();
    let plan = plan_snapshot_scan(SnapshotScan {
        store: store.as_ref(),
        snapshot: &snapshot,
        partitions: None,
        projection: vec![1, 0],
        predicate: None,
        limit: None,
        grouping: FileGrouping::PerStoragePartition,
        statistics: &ComponentStatistics::default(),
        decoded: None,
        runtime: &ctx.runtime_env(),
        parquet: Default::default(),
    })
    .unwrap();
    let shown = displayable(plan.as_ref()).indent(false).to_string();
    let outputs = plan.properties().output_partitioning().partition_count();
    let batches = collect(plan, ctx.task_ctx()).await.unwrap();
    (shown, outputs, rows_of(&batches))
}

fn components_per_partition(store: &Store) -> Vec<usize> {
    let snapshot = store.snapshot("t", None).unwrap();
    snapshot
        .partitions
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| p.components.len())
        .collect()
}

const KEYED: &str = "CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT)";

#[tokio::test]
async fn loads_of_disjoint_keys_are_read_as_written() {
    let (_dir, store, _) = loaded(KEYED, &[(1, 1000), (1001, 2000), (2001, 3000)]).await;
    let held = components_per_partition(&store);
    assert!(
        held.iter().all(|&c| c == 3),
        "three components each: {held:?}"
    );

    let (shown, outputs, rows) = scan(&store).await;
    assert!(!shown.contains("VersionedScanExec"), "{shown}");
    assert!(shown.contains("DataSourceExec"), "{shown}");
    assert_eq!(
        outputs,
        held.len(),
        "one output partition per storage partition"
    );
    let expected: Vec<(i64, i64)> = (1..=3000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows, expected);
}

#[tokio::test]
async fn loads_apart_in_any_order_are_read_as_written_until_a_key_repeats() {
    let (_dir, store, engine) = loaded(KEYED, &[(1, 1000), (2001, 3000), (1001, 2000)]).await;
    let (shown, _, rows) = scan(&store).await;
    assert!(!shown.contains("VersionedScanExec"), "{shown}");
    assert_eq!(rows.len(), 3000);

    // An update writes keys the first load holds: resolved as versions, each key once.
    engine
        .execute("UPDATE t SET v = v + 1 WHERE k % 100 = 0")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let (shown, outputs, rows) = scan(&store).await;
    assert!(shown.contains("VersionedScanExec"), "{shown}");
    assert_eq!(outputs, components_per_partition(&store).len());
    let expected: Vec<(i64, i64)> = (1..=3000)
        .map(|k| (k * 10 + i64::from(k % 100 == 0), k))
        .collect();
    assert_eq!(rows, expected, "every key once, at its newest version");
}

#[tokio::test]
async fn loads_whose_key_ranges_overlap_are_resolved_as_versions() {
    // Keys 500..=600 are written again (the same values): their ranges overlap, and so
    // do their keys.
    let (_dir, store, engine) = loaded(KEYED, &[(1, 2000)]).await;
    engine
        .execute("UPDATE t SET v = k * 10 WHERE k BETWEEN 500 AND 600")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let (shown, _, rows) = scan(&store).await;
    assert!(shown.contains("VersionedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (1..=2000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows, expected, "a key written twice is read once");

    // Odd keys after even ones: no key repeats, but the ranges interleave, so nothing
    // proves it; resolved as versions, the same rows.
    let (_dir, store, engine) = loaded(KEYED, &[]).await;
    for parity in [0, 1] {
        engine
            .execute(&format!(
                "INSERT INTO t SELECT value * 2 + {parity}, (value * 2 + {parity}) * 10 FROM generate_series(1, 1000)"
            ))
            .await
            .unwrap();
        store.checkpoint().unwrap();
    }
    let (shown, _, rows) = scan(&store).await;
    assert!(shown.contains("VersionedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (2..=2001).map(|k| (k * 10, k)).collect();
    assert_eq!(rows, expected);
}

#[tokio::test]
async fn an_append_only_table_reads_every_load_as_written() {
    let (_dir, store, _) = loaded(
        "CREATE TABLE t (k BIGINT, v BIGINT)",
        &[(1, 1000), (1, 1000)],
    )
    .await;
    let held = components_per_partition(&store);
    assert!(held.iter().all(|&c| c == 2), "{held:?}");
    let (shown, _, rows) = scan(&store).await;
    assert!(!shown.contains("VersionedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (1..=1000)
        .flat_map(|k| [(k * 10, k), (k * 10, k)])
        .collect();
    assert_eq!(rows, expected, "both loads' rows, duplicates and all");
}
