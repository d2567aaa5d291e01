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
/// The format this build writes. 2: components and logs may hold before images
/// (`RowOp::Before`), which a build reading only format 1 would take for tombstones.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest format this build reads (format 1 holds no before images).
pub const OLDEST_FORMAT_READ: u32 = 1;

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
        if !(OLDEST_FORMAT_READ..=FORMAT_VERSION).contains(&checkpoint.format) {
            return Err(corrupt(format!(
                "format version {} is not supported (this build reads {OLDEST_FORMAT_READ} to {FORMAT_VERSION})",
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

#[cfg(test)]
mod format_tests {
    use super::*;

    fn write_with_format(dir: &Path, format: u32) {
        let mut checkpoint = Checkpoint::empty(4);
        checkpoint.format = format;
        std::fs::write(
            dir.join(CHECKPOINT_FILE),
            serde_json::to_vec(&checkpoint).unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn older_formats_are_read_and_newer_ones_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for format in OLDEST_FORMAT_READ..=FORMAT_VERSION {
            write_with_format(dir.path(), format);
            assert!(
                Checkpoint::load(dir.path()).unwrap().is_some(),
                "format {format}"
            );
        }
        write_with_format(dir.path(), FORMAT_VERSION + 1);
        let error = Checkpoint::load(dir.path()).unwrap_err().to_string();
        assert!(
            error.contains(&format!("format version {}", FORMAT_VERSION + 1)),
            "{error}"
        );
    }

    /// A store of an older format is rewritten in the current one as it opens, before it
    /// can write anything an older build would misread.
    #[test]
    fn opening_an_older_store_upgrades_its_format() {
        let dir = tempfile::tempdir().unwrap();
        drop(crate::Store::open(dir.path(), crate::StoreConfig::default()).unwrap());
        let mut checkpoint = Checkpoint::load(dir.path()).unwrap().unwrap();
        checkpoint.format = OLDEST_FORMAT_READ;
        std::fs::write(
            dir.path().join(CHECKPOINT_FILE),
            serde_json::to_vec(&checkpoint).unwrap(),
        )
        .unwrap();
        drop(crate::Store::open(dir.path(), crate::StoreConfig::default()).unwrap());
        let reopened = Checkpoint::load(dir.path()).unwrap().unwrap();
        assert_eq!(reopened.format, FORMAT_VERSION);
    }
}
