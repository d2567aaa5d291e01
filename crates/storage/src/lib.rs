//! Tessera's storage engine for one node (DESIGN.md section 4; AsterixDB 3.4 and 4.2).
//!
//! Per (table, partition) a node keeps an in-memory component (Arrow batches) and immutable
//! on-disk components: Parquet files named by the BLAKE3 hash of their bytes. One
//! write-ahead log per node makes publishes durable; checkpoints flush memory to components,
//! record the partition manifests and let old log segments go. Recovery loads the last
//! checkpoint and replays committed log records above each manifest's LSN.

pub mod archive;
pub mod catalog;
pub mod changes;
pub mod checkpoint;
pub mod component;
pub mod digest;
pub mod error;
pub mod evolution;
mod fsio;
pub mod history;
pub mod manifest;
pub mod prepared;
pub mod routing;
pub mod store;
pub mod versions;
pub mod wal;

pub use catalog::TableDef;
pub use component::ComponentMeta;
pub use error::StorageError;
pub use manifest::Manifest;
pub use store::{
    HeldComponent, PartitionChanges, PartitionCopy, PartitionDelta, PartitionSnapshot,
    PreparedEntry, Store, StoreConfig, TableChanges, TableSnapshot, MEMTABLE_STALL_FACTOR,
};
