//! The store of one node: tables, their partitions, publishing epochs, snapshots for
//! readers, checkpoints, merges and crash recovery.
//!
//! Concurrency: a publish through the log holds the *gate* shared, so publishes group-commit
//! together; checkpoints, bulk publishes and DDL hold it exclusively, so they see no publish
//! half done. Readers never take the gate: they copy what an epoch needs under the short
//! state lock and read immutable components afterwards.
//!
//! Visibility: epochs are allocated in order and committed possibly out of order (group
//! commit); the visible epoch advances only over a contiguous run of resolved (committed or
//! aborted) epochs, so a visible epoch never moves back and never exposes a gap.

use crate::catalog::TableDef;
use crate::checkpoint::{Checkpoint, TableCheckpoint};
use crate::component::{self, ComponentMeta};
use crate::error::{Result, StorageError};
use crate::fsio::{self, DirLock};
use crate::manifest::Manifest;
use crate::versions;
use crate::wal::{self, Wal, WalRecord};
use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use tessera_common::{ComponentHash, Epoch, Lsn, PartitionId, PartitionRing, RowOp};

/// Store settings, with defaults suited to a laptop or a small server.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Partitions of the hash ring; fixed when the store is created.
    pub partitions: u32,
    /// A checkpoint runs once the in-memory components hold this many bytes.
    pub memtable_flush_bytes: usize,
    /// A checkpoint also runs once this many bytes of committed rows were logged since the
    /// last one: it bounds how much log a restart, or a cold standby's promotion, replays.
    pub checkpoint_log_bytes: usize,
    /// Publishes at least this large bypass the log and write components directly.
    pub bulk_publish_bytes: usize,
    /// A partition with more components than this is merged at the next checkpoint.
    pub merge_threshold: usize,
    /// The largest publish accepted, in bytes of Arrow data.
    pub max_publish_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            partitions: 64,
            memtable_flush_bytes: 64 << 20,
            checkpoint_log_bytes: 256 << 20,
            bulk_publish_bytes: 8 << 20,
            merge_threshold: 8,
            max_publish_bytes: 8 << 30,
        }
    }
}

/// One table's part of a publish: rows to upsert (the table's columns) and keys to delete
/// (the primary-key columns).
#[derive(Debug, Clone, Default)]
pub struct TableChanges {
    pub table: String,
    pub upserts: Vec<RecordBatch>,
    pub deletes: Vec<RecordBatch>,
}

/// Everything a reader needs to read one table at one epoch. Components it names are not
/// deleted while the snapshot lives.
impl std::fmt::Debug for TableSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableSnapshot")
            .field("table", &self.def.name)
            .field("epoch", &self.epoch)
            .finish()
    }
}

pub struct TableSnapshot {
    pub def: TableDef,
    pub epoch: Epoch,
    pub partitions: Vec<PartitionSnapshot>,
    _reader: ReaderGuard,
}

#[derive(Debug, Clone)]
pub struct PartitionSnapshot {
    pub partition: PartitionId,
    pub components: Vec<ComponentMeta>,
    /// In-memory row versions at or below the snapshot's epoch.
    pub memtable: Vec<RecordBatch>,
    /// A cold standby holds some of the partition's rows at this epoch in its log only:
    /// reading it needs [`Store::replay_standby`] first.
    pub rows_in_log: bool,
}

impl PartitionSnapshot {
    pub fn is_empty(&self) -> bool {
        self.components.is_empty() && self.memtable.is_empty()
    }

    /// True if the partition's rows at `epoch` are exactly its single component's rows, so
    /// a reader may scan the Parquet file directly without resolving versions.
    pub fn is_plain_scan(&self, epoch: Epoch) -> bool {
        match (self.components.as_slice(), self.memtable.is_empty()) {
            ([only], true) => only.unique_keys && only.tombstones == 0 && only.max_epoch <= epoch,
            _ => false,
        }
    }

    pub fn estimated_rows(&self) -> u64 {
        self.components.iter().map(|c| c.rows).sum::<u64>()
            + self
                .memtable
                .iter()
                .map(|b| b.num_rows() as u64)
                .sum::<u64>()
    }
}

/// Per-table counts for `tessera status` and tests.
#[derive(Debug, Clone)]
pub struct TableStats {
    pub name: String,
    pub components: usize,
    pub component_rows: u64,
    pub memtable_rows: u64,
    /// Rows a cold standby holds in its log only (committed, durable, not yet applied).
    pub logged_rows: u64,
    pub partitions_with_data: usize,
}

/// One partition's part of a cluster publish, as the coordinator routed it: rows to upsert
/// (the table's columns) and keys to delete.
#[derive(Debug, Clone)]
pub struct PartitionChanges {
    pub table: String,
    pub partition: PartitionId,
    pub upserts: Vec<RecordBatch>,
    pub deletes: Vec<RecordBatch>,
}

/// Prepared rows of a cluster epoch that is not yet decided.
struct PendingEntry {
    /// Position among the epoch's entries; a commit assigns LSNs in this order.
    seq: u32,
    table: String,
    partition: PartitionId,
    batch: RecordBatch,
}

struct MemEntry {
    lsn: Lsn,
    epoch: Epoch,
    batch: RecordBatch,
}

#[derive(Default)]
struct PartitionState {
    manifest: Manifest,
    memtable: Vec<MemEntry>,
    /// Cold standby: committed row batches (their LSNs and epochs) kept in the log only.
    /// A promotion, a read or a checkpoint replays them into `memtable`; components shipped
    /// by the primary make those they cover unnecessary.
    unapplied: Vec<LoggedRows>,
}

/// A committed row batch a cold standby keeps in its log only.
#[derive(Debug, Clone, Copy)]
struct LoggedRows {
    lsn: Lsn,
    epoch: Epoch,
    rows: u64,
}

struct TableState {
    def: TableDef,
    partitions: Vec<PartitionState>,
}

struct State {
    tables: BTreeMap<String, TableState>,
    partition_next_lsn: Vec<Lsn>,
    next_epoch: Epoch,
    visible: Epoch,
    resolved_above_visible: BTreeSet<Epoch>,
    retained_from: Epoch,
    memtable_bytes: usize,
    /// Cluster epochs prepared here and not yet committed or aborted by the metadata service.
    pending: BTreeMap<Epoch, Vec<PendingEntry>>,
    /// The next sequence number of each pending epoch's entries.
    next_prepare_seq: HashMap<Epoch, u32>,
    /// Partitions kept as a cold standby: their committed rows are logged, not applied.
    standby: BTreeSet<PartitionId>,
    /// The standby partitions the metadata asks for; `standby` also holds promoted ones
    /// until their log is replayed.
    standby_wanted: BTreeSet<PartitionId>,
    /// Bytes of committed rows logged since the last checkpoint. Counted at commit, not at
    /// prepare: a checkpoint set off in the middle of a large prepare would have to re-log
    /// the whole undecided epoch, and could not have its primaries cover it yet.
    logged_bytes: usize,
}

impl State {
    /// Marks an epoch committed or aborted and advances the visible epoch over every
    /// contiguous resolved epoch.
    fn resolve(&mut self, epoch: Epoch) {
        assert!(
            epoch > self.visible,
            "an epoch is resolved once, above the visible epoch"
        );
        self.resolved_above_visible.insert(epoch);
        while self.resolved_above_visible.remove(&self.visible.next()) {
            self.visible = self.visible.next();
        }
    }

    /// Cluster mode: epochs are decided by the metadata service, so the store's visible
    /// epoch only rises to what it is told.
    fn advance_visible_to(&mut self, epoch: Epoch) {
        if epoch > self.visible {
            self.visible = epoch;
            self.resolved_above_visible.retain(|e| *e > epoch);
        }
        self.next_epoch = self.next_epoch.max(epoch.next());
    }

    fn allocate_epoch(&mut self) -> Epoch {
        let epoch = self.next_epoch;
        self.next_epoch = epoch.next();
        epoch
    }

    fn allocate_lsn(&mut self, partition: PartitionId) -> Lsn {
        let slot = &mut self.partition_next_lsn[partition.0 as usize];
        let lsn = *slot;
        *slot = lsn.next();
        lsn
    }

    fn table(&self, name: &str) -> Result<&TableState> {
        self.tables
            .get(name)
            .ok_or_else(|| StorageError::UnknownTable(name.to_string()))
    }

    /// The (table, partition) pairs holding committed rows in the log only (cold standby).
    fn logged_partitions(&self) -> impl Iterator<Item = (&str, PartitionId, &PartitionState)> {
        self.tables.iter().flat_map(|(name, t)| {
            t.partitions
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.unapplied.is_empty())
                .map(move |(i, p)| (name.as_str(), PartitionId(i as u32), p))
        })
    }

    fn partition(&self, table: &str, partition: PartitionId) -> Result<&PartitionState> {
        self.table(table)?
            .partitions
            .get(partition.0 as usize)
            .ok_or_else(|| StorageError::InvalidTable {
                table: table.to_string(),
                reason: format!("no partition {partition}"),
            })
    }

    fn to_checkpoint(&self, partition_count: u32) -> Checkpoint {
        Checkpoint {
            format: crate::checkpoint::FORMAT_VERSION,
            partition_count,
            next_epoch: self.next_epoch,
            retained_from: self.retained_from,
            partition_next_lsn: self.partition_next_lsn.clone(),
            tables: self
                .tables
                .values()
                .map(|t| TableCheckpoint {
                    def: t.def.clone(),
                    manifests: t.partitions.iter().map(|p| p.manifest.clone()).collect(),
                })
                .collect(),
        }
    }

    fn referenced_components(&self) -> HashSet<ComponentHash> {
        self.tables
            .values()
            .flat_map(|t| t.partitions.iter())
            .flat_map(|p| p.manifest.components.iter().map(|c| c.hash))
            .collect()
    }
}

/// Tracks live snapshots so merged-away components are deleted only once no reader can
/// still open them.
#[derive(Default)]
struct ReaderRegistry {
    generation: u64,
    active: BTreeMap<u64, usize>,
    /// Components dropped from manifests, with the generation at which they were dropped.
    garbage: Vec<(u64, ComponentHash)>,
}

struct ReaderGuard {
    registry: Arc<Mutex<ReaderRegistry>>,
    generation: u64,
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        let mut registry = self.registry.lock().expect("reader registry lock");
        if let Some(count) = registry.active.get_mut(&self.generation) {
            *count -= 1;
            if *count == 0 {
                registry.active.remove(&self.generation);
            }
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("partitions", &self.ring.partition_count())
            .finish()
    }
}

pub struct Store {
    dir: PathBuf,
    components_dir: PathBuf,
    config: StoreConfig,
    ring: PartitionRing,
    state: Mutex<State>,
    gate: RwLock<()>,
    wal: Wal,
    verified: Mutex<HashSet<ComponentHash>>,
    readers: Arc<Mutex<ReaderRegistry>>,
    poisoned: Mutex<Option<String>>,
    _lock: DirLock,
}

/// What recovery did, for logs and tests.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    pub replayed_records: usize,
    pub skipped_uncommitted_records: usize,
    pub torn_bytes: u64,
    pub visible_epoch: Epoch,
}

impl Store {
    /// Opens (or creates) the store in `dir`, recovering from the last checkpoint and the log.
    pub fn open(dir: &Path, config: StoreConfig) -> Result<Arc<Store>> {
        Ok(Self::open_with_report(dir, config)?.0)
    }

    pub fn open_with_report(
        dir: &Path,
        mut config: StoreConfig,
    ) -> Result<(Arc<Store>, RecoveryReport)> {
        fsio::create_dir_all(dir)?;
        // Absolute paths: components are handed to readers (and, later, peers) by path.
        let dir = &dir.canonicalize().map_err(|e| StorageError::io(dir, e))?;
        let lock = DirLock::acquire(dir)?;
        let components_dir = dir.join("components");
        let wal_dir = dir.join("wal");
        fsio::create_dir_all(&components_dir)?;
        fsio::create_dir_all(&wal_dir)?;
        let checkpoint = match Checkpoint::load(dir)? {
            Some(checkpoint) => checkpoint,
            None => {
                if !wal::list_segments(&wal_dir)?.is_empty() {
                    return Err(StorageError::CorruptCheckpoint {
                        path: dir.join(crate::checkpoint::CHECKPOINT_FILE),
                        reason: "missing, yet the write-ahead log has segments; refusing to start empty over existing data".into(),
                    });
                }
                let fresh = Checkpoint::empty(config.partitions);
                fresh.store(dir)?;
                fresh
            }
        };
        if checkpoint.partition_count != config.partitions {
            tracing::info!(
                stored = checkpoint.partition_count,
                configured = config.partitions,
                "using the partition count the store was created with"
            );
            config.partitions = checkpoint.partition_count;
        }
        let log = wal::recover(&wal_dir)?;
        let (state, report) = replay(checkpoint, log.records, log.torn_bytes)?;
        // Appending to the last segment is safe: recovery cut any torn tail off it.
        let wal = Wal::start(&wal_dir, log.last_segment.max(1))?;
        let store = Store {
            dir: dir.to_path_buf(),
            components_dir,
            ring: PartitionRing::new(config.partitions),
            config,
            state: Mutex::new(state),
            gate: RwLock::new(()),
            wal,
            verified: Mutex::new(HashSet::new()),
            readers: Arc::new(Mutex::new(ReaderRegistry::default())),
            poisoned: Mutex::new(None),
            _lock: lock,
        };
        store.delete_unreferenced_component_files()?;
        tracing::info!(dir = %dir.display(), visible_epoch = %report.visible_epoch, replayed = report.replayed_records, torn_bytes = report.torn_bytes, "store opened");
        Ok((Arc::new(store), report))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn components_dir(&self) -> &Path {
        &self.components_dir
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    pub fn ring(&self) -> PartitionRing {
        self.ring
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("store state lock")
    }

    pub fn visible_epoch(&self) -> Epoch {
        self.state().visible
    }

    pub fn table_names(&self) -> Vec<String> {
        self.state().tables.keys().cloned().collect()
    }

    pub fn table_def(&self, name: &str) -> Option<TableDef> {
        self.state().tables.get(name).map(|t| t.def.clone())
    }

    fn check_poisoned(&self) -> Result<()> {
        if let Some(reason) = self
            .poisoned
            .lock()
            .expect("poison lock")
            .clone()
            .or_else(|| self.wal.poisoned())
        {
            return Err(StorageError::Poisoned(reason));
        }
        Ok(())
    }

    /// Runs a step whose failure leaves memory and disk possibly apart; on error the store
    /// refuses further writes until restarted, when it recovers from what is on disk.
    fn or_poison<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            tracing::error!(error = %e, "store poisoned");
            self.poisoned
                .lock()
                .expect("poison lock")
                .get_or_insert(e.to_string());
        }
        result
    }

    fn write_checkpoint(&self, state: &State) -> Result<()> {
        let result = state
            .to_checkpoint(self.ring.partition_count())
            .store(&self.dir);
        self.or_poison(result)
    }

    fn empty_table(&self, def: TableDef) -> TableState {
        let partitions = (0..self.ring.partition_count())
            .map(|_| PartitionState::default())
            .collect();
        TableState { def, partitions }
    }

    pub fn create_table(&self, mut def: TableDef) -> Result<()> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        let mut state = self.state();
        if state.tables.contains_key(&def.name) {
            return Err(StorageError::TableExists(def.name));
        }
        def.created_at = state.visible;
        state.tables.insert(def.name.clone(), self.empty_table(def));
        self.write_checkpoint(&state)
    }

    pub fn drop_table(&self, name: &str) -> Result<()> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        let mut state = self.state();
        let table = state
            .tables
            .remove(name)
            .ok_or_else(|| StorageError::UnknownTable(name.to_string()))?;
        state.memtable_bytes -= table
            .partitions
            .iter()
            .flat_map(|p| &p.memtable)
            .map(|e| e.batch.get_array_memory_size())
            .sum::<usize>();
        self.write_checkpoint(&state)?;
        let dropped = table
            .partitions
            .iter()
            .flat_map(|p| p.manifest.components.iter().map(|c| c.hash));
        self.collect_garbage(dropped.collect(), &state)
    }

    /// Publishes a batch of changes as one new epoch, visible atomically once this returns.
    pub fn publish(&self, changes: Vec<TableChanges>) -> Result<Epoch> {
        self.check_poisoned()?;
        let prepared = self.prepare(changes)?;
        let bytes: usize = prepared.iter().map(|p| p.bytes()).sum();
        if bytes > self.config.max_publish_bytes {
            return Err(StorageError::PublishTooLarge {
                bytes,
                limit: self.config.max_publish_bytes,
            });
        }
        let epoch = if bytes >= self.config.bulk_publish_bytes {
            self.publish_bulk(prepared)?
        } else {
            self.publish_logged(prepared)?
        };
        if self.state().memtable_bytes >= self.config.memtable_flush_bytes {
            self.checkpoint()?;
        }
        Ok(epoch)
    }

    /// Validates changes against the catalog: schemas, keys, duplicates within the publish.
    fn prepare(&self, changes: Vec<TableChanges>) -> Result<Vec<PreparedChanges>> {
        let mut prepared: Vec<PreparedChanges> = Vec::new();
        for change in changes {
            let def = self
                .table_def(&change.table)
                .ok_or_else(|| StorageError::UnknownTable(change.table.clone()))?;
            if def.append_only && change.deletes.iter().any(|b| b.num_rows() > 0) {
                return Err(StorageError::delete_from_append_only(&def.name));
            }
            let checked = PreparedChanges::checked(def, &change.upserts, &change.deletes)?;
            if let Some(existing) = prepared.iter_mut().find(|p| p.def.name == checked.def.name) {
                existing.upserts.extend(checked.upserts);
                existing.deletes.extend(checked.deletes);
            } else {
                prepared.push(checked);
            }
        }
        for p in &prepared {
            let all: Vec<RecordBatch> = p.upserts.iter().chain(&p.deletes).cloned().collect();
            versions::reject_duplicate_keys(&p.def, &all)?;
        }
        prepared.retain(|p| !p.upserts.is_empty() || !p.deletes.is_empty());
        Ok(prepared)
    }

    /// The log path: row records and a commit record go to the log, group-committed.
    fn publish_logged(&self, prepared: Vec<PreparedChanges>) -> Result<Epoch> {
        let _gate = self.gate.read().expect("gate lock");
        // Tables can only disappear under the exclusive gate; recheck now that we hold it.
        let mut state = self.state();
        for p in &prepared {
            state.table(&p.def.name)?;
        }
        let epoch = state.allocate_epoch();
        let encoded = (|| -> Result<(Vec<u8>, Vec<(String, PartitionId, MemEntry)>)> {
            let mut frames = Vec::new();
            let mut entries = Vec::new();
            for p in &prepared {
                for (partition, batch) in p.stamped_by_partition(epoch, &self.ring)? {
                    let lsn = state.allocate_lsn(partition);
                    let record = WalRecord::Rows {
                        table: p.def.name.clone(),
                        partition,
                        lsn,
                        epoch,
                        batch,
                    };
                    frames.extend(record.encode_frame()?);
                    let WalRecord::Rows { batch, .. } = record else {
                        unreachable!()
                    };
                    entries.push((
                        p.def.name.clone(),
                        partition,
                        MemEntry { lsn, epoch, batch },
                    ));
                }
            }
            frames.extend(WalRecord::Commit { epoch }.encode_frame()?);
            Ok((frames, entries))
        })();
        let (frames, entries) = match encoded {
            Ok(encoded) => encoded,
            Err(e) => {
                state.resolve(epoch);
                return Err(e);
            }
        };
        // Submitting under the state lock keeps the log in epoch and LSN order.
        let ticket = self.wal.submit(frames);
        drop(state);
        let durable = ticket.wait();
        let mut state = self.state();
        if durable.is_ok() {
            for (table, partition, entry) in entries {
                state.memtable_bytes += entry.batch.get_array_memory_size();
                let table = state
                    .tables
                    .get_mut(&table)
                    .expect("tables outlive publishes holding the gate");
                table.partitions[partition.0 as usize].memtable.push(entry);
            }
        }
        state.resolve(epoch);
        durable.map(|()| epoch)
    }

    /// The bulk path: rows become components directly; the checkpoint that lists them is
    /// the commit point.
    fn publish_bulk(&self, prepared: Vec<PreparedChanges>) -> Result<Epoch> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        // Flushing first keeps LSNs rising within each manifest.
        self.flush_memtables()?;
        let epoch = {
            let mut state = self.state();
            for p in &prepared {
                state.table(&p.def.name)?;
            }
            state.allocate_epoch()
        };
        let written = (|| -> Result<Vec<(String, PartitionId, ComponentMeta)>> {
            let mut written = Vec::new();
            for p in &prepared {
                for (partition, batch) in p.stamped_by_partition(epoch, &self.ring)? {
                    let lsn = self.state().allocate_lsn(partition);
                    let meta = self.write_component(&p.def, &[batch], lsn, lsn)?;
                    written.push((p.def.name.clone(), partition, meta));
                }
            }
            Ok(written)
        })();
        let mut state = self.state();
        let written = match written {
            Ok(written) => written,
            Err(e) => {
                // Nothing references the new files: the epoch is aborted and stays invisible.
                state.resolve(epoch);
                return Err(e);
            }
        };
        for (table, partition, meta) in written {
            let table = state
                .tables
                .get_mut(&table)
                .expect("tables outlive publishes holding the gate");
            table.partitions[partition.0 as usize].manifest.add(meta);
        }
        state.resolve(epoch);
        self.write_checkpoint(&state)?;
        drop(state);
        // Memtables were just flushed, so checkpointing now is cheap: it trims the log and
        // merges the partitions this publish crowded. The epoch is committed either way; a
        // failure here poisons the store or is retried by the next checkpoint.
        if let Err(error) = self.checkpoint_holding_gate() {
            tracing::error!(%error, %epoch, "checkpoint after bulk publish failed");
        }
        Ok(epoch)
    }

    fn write_component(
        &self,
        def: &TableDef,
        batches: &[RecordBatch],
        min_lsn: Lsn,
        max_lsn: Lsn,
    ) -> Result<ComponentMeta> {
        let batch = concat_batches(&batches[0].schema(), batches)?;
        let stats = versions::version_stats(&batch, &def.primary_key_indices(), def.append_only)?;
        let bytes = component::encode_parquet(&[batch.clone()])?;
        let hash = component::write_component(&self.components_dir, &bytes)?;
        self.verified.lock().expect("verified lock").insert(hash);
        Ok(ComponentMeta {
            hash,
            rows: batch.num_rows() as u64,
            bytes: bytes.len() as u64,
            min_lsn,
            max_lsn,
            min_epoch: stats.min_epoch,
            max_epoch: stats.max_epoch,
            unique_keys: stats.unique_keys,
            tombstones: stats.tombstones,
        })
    }

    /// Writes every in-memory component to disk and records the new manifests. Callers hold
    /// the gate exclusively, so memtables do not change underneath.
    fn flush_memtables(&self) -> Result<()> {
        let work: Vec<(TableDef, PartitionId, Vec<RecordBatch>, Lsn, Lsn)> = {
            let state = self.state();
            state
                .tables
                .values()
                .flat_map(|t| {
                    t.partitions
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| !p.memtable.is_empty())
                        .map(|(i, p)| {
                            let batches = p.memtable.iter().map(|e| e.batch.clone()).collect();
                            let min = p.memtable.iter().map(|e| e.lsn).min().expect("non-empty");
                            let max = p.memtable.iter().map(|e| e.lsn).max().expect("non-empty");
                            (t.def.clone(), PartitionId(i as u32), batches, min, max)
                        })
                })
                .collect()
        };
        if work.is_empty() {
            return Ok(());
        }
        let mut flushed = Vec::with_capacity(work.len());
        for (def, partition, batches, min_lsn, max_lsn) in work {
            let meta = self.or_poison(self.write_component(&def, &batches, min_lsn, max_lsn))?;
            flushed.push((def.name, partition, meta));
        }
        let mut state = self.state();
        for (table, partition, meta) in flushed {
            let table = state
                .tables
                .get_mut(&table)
                .expect("tables outlive the exclusive gate");
            let partition = &mut table.partitions[partition.0 as usize];
            partition.manifest.add(meta);
            partition.memtable.clear();
        }
        state.memtable_bytes = 0;
        self.write_checkpoint(&state)
    }

    /// Creates a table exactly as the cluster catalog defines it. A table of that name and
    /// the same or a newer generation makes this a no-op (a replayed metadata entry); an
    /// older one is replaced.
    pub fn ensure_table(&self, def: TableDef) -> Result<()> {
        if let Some(existing) = self.table_def(&def.name) {
            if existing.generation >= def.generation {
                return Ok(());
            }
            self.drop_table_generation(&def.name, existing.generation)?;
        }
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        let mut state = self.state();
        state.tables.insert(def.name.clone(), self.empty_table(def));
        self.write_checkpoint(&state)
    }

    /// Drops the table if it exists with a generation at or below `generation`.
    pub fn drop_table_generation(&self, name: &str, generation: u64) -> Result<()> {
        match self.table_def(name) {
            Some(existing) if existing.generation <= generation => self.drop_table(name),
            _ => Ok(()),
        }
    }

    /// Durably logs the rows a coordinator routed here for cluster epoch `epoch`. They stay
    /// invisible until [`Store::commit_epoch`]; [`Store::abort_epoch`] discards them. A
    /// large publish may arrive in several calls; each adds to the epoch's rows.
    pub fn prepare_epoch(&self, epoch: Epoch, changes: Vec<PartitionChanges>) -> Result<()> {
        self.check_poisoned()?;
        let mut grouped: BTreeMap<(String, PartitionId), Vec<RecordBatch>> = BTreeMap::new();
        for change in changes {
            let def = self
                .table_def(&change.table)
                .ok_or_else(|| StorageError::UnknownTable(change.table.clone()))?;
            let prepared = PreparedChanges::checked(def, &change.upserts, &change.deletes)?;
            for (partition, batch) in prepared.stamped_by_partition(epoch, &self.ring)? {
                if partition != change.partition {
                    return Err(StorageError::MisroutedRows {
                        table: change.table.clone(),
                        sent_to: change.partition,
                        belongs_to: partition,
                    });
                }
                grouped
                    .entry((change.table.clone(), partition))
                    .or_default()
                    .push(batch);
            }
        }
        let _gate = self.gate.read().expect("gate lock");
        let mut state = self.state();
        let next_seq = state.next_prepare_seq.entry(epoch).or_insert(0);
        let first_seq = *next_seq;
        *next_seq += grouped.len() as u32;
        let mut entries = Vec::with_capacity(grouped.len());
        for (i, ((table, partition), batches)) in grouped.into_iter().enumerate() {
            state.table(&table)?;
            entries.push(PendingEntry {
                seq: first_seq + i as u32,
                table,
                partition,
                batch: concat_batches(&batches[0].schema(), &batches)?,
            });
        }
        let mut frames = Vec::new();
        for entry in &entries {
            frames.extend(
                WalRecord::Prepared {
                    table: entry.table.clone(),
                    partition: entry.partition,
                    epoch,
                    seq: entry.seq,
                    batch: entry.batch.clone(),
                }
                .encode_frame()?,
            );
        }
        state.next_epoch = state.next_epoch.max(epoch.next());
        let ticket = self.wal.submit(frames);
        drop(state);
        let durable = ticket.wait();
        let mut state = self.state();
        let slot = state.pending.entry(epoch).or_default();
        if durable.is_ok() {
            slot.extend(entries);
            slot.sort_by_key(|e| e.seq);
        }
        durable
    }

    /// Makes the rows prepared for `epoch` part of their partitions. Returns whether this
    /// node had any; committing an epoch it never prepared (or already committed) is a no-op.
    pub fn commit_epoch(&self, epoch: Epoch) -> Result<bool> {
        self.check_poisoned()?;
        let _gate = self.gate.read().expect("gate lock");
        let mut state = self.state();
        state.advance_visible_to(epoch);
        state.next_prepare_seq.remove(&epoch);
        let Some(entries) = state.pending.remove(&epoch) else {
            return Ok(false);
        };
        debug_assert!(
            entries.windows(2).all(|w| w[0].seq < w[1].seq),
            "entries sorted by seq"
        );
        state.logged_bytes += entries
            .iter()
            .map(|e| e.batch.get_array_memory_size())
            .sum::<usize>();
        let mut lsns = Vec::with_capacity(entries.len());
        let mut assigned = Vec::with_capacity(entries.len());
        for entry in entries {
            let lsn = state.allocate_lsn(entry.partition);
            lsns.push((entry.table.clone(), entry.partition, lsn));
            assigned.push((entry, lsn));
        }
        let frame = WalRecord::CommitPrepared { epoch, lsns }.encode_frame()?;
        let ticket = self.wal.submit(frame);
        drop(state);
        self.or_poison(ticket.wait())?;
        let mut state = self.state();
        for (entry, lsn) in assigned {
            let cold = state.standby.contains(&entry.partition);
            let Some(table) = state.tables.get_mut(&entry.table) else {
                continue;
            };
            let part = &mut table.partitions[entry.partition.0 as usize];
            if cold {
                // The rows are durable in the log; a promotion replays them from there.
                part.unapplied.push(LoggedRows {
                    lsn,
                    epoch,
                    rows: entry.batch.num_rows() as u64,
                });
                continue;
            }
            let bytes = entry.batch.get_array_memory_size();
            part.memtable.push(MemEntry {
                lsn,
                epoch,
                batch: entry.batch,
            });
            state.memtable_bytes += bytes;
        }
        Ok(true)
    }

    /// Discards the rows prepared for `epoch`, if any.
    pub fn abort_epoch(&self, epoch: Epoch) -> Result<()> {
        self.check_poisoned()?;
        let _gate = self.gate.read().expect("gate lock");
        let mut state = self.state();
        state.advance_visible_to(epoch);
        state.next_prepare_seq.remove(&epoch);
        if state.pending.remove(&epoch).is_none() {
            return Ok(());
        }
        let ticket = self.wal.submit(WalRecord::Abort { epoch }.encode_frame()?);
        drop(state);
        self.or_poison(ticket.wait())
    }

    /// The stored row versions of one partition of `table` with an epoch at or above `since`
    /// (the stored schema, version columns included). `Epoch::ZERO` gives every version: what
    /// a new replica needs; a later epoch gives the delta a returning replica missed.
    pub fn partition_versions(
        &self,
        table: &str,
        partition: PartitionId,
        since: Epoch,
    ) -> Result<Vec<RecordBatch>> {
        self.replay_standby(&[partition])?;
        let snapshot = self.snapshot_with_partition(table, partition)?;
        let part = &snapshot.partitions[partition.0 as usize];
        let mut batches = Vec::new();
        for component in part.components.iter().filter(|c| c.max_epoch >= since) {
            self.verify_component(&component.hash)?;
            batches.extend(component::read_component(
                &self.components_dir,
                &component.hash,
                None,
            )?);
        }
        batches.extend(part.memtable.iter().cloned());
        versions::versions_since(batches, since)
    }

    /// A snapshot of `table` at the visible epoch that has partition `partition`; holding it
    /// keeps that partition's components from being collected while they are read.
    fn snapshot_with_partition(
        &self,
        table: &str,
        partition: PartitionId,
    ) -> Result<Arc<TableSnapshot>> {
        let snapshot = self.snapshot(table, None)?;
        if snapshot.partitions.len() <= partition.0 as usize {
            return Err(StorageError::InvalidTable {
                table: table.to_string(),
                reason: format!("no partition {partition}"),
            });
        }
        Ok(snapshot)
    }

    /// What a new replica of one partition of `table` copies: the components that hold its
    /// flushed versions (by hash) and the versions still only in memory.
    pub fn export_partition(
        &self,
        table: &str,
        partition: PartitionId,
    ) -> Result<(Vec<ComponentMeta>, Vec<RecordBatch>)> {
        self.replay_standby(&[partition])?;
        let snapshot = self.snapshot_with_partition(table, partition)?;
        let part = &snapshot.partitions[partition.0 as usize];
        Ok((part.components.clone(), part.memtable.clone()))
    }

    /// The bytes of a component, checked against its hash before they leave this node.
    pub fn component_bytes(&self, hash: &ComponentHash) -> Result<Vec<u8>> {
        component::read_verified(&self.components_dir, hash)
    }

    /// True if this node holds a component under `hash` whose bytes hash to it: a copy
    /// need not fetch it again.
    pub fn has_component(&self, hash: &ComponentHash) -> bool {
        self.verify_component(hash).is_ok()
    }

    /// Replaces one partition of `table` with copied components and in-memory versions
    /// (component replication by hash). `fetched` holds the bytes of the components this
    /// node lacked; each is checked against its name before it is written, and the others
    /// must already be here. LSNs are this node's own, so each component is re-stamped.
    pub fn install_partition_components(
        &self,
        table: &str,
        partition: PartitionId,
        components: Vec<ComponentMeta>,
        fetched: HashMap<ComponentHash, Vec<u8>>,
        memtable: Vec<RecordBatch>,
    ) -> Result<()> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        let def = self.state().table(table)?.def.clone();
        self.store_fetched_components(&components, &fetched)?;
        let mut installed = Vec::with_capacity(components.len() + 1);
        for mut meta in components {
            let lsn = self.state().allocate_lsn(partition);
            (meta.min_lsn, meta.max_lsn) = (lsn, lsn);
            installed.push(meta);
        }
        let memtable: Vec<RecordBatch> =
            memtable.into_iter().filter(|b| b.num_rows() > 0).collect();
        if !memtable.is_empty() {
            let lsn = self.state().allocate_lsn(partition);
            installed.push(self.or_poison(self.write_component(&def, &memtable, lsn, lsn))?);
        }
        let mut state = self.state();
        let table_state = state
            .tables
            .get_mut(table)
            .expect("tables outlive the exclusive gate");
        let part = &mut table_state.partitions[partition.0 as usize];
        let dropped: Vec<ComponentHash> = part.manifest.components.iter().map(|c| c.hash).collect();
        let freed: usize = part
            .memtable
            .iter()
            .map(|e| e.batch.get_array_memory_size())
            .sum();
        part.memtable.clear();
        // Standby rows in the log are older than the LSNs just allocated: replay skips them.
        part.unapplied.clear();
        part.manifest.components.clear();
        for meta in installed {
            part.manifest.add(meta);
        }
        state.memtable_bytes -= freed;
        self.write_checkpoint(&state)?;
        self.collect_garbage(dropped, &state)
    }

    /// Replaces one partition of `table` with the given row versions (copied from a
    /// replica), as one durable component.
    pub fn install_partition(
        &self,
        table: &str,
        partition: PartitionId,
        versions: Vec<RecordBatch>,
    ) -> Result<()> {
        self.install_partition_since(table, partition, Epoch::ZERO, versions)
    }

    /// Delta recovery: replaces the versions of one partition with an epoch at or above
    /// `since` by `delta` (the primary's versions since then), keeping everything older.
    ///
    /// Idempotent: a returning replica may fail mid-failback and install the same delta
    /// again. When nothing local is at or above `since` (the usual case: the node was down),
    /// the existing components and memory stay and only the delta is written, as one more
    /// component; otherwise the partition is rewritten without its newer versions.
    pub fn install_partition_since(
        &self,
        table: &str,
        partition: PartitionId,
        since: Epoch,
        delta: Vec<RecordBatch>,
    ) -> Result<()> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        self.replay_standby_holding_gate(|p| *p == partition)?;
        let (def, components, memtable, memtable_reaches_since) = {
            let state = self.state();
            let table_state = state.table(table)?;
            let part = &table_state.partitions[partition.0 as usize];
            (
                table_state.def.clone(),
                part.manifest.components.clone(),
                part.memtable
                    .iter()
                    .map(|e| e.batch.clone())
                    .collect::<Vec<_>>(),
                part.memtable.iter().any(|e| e.epoch >= since),
            )
        };
        let rewrite = since == Epoch::ZERO
            || memtable_reaches_since
            || components.iter().any(|c| c.max_epoch >= since);
        let mut rows: Vec<RecordBatch> = Vec::new();
        if rewrite && since > Epoch::ZERO {
            let mut old = Vec::new();
            for component in &components {
                self.verify_component(&component.hash)?;
                old.extend(component::read_component(
                    &self.components_dir,
                    &component.hash,
                    None,
                )?);
            }
            old.extend(memtable);
            rows.extend(versions::versions_before(old, since)?);
        }
        rows.extend(delta);
        let rows: Vec<RecordBatch> = rows.into_iter().filter(|b| b.num_rows() > 0).collect();
        let meta = match (rows.is_empty(), rewrite) {
            (true, _) => None,
            // The partition's own versions (memory included) go into the new component, so
            // its LSN covers the log records they came from.
            (false, true) => {
                let lsn = self.state().allocate_lsn(partition);
                Some(self.or_poison(self.write_component(&def, &rows, lsn, lsn))?)
            }
            // Only the delta: it came from no local log record, so it takes LSN zero and
            // leaves the memtable (and the replay point of its log records) alone.
            (false, false) => {
                Some(self.or_poison(self.write_component(&def, &rows, Lsn::ZERO, Lsn::ZERO))?)
            }
        };
        let mut state = self.state();
        let table_state = state
            .tables
            .get_mut(table)
            .expect("tables outlive the exclusive gate");
        let part = &mut table_state.partitions[partition.0 as usize];
        let mut dropped = Vec::new();
        let mut freed = 0;
        if rewrite {
            dropped = part.manifest.components.iter().map(|c| c.hash).collect();
            part.manifest.components.clear();
            freed = part
                .memtable
                .iter()
                .map(|e| e.batch.get_array_memory_size())
                .sum();
            part.memtable.clear();
        }
        if let Some(meta) = meta {
            part.manifest.add(meta);
        }
        state.memtable_bytes -= freed;
        self.write_checkpoint(&state)?;
        self.collect_garbage(dropped, &state)
    }

    /// Writes the components among `components` that were fetched from a peer, each checked
    /// against its name first; the others must already be here, intact.
    fn store_fetched_components(
        &self,
        components: &[ComponentMeta],
        fetched: &HashMap<ComponentHash, Vec<u8>>,
    ) -> Result<()> {
        for meta in components {
            match fetched.get(&meta.hash) {
                Some(bytes) => {
                    let actual = ComponentHash::of_bytes(bytes);
                    if actual != meta.hash {
                        return Err(StorageError::CorruptComponent {
                            hash: meta.hash,
                            path: component::component_path(&self.components_dir, &meta.hash),
                            actual,
                        });
                    }
                    self.or_poison(component::write_component(&self.components_dir, bytes))?;
                    self.verified.lock().expect("verified lock").insert(actual);
                }
                None => self.verify_component(&meta.hash)?,
            }
        }
        Ok(())
    }

    /// Makes `standby` the partitions this store keeps as a cold standby: from now on their
    /// committed rows are logged and not applied. Returns the partitions leaving the set
    /// (promoted to primary): they stay cold standbys, and readers replay them on demand,
    /// until [`Store::promote`] has replayed their log, which the caller runs next (off the
    /// metadata's apply path: a long replay must not hold it up).
    pub fn set_standby_partitions(&self, standby: BTreeSet<PartitionId>) -> BTreeSet<PartitionId> {
        let mut state = self.state();
        if state.standby_wanted == standby {
            return BTreeSet::new();
        }
        let promoted: BTreeSet<PartitionId> = state.standby.difference(&standby).copied().collect();
        state.standby.extend(standby.iter().copied());
        state.standby_wanted = standby;
        promoted
    }

    /// Replays the logged rows of promoted partitions and applies their rows as they commit
    /// from now on (unless they became standbys again meanwhile). Returns how many row
    /// batches were replayed.
    pub fn promote(&self, promoted: &BTreeSet<PartitionId>) -> Result<usize> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        let replayed = self.replay_standby_holding_gate(|p| promoted.contains(p))?;
        let mut state = self.state();
        let wanted = state.standby_wanted.clone();
        state
            .standby
            .retain(|p| wanted.contains(p) || !promoted.contains(p));
        Ok(replayed)
    }

    /// Applies the committed rows of `partitions` that a cold standby kept in the log only,
    /// so they can be read; they stay standby partitions. Returns how many row batches were
    /// replayed.
    pub fn replay_standby(&self, partitions: &[PartitionId]) -> Result<usize> {
        let lagging = |state: &State| {
            state
                .logged_partitions()
                .any(|(_, p, _)| partitions.contains(&p))
        };
        if !lagging(&self.state()) {
            return Ok(0);
        }
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        self.replay_standby_holding_gate(|p| partitions.contains(p))
    }

    /// The (table, partition) pairs holding committed rows in the log only: what a
    /// checkpoint would have to apply itself unless their primaries ship components first.
    pub fn standby_lag(&self) -> Vec<(String, PartitionId)> {
        let state = self.state();
        state
            .logged_partitions()
            .map(|(table, p, _)| (table.to_string(), p))
            .collect()
    }

    /// Reads the log back and moves the committed rows that standby partitions selected by
    /// `which` kept there into memory (log replay). The caller holds the gate exclusively,
    /// so no append is in flight.
    fn replay_standby_holding_gate(&self, which: impl Fn(&PartitionId) -> bool) -> Result<usize> {
        let wanted: HashMap<(String, PartitionId), HashSet<Lsn>> = self
            .state()
            .logged_partitions()
            .filter(|(_, p, _)| which(p))
            .map(|(table, p, part)| {
                let lsns = part.unapplied.iter().map(|l| l.lsn).collect();
                ((table.to_string(), p), lsns)
            })
            .collect();
        if wanted.is_empty() {
            return Ok(0);
        }
        let started = std::time::Instant::now();
        let wal_dir = self.dir.join("wal");
        let mut log = PreparedLog::default();
        let mut found: Vec<(String, PartitionId, MemEntry)> = Vec::new();
        for record in wal::read_all(&wal_dir)? {
            let LogStep::Committed(epoch, entries) = log.step(record)? else {
                continue;
            };
            for (entry, lsn) in entries {
                let key = (entry.table, entry.partition);
                if wanted.get(&key).is_some_and(|lsns| lsns.contains(&lsn)) {
                    let entry = MemEntry {
                        lsn,
                        epoch,
                        batch: entry.batch,
                    };
                    found.push((key.0, key.1, entry));
                }
            }
        }
        let expected: usize = wanted.values().map(HashSet::len).sum();
        if found.len() != expected {
            return Err(StorageError::CorruptLog {
                path: wal_dir,
                offset: 0,
                reason: format!(
                    "a cold standby kept {expected} committed row batches in the log, but only {} are there",
                    found.len()
                ),
            });
        }
        let mut state = self.state();
        for (table, partition, entry) in found {
            state.memtable_bytes += entry.batch.get_array_memory_size();
            let table_state = state
                .tables
                .get_mut(&table)
                .expect("wanted names live tables");
            table_state.partitions[partition.0 as usize]
                .memtable
                .push(entry);
        }
        for (table, partition) in wanted.keys() {
            let part =
                &mut state.tables.get_mut(table).expect("live").partitions[partition.0 as usize];
            part.unapplied.clear();
            part.memtable.sort_by_key(|e| e.lsn);
        }
        tracing::info!(
            batches = expected,
            partitions = wanted.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "replayed cold-standby rows from the log"
        );
        Ok(expected)
    }

    /// What a primary ships to the cold standbys of one partition of `table`: the components
    /// holding its flushed versions, and the epoch through which they hold every version of
    /// the partition (a standby drops its logged rows up to it).
    pub fn shipped_manifest(
        &self,
        table: &str,
        partition: PartitionId,
    ) -> Result<(Vec<ComponentMeta>, Epoch)> {
        let state = self.state();
        let part = state.partition(table, partition)?;
        let before = |epoch: Epoch| Epoch(epoch.0.saturating_sub(1));
        // A table's epochs commit in epoch order, so every version of this partition up to
        // the newest flushed one is in a component, unless memory (or the log) still holds
        // an older one.
        let covered = [
            part.manifest.components.iter().map(|c| c.max_epoch).max(),
            part.memtable.iter().map(|e| before(e.epoch)).min(),
            part.unapplied.iter().map(|l| before(l.epoch)).min(),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(Epoch::ZERO);
        let covered = if part.manifest.components.is_empty() {
            Epoch::ZERO
        } else {
            covered
        };
        Ok((part.manifest.components.clone(), covered))
    }

    /// Component replication for a cold standby: replaces the components of one partition
    /// of `table` by its primary's (`components`, holding every version up to `covered`),
    /// and drops the rows it held for epochs up to `covered`, in the log or in memory. The
    /// components it lacked are in `fetched`, checked against their names; its old ones,
    /// merge inputs included, are deleted only now that the replacements are here.
    ///
    /// Returns false, changing nothing, if this node holds a component newer than `covered`
    /// (it flushed rows the primary had not yet flushed): a later shipment covers them.
    pub fn install_shipped_components(
        &self,
        table: &str,
        partition: PartitionId,
        components: Vec<ComponentMeta>,
        fetched: HashMap<ComponentHash, Vec<u8>>,
        covered: Epoch,
    ) -> Result<bool> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        {
            let state = self.state();
            let part = state.partition(table, partition)?;
            let same = part
                .manifest
                .components
                .iter()
                .map(|c| c.hash)
                .eq(components.iter().map(|c| c.hash));
            let nothing_to_drop = part.memtable.iter().all(|e| e.epoch > covered)
                && part.unapplied.iter().all(|l| l.epoch > covered);
            if part
                .manifest
                .components
                .iter()
                .any(|c| c.max_epoch > covered)
                || (same && nothing_to_drop)
            {
                return Ok(false);
            }
        }
        self.store_fetched_components(&components, &fetched)?;
        let mut state = self.state();
        let part = &mut state
            .tables
            .get_mut(table)
            .expect("tables outlive the exclusive gate")
            .partitions[partition.0 as usize];
        // Everything at or below this LSN is now in the components: the dropped rows' log
        // records, as a table's later epochs also have later LSNs.
        let mut covered_lsn = part.manifest.max_lsn;
        for logged in part.unapplied.iter().filter(|l| l.epoch <= covered) {
            covered_lsn = covered_lsn.max(logged.lsn);
        }
        let mut freed = 0;
        for entry in part.memtable.iter().filter(|e| e.epoch <= covered) {
            covered_lsn = covered_lsn.max(entry.lsn);
            freed += entry.batch.get_array_memory_size();
        }
        part.memtable.retain(|e| e.epoch > covered);
        part.unapplied.retain(|l| l.epoch > covered);
        debug_assert!(
            part.memtable.iter().all(|e| e.lsn > covered_lsn)
                && part.unapplied.iter().all(|l| l.lsn > covered_lsn),
            "rows kept must replay above the components' LSN"
        );
        let dropped: Vec<ComponentHash> = part.manifest.components.iter().map(|c| c.hash).collect();
        part.manifest.components = components
            .into_iter()
            .map(|mut meta| {
                (meta.min_lsn, meta.max_lsn) = (covered_lsn, covered_lsn);
                meta
            })
            .collect();
        part.manifest.max_lsn = covered_lsn;
        state.memtable_bytes -= freed;
        self.write_checkpoint(&state)?;
        self.collect_garbage(dropped, &state)?;
        Ok(true)
    }

    /// Cluster epochs prepared here whose fate this node has not yet learnt.
    pub fn undecided_epochs(&self) -> Vec<Epoch> {
        self.state().pending.keys().copied().collect()
    }

    /// Lets readers ask for any epoch up to `epoch`: in a cluster the metadata service, not
    /// this store, decides which epochs are visible.
    pub fn advance_visible(&self, epoch: Epoch) {
        self.state().advance_visible_to(epoch);
    }

    /// True once memory holds enough rows that a checkpoint should run.
    pub fn wants_checkpoint(&self) -> bool {
        let state = self.state();
        state.memtable_bytes >= self.config.memtable_flush_bytes
            || state.logged_bytes >= self.config.checkpoint_log_bytes
    }

    /// Flushes memory to components, records manifests, drops log segments the checkpoint
    /// covers, and merges partitions that have too many components.
    pub fn checkpoint(&self) -> Result<()> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        self.checkpoint_holding_gate()
    }

    /// Flushes memory to components without truncating the log: what a primary does when
    /// a cold standby of its partitions wants components before truncating its own log.
    pub fn flush(&self) -> Result<()> {
        let _gate = self.gate.write().expect("gate lock");
        self.check_poisoned()?;
        self.flush_memtables()
    }

    /// The body of [`Store::checkpoint`], for callers already holding the gate exclusively.
    fn checkpoint_holding_gate(&self) -> Result<()> {
        // The segments about to go may hold a cold standby's only copy of committed rows not
        // yet covered by components from its primary: apply them, so the flush keeps them.
        let replayed = self.replay_standby_holding_gate(|_| true)?;
        if replayed > 0 {
            tracing::info!(
                replayed,
                "applied cold-standby rows the primary has not shipped components for"
            );
        }
        self.flush_memtables()?;
        self.state().logged_bytes = 0;
        {
            // Epoch and LSN counters must be durable before the log that held them goes.
            let state = self.state();
            self.write_checkpoint(&state)?;
        }
        let segment = self.or_poison(self.wal.rotate())?;
        // Undecided cluster epochs must outlive the segments about to be deleted.
        let relogged = {
            let state = self.state();
            let mut frames = Vec::new();
            for (epoch, entries) in &state.pending {
                for entry in entries {
                    frames.extend(
                        WalRecord::Prepared {
                            table: entry.table.clone(),
                            partition: entry.partition,
                            epoch: *epoch,
                            seq: entry.seq,
                            batch: entry.batch.clone(),
                        }
                        .encode_frame()?,
                    );
                }
            }
            frames
        };
        if !relogged.is_empty() {
            self.or_poison(self.wal.submit(relogged).wait())?;
        }
        self.or_poison(self.wal.delete_segments_before(segment))?;
        self.merge_crowded_partitions()
    }

    fn merge_crowded_partitions(&self) -> Result<()> {
        let (work, retained_from) = {
            let state = self.state();
            let work: Vec<(TableDef, PartitionId, Vec<ComponentMeta>)> = state
                .tables
                .values()
                .flat_map(|t| {
                    t.partitions
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.manifest.components.len() > self.config.merge_threshold)
                        .map(|(i, p)| {
                            (
                                t.def.clone(),
                                PartitionId(i as u32),
                                p.manifest.components.clone(),
                            )
                        })
                })
                .collect();
            (work, state.retained_from)
        };
        for (def, partition, inputs) in work {
            let mut batches = Vec::new();
            for input in &inputs {
                self.verify_component(&input.hash)?;
                batches.extend(component::read_component(
                    &self.components_dir,
                    &input.hash,
                    None,
                )?);
            }
            let merged = versions::merge_versions(
                &batches,
                &def.primary_key_indices(),
                retained_from,
                def.append_only,
            )?;
            let min_lsn = inputs
                .iter()
                .map(|c| c.min_lsn)
                .min()
                .expect("a merge has inputs");
            let max_lsn = inputs
                .iter()
                .map(|c| c.max_lsn)
                .max()
                .expect("a merge has inputs");
            let merged_meta = if merged.num_rows() > 0 {
                Some(self.write_component(&def, &[merged], min_lsn, max_lsn)?)
            } else {
                None
            };
            let mut state = self.state();
            let table = state
                .tables
                .get_mut(&def.name)
                .expect("tables outlive the exclusive gate");
            let manifest = &mut table.partitions[partition.0 as usize].manifest;
            assert_eq!(
                manifest.components, inputs,
                "manifests change only under the exclusive gate"
            );
            manifest.components = merged_meta.into_iter().collect();
            self.write_checkpoint(&state)?;
            tracing::debug!(table = %def.name, %partition, inputs = inputs.len(), "merged components");
            self.collect_garbage(inputs.iter().map(|c| c.hash).collect(), &state)?;
        }
        Ok(())
    }

    /// Queues components no manifest references for deletion once no snapshot can read them.
    fn collect_garbage(&self, dropped: Vec<ComponentHash>, state: &State) -> Result<()> {
        let referenced = state.referenced_components();
        let mut registry = self.readers.lock().expect("reader registry lock");
        let generation = registry.generation;
        registry.generation += 1;
        registry.garbage.extend(
            dropped
                .into_iter()
                .filter(|h| !referenced.contains(h))
                .map(|h| (generation, h)),
        );
        let oldest_reader = registry.active.keys().next().copied().unwrap_or(u64::MAX);
        let (deletable, kept): (Vec<_>, Vec<_>) = registry
            .garbage
            .drain(..)
            .partition(|(g, _)| *g < oldest_reader);
        registry.garbage = kept;
        drop(registry);
        // A component dropped earlier may be referenced again since (a replica copied the
        // same bytes back): it is no longer garbage.
        for (_, hash) in deletable
            .into_iter()
            .filter(|(_, h)| !referenced.contains(h))
        {
            let path = component::component_path(&self.components_dir, &hash);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StorageError::io(&path, e)),
            }
            self.verified.lock().expect("verified lock").remove(&hash);
        }
        Ok(())
    }

    /// Files of crashed bulk publishes or merges that no manifest names are removed at start.
    fn delete_unreferenced_component_files(&self) -> Result<()> {
        let referenced = self.state().referenced_components();
        let dir = &self.components_dir;
        for entry in std::fs::read_dir(dir).map_err(|e| StorageError::io(dir, e))? {
            let entry = entry.map_err(|e| StorageError::io(dir, e))?;
            let name = entry.file_name().to_string_lossy().to_string();
            let orphan = match name.strip_suffix(".parquet") {
                Some(hex) => ComponentHash::from_hex(hex).is_some_and(|h| !referenced.contains(&h)),
                None => name.ends_with(".tmp"),
            };
            if orphan {
                let path = entry.path();
                std::fs::remove_file(&path).map_err(|e| StorageError::io(&path, e))?;
            }
        }
        Ok(())
    }

    /// A consistent view of `table` at `epoch` (the visible epoch if `None`).
    pub fn snapshot(&self, table: &str, epoch: Option<Epoch>) -> Result<Arc<TableSnapshot>> {
        let state = self.state();
        let epoch = epoch.unwrap_or(state.visible);
        if epoch > state.visible {
            return Err(StorageError::EpochNotVisible {
                requested: epoch,
                visible: state.visible,
            });
        }
        if epoch < state.retained_from {
            return Err(StorageError::EpochNotRetained {
                requested: epoch,
                retained_from: state.retained_from,
            });
        }
        let table = state.table(table)?;
        let partitions = table
            .partitions
            .iter()
            .enumerate()
            .map(|(i, p)| PartitionSnapshot {
                partition: PartitionId(i as u32),
                rows_in_log: p.unapplied.iter().any(|l| l.epoch <= epoch),
                components: p.manifest.components_at(epoch),
                memtable: p
                    .memtable
                    .iter()
                    .filter(|e| e.epoch <= epoch)
                    .map(|e| e.batch.clone())
                    .collect(),
            })
            .collect();
        let reader = {
            let mut registry = self.readers.lock().expect("reader registry lock");
            let generation = registry.generation;
            *registry.active.entry(generation).or_insert(0) += 1;
            ReaderGuard {
                registry: self.readers.clone(),
                generation,
            }
        };
        Ok(Arc::new(TableSnapshot {
            def: table.def.clone(),
            epoch,
            partitions,
            _reader: reader,
        }))
    }

    /// Checks, once per process, that a component's bytes hash to its name.
    pub fn verify_component(&self, hash: &ComponentHash) -> Result<()> {
        if self.verified.lock().expect("verified lock").contains(hash) {
            return Ok(());
        }
        component::verify_component(&self.components_dir, hash)?;
        self.verified.lock().expect("verified lock").insert(*hash);
        Ok(())
    }

    /// The table version id at `epoch`: a hash over its partition manifests, equal on any
    /// node holding the same data (Pond's version GUID). Rows still only in memory are not
    /// part of a manifest, so call after a checkpoint for a stable id.
    pub fn table_version(&self, table: &str, epoch: Epoch) -> Result<ComponentHash> {
        let state = self.state();
        let table = state.table(table)?;
        let mut hasher = blake3::Hasher::new();
        for partition in &table.partitions {
            hasher.update(&partition.manifest.hash_at(epoch).0);
        }
        Ok(ComponentHash(*hasher.finalize().as_bytes()))
    }

    pub fn table_stats(&self) -> Vec<TableStats> {
        let state = self.state();
        state
            .tables
            .values()
            .map(|t| TableStats {
                name: t.def.name.clone(),
                components: t
                    .partitions
                    .iter()
                    .map(|p| p.manifest.components.len())
                    .sum(),
                component_rows: t.partitions.iter().map(|p| p.manifest.row_count()).sum(),
                memtable_rows: t
                    .partitions
                    .iter()
                    .flat_map(|p| &p.memtable)
                    .map(|e| e.batch.num_rows() as u64)
                    .sum(),
                logged_rows: t
                    .partitions
                    .iter()
                    .flat_map(|p| &p.unapplied)
                    .map(|l| l.rows)
                    .sum(),
                partitions_with_data: t
                    .partitions
                    .iter()
                    .filter(|p| {
                        !p.manifest.components.is_empty()
                            || !p.memtable.is_empty()
                            || !p.unapplied.is_empty()
                    })
                    .count(),
            })
            .collect()
    }
}

struct PreparedChanges {
    def: TableDef,
    upserts: Vec<RecordBatch>,
    deletes: Vec<RecordBatch>,
}

impl PreparedChanges {
    /// Upserts conformed to the table's schema and deletes turned into tombstones; empty
    /// batches dropped.
    fn checked(def: TableDef, upserts: &[RecordBatch], deletes: &[RecordBatch]) -> Result<Self> {
        Ok(PreparedChanges {
            upserts: upserts
                .iter()
                .filter(|b| b.num_rows() > 0)
                .map(|b| versions::conform_to_schema(&def, b))
                .collect::<Result<_>>()?,
            deletes: deletes
                .iter()
                .filter(|b| b.num_rows() > 0)
                .map(|b| versions::tombstone_rows(&def, b))
                .collect::<Result<_>>()?,
            def,
        })
    }

    fn bytes(&self) -> usize {
        self.upserts
            .iter()
            .chain(&self.deletes)
            .map(|b| b.get_array_memory_size())
            .sum()
    }

    /// Row versions of this publish, stamped with `epoch`, grouped by partition.
    fn stamped_by_partition(
        &self,
        epoch: Epoch,
        ring: &PartitionRing,
    ) -> Result<Vec<(PartitionId, RecordBatch)>> {
        let mut stamped = Vec::new();
        for batch in &self.upserts {
            stamped.push(versions::stamp(&self.def, batch, epoch, RowOp::Upsert)?);
        }
        for batch in &self.deletes {
            stamped.push(versions::stamp(&self.def, batch, epoch, RowOp::Delete)?);
        }
        let mut by_partition: BTreeMap<PartitionId, Vec<RecordBatch>> = BTreeMap::new();
        for batch in &stamped {
            for (partition, rows) in versions::split_by_partition(&self.def, ring, batch)? {
                by_partition.entry(partition).or_default().push(rows);
            }
        }
        by_partition
            .into_iter()
            .map(|(partition, batches)| {
                Ok((partition, concat_batches(&batches[0].schema(), &batches)?))
            })
            .collect()
    }
}

/// Rebuilds memory from a checkpoint and the log: committed row records above each
/// manifest's max LSN go back into memtables; records of epochs without a commit record are
/// aborted and skipped.
/// Pairs prepared rows with the commit that gives them LSNs, as a log is read in order.
#[derive(Default)]
struct PreparedLog {
    /// Epochs prepared and not (yet) decided in the log read so far.
    undecided: BTreeMap<Epoch, Vec<PendingEntry>>,
}

/// What one log record meant to a [`PreparedLog`].
enum LogStep {
    Prepared(Epoch),
    Aborted,
    /// The committed epoch's entries, each with the LSN its commit record assigns.
    Committed(Epoch, Vec<(PendingEntry, Lsn)>),
    /// A record of the single-node publish path, for the caller.
    Other(WalRecord),
}

impl PreparedLog {
    /// Takes in the next record read from the log.
    fn step(&mut self, record: WalRecord) -> Result<LogStep> {
        Ok(match record {
            WalRecord::Prepared {
                table,
                partition,
                epoch,
                seq,
                batch,
            } => {
                let entry = PendingEntry {
                    seq,
                    table,
                    partition,
                    batch,
                };
                self.prepared(epoch, entry);
                LogStep::Prepared(epoch)
            }
            WalRecord::Abort { epoch } => {
                self.undecided.remove(&epoch);
                LogStep::Aborted
            }
            WalRecord::CommitPrepared { epoch, lsns } => {
                LogStep::Committed(epoch, self.committed(epoch, &lsns)?)
            }
            other => LogStep::Other(other),
        })
    }

    fn prepared(&mut self, epoch: Epoch, entry: PendingEntry) {
        // A checkpoint re-logs undecided rows, so the same entry may appear twice.
        let entries = self.undecided.entry(epoch).or_default();
        entries.retain(|e| e.seq != entry.seq);
        entries.push(entry);
        entries.sort_by_key(|e| e.seq);
    }

    /// The committed epoch's entries, each with the LSN its commit record assigns.
    fn committed(
        &mut self,
        epoch: Epoch,
        lsns: &[(String, PartitionId, Lsn)],
    ) -> Result<Vec<(PendingEntry, Lsn)>> {
        let entries = self.undecided.remove(&epoch).unwrap_or_default();
        if !entries.is_empty() && entries.len() != lsns.len() {
            return Err(StorageError::CorruptCheckpoint {
                path: PathBuf::from("wal"),
                reason: format!(
                    "commit of epoch {epoch} assigns {} LSNs to {} prepared entries",
                    lsns.len(),
                    entries.len()
                ),
            });
        }
        let mut paired = Vec::with_capacity(entries.len());
        for (entry, (table, partition, lsn)) in entries.into_iter().zip(lsns) {
            if *table != entry.table || *partition != entry.partition {
                return Err(StorageError::CorruptCheckpoint {
                    path: PathBuf::from("wal"),
                    reason: format!("commit of epoch {epoch} names {table:?} partition {partition} where rows of {:?} partition {} were prepared", entry.table, entry.partition),
                });
            }
            paired.push((entry, *lsn));
        }
        Ok(paired)
    }
}

fn replay(
    checkpoint: Checkpoint,
    records: Vec<WalRecord>,
    torn_bytes: u64,
) -> Result<(State, RecoveryReport)> {
    let committed: HashSet<Epoch> = records
        .iter()
        .filter_map(|r| match r {
            WalRecord::Commit { epoch } => Some(*epoch),
            _ => None,
        })
        .collect();
    let mut state = State {
        tables: checkpoint
            .tables
            .into_iter()
            .map(|t| {
                let partitions = t
                    .manifests
                    .into_iter()
                    .map(|manifest| PartitionState {
                        manifest,
                        memtable: Vec::new(),
                        unapplied: Vec::new(),
                    })
                    .collect();
                (
                    t.def.name.clone(),
                    TableState {
                        def: t.def,
                        partitions,
                    },
                )
            })
            .collect(),
        partition_next_lsn: checkpoint.partition_next_lsn,
        next_epoch: checkpoint.next_epoch,
        visible: Epoch::ZERO,
        resolved_above_visible: BTreeSet::new(),
        retained_from: checkpoint.retained_from,
        memtable_bytes: 0,
        pending: BTreeMap::new(),
        next_prepare_seq: HashMap::new(),
        standby: BTreeSet::new(),
        standby_wanted: BTreeSet::new(),
        logged_bytes: 0,
    };
    let mut report = RecoveryReport {
        torn_bytes,
        ..Default::default()
    };
    let mut last_lsn: HashMap<(String, PartitionId), Lsn> = HashMap::new();
    let mut prepared = PreparedLog::default();
    for record in records {
        let record = match prepared.step(record)? {
            LogStep::Prepared(epoch) => {
                state.next_epoch = state.next_epoch.max(epoch.next());
                continue;
            }
            LogStep::Aborted => continue,
            LogStep::Committed(epoch, entries) => {
                for (entry, lsn) in entries {
                    if let Some(next) = state.partition_next_lsn.get_mut(entry.partition.0 as usize)
                    {
                        *next = (*next).max(lsn.next());
                    }
                    let Some(partition_state) = state
                        .tables
                        .get_mut(&entry.table)
                        .and_then(|t| t.partitions.get_mut(entry.partition.0 as usize))
                    else {
                        continue;
                    };
                    if lsn <= partition_state.manifest.max_lsn {
                        continue;
                    }
                    state.memtable_bytes += entry.batch.get_array_memory_size();
                    partition_state.memtable.push(MemEntry {
                        lsn,
                        epoch,
                        batch: entry.batch,
                    });
                    report.replayed_records += 1;
                }
                continue;
            }
            LogStep::Other(record) => record,
        };
        let (table, partition, lsn, epoch, batch) = match record {
            WalRecord::Rows {
                table,
                partition,
                lsn,
                epoch,
                batch,
            } => (table, partition, lsn, epoch, batch),
            _ => continue,
        };
        state.next_epoch = state.next_epoch.max(epoch.next());
        if let Some(next) = state.partition_next_lsn.get_mut(partition.0 as usize) {
            *next = (*next).max(lsn.next());
        }
        if !committed.contains(&epoch) {
            report.skipped_uncommitted_records += 1;
            continue;
        }
        let Some(table_state) = state.tables.get_mut(&table) else {
            continue;
        };
        let Some(partition_state) = table_state.partitions.get_mut(partition.0 as usize) else {
            return Err(StorageError::CorruptCheckpoint {
                path: PathBuf::from(crate::checkpoint::CHECKPOINT_FILE),
                reason: format!("log names partition {partition} of table {table:?}, beyond the partition count"),
            });
        };
        if lsn <= partition_state.manifest.max_lsn {
            continue;
        }
        let previous = last_lsn.insert((table.clone(), partition), lsn);
        assert!(
            previous.is_none_or(|p| p < lsn),
            "LSNs rise within a partition's log"
        );
        state.memtable_bytes += batch.get_array_memory_size();
        partition_state
            .memtable
            .push(MemEntry { lsn, epoch, batch });
        report.replayed_records += 1;
    }
    for epoch in committed {
        state.next_epoch = state.next_epoch.max(epoch.next());
    }
    state.pending = prepared.undecided;
    for (epoch, entries) in &state.pending {
        let next = entries.iter().map(|e| e.seq + 1).max().unwrap_or(0);
        state.next_prepare_seq.insert(*epoch, next);
    }
    // Every allocated epoch is now resolved: those with commit records are committed, the
    // rest were in flight at the crash and are aborted.
    state.visible = Epoch(state.next_epoch.0 - 1);
    report.visible_epoch = state.visible;
    Ok((state, report))
}
