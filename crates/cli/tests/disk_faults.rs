//! Disk faults under real node processes, injected by the file layer every durable write
//! goes through (`tessera_common::disk`, rules in `TESSERA_DISK_FAULTS`): an fsync that
//! fails (the node must stop acknowledging at once: fsyncgate), one that hangs (the node
//! stops itself rather than hold every publish it is a replica of), and a crash in the middle
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
    publish_batches_via(client, 1, first_key, count).await
}

/// [`publish_batches`] through `client`, which is node `coordinator`'s.
async fn publish_batches_via(
    client: &ClusterClient,
    coordinator: u64,
    first_key: i64,
    count: usize,
) -> Vec<Publish> {
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
        let ended = Instant::now();
        log.push(Publish {
            table: "kv",
            keys,
            outcome,
            error: result.as_ref().err().map(|e| e.to_string()),
            epoch: result.ok(),
            started,
            acknowledged: (outcome == Outcome::Acknowledged).then_some(ended),
            coordinator: coordinator as usize,
            ended,
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
    run_with_disk_fault_and(rule, &[]).await
}

/// [`run_with_disk_fault`] with node settings (`section.key`, value) on every node.
async fn run_with_disk_fault_and(
    rule: &str,
    options: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.log_to_files();
    cluster.set_node_env(FAULTY, tessera_common::disk::FAULTS_VAR, rule);
    let (mut cluster, client) = common::start_kv(cluster, options).await;

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

/// Node 2's disk stops answering: an fsync of its log hangs. The process still answers
/// heartbeats, so nothing would fail it over, and every publish it is a replica of would
/// wait on it (until the metadata aborts the epoch, minutes later, and the next one waits
/// again). Instead it stops itself once the fsync has hung for `failure.disk_stall_ms`, the
/// others fail it over and go on, and back on a healthy disk it holds every acknowledged
/// publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_log_fsync_stops_the_node_and_loses_no_acknowledged_publish() {
    let (status, log) = run_with_disk_fault_and(
        "fsync-stalls:.wal:after=12",
        &[("failure.disk_stall_ms", "5000")],
    )
    .await;
    assert_eq!(status.code(), Some(74), "exit status EX_IOERR; log:\n{log}");
    assert!(
        log.contains("injected disk fault: an fsync of") && log.contains("the disk stalled"),
        "the node says why it stopped; log:\n{log}"
    );
}

/// Node 2's disk stops answering, but it is configured to wait two minutes before it takes
/// that for a stalled disk and stops itself. Meanwhile it still answers heartbeats, so the
/// cluster counts it alive. Its primary forwards each publish's rows to it and gets no
/// progress. After `failure.progress_timeout_ms` (2 s here) the primary gives up on it: node 2
/// misses the epoch, is marked stale, and publishes go on without it. Without that deadline
/// every publish waits until node 2 stops itself, so nothing is acknowledged for two
/// minutes. Back on a healthy disk, node 2 catches up and holds every acknowledged publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_disk_hangs_misses_publishes_instead_of_holding_them() {
    let log = run_with_hung_disk(2, Via::Node(1), Voter::No).await;
    assert!(
        log.primary
            .contains("made no progress on a forwarded prepare"),
        "the primary says why it gave up on node 2"
    );
}

/// The same when the node whose disk hangs is the partition's primary (node 1), with
/// publishes coordinated by a compute node, which holds no copy and so sends the rows to
/// the primary to ship on: after twice `failure.progress_timeout_ms` without progress the
/// coordinator publishes again without node 1, through another current replica; node 1
/// misses the epoch, so it is no longer primary. Without that, every attempt goes to node 1
/// again (alive, so no new primary comes) and stalls in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_whose_disk_hangs_is_published_around() {
    let log = run_with_hung_disk(1, Via::ComputeNode, Voter::No).await;
    assert!(
        log.coordinator
            .contains("log shipping made no progress; publishing again without it"),
        "the coordinator says why it left node 1 out"
    );
}

/// The same when the node whose disk hangs is also the metadata leader (node 1, which
/// bootstraps the group). A leader applies each committed entry to its own store before it
/// answers the write, so every metadata write (every epoch allocation and commit) waits on
/// its hung log. It steps down once an fsync has hung for three election timeouts, and the
/// others elect a leader and go on; without that, nothing would be acknowledged until it
/// stopped itself (`failure.disk_stall_ms`, two minutes here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_leader_whose_disk_hangs_steps_down() {
    let log = run_with_hung_disk(1, Via::Node(2), Voter::Leader).await;
    assert!(
        log.primary
            .contains("stepping down so that metadata writes go on at another"),
        "node 1 says why it stepped down"
    );
}

/// The node [`run_with_hung_disk`]'s publishes go through.
enum Via {
    /// One of the three storage nodes.
    Node(u64),
    /// A compute node added for it, which holds no copy of anything.
    ComputeNode,
}

/// Whether [`run_with_hung_disk`]'s faulty node is a metadata voter.
#[derive(PartialEq)]
enum Voter {
    /// It is not, so never the metadata leader.
    No,
    /// It is, and leads when its disk hangs.
    Leader,
}

/// The logs of [`run_with_hung_disk`]'s nodes of interest.
struct HungDiskLogs {
    /// The partition's primary as the run began.
    primary: String,
    /// The node the publishes went through.
    coordinator: String,
}

/// On a 3-node cluster with one partition (so its primary is known: node 1, its first
/// replica), makes `faulty`'s log fsyncs hang after a few publishes, publishes 100 batches
/// through node `via`, and checks that publishes went on (no wait for an acknowledgement
/// past 10 s) with `faulty` still running and marked stale. Then brings `faulty` back on a
/// healthy disk and checks every replica.
///
/// With `Voter::No`, `faulty` is no metadata voter, so never the metadata leader; with
/// `Voter::Leader` it is checked to lead before the publishes begin.
async fn run_with_hung_disk(faulty: u64, via: Via, voter: Voter) -> HungDiskLogs {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 1, 3);
    let via = match via {
        Via::Node(id) => id,
        Via::ComputeNode => cluster.add_compute_node(),
    };
    let voters: Vec<u64> = (1..=3)
        .filter(|&id| id != faulty || voter == Voter::Leader)
        .collect();
    cluster.set_voters(&voters);
    cluster.log_to_files();
    cluster.set_node_env(
        faulty,
        tessera_common::disk::FAULTS_VAR,
        "fsync-stalls:.wal:after=12",
    );
    let options = [
        ("failure.disk_stall_ms", "120000"),
        ("failure.progress_timeout_ms", "2000"),
    ];
    let (mut cluster, _) = common::start_kv(cluster, &options).await;
    let client = ClusterClient::new(cluster.addr(via));
    let partition = |meta: &tessera_server::meta::MetaState| meta.map.partitions[0].clone();
    let primary = partition(&client.current_metadata().await.unwrap()).primary;
    assert_eq!(
        primary,
        Some(tessera_common::NodeId(1)),
        "the first replica leads"
    );
    if voter == Voter::Leader {
        let leader = client.status().await.unwrap().leader;
        assert_eq!(
            leader,
            Some(tessera_common::NodeId(faulty)),
            "the test needs node {faulty} to lead the metadata group"
        );
    }

    // About ten seconds of publishes, most after the disk hangs: several rebalances try to
    // catch the faulty node up meanwhile, each given up when its copy stalls.
    let publishes = publish_batches_via(&client, via, 0, 100).await;
    let mut acknowledged: Vec<Instant> = publishes.iter().filter_map(|p| p.acknowledged).collect();
    acknowledged.insert(0, publishes[0].started);
    let longest_wait = acknowledged
        .windows(2)
        .map(|pair| pair[1] - pair[0])
        .max()
        .unwrap();
    assert!(
        longest_wait < Duration::from_secs(10),
        "no publish was acknowledged for {longest_wait:?} while node {faulty}'s disk hung"
    );
    assert_eq!(
        cluster.exit_status(faulty),
        None,
        "node {faulty} stopped itself: its disk stall, not the progress deadline, let publishes go on"
    );
    let placement = partition(&client.current_metadata().await.unwrap());
    assert!(
        placement
            .stale
            .contains_key(&tessera_common::NodeId(faulty)),
        "node {faulty} is marked as having missed epochs: {placement:?}"
    );
    let read_log = |id: u64| std::fs::read_to_string(cluster.log_path(id)).unwrap();
    let logs = HungDiskLogs {
        primary: read_log(primary.unwrap().0),
        coordinator: read_log(via),
    };

    // Back on a healthy disk, it catches up.
    cluster.clear_node_env(faulty);
    cluster.kill9(faulty);
    cluster.start(faulty);
    let status = history::wait_recovered(&cluster, via, &publishes, Duration::from_secs(120)).await;
    let report = history::check_replicas(&cluster, &status, &["kv"], &publishes).await;
    assert!(report.by_outcome[&Outcome::Acknowledged] >= 100);
    assert!(cluster.panics_logged().is_empty());
    logs
}

/// Node 2 is paused (SIGSTOP, as a stopped VM or a long stall freezes a process) for
/// longer than `failure.disk_stall_ms`, several times, while publishes keep its log's
/// fsyncs busy (each one slowed to 200 ms, so the pause lands inside one). The time it
/// was frozen is not the disk's: once resumed, it must neither take the fsync it was in
/// for a stalled disk nor stop itself, and every acknowledged publish is on every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_does_not_take_its_own_pause_for_a_stalled_disk() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.log_to_files();
    cluster.set_node_env(
        FAULTY,
        tessera_common::disk::FAULTS_VAR,
        "fsync-slow:.wal:ms=200",
    );
    let (cluster, client) = common::start_kv(cluster, &[("failure.disk_stall_ms", "1500")]).await;
    let mut cluster = cluster;
    let mut publishes = publish_batches(&client, 0, 3).await;
    for round in 0..4 {
        let publishing = {
            let client = ClusterClient::new(cluster.addr(1));
            let first_key = 1_000_000 * (round + 1);
            tokio::spawn(async move { publish_batches(&client, first_key, 3).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        cluster.pause(FAULTY);
        tokio::time::sleep(Duration::from_secs(3)).await;
        cluster.resume(FAULTY);
        publishes.extend(publishing.await.unwrap());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let log = std::fs::read_to_string(cluster.log_path(FAULTY)).unwrap_or_default();
        assert_eq!(
            cluster.exit_status(FAULTY),
            None,
            "node {FAULTY} stopped itself after pause {round}; log:\n{log}"
        );
    }
    let log = std::fs::read_to_string(cluster.log_path(FAULTY)).unwrap_or_default();
    assert!(
        log.contains("this process was frozen"),
        "the node noticed its pauses; log:\n{log}"
    );
    assert!(!log.contains("the disk stalled"), "log:\n{log}");
    let status = history::wait_recovered(&cluster, 1, &publishes, Duration::from_secs(120)).await;
    history::check_replicas(&cluster, &status, &["kv"], &publishes).await;
    assert!(cluster.panics_logged().is_empty());
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

/// Every component file under `dir`, recursively.
fn component_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(component_files(&path));
        } else if path.extension().is_some_and(|e| e == "parquet") {
            found.push(path);
        }
    }
    found
}

/// True if the file's bytes hash to the name it bears.
fn intact(path: &Path) -> bool {
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    let bytes = std::fs::read(path).unwrap_or_default();
    tessera_common::ComponentHash::of_bytes(&bytes).to_hex() == name
}

/// Bit rot at rest and a lost file: while node 3 is down, a byte of every one of its
/// components is flipped and one component is deleted. Back up, it answers a query over
/// every partition exactly, and every read of its own replicas either answers or names the
/// damaged component: a component that another replica also holds (the same bytes, by
/// hash) is fetched from it, checked, and written back; one that only node 3 holds (its
/// replicas flushed the same rows into other components) is read from the other replicas
/// instead, so the query still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_and_missing_components_are_fetched_from_a_replica_by_hash() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.log_to_files();
    let (mut cluster, client) = common::start_kv(cluster, &[]).await;
    let publishes = publish_batches(&client, 0, 6).await;
    common::flush_everywhere(&cluster).await;

    const DAMAGED: u64 = 3;
    // Standbys pull a primary's flushed components after it announces them, in the
    // background: wait until node 3 holds some that another replica holds too.
    let shares = |elsewhere: &std::collections::BTreeSet<std::ffi::OsString>| {
        component_files(&root.path().join(format!("node-{DAMAGED}")))
            .iter()
            .filter(|f| elsewhere.contains(f.file_name().unwrap()))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let elsewhere = loop {
        let elsewhere: std::collections::BTreeSet<std::ffi::OsString> = [1, 2]
            .iter()
            .flat_map(|id| component_files(&root.path().join(format!("node-{id}"))))
            .filter_map(|f| f.file_name().map(|n| n.to_os_string()))
            .collect();
        if shares(&elsewhere) >= 2 || Instant::now() > deadline {
            break elsewhere;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    cluster.kill9(DAMAGED);
    let mut files = component_files(&root.path().join(format!("node-{DAMAGED}")));
    // Damage shared components first, so the deleted one is shared (repairable) too.
    files.sort_by_key(|f| !elsewhere.contains(f.file_name().unwrap()));
    let shared: Vec<_> = files
        .iter()
        .filter(|f| elsewhere.contains(f.file_name().unwrap()))
        .cloned()
        .collect();
    assert!(
        shared.len() >= 2,
        "node {DAMAGED} shares components with the others: {files:?}"
    );
    for file in &files[1..] {
        let mut bytes = std::fs::read(file).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x10;
        std::fs::write(file, bytes).unwrap();
    }
    std::fs::remove_file(&files[0]).unwrap();
    cluster.start(DAMAGED);
    let through = ClusterClient::new(cluster.addr(DAMAGED));
    let deadline = Instant::now() + Duration::from_secs(30);
    while through.status().await.is_err() {
        if Instant::now() > deadline || cluster.exit_status(DAMAGED).is_some() {
            let log = std::fs::read_to_string(cluster.log_path(DAMAGED)).unwrap_or_default();
            panic!("node {DAMAGED} did not come back with damaged components; log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = history::wait_recovered(&cluster, 1, &publishes, Duration::from_secs(60)).await;

    let rows: i64 = publishes
        .iter()
        .filter(|p| p.outcome == Outcome::Acknowledged)
        .map(|p| p.keys.end - p.keys.start)
        .sum();
    let sql = "SELECT count(*) AS n, sum(v) AS s FROM kv";
    for via in [DAMAGED, 1] {
        let batches = tokio::time::timeout(
            history::CALL_TIMEOUT,
            ClusterClient::new(cluster.addr(via)).query(sql),
        )
        .await
        .expect("an answer in time")
        .unwrap_or_else(|e| panic!("a query through node {via} failed: {e}"));
        let count = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>()
            .unwrap()
            .value(0);
        assert_eq!(count, rows, "every acknowledged row, through node {via}");
    }
    // Node 3's own replicas: each answers, or names the component no replica could supply.
    for p in 0..8 {
        let read = through
            .read_replica(
                cluster.cluster_id(),
                "kv",
                tessera_common::PartitionId(p),
                status.meta.visible,
            )
            .await;
        if let Err(e) = read {
            assert!(
                e.to_string()
                    .contains("no other replica supplied a good copy"),
                "partition {p} on node {DAMAGED}: {e}"
            );
        }
    }
    // Reads repair what they use; a damaged file no manifest uses any more (replaced by a
    // later flush) is left to the collector.
    let repaired = shared.iter().filter(|f| intact(f)).count();
    assert!(
        repaired > 0,
        "no component that another replica holds was repaired on node {DAMAGED}"
    );
    let log = std::fs::read_to_string(cluster.log_path(DAMAGED)).unwrap();
    assert!(
        log.contains("replaced a damaged component with a replica's copy"),
        "the repair is logged"
    );
}

/// Every fsync of node `slow`'s write-ahead log takes 2.5 s, longer than the publish's
/// progress deadlines (1 s for a forward, 2 s for the head), on a cluster of `nodes` nodes
/// with one partition on all of them, where a publish needs every replica (one node, or
/// `replicas.min_copies` = 2 on two). Leaving the slow node out would only leave too few
/// replicas, so the publish waits for it instead (saying so in the log) and is acknowledged,
/// and the node is not marked as having missed the epoch. Without that, the slow node is
/// given up and the publish refused, as a one-node SF 10 load was when write-back held its
/// disk for 30 s.
async fn a_slow_last_copy_is_waited_for(nodes: usize, slow: u64) {
    let root = tempfile::tempdir().unwrap();
    let mut cluster =
        LocalCluster::configure(Path::new(BINARY), root.path(), nodes, 1, nodes as u32);
    cluster.log_to_files();
    cluster.set_node_env(
        slow,
        tessera_common::disk::FAULTS_VAR,
        "fsync-slow:.wal:ms=2500",
    );
    let options = [
        ("failure.disk_stall_ms", "60000"),
        ("failure.progress_timeout_ms", "1000"),
    ];
    let (cluster, client) = common::start_kv(cluster, &options).await;
    for round in 0..2 {
        let keys = round * 100..round * 100 + 100;
        let published = tokio::time::timeout(
            Duration::from_secs(60),
            client.publish("kv", vec![kv_batch(keys.start, keys.end)], false),
        )
        .await
        .expect("the publish ended within a minute");
        published.unwrap_or_else(|e| panic!("publish {round} refused: {e}"));
    }
    let batches = client.query("SELECT count(*) FROM kv").await.unwrap();
    let count = batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .expect("count is BIGINT")
        .value(0);
    assert_eq!(count, 200, "both publishes' rows are there");
    let placement = client.current_metadata().await.unwrap().map.partitions[0].clone();
    assert!(
        placement.stale.is_empty(),
        "no replica missed an epoch: {placement:?}"
    );
    let log = std::fs::read_to_string(cluster.log_path(1)).unwrap();
    assert!(
        log.contains("a node the publish cannot go without"),
        "node 1 says why it waits on node {slow}"
    );
    assert!(!log.contains("giving up on it"), "log:\n{log}");
    // A log written to a file is plain text: colours are for a terminal.
    assert!(
        !log.contains('\u{1b}'),
        "node 1's log file holds terminal escape codes"
    );
    assert!(cluster.panics_logged().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_node_cluster_waits_for_its_own_slow_disk() {
    a_slow_last_copy_is_waited_for(1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_waits_for_a_slow_replica_it_cannot_publish_without() {
    a_slow_last_copy_is_waited_for(2, 2).await;
}
