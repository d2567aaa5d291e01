use crate::{Engine, StatementOutput};
use datafusion::common::tree_node::TreeNode;
use datafusion::logical_expr::{JoinType, LogicalPlan};
use tessera_storage::{Store, StoreConfig};

/// Customers, their orders and the orders' lines, where a customer has several orders and
/// an order several lines (so the inner joins multiply rows), some lines and orders have
/// no match, and one order key is NULL.
async fn shop() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 4,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let engine = Engine::new(store);
    for statement in [
        "CREATE TABLE customer (c_custkey BIGINT PRIMARY KEY, c_name TEXT)",
        "CREATE TABLE orders (o_orderkey BIGINT PRIMARY KEY, o_custkey BIGINT, o_price BIGINT)",
        "CREATE TABLE lineitem (l_id BIGINT PRIMARY KEY, l_orderkey BIGINT, l_quantity BIGINT)",
        "INSERT INTO customer SELECT value, 'c' || value FROM generate_series(1, 20)",
        "INSERT INTO orders SELECT value, value % 20 + 1, value * 3 FROM generate_series(1, 100)",
        "INSERT INTO lineitem SELECT value, CASE WHEN value % 97 = 0 THEN NULL ELSE value % 110 END, value % 7 FROM generate_series(1, 600)",
    ] {
        engine.execute(statement).await.unwrap();
    }
    (dir, engine)
}

/// The big orders: those whose lines' quantities sum past 20 (as TPC-H Q18 asks).
const BIG_ORDERS: &str = "SELECT c_name, o_orderkey, sum(l_quantity) AS q
    FROM customer, orders, lineitem
    WHERE o_orderkey IN (SELECT l_orderkey FROM lineitem GROUP BY l_orderkey HAVING sum(l_quantity) > 20)
      AND c_custkey = o_custkey AND o_orderkey = l_orderkey
    GROUP BY c_name, o_orderkey ORDER BY o_orderkey";

async fn optimized(engine: &Engine, sql: &str) -> LogicalPlan {
    engine
        .session()
        .sql(sql)
        .await
        .unwrap()
        .into_optimized_plan()
        .unwrap()
}

async fn answer(engine: &Engine, sql: &str) -> String {
    let outputs = engine.execute(sql).await.unwrap();
    let Some(StatementOutput::Rows { batches, .. }) = outputs.into_iter().last() else {
        panic!("{sql} answered no rows");
    };
    arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string()
}

/// For each semi or anti join of the plan: whether a join other than a semi or anti join
/// is below its left side.
fn semi_joins_above_joins(plan: &LogicalPlan) -> Vec<bool> {
    let mut found = Vec::new();
    plan.apply(|node| {
        if let LogicalPlan::Join(join) = node {
            if is_semi_or_anti(join.join_type) {
                found.push(join.left.exists(|below| {
                    Ok(matches!(below, LogicalPlan::Join(j) if !is_semi_or_anti(j.join_type)))
                })?);
            }
        }
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    })
    .unwrap();
    found
}

fn is_semi_or_anti(join_type: JoinType) -> bool {
    matches!(join_type, JoinType::LeftSemi | JoinType::LeftAnti)
}

/// The answer to `sql` and, for each semi join of its plan, whether a join is below it.
async fn run(engine: &Engine, sql: &str) -> (String, Vec<bool>) {
    (
        answer(engine, sql).await,
        semi_joins_above_joins(&optimized(engine, sql).await),
    )
}

/// Runs `sql` with the rule and without it: the two answers, and the plans' semi joins.
async fn with_and_without(
    engine: &Engine,
    sql: &str,
) -> ((String, Vec<bool>), (String, Vec<bool>)) {
    let pushed = run(engine, sql).await;
    engine
        .execute("SET tessera.push_semi_joins = false")
        .await
        .unwrap();
    let kept = run(engine, sql).await;
    engine
        .execute("SET tessera.push_semi_joins = true")
        .await
        .unwrap();
    (pushed, kept)
}

#[tokio::test]
async fn an_in_subquery_filters_the_orders_before_they_are_joined() {
    let (_dir, engine) = shop().await;
    let ((pushed, pushed_plan), (kept, kept_plan)) = with_and_without(&engine, BIG_ORDERS).await;
    assert_eq!(
        pushed_plan,
        vec![false],
        "{}",
        optimized(&engine, BIG_ORDERS).await
    );
    assert_eq!(
        kept_plan,
        vec![true],
        "without the rule, the semi join is on top"
    );
    assert_eq!(pushed, kept);
    // Not vacuous: some orders are big and some are not.
    let rows = pushed.lines().count() - 4;
    assert!(rows > 0 && rows < 100, "{pushed}");
}

#[tokio::test]
async fn not_in_and_not_exists_are_pushed_with_their_null_rules() {
    let (_dir, engine) = shop().await;
    // `NOT IN` over a subquery with a NULL keeps nothing; `NOT EXISTS` ignores the NULL.
    for sql in [
        "SELECT c_name, o_orderkey FROM customer JOIN orders ON c_custkey = o_custkey
            WHERE o_orderkey NOT IN (SELECT l_orderkey FROM lineitem) ORDER BY o_orderkey",
        "SELECT c_name, o_orderkey FROM customer JOIN orders ON c_custkey = o_custkey
            WHERE o_orderkey NOT IN (SELECT l_orderkey FROM lineitem WHERE l_orderkey IS NOT NULL) ORDER BY o_orderkey",
        "SELECT c_name, o_orderkey FROM customer JOIN orders ON c_custkey = o_custkey
            WHERE NOT EXISTS (SELECT 1 FROM lineitem WHERE l_orderkey = o_orderkey) ORDER BY o_orderkey",
    ] {
        let ((pushed, pushed_plan), (kept, kept_plan)) = with_and_without(&engine, sql).await;
        assert_eq!(pushed_plan, vec![false], "{sql}");
        assert_eq!(kept_plan, vec![true], "{sql}");
        assert_eq!(pushed, kept, "{sql}");
    }
}

#[tokio::test]
async fn a_test_of_both_join_inputs_of_an_outer_joins_padding_or_below_a_filtering_join_stays_on_top(
) {
    let (_dir, engine) = shop().await;
    for sql in [
        // The correlated filter reads a customer and an order column.
        "SELECT c_name, o_orderkey FROM customer JOIN orders ON c_custkey = o_custkey
            WHERE EXISTS (SELECT 1 FROM lineitem WHERE l_orderkey = o_orderkey AND l_quantity > c_custkey % 5)
            ORDER BY o_orderkey",
        // The customers are filtered: the join keeps only their orders, and the semi
        // join tests those rather than every order (as in TPC-H Q21).
        "SELECT c_name, o_orderkey FROM customer JOIN orders ON c_custkey = o_custkey
            WHERE c_name LIKE 'c1%' AND o_orderkey IN (SELECT l_orderkey FROM lineitem WHERE l_quantity = 3)
            ORDER BY o_orderkey",
        // Below a left join, the orders' side is padded with NULLs.
        "SELECT c_name, o_orderkey FROM customer LEFT JOIN orders ON c_custkey = o_custkey AND o_price > 200
            WHERE o_orderkey IN (SELECT l_orderkey FROM lineitem WHERE l_quantity = 3)
            ORDER BY c_name, o_orderkey",
    ] {
        let ((pushed, pushed_plan), (kept, _)) = with_and_without(&engine, sql).await;
        assert!(pushed_plan.iter().all(|&above| above), "{sql}: {pushed_plan:?}");
        assert_eq!(pushed, kept, "{sql}");
    }
}
