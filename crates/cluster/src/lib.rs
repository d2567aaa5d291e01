//! Tessera's cluster: nodes that share a Raft-replicated catalog and partition map, store
//! the partitions placed on them, coordinate publishes across replicas and answer queries
//! over every partition.
//!
//! - [`config`]: a node's `node.toml`.
//! - [`meta`]: the metadata state machine, its Raft log and snapshots.
//! - [`rpc`], [`server`], [`network`]: the Arrow Flight protocol between nodes.
//! - [`node`]: one running node and its background duties.
//! - [`publish`]: the publish coordinator (two-phase: prepare on replicas, commit in Raft).
//! - [`rebalance`]: moving partitions when members join or leave.
//! - [`shipping`]: component replication to cold standbys, and checkpoint coordination.
//! - [`backend`]: the SQL engine's view of the cluster (catalog, scans, publish).
//! - [`query`]: distributed, pipelined query execution over Arrow Flight.

pub mod backend;
pub mod client;
pub mod config;
pub mod error;
pub mod meta;
pub mod network;
pub mod node;
pub mod publish;
pub mod query;
pub mod rebalance;
pub mod rpc;
pub mod server;
pub mod shipping;

/// Nodes are named by positive integers, fixed in their configuration.
pub type NodeId = u64;

pub use backend::ClusterBackend;
pub use client::{ClusterClient, Notice};
pub use config::{NodeConfig, Peer};
pub use error::{ClusterError, Result};
pub use node::Node;
