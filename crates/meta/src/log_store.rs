//! The Raft log on disk: one append-only file of CRC-checked frames, plus a small file for
//! the vote, the committed log id and the purge point.
//!
//! Appends are fsynced before openraft is told they are durable. A torn tail (a crash in
//! the middle of an append) is cut off at start. Truncation and purging rewrite the file
//! atomically; both are rare (conflict resolution, after a snapshot). Purging waits until a
//! snapshot covering the purged entries is on disk (see `state_machine`).

use crate::NodeId;
use crate::TypeConfig;
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    AnyError, Entry, LogId, OptionalSend, RaftLogReader, StorageError, StorageIOError, Vote,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tessera_common::disk;

const LOG_FILE: &str = "raft-log";
const STATE_FILE: &str = "raft-state.json";

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct LogMeta {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    last_purged: Option<LogId<NodeId>>,
}

struct Inner {
    dir: PathBuf,
    file: File,
    entries: BTreeMap<u64, Entry<TypeConfig>>,
    meta: LogMeta,
}

/// Shared by the log storage and its readers.
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<Inner>>,
    /// The last log index the state machine's snapshot on disk covers, if purges are bound
    /// to it ([`LogStore::purge_only_behind`]).
    snapshot_on_disk: Option<tokio::sync::watch::Receiver<Option<u64>>>,
}

/// How long a purge waits for the snapshot covering it to be written. Installing a
/// snapshot takes well under a second; past this the disk is failing, and the purge fails
/// (the node stops, keeping its log) rather than leave a log the snapshot does not cover.
const SNAPSHOT_ON_DISK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

fn io_error(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_logs(AnyError::error(e.to_string())).into()
}

fn encode_frame(entry: &Entry<TypeConfig>) -> std::io::Result<Vec<u8>> {
    let payload = serde_json::to_vec(entry)?;
    let mut frame = Vec::with_capacity(payload.len() + 8);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Reads every whole, intact frame; returns the entries and the length they span.
fn read_frames(bytes: &[u8]) -> (Vec<Entry<TypeConfig>>, usize) {
    let mut entries = Vec::new();
    let mut at = 0;
    while at + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes"));
        let Some(payload) = bytes.get(at + 8..at + 8 + len) else {
            break;
        };
        if crc32c::crc32c(payload) != crc {
            break;
        }
        let Ok(entry) = serde_json::from_slice(payload) else {
            break;
        };
        entries.push(entry);
        at += 8 + len;
    }
    (entries, at)
}

fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    disk::write_atomically(&dir.join(name), bytes)
}

impl LogStore {
    pub fn open(dir: &Path) -> std::io::Result<LogStore> {
        std::fs::create_dir_all(dir)?;
        let meta: LogMeta = match disk::read(&dir.join(STATE_FILE)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is corrupt: {e}", dir.join(STATE_FILE).display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => LogMeta::default(),
            Err(e) => return Err(e),
        };
        let path = dir.join(LOG_FILE);
        let bytes = match disk::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let (frames, valid) = read_frames(&bytes);
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        if valid < bytes.len() {
            tracing::warn!(path = %path.display(), torn_bytes = bytes.len() - valid, "cutting a torn tail off the metadata log");
            file.set_len(valid as u64)?;
            disk::sync_all(&file, &path)?;
        }
        let purged = meta.last_purged.map(|l| l.index);
        let mut entries = BTreeMap::new();
        for entry in frames {
            if purged.is_none_or(|p| entry.log_id.index > p) {
                // A later frame for an index replaces an earlier one (written after a truncate
                // whose rewrite did not finish is impossible: rewrites are atomic).
                entries.split_off(&entry.log_id.index);
                entries.insert(entry.log_id.index, entry);
            }
        }
        Ok(LogStore {
            inner: Arc::new(Mutex::new(Inner {
                dir: dir.to_path_buf(),
                file,
                entries,
                meta,
            })),
            snapshot_on_disk: None,
        })
    }

    /// Binds purges to the snapshot on disk: entries are purged only once the last index a
    /// snapshot on disk covers (`snapshot_on_disk`, the state machine's) reaches them.
    pub fn purge_only_behind(
        mut self,
        snapshot_on_disk: tokio::sync::watch::Receiver<Option<u64>>,
    ) -> LogStore {
        self.snapshot_on_disk = Some(snapshot_on_disk);
        self
    }

    /// Waits until a snapshot covering `index` is on disk, if purges are bound to one.
    async fn snapshot_covers(&self, index: u64) -> Result<(), StorageError<NodeId>> {
        let Some(on_disk) = &self.snapshot_on_disk else {
            return Ok(());
        };
        let mut waiting = on_disk.clone();
        let covered = waiting.wait_for(|last| last.is_some_and(|last| last >= index));
        // Whether the snapshot came in time, and if so whether the state machine still lives.
        let outcome = tokio::time::timeout(SNAPSHOT_ON_DISK_PATIENCE, covered)
            .await
            .map(|covered| covered.is_ok());
        match outcome {
            Ok(true) => Ok(()),
            Ok(false) => Err(io_error(format!(
                "cannot purge the metadata log through index {index}: the state machine is gone"
            ))),
            Err(_) => Err(io_error(format!(
                "cannot purge the metadata log through index {index}: no snapshot covering it was written within {SNAPSHOT_ON_DISK_PATIENCE:?} (the newest on disk covers {:?}); the log is kept",
                *on_disk.borrow()
            ))),
        }
    }

    /// Appends `entries` (fsynced) to a log no running node has open, as a crash would have
    /// left them: for tests that need a log state no public openraft call can produce, such
    /// as a membership change stopped in its joint configuration. Each entry must follow
    /// the last one.
    pub fn append_offline(&self, entries: &[Entry<TypeConfig>]) -> std::io::Result<()> {
        let mut inner = self.inner();
        let mut next = inner.entries.keys().next_back().map_or(1, |last| last + 1);
        let mut bytes = Vec::new();
        for entry in entries {
            if entry.log_id.index != next {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "entry {} does not follow the log's last, {}",
                        entry.log_id,
                        next - 1
                    ),
                ));
            }
            next += 1;
            bytes.extend(encode_frame(entry)?);
        }
        let path = inner.dir.join(LOG_FILE);
        disk::write_all(&mut inner.file, &path, &bytes)?;
        disk::sync_data(&inner.file, &path)?;
        for entry in entries {
            inner.entries.insert(entry.log_id.index, entry.clone());
        }
        Ok(())
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("raft log lock")
    }
}

impl Inner {
    fn save_meta(&self) -> std::io::Result<()> {
        write_atomically(&self.dir, STATE_FILE, &serde_json::to_vec(&self.meta)?)
    }

    /// Rewrites the log file with exactly the entries held in memory.
    fn rewrite(&mut self) -> std::io::Result<()> {
        let mut bytes = Vec::new();
        for entry in self.entries.values() {
            bytes.extend(encode_frame(entry)?);
        }
        write_atomically(&self.dir, LOG_FILE, &bytes)?;
        self.file = OpenOptions::new()
            .append(true)
            .open(self.dir.join(LOG_FILE))?;
        Ok(())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        Ok(self
            .inner()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let inner = self.inner();
        let last_purged_log_id = inner.meta.last_purged;
        let last_log_id = inner
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner();
        inner.meta.vote = Some(*vote);
        inner.save_meta().map_err(io_error)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.inner().meta.vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner();
        inner.meta.committed = committed;
        inner.save_meta().map_err(io_error)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.inner().meta.committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut inner = self.inner();
        let mut bytes = Vec::new();
        let mut appended = Vec::new();
        for entry in entries {
            bytes.extend(encode_frame(&entry).map_err(io_error)?);
            appended.push(entry);
        }
        let path = inner.dir.join(LOG_FILE);
        let result = disk::write_all(&mut inner.file, &path, &bytes)
            .and_then(|()| disk::sync_data(&inner.file, &path));
        if result.is_ok() {
            for entry in appended {
                inner.entries.insert(entry.log_id.index, entry);
            }
        }
        let failed = result.as_ref().err().map(|e| e.to_string());
        callback.log_io_completed(result);
        match failed {
            Some(e) => Err(io_error(e)),
            None => Ok(()),
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner();
        inner.entries.split_off(&log_id.index);
        inner.rewrite().map_err(io_error)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.snapshot_covers(log_id.index).await?;
        let mut inner = self.inner();
        inner.meta.last_purged = Some(log_id);
        inner.save_meta().map_err(io_error)?;
        inner.entries = inner.entries.split_off(&(log_id.index + 1));
        inner.rewrite().map_err(io_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};

    fn entry(index: u64) -> Entry<TypeConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, NodeId(1)), index),
            payload: EntryPayload::Blank,
        }
    }

    fn write_entries(dir: &Path, indices: std::ops::Range<u64>) -> Vec<u8> {
        let mut bytes = Vec::new();
        for i in indices {
            bytes.extend(encode_frame(&entry(i)).unwrap());
        }
        std::fs::write(dir.join(LOG_FILE), &bytes).unwrap();
        bytes
    }

    #[tokio::test]
    async fn a_torn_tail_is_cut_off_and_whole_entries_survive() {
        let dir = tempfile::tempdir().unwrap();
        let whole = write_entries(dir.path(), 1..6);
        let mut torn = whole.clone();
        torn.extend(&encode_frame(&entry(6)).unwrap()[..10]);
        std::fs::write(dir.path().join(LOG_FILE), &torn).unwrap();
        let mut store = LogStore::open(dir.path()).unwrap();
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_log_id.unwrap().index, 5);
        let entries = store.try_get_log_entries(1..).await.unwrap();
        assert_eq!(entries.len(), 5);
        assert_eq!(
            std::fs::metadata(dir.path().join(LOG_FILE)).unwrap().len(),
            whole.len() as u64,
            "the torn bytes are gone from the file"
        );
    }

    #[tokio::test]
    async fn truncate_and_purge_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        write_entries(dir.path(), 1..11);
        {
            let mut store = LogStore::open(dir.path()).unwrap();
            store.truncate(entry(8).log_id).await.unwrap();
            store.purge(entry(3).log_id).await.unwrap();
            let vote = Vote::new(2, NodeId(1));
            store.save_vote(&vote).await.unwrap();
        }
        let mut store = LogStore::open(dir.path()).unwrap();
        let indices: Vec<u64> = store
            .try_get_log_entries(0..)
            .await
            .unwrap()
            .iter()
            .map(|e| e.log_id.index)
            .collect();
        assert_eq!(indices, vec![4, 5, 6, 7]);
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id.unwrap().index, 3);
        assert_eq!(
            store.read_vote().await.unwrap(),
            Some(Vote::new(2, NodeId(1)))
        );
    }

    async fn indices_on_disk(dir: &Path) -> Vec<u64> {
        LogStore::open(dir)
            .unwrap()
            .try_get_log_entries(0..)
            .await
            .unwrap()
            .iter()
            .map(|e| e.log_id.index)
            .collect()
    }

    /// A follower given a snapshot by the leader purges the log it covers while its state
    /// machine is still writing it: the purge waits until the snapshot is on disk, so a
    /// crash before that finds the log the old snapshot needs.
    #[tokio::test]
    async fn a_purge_waits_until_a_snapshot_covering_it_is_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        write_entries(dir.path(), 1..11);
        let (on_disk, snapshot_on_disk) = tokio::sync::watch::channel(Some(3));
        let mut store = LogStore::open(dir.path())
            .unwrap()
            .purge_only_behind(snapshot_on_disk);
        let purge = tokio::spawn(async move { store.purge(entry(8).log_id).await });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!purge.is_finished(), "the purge waits for the snapshot");
        assert_eq!(
            indices_on_disk(dir.path()).await,
            (1..11).collect::<Vec<_>>(),
            "a crash now finds every entry"
        );
        on_disk.send_replace(Some(5));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(
            !purge.is_finished(),
            "a snapshot through 5 does not cover 8"
        );
        on_disk.send_replace(Some(8));
        purge.await.unwrap().unwrap();
        assert_eq!(indices_on_disk(dir.path()).await, vec![9, 10]);
    }

    /// A purge the snapshot on disk covers, up to its last index, goes ahead at once (a
    /// leader purges behind the snapshots it built itself); one index past it waits.
    #[tokio::test]
    async fn a_purge_goes_ahead_exactly_as_far_as_the_snapshot_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        write_entries(dir.path(), 1..11);
        let (_on_disk, snapshot_on_disk) = tokio::sync::watch::channel(Some(6));
        let mut store = LogStore::open(dir.path())
            .unwrap()
            .purge_only_behind(snapshot_on_disk);
        let patience = std::time::Duration::from_millis(300);
        tokio::time::timeout(patience, store.purge(entry(6).log_id))
            .await
            .expect("the snapshot through 6 covers a purge through 6")
            .unwrap();
        assert_eq!(indices_on_disk(dir.path()).await, vec![7, 8, 9, 10]);
        let past = tokio::time::timeout(patience, store.purge(entry(7).log_id)).await;
        assert!(
            past.is_err(),
            "a purge through 7 waits for a snapshot through 7"
        );
        assert_eq!(indices_on_disk(dir.path()).await, vec![7, 8, 9, 10]);
    }
}
