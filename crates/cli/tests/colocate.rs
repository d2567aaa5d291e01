//! Co-located joins and aggregations on a 3-node cluster of real node processes: a join or
//! aggregation on the tables' shared partition key runs where the partitions are, moving
//! neither side; a join whose other side is partitioned some other way hashes that side
//! as the storage does; a join on any other key still hashes both sides. Every answer is
//! the plain DataFusion one.

use arrow::array::RecordBatch;
use datafusion::prelude::SessionContext;
use std::path::Path;
use std::sync::Arc;
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

mod common;
use common::{load_tpch_tables, plan_text, reported, wait_formed};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const SF: f64 = 0.05;
const TABLES: [&str; 8] = [
    "orders", "lineitem", "customer", "nation", "region", "supplier", "part", "partsupp",
];
/// Hash joins partitioned even when one side is small enough to broadcast.
const NO_BROADCAST: &str = "datafusion.optimizer.hash_join_single_partition_threshold = 0, \
     datafusion.optimizer.hash_join_single_partition_threshold_rows = 0";
const APART: &str = "tessera.colocate = false";
const MERGE_JOINS: &str = "datafusion.optimizer.prefer_hash_join = false";

fn oracle() -> SessionContext {
    let oracle = SessionContext::new();
    for name in TABLES {
        let table = tessera_tpch::table(name).unwrap();
        let batches: Vec<RecordBatch> = table
            .generate(SF, 64 * 1024)
            .collect::<Result<_, _>>()
            .unwrap();
        let mem = datafusion::datasource::MemTable::try_new(table.schema(), vec![batches]).unwrap();
        oracle.register_table(name, Arc::new(mem)).unwrap();
    }
    oracle
}

/// `sql` under the settings `hints` (none if empty).
fn with(hints: &[&str], sql: &str) -> String {
    if hints.is_empty() {
        sql.to_string()
    } else {
        format!("/*+ SET {} */ {sql}", hints.join(", SET "))
    }
}

/// The bytes an `EXPLAIN ANALYZE` reports as exchanged between nodes.
async fn bytes_exchanged(client: &ClusterClient, hints: &[&str], sql: &str) -> u64 {
    let text = plan_text(
        client,
        &with(hints, &format!("EXPLAIN ANALYZE {sql}")),
        "Plan with Metrics",
    )
    .await;
    reported(&text, "bytes exchanged")
}

/// The stages of a distributed plan's text, each its header line and operators.
fn stages(plan: &str) -> Vec<String> {
    let mut stages: Vec<String> = Vec::new();
    for line in plan.lines() {
        if line.starts_with("Stage ") {
            stages.push(String::new());
        }
        if let Some(stage) = stages.last_mut() {
            stage.push_str(line);
            stage.push('\n');
        }
    }
    stages
}

async fn explain(client: &ClusterClient, hints: &[&str], sql: &str) -> String {
    plan_text(
        client,
        &with(hints, &format!("EXPLAIN {sql}")),
        "distributed_plan",
    )
    .await
}

async fn assert_exact(client: &ClusterClient, oracle: &SessionContext, hints: &[&str], sql: &str) {
    let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
    let actual = client.query(&with(hints, sql)).await.unwrap();
    tessera_tpch::compare::same_answer(&expected, &actual, 1e-9)
        .unwrap_or_else(|diff| panic!("{hints:?} {sql}: {diff}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_and_aggregations_on_the_partition_key_run_where_the_partitions_are() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 16, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let loaded = load_tpch_tables(&cluster, SF, &TABLES).await;
    let client = ClusterClient::new(cluster.addr(2));
    let oracle = oracle();

    // lineitem and orders share the order key: the join runs in the scan stage, on the
    // nodes holding both tables' partitions, and only the grouped counts move.
    let on_key = "SELECT o_orderpriority, count(*) AS n, sum(l_quantity) AS q \
                  FROM lineitem JOIN orders ON l_orderkey = o_orderkey \
                  GROUP BY o_orderpriority ORDER BY o_orderpriority";
    let plan = explain(&client, &[NO_BROADCAST], on_key).await;
    let scans = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=lineitem"))
        .unwrap_or_else(|| panic!("no lineitem scan:\n{plan}"));
    assert!(
        scans.contains("table=orders") && scans.contains("HashJoinExec"),
        "the join reads both tables in their scan stage:\n{plan}"
    );
    assert!(!plan.contains("Storage-hash"), "{plan}");
    for node in 1..=3 {
        assert!(scans.contains(&format!("node {node}: ")), "{scans}");
    }
    // With co-location off, both sides are hashed across the nodes, and far more moves.
    let apart_plan = explain(&client, &[NO_BROADCAST, APART], on_key).await;
    let apart_scans = stages(&apart_plan)
        .into_iter()
        .find(|s| s.contains("table=lineitem"))
        .unwrap();
    assert!(!apart_scans.contains("table=orders"), "{apart_plan}");
    let together = bytes_exchanged(&client, &[NO_BROADCAST], on_key).await;
    let apart = bytes_exchanged(&client, &[NO_BROADCAST, APART], on_key).await;
    assert!(
        together * 10 < apart,
        "co-located, {together} bytes moved; apart, {apart}"
    );
    for hints in [&[NO_BROADCAST][..], &[NO_BROADCAST, APART], &[]] {
        assert_exact(&client, &oracle, hints, on_key).await;
    }
    // Sort-merge joins on the key run where the partitions are too, each side sorted there.
    let plan = explain(&client, &[MERGE_JOINS], on_key).await;
    let scans = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=lineitem"))
        .unwrap();
    assert!(
        scans.contains("table=orders") && scans.contains("SortMergeJoinExec"),
        "{plan}"
    );
    assert_exact(&client, &oracle, &[MERGE_JOINS], on_key).await;

    // One day's orders are few enough to collect and send to every node, as DataFusion
    // plans them; but both sides are partitioned alike on the key, so the join runs where
    // the partitions are and neither side moves.
    let small_side = "SELECT count(*) AS n, sum(l_quantity) AS q FROM orders JOIN lineitem \
                      ON o_orderkey = l_orderkey WHERE o_orderdate = DATE '1995-03-15'";
    let plan = explain(&client, &[], small_side).await;
    assert!(!plan.contains(", broadcast"), "{plan}");
    let scans = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=lineitem"))
        .unwrap();
    assert!(
        scans.contains("table=orders") && scans.contains("HashJoinExec"),
        "{plan}"
    );
    let apart_plan = explain(&client, &[APART], small_side).await;
    assert!(apart_plan.contains(", broadcast"), "{apart_plan}");
    for hints in [&[][..], &[APART]] {
        assert_exact(&client, &oracle, hints, small_side).await;
    }

    // An aggregation on the key needs no exchange below the answer.
    let by_key = "SELECT l_orderkey, sum(l_quantity) AS q FROM lineitem \
                  GROUP BY l_orderkey HAVING sum(l_quantity) > 250 ORDER BY l_orderkey";
    let plan = explain(&client, &[], by_key).await;
    assert!(!plan.contains("Hash exchange"), "{plan}");
    assert_exact(&client, &oracle, &[], by_key).await;

    // customer is partitioned on c_custkey; the orders per customer are grouped by
    // DataFusion's hash of o_custkey. Pairing those partitions would lose matches: the
    // grouped side is hashed again as the storage hashes, and customer does not move.
    let mixed = "SELECT c_mktsegment, count(*) AS customers, sum(n) AS orders \
                 FROM customer JOIN (SELECT o_custkey, count(*) AS n FROM orders GROUP BY o_custkey) \
                 ON c_custkey = o_custkey GROUP BY c_mktsegment ORDER BY c_mktsegment";
    let plan = explain(&client, &[NO_BROADCAST], mixed).await;
    let customer = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=customer"))
        .unwrap_or_else(|| panic!("no customer scan:\n{plan}"));
    assert!(customer.contains("HashJoinExec"), "{plan}");
    assert!(plan.contains("Storage-hash exchange"), "{plan}");
    for hints in [&[NO_BROADCAST][..], &[NO_BROADCAST, APART]] {
        assert_exact(&client, &oracle, hints, mixed).await;
    }
    // So with sort-merge joins (what a query runs again with when a hash join's build
    // side does not fit its memory): the grouped side is hashed as the storage hashes,
    // under its sort, and customer is sorted where it is.
    let plan = explain(&client, &[NO_BROADCAST, MERGE_JOINS], mixed).await;
    let customer = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=customer"))
        .unwrap_or_else(|| panic!("no customer scan:\n{plan}"));
    assert!(customer.contains("SortMergeJoinExec"), "{plan}");
    assert!(plan.contains("Storage-hash exchange"), "{plan}");
    for hints in [&[MERGE_JOINS][..], &[MERGE_JOINS, APART]] {
        assert_exact(&client, &oracle, hints, mixed).await;
    }

    // orders joined to customer on the customer key: customer is partitioned by it and
    // stays; only orders moves, hashed as the storage hashes customer.
    let to_customer = "SELECT c_mktsegment, count(*) AS n FROM orders JOIN customer \
                       ON o_custkey = c_custkey GROUP BY c_mktsegment ORDER BY c_mktsegment";
    let plan = explain(&client, &[NO_BROADCAST], to_customer).await;
    let orders = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=orders"))
        .unwrap();
    assert!(orders.contains("Storage-hash exchange"), "{plan}");
    assert_exact(&client, &oracle, &[NO_BROADCAST], to_customer).await;

    // A join on a key neither side is partitioned by hashes both sides.
    let off_key = "SELECT count(*) AS pairs FROM orders a JOIN orders b \
                   ON a.o_custkey = b.o_custkey AND a.o_orderdate < b.o_orderdate";
    let plan = explain(&client, &[NO_BROADCAST], off_key).await;
    let scans: Vec<String> = stages(&plan)
        .into_iter()
        .filter(|s| s.contains("table=orders"))
        .collect();
    assert_eq!(scans.len(), 2, "{plan}");
    for scan in scans {
        assert!(scan.contains("; Hash exchange"), "{plan}");
    }
    assert!(!plan.contains("Storage-hash"), "{plan}");
    assert_exact(&client, &oracle, &[NO_BROADCAST], off_key).await;

    // A small build side that is itself an inner join, whose rows nothing bounds, is not
    // broadcast: the join is made partitioned, on the join key, for the cluster.
    // DataFusion had planned the aggregation above it on lineitem's own partitioning (by
    // order key), which the join no longer keeps: lineitem is hashed again on the order
    // key before grouping, and no order's lines are split between groups.
    let regrouped = "SELECT l_orderkey, sum(l_quantity) AS q FROM lineitem \
                     JOIN (SELECT c_custkey, n_name FROM customer JOIN nation \
                           ON c_nationkey = n_nationkey \
                           WHERE c_mktsegment = 'BUILDING' AND n_regionkey = 1 \
                           GROUP BY c_custkey, n_name) ON l_suppkey = c_custkey \
                     GROUP BY l_orderkey ORDER BY q DESC, l_orderkey LIMIT 20";
    let plan = explain(&client, &[], regrouped).await;
    assert!(plan.contains("mode=Hash([l_orderkey@0])"), "{plan}");
    assert_exact(&client, &oracle, &[], regrouped).await;

    // Q11's suppliers of one nation, a semi join of supplier, are at most supplier's rows:
    // few enough to broadcast, though derived. Each node joins its own partsupp
    // partitions to them and groups them by part key where they are; partsupp does not
    // move, as it does when the joins are hashed.
    let q11 = tessera_tpch::query(11);
    let plan = explain(&client, &[], q11).await;
    assert!(plan.contains(", broadcast"), "{plan}");
    let broadcast = bytes_exchanged(&client, &[], q11).await;
    let hashed = bytes_exchanged(&client, &[NO_BROADCAST], q11).await;
    println!("Q11 bytes exchanged: suppliers broadcast {broadcast}, joins hashed {hashed}");
    assert!(
        broadcast * 5 < hashed,
        "broadcast {broadcast}, hashed {hashed}"
    );
    for hints in [&[][..], &[NO_BROADCAST]] {
        assert_exact(&client, &oracle, hints, q11).await;
    }

    // Q2 pairs each part of one size and type with the cheapest supply cost of that part,
    // on the part key and the cost: both sides are partitioned by the part key alone
    // (part joined to partsupp where they are; the cheapest cost grouped by part key where
    // partsupp is), a part of the join keys, the same part on both sides. The join runs
    // where they are, and only the small tables move, broadcast.
    let q2 = tessera_tpch::query(2);
    let plan = explain(&client, &[], q2).await;
    assert!(!plan.contains("; Hash exchange"), "{plan}");
    assert!(!plan.contains("Storage-hash"), "{plan}");
    for hints in [&[][..], &[APART]] {
        assert_exact(&client, &oracle, hints, q2).await;
    }

    // Q18's `IN` (the orders whose lines sum past 300) runs on orders before orders is
    // joined to customer and lineitem: both sides of that semi join are partitioned by
    // order key, so it runs where they are, and few orders travel to the customers
    // (which are not broadcast, as at SF 1 they are too many to be).
    let q18 = tessera_tpch::query(18);
    let kept_above = "tessera.push_semi_joins = false";
    let pushed = bytes_exchanged(&client, &[NO_BROADCAST], q18).await;
    let kept = bytes_exchanged(&client, &[NO_BROADCAST, kept_above], q18).await;
    println!("Q18 bytes exchanged: semi join pushed {pushed}, kept above the joins {kept}");
    assert!(pushed * 2 < kept, "pushed {pushed}, kept {kept}");
    assert_exact(&client, &oracle, &[NO_BROADCAST, kept_above], q18).await;

    // Q22's customers without orders: every order's customer key is hashed to the
    // customer partitions, once per key and producer channel (an anti join asks only
    // whether a key occurs), not once per order.
    let q22 = tessera_tpch::query(22);
    let plan = explain(&client, &[], q22).await;
    let orders = stages(&plan)
        .into_iter()
        .find(|s| s.contains("table=orders"))
        .unwrap_or_else(|| panic!("no orders scan:\n{plan}"));
    assert!(orders.contains("AggregateExec: mode=Partial"), "{plan}");
    let moved = bytes_exchanged(&client, &[], q22).await;
    let order_keys = 8 * loaded["orders"] as u64;
    println!("Q22 bytes exchanged: {moved}; the orders' customer keys are {order_keys} bytes");
    assert!(moved * 3 < order_keys, "{moved} bytes moved");

    // Every TPC-H query that reads only these tables is exact co-located.
    for q in [3, 4, 12, 13, 18, 22] {
        assert_exact(&client, &oracle, &[NO_BROADCAST], tessera_tpch::query(q)).await;
    }
}
