//! Bounded memory on a real node process: a query held to `tessera.query_memory_limit`
//! spills its sorts and aggregations to disk and answers exactly what it answers without
//! the limit; a query whose hash join's build side cannot fit runs again with sort-merge
//! joins, which spill, and says so; one that cannot go on even so fails with an error
//! naming the query, the node and the limit, and the node serves on. A publish larger than
//! `store.max_publish_bytes` is refused by its coordinator, naming the limit, and
//! publishes nothing.

use std::path::Path;
use tessera_server::ClusterClient;
use tessera_testkit::{kv_batch, LocalCluster};

mod common;
use arrow::array::{Int64Array, RecordBatch};
use common::{
    flush_everywhere, kv_cluster_with, load_tpch_tables, plan_text, reported, wait_formed,
};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// The query's channels on the node share the limit (about 13 MiB each); sorting or
/// grouping 600,000 rows needs several times a sort channel's spilling half of that.
const LIMIT: &str = "64MB";

/// `sql` under a `limit` spills and answers what it answers without the limit, where
/// nothing spills.
async fn spills_and_answers_exactly(
    client: &ClusterClient,
    sql: &str,
    rows_from: &str,
    limit: &str,
) {
    let limited = format!("/*+ SET tessera.query_memory_limit = '{limit}' */");
    let free = client.query(sql).await.unwrap();
    let held = client
        .query(&format!("{limited} {sql}"))
        .await
        .unwrap_or_else(|e| panic!("{sql} under {limit}, rows from {rows_from}: {e}"));
    tessera_tpch::compare::same_answer(&free, &held, 0.0)
        .unwrap_or_else(|diff| panic!("{sql}, rows from {rows_from}: {diff}"));
    let analyzed = plan_text(
        client,
        &format!("{limited} EXPLAIN ANALYZE {sql}"),
        "Plan with Metrics",
    )
    .await;
    assert!(
        reported(&analyzed, "bytes spilled") > 0,
        "held to {limit}, {sql} spilled (rows from {rows_from}):\n{analyzed}"
    );
    let unlimited = plan_text(
        client,
        &format!("EXPLAIN ANALYZE {sql}"),
        "Plan with Metrics",
    )
    .await;
    assert_eq!(
        reported(&unlimited, "bytes spilled"),
        0,
        "with the node's whole pool nothing spills:\n{unlimited}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_over_their_memory_limit_spill_and_stay_exact_or_fail_naming_the_limit() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 1, 16, 1);
    // No checkpoint of its own: the rows stay in the memtables until the flush below.
    cluster.set_option("store.memtable_flush_bytes", "4000000000");
    cluster.set_option("store.idle_checkpoint_ms", "0");
    cluster.start_all();
    wait_formed(&cluster, 1, 1).await;
    load_tpch_tables(&cluster, 0.1, &["lineitem"]).await;
    let client = ClusterClient::new(cluster.addr(1));
    let sort = "SELECT l_orderkey, l_linenumber, l_comment FROM lineitem \
                ORDER BY l_comment, l_orderkey, l_linenumber";
    let group = "SELECT l_comment, count(*) AS n, sum(l_quantity) AS q FROM lineitem \
                 GROUP BY l_comment ORDER BY l_comment";
    let components = || {
        std::fs::read_dir(root.path().join("node-1/data/store/components"))
            .map(|dir| dir.count())
            .unwrap_or(0)
    };

    // Rows read from the memtables come out of the versioned scan in batches of the
    // session's size, so the sort's share fits them (one batch per partition did not).
    assert_eq!(components(), 0, "lineitem is read from memtables");
    for sql in [sort, group] {
        spills_and_answers_exactly(&client, sql, "memtables", LIMIT).await;
    }

    // The same rows in components, as a checkpoint leaves them.
    flush_everywhere(&cluster).await;
    let written = components();
    assert!(
        written >= 16,
        "lineitem is read from components: {written} written"
    );
    for sql in [sort, group] {
        spills_and_answers_exactly(&client, sql, "components", LIMIT).await;
    }
    // Tighter: an aggregation reading back the runs it spilled cannot spill again, and the
    // merge of 16 partitions' sorted groups holds a batch of each; neither fits a channel's
    // share (a fifth of the limit), both fit the query's.
    spills_and_answers_exactly(&client, group, "components", "16MB").await;
    let wide_groups = "SELECT l_orderkey, l_comment, sum(l_quantity) AS q FROM lineitem \
                       GROUP BY l_orderkey, l_comment";
    spills_and_answers_exactly(&client, wide_groups, "components", "8MB").await;

    // A hash join's build side does not spill: the query runs again with sort-merge joins,
    // which sort (and spill) both sides, answers as without the limit, and says so.
    let join = "SELECT count(*) AS n, sum(a.l_quantity) AS q FROM lineitem a \
                JOIN lineitem b ON a.l_comment = b.l_comment";
    let build_sides_over = |limit: &str| {
        format!(
            "/*+ SET tessera.query_memory_limit = '{limit}', \
             SET datafusion.optimizer.hash_join_single_partition_threshold = 0, \
             SET datafusion.optimizer.hash_join_single_partition_threshold_rows = 0 */ {join}"
        )
    };
    let free = client.query(join).await.unwrap();
    let (held, notices) = client
        .query_with_notices(&build_sides_over("8MB"))
        .await
        .unwrap_or_else(|e| panic!("the join under 8 MiB, with sort-merge joins: {e}"));
    tessera_tpch::compare::same_answer(&free, &held, 0.0)
        .unwrap_or_else(|diff| panic!("the join ran again with sort-merge joins: {diff}"));
    let replanned = notices
        .iter()
        .find_map(|n| n.recovery.as_ref())
        .unwrap_or_else(|| panic!("no notice says the join ran again: {notices:?}"));
    assert!(
        matches!(
            replanned,
            tessera_server::RecoveryOutcome::SpillingJoins { .. }
        ),
        "{replanned}"
    );
    let said = replanned.to_string();
    for part in ["sort-merge joins", "HashJoinInput", "its limit of 8.0 MiB"] {
        assert!(said.contains(part), "{part:?} missing from: {said}");
    }
    // A limit even a sort cannot make do with fails, naming it.
    let error = client
        .query(&build_sides_over("256KB"))
        .await
        .unwrap_err()
        .to_string();
    for part in [
        "needs more memory on node 1",
        "its limit of 256.0 KiB (tessera.query_memory_limit",
        "query ",
    ] {
        assert!(error.contains(part), "{part:?} missing from: {error}");
    }

    // A scalar subquery runs first, on its own, and under the query's limit too.
    let error = client
        .query(
            "/*+ SET tessera.query_memory_limit = '256KB' */ \
             SELECT count(*) AS n FROM lineitem \
             WHERE l_quantity < (SELECT count(DISTINCT l_comment) FROM lineitem)",
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("its limit of 256.0 KiB (tessera.query_memory_limit"),
        "{error}"
    );

    // A limit that is not a size is refused by name.
    let error = client
        .query("/*+ SET tessera.query_memory_limit = 'lots' */ SELECT count(*) FROM lineitem")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tessera.query_memory_limit must be a size"),
        "{error}"
    );

    // The node serves on, and the limit held only its own requests.
    let count = client
        .query("SELECT count(*) AS n FROM lineitem")
        .await
        .unwrap();
    assert_eq!(count[0].num_rows(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_over_the_largest_accepted_is_refused_naming_the_limit_and_publishes_nothing() {
    let root = tempfile::tempdir().unwrap();
    // 64 KiB: 20,000 rows of two BIGINTs are about 320 KB of Arrow data.
    let (_cluster, client) = kv_cluster_with(
        BINARY,
        root.path(),
        8,
        3,
        &[("store.max_publish_bytes", "65536")],
    )
    .await;
    let count = || async {
        let batches = client.query("SELECT count(*) FROM kv").await.unwrap();
        let counts = batches[0].column(0).as_any().downcast_ref::<Int64Array>();
        counts.unwrap().value(0)
    };

    // Through a client's publish (`tessera publish`, the loader), sent in several batches:
    // refused once what arrived outgrew the limit.
    let batches: Vec<RecordBatch> = (0..10)
        .map(|i| kv_batch(i * 2000, (i + 1) * 2000))
        .collect();
    let error = client
        .publish("kv", batches, false)
        .await
        .unwrap_err()
        .to_string();
    for part in ["exceeds the limit of 65536 bytes", "max_publish_bytes"] {
        assert!(error.contains(part), "{part:?} missing from: {error}");
    }
    // Through SQL, whose rows the coordinator computes itself.
    let error = client
        .sql("INSERT INTO kv SELECT value AS k, value AS v FROM generate_series(1, 20000)")
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("max_publish_bytes"), "{error}");
    assert_eq!(count().await, 0, "a refused publish leaves no rows");

    // Below the limit, publishes go through.
    client
        .publish("kv", vec![kv_batch(0, 1000)], false)
        .await
        .unwrap();
    client
        .sql("INSERT INTO kv SELECT value AS k, value AS v FROM generate_series(1000, 1999)")
        .await
        .unwrap();
    assert_eq!(count().await, 2000);
}
