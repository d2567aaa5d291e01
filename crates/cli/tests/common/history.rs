//! A Jepsen-style history of publishes and reads made through random nodes while faults
//! happen, and the checks run on it: no acknowledged publish lost, no aborted one seen,
//! in-doubt ones all or nothing, no row nobody wrote, replicas equal; and for reads, no
//! stale read (a read started after a publish was acknowledged sees it), no read going
//! backwards after another finished, no phantom rows, and `AS OF EPOCH` answers that never
//! change.

use arrow::array::{Int64Array, RecordBatch};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_common::{Epoch, PartitionId};
use tessera_server::server::NodeStatus;
use tessera_server::{ClusterClient, ClusterError};
use tessera_testkit::{kv_batch, LocalCluster};

/// How long a client waits for any one call before counting it unanswered.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What the client learnt about one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Acknowledged: committed, must be everywhere.
    Acknowledged,
    /// Refused as aborted by a live coordinator: must be nowhere.
    Aborted,
    /// The reply never came (coordinator or connection died): all of it or none of it.
    InDoubt,
}

#[derive(Debug, Clone)]
pub struct Publish {
    pub table: &'static str,
    pub keys: std::ops::Range<i64>,
    pub outcome: Outcome,
    /// The epoch an acknowledged publish became.
    pub epoch: Option<Epoch>,
    pub started: Instant,
    /// When the acknowledgement arrived.
    pub acknowledged: Option<Instant>,
    /// The node (1-based) the publish went through, and when and how its call ended: the
    /// trail of a slow recovery.
    pub coordinator: usize,
    pub ended: Instant,
    pub error: Option<String>,
}

impl Publish {
    fn rows(&self) -> i64 {
        self.keys.end - self.keys.start
    }
}

pub fn classify(result: &Result<Epoch, ClusterError>) -> Outcome {
    match result {
        Ok(_) => Outcome::Acknowledged,
        // The coordinator said so itself after aborting the epoch in the metadata.
        Err(ClusterError::PublishAborted { .. }) => Outcome::Aborted,
        Err(_) => Outcome::InDoubt,
    }
}

/// Acknowledged epochs so far, per table, for readers to ask `AS OF`.
pub type AcknowledgedEpochs = Arc<Mutex<Vec<(&'static str, Epoch)>>>;

/// Which node a publisher's calls go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Through {
    /// A random node for each publish: every node coordinates every table's publishes.
    AnyNode,
    /// Always this node (an index into the addresses), as a client that knows one node:
    /// while faults last, some publishers are always on the side that can still commit.
    Node(usize),
}

/// Publishes batches of `rows` fresh keys into `table` through `through` until `stop`.
#[allow(clippy::too_many_arguments)]
pub async fn publisher(
    table: &'static str,
    first_key: i64,
    rows: i64,
    addrs: Vec<String>,
    through: Through,
    stop: Arc<AtomicBool>,
    seed: u64,
    acknowledged: AcknowledgedEpochs,
) -> Vec<Publish> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut log = Vec::new();
    let mut next = first_key;
    while !stop.load(Ordering::Relaxed) {
        let coordinator = match through {
            Through::AnyNode => rng.random_range(0..addrs.len()),
            Through::Node(node) => node,
        };
        let keys = next..next + rows;
        next += rows;
        let client = ClusterClient::new(&addrs[coordinator]);
        let started = Instant::now();
        let result = tokio::time::timeout(
            CALL_TIMEOUT * 2,
            client.publish(table, vec![kv_batch(keys.start, keys.end)], false),
        )
        .await
        .ok();
        let ended = Instant::now();
        // A publish the client gave up waiting on is in doubt, like a lost reply.
        let outcome = result.as_ref().map_or(Outcome::InDoubt, classify);
        let error = match &result {
            None => Some(format!("no answer in {:?}", CALL_TIMEOUT * 2)),
            Some(Err(e)) => Some(e.to_string()),
            Some(Ok(_)) => None,
        };
        let epoch = result.and_then(Result::ok);
        if let Some(epoch) = epoch {
            acknowledged.lock().unwrap().push((table, epoch));
        } else {
            // Give a dead coordinator's failure time to be noticed (a publisher that only
            // knows that one node waits longer: it would only be refused again).
            let pause = match through {
                Through::AnyNode => Duration::from_millis(100),
                Through::Node(_) => Duration::from_millis(250),
            };
            tokio::time::sleep(pause).await;
        }
        log.push(Publish {
            table,
            keys,
            outcome,
            epoch,
            started,
            acknowledged: (outcome == Outcome::Acknowledged).then_some(ended),
            coordinator: coordinator + 1,
            ended,
            error,
        });
    }
    log
}

/// Starts one [`publisher`] per table through `addrs` (the nodes each goes through
/// alongside), each on its own key range (table `i` from `i * 10⁹`) and seed (`seed + i`).
pub fn spawn_publishers(
    tables: &[(&'static str, Through)],
    rows: i64,
    addrs: &[String],
    stop: &Arc<AtomicBool>,
    seed: u64,
    acknowledged: &AcknowledgedEpochs,
) -> Vec<tokio::task::JoinHandle<Vec<Publish>>> {
    tables
        .iter()
        .enumerate()
        .map(|(i, &(table, through))| {
            tokio::spawn(publisher(
                table,
                i as i64 * 1_000_000_000,
                rows,
                addrs.to_vec(),
                through,
                stop.clone(),
                seed + i as u64,
                acknowledged.clone(),
            ))
        })
        .collect()
}

/// One read of `count(*)`, current or `AS OF` an acknowledged epoch.
#[derive(Debug, Clone)]
pub struct Read {
    pub table: &'static str,
    pub node: usize,
    pub as_of: Option<Epoch>,
    pub started: Instant,
    /// The wall-clock start, to find the read in the nodes' logs.
    pub started_at: std::time::SystemTime,
    pub ended: Instant,
    /// The count, or why there was none (a refusal is allowed; a wrong count is not).
    pub answer: Result<i64, String>,
}

/// Reads counts through random nodes until `stop`; one read in four is `AS OF` an epoch
/// already acknowledged.
pub async fn reader(
    tables: &'static [&'static str],
    addrs: Vec<String>,
    stop: Arc<AtomicBool>,
    seed: u64,
    acknowledged: AcknowledgedEpochs,
) -> Vec<Read> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut reads = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let node = rng.random_range(0..addrs.len());
        let table = tables[rng.random_range(0..tables.len())];
        let as_of = if rng.random_bool(0.25) {
            let known: Vec<Epoch> = acknowledged
                .lock()
                .unwrap()
                .iter()
                .filter(|(t, _)| *t == table)
                .map(|(_, e)| *e)
                .collect();
            (!known.is_empty()).then(|| known[rng.random_range(0..known.len())])
        } else {
            None
        };
        let sql = match as_of {
            Some(epoch) => format!("SELECT count(*) AS n FROM {table} AS OF EPOCH {}", epoch.0),
            None => format!("SELECT count(*) AS n FROM {table}"),
        };
        let client = ClusterClient::new(&addrs[node]);
        let started = Instant::now();
        let started_at = std::time::SystemTime::now();
        let answer = match tokio::time::timeout(CALL_TIMEOUT, client.query(&sql)).await {
            Err(_) => Err(format!("no answer in {CALL_TIMEOUT:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(batches)) => Ok(batches[0]
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .expect("count is BIGINT")
                .value(0)),
        };
        reads.push(Read {
            table,
            node: node + 1,
            as_of,
            started,
            started_at,
            ended: Instant::now(),
            answer,
        });
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..200))).await;
    }
    reads
}

/// What the read checks found.
#[derive(Debug, Default)]
pub struct ReadReport {
    pub answered: usize,
    pub refused: usize,
    /// How many reads were refused for each reason (its start, numbers blanked out).
    pub refusals_by_reason: BTreeMap<String, usize>,
    /// Each violation, described.
    pub violations: Vec<String>,
}

/// A refusal's reason with its numbers (nodes, epochs, times) blanked out and cut short,
/// so refusals of one kind count together.
fn reason_kind(reason: &str) -> String {
    let mut kind = String::new();
    for c in reason.chars() {
        match c {
            '0'..='9' if kind.ends_with('#') => {}
            '0'..='9' => kind.push('#'),
            c => kind.push(c),
        }
    }
    kind.chars().take(90).collect()
}

/// Checks every answered read against the publishes (each publish's keys are fresh, and
/// nothing is deleted, so a table's count only grows):
/// - not stale: at least the rows of every publish acknowledged before the read started;
/// - no phantom: at most the rows of every publish started before the read ended;
/// - monotonic: at least what any read of the same table that ended before it started saw;
/// - `AS OF e`: the same count every time, and at least the publishes acknowledged at or
///   below `e`.
pub fn check_reads(publishes: &[Publish], reads: &[Read]) -> ReadReport {
    let mut report = ReadReport::default();
    let mut as_of_answers: BTreeMap<(&str, Epoch), BTreeSet<i64>> = BTreeMap::new();
    let mut current: Vec<(&Read, i64)> = Vec::new();
    for read in reads {
        let count = match &read.answer {
            Ok(count) => *count,
            Err(reason) => {
                report.refused += 1;
                *report
                    .refusals_by_reason
                    .entry(reason_kind(reason))
                    .or_default() += 1;
                continue;
            }
        };
        report.answered += 1;
        let of_table = publishes.iter().filter(|p| p.table == read.table);
        match read.as_of {
            Some(epoch) => {
                let floor: i64 = of_table
                    .filter(|p| p.epoch.is_some_and(|e| e <= epoch))
                    .map(Publish::rows)
                    .sum();
                if count < floor {
                    report.violations.push(format!(
                        "{} AS OF EPOCH {epoch} through node {} counted {count}, but publishes acknowledged at or below it hold {floor}",
                        read.table, read.node
                    ));
                }
                as_of_answers
                    .entry((read.table, epoch))
                    .or_default()
                    .insert(count);
            }
            None => {
                let (mut floor, mut ceiling) = (0, 0);
                for publish in of_table {
                    if publish.acknowledged.is_some_and(|at| at < read.started) {
                        floor += publish.rows();
                    }
                    if publish.started < read.ended && publish.outcome != Outcome::Aborted {
                        ceiling += publish.rows();
                    }
                }
                if count < floor {
                    // The latest acknowledgements before the read, to name what it missed.
                    let mut recent: Vec<String> = publishes
                        .iter()
                        .filter(|p| p.table == read.table)
                        .filter_map(|p| Some((p.acknowledged?, p.epoch?)))
                        .filter(|(at, _)| *at < read.started)
                        .map(|(at, epoch)| (read.started - at, epoch))
                        .filter(|(before, _)| *before < Duration::from_secs(3))
                        .map(|(before, epoch)| {
                            format!("epoch {epoch} {}ms before", before.as_millis())
                        })
                        .collect();
                    recent.sort();
                    report.violations.push(format!(
                        "stale read: {} through node {} counted {count} rows, but {floor} were acknowledged before it started (at {} UTC; acknowledged just before it: {})",
                        read.table, read.node, utc_time_of_day(read.started_at), recent.join(", ")
                    ));
                }
                if count > ceiling {
                    report.violations.push(format!(
                        "phantom rows: {} through node {} counted {count} rows, but publishes started by its end hold at most {ceiling}",
                        read.table, read.node
                    ));
                }
                current.push((read, count));
            }
        }
    }
    for ((table, epoch), counts) in as_of_answers {
        if counts.len() > 1 {
            report.violations.push(format!(
                "{table} AS OF EPOCH {epoch} answered differently over time: {counts:?}"
            ));
        }
    }
    // Monotonic reads: a read that started after another ended sees at least as much.
    current.sort_by_key(|(read, _)| read.ended);
    let mut seen: BTreeMap<&str, Vec<(Instant, i64)>> = BTreeMap::new();
    for (read, count) in &current {
        let before = seen.entry(read.table).or_default();
        if let Some((_, earlier)) = before
            .iter()
            .filter(|(ended, _)| *ended < read.started)
            .max_by_key(|(_, c)| *c)
        {
            if count < earlier {
                report.violations.push(format!(
                    "non-monotonic read: {} through node {} counted {count} after an earlier finished read counted {earlier}",
                    read.table, read.node
                ));
            }
        }
        before.push((read.ended, *count));
    }
    report
}

/// Waits until node `via` sees every node alive, no replica stale, no epoch open, and
/// every acknowledged epoch visible; returns its status.
pub async fn wait_recovered(
    cluster: &LocalCluster,
    via: u64,
    publishes: &[Publish],
    timeout: Duration,
) -> NodeStatus {
    let last_acknowledged = publishes
        .iter()
        .filter_map(|p| p.epoch)
        .max()
        .unwrap_or_default();
    let nodes = cluster.node_ids().len();
    let admin = ClusterClient::new(cluster.addr(via));
    let deadline = Instant::now() + timeout;
    let mut unmet = vec!["no status answered".to_string()];
    while Instant::now() < deadline {
        match admin.status().await {
            Ok(status) => {
                unmet = unrecovered(&status, last_acknowledged, nodes);
                if unmet.is_empty() {
                    return status;
                }
            }
            Err(error) => unmet = vec![format!("status through node {via} failed: {error}")],
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "timed out waiting for the cluster to recover after {timeout:?}; still: {}",
        unmet.join("; ")
    );
}

/// What keeps `status` from showing a recovered cluster (empty when it does).
fn unrecovered(status: &NodeStatus, last_acknowledged: Epoch, nodes: usize) -> Vec<String> {
    let mut unmet = Vec::new();
    if status.leader.is_none() {
        unmet.push("no metadata leader".to_string());
    }
    if status.meta.visible < last_acknowledged {
        unmet.push(format!(
            "visible epoch {} is below the last acknowledged {last_acknowledged}",
            status.meta.visible
        ));
    }
    let live: Vec<_> = status.meta.live_nodes().map(|n| n.id).collect();
    if live.len() != nodes {
        unmet.push(format!("live nodes {live:?} of {nodes}"));
    }
    if !status.meta.open.is_empty() {
        unmet.push(format!(
            "epochs still open: {:?}",
            status.meta.open.keys().collect::<Vec<_>>()
        ));
    }
    let stale: Vec<String> = status
        .meta
        .map
        .partitions
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.stale.is_empty())
        .map(|(i, p)| format!("partition {i} stale on {:?}", p.stale))
        .collect();
    if !stale.is_empty() {
        unmet.push(stale.join(", "));
    }
    unmet
}

pub fn keys_of(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    let mut rows = Vec::new();
    for batch in batches {
        let column = |i: usize| {
            batch
                .column(i)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .clone()
        };
        let (k, v) = (column(0), column(1));
        rows.extend(k.values().iter().copied().zip(v.values().iter().copied()));
    }
    rows.sort_unstable();
    rows
}

/// Which keys one replica holds and the other lacks, and the publishes they came from.
fn describe_difference(
    table: &str,
    publishes: &[Publish],
    (a, a_rows): (tessera_server::NodeId, &[(i64, i64)]),
    (b, b_rows): (tessera_server::NodeId, &[(i64, i64)]),
) -> String {
    let keys = |rows: &[(i64, i64)]| rows.iter().map(|(k, _)| *k).collect::<BTreeSet<i64>>();
    let (a_keys, b_keys) = (keys(a_rows), keys(b_rows));
    let origin = |key: i64| {
        publishes
            .iter()
            .find(|p| p.table == table && p.keys.contains(&key))
            .map(|p| format!("{:?} epoch {:?} keys {:?}", p.outcome, p.epoch, p.keys))
            .unwrap_or_else(|| "no publish".into())
    };
    let mut lines = Vec::new();
    for (holder, lacker, only) in [
        (
            a,
            b,
            a_keys.difference(&b_keys).copied().collect::<Vec<_>>(),
        ),
        (
            b,
            a,
            b_keys.difference(&a_keys).copied().collect::<Vec<_>>(),
        ),
    ] {
        let origins: BTreeSet<String> = only.iter().map(|&k| origin(k)).collect();
        if !only.is_empty() {
            lines.push(format!(
                "{} keys only on node {holder}, not on node {lacker}, from: {origins:?}",
                only.len()
            ));
        }
    }
    lines.join("; ")
}

/// The publishes' fate, once checked.
#[derive(Debug, Default)]
pub struct PublishReport {
    pub by_outcome: BTreeMap<Outcome, usize>,
    /// In-doubt publishes that turned out committed.
    pub in_doubt_committed: usize,
}

/// Checks, at `status`'s visible epoch, that every replica of every partition of every
/// table holds the same rows with the right values, every acknowledged publish is there in
/// full, every aborted one is not, every in-doubt one is all or nothing, and no row is
/// there that no publish wrote. Panics naming the first violation.
pub async fn check_replicas(
    cluster: &LocalCluster,
    status: &NodeStatus,
    tables: &[&'static str],
    publishes: &[Publish],
) -> PublishReport {
    let epoch = status.meta.visible;
    let mut visible: BTreeMap<&str, BTreeSet<i64>> = BTreeMap::new();
    for &table in tables {
        for (p, placement) in status.meta.map.partitions.iter().enumerate() {
            let mut first: Option<(tessera_server::NodeId, Vec<(i64, i64)>)> = None;
            for &replica in &placement.replicas {
                let client = ClusterClient::new(cluster.addr(replica.0));
                let rows = keys_of(
                    &client
                        .read_replica(cluster.cluster_id(), table, PartitionId(p as u32), epoch)
                        .await
                        .unwrap_or_else(|e| {
                            panic!("reading p{p} of {table} on node {replica}: {e}")
                        }),
                );
                assert!(
                    rows.iter().all(|(k, v)| *v == k * 10),
                    "{table} p{p} on node {replica} holds a wrong value"
                );
                match &first {
                    None => first = Some((replica, rows)),
                    Some((other, expected)) => {
                        if *expected != rows {
                            panic!(
                                "{table} p{p}: node {replica} holds {} rows, node {other} holds {}; {}",
                                rows.len(),
                                expected.len(),
                                describe_difference(table, publishes, (*other, expected), (replica, &rows))
                            );
                        }
                    }
                }
            }
            let (_, rows) = first.expect("every partition has a replica");
            let keys = visible.entry(table).or_default();
            for (k, _) in rows {
                assert!(keys.insert(k), "{table}: key {k} in two partitions");
            }
        }
    }

    let mut report = PublishReport::default();
    let mut expected_rows: BTreeMap<&str, usize> = BTreeMap::new();
    for publish in publishes {
        *report.by_outcome.entry(publish.outcome).or_default() += 1;
        let keys = &visible[publish.table];
        let present = publish.keys.clone().filter(|k| keys.contains(k)).count() as i64;
        let all = publish.rows();
        match publish.outcome {
            Outcome::Acknowledged => assert_eq!(
                present,
                all,
                "acknowledged publish {publish:?} lost {} rows",
                all - present
            ),
            Outcome::Aborted => assert_eq!(present, 0, "aborted publish {publish:?} is visible"),
            Outcome::InDoubt => {
                assert!(
                    present == 0 || present == all,
                    "publish {publish:?} is partly visible ({present} of {all} rows)"
                );
                report.in_doubt_committed += usize::from(present == all);
            }
        }
        if present == all {
            *expected_rows.entry(publish.table).or_default() += all as usize;
        }
    }
    for &table in tables {
        assert_eq!(
            visible[table].len(),
            expected_rows.get(table).copied().unwrap_or(0),
            "{table} holds rows no publish wrote"
        );
    }
    report
}

/// `HH:MM:SS.mmm` in UTC, as the nodes' logs print time.
pub fn utc_time_of_day(at: std::time::SystemTime) -> String {
    let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seconds = since.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60,
        since.subsec_millis()
    )
}
