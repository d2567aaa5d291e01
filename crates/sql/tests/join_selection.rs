//! A local engine collects a hash join's build side into one shared table up to
//! `LOCAL_COLLECT_JOIN_BYTES` (estimated), where plain DataFusion (1 MiB) repartitions both
//! sides by the key; the answer is the same either way.

use arrow::util::pretty::pretty_format_batches;
use datafusion::physical_plan::displayable;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_join_collects_a_build_side_of_a_few_megabytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE probe (k BIGINT PRIMARY KEY, v BIGINT)")
        .await
        .unwrap();
    engine
        .execute("CREATE TABLE tagged (k BIGINT PRIMARY KEY, tag VARCHAR)")
        .await
        .unwrap();
    engine
        .execute("INSERT INTO probe SELECT value, value * 3 FROM generate_series(1, 600000)")
        .await
        .unwrap();
    engine
        .execute("INSERT INTO tagged SELECT value, 'tag' || (value % 5) FROM generate_series(1, 1000000)")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    // The build side, as TPC-H Q8's filtered parts: a filter the planner cannot size, guessed
    // at a fifth of a million keys (200,000 of 8 bytes, 1.6 MB: between DataFusion's bound
    // and Tessera's local one).
    let sql = "SELECT count(*), sum(probe.k) FROM probe JOIN tagged ON probe.v = tagged.k \
               WHERE tagged.tag = 'tag3'";

    let plan_of = |engine: &Engine| {
        let ctx = engine.session().clone();
        async move {
            let plan = ctx
                .sql(sql)
                .await
                .unwrap()
                .create_physical_plan()
                .await
                .unwrap();
            let shown = displayable(plan.as_ref()).indent(false).to_string();
            shown
        }
    };
    let collected = plan_of(&engine).await;
    assert!(collected.contains("mode=CollectLeft"), "{collected}");
    let answer = pretty_format_batches(&engine.query(sql).await.unwrap())
        .unwrap()
        .to_string();

    // DataFusion's own bound, set for the session, repartitions both sides instead.
    engine
        .execute("SET datafusion.optimizer.hash_join_single_partition_threshold = 1048576")
        .await
        .unwrap();
    let partitioned = plan_of(&engine).await;
    assert!(partitioned.contains("mode=Partitioned"), "{partitioned}");
    let again = pretty_format_batches(&engine.query(sql).await.unwrap())
        .unwrap()
        .to_string();
    assert_eq!(answer, again);
    // probe.v = 3 k meets tagged keys up to 1,000,000 that are multiples of 3 and 3 mod 5:
    // v = 15 j + 3 (j from 0 to 66,666), k = 5 j + 1; their sum is 5 * 66666 * 66667 / 2 + 66667.
    assert!(answer.contains("| 66667 "), "{answer}");
    assert!(answer.contains("| 11111122222 "), "{answer}");
}
