//! No lost updates through PostgreSQL clients on a 3-node cluster: sessions on different
//! nodes update the same row. A transaction whose table changed after it read it fails at
//! COMMIT with SQLSTATE 40001 (serialization_failure) and publishes nothing; statements on
//! their own run again by themselves, so concurrent increments all count.

use super::{cluster, connect, exclusive};
use tokio_postgres::error::SqlState;

async fn counter(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT n FROM counters WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_on_different_nodes_lose_no_update() {
    let _one = exclusive();
    let root = tempfile::tempdir().unwrap();
    let cluster = cluster(root.path()).await;
    let (one, two) = (connect(&cluster, 1).await, connect(&cluster, 2).await);
    one.batch_execute("CREATE TABLE counters (id BIGINT, n BIGINT NOT NULL, PRIMARY KEY (id))")
        .await
        .unwrap();
    one.batch_execute("INSERT INTO counters VALUES (1, 0)")
        .await
        .unwrap();

    one.batch_execute("BEGIN").await.unwrap();
    one.batch_execute("UPDATE counters SET n = n + 1 WHERE id = 1")
        .await
        .unwrap();
    two.batch_execute("UPDATE counters SET n = n + 10 WHERE id = 1")
        .await
        .unwrap();
    let refused = one
        .batch_execute("COMMIT")
        .await
        .expect_err("a lost update");
    assert_eq!(
        refused.code(),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE),
        "{refused:?}"
    );
    assert_eq!(counter(&two).await, 10, "node 2's update is kept");

    // Autocommit increments through every node at once: each acknowledged one counts.
    let sessions = (1..=3).map(|id| {
        let cluster = &cluster;
        async move {
            let client = connect(cluster, id).await;
            let mut acknowledged = 0i64;
            for _ in 0..8 {
                match client
                    .batch_execute("UPDATE counters SET n = n + 1 WHERE id = 1")
                    .await
                {
                    Ok(()) => acknowledged += 1,
                    Err(error) => assert_eq!(
                        error.code(),
                        Some(&SqlState::T_R_SERIALIZATION_FAILURE),
                        "{error:?}"
                    ),
                }
            }
            acknowledged
        }
    });
    let acknowledged: i64 = futures::future::join_all(sessions).await.into_iter().sum();
    assert!(acknowledged > 0);
    assert_eq!(counter(&one).await, 10 + acknowledged);
}
