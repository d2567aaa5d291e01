//! Disk faults under real node processes, injected by the file layer every durable write
//! goes through (`tessera_common::disk`, rules in `TESSERA_DISK_FAULTS`): an fsync that
//! fails (the node must stop acknowledging at once: fsyncgate), and a crash in the middle
//! of a write that also loses everything not yet fsynced (a power cut). In every case the
//! cluster goes on, the node comes back, and no acknowledged publish is lost.

mod common;

use common::history::{self, Outcome, Publish};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::{ClusterClient, ClusterError};
use tessera_testkit::{kv_batch, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const FAULTY: u64 = 2;

/// Publishes `count` batches of fresh kv keys through node 1 (each retried once it is
/// refused, under fresh keys), recording each attempt's outcome.
async fn publish_batches(client: &ClusterClient, first_key: i64, count: usize) -> Vec<Publish> {
    let mut log = Vec::new();
    let mut next = first_key;
    let mut acknowledged = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while acknowledged < count {
        assert!(
            Instant::now() < deadline,
            "publishes stopped being acknowledged"
        );
        let keys = next..next + 100;
        next += 100;
        let started = Instant::now();
        let result = tokio::time::timeout(
            history::CALL_TIMEOUT,
            client.publish("kv", vec![kv_batch(keys.start, keys.end)], false),
        )
        .await
        .unwrap_or_else(|_| {
            Err(ClusterError::AddressUnreachable {
                addr: "node 1".into(),
                reason: "timed out".into(),
            })
        });
        let outcome = history::classify(&result);
        if outcome == Outcome::Acknowledged {
            acknowledged += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        log.push(Publish {
            table: "kv",
            keys,
            outcome,
            epoch: result.ok(),
            started,
            acknowledged: (outcome == Outcome::Acknowledged).then(Instant::now),
        });
    }
    log
}

/// Waits until the faulty node's process has ended by itself; returns its exit status and log.
async fn wait_for_exit(cluster: &mut LocalCluster) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = cluster.exit_status(FAULTY) {
            let log = std::fs::read_to_string(cluster.log_path(FAULTY)).unwrap_or_default();
            return (status, log);
        }
        assert!(
            Instant::now() < deadline,
            "node {FAULTY} kept running after its disk fault"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts a 3-node cluster (r = 3) with node 2's disk failing as `rule` says, runs
/// publishes until node 2 has died of it, then brings node 2 back with a healthy disk and
/// checks every replica. Returns node 2's exit status and its whole log, the restart's
/// included.
async fn run_with_disk_fault(rule: &str) -> (std::process::ExitStatus, String) {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.log_to_files();
    cluster.set_node_env(FAULTY, tessera_common::disk::FAULTS_VAR, rule);
    let (mut cluster, client) = common::start_kv(cluster, &[]).await;

    let mut publishes = Vec::new();
    let mut died = None;
    while died.is_none() {
        let first_key = publishes.len() as i64 * 100;
        publishes.extend(publish_batches(&client, first_key, 5).await);
        died = cluster.exit_status(FAULTY).map(|_| ());
        if publishes.len() > 400 {
            break;
        }
    }
    let (status, _) = wait_for_exit(&mut cluster).await;
    // The others go on without it.
    let first_key = 1_000_000;
    publishes.extend(publish_batches(&client, first_key, 5).await);

    // Back with a healthy disk: it recovers from what is durable and catches up.
    cluster.clear_node_env(FAULTY);
    cluster.kill9(FAULTY);
    cluster.start(FAULTY);
    let status_after =
        history::wait_recovered(&cluster, 1, &publishes, Duration::from_secs(120)).await;
    let report = history::check_replicas(&cluster, &status_after, &["kv"], &publishes).await;
    assert!(report.by_outcome[&Outcome::Acknowledged] >= 10);
    let panics = cluster.panics_logged();
    assert!(panics.is_empty(), "panics: {panics:?}");
    let log = std::fs::read_to_string(cluster.log_path(FAULTY)).unwrap_or_default();
    (status, log)
}

/// An fsync of node 2's write-ahead log fails. The log is poisoned at once (a retried fsync
/// could claim success for pages the kernel dropped) and the node stops with a clear message
/// and the I/O-error exit status, instead of staying up as a replica that refuses every
/// prepare. The others fail it over and go on; back with a healthy disk, it recovers and
/// holds every acknowledged publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_log_fsync_stops_the_node_and_loses_no_acknowledged_publish() {
    let (status, log) = run_with_disk_fault("fsync-fails:.wal:after=12").await;
    assert_eq!(status.code(), Some(74), "exit status EX_IOERR; log:\n{log}");
    assert!(
        log.contains("its disk failed") && log.contains("injected disk fault: fsync"),
        "the node says why it stopped; log:\n{log}"
    );
}

/// The same for the metadata's Raft log: a failed fsync there stops the node too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_raft_log_fsync_stops_the_node_and_loses_no_acknowledged_publish() {
    let (status, log) = run_with_disk_fault("fsync-fails:raft-log:after=30").await;
    assert_eq!(status.code(), Some(74), "exit status EX_IOERR; log:\n{log}");
    assert!(
        log.contains("injected disk fault: fsync") && log.contains("raft-log"),
        "the node names the failed file; log:\n{log}"
    );
}

/// Node 2 crashes in the middle of a write to its log, and everything it had not fsynced is
/// lost (a power cut): its log ends in half a frame. On restart it cuts the torn tail,
/// recovers what is durable, and catches up; every acknowledged publish is on every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_write_that_loses_unsynced_data_loses_no_acknowledged_publish() {
    let (status, log) = run_with_disk_fault("crash:.wal:after=25:lose-unsynced").await;
    assert!(!status.success(), "it died");
    assert!(
        log.contains("injected disk fault: crash in the middle of"),
        "log:\n{log}"
    );
    assert!(
        log.contains("cutting torn tail off the write-ahead log"),
        "the restart found and cut the torn write; log:\n{log}"
    );
}
