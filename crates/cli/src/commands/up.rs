//! `tessera up --nodes N [--compute M]`: a local cluster of N storage node processes (and M
//! compute-only ones) on 127.0.0.1, with data and configuration under the data directory.
//! Running it again restarts the same cluster.

use super::local_cluster::{LocalCluster, NodeOutput};
use super::node::wait_for_shutdown;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tessera_server::config::{
    ExecSettings, MtlsSettings, NodeRole, ReplicaSettings, StoreSettings,
};
use tessera_server::{NodeConfig, NodeId, Peer};

pub struct UpOptions {
    /// Storage nodes: ids 1 to `nodes`.
    pub nodes: u64,
    /// Compute-only nodes after them: ids `nodes + 1` to `nodes + compute`.
    pub compute: u64,
    pub base_port: u16,
    /// Node i serves PostgreSQL clients on this + i - 1; none when unset.
    pub pg_base_port: Option<u16>,
    /// Node i serves HTTP (console, metrics) on this + i - 1; none when unset.
    pub http_base_port: Option<u16>,
    /// Node i serves Flight SQL on this + i - 1; none when unset.
    pub flightsql_base_port: Option<u16>,
    pub partitions: u32,
    pub replication: u32,
    pub delta_recovery: bool,
    pub hot_standby: bool,
    /// Publishes record version ids and signatures (off only for a benchmark's baseline).
    pub version_ids: bool,
    pub memtable_flush_bytes: Option<usize>,
    pub checkpoint_log_bytes: Option<usize>,
    /// `store.idle_checkpoint_ms` (0: no idle checkpoints).
    pub idle_checkpoint_ms: Option<u64>,
    /// Plaintext on the internal port instead of mutual TLS (certificates made under the
    /// data directory's `certs`).
    pub insecure: bool,
}

impl UpOptions {
    /// A cluster of `nodes` with `replication` copies and every other setting at its default.
    pub fn new(nodes: u64, partitions: u32, replication: u32) -> UpOptions {
        UpOptions {
            nodes,
            compute: 0,
            base_port: 0,
            pg_base_port: None,
            http_base_port: None,
            flightsql_base_port: None,
            partitions,
            replication,
            delta_recovery: true,
            hot_standby: false,
            version_ids: true,
            memtable_flush_bytes: None,
            checkpoint_log_bytes: None,
            idle_checkpoint_ms: None,
            insecure: false,
        }
    }

    /// Every node, storage and compute.
    pub fn all_nodes(&self) -> u64 {
        self.nodes + self.compute
    }
}

/// Writes (or reuses) the node configurations of a local cluster under `root`.
pub fn local_configs(root: &Path, options: &UpOptions) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let root = root.canonicalize()?;
    let existing = root.join("node-1").join("node.toml");
    if existing.exists() {
        let first = NodeConfig::load(&existing)?;
        let compute = (first.peers.len() as u64 + 1..)
            .take_while(|id| root.join(format!("node-{id}")).join("node.toml").exists())
            .count();
        if first.peers.len() as u64 != options.nodes || compute as u64 != options.compute {
            bail!(
                "{} holds a cluster of {} storage and {compute} compute nodes; use --nodes {} --compute {compute} or another --data-dir",
                root.display(),
                first.peers.len(),
                first.peers.len()
            );
        }
        return Ok((1..=options.all_nodes())
            .map(|id| root.join(format!("node-{id}")).join("node.toml"))
            .collect());
    }
    let cluster_id = format!("local-{:08x}", rand::random::<u32>());
    let all: Vec<Peer> = (1..=options.all_nodes())
        .map(|id| Peer {
            id: NodeId(id),
            addr: format!("127.0.0.1:{}", options.base_port as u64 + id - 1)
                .parse()
                .expect("loopback address"),
        })
        .collect();
    // Storage nodes found the cluster; a compute node lists them and itself, and joins.
    let founders = &all[..options.nodes as usize];
    let certs = root.join("certs");
    if !options.insecure {
        let ids: Vec<NodeId> = all.iter().map(|p| p.id).collect();
        super::certs::ensure_local(&certs, &cluster_id, &ids)?;
    }
    let mut paths = Vec::new();
    for peer in &all {
        let compute = peer.id.0 > options.nodes;
        let mut peers = founders.to_vec();
        if compute {
            peers.push(peer.clone());
        }
        let dir = root.join(format!("node-{}", peer.id));
        std::fs::create_dir_all(&dir)?;
        let config = NodeConfig {
            cluster_id: cluster_id.clone(),
            node_id: peer.id,
            listen: peer.addr,
            pg_listen: options.pg_base_port.map(|base| loopback(base, peer.id)),
            http_listen: options.http_base_port.map(|base| loopback(base, peer.id)),
            flightsql_listen: options
                .flightsql_base_port
                .map(|base| loopback(base, peer.id)),
            pg_max_connections: 256,
            flightsql_max_connections: 256,
            tls_cert: None,
            tls_key: None,
            data_dir: PathBuf::from("data"),
            peers,
            voters: None,
            partitions: options.partitions,
            replication: options.replication,
            role: if compute {
                NodeRole::Compute
            } else {
                NodeRole::Storage
            },
            store: StoreSettings {
                memtable_flush_bytes: options.memtable_flush_bytes,
                checkpoint_log_bytes: options.checkpoint_log_bytes,
                idle_checkpoint_ms: options.idle_checkpoint_ms,
                ..Default::default()
            },
            replicas: ReplicaSettings {
                hot_standby: options.hot_standby,
                delta_recovery: options.delta_recovery,
                version_ids: options.version_ids,
                ..Default::default()
            },
            failure: Default::default(),
            // The nodes share this machine: each keeps its share of a decoded cache.
            exec: ExecSettings::sharing_machine(all.len()),
            scrub: Default::default(),
            archive: Default::default(),
            replace: false,
            insecure: options.insecure,
            mtls: (!options.insecure).then(|| MtlsSettings {
                ca: certs.join("ca.pem"),
                cert: certs.join(format!("node-{}.pem", peer.id.0)),
                key: certs.join(format!("node-{}.key", peer.id.0)),
            }),
        };
        let path = dir.join("node.toml");
        std::fs::write(&path, toml::to_string(&config)?)?;
        paths.push(path);
    }
    Ok(paths)
}

pub async fn run(root: &Path, options: UpOptions) -> Result<()> {
    let started = Instant::now();
    let mut cluster = LocalCluster::start(root, &options, NodeOutput::Inherit)?;
    let result = cluster
        .wait_formed(Duration::from_secs(60))
        .await
        .map(|_leader| ());
    match result {
        Ok(()) => {
            println!(
                "cluster of {} nodes up in {:.1} s (data under {}):",
                cluster.configs().len(),
                started.elapsed().as_secs_f64(),
                root.display()
            );
            print_endpoints(cluster.configs())?;
            print_connect_hints(cluster.configs())?;
            println!("Ctrl-C stops the cluster.");
            wait_for_shutdown().await;
        }
        Err(ref error) => eprintln!("error: {error:#}"),
    }
    cluster.stop();
    println!("cluster stopped");
    result
}

/// Prints every node's endpoints.
pub fn print_endpoints(configs: &[PathBuf]) -> Result<()> {
    for config in configs {
        let config = NodeConfig::load(config)?;
        let role = match config.role {
            NodeRole::Compute => " (compute)",
            NodeRole::Storage => "",
        };
        let mut line = format!("  node {}{role}: RPC {}", config.node_id, config.listen);
        if let Some(pg) = config.pg_listen {
            line.push_str(&format!(", SQL (PostgreSQL) {pg}"));
        }
        if let Some(flightsql) = config.flightsql_listen {
            line.push_str(&format!(", Flight SQL grpc://{flightsql}"));
        }
        if let Some(http) = config.http_listen {
            line.push_str(&format!(
                ", console http://{http}/, metrics http://{http}/metrics"
            ));
        }
        println!("{line}");
    }
    Ok(())
}

/// Prints how to connect to a local cluster.
fn print_connect_hints(configs: &[PathBuf]) -> Result<()> {
    let first = NodeConfig::load(&configs[0])?;
    if let Some(pg) = first.pg_listen {
        println!(
            "connect with: psql -h {} -p {} -U tessera (any node)",
            pg.ip(),
            pg.port()
        );
    }
    if let Some(http) = first.http_listen {
        println!("watch it at:  http://{http}/");
    }
    match &first.mtls {
        Some(mtls) => println!(
            "connect with: tessera --certs {} --node {} sql",
            mtls.ca.parent().unwrap_or(Path::new(".")).display(),
            first.listen
        ),
        None => println!("connect with: tessera --node {} sql", first.listen),
    }
    Ok(())
}

/// `127.0.0.1:(base + id - 1)`: node `id`'s port in a local cluster.
fn loopback(base: u16, id: NodeId) -> std::net::SocketAddr {
    format!("127.0.0.1:{}", base as u64 + id.0 - 1)
        .parse()
        .expect("loopback address")
}
