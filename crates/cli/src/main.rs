//! `tessera`: the command-line front of Tessera. Thin by design: every command parses its
//! flags and calls into the library crates.

mod commands;
mod logging;
mod output;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use commands::target::Target;
use std::path::PathBuf;
use std::sync::Arc;
use tessera_storage::{Store, StoreConfig};

// Every node, and the CLI, allocate with jemalloc: see `tessera_common::allocator` for why.
tessera_common::allocate_with_jemalloc!();

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Tessera: a replicated, versioned SQL store"
)]
struct Cli {
    /// Where this node keeps its data.
    #[arg(
        long,
        global = true,
        default_value = "./tessera-data",
        env = "TESSERA_DATA_DIR"
    )]
    data_dir: PathBuf,
    /// Work against a running cluster through the node at this address (host:port)
    /// instead of the local data directory (sql, load, publish, status).
    #[arg(long, global = true, env = "TESSERA_NODE")]
    node: Option<String>,
    /// For a cluster whose internal port is under mutual TLS: the directory with its CA and
    /// this client's certificate (ca.pem, admin.pem, admin.key, as `tessera certs` or
    /// `tessera up` writes them). Default: <data-dir>/certs when it holds them.
    #[arg(long, global = true, env = "TESSERA_CERTS")]
    certs: Option<PathBuf>,
    /// Whose certificate in the --certs directory to present (NAME.pem, NAME.key, as
    /// `tessera certs client --name NAME` writes them): the cluster runs this CLI's
    /// statements and publishes as user NAME, with NAME's rights. Default: admin, the
    /// cluster's operator.
    #[arg(long = "as", global = true, env = "TESSERA_USER", value_name = "NAME")]
    as_user: Option<String>,
    #[command(flatten)]
    store: StoreFlags,
    #[command(subcommand)]
    command: Command,
}

/// Storage settings; defaults are documented in `StoreConfig`.
#[derive(clap::Args, Clone)]
struct StoreFlags {
    /// Partitions of the hash ring (fixed when a store is created).
    #[arg(long, global = true, default_value_t = tessera_common::DEFAULT_PARTITIONS)]
    partitions: u32,
    /// Checkpoint once in-memory components hold this many bytes.
    #[arg(long, global = true, default_value_t = StoreConfig::DEFAULT_MEMTABLE_FLUSH_BYTES)]
    memtable_flush_bytes: usize,
    /// Publishes at least this large write components directly instead of the log.
    #[arg(long, global = true, default_value_t = StoreConfig::DEFAULT_BULK_PUBLISH_BYTES)]
    bulk_publish_bytes: usize,
    /// Merge a partition's components once it has more than this many.
    #[arg(long, global = true, default_value_t = StoreConfig::DEFAULT_MERGE_THRESHOLD)]
    merge_threshold: usize,
}

impl StoreFlags {
    fn config(&self) -> StoreConfig {
        StoreConfig {
            partitions: self.partitions,
            memtable_flush_bytes: self.memtable_flush_bytes,
            bulk_publish_bytes: self.bulk_publish_bytes,
            merge_threshold: self.merge_threshold,
            ..StoreConfig::default()
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// The whole story: a local 3-node cluster (r = 3) with TPC-H loaded, distributed
    /// queries, a node killed mid-query, its delta catch-up, and time travel.
    Demo {
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// One store in this process instead of a cluster.
        #[arg(long)]
        local: bool,
        /// Stop the cluster when the story ends instead of leaving it up until Ctrl-C.
        #[arg(long)]
        exit: bool,
        #[command(flatten)]
        ports: LocalPorts,
    },
    /// Run SQL: an interactive prompt, or the statements given with -c.
    Sql {
        /// Statements to run instead of starting the prompt (they may start with a
        /// `-- comment`).
        #[arg(short = 'c', long = "command", allow_hyphen_values = true)]
        command: Option<String>,
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Write a table, as it is now or at a point of its history, to a Parquet or CSV file
    /// here (in SQL: `COPY (query) TO 'file.parquet'`).
    Export {
        #[arg(long)]
        table: String,
        /// An epoch number, a tag, or a timestamp ('2026-11-20 10:00', UTC).
        #[arg(long)]
        as_of: Option<String>,
        /// The file to write; its extension names the format unless --format does.
        #[arg(long, short = 'o')]
        output: PathBuf,
        #[arg(long, value_enum)]
        format: Option<commands::export::ExportFormat>,
    },
    /// Generate a data set in-process and publish it.
    Load {
        #[command(subcommand)]
        dataset: LoadDataset,
    },
    /// Publish rows from Parquet or CSV files as one new epoch.
    Publish {
        #[arg(long)]
        table: String,
        /// The files hold keys to delete instead of rows to upsert.
        #[arg(long)]
        delete: bool,
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Flush memory to components and trim the log.
    Checkpoint,
    /// Merge every partition down to one component, as `load` ends: for a table that a
    /// bulk load left in several (with --node, every live node settles and ships its
    /// partitions to their standbys).
    Settle,
    /// Tables, rows, components and the visible epoch; with --node, the cluster: nodes,
    /// liveness, partitions, primaries, replicas and epochs.
    Status,
    /// Run one node of a cluster, configured by a TOML file (see the README).
    Node {
        #[arg(long)]
        config: PathBuf,
        /// Overrides a setting of the file by its dotted path, e.g.
        /// `--set failure.timeout_ms=3000` (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
        /// This node's data is gone (a wiped or replaced disk): rejoin empty, the cluster
        /// copying its partitions to it from the other replicas. Only on a new data
        /// directory; a node that finds its data gone refuses to start without it.
        #[arg(long)]
        replace: bool,
    },
    /// Move a node's partitions to the other members and retire it (needs --node).
    Decommission {
        /// The node to retire.
        id: u64,
    },
    /// Start a local cluster of node processes on 127.0.0.1, data under --data-dir.
    Up {
        #[arg(long, default_value_t = 3)]
        nodes: u64,
        /// Compute-only nodes besides them (ids after the storage nodes'): they hold no
        /// partitions and take query channels.
        #[arg(long, default_value_t = 0)]
        compute: u64,
        #[command(flatten)]
        ports: LocalPorts,
        /// Copies of each partition.
        #[arg(long, default_value_t = 3)]
        replication: u32,
        /// Plaintext on the internal port (development only) instead of mutual TLS with
        /// certificates made under --data-dir/certs.
        #[arg(long)]
        insecure: bool,
    },
    /// Check a cluster's data against its signed, chained version ids (needs --node): each
    /// table's chain, each epoch's signature, and every up-to-date replica's rows. A
    /// corrupt replica is refused and copied again whole from a good one.
    Verify {
        /// Only this table.
        #[arg(long)]
        table: Option<String>,
        /// Only this epoch's rows and signature (chains are always checked whole).
        #[arg(long)]
        epoch: Option<u64>,
        /// Report corrupt replicas without refusing them.
        #[arg(long)]
        no_repair: bool,
    },
    /// Have every live node hash its components again now and repair the damaged ones
    /// from other replicas (needs --node); prints what each checked and repaired.
    Scrub,
    /// Participants' signing keys (ed25519), with which they sign the epochs they publish.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Certificates for mutual TLS on the internal port: the cluster's CA, nodes', clients'.
    Certs {
        #[command(subcommand)]
        action: CertsAction,
    },
    /// Benchmarks that print Tessera against a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        bench: BenchKind,
    },
    /// Tools for tests; not for production use.
    #[command(hide = true)]
    Debug {
        #[command(subcommand)]
        tool: DebugTool,
    },
}

#[derive(Subcommand)]
enum KeysAction {
    /// Make a participant's secret key (PARTICIPANT.ed25519) and print its public key.
    New {
        #[arg(long)]
        participant: String,
        /// The keys directory of a node of the participant (default: --data-dir/keys).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum CertsAction {
    /// Make the cluster's CA (ca.pem, ca.key) in --dir; keep ca.key safe.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// A name for the CA's subject.
        #[arg(long, default_value = "tessera")]
        cluster: String,
    },
    /// Issue node ID's certificate (node-ID.pem, node-ID.key), signed by the CA in --dir.
    Node {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        id: u64,
        /// The node's address (host or IP, a port is ignored); repeat for several.
        #[arg(long = "addr")]
        addrs: Vec<String>,
        /// The last day it is valid, YYYY-MM-DD (default: a year from now).
        #[arg(long)]
        not_after: Option<String>,
    },
    /// Issue a client's certificate (NAME.pem, NAME.key): an administrator's CLI, a tool.
    Client {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value = commands::certs::ADMIN)]
        name: String,
        /// The last day it is valid, YYYY-MM-DD (default: a year from now).
        #[arg(long)]
        not_after: Option<String>,
    },
}

/// Where the nodes of a local cluster (`up`, `demo`) listen: node i on each base + i - 1.
#[derive(clap::Args, Clone, Copy)]
struct LocalPorts {
    /// Node i listens on base-port + i - 1.
    #[arg(long, default_value_t = 7001)]
    base_port: u16,
    /// Node i serves PostgreSQL clients (psql, drivers) on pg-port + i - 1.
    #[arg(long, default_value_t = 5433)]
    pg_port: u16,
    /// Node i serves HTTP (the console, Prometheus metrics at /metrics) on
    /// http-port + i - 1.
    #[arg(long, default_value_t = 8080)]
    http_port: u16,
    /// Node i serves Arrow Flight SQL (ADBC, JDBC) on flightsql-port + i - 1.
    #[arg(long, default_value_t = 32010)]
    flightsql_port: u16,
}

impl LocalPorts {
    fn options(&self, nodes: u64, partitions: u32, replication: u32) -> commands::up::UpOptions {
        commands::up::UpOptions {
            base_port: self.base_port,
            pg_base_port: Some(self.pg_port),
            http_base_port: Some(self.http_port),
            flightsql_base_port: Some(self.flightsql_port),
            ..commands::up::UpOptions::new(nodes, partitions, replication)
        }
    }
}

#[derive(Subcommand)]
enum LoadDataset {
    /// TPC-H at a scale factor.
    Tpch {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Comma-separated tables to load (default: all eight).
        #[arg(long, value_delimiter = ',')]
        tables: Vec<String>,
    },
}

#[derive(Subcommand)]
enum BenchKind {
    /// All 22 TPC-H queries on Tessera and on plain DataFusion over the same data.
    Tpch {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Comma-separated query numbers (default: all 22).
        #[arg(long, value_delimiter = ',')]
        queries: Vec<usize>,
        /// Timed runs per query and engine; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Run on a local cluster of this many nodes, against a 1-node cluster and plain
        /// DataFusion (without it: one local store against plain DataFusion).
        #[arg(long)]
        nodes: Option<u64>,
        /// With --nodes: run every query once more under this per-query memory limit
        /// (e.g. '256MB'), checking its answer and counting the bytes spilled.
        #[arg(long, requires = "nodes")]
        memory_limit: Option<String>,
        /// Without --nodes: also run at this smaller scale factor first, and print how each
        /// query's time grew from it on both engines (e.g. --sf 10 --growth-from 1).
        #[arg(long, conflicts_with = "nodes")]
        growth_from: Option<f64>,
        /// Without --nodes: load each table as this many publishes of consecutive rows and
        /// leave them unmerged, as a table appended to over time is read before its merges.
        #[arg(long, conflicts_with = "nodes")]
        publishes_per_table: Option<usize>,
    },
    /// Surviving a node failure mid-query: lineage's overhead against none, and restart
    /// against lineage with a node SIGKILLed at 50% of each query's no-failure time.
    Recovery {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Comma-separated query numbers.
        #[arg(long, value_delimiter = ',', default_value = "1,3,5,6,9,10,18")]
        queries: Vec<usize>,
        /// Runs per query and mode, without failures and with a node killed; the medians are reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[arg(long, default_value_t = 4)]
        nodes: u64,
        /// Update half of lineitem after the load, settle every node (each partition merged
        /// into its current versions and their history), and read every table `AS OF` the
        /// load's epoch: under lineage each partition's rows then come in key order, under
        /// none and restart in the order they were logged.
        #[arg(long)]
        as_of: bool,
    },
    /// TPC-H through each client path on a 3-node cluster: Flight SQL (what ADBC speaks)
    /// and the PostgreSQL wire protocol (as psql) as ratios to Tessera's internal client.
    Clients {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Comma-separated query numbers (default: all 22).
        #[arg(long, value_delimiter = ',')]
        queries: Vec<usize>,
        /// Timed runs per query and client; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// The diff between two epochs of lineitem that differ by about 1% of its rows
    /// (`tessera_changes`) against a full scan of both epochs and a full outer join of them.
    Diff {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// What kept versions cost a read of the newest epoch: Q1 and Q6 after each round of
    /// updates to a tenth of lineitem (every version kept), as ratios to the time with one
    /// version, in the same process.
    Versions {
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// Rounds of updates.
        #[arg(long, default_value_t = 20)]
        rounds: usize,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// What mutual TLS on the internal port costs: TPC-H and publish time on two 3-node
    /// clusters, one under mTLS and one plaintext, in turn.
    Security {
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// Queries to run (default: all 22), e.g. --queries 1,3,5.
        #[arg(long, value_delimiter = ',')]
        queries: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Publishes timed on each cluster (in turn, each after both clusters went quiet).
        #[arg(long, default_value_t = 9)]
        publishes: usize,
    },
    /// TPC-H on a cluster of storage nodes alone against the same with compute-only nodes
    /// added, in turn: times, and the share of channels that ran on the compute nodes.
    Compute {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Storage nodes (both clusters).
        #[arg(long, default_value_t = 3)]
        nodes: u64,
        /// Compute-only nodes added to the second cluster.
        #[arg(long, default_value_t = 2)]
        compute: u64,
        /// Queries to run (default: all 22), e.g. --queries 1,3,5.
        #[arg(long, value_delimiter = ',')]
        queries: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// The erasure-coded archive: bytes on disk per logical byte (replicas vs archive), and
    /// the time to read an archived epoch vs the same epoch from the replicas; with
    /// --compute-sf, also `bench compute`'s TPC-H comparison.
    Archive {
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// Storage nodes (at least k + m of `[archive]`: 6 by default).
        #[arg(long, default_value_t = 6)]
        nodes: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Also run TPC-H at this scale on 3 storage nodes alone vs with 2 compute nodes
        /// (0: skip).
        #[arg(long, default_value_t = 0.0)]
        compute_sf: f64,
    },
    /// The metadata's cost per publish as the cluster's history grows (every node applies
    /// each entry and publishes a view of the state), against a young cluster's.
    Meta {
        /// Epochs of history to build up.
        #[arg(long, default_value_t = 100_000)]
        epochs: u64,
    },
    /// Cluster formation time, leader failover time, and publish rows/s on 1 vs 3 nodes.
    Cluster {
        /// Scale factor of the lineitem rows published.
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Publish rows/s with 1, 2 and 3 replicas, failover time, and failback time with delta
    /// recovery against a full copy, on a 3-node local cluster.
    Replication {
        /// Scale factor of the lineitem rows published.
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
}

#[derive(Subcommand)]
enum DebugTool {
    /// Publish numbered epochs to table `kv` forever, printing `ACK <n> <epoch>` for each.
    PublishLoop {
        #[arg(long, default_value_t = 64)]
        rows: i64,
        /// Every this many publishes, publish a large batch that takes the bulk path.
        #[arg(long, default_value_t = 7)]
        bulk_every: i64,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Format {
    Table,
    Csv,
    Json,
}

fn open_store(cli: &Cli) -> Result<Arc<Store>> {
    Ok(Store::open(&cli.data_dir, cli.store.config())?)
}

/// The cluster node named by --node, or the local store.
fn target(cli: &Cli) -> Result<Target> {
    Ok(match &cli.node {
        Some(addr) => Target::cluster(addr),
        None => Target::local(open_store(cli)?),
    })
}

fn main() {
    logging::init();
    let cli = Cli::parse();
    tessera_common::tls::install_ring_provider();
    // More workers than cores: a long CPU-bound poll (a query operator, a large batch) then
    // cannot starve the tasks that answer heartbeats and Raft, and the OS shares the cores.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores.max(4) * 2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(error) = runtime.block_on(run(cli)) {
        eprintln!("error: {}", one_message(&error));
        std::process::exit(1);
    }
}

/// The error as one message: each cause said once (a wrapper's text often repeats its
/// source's), and SQL errors without DataFusion's category prefixes.
fn one_message(error: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        let (text, last) = match cause.downcast_ref::<tessera_sql::SqlError>() {
            // It says its own causes; a wrapper above that quoted it whole says it short.
            Some(sql) => {
                let short = tessera_sql::error::one_message(sql);
                message = message.replace(&text, &short);
                (short, true)
            }
            None => (text, false),
        };
        if message.is_empty() {
            message = text;
        } else if !message.contains(&text) {
            message = format!("{message}: {text}");
        }
        if last {
            break;
        }
    }
    message
}

/// `tessera certs ...`.
fn certs(action: &CertsAction) -> Result<()> {
    use commands::certs::{Expiry, DEFAULT_VALID_DAYS};
    let expiry = |not_after: &Option<String>| match not_after {
        Some(date) => Expiry::parse(date),
        None => Ok(Expiry::Days(DEFAULT_VALID_DAYS)),
    };
    let written = match action {
        CertsAction::Init { dir, cluster } => commands::certs::init(dir, cluster)?,
        CertsAction::Node {
            dir,
            id,
            addrs,
            not_after,
        } => {
            let hosts: Vec<String> = addrs
                .iter()
                .map(|addr| match addr.parse::<std::net::SocketAddr>() {
                    Ok(socket) => socket.ip().to_string(),
                    Err(_) => addr
                        .rsplit_once(':')
                        .map_or(addr.as_str(), |(host, _)| host)
                        .to_string(),
                })
                .collect();
            commands::certs::node(dir, tessera_common::NodeId(*id), &hosts, expiry(not_after)?)?
        }
        CertsAction::Client {
            dir,
            name,
            not_after,
        } => commands::certs::client(dir, name, expiry(not_after)?)?,
    };
    println!("wrote {} and its key", written.display());
    Ok(())
}

/// This process's client certificate for clusters under mutual TLS: from --certs, or
/// <data-dir>/certs when it holds one.
fn client_certs(cli: &Cli) -> Result<()> {
    let admin = commands::certs::ADMIN;
    let dir = match &cli.certs {
        Some(dir) => dir.clone(),
        None => {
            let dir = cli.data_dir.join("certs");
            if !dir.join(format!("{admin}.pem")).exists() {
                if let Some(name) = &cli.as_user {
                    anyhow::bail!(
                        "--as {name} presents {name}'s client certificate from a certificates directory: give it with --certs DIR"
                    );
                }
                return Ok(());
            }
            dir
        }
    };
    let name = cli.as_user.as_deref().unwrap_or(admin);
    let tls = tessera_common::tls::MutualTls::from_dir(&dir, name)
        .map_err(|e| anyhow::anyhow!("--certs {} --as {name}: {e}", dir.display()))?;
    tessera_server::client::set_default_tls(Some(tls));
    Ok(())
}

async fn run(cli: Cli) -> Result<()> {
    client_certs(&cli)?;
    match &cli.command {
        Command::Demo {
            sf, local: true, ..
        } => commands::demo::run_local(open_store(&cli)?, *sf).await,
        Command::Demo {
            sf,
            local: false,
            exit,
            ports,
        } => {
            let nodes = commands::demo::NODES;
            let options = commands::demo::DemoOptions {
                sf: *sf,
                cluster: ports.options(nodes, cli.store.partitions, nodes as u32),
                stay_up: !exit,
            };
            commands::demo::run(&cli.data_dir, options).await
        }
        Command::Sql { command, format } => {
            commands::sql::run(target(&cli)?, command.as_deref(), *format).await
        }
        Command::Export {
            table,
            as_of,
            output,
            format,
        } => commands::export::run(target(&cli)?, table, as_of.as_deref(), output, *format).await,
        Command::Load {
            dataset: LoadDataset::Tpch { sf, tables },
        } => commands::load::tpch(&target(&cli)?, *sf, tables, true).await,
        Command::Publish {
            table,
            delete,
            files,
        } => commands::publish::run(target(&cli)?, table, *delete, files).await,
        Command::Node {
            config,
            overrides,
            replace,
        } => commands::node::run(config, overrides, *replace).await,
        Command::Decommission { id } => {
            let Some(addr) = &cli.node else {
                anyhow::bail!("decommission works on a cluster: give --node ADDR of any member");
            };
            tessera_server::ClusterClient::new(addr)
                .decommission(*id)
                .await?;
            println!("node {id} is leaving: its partitions are moving to the other members; `tessera --node {addr} status` shows it removed when done");
            Ok(())
        }
        Command::Up {
            nodes,
            compute,
            ports,
            replication,
            insecure,
        } => {
            let mut options = ports.options(*nodes, cli.store.partitions, *replication);
            options.insecure = *insecure;
            options.compute = *compute;
            commands::up::run(&cli.data_dir, options).await
        }
        Command::Certs { action } => certs(action),
        Command::Verify {
            table,
            epoch,
            no_repair,
        } => {
            let Some(addr) = &cli.node else {
                anyhow::bail!("verify works on a cluster: give --node ADDR of any member");
            };
            commands::verify::run(addr, table.clone(), *epoch, !no_repair).await
        }
        Command::Scrub => {
            let Some(addr) = &cli.node else {
                anyhow::bail!("scrub works on a cluster: give --node ADDR of any member");
            };
            commands::scrub::run(addr).await
        }
        Command::Keys {
            action: KeysAction::New { participant, dir },
        } => {
            let dir = dir
                .clone()
                .unwrap_or_else(|| cli.data_dir.join(tessera_server::node::KEYS_DIR));
            commands::keys::new_key(&dir, participant)
        }
        Command::Checkpoint => {
            let store = open_store(&cli)?;
            store.checkpoint()?;
            println!("checkpoint done; visible epoch {}", store.visible_epoch());
            Ok(())
        }
        Command::Settle => {
            target(&cli)?.settle().await?;
            println!("settled: every partition in one component");
            Ok(())
        }
        Command::Status => match &cli.node {
            Some(addr) => commands::cluster_status::run(addr).await,
            None => commands::status::run(open_store(&cli)?),
        },
        Command::Bench {
            bench:
                BenchKind::Tpch {
                    sf,
                    queries,
                    runs,
                    nodes,
                    memory_limit,
                    growth_from,
                    publishes_per_table,
                },
        } => match nodes {
            Some(nodes) => {
                commands::bench_distributed::run(
                    &cli.data_dir,
                    *nodes,
                    cli.store.partitions,
                    *sf,
                    queries,
                    *runs,
                    memory_limit.as_deref(),
                )
                .await
            }
            None => {
                commands::bench::tpch(
                    &cli.data_dir,
                    cli.store.config(),
                    *sf,
                    queries,
                    *runs,
                    *growth_from,
                    *publishes_per_table,
                )
                .await
            }
        },
        Command::Bench {
            bench:
                BenchKind::Recovery {
                    sf,
                    queries,
                    runs,
                    nodes,
                    as_of,
                },
        } => {
            commands::bench_recovery::run(
                &cli.data_dir,
                *nodes,
                cli.store.partitions,
                *sf,
                queries,
                *runs,
                *as_of,
            )
            .await
        }
        Command::Bench {
            bench: BenchKind::Clients { sf, queries, runs },
        } => {
            commands::bench_clients::run(&cli.data_dir, cli.store.partitions, *sf, queries, *runs)
                .await
        }
        Command::Bench {
            bench: BenchKind::Diff { sf, runs },
        } => commands::bench_diff::run(&cli.data_dir, cli.store.config(), *sf, *runs).await,
        Command::Bench {
            bench: BenchKind::Versions { sf, rounds, runs },
        } => {
            commands::bench_versions::run(&cli.data_dir, cli.store.config(), *sf, *rounds, *runs)
                .await
        }
        Command::Bench {
            bench:
                BenchKind::Security {
                    sf,
                    queries,
                    runs,
                    publishes,
                },
        } => {
            commands::bench_security::run(
                &cli.data_dir,
                cli.store.partitions,
                *sf,
                queries,
                *runs,
                *publishes,
            )
            .await
        }
        Command::Bench {
            bench:
                BenchKind::Compute {
                    sf,
                    nodes,
                    compute,
                    queries,
                    runs,
                },
        } => {
            commands::bench_compute::run(
                &cli.data_dir,
                *nodes,
                *compute,
                cli.store.partitions,
                *sf,
                queries,
                *runs,
            )
            .await
        }
        Command::Bench {
            bench: BenchKind::Meta { epochs },
        } => commands::bench_meta::run(*epochs),
        Command::Bench {
            bench:
                BenchKind::Archive {
                    sf,
                    nodes,
                    runs,
                    compute_sf,
                },
        } => {
            commands::bench_archive::run(
                &cli.data_dir,
                *nodes,
                cli.store.partitions,
                *sf,
                *runs,
                *compute_sf,
            )
            .await
        }
        Command::Bench {
            bench: BenchKind::Cluster { sf, runs },
        } => commands::bench_cluster::run(&cli.data_dir, *sf, cli.store.partitions, *runs).await,
        Command::Bench {
            bench: BenchKind::Replication { sf, runs },
        } => {
            commands::bench_replication::run(&cli.data_dir, *sf, cli.store.partitions, *runs).await
        }
        Command::Debug {
            tool: DebugTool::PublishLoop { rows, bulk_every },
        } => commands::publish_loop::run(open_store(&cli)?, *rows, *bulk_every).await,
    }
}
