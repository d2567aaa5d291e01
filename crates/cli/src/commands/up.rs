//! `tessera up --nodes N`: a local cluster of N node processes on 127.0.0.1, with data and
//! configuration under the data directory. Running it again restarts the same cluster.

use super::node::wait_for_shutdown;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tessera_server::config::{ReplicaSettings, StoreSettings};
use tessera_server::{ClusterClient, NodeConfig, NodeId, Peer};

pub struct UpOptions {
    pub nodes: u64,
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
    pub memtable_flush_bytes: Option<usize>,
    pub checkpoint_log_bytes: Option<usize>,
}

impl UpOptions {
    /// A cluster of `nodes` with `replication` copies and every other setting at its default.
    pub fn new(nodes: u64, partitions: u32, replication: u32) -> UpOptions {
        UpOptions {
            nodes,
            base_port: 0,
            pg_base_port: None,
            http_base_port: None,
            flightsql_base_port: None,
            partitions,
            replication,
            delta_recovery: true,
            hot_standby: false,
            memtable_flush_bytes: None,
            checkpoint_log_bytes: None,
        }
    }
}

/// Writes (or reuses) the node configurations of a local cluster under `root`.
pub fn local_configs(root: &Path, options: &UpOptions) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let root = root.canonicalize()?;
    let existing = root.join("node-1").join("node.toml");
    if existing.exists() {
        let first = NodeConfig::load(&existing)?;
        if first.peers.len() as u64 != options.nodes {
            bail!(
                "{} holds a {}-node cluster; use --nodes {} or another --data-dir",
                root.display(),
                first.peers.len(),
                first.peers.len()
            );
        }
        return Ok((1..=options.nodes)
            .map(|id| root.join(format!("node-{id}")).join("node.toml"))
            .collect());
    }
    let cluster_id = format!("local-{:08x}", rand::random::<u32>());
    let peers: Vec<Peer> = (1..=options.nodes)
        .map(|id| Peer {
            id: NodeId(id),
            addr: format!("127.0.0.1:{}", options.base_port as u64 + id - 1)
                .parse()
                .expect("loopback address"),
        })
        .collect();
    let mut paths = Vec::new();
    for peer in &peers {
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
            peers: peers.clone(),
            voters: None,
            partitions: options.partitions,
            replication: options.replication,
            store: StoreSettings {
                memtable_flush_bytes: options.memtable_flush_bytes,
                checkpoint_log_bytes: options.checkpoint_log_bytes,
                ..Default::default()
            },
            replicas: ReplicaSettings {
                hot_standby: options.hot_standby,
                delta_recovery: options.delta_recovery,
            },
            failure: Default::default(),
            exec: Default::default(),
        };
        let path = dir.join("node.toml");
        std::fs::write(&path, toml::to_string(&config)?)?;
        paths.push(path);
    }
    Ok(paths)
}

pub async fn run(root: &Path, options: UpOptions) -> Result<()> {
    let configs = local_configs(root, &options)?;
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children: Vec<Child> = Vec::new();
    for config in &configs {
        let child = Command::new(&exe)
            .arg("node")
            .arg("--config")
            .arg(config)
            .spawn()
            .with_context(|| format!("starting a node with {}", config.display()))?;
        children.push(child);
    }
    let result = wait_until_formed(&configs, &mut children).await;
    match result {
        Ok(()) => {
            println!(
                "cluster of {} nodes up in {:.1} s (data under {}):",
                configs.len(),
                started.elapsed().as_secs_f64(),
                root.display()
            );
            for config in &configs {
                let config = NodeConfig::load(config)?;
                let mut line = format!("  node {}: RPC {}", config.node_id, config.listen);
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
            if let Some(pg) = NodeConfig::load(&configs[0])?.pg_listen {
                println!(
                    "connect with: psql -h {} -p {} (any node)",
                    pg.ip(),
                    pg.port()
                );
            }
            println!(
                "connect with: tessera --node {} sql",
                NodeConfig::load(&configs[0])?.listen
            );
            println!("Ctrl-C stops the cluster.");
            wait_for_shutdown().await;
        }
        Err(ref error) => eprintln!("error: {error:#}"),
    }
    stop(&mut children);
    result
}

/// Waits until every node answers, each knows the leader, and the metadata lists them all
/// alive.
async fn wait_until_formed(configs: &[PathBuf], children: &mut [Child]) -> Result<()> {
    let clients: Vec<ClusterClient> = configs
        .iter()
        .map(|c| Ok(ClusterClient::new(&NodeConfig::load(c)?.listen.to_string())))
        .collect::<Result<_>>()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for (child, config) in children.iter_mut().zip(configs) {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the node configured by {} exited ({status})",
                    config.display()
                );
            }
        }
        if formed(&clients).await {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the cluster did not form within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// True when every node answers, knows a leader, and sees all of them alive.
pub async fn formed(clients: &[ClusterClient]) -> bool {
    for client in clients {
        match client.status().await {
            Ok(status)
                if status.leader.is_some() && status.meta.live_nodes().count() == clients.len() => {
            }
            _ => return false,
        }
    }
    true
}

/// Stops every node with SIGTERM, then SIGKILL after a grace period.
fn stop(children: &mut [Child]) {
    for child in children.iter() {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for child in children.iter_mut() {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Ok(None) = child.try_wait() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    println!("cluster stopped");
}

/// `127.0.0.1:(base + id - 1)`: node `id`'s port in a local cluster.
fn loopback(base: u16, id: NodeId) -> std::net::SocketAddr {
    format!("127.0.0.1:{}", base as u64 + id.0 - 1)
        .parse()
        .expect("loopback address")
}
