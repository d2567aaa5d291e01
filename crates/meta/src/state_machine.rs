//! The Raft state machine: applies metadata commands to [`MetaState`], carries out their
//! local effects on this node's store, publishes each new state to the node's readers, and
//! builds and installs snapshots.
//!
//! The state lives in memory and in snapshots; entries after the last snapshot are applied
//! again at start (the log store keeps the committed index), and every local effect is
//! idempotent, so a replay changes nothing that was already done.
//!
//! The snapshot on disk only moves forward ([`SnapshotFile`]), and the log store purges
//! entries only once a snapshot covering them is on disk: openraft 0.9 hands a snapshot
//! received from the leader to this state machine's task and purges the log it covers
//! without waiting for the install, so a crash in between would leave a node with an old
//! snapshot and no log after it, unable to start.

use crate::state::{LocalEffect, MetaResponse, MetaState};
use crate::NodeId;
use crate::TypeConfig;
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_common::{Epoch, PartitionId};
use tessera_storage::Store;
use tokio::sync::watch;

const SNAPSHOT_FILE: &str = "raft-snapshot.json";

/// What readers on this node see of the metadata: the state after `applied_index`.
#[derive(Debug, Clone, Default)]
pub struct MetaView {
    pub state: MetaState,
    pub applied_index: u64,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    state: MetaState,
}

pub struct StateMachine {
    /// This node, whose cold-standby partitions the metadata decides.
    node_id: NodeId,
    snapshot_file: SnapshotFile,
    state: MetaState,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    store: Arc<Store>,
    view: watch::Sender<Arc<MetaView>>,
}

fn sm_error(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_state_machine(AnyError::error(e.to_string())).into()
}

impl StateMachine {
    /// Loads the last snapshot (if any) and brings the local store in line with it.
    pub fn open(
        node_id: NodeId,
        dir: &Path,
        store: Arc<Store>,
    ) -> std::io::Result<(StateMachine, watch::Receiver<Arc<MetaView>>)> {
        let (state, last_applied, membership) =
            match tessera_common::disk::read(&dir.join(SNAPSHOT_FILE)) {
                Ok(bytes) => {
                    let stored: StoredSnapshot = serde_json::from_slice(&bytes).map_err(|e| {
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("{} is corrupt: {e}", dir.join(SNAPSHOT_FILE).display()),
                        )
                    })?;
                    (
                        stored.state,
                        stored.meta.last_log_id,
                        stored.meta.last_membership,
                    )
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    (MetaState::default(), None, StoredMembership::default())
                }
                Err(e) => return Err(e),
            };
        let (view, receiver) = watch::channel(Arc::new(MetaView {
            state: state.clone(),
            applied_index: last_applied.map_or(0, |l| l.index),
        }));
        let machine = StateMachine {
            node_id,
            snapshot_file: SnapshotFile::new(dir, last_applied),
            state,
            last_applied,
            membership,
            store,
            view,
        };
        machine
            .reconcile_store()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok((machine, receiver))
    }

    /// The index of the newest snapshot on disk, as it moves: what the log store may purge
    /// through (see the module's comment).
    pub fn snapshot_on_disk(&self) -> watch::Receiver<Option<u64>> {
        self.snapshot_file.on_disk.subscribe()
    }

    fn publish_view(&self) {
        self.view.send_replace(Arc::new(MetaView {
            state: self.state.clone(),
            applied_index: self.last_applied.map_or(0, |l| l.index),
        }));
    }

    fn run_effects(&self, effects: Vec<LocalEffect>) -> tessera_storage::error::Result<()> {
        let store = &self.store;
        tokio::task::block_in_place(|| {
            // First, so a promotion in this entry replays the promoted partitions' log
            // before anything else touches them.
            let standby = if self.state.hot_standby || !self.state.is_bootstrapped() {
                Default::default()
            } else {
                self.state.map.standby_of(self.node_id)
            };
            let promoted = store.set_standby_partitions(standby);
            if !promoted.is_empty() {
                let store = store.clone();
                tokio::task::spawn_blocking(move || match store.promote(&promoted) {
                    Ok(replayed) => {
                        tracing::info!(
                            partitions = promoted.len(),
                            replayed,
                            "promoted partitions replayed their logged rows"
                        )
                    }
                    // Reads replay them on demand, and a checkpoint before it truncates.
                    Err(error) => tracing::error!(%error, "replaying promoted partitions failed"),
                });
            }
            for effect in effects {
                match effect {
                    LocalEffect::EnsureTable(def) => store.ensure_table(def)?,
                    LocalEffect::DropTable { name, generation } => {
                        store.drop_table_generation(&name, generation)?
                    }
                    LocalEffect::Commit(epoch) => {
                        store.commit_epoch_except(epoch, &self.missed_here(epoch))?;
                    }
                    LocalEffect::Abort(epoch) => store.abort_epoch(epoch)?,
                }
            }
            store.advance_visible(self.state.visible);
            store.set_retention_horizons(self.state.retention_horizons());
            Ok(())
        })
    }

    /// The partitions for which this node is marked stale since `epoch` or earlier: it
    /// missed the epoch there (or an earlier one), so its failback copy brings the epoch's
    /// versions and any rows it prepared for them must not be applied as well.
    fn missed_here(&self, epoch: Epoch) -> BTreeSet<PartitionId> {
        self.state
            .map
            .partitions
            .iter()
            .enumerate()
            .filter(|(_, placement)| {
                placement
                    .stale
                    .get(&self.node_id)
                    .is_some_and(|since| *since <= epoch)
            })
            .map(|(p, _)| PartitionId(p as u32))
            .collect()
    }

    /// Makes the store agree with the metadata after a snapshot: the same tables, and every
    /// epoch prepared here and since decided, committed or aborted accordingly.
    fn reconcile_store(&self) -> tessera_storage::error::Result<()> {
        let mut effects = Vec::new();
        let applied = self.last_applied.map_or(0, |l| l.index);
        for name in self.store.table_names() {
            let local = self.store.table_def(&name).expect("listed table");
            // A table created by an entry after the snapshot is not in it yet: the entry is
            // applied again. One created before and missing from the snapshot was dropped.
            let dropped = local.generation <= applied
                && self
                    .state
                    .tables
                    .get(&name)
                    .is_none_or(|def| def.generation != local.generation);
            if dropped {
                effects.push(LocalEffect::DropTable {
                    name,
                    generation: local.generation,
                });
            }
        }
        for def in self.state.tables.values() {
            effects.push(LocalEffect::EnsureTable(def.clone()));
        }
        for epoch in self.store.undecided_epochs() {
            if self.state.open.contains_key(&epoch) || epoch >= self.state.next_epoch {
                continue;
            }
            effects.push(if self.state.is_committed(epoch) {
                LocalEffect::Commit(epoch)
            } else {
                LocalEffect::Abort(epoch)
            });
        }
        self.run_effects(effects)
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        Ok((self.last_applied, self.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<MetaResponse>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut responses = Vec::new();
        for entry in entries {
            self.last_applied = Some(entry.log_id);
            let response = match entry.payload {
                EntryPayload::Blank => MetaResponse::Done,
                EntryPayload::Membership(membership) => {
                    self.membership = StoredMembership::new(Some(entry.log_id), membership);
                    MetaResponse::Done
                }
                EntryPayload::Normal(command) => {
                    let (response, effects) = self.state.apply(entry.log_id.index, command);
                    self.run_effects(effects).map_err(sm_error)?;
                    response
                }
            };
            responses.push(response);
        }
        self.publish_view();
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            snapshot_file: self.snapshot_file.clone(),
            state: self.state.clone(),
            last_applied: self.last_applied,
            membership: self.membership.clone(),
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let stored: StoredSnapshot =
            serde_json::from_slice(snapshot.get_ref()).map_err(sm_error)?;
        self.snapshot_file
            .write(meta.last_log_id, snapshot.get_ref())
            .map_err(sm_error)?;
        self.state = stored.state;
        self.last_applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        self.reconcile_store().map_err(sm_error)?;
        self.publish_view();
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        match tessera_common::disk::read(&self.snapshot_file.path()) {
            Ok(bytes) => {
                let stored: StoredSnapshot = serde_json::from_slice(&bytes).map_err(sm_error)?;
                Ok(Some(Snapshot {
                    meta: stored.meta,
                    snapshot: Box::new(Cursor::new(bytes)),
                }))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(sm_error(e)),
        }
    }
}

/// The snapshot file, which only moves forward: a snapshot built from an older state
/// (openraft builds them on a task of their own) never replaces a newer one installed from
/// the leader meanwhile, whose entries the log may already have purged.
#[derive(Clone)]
struct SnapshotFile {
    dir: PathBuf,
    /// Held while the file is compared and written.
    writing: Arc<std::sync::Mutex<()>>,
    /// The last log index the file on disk covers.
    on_disk: Arc<watch::Sender<Option<u64>>>,
}

impl SnapshotFile {
    fn new(dir: &Path, on_disk: Option<LogId<NodeId>>) -> SnapshotFile {
        SnapshotFile {
            dir: dir.to_path_buf(),
            writing: Arc::default(),
            on_disk: Arc::new(watch::channel(on_disk.map(|l| l.index)).0),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.join(SNAPSHOT_FILE)
    }

    /// Writes the snapshot through `last` (its bytes), durably, unless one at least as new
    /// is on disk already.
    fn write(&self, last: Option<LogId<NodeId>>, bytes: &[u8]) -> std::io::Result<()> {
        let _writing = self.writing.lock().expect("snapshot file lock");
        let last = last.map(|l| l.index);
        if *self.on_disk.borrow() >= last {
            return Ok(());
        }
        tessera_common::disk::write_atomically(&self.path(), bytes)?;
        self.on_disk.send_replace(last);
        Ok(())
    }
}

pub struct SnapshotBuilder {
    snapshot_file: SnapshotFile,
    state: MetaState,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let meta = SnapshotMeta {
            last_log_id: self.last_applied,
            last_membership: self.membership.clone(),
            snapshot_id: format!(
                "{}-{}",
                self.last_applied.map_or(0, |l| l.leader_id.term),
                self.last_applied.map_or(0, |l| l.index)
            ),
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            state: self.state.clone(),
        };
        let bytes = serde_json::to_vec(&stored).map_err(sm_error)?;
        self.snapshot_file
            .write(self.last_applied, &bytes)
            .map_err(sm_error)?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    fn log_id(index: u64) -> Option<LogId<NodeId>> {
        Some(LogId::new(CommittedLeaderId::new(1, NodeId(1)), index))
    }

    /// openraft builds snapshots on a task of its own: one built from an older state and
    /// finished after a newer one was installed from the leader must not replace it.
    #[test]
    fn the_snapshot_file_only_moves_forward() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::new(dir.path(), None);
        let on_disk = file.on_disk.subscribe();
        file.write(log_id(10), b"installed through 10").unwrap();
        assert_eq!(*on_disk.borrow(), Some(10));
        file.write(log_id(7), b"built through 7").unwrap();
        assert_eq!(std::fs::read(file.path()).unwrap(), b"installed through 10");
        assert_eq!(*on_disk.borrow(), Some(10));
        file.write(log_id(12), b"built through 12").unwrap();
        assert_eq!(std::fs::read(file.path()).unwrap(), b"built through 12");
        assert_eq!(*on_disk.borrow(), Some(12));
    }
}
