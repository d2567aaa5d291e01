//! Scans push filters down: batches of kept columns whose bounds exclude the filter are
//! skipped, as Parquet row groups are by their statistics, and the answer stays exact.

use arrow::util::pretty::pretty_format_batches;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_outside_a_filter_are_skipped_by_their_bounds() {
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

    // The table's two columns are small decoded, so the scan reads them through the
    // decoded cache: the first query decodes and keeps them, the second reads memory.
    // Either way the batches the filter excludes are skipped by their bounds, as Parquet's
    // row groups would be by their footer statistics (the Parquet reader's own pruning is
    // tested in `snapshot_scan`'s unit tests).
    let sql = "SELECT count(*), sum(v) FROM t WHERE k > 290000";
    for run in ["first", "second"] {
        let answer = pretty_format_batches(&engine.query(sql).await.unwrap())
            .unwrap()
            .to_string();
        assert!(
            answer.contains("| 10000    | 5900010000 |"),
            "{run}: {answer}"
        );
        let analyzed = pretty_format_batches(
            &engine
                .query(&format!("EXPLAIN ANALYZE {sql}"))
                .await
                .unwrap(),
        )
        .unwrap()
        .to_string();
        assert!(analyzed.contains("DecodedScanExec"), "{run}: {analyzed}");
        let (total, matched) = pruning_counts(&analyzed, "batches_pruned_statistics=")
            .unwrap_or_else(|| panic!("{run}: no pruning metrics in {analyzed}"));
        // 300 000 rows in batches of a few thousand; the last 10 000 keys span two or three.
        assert!(
            total >= 30 && (1..=3).contains(&matched),
            "{run}: most batches are skipped: {total} total, {matched} matched"
        );
    }
}

/// The `N total → M matched` of the first metric named `metric` in `analyzed`.
fn pruning_counts(analyzed: &str, metric: &str) -> Option<(usize, usize)> {
    let counts = analyzed.split(metric).nth(1)?;
    let (total, rest) = counts.split_once(" total → ")?;
    let matched = rest.split_once(" matched")?.0;
    Some((total.trim().parse().ok()?, matched.trim().parse().ok()?))
}
