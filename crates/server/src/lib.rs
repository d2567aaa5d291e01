//! Tessera's cluster: nodes that share a Raft-replicated catalog and partition map, store
//! the partitions placed on them, coordinate publishes across replicas and answer queries
//! over every partition.
//!
//! - [`config`]: a node's `node.toml`.
//! - [`meta`] (the `tessera-meta` crate): the metadata state machine, its Raft log and
//!   snapshots, and the `MetaClient` handle.
//! - [`rpc`], [`server`]: the requests between nodes (on `tessera-net`) and their dispatch.
//! - [`node`]: one running node and its background duties.
//! - [`failover`]: the failure detector, pure and driven by time and observations.
//! - [`publish`]: the publish coordinator (two-phase: prepare on replicas, commit in Raft).
//! - [`rebalance`]: moving partitions when members join or leave.
//! - [`shipping`]: component replication to cold standbys, and checkpoint coordination.
//! - [`backend`]: the SQL engine's view of the cluster (catalog, scans, publish).
//! - distributed, pipelined query execution is the `tessera-exec` crate, and lineage
//!   recovery of running queries the `tessera-recovery` crate.

pub mod backend;
/// The metadata layer, re-exported under its old path while the cluster crate is split.
pub use tessera_meta as meta;
/// The replication protocols, re-exported under their old paths while the crate is split.
pub use tessera_replication::{failover, publish, rebalance, shipping};
pub mod client;
mod console;
pub mod error;
pub mod node;
pub mod rpc;
pub mod scrub;
pub mod server;
pub mod sql_answers;
pub mod startup;
pub mod status;
mod system_tables;
pub mod table_statistics;
pub mod verify;

pub use tessera_common::NodeId;

pub use backend::ClusterBackend;
pub use client::{ClusterClient, Notice};
pub use error::{ClusterError, Result};
pub use node::Node;
pub use tessera_common::config::{self, ConfigError, NodeConfig, Peer};
pub use tessera_exec::RecoveryOutcome;
