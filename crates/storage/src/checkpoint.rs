//! The checkpoint file: the durable state of a node that is not in its log.
//!
//! It holds the catalog, every partition manifest, the per-partition LSN counters and the
//! epoch counter. It is replaced atomically (write, fsync, rename, fsync directory), so it is
//! always one complete version. Recovery starts from it and replays the log above each
//! manifest's max LSN.

use crate::catalog::TableDef;
use crate::error::{Result, StorageError};
use crate::fsio;
use crate::history::LocalHistory;
use crate::manifest::Manifest;
use serde::{Deserialize, Serialize};
use std::path::Path;
use tessera_common::{Epoch, Lsn};

pub const CHECKPOINT_FILE: &str = "checkpoint.json";
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Checkpoint {
    pub format: u32,
    pub partition_count: u32,
    /// The next epoch to allocate; every epoch below it is committed or aborted once the
    /// log has been replayed.
    pub next_epoch: Epoch,
    /// Epochs at or below this may be read; older versions may have been merged away.
    pub retained_from: Epoch,
    pub partition_next_lsn: Vec<Lsn>,
    pub tables: Vec<TableCheckpoint>,
    /// Commit times and tags (a store on its own; a cluster keeps them in its metadata).
    #[serde(default)]
    pub history: LocalHistory,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableCheckpoint {
    pub def: TableDef,
    /// One manifest per partition, indexed by partition id.
    pub manifests: Vec<Manifest>,
}

impl Checkpoint {
    pub fn empty(partition_count: u32) -> Checkpoint {
        Checkpoint {
            format: FORMAT_VERSION,
            partition_count,
            next_epoch: Epoch(1),
            retained_from: Epoch::ZERO,
            partition_next_lsn: vec![Lsn(1); partition_count as usize],
            tables: Vec::new(),
            history: LocalHistory::default(),
        }
    }

    pub fn load(dir: &Path) -> Result<Option<Checkpoint>> {
        let path = dir.join(CHECKPOINT_FILE);
        let bytes = match tessera_common::disk::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StorageError::io(&path, e)),
        };
        let corrupt = |reason: String| StorageError::CorruptCheckpoint {
            path: path.clone(),
            reason,
        };
        let checkpoint: Checkpoint =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if checkpoint.format != FORMAT_VERSION {
            return Err(corrupt(format!(
                "format version {} is not supported (this build reads {FORMAT_VERSION})",
                checkpoint.format
            )));
        }
        let partitions = checkpoint.partition_count as usize;
        if checkpoint.partition_next_lsn.len() != partitions
            || checkpoint
                .tables
                .iter()
                .any(|t| t.manifests.len() != partitions)
        {
            return Err(corrupt(format!(
                "partition lists do not match the partition count {partitions}"
            )));
        }
        Ok(Some(checkpoint))
    }

    pub fn store(&self, dir: &Path) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).expect("a checkpoint always serializes");
        fsio::write_atomically(&dir.join(CHECKPOINT_FILE), &bytes)
    }
}
