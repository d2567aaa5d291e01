//! Faults beyond SIGKILL on a healthy network: paused nodes (a long GC pause, a stopped VM)
//! for now; partitions, degraded links and disk faults join them here.

mod common;

use arrow::array::Int64Array;
use common::{kv_cluster_with, wait_until};
use std::time::{Duration, Instant};
use tessera_server::ClusterClient;
use tessera_testkit::kv_batch;

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
    let (cluster, _) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    let lone = ClusterClient::new(cluster.addr(3));
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
    // The catalog a client acts on (the CLI's load and publish check it) is refused the
    // same way; the node's status, which says it is the node's own view, still answers.
    let catalog = match lone.current_metadata().await {
        Err(refusal) => refusal.to_string(),
        // Seen once under a loaded machine: say what node 3 believed, to find out why.
        Ok(state) => {
            let own = lone.status().await.ok();
            panic!(
                "a node cut off from the majority served its own catalog as current \
                 (visible epoch {}); its view: leader {:?}, term {:?}, voters {:?}, applied {:?}",
                state.visible,
                own.as_ref().map(|s| s.leader),
                own.as_ref().map(|s| s.term),
                own.as_ref().map(|s| s.voters.clone()),
                own.as_ref().map(|s| s.applied_index),
            )
        }
    };
    assert!(
        catalog.contains("node 3 cannot prove its metadata is current"),
        "the refusal names the node and why: {catalog}"
    );
    let own_view = lone
        .status()
        .await
        .expect("status answers from the node's own view");
    assert!(own_view.meta.tables.contains_key("kv"));

    cluster.resume(1);
    cluster.resume(2);
    let answered = wait_until(
        "node 3 to answer again once the majority is back",
        Duration::from_secs(60),
        || async { count(&lone).await.ok() },
    )
    .await;
    assert_eq!(answered, 100, "every acknowledged row, after the pause");
    let catalog = lone.current_metadata().await.expect("the majority is back");
    assert!(catalog.tables.contains_key("kv"));
}

/// A metadata leader whose followers are both paused can commit nothing. A metadata write
/// forwarded to it (as a node that is not the leader forwards its own) gets, within a
/// deadline, an error that says its entry did not commit, instead of the leader waiting
/// for ever on its own log; a statement through it is refused in time as well. Once the
/// followers are back, the statement succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_majority_refuses_writes_within_a_deadline() {
    use tessera_server::meta::wire::ACTION_META_WRITE;
    use tessera_server::meta::{MetaCommand, MetaResponse};
    use tessera_server::rpc::{Clients, Refusal, PROTOCOL_VERSION};

    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    let leader = wait_until("a leader", Duration::from_secs(30), || async {
        client.status().await.ok()?.leader
    })
    .await;
    let peer = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION);
    // What the leader's own failure detector writes; harmless to write again.
    let write = || {
        peer.action::<_, Result<MetaResponse, Refusal>>(
            cluster.addr(leader.0),
            ACTION_META_WRITE,
            MetaCommand::SetLiveness {
                id: leader,
                alive: true,
            },
            Duration::from_secs(60),
        )
    };
    assert!(matches!(write().await, Ok(Ok(_))), "the cluster is whole");

    let followers: Vec<u64> = cluster
        .node_ids()
        .into_iter()
        .filter(|&id| id != leader.0)
        .collect();
    followers.iter().for_each(|&id| cluster.pause(id));
    let asked = Instant::now();
    let refused = match write().await {
        Ok(Err(refusal)) => format!("{refusal:?}"),
        other => panic!("a leader without a majority must refuse the write, got {other:?}"),
    };
    let waited = asked.elapsed();
    eprintln!("the forwarded write was refused after {waited:?}: {refused}");
    assert!(
        refused.contains("committed no entry"),
        "the refusal says why: {refused}"
    );
    assert!(
        waited < Duration::from_secs(20),
        "the write waited {waited:?}: it must have a deadline"
    );
    let through_leader = ClusterClient::new(cluster.addr(leader.0));
    let create = "CREATE TABLE kv2 (k BIGINT PRIMARY KEY, v BIGINT)";
    let asked = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), through_leader.sql(create))
        .await
        .expect("a statement must give up by itself, well within a minute")
        .expect_err("a leader without a majority cannot create a table");
    assert!(asked.elapsed() < Duration::from_secs(40));

    followers.iter().for_each(|&id| cluster.resume(id));
    wait_until(
        "the table to be created once the majority is back",
        Duration::from_secs(60),
        || async {
            match through_leader.sql(create).await {
                Ok(_) => Some(()),
                Err(e) if e.to_string().contains("already exists") => Some(()),
                Err(_) => None,
            }
        },
    )
    .await;
}

/// A coordinator stalled mid-publish (paused, but not yet declared failed) must not hold its
/// tables' lease for ever: the metadata leader aborts an epoch left open past
/// `failure.open_epoch_timeout_ms`, other writers go on at once, and none of the stalled
/// publish's rows become visible, then or after the coordinator resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_left_open_by_a_stalled_coordinator_is_aborted_and_frees_its_tables() {
    let root = tempfile::tempdir().unwrap();
    // Detection is slow on purpose: only the open-epoch timeout can free the table soon.
    let slow_detection = [
        ("failure.timeout_ms", "60000"),
        ("failure.rereplicate_after_ms", "120000"),
        ("failure.open_epoch_timeout_ms", "3000"),
    ];
    let (cluster, writer) = kv_cluster_with(BINARY, root.path(), 8, 3, &slow_detection).await;
    writer
        .publish("kv", vec![kv_batch(0, 100)], false)
        .await
        .unwrap();

    let stalled = ClusterClient::new(cluster.addr(3));
    let stalled_publish = tokio::spawn(async move {
        let batches = (0..40)
            .map(|i| kv_batch(1_000 + i * 50_000, 1_000 + (i + 1) * 50_000))
            .collect();
        stalled.publish("kv", batches, false).await
    });
    // Pause it once its epoch is open (it holds the table's lease), mid-prepare. A publish's
    // rows are received whole before its epoch opens, so this waits for all 2 million of
    // them to arrive: on a loaded two-core machine (a debug build, another test's long
    // publish beside it) that took past 30 s in CI, so the wait is the other long test's.
    wait_until(
        "the stalled publish's epoch to open",
        Duration::from_secs(180),
        || async {
            let open = !writer.status().await.ok()?.meta.open.is_empty();
            (open || stalled_publish.is_finished()).then_some(())
        },
    )
    .await;
    cluster.pause(3);
    assert!(
        !stalled_publish.is_finished(),
        "the stalled publish ended before its epoch was seen open: {:?}",
        stalled_publish.await.unwrap().map(|e| e.0)
    );

    let asked = Instant::now();
    writer
        .publish("kv", vec![kv_batch(100, 200)], false)
        .await
        .expect("the table takes writes once the stalled epoch is aborted");
    let waited = asked.elapsed();
    assert!(
        waited < Duration::from_secs(20),
        "the next writer waited {waited:?}: the stalled epoch held the lease until its coordinator was declared failed"
    );
    assert_eq!(
        count(&writer).await,
        Ok(200),
        "none of the stalled publish's rows"
    );

    cluster.resume(3);
    let outcome = tokio::time::timeout(Duration::from_secs(60), stalled_publish)
        .await
        .expect("the stalled coordinator hears the outcome")
        .unwrap();
    // Its client's own connection may have timed out during the pause (then the client
    // cannot tell); what must never happen is an acknowledgement of the aborted epoch.
    let error = outcome.expect_err("an aborted epoch was acknowledged");
    eprintln!("the stalled publish ended with: {error}");
    assert_eq!(count(&writer).await, Ok(200), "still none of its rows");
}

/// An acknowledged publish is visible to every read that starts after the acknowledgement,
/// even while an earlier epoch of another table is still open (a long publish): the
/// visible epoch is a prefix of decided epochs, so a publish is acknowledged only once
/// every epoch below it is decided, not as soon as its own commit is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_is_acknowledged_only_once_it_is_visible() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, writer) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    writer
        .sql("CREATE TABLE other (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
        .await
        .unwrap();
    let long = ClusterClient::new(cluster.addr(3));
    let long_publish = tokio::spawn(async move {
        let batches = (0..80)
            .map(|i| kv_batch(i * 50_000, (i + 1) * 50_000))
            .collect();
        long.publish("other", batches, false).await
    });
    // Routing and shipping 4 million rows takes a while on a loaded machine.
    let open_before = wait_until(
        "the long publish's epoch to open",
        Duration::from_secs(180),
        || async {
            let open = writer.status().await.ok()?.meta.open;
            match open.keys().next() {
                Some(&first) => Some(Some(first)),
                None => long_publish.is_finished().then_some(None),
            }
        },
    )
    .await;
    assert!(
        !long_publish.is_finished(),
        "the long publish ended before its epoch was seen open: {:?}",
        long_publish.await.unwrap().map(|e| e.0)
    );
    let open_before = open_before.expect("an epoch was seen open");

    // Allocated after it, the next publish's epoch is above the open one: acknowledged only
    // once that one is decided (committed, or aborted should its node be declared failed
    // on a loaded machine, the publish then retried in a later epoch).
    let epoch = writer
        .publish("kv", vec![kv_batch(0, 100)], false)
        .await
        .expect("a publish to another table commits while the long one is open");
    // Straight after the acknowledgement, through a node that did not coordinate it.
    let reader = ClusterClient::new(cluster.addr(2));
    assert_eq!(
        count(&reader).await,
        Ok(100),
        "a read started after epoch {epoch} was acknowledged missed it"
    );
    let status = reader.status().await.unwrap();
    assert!(
        status.meta.visible >= epoch,
        "epoch {epoch} was acknowledged before it was visible"
    );
    assert!(
        !status.meta.open.contains_key(&open_before),
        "epoch {epoch} was acknowledged while epoch {open_before}, below it, was still open"
    );
    long_publish
        .await
        .unwrap()
        .expect("the long publish commits");
}

/// A coordinator still working on its epoch renews it with every heartbeat: a publish
/// that takes longer than the open-epoch timeout is acknowledged, not aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_longer_than_the_open_epoch_timeout_is_renewed_not_aborted() {
    let root = tempfile::tempdir().unwrap();
    let short_timeout = [("failure.open_epoch_timeout_ms", "1000")];
    let (cluster, _) = kv_cluster_with(BINARY, root.path(), 8, 3, &short_timeout).await;
    let coordinator = ClusterClient::new(cluster.addr(3));
    let batches = (0..40)
        .map(|i| kv_batch(i * 50_000, (i + 1) * 50_000))
        .collect();
    let started = Instant::now();
    coordinator
        .publish("kv", batches, false)
        .await
        .expect("a publish still being worked on is not aborted");
    let took = started.elapsed();
    assert!(
        took > Duration::from_millis(1500),
        "the publish took {took:?}, too short to outlast the 1 s timeout: the test proves nothing"
    );
    assert_eq!(count(&coordinator).await, Ok(2_000_000));
}

/// A publisher that goes away mid-publish (its process dies, its call is cancelled) ends
/// the call on the coordinating node, which is alive and well and no longer works on the
/// epoch. The metadata leader sees that in the coordinator's next heartbeat and aborts the
/// epoch at once, instead of holding the table's lease, and every later epoch's
/// visibility, until the open-epoch timeout (five minutes by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_its_live_coordinator_gives_up_is_aborted_at_once() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    let coordinator = ClusterClient::new(cluster.addr(3));
    // Two million rows: prepared on every replica for a second or more in a debug build.
    let batches = (0..40)
        .map(|i| kv_batch(i * 50_000, (i + 1) * 50_000))
        .collect();
    let publishing = tokio::spawn(async move { coordinator.publish("kv", batches, false).await });
    let open = wait_until(
        "the publish to open an epoch",
        Duration::from_secs(60),
        || async {
            let meta = client.current_metadata().await.ok()?;
            meta.open.keys().next().copied()
        },
    )
    .await;
    publishing.abort();
    let gone = Instant::now();
    let decided = wait_until(
        "the epoch its publisher left to be decided",
        Duration::from_secs(20),
        || async {
            let meta = client.current_metadata().await.ok()?;
            (!meta.open.contains_key(&open)).then_some(meta)
        },
    )
    .await;
    let waited = gone.elapsed();
    assert!(
        decided.is_aborted(open),
        "epoch {open} committed: the cancelled call went on, so the test proves nothing"
    );
    let reason = &decided.abort_reasons[&open];
    assert!(
        reason.contains("no longer working on it"),
        "the leader says why it aborted epoch {open}: {reason}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "epoch {open} was decided {waited:?} after its publisher went away"
    );
    // The lease is free: another node publishes to the table at once, and nothing of the
    // aborted epoch is seen.
    let other = ClusterClient::new(cluster.addr(2));
    other
        .publish("kv", vec![kv_batch(-10, 0)], false)
        .await
        .expect("a publish after the abort");
    assert_eq!(count(&other).await, Ok(10));
}

/// Bad input from peers: garbage on the RPC port, and a request for the spool of a query
/// that never ran there, get an error in bounded time, naming the problem, and the node
/// goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_naming_unknown_queries_and_garbage_get_clear_errors_in_time() {
    use futures::StreamExt;
    use std::io::Write;
    use tessera_server::rpc::{Clients, SpoolRequest, PROTOCOL_VERSION};

    let root = tempfile::tempdir().unwrap();
    let patience = [("exec.spool_start_timeout_ms", "1000")];
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &patience).await;
    client
        .publish("kv", vec![kv_batch(0, 10)], false)
        .await
        .unwrap();

    // Garbage where HTTP/2 is expected, then a connection cut mid-frame.
    for bytes in [
        &b"GET / HTTP/1.1\r\n\r\n\x00\xff garbage"[..],
        b"PRI * HTTP/2.0\r\n",
    ] {
        let mut stream = std::net::TcpStream::connect(cluster.addr(2)).unwrap();
        stream.write_all(bytes).unwrap();
    }

    let peer = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION);
    let unknown = SpoolRequest {
        query: tessera_common::QueryId(0xdead),
        exchange: tessera_common::StageId(1),
        channel: tessera_common::ChannelId(0),
        bucket: 0,
    };
    let asked = Instant::now();
    let ask = async {
        match peer.get(cluster.addr(2), &unknown).await {
            Err(error) => Err(error.to_string()),
            Ok(mut batches) => match batches.next().await {
                Some(Err(error)) => Err(error.to_string()),
                other => Ok(format!("{other:?}")),
            },
        }
    };
    let outcome = tokio::time::timeout(Duration::from_secs(20), ask)
        .await
        .expect("a request for an unknown query's spool got no answer in 20 s");
    let error = outcome.expect_err("a spool of a query that never ran here was served");
    assert!(
        error.contains("did not start on this node within"),
        "the error names the problem: {error}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "it has a deadline"
    );

    let other = ClusterClient::new(cluster.addr(2));
    assert_eq!(count(&other).await, Ok(10), "the node goes on serving");
}

/// Component shipping asks a partition's primary for its components and the epoch they
/// cover. A node that is not the primary (it lost the role while cut off, say, and may lack
/// committed epochs) refuses, naming the primary, instead of shipping what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_partitions_primary_ships_its_components() {
    use tessera_server::rpc::{Clients, Refusal, PROTOCOL_VERSION};
    use tessera_server::shipping::TablePartition;

    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    client
        .publish("kv", vec![kv_batch(0, 1000)], false)
        .await
        .unwrap();
    common::flush_everywhere(&cluster).await;
    let status = client.status().await.unwrap();
    let generation = status.meta.tables["kv"].generation;
    let placement = &status.meta.map.partitions[0];
    let primary = placement.primary.expect("partition 0 has a primary");
    let standby = *placement
        .replicas
        .iter()
        .find(|&&r| r != primary)
        .expect("partition 0 has a standby");

    let peer = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION);
    let ask = |node: tessera_server::NodeId| {
        let peer = &peer;
        let addr = cluster.addr(node.0).to_string();
        async move {
            let request: TablePartition =
                ("kv".to_string(), generation, tessera_common::PartitionId(0));
            let reply: Result<serde_json::Value, Refusal> = peer
                .action(
                    &addr,
                    tessera_server::rpc::ACTION_SHIPPED_MANIFEST,
                    request,
                    Duration::from_secs(20),
                )
                .await
                .expect("the node answers");
            reply
        }
    };
    ask(primary).await.expect("the primary ships");
    let refused = ask(standby)
        .await
        .expect_err("a standby shipped components as if it were the primary");
    let refused = format!("{refused:?}");
    assert!(
        refused.contains(&format!(
            "not the primary of partition p0 (the primary is node {primary})"
        )) || refused.contains(&format!(
            "not the primary of partition 0 (the primary is node {primary})"
        )),
        "the refusal names the primary: {refused}"
    );
}

/// What node `addr` answers a peer reading `partitions` of table `kv` at `epoch`: its rows,
/// or its error.
async fn read_as_peer(
    peer: &tessera_server::rpc::Clients,
    addr: &str,
    generation: u64,
    epoch: tessera_common::Epoch,
    partitions: Vec<tessera_common::PartitionId>,
) -> Result<Vec<arrow::array::RecordBatch>, String> {
    use futures::TryStreamExt;
    let request = tessera_server::rpc::ScanRequest {
        table: "kv".into(),
        generation,
        epoch,
        partitions,
        columns: vec![0, 1],
        changes_since: None,
        order: Default::default(),
    };
    let stream = peer.get(addr, &request).await.map_err(|e| e.to_string())?;
    stream.try_collect().await.map_err(|e| e.to_string())
}

/// Bad input from peers naming what does not exist: a read of a partition the cluster
/// does not have, or at an epoch that was never published, gets an error in bounded time
/// that names it (an unknown partition read as empty before), and the node goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_naming_an_unknown_partition_or_epoch_get_clear_errors() {
    use tessera_server::rpc::{Clients, PROTOCOL_VERSION};

    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 3, &[]).await;
    client
        .publish("kv", vec![kv_batch(0, 100)], false)
        .await
        .unwrap();
    let status = client.status().await.unwrap();
    let generation = status.meta.tables["kv"].generation;
    let peer = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION);
    let read = |partition: u32, epoch: tessera_common::Epoch| {
        let (peer, addr) = (&peer, cluster.addr(2));
        async move {
            let asked = Instant::now();
            let partitions = vec![tessera_common::PartitionId(partition)];
            let result = read_as_peer(peer, addr, generation, epoch, partitions).await;
            (result, asked.elapsed())
        }
    };
    let visible = status.meta.visible;
    let (good, _) = read(0, visible).await;
    assert!(good.is_ok(), "a good read answers: {good:?}");

    let (unknown_partition, took) = read(99, visible).await;
    let error = unknown_partition.expect_err("a read of partition 99 of 8 answered");
    assert!(
        error.contains("has no partition p99 (it has 8)"),
        "the error names the partition: {error}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");

    let future = tessera_common::Epoch(visible.0 + 1000);
    let (unknown_epoch, took) = read(0, future).await;
    let error = unknown_epoch.expect_err("a read at an epoch never published answered");
    assert!(
        error.contains(&future.to_string()),
        "the error names the epoch: {error}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");

    let (after, _) = read(0, visible).await;
    assert!(after.is_ok(), "the node still serves: {after:?}");
}

/// A read reaches a replica chosen from the reader's metadata, which may be older than the
/// replica's own: one that does not hold the partition (moved off it, or wiped and taken
/// back empty, or still being copied what it missed) refuses, naming why, and the reader
/// goes on to another replica. Before, it answered from what it had: no rows at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_asked_for_rows_it_does_not_hold_refuses_instead_of_answering_empty() {
    use tessera_server::rpc::{Clients, PROTOCOL_VERSION};

    let root = tempfile::tempdir().unwrap();
    let (cluster, client) = kv_cluster_with(BINARY, root.path(), 8, 2, &[]).await;
    client
        .publish("kv", vec![kv_batch(0, 400)], false)
        .await
        .unwrap();
    let status = client.status().await.unwrap();
    let generation = status.meta.tables["kv"].generation;
    let asked = tessera_common::NodeId(2);
    let (held, not_held): (Vec<_>, Vec<_>) =
        (0..8u32).map(tessera_common::PartitionId).partition(|p| {
            status.meta.map.partitions[p.0 as usize]
                .replicas
                .contains(&asked)
        });
    assert!(!held.is_empty() && !not_held.is_empty(), "r=2 of 3 nodes");
    let peer = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION);
    let read = |partitions: Vec<tessera_common::PartitionId>| {
        let addr = cluster.addr(asked.0);
        read_as_peer(&peer, addr, generation, status.meta.visible, partitions)
    };
    let rows = |batches: &[arrow::array::RecordBatch]| -> usize {
        batches.iter().map(|b| b.num_rows()).sum()
    };
    let answered = read(held.clone()).await.expect("a replica answers");
    assert!(rows(&answered) > 0, "its partitions have rows");

    let refused = read(vec![not_held[0]])
        .await
        .map(|batches| rows(&batches))
        .expect_err("a node answered for a partition it does not hold");
    assert!(
        refused.contains(&format!(
            "node 2 is not a replica of partition {}",
            not_held[0]
        )),
        "the refusal names the node and the partition: {refused}"
    );
    // The cluster's own reads go to the replicas: every row, through every node.
    for id in cluster.node_ids() {
        let batches = ClusterClient::new(cluster.addr(id))
            .query("SELECT count(*) FROM kv")
            .await
            .unwrap();
        let count = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .value(0);
        assert_eq!(count, 400, "through node {id}");
    }
}
