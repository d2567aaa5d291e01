//! Where replicas live as the cluster changes: a joining node takes its share, a lost one
//! is re-replicated and takes its share back, failover and delta failback keep answers
//! exact, cold and hot standbys, and `tessera up` starting and stopping a local cluster.

use super::*;

async fn replicas_held_by(client: &ClusterClient, id: u64) -> usize {
    let status = client.status().await.unwrap();
    status
        .meta
        .map
        .partitions
        .iter()
        .filter(|p| p.replicas.contains(&NodeId(id)))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_takes_its_share_while_queries_stay_exact() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = kv_cluster(root.path(), 2).await;
    client
        .publish("kv", vec![kv_batch(0, 20_000)], false)
        .await
        .unwrap();
    client
        .sql("UPDATE kv SET v = v + 1 WHERE k < 100")
        .await
        .unwrap();
    let expected = (20_000, (0..20_000).map(|k| k * 10).sum::<i64>() + 100);
    let before = client.status().await.unwrap().meta.visible;

    let newcomer = cluster.add_node();
    cluster.start(newcomer);
    // Queries keep returning the exact answer while partitions move.
    let moved = wait_until(
        "the new node to hold partitions",
        Duration::from_secs(60),
        || async {
            assert_eq!(count_and_sum(&client).await, expected);
            (replicas_held_by(&client, newcomer).await > 0).then_some(())
        },
    )
    .await;
    let () = moved;
    let share = replicas_held_by(&client, newcomer).await;
    assert_eq!(
        share,
        PARTITIONS as usize * 2 / 4,
        "uniform share of 16 partitions x 2 replicas over 4 nodes"
    );
    for id in cluster.node_ids() {
        let node = ClusterClient::new(cluster.addr(id));
        assert_eq!(count_and_sum(&node).await, expected, "node {id}");
    }
    // Time travel still works across the move.
    let old = client
        .query(&format!(
            "SELECT sum(v) FROM kv AS OF EPOCH {}",
            before.0 - 1
        ))
        .await
        .unwrap();
    let old_sum = old[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap()
        .value(0);
    assert_eq!(old_sum, (0..20_000).map(|k| k * 10).sum::<i64>());
    // Publishes after the move reach the new replicas.
    let newcomer_client = ClusterClient::new(cluster.addr(newcomer));
    newcomer_client
        .publish("kv", vec![kv_batch(20_000, 21_000)], false)
        .await
        .unwrap();
    let expected = (
        21_000,
        expected.1 + (20_000..21_000).map(|k| k * 10).sum::<i64>(),
    );
    assert_eq!(count_and_sum(&client).await, expected);

    // Decommissioning moves its partitions back and retires it.
    newcomer_client.decommission(newcomer).await.unwrap();
    wait_until(
        "the node to be decommissioned",
        Duration::from_secs(60),
        || async {
            let status = client.status().await.ok()?;
            status.meta.nodes[&NodeId(newcomer)]
                .decommissioned
                .then_some(())
        },
    )
    .await;
    assert_eq!(replicas_held_by(&client, newcomer).await, 0);
    assert_eq!(count_and_sum(&client).await, expected);
    // A metadata voter cannot be decommissioned.
    let error = client.decommission(1).await.unwrap_err().to_string();
    assert!(error.contains("votes in the metadata group"), "{error}");
}

/// A run of four consecutive free loopback ports.
fn four_free_ports() -> u16 {
    for _ in 0..100 {
        let base = tessera_testkit::free_ports(1)[0];
        if base > u16::MAX - 4 {
            continue;
        }
        if (0..4).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok()) {
            return base;
        }
    }
    panic!("no four consecutive free ports");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_starts_a_local_cluster_and_stops_it_cleanly() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let base = four_free_ports();
    let data = root.path().join("data");
    let base_arg = base.to_string();
    let up = tessera_testkit::TesseraProcess::spawn(
        Path::new(BINARY),
        &data,
        &[
            "--partitions",
            "8",
            "up",
            "--nodes",
            "3",
            "--compute",
            "1",
            "--base-port",
            &base_arg,
        ],
    );
    let mut printed = Vec::new();
    while let Some(line) = up.next_line(Duration::from_secs(60)) {
        let done = line.contains("Ctrl-C stops the cluster");
        printed.push(line);
        if done {
            break;
        }
    }
    let text = printed.join("\n");
    assert!(text.contains("cluster of 4 nodes up"), "{text}");
    for i in 0..4 {
        assert!(
            text.contains(&format!("listening on 127.0.0.1:{}", base + i)),
            "{text}"
        );
    }
    assert!(
        text.contains(&format!("node 4 (compute): RPC 127.0.0.1:{}", base + 3)),
        "up lists its compute node: {text}"
    );
    // `up` made the cluster's certificates under its data directory; a client presents
    // the administrator's.
    let admin = tessera_common::tls::MutualTls::from_dir(&data.join("certs"), "admin").unwrap();
    let client = ClusterClient::with_tls(&format!("127.0.0.1:{}", base + 1), Some(&admin));
    client
        .sql("CREATE TABLE t (k INT PRIMARY KEY)")
        .await
        .unwrap();
    client.sql("INSERT INTO t VALUES (1), (2)").await.unwrap();
    let status = client.status().await.unwrap();
    assert_eq!(status.meta.live_nodes().count(), 4);
    assert_eq!(status.meta.partition_count, 8);
    // Node 4 joined as a compute node: a member that holds nothing.
    assert!(status.meta.nodes[&NodeId(4)].compute);
    assert!(status
        .meta
        .map
        .partitions
        .iter()
        .all(|p| p.replicas.len() == 3 && !p.replicas.contains(&NodeId(4))));
    // Ctrl-C stops every node.
    // SAFETY: kill(2) on the pid of a child we own and have not reaped.
    unsafe {
        libc::kill(up.pid() as libc::pid_t, libc::SIGINT);
    }
    let mut stopped = false;
    while let Some(line) = up.next_line(Duration::from_secs(30)) {
        if line.contains("cluster stopped") {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "up reports the cluster stopped");
    for i in 0..4 {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok(),
            "node {} released its port",
            i + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_is_rereplicated_and_takes_its_share_back_when_it_returns() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 4, PARTITIONS, 3);
    cluster.set_option("failure.rereplicate_after_ms", "3000");
    // Small memtables: the partitions are flushed to components, which the new replicas
    // then copy by hash.
    cluster.set_option("store.memtable_flush_bytes", "65536");
    cluster.start_all();
    wait_formed(&cluster, 1, 4).await;
    let client = ClusterClient::new(cluster.addr(1));
    client
        .sql("CREATE TABLE kv (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
        .await
        .unwrap();
    client
        .publish("kv", vec![kv_batch(0, 4_000)], false)
        .await
        .unwrap();
    let share = replicas_held_by(&client, 4).await;
    assert_eq!(share, 12, "node 4 holds a quarter of the 48 replicas");

    // Node 4 (not a voter) dies and misses a publish; after rereplicate_after_ms its
    // replicas are rebuilt on the other three nodes.
    cluster.kill9(4);
    wait_formed(&cluster, 1, 3).await;
    client
        .publish("kv", vec![kv_batch(4_000, 5_000)], false)
        .await
        .unwrap();
    let expected = (5_000, (0..5_000).map(|k| k * 10).sum::<i64>());
    wait_until(
        "three up-to-date copies without node 4",
        Duration::from_secs(30),
        || async {
            let status = client.status().await.ok()?;
            status
                .meta
                .map
                .partitions
                .iter()
                .all(|p| {
                    p.replicas.len() == 3 && !p.replicas.contains(&NodeId(4)) && p.stale.is_empty()
                })
                .then_some(())
        },
    )
    .await;
    for id in 1..=3 {
        let node = ClusterClient::new(cluster.addr(id));
        assert_eq!(count_and_sum(&node).await, expected, "node {id}");
        let held = node
            .status()
            .await
            .unwrap()
            .tables
            .iter()
            .find(|t| t.name == "kv")
            .map_or(0, |t| t.rows);
        assert_eq!(
            held, 5_000,
            "with three copies on three nodes, node {id} holds every row"
        );
    }

    // Node 4 returns and is given its share back, with every row.
    cluster.start(4);
    wait_until(
        "node 4 to hold its share again",
        Duration::from_secs(60),
        || async {
            let status = client.status().await.ok()?;
            let back = status.meta.nodes.get(&NodeId(4)).is_some_and(|n| n.alive)
                && status
                    .meta
                    .map
                    .partitions
                    .iter()
                    .all(|p| p.stale.is_empty())
                && status
                    .meta
                    .map
                    .partitions
                    .iter()
                    .filter(|p| p.replicas.contains(&NodeId(4)))
                    .count()
                    == 12;
            back.then_some(())
        },
    )
    .await;
    let returned = ClusterClient::new(cluster.addr(4));
    assert_eq!(count_and_sum(&returned).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_answers_stay_exact_through_failover_and_delta_failback() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 2);
    // With r = 2 a publish while a replica is down has one copy: the cluster refuses it
    // unless asked to acknowledge single copies, which this test of failback needs.
    cluster.set_option("replicas.min_copies", "1");
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let sf = 0.01;
    load_tpch(&cluster, sf).await;
    let oracle = tessera_tpch::oracle::oracle(sf).unwrap();
    assert_tpch_answers(&cluster, &[1], &oracle).await;

    // Node 3 dies: its partitions are served by their other replica (r = 2).
    cluster.kill9(3);
    wait_formed(&cluster, 1, 2).await;
    assert_tpch_answers(&cluster, &[1, 2], &oracle).await;
    // It misses an epoch: the orders rows published again (same keys, same values, so the
    // answers do not change), which leaves it stale on every partition it holds.
    let orders = tessera_tpch::table("orders").unwrap();
    let batches: Vec<RecordBatch> = orders
        .generate(sf, 64 * 1024)
        .collect::<Result<_, _>>()
        .unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    ClusterClient::new(cluster.addr(2))
        .publish("orders", batches, false)
        .await
        .unwrap();
    let client = ClusterClient::new(cluster.addr(1));
    let stale = client
        .status()
        .await
        .unwrap()
        .meta
        .map
        .partitions
        .iter()
        .filter(|p| p.stale.contains_key(&NodeId(3)))
        .count();
    assert!(stale > 0, "node 3 missed the epoch");

    // It returns, fetches the missed versions, and serves again: every answer is exact on
    // every node, and it holds the orders versions of both epochs, each once.
    cluster.start(3);
    wait_until("node 3 to catch up", Duration::from_secs(60), || async {
        let status = client.status().await.ok()?;
        let back = status.meta.nodes.get(&NodeId(3)).is_some_and(|n| n.alive)
            && status
                .meta
                .map
                .partitions
                .iter()
                .all(|p| p.stale.is_empty());
        back.then_some(())
    })
    .await;
    assert_tpch_answers(&cluster, &[1, 2, 3], &oracle).await;
    let returned = ClusterClient::new(cluster.addr(3));
    let status = returned.status().await.unwrap();
    let mut live_rows = 0;
    for (p, placement) in status.meta.map.partitions.iter().enumerate() {
        if placement.replicas.contains(&NodeId(3)) {
            let batches = returned
                .read_replica(
                    cluster.cluster_id(),
                    "orders",
                    tessera_common::PartitionId(p as u32),
                    status.meta.visible,
                )
                .await
                .unwrap();
            live_rows += batches.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        }
    }
    let versions = status
        .tables
        .iter()
        .find(|t| t.name == "orders")
        .map_or(0, |t| t.rows);
    assert!(live_rows > 0 && live_rows < rows as u64);
    assert_eq!(
        versions,
        2 * live_rows,
        "node 3 holds each orders row's two versions (both epochs) exactly once"
    );
    // And it got there by delta: it fetched only the missed epoch's versions (one per live
    // orders row it holds), not its partitions whole (both epochs, and every other table).
    let transfers = status.transfers;
    assert_eq!(
        transfers.whole_copies, 0,
        "a returning replica copies nothing whole: {transfers:?}"
    );
    assert!(transfers.delta_copies > 0, "{transfers:?}");
    assert_eq!(
        transfers.delta_versions, live_rows,
        "node 3 fetched exactly the versions of the epoch it missed: {transfers:?}"
    );
    // It fetched them before the rebalance took every table's lease: nothing was published
    // since, so the leased copy fetched no version, and publishes waited on nothing slow.
    assert_eq!(
        transfers.leased_delta_versions, 0,
        "versions fetched while every table's lease was held: {transfers:?}"
    );
    // Its deltas were installed in batches, each with one checkpoint of the whole store:
    // one per delta (every partition of every table, before the lease and again under it)
    // made most of a small failback's time.
    assert!(
        status.checkpoints_written < transfers.delta_copies,
        "node 3 wrote {} checkpoints since it restarted for {} deltas under the lease: {transfers:?}",
        status.checkpoints_written,
        transfers.delta_copies
    );
}

/// Rows node `id` holds of `kv`, and how many of them are in its log only.
async fn kv_rows_held(cluster: &LocalCluster, id: u64) -> (u64, u64) {
    let status = ClusterClient::new(cluster.addr(id)).status().await.unwrap();
    status
        .tables
        .iter()
        .find(|t| t.name == "kv")
        .map_or((0, 0), |t| (t.rows, t.logged_rows))
}

/// Publishes `batches` kv batches of `rows` consecutive keys, one epoch each, and waits
/// until every node holds every row (three copies on three nodes) and, as a standby that
/// logged them without applying them, has taken its primaries' components for most of
/// them. Returns how many rows were published.
async fn publish_until_shipped(
    cluster: &LocalCluster,
    client: &ClusterClient,
    batches: i64,
    rows: i64,
) -> u64 {
    for b in 0..batches {
        client
            .publish("kv", vec![kv_batch(b * rows, (b + 1) * rows)], false)
            .await
            .unwrap();
    }
    let total = (batches * rows) as u64;
    for id in 1..=3 {
        wait_until(
            "components shipped to the standbys",
            Duration::from_secs(60),
            || async {
                let (held, logged) = kv_rows_held(cluster, id).await;
                (held == total && logged < total / 2).then_some(())
            },
        )
        .await;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_standbys_take_their_primaries_components_and_replay_the_rest_when_promoted() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    // Checkpoints every 16 KiB of log (its rows zstd-compressed): primaries flush and ship
    // components often.
    let (mut cluster, client) =
        kv_cluster_with(root.path(), 3, &[("store.checkpoint_log_bytes", "16384")]).await;
    let total = publish_until_shipped(&cluster, &client, 20, 500).await;
    let expected = (total as i64, (0..total as i64).map(|k| k * 10).sum::<i64>());
    // Node 1 dies; its partitions' standbys are promoted and replay what their logs hold
    // beyond the shipped components. Every answer stays exact, and writes go on.
    cluster.kill9(1);
    wait_formed(&cluster, 2, 2).await;
    for id in 2..=3 {
        let survivor = ClusterClient::new(cluster.addr(id));
        assert_eq!(count_and_sum(&survivor).await, expected, "node {id}");
    }
    let survivor = ClusterClient::new(cluster.addr(2));
    survivor
        .publish(
            "kv",
            vec![kv_batch(total as i64, total as i64 + 500)],
            false,
        )
        .await
        .unwrap();
    let (n, s) = count_and_sum(&ClusterClient::new(cluster.addr(3))).await;
    assert_eq!(
        (n, s),
        (
            expected.0 + 500,
            expected.1
                + (total as i64..total as i64 + 500)
                    .map(|k| k * 10)
                    .sum::<i64>()
        )
    );
}

/// A cold standby checkpointing while publishes commit leaves the flushing to its primaries:
/// rows committed while they flushed for it are asked for again, not decoded and flushed
/// here too (which costs a standby what its primary pays once more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_checkpointing_while_publishes_commit_leaves_the_flushing_to_primaries() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 3);
    cluster.log_to_files();
    for id in 1..=3 {
        cluster.set_node_env(
            id,
            "TESSERA_LOG",
            "warn,tessera_storage::store::standby=info",
        );
    }
    // Checkpoints every 64 KiB of memtables: one begins on some node during nearly every
    // publish, and the next publish commits while it runs.
    let (cluster, client) =
        common::start_kv(cluster, &[("store.memtable_flush_bytes", "65536")]).await;
    let total = publish_until_shipped(&cluster, &client, 40, 2000).await;
    let checkpoints = checkpoints_written(&cluster).await;
    assert!(
        checkpoints.iter().all(|&c| c >= 5),
        "every node checkpointed during the publishes: {checkpoints:?}"
    );
    let applied_here: Vec<String> = (1..=3)
        .flat_map(|id| {
            std::fs::read_to_string(cluster.log_path(id))
                .unwrap()
                .lines()
                .filter(|line| {
                    // The replays, and why: a primary that did not flush or ship for it.
                    line.contains("replayed cold-standby rows from the log")
                        || line.contains("applying its logged rows here")
                        || line.contains("applying logged rows here")
                })
                .map(|line| format!("node {id}: {line}"))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        applied_here.is_empty(),
        "standbys applied rows their live primaries flush: {applied_here:#?}"
    );
    assert_eq!(
        count_and_sum(&client).await,
        (total as i64, (0..total as i64).map(|k| k * 10).sum::<i64>())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_standbys_apply_rows_as_they_commit() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) =
        kv_cluster_with(root.path(), 3, &[("replicas.hot_standby", "true")]).await;
    client
        .publish("kv", vec![kv_batch(0, 2000)], false)
        .await
        .unwrap();
    assert!(client.status().await.unwrap().meta.hot_standby);
    for id in 1..=3 {
        assert_eq!(
            kv_rows_held(&cluster, id).await,
            (2000, 0),
            "node {id} applied every row"
        );
    }
    cluster.kill9(3);
    wait_formed(&cluster, 1, 2).await;
    assert_eq!(
        count_and_sum(&client).await,
        (2000, (0..2000).map(|k| k * 10).sum::<i64>())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_stop_arriving_reach_components_everywhere_after_the_idle_wait() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    // The default thresholds (64 MiB of memtables, 256 MiB of log) are far away: only the
    // idle wait checkpoints these rows.
    let (cluster, client) =
        kv_cluster_with(root.path(), 3, &[("store.idle_checkpoint_ms", "1500")]).await;
    client
        .publish("kv", vec![kv_batch(0, 3000)], false)
        .await
        .unwrap();
    let before: Vec<u64> = checkpoints_written(&cluster).await;
    // Each primary flushes its rows to components and ships them; each cold standby swaps
    // them in for the rows it logged. No node keeps them in its log.
    for id in 1..=3 {
        wait_until(
            "the idle rows to reach components",
            Duration::from_secs(30),
            || async { (kv_rows_held(&cluster, id).await == (3000, 0)).then_some(()) },
        )
        .await;
    }
    let after = checkpoints_written(&cluster).await;
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "every node checkpointed: {before:?} then {after:?}"
    );
    assert_eq!(
        count_and_sum(&client).await,
        (3000, (0..3000).map(|k| k * 10).sum::<i64>())
    );
}

/// Each node's checkpoints written since it started.
async fn checkpoints_written(cluster: &LocalCluster) -> Vec<u64> {
    let mut written = Vec::new();
    for id in 1..=3 {
        let status = ClusterClient::new(cluster.addr(id)).status().await.unwrap();
        written.push(status.checkpoints_written);
    }
    written
}

/// A query planned under one placement whose scans read only after the partitions moved
/// (a node joined): the replicas its plan names no longer hold some of them, so the
/// scans read them where the metadata places them now, and the answer stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_planned_before_its_partitions_moved_reads_them_where_they_are_now() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    // Every scan on the first three nodes waits at this gate while it is closed (absent).
    let gate = root.path().join("scan-gate");
    let held = root.path().join("scan-gate.waiting");
    std::fs::write(&gate, b"").unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 2);
    for id in cluster.node_ids() {
        cluster.set_node_env(id, "TESSERA_TEST_SCAN_GATE", gate.to_str().unwrap());
    }
    let (mut cluster, client) = common::start_kv(cluster, &[]).await;
    client
        .publish("kv", vec![kv_batch(0, 20_000)], false)
        .await
        .unwrap();
    let expected = (20_000, (0..20_000).map(|k| k * 10).sum::<i64>());
    assert_eq!(count_and_sum(&client).await, expected);
    let placed_before = client.status().await.unwrap().meta.map.partitions;

    // Plan a query, and hold its scans before they read.
    std::fs::remove_file(&gate).unwrap();
    let query = tokio::spawn({
        let client = ClusterClient::new(cluster.addr(1));
        async move { count_and_sum(&client).await }
    });
    wait_until(
        "a scan to wait at the gate",
        Duration::from_secs(30),
        || async { held.exists().then_some(()) },
    )
    .await;

    // A fourth node joins and takes its share; the moves finish.
    let newcomer = cluster.add_node();
    cluster.start(newcomer);
    wait_until(
        "the new node's share to be copied",
        Duration::from_secs(60),
        || async {
            let map = client.status().await.ok()?.meta.map;
            let settled = map
                .partitions
                .iter()
                .all(|p| p.replicas.len() == 2 && p.stale.is_empty());
            let share = map
                .partitions
                .iter()
                .filter(|p| p.replicas.contains(&NodeId(newcomer)))
                .count();
            (settled && share == PARTITIONS as usize * 2 / 4).then_some(())
        },
    )
    .await;
    let placed_now = client.status().await.unwrap().meta.map.partitions;
    let left = placed_before
        .iter()
        .zip(&placed_now)
        .filter(|(before, now)| before.replicas.iter().any(|r| !now.replicas.contains(r)))
        .count();
    assert!(left > 0, "no partition left a replica it had when planned");

    // The held scans read now, where the partitions are.
    std::fs::write(&gate, b"").unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(60), query)
        .await
        .expect("the held query to finish")
        .expect("the query task");
    assert_eq!(answer, expected);
}
