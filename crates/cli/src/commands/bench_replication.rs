//! `tessera bench replication`: on a 3-node local cluster, in one run, publish throughput
//! with r = 1, 2, 3 (and the overhead against r = 1), failover time from a node's detection
//! to its partitions serving again (hot standby, and cold standby with and without
//! checkpoints), and failback time of the returning node with delta recovery against a full
//! copy of its stale partitions (a node that kept its components, which fetches none of
//! them) and against a wiped node's return, which copies every partition again.
//!
//! Each publish is timed alone: the one before it flushed what it left in memory and the
//! nodes went quiet, and each cluster publishes once before the timed rounds.

use super::local_cluster::LocalCluster;
use super::timing::{cpu_seconds, median_of, poll_until, wait_quiet};
use super::up::UpOptions;
use anyhow::{Context, Result};
use arrow::array::RecordBatch;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::{ClusterClient, NodeId};

const NODES: u64 = 3;
/// Rows of the small publish the killed node misses before it returns.
const DELTA_ROWS: usize = 1000;

/// Publish times of one configuration, one per round, and the CPU its nodes spent on each
/// publish, the background work it left (checkpoints, component shipping) included.
struct Throughput {
    times: Vec<Duration>,
    /// From the publish's start until every node had flushed the rows it left in memory to
    /// components and shipped them to their standbys (what the idle checkpoint would do
    /// later).
    flushed: Vec<Duration>,
    cpu_seconds: Vec<f64>,
    /// CPU seconds the other clusters' nodes used while this one's publish was timed:
    /// background work they had left (an idle checkpoint, a merge) that the publish shared
    /// the cores with.
    others_cpu_seconds: Vec<f64>,
    /// The first publish into the cluster's fresh processes (publish, then flushed), not
    /// counted in the rounds: its nodes' allocators and page cache still start empty.
    warm_up: (Duration, Duration),
}

impl Throughput {
    /// Takes the first round off as the warm-up.
    fn set_warm_up_aside(&mut self) {
        self.warm_up = (self.times.remove(0), self.flushed.remove(0));
        self.cpu_seconds.remove(0);
        self.others_cpu_seconds.remove(0);
    }

    fn median(&self) -> Duration {
        median_of(&self.times)
    }

    /// This configuration's publish time over `baseline`'s in each round (published one
    /// after the other, so both saw the machine in the same state), sorted.
    fn ratios_to(&self, baseline: &Throughput) -> Vec<f64> {
        sorted_ratios(&self.times, &baseline.times)
    }

    /// [`Throughput::ratios_to`] of the times until the rows were flushed too.
    fn flushed_ratios_to(&self, baseline: &Throughput) -> Vec<f64> {
        sorted_ratios(&self.flushed, &baseline.flushed)
    }

    fn median_cpu_seconds(&self) -> f64 {
        median_of(&self.cpu_seconds)
    }
}

/// Each round's `times[i] / baselines[i]`, sorted.
fn sorted_ratios(times: &[Duration], baselines: &[Duration]) -> Vec<f64> {
    let mut ratios: Vec<f64> = times
        .iter()
        .zip(baselines)
        .map(|(time, base)| time.as_secs_f64() / base.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios
}

/// The median of sorted `ratios`, and it described with their range.
fn median_and_range(ratios: &[f64]) -> (f64, String) {
    let median = ratios[ratios.len() / 2];
    let (low, high) = (ratios[0], ratios[ratios.len() - 1]);
    (median, format!("{median:.2} ({low:.2}-{high:.2})"))
}

struct Failover {
    detected: Duration,
    serving_after_detection: Duration,
    healthy_query: Duration,
}

struct Failback {
    /// From the restarted node being declared alive to no replica being stale, in each
    /// round.
    caught_up: Vec<Duration>,
    /// What the returning node fetched to catch up (in the last round).
    fetched: String,
}

impl Failback {
    fn median(&self) -> Duration {
        median_of(&self.caught_up)
    }

    /// The median and the range, in milliseconds.
    fn describe(&self) -> String {
        let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
        let low = self.caught_up.iter().min().map_or(0.0, ms);
        let high = self.caught_up.iter().max().map_or(0.0, ms);
        format!("{:.0} ms ({low:.0}-{high:.0})", ms(&self.median()))
    }
}

/// Failbacks timed per configuration: at a small delta each is mostly the leader's duty
/// tick, heartbeats and polling, which one round does not average out.
const FAILBACK_ROUNDS: usize = 3;

/// How a benchmark cluster's replicas keep the rows of partitions they do not lead.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Standby {
    /// Applied as they commit: a promotion replays nothing.
    Hot,
    /// In the log until promoted, checkpoints at their defaults.
    Cold,
    /// In the log until promoted, with checkpoints every few MiB of log: primaries ship
    /// components, so a promotion replays only the log since the last one.
    ColdCheckpointed,
    /// In the log until promoted, and no checkpoint at all: a promotion replays everything.
    ColdUncheckpointed,
}

/// Log bytes between checkpoints in the checkpointed cold-standby cluster.
const CHECKPOINT_LOG_BYTES: usize = 16 << 20;
/// Large enough that no checkpoint runs during the benchmark.
const NEVER: usize = 1 << 50;

async fn start(
    root: &Path,
    partitions: u32,
    replication: u32,
    delta: bool,
    standby: Standby,
) -> Result<LocalCluster> {
    let mut options = UpOptions::new(NODES, partitions, replication);
    options.delta_recovery = delta;
    match standby {
        Standby::Hot => options.hot_standby = true,
        Standby::Cold => {}
        Standby::ColdCheckpointed => options.checkpoint_log_bytes = Some(CHECKPOINT_LOG_BYTES),
        Standby::ColdUncheckpointed => {
            options.checkpoint_log_bytes = Some(NEVER);
            options.memtable_flush_bytes = Some(NEVER);
            options.idle_checkpoint_ms = Some(0);
        }
    }
    let mut nodes = LocalCluster::start_on_free_ports(root, options)?;
    nodes.wait_formed(Duration::from_secs(60)).await?;
    let client = nodes.client(0);
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    client
        .sql(&tessera_tpch::create_table_sql(&lineitem))
        .await?;
    Ok(nodes)
}

/// Publishes `rows` through node 1 of each cluster in turn, `runs` rounds; returns each
/// cluster's publish times and CPU. Interleaved rounds, rather than one cluster's runs after
/// another's, let every configuration meet the machine in the same state. After each
/// publish every node of its cluster flushes the rows the publish left in memory (and
/// ships the components to their standbys), and the next publish starts once every node
/// of every cluster is quiet: the background work one publish leaves is charged to it, and
/// not to the next or another cluster's. Left to the idle checkpoint, that work began
/// `store.idle_checkpoint_ms` after the publish, in the middle of the next cluster's.
/// Each cluster's first publish is a warm-up, left out of its rounds. Returns too how many
/// publishes were timed before the nodes went quiet (the wait has a deadline).
async fn interleaved_publish_times(
    clusters: &[&LocalCluster],
    rows: &[RecordBatch],
    runs: usize,
) -> Result<(Vec<Throughput>, usize)> {
    const QUIET_PATIENCE: Duration = Duration::from_secs(20);
    let every_node: Vec<u32> = clusters.iter().flat_map(|nodes| nodes.pids()).collect();
    let mut not_quiet = 0;
    let mut measured: Vec<Throughput> = clusters
        .iter()
        .map(|_| Throughput {
            times: Vec::new(),
            flushed: Vec::new(),
            cpu_seconds: Vec::new(),
            others_cpu_seconds: Vec::new(),
            warm_up: (Duration::ZERO, Duration::ZERO),
        })
        .collect();
    let clients: Vec<Vec<ClusterClient>> = clusters
        .iter()
        .map(|nodes| (0..NODES as usize).map(|i| nodes.client(i)).collect())
        .collect();
    for _ in 0..=runs.max(1) {
        for ((nodes, clients), throughput) in clusters.iter().zip(&clients).zip(&mut measured) {
            if !wait_quiet(&every_node, QUIET_PATIENCE).await {
                not_quiet += 1;
            }
            let pids = nodes.pids();
            let others: Vec<u32> = every_node
                .iter()
                .copied()
                .filter(|pid| !pids.contains(pid))
                .collect();
            let cpu_before = cpu_seconds(&pids);
            let others_before = cpu_seconds(&others);
            let started = Instant::now();
            clients[0].publish("lineitem", rows.to_vec(), false).await?;
            throughput.times.push(started.elapsed());
            throughput
                .others_cpu_seconds
                .push(cpu_seconds(&others) - others_before);
            futures::future::try_join_all(clients.iter().map(|client| client.flush())).await?;
            throughput.flushed.push(started.elapsed());
            wait_quiet(&every_node, QUIET_PATIENCE).await;
            throughput.cpu_seconds.push(cpu_seconds(&pids) - cpu_before);
        }
    }
    measured.iter_mut().for_each(Throughput::set_warm_up_aside);
    Ok((measured, not_quiet))
}

/// Publishes `rows` through node 1 and waits for the nodes to go quiet, leaving what the
/// publish left in memory to the cluster's own checkpoints (which the failovers measure).
async fn publish_and_wait_quiet(nodes: &LocalCluster, rows: &[RecordBatch]) -> Result<()> {
    nodes
        .client(0)
        .publish("lineitem", rows.to_vec(), false)
        .await?;
    wait_quiet(&nodes.pids(), Duration::from_secs(20)).await;
    Ok(())
}

/// How many times the clusters' metadata leaders declared a node failed, read from the
/// nodes' logs. No node of these clusters is stopped while they publish, so every one is a
/// false declaration (a failure detector starved of CPU).
fn failure_declarations(clusters: &[&LocalCluster]) -> usize {
    clusters
        .iter()
        .flat_map(|nodes| (1..=NODES).map(|id| nodes.log_path(id)))
        .filter_map(|log| std::fs::read_to_string(log).ok())
        .map(|log| {
            log.lines()
                .filter(|line| line.contains("node liveness changed") && line.contains("false"))
                .count()
        })
        .sum()
}

async fn count_rows(client: &ClusterClient) -> Result<i64> {
    let batches = client.query("SELECT count(*) FROM lineitem").await?;
    super::answers::first_int64(&batches)?.context("count(*) answers one number")
}

/// When `client`'s node first saw `victim` declared failed (polled, up to `patience`).
async fn declared_failed(
    client: &ClusterClient,
    victim: u64,
    patience: Duration,
) -> Result<Instant> {
    poll_until("the node declared failed", patience, || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.meta.nodes.get(&NodeId(victim)).is_some_and(|n| !n.alive))
    })
    .await
}

/// SIGKILLs node 3 (not the metadata leader, so no election is timed) and measures how long
/// until it is declared failed and until a query over every partition answers exactly.
async fn failover(nodes: &mut LocalCluster, victim: u64) -> Result<Failover> {
    let client = nodes.client(0);
    let healthy_started = Instant::now();
    let expected = count_rows(&client).await?;
    let healthy_query = healthy_started.elapsed();
    let killed = Instant::now();
    nodes.kill9(victim);
    let detected = declared_failed(&client, victim, Duration::from_secs(10)).await?;
    let serving = poll_until(
        "partitions serving again",
        Duration::from_secs(30),
        || async { count_rows(&client).await.is_ok_and(|n| n == expected) },
    )
    .await?;
    Ok(Failover {
        detected: detected - killed,
        serving_after_detection: serving - detected,
        healthy_query,
    })
}

/// How a failed node comes back.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Return {
    /// With its data directory as it left it.
    Kept,
    /// With its data directory wiped (a replaced disk): `--replace`, and every partition
    /// copied to it again.
    Wiped,
}

/// [`FAILBACK_ROUNDS`] failbacks of `victim`, returning as `how`: each round kills it first
/// if it runs, and waits until it is declared failed.
async fn failbacks(
    nodes: &mut LocalCluster,
    victim: u64,
    delta: &RecordBatch,
    how: Return,
) -> Result<Failback> {
    let mut caught_up = Vec::with_capacity(FAILBACK_ROUNDS);
    let mut fetched = String::new();
    for _ in 0..FAILBACK_ROUNDS {
        if nodes.pid(victim).is_some() {
            nodes.kill9(victim);
            declared_failed(&nodes.client(0), victim, Duration::from_secs(30)).await?;
        }
        let (took, what) = failback(nodes, victim, delta, how).await?;
        caught_up.push(took);
        fetched = what;
    }
    Ok(Failback { caught_up, fetched })
}

/// With `victim` down, publishes a small delta, restarts it (as `how` says) and measures
/// how long it takes from being declared alive to holding every epoch again; and what it
/// fetched.
async fn failback(
    nodes: &mut LocalCluster,
    victim: u64,
    delta: &RecordBatch,
    how: Return,
) -> Result<(Duration, String)> {
    let client = nodes.client(0);
    client
        .publish("lineitem", vec![delta.clone()], false)
        .await?;
    let stale = client
        .status()
        .await?
        .meta
        .map
        .partitions
        .iter()
        .filter(|p| !p.stale.is_empty())
        .count();
    anyhow::ensure!(stale > 0, "the dead node should have missed the delta");
    match how {
        Return::Kept => nodes.spawn(victim)?,
        Return::Wiped => {
            std::fs::remove_dir_all(nodes.data_dir(victim))?;
            nodes.spawn_with(victim, &["--replace"])?;
        }
    }
    let alive = poll_until("the node back alive", Duration::from_secs(60), || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.meta.nodes.get(&NodeId(victim)).is_some_and(|n| n.alive))
    })
    .await?;
    let caught_up = poll_until("the node caught up", Duration::from_secs(600), || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.meta.map.partitions.iter().all(|p| p.stale.is_empty()))
    })
    .await?;
    let transfers = nodes.client(victim as usize - 1).status().await?.transfers;
    let fetched = if transfers.delta_copies > 0 {
        format!(
            "{} missed row versions in {} partition deltas",
            transfers.delta_versions, transfers.delta_copies
        )
    } else {
        format!(
            "{} partitions copied whole ({} rows), {} components fetched{}",
            transfers.whole_copies,
            transfers.whole_rows,
            transfers.prefetched_components + transfers.leased_components,
            match how {
                Return::Kept => " (the rest held already)",
                Return::Wiped => "",
            }
        )
    };
    Ok((caught_up - alive, fetched))
}

pub async fn run(data_dir: &Path, sf: f64, partitions: u32, runs: usize) -> Result<()> {
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    let rows: Vec<RecordBatch> = lineitem.generate(sf, 64 * 1024).collect::<Result<_, _>>()?;
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    let delta = rows[0].slice(0, DELTA_ROWS.min(rows[0].num_rows()));
    let root = data_dir.join(format!("bench-replication-{}", std::process::id()));
    println!("replication benchmark: {NODES} nodes on this machine, {partitions} partitions, lineitem SF {sf} ({count} rows), {runs} rounds of publishes after a warm-up publish into each cluster");

    let result = async {
        let mut clusters = Vec::new();
        for r in 1..=3u32 {
            let dir = root.join(format!("r{r}"));
            clusters.push(start(&dir, partitions, r, true, Standby::Cold).await?);
        }
        clusters.push(start(&root.join("hot"), partitions, 3, true, Standby::Hot).await?);
        let (mut throughput, not_quiet) =
            interleaved_publish_times(&clusters.iter().collect::<Vec<_>>(), &rows, runs).await?;
        let false_failures = failure_declarations(&clusters.iter().collect::<Vec<_>>());
        drop(clusters);
        let hot_r3 = throughput.pop().expect("the hot-standby cluster's times");
        let mut failovers = Vec::new();
        let mut delta_failback = None;
        for standby in [
            Standby::Hot,
            Standby::ColdCheckpointed,
            Standby::ColdUncheckpointed,
        ] {
            let dir = root.join(format!("failover-{standby:?}"));
            let mut nodes = start(&dir, partitions, 3, true, standby).await?;
            publish_and_wait_quiet(&nodes, &rows).await?;
            // Let the last checkpoints' component shipments land.
            tokio::time::sleep(Duration::from_secs(2)).await;
            failovers.push((standby, failover(&mut nodes, 3).await?));
            if standby == Standby::ColdCheckpointed {
                delta_failback = Some(failbacks(&mut nodes, 3, &delta, Return::Kept).await?);
            }
        }
        let full_failback = {
            let dir = root.join("full-copy");
            let mut nodes = start(&dir, partitions, 3, false, Standby::ColdCheckpointed).await?;
            publish_and_wait_quiet(&nodes, &rows).await?;
            failover(&mut nodes, 3).await?;
            let kept = failbacks(&mut nodes, 3, &delta, Return::Kept).await?;
            (kept, failbacks(&mut nodes, 3, &delta, Return::Wiped).await?)
        };
        let delta_failback = delta_failback.expect("the checkpointed cluster fails back");
        anyhow::Ok((
            (throughput, hot_r3, not_quiet, false_failures),
            failovers,
            delta_failback,
            full_failback,
        ))
    }
    .await;
    let _ = std::fs::remove_dir_all(&root);
    let ((throughput, hot_r3, not_quiet, false_failures), failovers, delta, (full, wiped)) =
        result?;

    let rows_per_second = |t: &Throughput| count as f64 / t.median().as_secs_f64();
    println!();
    println!("{:<30} {:>18} {:>18} {:>18}", "", "r=1", "r=2", "r=3");
    println!(
        "{:<30} {:>18.0} {:>18.0} {:>18.0}   (cold standby, default checkpoints; median of {runs} rounds)",
        "publish throughput (rows/s)",
        rows_per_second(&throughput[0]),
        rows_per_second(&throughput[1]),
        rows_per_second(&throughput[2])
    );
    let spread = |t: &Throughput| median_and_range(&t.ratios_to(&throughput[0]));
    println!(
        "{:<30} {:>18} {:>18} {:>18}   (publish time / r=1 time in the same round: median (lowest-highest); goal for r=3: <= 1.10)",
        "overhead vs r=1",
        "1.00",
        spread(&throughput[1]).1,
        spread(&throughput[2]).1
    );
    let flushed_spread = |t: &Throughput| median_and_range(&t.flushed_ratios_to(&throughput[0])).1;
    let flushed_s = |t: &Throughput| median_of(&t.flushed).as_secs_f64();
    println!(
        "{:<30} {:>18} {:>18} {:>18}   (to every node's rows flushed to components and shipped to their standbys: {:.2} / {:.2} / {:.2} s; hot standby r=3 {})",
        "publish then flush vs r=1",
        "1.00",
        flushed_spread(&throughput[1]),
        flushed_spread(&throughput[2]),
        flushed_s(&throughput[0]),
        flushed_s(&throughput[1]),
        flushed_s(&throughput[2]),
        flushed_spread(&hot_r3)
    );
    println!(
        "{:<30} {:>18} {:>18} {:>18}   (hot standby: {:.0} rows/s)",
        "overhead vs r=1, hot standby",
        "",
        "",
        spread(&hot_r3).1,
        rows_per_second(&hot_r3)
    );
    let rounds = |t: &Throughput| {
        let seconds: Vec<String> = (t.times.iter().zip(&t.flushed))
            .map(|(publish, flushed)| {
                format!("{:.2}/{:.2}", publish.as_secs_f64(), flushed.as_secs_f64())
            })
            .collect();
        seconds.join(" ")
    };
    println!(
        "{:<30} {:>18} {:>18} {:>18}   (publish/flushed seconds in each round, in order; hot standby r=3 {})",
        "each round (s)",
        rounds(&throughput[0]),
        rounds(&throughput[1]),
        rounds(&throughput[2]),
        rounds(&hot_r3)
    );
    let warm_up = |t: &Throughput| {
        format!(
            "{:.2}/{:.2}",
            t.warm_up.0.as_secs_f64(),
            t.warm_up.1.as_secs_f64()
        )
    };
    println!(
        "{:<30} {:>18} {:>18} {:>18}   (publish/flushed seconds of each cluster's first publish, before the rounds; hot standby r=3 {})",
        "warm-up, not in the rounds (s)",
        warm_up(&throughput[0]),
        warm_up(&throughput[1]),
        warm_up(&throughput[2]),
        warm_up(&hot_r3)
    );
    let cpu = |t: &Throughput| t.median_cpu_seconds();
    println!(
        "{:<30} {:>18.2} {:>18.2} {:>18.2}   (CPU seconds of all nodes per publish, its background work included; r=3/r=1 {:.2}, hot standby r=3 {:.2} s)",
        "CPU per publish (s)",
        cpu(&throughput[0]),
        cpu(&throughput[1]),
        cpu(&throughput[2]),
        cpu(&throughput[2]) / cpu(&throughput[0]),
        cpu(&hot_r3)
    );
    let others = |t: &Throughput| t.others_cpu_seconds.iter().sum::<f64>();
    println!(
        "{:<30} {:>18.2} {:>18.2} {:>18.2}   (CPU seconds the other clusters' nodes used while this cluster's publishes were timed, all rounds; hot standby r=3 {:.2} s)",
        "others' CPU during publishes",
        others(&throughput[0]),
        others(&throughput[1]),
        others(&throughput[2]),
        others(&hot_r3)
    );
    println!(
        "each publish started once every node was quiet ({not_quiet} of {} timed before they were)",
        4 * (runs.max(1) + 1)
    );
    println!(
        "nodes declared failed while the clusters published (none was stopped): {false_failures}"
    );
    let verdict = if spread(&throughput[2]).0 <= 1.10 {
        "met"
    } else {
        "not met"
    };
    println!("r=3 overhead goal (<= 1.10, median of the rounds): {verdict}");
    println!();
    println!("failover (r=3, SIGKILL of node 3; detection = declared failed, serving = a count(*) over every partition answers exactly):");
    for (standby, failover) in &failovers {
        let what = match standby {
            Standby::Hot => "hot standby".to_string(),
            Standby::Cold => "cold standby".to_string(),
            Standby::ColdCheckpointed => {
                format!(
                    "cold standby, checkpoint every {} MiB of log",
                    CHECKPOINT_LOG_BYTES >> 20
                )
            }
            Standby::ColdUncheckpointed => "cold standby, no checkpoints".to_string(),
        };
        println!(
            "  {what:<48} detected {:>6.0} ms after the kill, serving {:>6.0} ms after detection (healthy query {:.0} ms)",
            failover.detected.as_secs_f64() * 1000.0,
            failover.serving_after_detection.as_secs_f64() * 1000.0,
            failover.healthy_query.as_secs_f64() * 1000.0
        );
    }
    println!(
        "failback after missing one {DELTA_ROWS}-row publish, from declared alive to up to date (median of {FAILBACK_ROUNDS}, range): delta recovery {}, full copy {}, full/delta {:.2}",
        delta.describe(),
        full.describe(),
        full.median().as_secs_f64() / delta.median().as_secs_f64()
    );
    println!(
        "  the returning node fetched: delta recovery {}; full copy {}",
        delta.fetched, full.fetched
    );
    println!(
        "failback of a wiped node (--replace, every partition copied to it again; median of {FAILBACK_ROUNDS}, range): {}, wiped/delta {:.2}; it fetched {}",
        wiped.describe(),
        wiped.median().as_secs_f64() / delta.median().as_secs_f64(),
        wiped.fetched
    );
    Ok(())
}
