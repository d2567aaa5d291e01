//! A partition's scan is canonical: its rows come in the same order whatever the layout
//! holding them (memtable, flushed components, a merge's current component). Lineage
//! recovery relies on it: a dead node's scan re-run on another replica must reproduce the
//! batches the dead node had already sent, and that replica may hold the same rows laid
//! out differently (it has not yet taken the primary's newest components, or, as a hot
//! standby, flushed and merged on its own).

use arrow::array::{Array, AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema};
use datafusion::prelude::SessionContext;
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_sql::provider::{
    plan_in_id_order, ComponentStatistics, FileGrouping, InIdOrder, SnapshotScan,
};
use tessera_sql::Engine;
use tessera_storage::versions::RowOrder;
use tessera_storage::{Store, StoreConfig, TableChanges};

/// Table `t (k, v)` in a store of one partition, merged at every checkpoint that finds
/// two components.
async fn table_t() -> (tempfile::TempDir, Arc<Store>, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 1,
            merge_threshold: 1,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE t (k BIGINT, v BIGINT, PRIMARY KEY (k))")
        .await
        .unwrap();
    (dir, store, engine)
}

/// The table's rows, in the order its one partition's scan gives them (one output
/// partition, so nothing downstream reorders them).
async fn scanned(engine: &Engine) -> Vec<(i64, i64)> {
    let batches = engine
        .query("/*+ SET datafusion.execution.target_partitions = 1 */ SELECT k, v FROM t")
        .await
        .unwrap();
    pairs(&batches)
}

/// The (k, v) rows of `batches`, in order.
fn pairs(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    batches
        .iter()
        .flat_map(|b| {
            let (k, v) = (
                b.column(0).as_primitive::<Int64Type>(),
                b.column(1).as_primitive::<Int64Type>(),
            );
            (0..b.num_rows()).map(move |i| {
                assert!(!k.is_null(i) && !v.is_null(i));
                (k.value(i), v.value(i))
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitions_rows_come_in_one_order_whatever_their_layout() {
    let (_dir, store, engine) = table_t().await;
    // Rows that do not arrive in key order, then new versions of some of them, deletes and
    // more new keys, each its own epoch.
    for sql in [
        "INSERT INTO t SELECT (value * 7919) % 1000, value FROM generate_series(1, 999) ORDER BY value",
        "UPDATE t SET v = v + 100000 WHERE k % 5 = 0",
        "DELETE FROM t WHERE k % 11 = 0",
        "INSERT INTO t SELECT 2000 - value, value FROM generate_series(1, 300) ORDER BY value",
    ] {
        engine.execute(sql).await.unwrap();
    }
    let in_memory = scanned(&engine).await;
    let keys: Vec<i64> = in_memory.iter().map(|r| r.0).collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    assert_ne!(keys, sorted, "the rows are not in key order to begin with");

    store.flush().unwrap();
    assert_eq!(
        scanned(&engine).await,
        in_memory,
        "flushed into a component, the rows come in the order they did from the memtable"
    );
    // Another epoch on top, flushed into a second component, then both merged.
    engine
        .execute("UPDATE t SET v = -v WHERE k % 3 = 0")
        .await
        .unwrap();
    let before_merge = scanned(&engine).await;
    store.flush().unwrap();
    assert_eq!(
        scanned(&engine).await,
        before_merge,
        "two flushed components"
    );
    store.checkpoint().unwrap();
    let stats = store.table_stats();
    assert_eq!(
        stats.iter().find(|t| t.name == "t").unwrap().components,
        2,
        "merged into one current and one history component: {stats:?}"
    );
    assert_eq!(
        scanned(&engine).await,
        before_merge,
        "the merge's current component keeps the order the versions were read in"
    );
}

/// A partition whose largest component is not its oldest: a read resolves the other
/// versions against the largest one, and must still give the rows in the order a read of
/// the same versions from memory does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_larger_newer_component_does_not_reorder_a_partitions_rows() {
    let (_dir, store, engine) = table_t().await;
    engine
        .execute("INSERT INTO t SELECT value, value * 1 FROM generate_series(1, 5)")
        .await
        .unwrap();
    store.flush().unwrap();
    // One blind publish, larger than the first: new versions of two of its keys, and new
    // keys. One version per key, so the read resolves the first component against it.
    let keys: Vec<i64> = [2, 4].into_iter().chain(10..=200).collect();
    let values: Vec<i64> = keys.iter().map(|k| 1000 + k).collect();
    let upserts = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, true),
        ])),
        vec![
            Arc::new(Int64Array::from(keys)),
            Arc::new(Int64Array::from(values)),
        ],
    )
    .unwrap();
    store
        .publish(vec![TableChanges::upserts("t", vec![upserts])])
        .unwrap();
    let in_memory = scanned(&engine).await;
    assert_eq!(in_memory[..3], [(1, 1), (3, 3), (5, 5)], "{in_memory:?}");
    store.flush().unwrap();
    assert_eq!(
        store
            .table_stats()
            .iter()
            .find(|t| t.name == "t")
            .unwrap()
            .components,
        2,
        "not merged yet"
    );
    assert_eq!(scanned(&engine).await, in_memory);
}

/// `t`'s rows at `epoch` as a cluster channel plans its scan (every storage partition, by
/// id, each through whichever reader its layout here allows), in `order`.
async fn scanned_at(store: &Arc<Store>, epoch: Epoch, order: RowOrder) -> Vec<(i64, i64)> {
    let ctx = SessionContext::new();
    let snapshot = store.snapshot("t", Some(epoch)).unwrap();
    let InIdOrder {
        plan,
        reading_order,
        ..
    } = plan_in_id_order(SnapshotScan {
        store: store.as_ref(),
        snapshot: &snapshot,
        partitions: None,
        projection: vec![0, 1],
        predicate: None,
        limit: None,
        grouping: FileGrouping::InIdRuns,
        statistics: &ComponentStatistics::default(),
        decoded: None,
        runtime: &ctx.runtime_env(),
        parquet: Default::default(),
        order,
    })
    .unwrap();
    let mut rows = Vec::new();
    for i in reading_order {
        let stream = plan.execute(i, ctx.task_ctx()).unwrap();
        let batches: Vec<RecordBatch> = futures::TryStreamExt::try_collect(stream).await.unwrap();
        rows.extend(pairs(&batches));
    }
    rows
}

/// A read at an epoch below a merge's (`AS OF`) finds some of its rows among the merge's
/// current versions and some among its history: in the order the versions were logged, it
/// comes out otherwise than before the merge, on a replica that has not merged. In key
/// order, it comes out the same from every layout, which is what lineage recovery's
/// re-run of a dead node's scan on another replica needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_below_a_merge_comes_in_one_order_only_by_key() {
    let (_dir, store, engine) = table_t().await;
    engine
        .execute("INSERT INTO t SELECT (value * 7919) % 1000, value FROM generate_series(1, 999) ORDER BY value")
        .await
        .unwrap();
    let old = store.visible_epoch();
    store.flush().unwrap();
    let flushed = (
        scanned_at(&store, old, RowOrder::Logged).await,
        scanned_at(&store, old, RowOrder::ByKey).await,
    );
    let keys: Vec<i64> = flushed.0.iter().map(|r| r.0).collect();
    assert!(!keys.is_sorted(), "logged out of key order to begin with");
    let mut sorted = flushed.0.clone();
    sorted.sort_unstable();
    assert_eq!(flushed.1, sorted, "by key: the same rows, sorted");

    // Newer versions of some keys, then a merge: those keys' versions of `old` are history.
    engine
        .execute("UPDATE t SET v = -v WHERE k % 3 = 0")
        .await
        .unwrap();
    store.flush().unwrap();
    store.checkpoint().unwrap();
    let stats = store.table_stats();
    assert_eq!(
        stats.iter().find(|t| t.name == "t").unwrap().components,
        2,
        "merged into one current and one history component: {stats:?}"
    );
    let merged = scanned_at(&store, old, RowOrder::Logged).await;
    let mut merged_sorted = merged.clone();
    merged_sorted.sort_unstable();
    assert_eq!(merged_sorted, sorted, "the same rows at the old epoch");
    assert_ne!(
        merged, flushed.0,
        "in logged order, the merged layout reads the old epoch's rows otherwise"
    );
    assert_eq!(
        scanned_at(&store, old, RowOrder::ByKey).await,
        flushed.1,
        "in key order, the merged layout reads them as the unmerged one did"
    );
}
