//! A node's configuration file (`node.toml`) and its checks.
//!
//! ```toml
//! cluster_id = "lab-cluster"
//! node_id = 1
//! listen = "127.0.0.1:7001"
//! data_dir = "tessera-data/node-1"
//! partitions = 64          # fixed when the cluster is created
//! replication = 3
//! voters = [1, 2, 3]       # default: the three lowest ids
//!
//! [[peers]]
//! id = 1
//! addr = "127.0.0.1:7001"
//! [[peers]]
//! id = 2
//! addr = "127.0.0.1:7002"
//! ```

use crate::error::{ClusterError, Result};
use crate::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    pub cluster_id: String,
    pub node_id: NodeId,
    /// Where this node serves RPC (Arrow Flight over gRPC).
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// Every node the cluster starts with, this one included. A node joining a running
    /// cluster lists itself and at least one member.
    pub peers: Vec<Peer>,
    /// Nodes that vote in the metadata group; default: the three lowest peer ids.
    #[serde(default)]
    pub voters: Option<Vec<NodeId>>,
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    #[serde(default = "default_replication")]
    pub replication: u32,
    /// Heartbeat period to the metadata leader.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A node silent this long is declared failed.
    #[serde(default = "default_failure_timeout_ms")]
    pub failure_timeout_ms: u64,
    /// Store tuning; defaults as for a single node.
    #[serde(default)]
    pub memtable_flush_bytes: Option<usize>,
    /// A checkpoint also runs once this many bytes were logged since the last one. It bounds
    /// the log a cold standby replays when promoted (default 256 MiB).
    #[serde(default)]
    pub checkpoint_log_bytes: Option<usize>,
    /// Replicas apply committed rows as they arrive (hot standby: a promotion replays
    /// nothing) instead of keeping them in the log until promoted (cold standby, the
    /// default: replicas do no flushing or merging; their primaries ship components). A
    /// cluster-wide setting: the founding metadata leader's value is recorded at bootstrap.
    #[serde(default)]
    pub hot_standby: bool,
    /// A returning replica fetches only the versions it missed (true), or copies its stale
    /// partitions whole (false: for comparison; the metadata leader's setting applies).
    #[serde(default = "default_true")]
    pub delta_recovery: bool,
    /// A node failed for this long loses its replicas: the metadata leader builds new ones
    /// on the other nodes so every partition has `replication` copies again. When the node
    /// returns it is given its share back.
    #[serde(default = "default_rereplicate_after_ms")]
    pub rereplicate_after_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    pub id: NodeId,
    pub addr: SocketAddr,
}

impl NodeConfig {
    pub const DEFAULT_REPLICATION: u32 = 3;
    pub const DEFAULT_HEARTBEAT_MS: u64 = 200;
    pub const DEFAULT_FAILURE_TIMEOUT_MS: u64 = 1500;
    pub const DEFAULT_REREPLICATE_AFTER_MS: u64 = 5 * 60 * 1000;
}

fn default_partitions() -> u32 {
    tessera_common::DEFAULT_PARTITIONS
}
fn default_replication() -> u32 {
    NodeConfig::DEFAULT_REPLICATION
}
fn default_heartbeat_ms() -> u64 {
    NodeConfig::DEFAULT_HEARTBEAT_MS
}
fn default_failure_timeout_ms() -> u64 {
    NodeConfig::DEFAULT_FAILURE_TIMEOUT_MS
}
fn default_true() -> bool {
    true
}
fn default_rereplicate_after_ms() -> u64 {
    NodeConfig::DEFAULT_REREPLICATE_AFTER_MS
}

impl NodeConfig {
    pub fn load(path: &Path) -> Result<NodeConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| ClusterError::Config {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<NodeConfig> {
        let config: NodeConfig = toml::from_str(text).map_err(|e| ClusterError::Config {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        config.validate().map_err(|reason| ClusterError::Config {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(config)
    }

    /// The voters: configured, or the three lowest peer ids.
    pub fn voter_ids(&self) -> BTreeSet<NodeId> {
        match &self.voters {
            Some(voters) => voters.iter().copied().collect(),
            None => self.peers.iter().map(|p| p.id).take(3).collect(),
        }
    }

    pub fn peer(&self, id: NodeId) -> Option<&Peer> {
        self.peers.iter().find(|p| p.id == id)
    }

    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    pub fn failure_timeout(&self) -> Duration {
        Duration::from_millis(self.failure_timeout_ms)
    }

    pub fn rereplicate_after(&self) -> Duration {
        Duration::from_millis(self.rereplicate_after_ms)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.cluster_id.trim().is_empty() {
            return Err("cluster_id is empty".into());
        }
        if self.node_id == 0 {
            return Err("node_id must be at least 1".into());
        }
        let mut ids = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        for peer in &self.peers {
            if peer.id == 0 {
                return Err("peer ids must be at least 1".into());
            }
            if !ids.insert(peer.id) {
                return Err(format!("peer id {} is listed twice", peer.id));
            }
            if !addrs.insert(peer.addr) {
                return Err(format!("address {} is given to two peers", peer.addr));
            }
        }
        let Some(me) = self.peer(self.node_id) else {
            return Err(format!(
                "node_id {} is not among the peers (ids {:?}); list this node in [[peers]]",
                self.node_id, ids
            ));
        };
        if me.addr.port() != self.listen.port() {
            return Err(format!(
                "this node listens on {} but its [[peers]] entry says {}",
                self.listen, me.addr
            ));
        }
        if let Some(voters) = &self.voters {
            if voters.is_empty() {
                return Err("voters is empty; at least one node must vote".into());
            }
            for voter in voters {
                if !ids.contains(voter) {
                    return Err(format!(
                        "voter {voter} is not a known peer (peers are {ids:?})"
                    ));
                }
            }
        }
        if !(1..=1 << 16).contains(&self.partitions) {
            return Err(format!(
                "partitions = {} is out of range 1..=65536",
                self.partitions
            ));
        }
        if self.replication == 0 {
            return Err("replication must be at least 1".into());
        }
        if self.heartbeat_ms == 0 || self.failure_timeout_ms <= self.heartbeat_ms {
            return Err(format!(
                "failure_timeout_ms ({}) must exceed heartbeat_ms ({}), which must be positive",
                self.failure_timeout_ms, self.heartbeat_ms
            ));
        }
        if self.rereplicate_after_ms <= self.failure_timeout_ms {
            return Err(format!(
                "rereplicate_after_ms ({}) must exceed failure_timeout_ms ({})",
                self.rereplicate_after_ms, self.failure_timeout_ms
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        cluster_id = "c"
        node_id = 1
        listen = "127.0.0.1:7001"
        data_dir = "d"
        [[peers]]
        id = 1
        addr = "127.0.0.1:7001"
        [[peers]]
        id = 2
        addr = "127.0.0.1:7002"
    "#;

    fn error(text: &str) -> String {
        NodeConfig::parse(text, Path::new("node.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_good_config_gets_defaults() {
        let config = NodeConfig::parse(GOOD, Path::new("node.toml")).unwrap();
        assert_eq!(config.partitions, 64);
        assert_eq!(config.replication, 3);
        assert_eq!(config.voter_ids(), BTreeSet::from([1, 2]));
    }

    #[test]
    fn bad_configs_name_the_problem() {
        assert!(error(&GOOD.replace("node_id = 1", "node_id = 9"))
            .contains("node_id 9 is not among the peers"));
        assert!(error(&format!("voters = [1, 7]\n{GOOD}")).contains("voter 7 is not a known peer"));
        assert!(error(&GOOD.replace("id = 2", "id = 1")).contains("peer id 1 is listed twice"));
        assert!(error(&format!("{GOOD}\nbogus = 1")).contains("unknown field `bogus`"));
        assert!(
            error(&GOOD.replace("listen = \"127.0.0.1:7001\"", "listen = \"127.0.0.1:9999\""))
                .contains("its [[peers]] entry says")
        );
        assert!(
            error(&GOOD.replace("127.0.0.1:7002", "nonsense")).contains("invalid socket address")
        );
    }
}
