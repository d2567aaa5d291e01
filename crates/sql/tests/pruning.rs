//! Scans push filters into Parquet: row groups whose statistics exclude the filter are
//! skipped, and the answer stays exact.

use arrow::util::pretty::pretty_format_batches;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_groups_outside_a_filter_are_pruned_by_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 1,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE t (k BIGINT, v BIGINT, PRIMARY KEY (k))")
        .await
        .unwrap();
    // Rows arrive in key order, so each row group covers one key range. (Without the
    // ORDER BY, generate_series spread over the session's cores may interleave ranges.)
    engine
        .execute(
            "INSERT INTO t SELECT value, value * 2 FROM generate_series(1, 300000) ORDER BY value",
        )
        .await
        .unwrap();
    store.checkpoint().unwrap();

    let sql = "SELECT count(*), sum(v) FROM t WHERE k > 290000";
    let answer = pretty_format_batches(&engine.query(sql).await.unwrap())
        .unwrap()
        .to_string();
    assert!(answer.contains("| 10000    | 5900010000 |"), "{answer}");
    let analyzed = pretty_format_batches(
        &engine
            .query(&format!("EXPLAIN ANALYZE {sql}"))
            .await
            .unwrap(),
    )
    .unwrap()
    .to_string();
    let pruned = analyzed
        .split("row_groups_pruned_statistics=")
        .nth(1)
        .unwrap_or_else(|| panic!("no pruning metrics in {analyzed}"));
    assert!(
        pruned.starts_with("3 total → 1 matched"),
        "two of three row groups are skipped: {pruned:.120}"
    );
}
