//! Answers that stream at the client's pace (with their errors and recovery notices), and
//! cancels that stop a statement on every node.

use super::*;

/// A 3-node cluster with a table `numbers` of the keys 1 to 100 000, and a client of node 1.
async fn numbers_cluster(root: &Path) -> (LocalCluster, tokio_postgres::Client) {
    let cluster = cluster(root).await;
    let client = connect(&cluster, 1).await;
    client
        .batch_execute(
            "CREATE TABLE numbers (k BIGINT NOT NULL, PRIMARY KEY (k));
             INSERT INTO numbers SELECT value FROM generate_series(1, 100000)",
        )
        .await
        .unwrap();
    (cluster, client)
}

/// Waits until no node runs a channel of any query.
async fn wait_no_query_running(cluster: &LocalCluster) {
    for node in 1..=3 {
        wait_until(
            &format!("node {node} to stop the query's channels"),
            std::time::Duration::from_secs(15),
            || async {
                (metric(cluster, node, "tessera_queries_running").await? == 0.0).then_some(())
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_query_stops_on_every_node() {
    let _one = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = numbers_cluster(root.path()).await;
    // A join of every number with a thousandth of the others: hours in a debug build, with
    // channels on every node (both sides are hashed across the cluster).
    const LONG: &str = "SELECT count(*) FROM numbers a JOIN numbers b ON a.k % 100 = b.k % 100";
    let cancel = client.cancel_token();
    let query = tokio::spawn(async move { client.query_one(LONG, &[]).await });
    for node in 1..=3 {
        if query.is_finished() {
            panic!("the long query ended by itself: {:?}", query.await.unwrap());
        }
        wait_until(
            &format!("the query's channels to run on node {node}"),
            std::time::Duration::from_secs(30),
            || async {
                (metric(&cluster, node, "tessera_queries_running").await? >= 1.0).then_some(())
            },
        )
        .await;
    }
    cancel.cancel_query(NoTls).await.unwrap();
    let answer = tokio::time::timeout(std::time::Duration::from_secs(30), query)
        .await
        .expect("the cancel stopped the query")
        .unwrap();
    let error = answer.expect_err("a cancelled query answered");
    assert_eq!(error.code(), Some(&SqlState::QUERY_CANCELED), "{error}");
    wait_no_query_running(&cluster).await;
    // The connection goes on.
    let client = connect(&cluster, 1).await;
    let n: i64 = client
        .query_one("SELECT count(*) FROM numbers", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 100000);
}

/// An answer larger than the session's answer buffer goes out as it comes: the client
/// reads its first rows while the query still runs (a node holding the whole answer would
/// have finished first), every row arrives once and in order, and a cancel mid-answer
/// stops the query on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_streams_at_the_clients_pace() {
    use futures::StreamExt;
    let _one = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = numbers_cluster(root.path()).await;
    client
        .batch_execute("SET tessera.answer_buffer = '64KB'")
        .await
        .unwrap();

    // Streamed, yet exact: every number once, in order.
    let ordered = client
        .query_raw("SELECT k FROM numbers ORDER BY k", Vec::<i64>::new())
        .await
        .unwrap();
    futures::pin_mut!(ordered);
    let mut expected = 1_i64;
    while let Some(row) = ordered.next().await {
        assert_eq!(
            row.unwrap().get::<_, i64>(0),
            expected,
            "in order, none lost"
        );
        expected += 1;
    }
    assert_eq!(expected, 100_001, "every row arrived");
    // Several statements in one simple query: the earlier answer is read whole first.
    let both = client
        .simple_query(
            "SELECT k AS streamed FROM numbers ORDER BY k; \
             SELECT count(*) AS after_it FROM numbers",
        )
        .await
        .unwrap();
    let rows: Vec<&str> = both
        .iter()
        .filter_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0),
            _ => None,
        })
        .collect();
    assert_eq!(rows.len(), 100_001);
    assert_eq!(
        (rows[0], rows[99_999], rows[100_000]),
        ("1", "100000", "100000")
    );
    // ... so the first statement had ended (its last row read) before the second began;
    // streamed, it would have run on while the second ran.
    let (_, status) = common::http_get(&cluster, 1, "/api/status", None).await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let recent = |tag: &str| {
        let statement = status["recent"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["sql"].as_str().unwrap().contains(tag))
            .unwrap_or_else(|| panic!("{tag} among the recent statements: {status}"));
        let started = statement["started_ms"].as_u64().unwrap();
        (started, started + statement["elapsed_ms"].as_u64().unwrap())
    };
    let ((_, first_ended), (second_started, _)) = (recent("streamed"), recent("after_it"));
    assert!(
        first_ended <= second_started + 5,
        "the first statement ended at {first_ended} ms, after the second began at {second_started} ms"
    );

    // A streamed answer that fails after rows went out fails its transaction, as an
    // error mid-scan does in PostgreSQL: what follows is refused until ROLLBACK.
    client.batch_execute("BEGIN").await.unwrap();
    let failing = client
        .query_raw("SELECT 1 / (k - 90000) FROM numbers", Vec::<i64>::new())
        .await;
    let error = match failing {
        Err(error) => error,
        Ok(rows) => {
            futures::pin_mut!(rows);
            let mut received = 0;
            loop {
                match rows.next().await {
                    Some(Ok(_)) => received += 1,
                    Some(Err(error)) => {
                        eprintln!("{received} rows arrived before the error");
                        break error;
                    }
                    None => panic!("a division by zero answered {received} rows"),
                }
            }
        }
    };
    assert_eq!(error.code(), Some(&SqlState::DIVISION_BY_ZERO), "{error:?}");
    let refused = client.query_one("SELECT 1", &[]).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(&SqlState::IN_FAILED_SQL_TRANSACTION),
        "{refused}"
    );
    client.batch_execute("ROLLBACK").await.unwrap();
    // The same error met by a channel on another node, in an answer kept whole, keeps its
    // SQLSTATE across the network: it is the statement's fault, not a node's (40001).
    let error = client
        .query_one("SELECT sum(1 / (k - 90000)) FROM numbers", &[])
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some(&SqlState::DIVISION_BY_ZERO), "{error:?}");

    // Twenty million rows (about 300 MiB as Arrow): more than every buffer between the
    // nodes and the client (exchange inboxes, the answer's queue, the sockets) together.
    const LARGE: &str = "SELECT a.k, b.k FROM numbers a, numbers b WHERE b.k <= 200";
    let cancel = client.cancel_token();
    let rows = client
        .query_raw(LARGE, Vec::<i64>::new())
        .await
        .expect("the first rows arrive");
    futures::pin_mut!(rows);
    rows.next().await.expect("a first row").unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let running = metric(&cluster, 1, "tessera_queries_running").await;
    assert!(
        running >= Some(1.0),
        "the query still runs while its client has read only its first rows: {running:?}"
    );
    cancel.cancel_query(NoTls).await.unwrap();
    let ended = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while let Some(row) = rows.next().await {
            if let Err(error) = row {
                return error;
            }
        }
        panic!("a cancelled answer ran to its end");
    })
    .await
    .expect("the cancel ended the answer");
    assert_eq!(ended.code(), Some(&SqlState::QUERY_CANCELED), "{ended}");
    wait_no_query_running(&cluster).await;
    let n: i64 = connect(&cluster, 1)
        .await
        .query_one("SELECT count(*) FROM numbers", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 100000, "the node serves on");

    // A node lost just before a streamed answer (the cluster still counts it alive, so
    // the plan places work on it): lineage recovery carries the answer through, and its
    // notice, known only once the answer has ended, follows the rows in psql's output.
    let mut cluster = cluster;
    cluster.kill9(3);
    let (rows, stderr) = psql(
        &cluster,
        1,
        &[
            "-c",
            "SET tessera.answer_buffer = '1'",
            "-c",
            "SELECT k FROM numbers ORDER BY k",
        ],
    )
    .expect("the streamed answer survives the lost node");
    let keys: Vec<i64> = rows
        .iter()
        .map(|row| row[0].as_deref().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        keys,
        (1..=100_000).collect::<Vec<i64>>(),
        "every row once, in order"
    );
    assert!(
        stderr.contains("NOTICE") && stderr.contains("node 3 died"),
        "psql shows the recovery notice of the streamed answer: {stderr:?}"
    );
}
