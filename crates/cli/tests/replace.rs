//! A node whose disk is wiped (a replaced disk, a lost volume) on a real 3-node cluster
//! (r = 3, three Raft voters). The wiped node is node 1, the lowest voter, which founded
//! the metadata group:
//!
//! - while it is down, more rows are published (acknowledged: they must not be lost);
//! - started on its empty data directory it refuses to start, naming the lost data and
//!   `--replace`, instead of answering without its rows (before this check it answered
//!   counts short by a third, and the metadata leader's Raft core panicked);
//! - started with `--replace` it rejoins empty: its partitions are copied to it whole,
//!   every row (those published while it was down included) is there through every node;
//! - wiped again and killed while its replacement was under way, it finishes the
//!   replacement when started without the flag;
//! - it votes again: with node 2 then SIGKILLed, nodes 1 and 3 still take a publish.
//!
//! And a membership change a crashed leader left in its joint configuration is finished.

mod common;

use common::{wait_formed, wait_until};
use std::path::Path;
use std::time::Duration;
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

async fn count(client: &ClusterClient) -> Result<i64, String> {
    let batches = client
        .query("SELECT count(*) AS n, sum(v) AS s FROM kv")
        .await
        .map_err(|e| e.to_string())?;
    let n = batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .unwrap()
        .value(0);
    Ok(n)
}

async fn insert(client: &ClusterClient, from: i64, to: i64) {
    let sql = format!("INSERT INTO kv SELECT value, value * 2 FROM generate_series({from}, {to})");
    client
        .sql(&sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A cluster of `nodes` processes (8 partitions, `replication` replicas each, nodes 1-3
/// the metadata voters, failures declared after 1.5 s, and `options`) with table `kv`; a
/// client of node `through`.
async fn kv_cluster(
    root: &Path,
    nodes: usize,
    replication: u32,
    through: u64,
    options: &[(&str, &str)],
) -> (LocalCluster, ClusterClient) {
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root, nodes, 8, replication);
    cluster.set_option("failure.timeout_ms", "1500");
    for (key, value) in options {
        cluster.set_option(key, value);
    }
    cluster.log_to_files();
    cluster.start_all();
    wait_formed(&cluster, 1, nodes).await;
    let client = ClusterClient::new(cluster.addr(through));
    client
        .sql("CREATE TABLE kv (k BIGINT PRIMARY KEY, v BIGINT)")
        .await
        .unwrap();
    (cluster, client)
}

/// Waits until the metadata, as `client`'s node sees it, counts node `id` failed.
async fn declared_failed(client: &ClusterClient, id: u64) {
    wait_until(
        &format!("node {id} declared failed"),
        Duration::from_secs(30),
        || async {
            let status = client.status().await.ok()?;
            status
                .meta
                .nodes
                .values()
                .any(|n| n.id.0 == id && !n.alive)
                .then_some(())
        },
    )
    .await;
}

/// SIGKILLs voter `killed`; node 3 then still takes a publish (the other two voters are a
/// majority), after which it counts `rows`; and no node panicked.
async fn still_publishes_without(cluster: &mut LocalCluster, killed: u64, rows: i64) {
    cluster.kill9(killed);
    let three = ClusterClient::new(cluster.addr(3));
    wait_until(
        &format!("a publish without node {killed}"),
        Duration::from_secs(60),
        || async {
            three
                .sql("INSERT INTO kv VALUES (5000, 1)")
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    assert_eq!(count(&three).await.unwrap(), rows);
    assert!(
        cluster.panics_logged().is_empty(),
        "{:?}",
        cluster.panics_logged()
    );
}

/// Waits (up to a minute) for node `id` to exit with a failure; its log. Panics, saying
/// that it `still_running` and showing its log, if it does not.
async fn refused_to_start(cluster: &mut LocalCluster, id: u64, still_running: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = cluster.exit_status(id) {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node {id} {still_running}: {}",
            std::fs::read_to_string(cluster.log_path(id)).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success(), "node {id} exited successfully");
    std::fs::read_to_string(cluster.log_path(id)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_refuses_to_start_and_rejoins_empty_with_replace() {
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = kv_cluster(root.path(), 3, 3, 2, &[]).await;
    insert(&client, 1, 3000).await;
    for id in 1..=3 {
        ClusterClient::new(cluster.addr(id)).flush().await.unwrap();
    }

    // Node 1 dies; rows are published without it; its data directory is wiped.
    cluster.kill9(1);
    let killed = std::time::Instant::now();
    declared_failed(&client, 1).await;
    insert(&client, 3001, 4000).await;
    std::fs::remove_dir_all(root.path().join("node-1/data")).unwrap();
    // The leader retried node 1 several times a second meanwhile, and openraft logs every
    // failed try: each distinct line is written once per 30 s (`logging.rs`).
    if killed.elapsed() < Duration::from_secs(25) {
        for id in 2..=3 {
            let log = std::fs::read_to_string(cluster.log_path(id)).unwrap();
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("RPCError") && l.contains("node 1 at"))
                .map(|l| l.split_once(' ').map_or(l, |(_timestamp, rest)| rest))
                .collect();
            let distinct: std::collections::HashSet<&&str> = lines.iter().collect();
            assert_eq!(
                lines.len(),
                distinct.len(),
                "node {id} repeated openraft's errors about node 1:\n{}",
                lines.join("\n")
            );
        }
    }

    // Without --replace it refuses, and says why.
    cluster.start(1);
    let log = refused_to_start(&mut cluster, 1, "still runs on its wiped data directory").await;
    assert!(
        log.contains("its data is gone") && log.contains("--replace"),
        "{log}"
    );
    assert_eq!(
        count(&client).await.unwrap(),
        4000,
        "the others answer in full"
    );

    // With --replace it rejoins empty and gets every row back.
    cluster.start_with_args(1, &["--replace"]);
    wait_until(
        "node 1 back, its partitions copied whole",
        Duration::from_secs(120),
        || async {
            let status = client.status().await.ok()?;
            let back = status.meta.nodes.values().any(|n| n.id.0 == 1 && n.alive);
            let stale = status
                .meta
                .map
                .partitions
                .iter()
                .any(|p| !p.stale.is_empty());
            (back && !stale).then_some(())
        },
    )
    .await;
    let one = ClusterClient::new(cluster.addr(1));
    let copied = one.status().await.unwrap().transfers;
    assert!(
        copied.whole_copies > 0 && copied.delta_copies == 0,
        "{copied:?}"
    );
    // Its components came before the rebalance took every table's lease; nothing was
    // flushed since, so the leased copy fetched none (only the in-memory versions).
    assert!(
        copied.prefetched_components > 0 && copied.leased_components == 0,
        "components fetched under the lease: {copied:?}"
    );
    println!("node 1 copied back: {copied:?}");
    for id in 1..=3 {
        let via = ClusterClient::new(cluster.addr(id));
        assert_eq!(count(&via).await.unwrap(), 4000, "through node {id}");
    }
    // Every row is on node 1 itself: it holds a replica of every partition (r = 3).
    let rows_here: u64 = one
        .status()
        .await
        .unwrap()
        .tables
        .iter()
        .map(|t| t.rows)
        .sum();
    assert_eq!(rows_here, 4000, "node 1 holds every row again");

    // Wiped again, and killed while its --replace was under way (its data directory holds
    // the replacement's marker and nothing else): started plainly, it finishes the
    // replacement instead of refusing.
    cluster.kill9(1);
    declared_failed(&client, 1).await;
    insert(&client, 4001, 4500).await;
    let data = root.path().join("node-1/data");
    std::fs::remove_dir_all(&data).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("REPLACING"), b"").unwrap();
    cluster.start(1);
    wait_until("node 1 back again", Duration::from_secs(120), || async {
        let status = client.status().await.ok()?;
        let back = status.meta.nodes.values().any(|n| n.id.0 == 1 && n.alive);
        let stale = status
            .meta
            .map
            .partitions
            .iter()
            .any(|p| !p.stale.is_empty());
        (back && !stale).then_some(())
    })
    .await;
    assert!(
        !data.join("REPLACING").exists(),
        "the marker is gone once the node is back"
    );
    let rows_here: u64 = one
        .status()
        .await
        .unwrap()
        .tables
        .iter()
        .map(|t| t.rows)
        .sum();
    assert_eq!(rows_here, 4500, "node 1 holds every row again");

    // It votes again: without node 2, nodes 1 and 3 are a majority of the three voters.
    wait_until("node 1 a voter again", Duration::from_secs(60), || async {
        let status = client.status().await.ok()?;
        status
            .voters
            .contains(&tessera_common::NodeId(1))
            .then_some(())
    })
    .await;
    still_publishes_without(&mut cluster, 2, 4501).await;
}

/// A wiped node that was the only up-to-date replica of a partition is not taken back:
/// starting empty, it would have served that partition as current with none of its rows,
/// and the other replicas would have been copied from it. (The metadata refused the
/// replacement, but the refusal came back as a success; a long fault run lost every row
/// before one epoch of nine partitions that way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_holding_the_only_current_rows_is_not_taken_back() {
    let root = tempfile::tempdir().unwrap();
    // r = 2 on five nodes, nodes 1-3 the metadata voters: nodes 4 and 5 can both fail.
    // Publishes acknowledged with a single current copy (the cluster refuses them unless
    // told otherwise: see the next test) set up the hazard.
    let (mut cluster, client) =
        kv_cluster(root.path(), 5, 2, 1, &[("replicas.min_copies", "1")]).await;
    insert(&client, 1, 1000).await;
    let shared = partitions_on_4_and_5_only(&client).await;

    // Node 5 dies and misses a publish: node 4 alone holds every committed epoch of the
    // partitions they share. Then node 4 dies and its disk is wiped.
    cluster.kill9(5);
    declared_failed(&client, 5).await;
    insert(&client, 1001, 2000).await;
    cluster.kill9(4);
    declared_failed(&client, 4).await;
    std::fs::remove_dir_all(root.path().join("node-4/data")).unwrap();

    // With --replace it is refused and stops, naming why, rather than start empty.
    cluster.start_with_args(4, &["--replace"]);
    let log = refused_to_start(
        &mut cluster,
        4,
        "runs, taken back empty although it held the only current rows",
    )
    .await;
    assert!(
        log.contains("refused to take this node back") && log.contains("only up-to-date replica"),
        "{log}"
    );
    // The metadata still counts node 4's replicas as current: the rows are its disk's.
    let status = client.status().await.unwrap();
    for p in shared {
        assert!(
            !status.meta.map.partitions[p]
                .stale
                .contains_key(&tessera_server::NodeId(4)),
            "p{p}: the refused replacement changed nothing"
        );
    }
}

/// The partitions of an r = 2 cluster of five whose replicas are nodes 4 and 5 (some are).
async fn partitions_on_4_and_5_only(client: &ClusterClient) -> Vec<usize> {
    let status = client.status().await.unwrap();
    let shared: Vec<usize> = (status.meta.map.partitions.iter().enumerate())
        .filter(|(_, p)| {
            let mut replicas: Vec<u64> = p.replicas.iter().map(|r| r.0).collect();
            replicas.sort_unstable();
            replicas == [4, 5]
        })
        .map(|(i, _)| i)
        .collect();
    assert!(
        !shared.is_empty(),
        "some partition lives on nodes 4 and 5 only"
    );
    shared
}

/// The guard against the hazard above: by default (`replicas.min_copies = 2`) a publish is
/// acknowledged only once two replicas of every partition it touches hold every committed
/// epoch, so no single lost disk holds the only copy of an acknowledged row. With node 5
/// down, the partitions it shares with node 4 have one live replica: a publish touching
/// them is refused, naming the partition and the setting, and leaves no row; once node 5
/// is back the same publish is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_a_single_replica_would_hold_is_refused_until_a_second_returns() {
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = kv_cluster(root.path(), 5, 2, 1, &[]).await;
    insert(&client, 1, 1000).await;
    let shared = partitions_on_4_and_5_only(&client).await;

    cluster.kill9(5);
    declared_failed(&client, 5).await;
    let sql = "INSERT INTO kv SELECT value, value * 2 FROM generate_series(1001, 2000)";
    let refused = client
        .sql(sql)
        .await
        .expect_err("a publish acknowledged with one current copy of some partitions")
        .to_string();
    assert!(
        refused.contains("too few live replicas holding every committed epoch")
            && refused.contains("replicas.min_copies")
            && shared.iter().any(|p| refused.contains(&format!("p{p} "))),
        "the refusal names a partition on nodes 4 and 5 and the setting: {refused}"
    );
    assert_eq!(
        count(&client).await.unwrap(),
        1000,
        "the refused publish left no row"
    );

    cluster.start(5);
    wait_formed(&cluster, 1, 5).await;
    insert(&client, 1001, 2000).await;
    assert_eq!(count(&client).await.unwrap(), 2000);
    assert!(
        cluster.panics_logged().is_empty(),
        "{:?}",
        cluster.panics_logged()
    );
}

/// A leader that crashes between the two steps of a membership change leaves the joint
/// configuration in force: old and new voters must both agree, so losing one voter of the
/// smaller set stops every election for good (fault run 5301, second run). Here every
/// node's log ends as that crash leaves it: the joint entry that makes node 3 a voter again
/// ({1, 2} and {1, 2, 3}) written, the second step never proposed. On restart the new
/// leader finishes the change, and with node 1 then SIGKILLed, nodes 2 and 3 still elect
/// and publish (under the joint configuration, node 1 was needed in both halves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_membership_change_a_crashed_leader_left_joint_is_finished_by_the_next() {
    use openraft::{BasicNode, Entry, EntryPayload, LogId, Membership, RaftLogReader};
    use std::collections::{BTreeMap, BTreeSet};
    use tessera_common::NodeId;
    use tessera_server::meta::log_store::LogStore;

    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = kv_cluster(root.path(), 3, 3, 1, &[]).await;
    insert(&client, 1, 1000).await;
    // Every node's log holds the last entry before the crash.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for id in 1..=3 {
        cluster.kill9(id);
    }

    let mut logs = Vec::new();
    for id in 1..=3u64 {
        let mut log = LogStore::open(&root.path().join(format!("node-{id}/data/raft"))).unwrap();
        let entries = log.try_get_log_entries(0..).await.unwrap();
        logs.push((log, entries));
    }
    let last = |entries: &[Entry<tessera_server::meta::TypeConfig>]| {
        entries.last().expect("a formed cluster's log").log_id
    };
    let newest = logs.iter().map(|(_, e)| last(e)).max().unwrap();
    let nodes: BTreeMap<NodeId, BasicNode> = logs
        .iter()
        .flat_map(|(_, entries)| entries.iter().rev())
        .find_map(|e| match &e.payload {
            EntryPayload::Membership(m) => {
                Some(m.nodes().map(|(id, n)| (*id, n.clone())).collect())
            }
            _ => None,
        })
        .expect("the log holds the voters' membership");
    let joint = Membership::new(
        vec![
            BTreeSet::from([NodeId(1), NodeId(2)]),
            BTreeSet::from([NodeId(1), NodeId(2), NodeId(3)]),
        ],
        nodes,
    );
    let crashed_between_steps = Entry {
        log_id: LogId::new(newest.leader_id, newest.index + 1),
        payload: EntryPayload::Membership(joint),
    };
    let mut written = 0;
    for (log, entries) in &logs {
        if last(entries) == newest {
            log.append_offline(std::slice::from_ref(&crashed_between_steps))
                .unwrap();
            written += 1;
        }
    }
    assert!(written >= 2, "a majority of the logs end at the same entry");
    drop(logs);

    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    wait_until(
        "the joint membership finished",
        Duration::from_secs(60),
        || async {
            let status = client.status().await.ok()?;
            (!status.membership_joint && status.voters == vec![NodeId(1), NodeId(2), NodeId(3)])
                .then_some(())
        },
    )
    .await;
    let logged = (1..=3)
        .map(|id| std::fs::read_to_string(cluster.log_path(id)).unwrap_or_default())
        .collect::<String>();
    assert!(
        logged.contains(
            "finishing a membership change a former leader left in its joint configuration"
        ),
        "the restarted cluster was in the joint configuration, and its leader finished it"
    );

    still_publishes_without(&mut cluster, 1, 1001).await;
}
