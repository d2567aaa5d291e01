//! Faults beyond SIGKILL on a healthy network: paused nodes (a long GC pause, a stopped VM)
//! for now; partitions, degraded links and disk faults join them here.

mod common;

use arrow::array::Int64Array;
use common::{wait_formed, wait_until};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::ClusterClient;
use tessera_testkit::{kv_batch, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

async fn count(client: &ClusterClient) -> Result<i64, String> {
    let batches = client
        .query("SELECT count(*) AS n FROM kv")
        .await
        .map_err(|e| e.to_string())?;
    Ok(batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("count is BIGINT")
        .value(0))
}

/// A node that cannot reach a majority cannot prove it has seen every acknowledged epoch:
/// it refuses a query, within a deadline, instead of answering from its own view. Once the
/// majority is back, the same node answers with every acknowledged row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_the_majority_refuses_reads_instead_of_answering_stale() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let lone = ClusterClient::new(cluster.addr(3));
    lone.sql("CREATE TABLE kv (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
        .await
        .unwrap();
    lone.publish("kv", vec![kv_batch(0, 100)], false)
        .await
        .unwrap();
    assert_eq!(count(&lone).await, Ok(100));

    cluster.pause(1);
    cluster.pause(2);
    let asked = Instant::now();
    let refused = count(&lone)
        .await
        .expect_err("a node cut off from the majority answered from its own view");
    let waited = asked.elapsed();
    assert!(
        refused.contains("node 3 cannot prove its metadata is current"),
        "the refusal names the node and why: {refused}"
    );
    assert!(
        waited < Duration::from_secs(30),
        "the read waited {waited:?}: it must have a deadline"
    );

    cluster.resume(1);
    cluster.resume(2);
    let answered = wait_until(
        "node 3 to answer again once the majority is back",
        Duration::from_secs(60),
        || async { count(&lone).await.ok() },
    )
    .await;
    assert_eq!(answered, 100, "every acknowledged row, after the pause");
}
