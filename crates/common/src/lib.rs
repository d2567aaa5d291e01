//! Shared vocabulary of Tessera: identifiers (epochs, partitions, LSNs, component hashes),
//! the stable partition hash that decides where a row lives, and the row-version columns
//! every stored row carries.
//!
//! Everything here is part of Tessera's on-disk and on-wire contract: changing the partition
//! hash or the version column names moves data, so both are fixed and tested against
//! known vectors.

pub mod allocator;
pub mod auth;
pub mod config;
pub mod disk;
pub mod hex;
pub mod ids;
pub mod memory;
pub mod metrics;
pub mod parallel;
pub mod partitioning;
pub mod short_hash;
pub mod signing;
pub mod statement;
pub mod time;
pub mod tls;
pub mod version;
pub mod views;

pub use config::{ConfigError, NodeConfig, Peer};
pub use ids::{ChannelId, ComponentHash, Epoch, Lsn, NodeId, PartitionId, QueryId, StageId};
pub use partitioning::{
    is_key_type, partition_key_hashes, PartitionRing, PartitioningError, DEFAULT_PARTITIONS,
};
pub use version::{ReadEpochs, RowOp, EPOCH_COLUMN, OP_COLUMN};
