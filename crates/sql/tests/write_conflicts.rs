//! No lost updates: an UPDATE or DELETE computes its rows from what it read, and another
//! publish may change the table before those rows are published. Such a publish is refused
//! as a write conflict (SQLSTATE 40001): a statement on its own runs again, reading the
//! change; a transaction fails at COMMIT and publishes nothing. Engines sharing one store,
//! as sessions of one node do.

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use std::sync::Arc;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

fn store(dir: &std::path::Path) -> Arc<Store> {
    let config = StoreConfig {
        partitions: 4,
        ..StoreConfig::default()
    };
    Store::open(dir, config).unwrap()
}

async fn counter(engine: &Engine, id: i64) -> Option<i64> {
    let batches = engine
        .query(&format!("SELECT n FROM counters WHERE id = {id}"))
        .await
        .unwrap();
    batches
        .iter()
        .find(|b| b.num_rows() > 0)
        .map(|b| b.column(0).as_primitive::<Int64Type>().value(0))
}

async fn with_counters(store: &Arc<Store>) -> Engine {
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE counters (id BIGINT, n BIGINT NOT NULL, PRIMARY KEY (id))")
        .await
        .unwrap();
    engine
        .execute("INSERT INTO counters VALUES (1, 0), (2, 0)")
        .await
        .unwrap();
    engine
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_overtaken_by_another_publish_fails_at_commit_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let a = with_counters(&store).await;
    let b = Engine::new(store.clone());

    a.execute("BEGIN").await.unwrap();
    a.execute("UPDATE counters SET n = n + 1 WHERE id = 1")
        .await
        .unwrap();
    // Another session's update of the same row commits first.
    b.execute("UPDATE counters SET n = n + 10 WHERE id = 1")
        .await
        .unwrap();
    let refused = a.execute("COMMIT").await.expect_err("a lost update");
    assert_eq!(refused.sqlstate(), "40001", "{refused}");
    assert!(
        refused
            .to_string()
            .contains("table \"counters\" changed at epoch"),
        "{refused}"
    );
    assert_eq!(counter(&b, 1).await, Some(10), "b's update is kept");
    assert!(
        !a.in_transaction(),
        "the failed COMMIT ended the transaction"
    );

    // Run again, it reads b's update.
    a.execute("BEGIN").await.unwrap();
    a.execute("UPDATE counters SET n = n + 1 WHERE id = 1")
        .await
        .unwrap();
    a.execute("COMMIT").await.unwrap();
    assert_eq!(counter(&b, 1).await, Some(11));

    // A DELETE of rows chosen by what it read: row 2 no longer matches once b updates it.
    a.execute("BEGIN").await.unwrap();
    a.execute("DELETE FROM counters WHERE n < 5").await.unwrap();
    b.execute("UPDATE counters SET n = 100 WHERE id = 2")
        .await
        .unwrap();
    let refused = a.execute("COMMIT").await.expect_err("a stale delete");
    assert_eq!(refused.sqlstate(), "40001", "{refused}");
    assert_eq!(counter(&b, 2).await, Some(100), "row 2 is still there");

    // A transaction that only inserts read nothing it writes back: no conflict.
    a.execute("BEGIN").await.unwrap();
    a.execute("INSERT INTO counters VALUES (3, 0)")
        .await
        .unwrap();
    b.execute("UPDATE counters SET n = n + 1 WHERE id = 1")
        .await
        .unwrap();
    a.execute("COMMIT").await.unwrap();
    assert_eq!(counter(&b, 3).await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_increments_lose_no_acknowledged_update() {
    const SESSIONS: usize = 4;
    const INCREMENTS: usize = 25;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let reader = with_counters(&store).await;
    let sessions = (0..SESSIONS).map(|_| {
        let engine = Engine::new(store.clone());
        tokio::spawn(async move {
            let mut acknowledged = 0;
            for _ in 0..INCREMENTS {
                match engine
                    .execute("UPDATE counters SET n = n + 1 WHERE id = 1")
                    .await
                {
                    Ok(_) => acknowledged += 1,
                    // Conflicts past the statement's own retries are the client's.
                    Err(error) => assert_eq!(error.sqlstate(), "40001", "{error}"),
                }
            }
            acknowledged
        })
    });
    let mut acknowledged = 0;
    for session in futures::future::join_all(sessions).await {
        acknowledged += session.unwrap();
    }
    assert!(acknowledged > 0);
    assert_eq!(
        counter(&reader, 1).await,
        Some(acknowledged as i64),
        "every acknowledged increment is counted once"
    );
}
