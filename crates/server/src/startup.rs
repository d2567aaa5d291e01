//! A node's start-up checks: which cluster and node its data directory belongs to, its
//! incarnation, its peers (the same cluster and protocol, at the addresses configured), and
//! a data directory that is new although the cluster has seen the node run (a wiped disk):
//! refused, or with `--replace` taken back empty.

use crate::error::{ClusterError, Result};
use crate::rpc::{CallError, Clients, Identity, Refusal, ACTION_HELLO};
use crate::NodeId;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_common::NodeConfig;

/// The format of a node's data directory; bumped on incompatible changes.
pub const DATA_FORMAT_VERSION: u32 = 1;
/// The directory, under a node's data directory, of the participants' secret signing keys it holds.
pub const KEYS_DIR: &str = "keys";
const IDENTITY_FILE: &str = "node.json";

/// Written into the data directory on first start, checked on every later one.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct DataIdentity {
    cluster_id: String,
    node_id: NodeId,
    format: u32,
    /// The node came back empty with `--replace` onto this directory: it joins the
    /// metadata group that exists and never founds one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    replaced: bool,
}

/// Checks the data directory belongs to this cluster and node: `None` if it is new (it has
/// no identity file yet, written by [`write_data_identity`] once the node may start), else
/// whether the node came back onto it as a replacement.
pub(crate) fn check_data_identity(dir: &Path, config: &NodeConfig) -> Result<Option<bool>> {
    let data_error = |reason: String| ClusterError::DataDir {
        dir: dir.display().to_string(),
        reason,
    };
    std::fs::create_dir_all(dir).map_err(|e| data_error(e.to_string()))?;
    let path = dir.join(IDENTITY_FILE);
    let ours = DataIdentity {
        cluster_id: config.cluster_id.clone(),
        node_id: config.node_id,
        format: DATA_FORMAT_VERSION,
        replaced: false,
    };
    match std::fs::read(&path) {
        Ok(bytes) => {
            let found: DataIdentity = serde_json::from_slice(&bytes)
                .map_err(|e| data_error(format!("{IDENTITY_FILE} is unreadable: {e}")))?;
            if found.format != DATA_FORMAT_VERSION {
                return Err(data_error(format!(
                    "written by data format version {}, this build reads version {DATA_FORMAT_VERSION}",
                    found.format
                )));
            }
            if found.cluster_id != ours.cluster_id {
                return Err(data_error(format!(
                    "belongs to cluster {:?}, but the configuration names cluster {:?}",
                    found.cluster_id, ours.cluster_id
                )));
            }
            if found.node_id != ours.node_id {
                return Err(data_error(format!(
                    "belongs to node {}, but the configuration says this is node {}",
                    found.node_id, ours.node_id
                )));
            }
            Ok(Some(found.replaced))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(data_error(e.to_string())),
    }
}

/// Marks the data directory as this cluster's and node's (`replaced`: it came back onto it
/// with `--replace`).
pub(crate) fn write_data_identity(dir: &Path, config: &NodeConfig) -> Result<()> {
    let ours = DataIdentity {
        cluster_id: config.cluster_id.clone(),
        node_id: config.node_id,
        format: DATA_FORMAT_VERSION,
        replaced: config.replace,
    };
    let bytes = serde_json::to_vec_pretty(&ours).expect("identity serializes");
    std::fs::write(dir.join(IDENTITY_FILE), bytes).map_err(|e| ClusterError::DataDir {
        dir: dir.display().to_string(),
        reason: e.to_string(),
    })
}

/// Present in a new data directory while its `--replace` is under way.
pub(crate) const REPLACING_FILE: &str = "REPLACING";

/// A node whose data is gone asks to be taken back empty ([`crate::node::Node::replace`]).
pub const ACTION_REPLACE_NODE: &str = "replace-node";

/// Begins the refusal of a replacement by the metadata itself (the node was the only
/// up-to-date replica of a partition): final, so the node stops asking.
pub(crate) const REPLACEMENT_REFUSED: &str = "the metadata refused to take this node back empty";

/// How long a replacement node keeps asking its peers to take it back.
const REPLACEMENT_PATIENCE: Duration = Duration::from_secs(120);

/// A node starting on a new data directory with `--replace`: has the metadata leader (through
/// any peer) forget what it held, before its own metadata member starts.
pub(crate) async fn request_replacement(config: &NodeConfig, clients: &Clients) -> Result<()> {
    let deadline = Instant::now() + REPLACEMENT_PATIENCE;
    let mut last = String::from("no peer answered");
    while Instant::now() < deadline {
        for peer in config.peers.iter().filter(|p| p.id != config.node_id) {
            let addr = peer.addr.to_string();
            let reply: std::result::Result<std::result::Result<(), Refusal>, CallError> = clients
                .action(
                    &addr,
                    ACTION_REPLACE_NODE,
                    config.node_id,
                    Duration::from_secs(30),
                )
                .await;
            match reply {
                Ok(Ok(())) => {
                    tracing::warn!(via = peer.id.0, "the cluster took this node back empty: its partitions are copied to it whole");
                    return Ok(());
                }
                Ok(Err(refusal)) => {
                    last = format!("node {}: {refusal:?}", peer.id);
                    if last.contains(REPLACEMENT_REFUSED) {
                        // Starting empty would serve as current rows it no longer has.
                        return Err(ClusterError::DataDir {
                            dir: config.data_dir.display().to_string(),
                            reason: last,
                        });
                    }
                }
                Err(error) => last = format!("node {}: {error}", peer.id),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(ClusterError::DataDir {
        dir: config.data_dir.display().to_string(),
        reason: format!("the cluster did not take this node back as a replacement within {REPLACEMENT_PATIENCE:?}: {last}"),
    })
}

/// A node starting on a new data directory asks its reachable peers whether the cluster
/// knows it as a member that has already run (announced a process; only then does it take
/// rows, see [`crate::node::Node::wait_announced`]): then its data is gone, and it refuses to start
/// ([`ClusterError::DataLost`]). Peers that do not answer (a cluster starting for the
/// first time) are skipped.
pub(crate) async fn refuse_if_data_lost(
    config: &NodeConfig,
    clients: &Clients,
    reachable: &[tessera_common::config::Peer],
) -> Result<()> {
    for peer in reachable {
        let addr = peer.addr.to_string();
        let status: std::result::Result<crate::server::NodeStatus, CallError> = clients
            .action(&addr, crate::rpc::ACTION_STATUS, (), Duration::from_secs(5))
            .await;
        let status = match status {
            Ok(status) => status,
            Err(error) => {
                tracing::info!(peer = peer.id.0, %error, "a peer could not say whether it knows this node");
                continue;
            }
        };
        if let Some(me) = status
            .meta
            .nodes
            .get(&config.node_id)
            .filter(|n| n.incarnation > 0 && !n.decommissioned)
        {
            return Err(ClusterError::DataLost {
                dir: config.data_dir.display().to_string(),
                node: config.node_id,
                peer: status.node_id,
                incarnation: me.incarnation,
            });
        }
    }
    Ok(())
}

/// The file in a data directory holding the node's incarnation.
const INCARNATION_FILE: &str = "incarnation";

/// Raises and durably records this node's incarnation (see [`NodeInfo::incarnation`]): above
/// the last one recorded here, and at least the wall clock in microseconds, so it still rises
/// if the directory was wiped and the node rejoins under the same id.
///
/// [`NodeInfo::incarnation`]: crate::meta::NodeInfo::incarnation
pub(crate) fn next_incarnation(dir: &Path) -> Result<u64> {
    let data_error = |reason: String| ClusterError::DataDir {
        dir: dir.display().to_string(),
        reason,
    };
    let path = dir.join(INCARNATION_FILE);
    let previous: u64 = match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse().map_err(|e| {
            data_error(format!(
                "{INCARNATION_FILE} holds {text:?}, not a number: {e}"
            ))
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(data_error(e.to_string())),
    };
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let incarnation = (previous + 1).max(clock);
    let write = || -> std::io::Result<()> {
        let temporary = dir.join(format!("{INCARNATION_FILE}.tmp"));
        let mut file = std::fs::File::create(&temporary)?;
        std::io::Write::write_all(&mut file, incarnation.to_string().as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| data_error(format!("recording the incarnation: {e}")))?;
    Ok(incarnation)
}

/// Refuses to start next to peers of another cluster, another protocol version, or at an
/// address where another node answers. Peers that do not answer are fine: they may start
/// later.
pub(crate) async fn check_peers(
    config: &NodeConfig,
    clients: &Clients,
    protocol: u32,
) -> Result<Vec<tessera_common::config::Peer>> {
    let mut reachable = Vec::new();
    for peer in config.peers.iter().filter(|p| p.id != config.node_id) {
        let addr = peer.addr.to_string();
        let reply: std::result::Result<Identity, CallError> = clients
            .action(&addr, ACTION_HELLO, (), Duration::from_millis(500))
            .await;
        let identity = match reply {
            Ok(identity) => identity,
            Err(CallError::Refused(Refusal::WrongCluster {
                node_id,
                cluster_id,
            })) => {
                return Err(ClusterError::WrongCluster {
                    node: node_id,
                    addr,
                    ours: config.cluster_id.clone(),
                    theirs: cluster_id,
                })
            }
            Err(CallError::Refused(Refusal::VersionMismatch {
                node_id,
                protocol: theirs,
            })) => {
                return Err(ClusterError::VersionMismatch {
                    node: node_id,
                    addr,
                    ours: protocol,
                    theirs,
                })
            }
            Err(error) => {
                tracing::info!(peer = peer.id.0, %addr, %error, "peer not reachable yet");
                continue;
            }
        };
        if identity.node_id != peer.id {
            return Err(ClusterError::WrongNode {
                addr,
                expected: peer.id,
                theirs: identity.node_id,
            });
        }
        reachable.push(peer.clone());
    }
    Ok(reachable)
}
