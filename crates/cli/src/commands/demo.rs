//! `tessera demo`: the whole story in one command. A local 3-node cluster with every
//! partition on all three nodes starts, TPC-H is loaded, queries run distributed with
//! timings, a node is SIGKILLed in the middle of a long query and the exact answer still
//! arrives, writes go on while it is down, it comes back and catches up by fetching only
//! what it missed, and time travel shows an update's before and after. Everything it
//! started is stopped when it ends, also on Ctrl-C; a second run reuses the data.
//!
//! `tessera demo --local` keeps the single-store version: one process, no cluster.

use super::local_cluster::{LocalCluster, NodeOutput};
use super::node::wait_for_shutdown;
use super::timing::{poll_until, timed};
use super::up::{print_endpoints, UpOptions};
use crate::commands::load;
use crate::output::{print_output, print_rows};
use crate::Format;
use anyhow::{bail, Context, Result};
use arrow::array::RecordBatch;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_server::server::NodeStatus;
use tessera_server::{ClusterClient, NodeConfig, NodeId, RecoveryOutcome};
use tessera_sql::{Engine, StatementOutput};
use tessera_storage::Store;

const DEMO_QUERIES: [usize; 8] = [1, 3, 5, 6, 10, 12, 14, 19];
/// The query a node dies in the middle of: a large join and aggregation, the longest of
/// TPC-H at small scales.
const LONG_QUERY: usize = 18;
/// How far into the long query's measured time the node is killed.
const KILL_AT: f64 = 0.5;
/// Runs of the long query a kill is tried on: one that finishes before the kill lands
/// is run again, the kill coming sooner.
const KILL_ATTEMPTS: usize = 3;
/// The demo's cluster: three nodes, each holding every partition (r = 3).
pub const NODES: u64 = 3;

pub struct DemoOptions {
    pub sf: f64,
    /// The local cluster: [`NODES`] nodes, r = [`NODES`].
    pub cluster: UpOptions,
    /// Keep the cluster running at the end, until Ctrl-C, so the user can connect.
    pub stay_up: bool,
}

pub async fn run(root: &Path, options: DemoOptions) -> Result<()> {
    let up = &options.cluster;
    assert_eq!(up.nodes, NODES, "the story is told on {NODES} nodes");
    println!(
        "Tessera demo: a local cluster of {NODES} node processes, every partition kept on all {NODES} (r = {NODES}); data and node logs under {}",
        root.display()
    );
    let mut cluster = LocalCluster::start(root, up, NodeOutput::LogFile)?;
    let outcome = tokio::select! {
        result = story(&mut cluster, &options) => Some(result),
        _ = wait_for_shutdown() => None,
    };
    let result = match outcome {
        Some(Ok(())) if options.stay_up => {
            println!("\nThe cluster keeps running for you to try; Ctrl-C stops it.");
            wait_for_shutdown().await;
            Ok(())
        }
        Some(result) => result,
        None => {
            println!("\ninterrupted");
            Ok(())
        }
    };
    print!("stopping the nodes ... ");
    cluster.stop();
    println!("stopped (data kept: a second run reuses it)");
    result
}

async fn story(cluster: &mut LocalCluster, options: &DemoOptions) -> Result<()> {
    heading(1, "start the cluster");
    let started = Instant::now();
    let leader = cluster.wait_formed(Duration::from_secs(60)).await?;
    println!(
        "{NODES} nodes up in {:.1} s; node {leader} leads the metadata (Raft), and any node answers SQL",
        started.elapsed().as_secs_f64()
    );
    print_endpoints(cluster.configs())?;
    let client = cluster.client(0);

    heading(2, &format!("load TPC-H SF {}", options.sf));
    load_missing(&client, &cluster.addrs[0], options.sf).await?;
    let settled = settle_standbys(&cluster.addrs).await?;
    println!(
        "flushed to components, and every standby holds its primaries' components ({:.1} s)",
        settled.as_secs_f64()
    );

    heading(3, "queries, planned on node 1 and run on all three");
    println!("TPC-H Q1 (pricing summary):");
    print_query(&client, tessera_tpch::query(1)).await?;
    println!("\n{:>5} {:>8} {:>10}", "query", "rows", "time (ms)");
    for q in DEMO_QUERIES {
        let (elapsed, batches) = timed(|| client.query(tessera_tpch::query(q))).await?;
        println!(
            "{:>5} {:>8} {:>10.1}",
            format!("Q{q}"),
            rows_of(&batches),
            ms(elapsed)
        );
    }
    println!("\nWhere Q3 runs (EXPLAIN; `EXPLAIN ANALYZE` adds what every channel did):");
    for line in plan_outline(&client, tessera_tpch::query(3)).await? {
        println!("  {line}");
    }

    heading(4, "a node dies in the middle of a query");
    let victim = victim(&client).await?;
    let sql = tessera_tpch::query(LONG_QUERY);
    let (mut measured, expected) = timed(|| client.query(sql)).await?;
    for attempt in 1..=KILL_ATTEMPTS {
        let pid = cluster.pid(victim).context("the victim runs")?;
        println!(
            "Q{LONG_QUERY} takes {:.0} ms. Running it again from node 1, and SIGKILLing node {victim} (pid {pid}) {:.0} ms in ...",
            ms(measured),
            ms(measured.mul_f64(KILL_AT))
        );
        let running = {
            let client = cluster.client(0);
            tokio::spawn(async move { timed(|| client.query_with_notices(sql)).await })
        };
        tokio::time::sleep(measured.mul_f64(KILL_AT)).await;
        cluster.kill9(victim);
        let (elapsed, (actual, notices)) = running.await??;
        for notice in &notices {
            println!("NOTICE: {}", notice.message);
        }
        let recovered = notices.iter().find_map(|n| n.recovery.as_ref());
        let same = tessera_tpch::compare::same_answer(&expected, &actual, 0.0).is_ok();
        println!(
            "answer: {} rows in {:.0} ms, {}",
            rows_of(&actual),
            ms(elapsed),
            if same {
                "identical to the answer before the kill"
            } else {
                "DIFFERENT from the answer before the kill"
            }
        );
        print_rows(
            &actual_schema(&expected, &actual),
            &actual,
            Format::Table,
            &mut std::io::stdout(),
        )?;
        if !same {
            bail!("the answer after the kill differs from the answer before it");
        }
        match recovered {
            Some(outcome) => {
                println!("the query survived: {}", describe(outcome));
                break;
            }
            None if attempt < KILL_ATTEMPTS => {
                // A warm run can take half the first one's time: the kill comes earlier.
                println!(
                    "(the query finished before the kill landed; node {victim} restarts, and the next kill comes sooner)"
                );
                restart(cluster, &client, victim).await?;
                measured = elapsed;
            }
            None => println!("(the query finished before the kill landed: nothing to recover)"),
        }
    }

    heading(5, &format!("writes go on while node {victim} is down"));
    let before = client.current_metadata().await?.visible;
    let comment = format!("changed by the demo after epoch {before}");
    let update = format!("UPDATE nation SET n_comment = '{comment}' WHERE n_nationkey = 0");
    let (elapsed, outputs) = timed(|| client.sql(&update)).await?;
    let after = match outputs.first() {
        Some(StatementOutput::Done {
            epoch: Some(epoch), ..
        }) => *epoch,
        other => bail!("the UPDATE answered {other:?}"),
    };
    let missed = client
        .current_metadata()
        .await?
        .map
        .partitions
        .iter()
        .filter(|p| p.stale.contains_key(&NodeId(victim)))
        .count();
    println!(
        "UPDATE nation ... committed as epoch {after} in {:.0} ms, acknowledged by the two live copies; node {victim} missed it in {missed} partition(s)",
        ms(elapsed)
    );
    println!("restarting node {victim} ...");
    let (alive, caught_up) = restart(cluster, &client, victim).await?;
    let returned = cluster.client(victim as usize - 1).status().await?;
    println!(
        "node {victim} back in {:.1} s and up to date {:.1} s later: {}",
        alive.as_secs_f64(),
        caught_up.as_secs_f64(),
        catch_up_summary(&returned)
    );

    heading(
        6,
        "time travel: every publish is an epoch, and older epochs stay readable",
    );
    for sql in [
        format!("SELECT n_name, n_comment FROM nation AS OF EPOCH {before} WHERE n_nationkey = 0"),
        "SELECT n_name, n_comment FROM nation WHERE n_nationkey = 0".to_string(),
        format!(
            "SELECT change, n_nationkey, before_n_comment, after_n_comment FROM tessera_changes('nation', {before}, {after})"
        ),
    ] {
        println!("\n{sql}");
        print_query(&client, &sql).await?;
    }

    print_next_steps(cluster.configs())?;
    Ok(())
}

/// What to run next against the cluster the demo leaves (or a second run) starts.
fn print_next_steps(configs: &[PathBuf]) -> Result<()> {
    let first = NodeConfig::load(&configs[0])?;
    let root = configs[0]
        .parent()
        .and_then(Path::parent)
        .context("a node configuration sits in the cluster's directory")?;
    let mut steps = Vec::new();
    if let Some(pg) = first.pg_listen {
        steps.push((
            format!("psql -h {} -p {} -U tessera", pg.ip(), pg.port()),
            "any node speaks PostgreSQL",
        ));
    }
    if let Some(http) = first.http_listen {
        steps.push((
            format!("open http://{http}/"),
            "the console: nodes, partitions, epochs, queries",
        ));
    }
    steps.push((
        format!("tessera --node {} sql", first.listen),
        "a prompt: try AS OF TIMESTAMP, CREATE TAG, SELECT * FROM tessera_epochs",
    ));
    steps.push((
        format!("tessera up --data-dir {}", root.display()),
        "this cluster again, TPC-H loaded",
    ));
    let width = steps
        .iter()
        .map(|(command, _)| command.len())
        .max()
        .unwrap_or(0);
    println!("\nWhat next:");
    for (command, why) in steps {
        println!("  {command:<width$}   # {why}");
    }
    Ok(())
}

/// Loads the TPC-H tables a previous run did not finish loading (each table is one
/// publish, so it holds all its rows or none), or says the data is reused.
async fn load_missing(client: &ClusterClient, addr: &str, sf: f64) -> Result<()> {
    let mut missing = Vec::new();
    // The current catalog: the nodes have just (re)started and may still be applying it.
    let tables = client.current_metadata().await?.tables;
    for table in tessera_tpch::TABLES {
        if !tables.contains_key(table.name) {
            missing.push(table.name.to_string());
            continue;
        }
        let count = client
            .query(&format!("SELECT count(*) FROM {}", table.name))
            .await?;
        let rows = super::answers::first_int64(&count)?.context("count(*) answers one number")?;
        if rows == 0 {
            // Created, but the run that created it stopped before its rows were published.
            client.sql(&format!("DROP TABLE {}", table.name)).await?;
            missing.push(table.name.to_string());
        } else if table.name != "lineitem" && rows as u64 != table.estimated_rows(sf) {
            // Every table but lineitem has an exact size per scale factor.
            bail!(
                "this data directory holds TPC-H at another scale ({} has {rows} rows, SF {sf} has {}): run the demo with the --sf it was loaded with, or another --data-dir",
                table.name,
                table.estimated_rows(sf)
            );
        }
    }
    let target = super::target::Target::cluster(addr);
    if missing.len() == tessera_tpch::TABLES.len() {
        load::tpch(&target, sf, &[], true).await
    } else if missing.is_empty() {
        let visible = client.current_metadata().await?.visible;
        println!("TPC-H already loaded (visible epoch {visible}); reusing it");
        Ok(())
    } else {
        println!(
            "resuming an unfinished load: {} of {} tables to go",
            missing.len(),
            tessera_tpch::TABLES.len()
        );
        load::tpch(&target, sf, &missing, true).await
    }
}

/// Flushes every node and waits until every standby holds its primaries' components, not
/// only their log: a scan rebuilt on a replica then reproduces the primary's output, so a
/// query that loses a node can be rebuilt from lineage instead of restarted.
async fn settle_standbys(addrs: &[String]) -> Result<Duration> {
    let started = Instant::now();
    for addr in addrs {
        ClusterClient::new(addr).flush().await?;
    }
    let clients: Vec<ClusterClient> = addrs.iter().map(|a| ClusterClient::new(a)).collect();
    poll_until(
        "standbys to take their primaries' components",
        Duration::from_secs(120),
        || async {
            for client in &clients {
                match client.status().await {
                    Ok(status) if status.tables.iter().all(|t| t.logged_rows == 0) => {}
                    _ => return false,
                }
            }
            true
        },
    )
    .await?;
    Ok(started.elapsed())
}

fn heading(step: usize, title: &str) {
    println!("\n[{step}/6] {title}");
}

/// Starts node `victim` again and waits until the cluster has formed with it and none of
/// its replicas is stale; returns how long each took.
async fn restart(
    cluster: &mut LocalCluster,
    client: &ClusterClient,
    victim: u64,
) -> Result<(Duration, Duration)> {
    let restarted = Instant::now();
    cluster.spawn(victim)?;
    cluster.wait_formed(Duration::from_secs(120)).await?;
    let formed = Instant::now();
    let up_to_date = poll_until(
        &format!("node {victim} to catch up"),
        Duration::from_secs(300),
        || async {
            client
                .status()
                .await
                .is_ok_and(|s| s.meta.map.partitions.iter().all(|p| p.stale.is_empty()))
        },
    )
    .await?;
    Ok((formed - restarted, up_to_date - formed))
}

/// A node other than node 1 (which plans the queries) and the metadata leader, so that
/// the kill shows a query's recovery, not also an election.
async fn victim(client: &ClusterClient) -> Result<u64> {
    let leader = client.status().await?.leader.map(|l| l.0);
    (2..=NODES)
        .rev()
        .find(|id| Some(*id) != leader)
        .context("no node to kill")
}

fn describe(outcome: &RecoveryOutcome) -> &'static str {
    match outcome {
        RecoveryOutcome::Rebuilt { .. } => {
            "the dead node's part was rebuilt from lineage on the replicas that hold its data"
        }
        RecoveryOutcome::Restarted { .. } => "it was restarted on the surviving nodes",
        RecoveryOutcome::Rerouted { .. } => "it was rerouted around the dead node",
        RecoveryOutcome::SpillingJoins { .. } => "it ran again with joins that spill to disk",
    }
}

/// What a returning node fetched, from its own counters.
fn catch_up_summary(status: &NodeStatus) -> String {
    let held: u64 = status.tables.iter().map(|t| t.rows).sum();
    let t = status.transfers;
    let mut text = format!(
        "it fetched only what it missed, {} row version(s) by delta (over {} table partition(s)), not the {held} rows it holds; {} of them while publishes waited on its catch-up",
        t.delta_versions, t.delta_copies, t.leased_delta_versions
    );
    if t.whole_copies > 0 {
        text.push_str(&format!(
            ", and copied {} partition(s) whole ({} rows)",
            t.whole_copies, t.whole_rows
        ));
    }
    text
}

/// The stage lines of a query's distributed plan: where each stage runs and what it sends.
async fn plan_outline(client: &ClusterClient, sql: &str) -> Result<Vec<String>> {
    let batches = client.query(&format!("EXPLAIN {sql}")).await?;
    let mut lines = Vec::new();
    for batch in &batches {
        let plans = batch
            .column(1)
            .as_any()
            .downcast_ref::<arrow::array::StringArray>()
            .context("EXPLAIN returns its plan as text")?;
        for plan in plans.iter().flatten() {
            lines.extend(
                plan.lines()
                    .filter(|l| l.starts_with("Distributed plan") || l.starts_with("Stage"))
                    .map(str::to_string),
            );
        }
    }
    Ok(lines)
}

async fn print_query(client: &ClusterClient, sql: &str) -> Result<()> {
    let mut stdout = std::io::stdout();
    for output in client.sql(sql).await? {
        print_output(&output, Format::Table, &mut stdout)?;
    }
    Ok(())
}

/// The schema to print an answer under (an empty answer has no batch to take it from).
fn actual_schema(expected: &[RecordBatch], actual: &[RecordBatch]) -> arrow::datatypes::SchemaRef {
    actual
        .first()
        .or(expected.first())
        .map(|b| b.schema())
        .unwrap_or_else(|| Arc::new(arrow::datatypes::Schema::empty()))
}

fn rows_of(batches: &[RecordBatch]) -> usize {
    batches.iter().map(|b| b.num_rows()).sum()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `tessera demo --local`: one store in this process with TPC-H loaded, queries with
/// timings, and time travel.
pub async fn run_local(store: Arc<Store>, sf: f64) -> Result<()> {
    println!(
        "Tessera demo (local store): data in {}",
        store.dir().display()
    );
    if store.table_def("lineitem").is_none() {
        load::tpch(&super::target::Target::local(store.clone()), sf, &[], true).await?;
    } else {
        println!(
            "TPC-H already loaded (visible epoch {}); reusing it",
            store.visible_epoch()
        );
    }
    let engine = Engine::new(store.clone());
    let mut stdout = std::io::stdout();

    println!("\nTPC-H Q1 (pricing summary):");
    for output in engine.execute(tessera_tpch::query(1)).await? {
        print_output(&output, Format::Table, &mut stdout)?;
    }
    println!("\n{:>5} {:>8} {:>10}", "query", "rows", "time (ms)");
    for q in DEMO_QUERIES {
        let started = Instant::now();
        let batches = engine.query(tessera_tpch::query(q)).await?;
        println!(
            "{:>5} {:>8} {:>10.1}",
            format!("Q{q}"),
            rows_of(&batches),
            ms(started.elapsed())
        );
    }

    println!("\nTime travel: every write is a new epoch; older epochs stay readable.");
    let before = store.visible_epoch();
    let comment = format!("changed by the demo at epoch {}", before.next());
    let outputs = engine
        .execute(&format!(
            "UPDATE nation SET n_comment = '{comment}' WHERE n_nationkey = 0"
        ))
        .await?;
    if let Some(StatementOutput::Done {
        epoch: Some(epoch), ..
    }) = outputs.first()
    {
        println!("UPDATE nation ... committed as epoch {epoch}");
    }
    for sql in [
        format!("SELECT n_name, n_comment FROM nation AS OF EPOCH {before} WHERE n_nationkey = 0"),
        "SELECT n_name, n_comment FROM nation WHERE n_nationkey = 0".to_string(),
    ] {
        println!("\n{sql}");
        for output in engine.execute(&sql).await? {
            print_output(&output, Format::Table, &mut stdout)?;
        }
    }
    println!("\nNext: `tessera sql` for a prompt, `tessera status` for what is stored.");
    Ok(())
}
