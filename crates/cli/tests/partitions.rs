//! Network faults with real dropped packets: every node runs in its own network namespace
//! (`tessera_testkit::NetLab`), partitions are iptables rules, and degraded links go through
//! user-space proxies. Needs root and iptables (`.ci/run` installs it).

mod common;

use arrow::array::Int64Array;
use common::{start_kv, wait_until};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_common::NodeId;
use tessera_server::ClusterClient;
use tessera_server::RecoveryOutcome;
use tessera_testkit::{kv_batch, LinkFaults, Links, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// Every call a test makes while links are cut has this deadline: a hung call fails the
/// test instead of hanging it.
const CALL_DEADLINE: Duration = Duration::from_secs(45);

/// `count(*)` and `sum(v)` of `kv` through `client`, or the error it gave.
async fn count_and_sum(client: &ClusterClient) -> Result<(i64, i64), String> {
    let sql = "SELECT count(*) AS n, coalesce(sum(v), 0) AS s FROM kv";
    let batches = tokio::time::timeout(CALL_DEADLINE, client.query(sql))
        .await
        .map_err(|_| format!("no answer within {CALL_DEADLINE:?}"))?
        .map_err(|e| e.to_string())?;
    let column = |i: usize| {
        batches[0]
            .column(i)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("BIGINT")
            .value(0)
    };
    Ok((column(0), column(1)))
}

/// `count` and `sum(v)` of the kv rows `0..n` (`v = 10 k`).
fn expected(n: i64) -> (i64, i64) {
    (n, 10 * n * (n - 1) / 2)
}

/// Publishes kv rows `from..to` through `client`, retrying a refused or failed attempt until
/// `deadline` (a publish is all-or-nothing, so a retry after an unknown outcome of the same
/// rows is harmless: the keys are the same). Returns how long it took.
async fn publish_until_acknowledged(
    client: &ClusterClient,
    from: i64,
    to: i64,
    deadline: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        let attempt = tokio::time::timeout(
            CALL_DEADLINE,
            client.publish("kv", vec![kv_batch(from, to)], false),
        )
        .await;
        match attempt {
            Ok(Ok(_)) => return started.elapsed(),
            Ok(Err(e)) => eprintln!("publish {from}..{to} not acknowledged yet: {e}"),
            Err(_) => eprintln!("publish {from}..{to} gave no answer in {CALL_DEADLINE:?}"),
        }
        assert!(
            started.elapsed() < deadline,
            "the majority side acknowledged no publish within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A 3-node cluster (8 partitions, r = 3) in network namespaces with `links`, table `kv`
/// holding rows `0..rows`; returns it, a client of node 1, the metadata leader and the
/// other two nodes.
async fn kv_lab(
    root: &Path,
    links: Links,
    rows: i64,
) -> (LocalCluster, ClusterClient, NodeId, Vec<u64>) {
    let cluster = LocalCluster::configure_networked(Path::new(BINARY), root, 3, 8, 3, links);
    let (cluster, client) = start_kv(cluster, &[]).await;
    client
        .publish("kv", vec![kv_batch(0, rows)], false)
        .await
        .unwrap();
    let leader = leader(&client).await;
    let others = cluster
        .node_ids()
        .into_iter()
        .filter(|&id| id != leader.0)
        .collect();
    (cluster, client, leader, others)
}

async fn leader(client: &ClusterClient) -> NodeId {
    wait_until("a leader", Duration::from_secs(30), || async {
        client.status().await.ok()?.leader
    })
    .await
}

/// The metadata leader is cut off from both other nodes (real dropped packets, so its
/// connections hang rather than fail). It still believes it leads for a while; asked
/// through it, a query must either include every publish the majority acknowledged or
/// refuse, never answer from the old leader's view. The majority elects a new leader and
/// acknowledges publishes within seconds; after healing, the old leader answers with all
/// of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_leader_never_answers_stale_and_the_majority_goes_on() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, _, old_leader, majority) = kv_lab(root.path(), Links::Direct, 100).await;
    let isolated = ClusterClient::new(cluster.addr(old_leader.0));
    let writer = ClusterClient::new(cluster.addr(majority[0]));

    cluster.net().isolate(old_leader.0);
    let took = publish_until_acknowledged(&writer, 100, 200, Duration::from_secs(30)).await;
    eprintln!("the majority acknowledged a publish {took:?} after the isolation");
    let mut acknowledged = 200;

    let mut answered_stale = Vec::new();
    let mut refusals = 0;
    for round in 0..3 {
        let from = acknowledged;
        publish_until_acknowledged(&writer, from, from + 50, Duration::from_secs(30)).await;
        acknowledged = from + 50;
        match count_and_sum(&isolated).await {
            Ok(answer) if answer == expected(acknowledged) => {}
            Ok(answer) => answered_stale.push((round, answer, expected(acknowledged))),
            Err(refusal) => {
                refusals += 1;
                eprintln!("the isolated node refused: {refusal}");
            }
        }
    }
    assert!(
        answered_stale.is_empty(),
        "stale reads through the isolated old leader (round, answer, acknowledged): {answered_stale:?}"
    );
    assert_eq!(
        refusals, 3,
        "it cannot see the majority's publishes, so it must refuse"
    );

    cluster.net().heal();
    let healed = Instant::now();
    let answer = wait_until(
        "the old leader to answer again after healing",
        Duration::from_secs(30),
        || async { count_and_sum(&isolated).await.ok() },
    )
    .await;
    eprintln!(
        "the old leader answered {:?} after healing",
        healed.elapsed()
    );
    assert_eq!(answer, expected(acknowledged), "every acknowledged row");
}

/// The metadata leader's links turn slow: 150 ms each way, so each round trip takes three
/// heartbeat intervals and openraft times every AppendEntries out. Its followers still
/// hear it (late), so neither campaigns; unless it steps down, the cluster commits nothing
/// for as long as the links stay slow. It must step down (no majority acknowledged it),
/// the other two elect a leader between them and acknowledge publishes within the bound
/// the fault run asserts; once the links recover, the old leader answers with every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_leader_behind_slow_links_steps_down_and_the_others_go_on() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, _, old_leader, others) =
        kv_lab(root.path(), Links::Proxied { seed: 16 }, 100).await;
    let writer = ClusterClient::new(cluster.addr(others[0]));
    let slow = LinkFaults {
        delay: Duration::from_millis(150),
        ..LinkFaults::default()
    };
    for (&(from, to), link) in cluster.links() {
        if from == old_leader.0 || to == old_leader.0 {
            link.set(slow.clone());
        }
    }
    let took = publish_until_acknowledged(&writer, 100, 200, slow_leader_bound()).await;
    eprintln!("the others acknowledged a publish {took:?} after the leader's links turned slow");
    let new_leader = leader(&writer).await;
    assert_ne!(
        new_leader, old_leader,
        "the leader behind slow links should have stepped down"
    );
    publish_until_acknowledged(&writer, 200, 300, slow_leader_bound()).await;

    for (_, link) in cluster.links() {
        link.set(LinkFaults::default());
    }
    let through_old = ClusterClient::new(cluster.addr(old_leader.0));
    let answer = wait_until(
        "the old leader to answer after its links recovered",
        Duration::from_secs(30),
        || async { count_and_sum(&through_old).await.ok() },
    )
    .await;
    assert_eq!(answer, expected(300), "every acknowledged row");
}

/// How soon the nodes around a leader behind slow links acknowledge publishes again: its
/// step-down (no majority's acknowledgement for a while), an election, the failure
/// timeout, and the fault run's 5 s margin.
fn slow_leader_bound() -> Duration {
    let election = Duration::from_millis(tessera_server::node::ELECTION_TIMEOUT_MAX_MS);
    let step_down =
        tessera_server::meta::quorum_check::QuorumPolicy::for_election_timeout(election)
            .step_down_after;
    let failure =
        Duration::from_millis(tessera_server::config::FailureSettings::default().timeout_ms);
    step_down + election + failure + Duration::from_secs(5)
}

/// A partial partition: two nodes that are not the metadata leader cannot reach each
/// other, both still reach the leader, so it keeps counting both alive. A query through one
/// of them over partitions whose primary is the other must still answer exactly, reading
/// from replicas it can reach, instead of failing because that node does not answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_goes_on_when_its_initiator_cannot_reach_a_node_others_see_alive() {
    let root = tempfile::tempdir().unwrap();
    let (cluster, client, _, others) = kv_lab(root.path(), Links::Direct, 1000).await;
    let (initiator, unreachable) = (others[0], others[1]);
    let through = ClusterClient::new(cluster.addr(initiator));
    assert_eq!(count_and_sum(&through).await, Ok(expected(1000)));

    cluster.net().cut(initiator, unreachable);
    let sql = "SELECT count(*) AS n, sum(v) AS s FROM kv";
    for round in 0..3 {
        let asked = Instant::now();
        let (batches, notices) = tokio::time::timeout(CALL_DEADLINE, through.query_with_notices(sql))
            .await
            .unwrap_or_else(|_| panic!("round {round}: no answer within {CALL_DEADLINE:?}"))
            .unwrap_or_else(|e| {
                panic!("round {round}: a query through node {initiator} while it cannot reach node {unreachable} failed: {e}")
            });
        let column = |i: usize| {
            batches[0]
                .column(i)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .value(0)
        };
        assert_eq!(
            (column(0), column(1)),
            expected(1000),
            "round {round}: exact"
        );
        let rerouted: Vec<_> = notices
            .iter()
            .filter_map(|n| n.recovery.as_ref())
            .filter(|r| matches!(r, RecoveryOutcome::Rerouted { .. }))
            .collect();
        eprintln!(
            "round {round} answered in {:?}, rerouted: {rerouted:?}",
            asked.elapsed()
        );
        if round == 0 {
            assert!(
                rerouted
                    .iter()
                    .all(|r| r.dead().is_some_and(|dead| dead.0 == unreachable)),
                "a reroute names the unreachable node"
            );
        } else {
            // The initiator remembers the unreachable peer: later plans avoid it at once.
            assert!(
                rerouted.is_empty(),
                "round {round} should not need a reroute"
            );
            assert!(
                asked.elapsed() < Duration::from_secs(5),
                "round {round} took {:?}",
                asked.elapsed()
            );
        }
    }
    let status = client.status().await.unwrap();
    assert!(
        status.meta.live_nodes().any(|n| n.id.0 == unreachable),
        "the leader should still count node {unreachable} alive (it reaches it)"
    );
    cluster.net().heal();
}

/// Slow, jittery links with stalls (as lost segments cost TCP) between every pair of nodes:
/// publishes are acknowledged and every query answers exactly; when every connection is
/// reset mid-query, the query still answers exactly or fails with a clear error, and the
/// next one answers exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_reset_links_give_exact_answers_or_clear_errors() {
    let root = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::configure_networked(
        Path::new(BINARY),
        root.path(),
        3,
        8,
        3,
        Links::Proxied { seed: 15 },
    );
    let (cluster, client) = start_kv(cluster, &[]).await;
    for (_, link) in cluster.links() {
        link.set(LinkFaults {
            delay: Duration::from_millis(20),
            jitter: Duration::from_millis(20),
            stall_probability: 0.02,
            stall: Duration::from_millis(200),
            bytes_per_second: Some(4 << 20),
        });
    }
    let mut acknowledged = 0;
    for i in 0..4 {
        let coordinator = ClusterClient::new(cluster.addr(1 + i % 3));
        publish_until_acknowledged(
            &coordinator,
            i as i64 * 500,
            (i as i64 + 1) * 500,
            CALL_DEADLINE,
        )
        .await;
        acknowledged = (i as i64 + 1) * 500;
        let reader = ClusterClient::new(cluster.addr(1 + (i + 1) % 3));
        assert_eq!(count_and_sum(&reader).await, Ok(expected(acknowledged)));
    }

    // The links really are slow: a query crosses them at least once each way (20 ms or
    // more of delay each), so it cannot answer as fast as over a healthy link.
    let timed = Instant::now();
    assert_eq!(count_and_sum(&client).await, Ok(expected(acknowledged)));
    assert!(
        timed.elapsed() >= Duration::from_millis(40),
        "a query over 20 ms links took only {:?}: the proxies are not in the path",
        timed.elapsed()
    );

    let querying = tokio::spawn(async move { count_and_sum(&client).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    for (_, link) in cluster.links() {
        link.reset();
    }
    match querying.await.unwrap() {
        Ok(answer) => assert_eq!(answer, expected(acknowledged), "an exact answer"),
        Err(error) => eprintln!("the query cut by resets failed: {error}"),
    }
    let after = ClusterClient::new(cluster.addr(2));
    let answer = wait_until(
        "an answer after the resets",
        Duration::from_secs(30),
        || async { count_and_sum(&after).await.ok() },
    )
    .await;
    assert_eq!(answer, expected(acknowledged));
}
