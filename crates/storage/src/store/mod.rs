//! The store of one node: tables, their partitions, publishing epochs, snapshots for
//! readers, checkpoints, merges and crash recovery.
//!
//! Concurrency: a publish through the log holds the *gate* shared, so publishes group-commit
//! together; checkpoints, bulk publishes and DDL hold it exclusively, so they see no publish
//! half done; an exclusive section hands the gate to the waiting publishes when it ends
//! (`gate.rs`), so back-to-back ones cannot starve them. Readers never take the gate: they copy what an epoch needs under the short
//! state lock and read immutable components afterwards.
//!
//! Visibility: epochs are allocated in order and committed possibly out of order (group
//! commit); the visible epoch advances only over a contiguous run of resolved (committed or
//! aborted) epochs, so a visible epoch never moves back and never exposes a gap.
//!
//! By role: this file opens the store and holds its state; [`publish`] (local publishes,
//! logged or bulk), [`participant`] (prepare, commit, abort: the store in a cluster
//! publish), [`transfer`] (a partition's versions and export, installing copies),
//! [`standby`] (cold standbys: promotion, shipped components), [`maintenance`]
//! (checkpoints, merges, garbage collection), [`snapshot`] (what readers see), [`replay`]
//! (crash recovery).

use crate::catalog::TableDef;
use crate::checkpoint::{Checkpoint, TableCheckpoint};
use crate::component::{self, ComponentMeta};
use crate::error::{Result, StorageError};
use crate::fsio::{self, DirLock};
use crate::history::{LocalCommit, LocalHistory, TableRows};
use crate::manifest::Manifest;
use crate::prepared::EncodedRows;
use crate::versions;
use crate::wal::{self, Wal, WalRecord};
use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tessera_common::memory::held_bytes;
use tessera_common::{ComponentHash, Epoch, Lsn, PartitionId, PartitionRing, ReadEpochs, RowOp};

mod archive;
mod gate;
mod history;
mod maintenance;
mod participant;
mod publish;
mod replay;
mod scrub;
mod snapshot;
mod standby;
mod transfer;
mod verified;

pub use maintenance::MEMTABLE_STALL_FACTOR;
use publish::PreparedChanges;
use replay::replay;
pub use scrub::HeldComponent;
pub use transfer::{PartitionCopy, PartitionDelta};

/// Store settings, with defaults suited to a laptop or a small server.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Partitions of the hash ring; fixed when the store is created.
    pub partitions: u32,
    /// A checkpoint runs once the in-memory components hold this many bytes; at
    /// [`MEMTABLE_STALL_FACTOR`] times as many, new rows wait for the flush under way.
    pub memtable_flush_bytes: usize,
    /// A checkpoint also runs once this many bytes of committed rows were logged since the
    /// last one: it bounds how much log a restart, or a cold standby's promotion, replays.
    pub checkpoint_log_bytes: usize,
    /// Publishes at least this large bypass the log and write components directly.
    pub bulk_publish_bytes: usize,
    /// A partition with more components than this is merged at the next checkpoint.
    pub merge_threshold: usize,
    /// Also merge a partition's live components before they crowd, once all but the
    /// largest add up to half of it (`maintenance::tiered_merge_due`):
    /// a table loaded or changed in a few large publishes is then read as one file per
    /// partition. Off, only the count decides (tests and benchmarks that keep publishes
    /// apart).
    pub tiered_merges: bool,
    /// The largest publish accepted, in bytes of Arrow data.
    pub max_publish_bytes: usize,
    /// A checkpoint also runs once rows have waited in memory this long with no more
    /// arriving (0: never for that reason). Asked by a node's duty loop.
    pub idle_checkpoint_ms: u64,
}

impl StoreConfig {
    pub const DEFAULT_MEMTABLE_FLUSH_BYTES: usize = 64 << 20;
    pub const DEFAULT_CHECKPOINT_LOG_BYTES: usize = 256 << 20;
    pub const DEFAULT_BULK_PUBLISH_BYTES: usize = 8 << 20;
    pub const DEFAULT_MERGE_THRESHOLD: usize = 8;
    pub const DEFAULT_MAX_PUBLISH_BYTES: usize = 8 << 30;
    pub const DEFAULT_IDLE_CHECKPOINT_MS: u64 = 10_000;
}

impl StoreConfig {
    /// A store of `partitions` tuned by a node's `[store]` section: what it leaves unset
    /// keeps the default above.
    pub fn with_settings(
        partitions: u32,
        settings: &tessera_common::config::StoreSettings,
    ) -> Self {
        let default = StoreConfig::default();
        StoreConfig {
            partitions,
            memtable_flush_bytes: settings
                .memtable_flush_bytes
                .unwrap_or(default.memtable_flush_bytes),
            checkpoint_log_bytes: settings
                .checkpoint_log_bytes
                .unwrap_or(default.checkpoint_log_bytes),
            bulk_publish_bytes: settings
                .bulk_publish_bytes
                .unwrap_or(default.bulk_publish_bytes),
            merge_threshold: settings.merge_threshold.unwrap_or(default.merge_threshold),
            tiered_merges: settings.tiered_merges.unwrap_or(default.tiered_merges),
            max_publish_bytes: settings
                .max_publish_bytes
                .unwrap_or(default.max_publish_bytes),
            idle_checkpoint_ms: settings
                .idle_checkpoint_ms
                .unwrap_or(default.idle_checkpoint_ms),
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            partitions: tessera_common::DEFAULT_PARTITIONS,
            memtable_flush_bytes: Self::DEFAULT_MEMTABLE_FLUSH_BYTES,
            checkpoint_log_bytes: Self::DEFAULT_CHECKPOINT_LOG_BYTES,
            bulk_publish_bytes: Self::DEFAULT_BULK_PUBLISH_BYTES,
            merge_threshold: Self::DEFAULT_MERGE_THRESHOLD,
            tiered_merges: true,
            max_publish_bytes: Self::DEFAULT_MAX_PUBLISH_BYTES,
            idle_checkpoint_ms: Self::DEFAULT_IDLE_CHECKPOINT_MS,
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
    /// Before images (the table's columns): for keys an UPDATE or DELETE read and then
    /// changed, the rows as it read them. Stored beside the versions
    /// ([`tessera_common::RowOp::Before`]) so that a diff takes a key's row before the
    /// change from the change's own epoch. Only right if no other publish changed the
    /// key between that read and this epoch, so a publish carries them only with the epoch
    /// it read the table at, which the write-conflict check holds it to (a store refuses
    /// them without one).
    pub before_images: Vec<RecordBatch>,
}

impl TableChanges {
    /// Upserts only, as a load or a blind publish writes them.
    pub fn upserts(table: impl Into<String>, upserts: Vec<RecordBatch>) -> Self {
        TableChanges {
            table: table.into(),
            upserts,
            ..Default::default()
        }
    }

    /// Deletes of the keys in `deletes` only.
    pub fn deletes(table: impl Into<String>, deletes: Vec<RecordBatch>) -> Self {
        TableChanges {
            table: table.into(),
            deletes,
            ..Default::default()
        }
    }

    /// Before images are right only if nothing changed their keys between the read they
    /// came from and the publish's epoch, which the write-conflict check of the table's
    /// read epoch guarantees: without one they would be trusted unchecked.
    pub fn refuse_unchecked_before_images(&self, read_at: &ReadEpochs) -> Result<()> {
        let has_images = self.before_images.iter().any(|b| b.num_rows() > 0);
        if has_images && !read_at.contains_key(&self.table) {
            return Err(StorageError::UncheckedBeforeImages {
                table: self.table.clone(),
            });
        }
        Ok(())
    }
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
    /// Keeps this store's components from deletion while the snapshot lives; `None` for a
    /// snapshot of another node's replica ([`TableSnapshot::detached`]).
    _reader: Option<ReaderGuard>,
}

impl TableSnapshot {
    /// A snapshot of partitions held elsewhere (another node's replica, described to a
    /// compute node): no store protects its components, so whoever reads it keeps the
    /// files it names (a cache pins them).
    pub fn detached(def: TableDef, epoch: Epoch, partitions: Vec<PartitionSnapshot>) -> Self {
        TableSnapshot {
            def,
            epoch,
            partitions,
            _reader: None,
        }
    }
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
    pub fn is_plain_scan(&self, epoch: Epoch, layout: u32) -> bool {
        self.plain_components(epoch, layout)
            .is_some_and(|components| components.len() == 1)
    }

    /// The partition's components, if each one's rows at `epoch` are all of its rows, as
    /// written: no memtable, and every component duplicate-free, without tombstones, every
    /// version at or below `epoch`, and written under the table's
    /// current definition (`layout`; a plain reader matches columns by name and would not
    /// conform an older file). Such components read as plain Parquet when no key occurs in
    /// two of them: one component, an append-only table (no keys to resolve), or key
    /// ranges that do not overlap, which the reader proves from their statistics. Beside
    /// others, a merge's history component never counts: its rows are older versions of
    /// keys the others hold (or deleted), which only version resolution sorts out.
    pub fn plain_components(&self, epoch: Epoch, layout: u32) -> Option<&[ComponentMeta]> {
        let plain = |c: &ComponentMeta| {
            c.unique_keys
                && c.tombstones == 0
                && c.max_epoch <= epoch
                && c.layout == layout
                && (self.components.len() == 1 || !c.is_history())
        };
        (self.memtable.is_empty()
            && !self.components.is_empty()
            && self.components.iter().all(plain))
        .then_some(self.components.as_slice())
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
    /// Before images, as in [`TableChanges::before_images`].
    pub before_images: Vec<RecordBatch>,
}

/// One partition's rows of a prepare, checked, stamped and encoded, to be logged
/// ([`Store::encode_prepared`], [`Store::prepare_received`], [`Store::log_prepared`]).
pub struct PreparedEntry {
    pub table: String,
    pub partition: PartitionId,
    /// The row versions as their log record holds them, and as the head of their log
    /// shipping sends them to the other replicas.
    pub rows: EncodedRows,
    /// The same rows decoded, where this node will read them (it serves the partition);
    /// `None` for a cold standby's.
    batch: Option<RecordBatch>,
}

/// Prepared rows of a cluster epoch that is not yet decided: held (`R` = [`PendingRows`]),
/// or where a skim of the log found them ([`wal::FrameAt`]).
struct PendingEntry<R = PendingRows> {
    /// Position among the epoch's entries; a commit assigns LSNs in this order.
    seq: u32,
    table: String,
    partition: PartitionId,
    rows: R,
}

/// A pending entry's row versions: decoded, or (a cold standby's, shipped by the
/// partition's primary) the IPC messages they arrived in, which nothing reads before a
/// promotion replays the log.
enum PendingRows {
    Decoded(RecordBatch),
    Encoded(EncodedRows),
}

impl PendingRows {
    fn num_rows(&self) -> usize {
        match self {
            PendingRows::Decoded(batch) => batch.num_rows(),
            PendingRows::Encoded(rows) => rows.num_rows(),
        }
    }

    fn memory_size(&self) -> usize {
        match self {
            PendingRows::Decoded(batch) => held_bytes(batch),
            PendingRows::Encoded(rows) => rows.bytes(),
        }
    }

    /// The rows, decoded if they are not yet (a cold standby's partition promoted between
    /// the prepare and the commit).
    fn into_batch(self) -> Result<RecordBatch> {
        match self {
            PendingRows::Decoded(batch) => Ok(batch),
            PendingRows::Encoded(rows) => rows.decode(),
        }
    }

    /// The entry's log record, as its prepare wrote it.
    fn frame(
        &self,
        table: &str,
        partition: PartitionId,
        epoch: Epoch,
        seq: u32,
    ) -> Result<wal::Frame> {
        match self {
            PendingRows::Decoded(batch) => Ok(WalRecord::Prepared {
                table: table.to_string(),
                partition,
                epoch,
                seq,
                batch: batch.clone(),
            }
            .encode_frame()?
            .into()),
            PendingRows::Encoded(rows) => {
                Ok(wal::PreparedFrame::new(table, partition, epoch, rows).finish(seq))
            }
        }
    }
}

struct MemEntry {
    lsn: Lsn,
    epoch: Epoch,
    batch: RecordBatch,
    /// The memory `batch` holds ([`held_bytes`]), counted once as the entry is made: what
    /// it adds to and takes from `State::memtable_bytes`.
    bytes: usize,
}

impl MemEntry {
    fn new(lsn: Lsn, epoch: Epoch, batch: RecordBatch) -> MemEntry {
        let bytes = held_bytes(&batch);
        MemEntry {
            lsn,
            epoch,
            batch,
            bytes,
        }
    }
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

impl PartitionState {
    /// The newest epoch of a version this partition holds: in a component, in memory, or
    /// committed and kept in the log only (a cold standby).
    fn newest_epoch(&self) -> Epoch {
        let components = self.manifest.components.iter().map(|c| c.max_epoch);
        let memory = self.memtable.iter().map(|e| e.epoch);
        let logged = self.unapplied.iter().map(|l| l.epoch);
        components
            .chain(memory)
            .chain(logged)
            .max()
            .unwrap_or(Epoch::ZERO)
    }
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
    /// The newest epoch a local publish of this table was given since the store opened:
    /// its rows reach the memtable only after the log is written, and a publish checked
    /// for write conflicts in between must count it already.
    last_allocated: Epoch,
}

struct State {
    tables: BTreeMap<String, TableState>,
    partition_next_lsn: Vec<Lsn>,
    next_epoch: Epoch,
    visible: Epoch,
    resolved_above_visible: BTreeSet<Epoch>,
    /// Cluster mode: every epoch up to this one is decided (the metadata's visible epoch,
    /// as this store was last told it).
    decided_through: Epoch,
    /// Cluster mode: epochs above `decided_through` whose commit or abort this store has
    /// applied. With it, a prepare that arrives after its epoch's decision is known late.
    decided_above: BTreeSet<Epoch>,
    retained_from: Epoch,
    /// Each table's retention horizon as the metadata sets it (absent: every epoch kept):
    /// merges drop what no epoch at or above it sees, and reads below it are refused.
    horizons: BTreeMap<String, Epoch>,
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
    /// When local publishes committed, and tags (see [`crate::history`]).
    history: LocalHistory,
    /// Bytes of committed rows logged since the last checkpoint. Counted at commit, not at
    /// prepare: a checkpoint set off in the middle of a large prepare would have to re-log
    /// the whole undecided epoch, and could not have its primaries cover it yet.
    logged_bytes: usize,
    /// How long `memtable_bytes` has stayed as it is, for the idle checkpoint.
    idle: maintenance::IdleWatch,
}

impl State {
    /// The oldest epoch at which `table` is still read exactly.
    fn horizon(&self, table: &str) -> Epoch {
        self.horizons
            .get(table)
            .copied()
            .unwrap_or(Epoch::ZERO)
            .max(self.retained_from)
    }

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

    /// Cluster mode: records that this store applied `epoch`'s commit or abort.
    fn record_decision(&mut self, epoch: Epoch) {
        if epoch > self.decided_through {
            self.decided_above.insert(epoch);
        }
    }

    /// Cluster mode: whether `epoch` is known decided here.
    fn is_decided(&self, epoch: Epoch) -> bool {
        epoch <= self.decided_through || self.decided_above.contains(&epoch)
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

    /// Refuses a publish of rows read at `read_at` from tables that changed since (see
    /// [`Store::publish_read_at`]). A table's last change is its newest row version, or
    /// the newest epoch given to a publish of it.
    fn refuse_write_conflict(&self, read_at: &ReadEpochs) -> Result<()> {
        for (table, &read) in read_at {
            let state = self.table(table)?;
            let changed = state
                .partitions
                .iter()
                .map(PartitionState::newest_epoch)
                .chain([state.last_allocated])
                .max()
                .unwrap_or(Epoch::ZERO);
            if changed > read {
                return Err(StorageError::WriteConflict {
                    table: table.clone(),
                    read,
                    changed,
                });
            }
        }
        Ok(())
    }

    /// Takes the next epoch for a publish writing `tables`.
    fn allocate_publish_epoch<'a>(&mut self, tables: impl Iterator<Item = &'a str>) -> Epoch {
        let epoch = self.allocate_epoch();
        for table in tables {
            if let Some(state) = self.tables.get_mut(table) {
                state.last_allocated = epoch;
            }
        }
        epoch
    }

    fn table(&self, name: &str) -> Result<&TableState> {
        self.tables
            .get(name)
            .ok_or_else(|| StorageError::UnknownTable(name.to_string()))
    }

    fn table_mut(&mut self, name: &str) -> Result<&mut TableState> {
        self.tables
            .get_mut(name)
            .ok_or_else(|| StorageError::UnknownTable(name.to_string()))
    }

    /// Every partition of every table.
    fn all_partitions(&self) -> impl Iterator<Item = (&TableState, PartitionId, &PartitionState)> {
        self.tables.values().flat_map(|t| {
            t.partitions
                .iter()
                .enumerate()
                .map(move |(i, p)| (t, PartitionId(i as u32), p))
        })
    }

    /// The (table, partition) pairs holding committed rows in the log only (cold standby).
    fn logged_partitions(&self) -> impl Iterator<Item = (&str, PartitionId, &PartitionState)> {
        self.all_partitions()
            .filter(|(_, _, p)| !p.unapplied.is_empty())
            .map(|(t, partition, p)| (t.def.name.as_str(), partition, p))
    }

    /// A partition of a table that cannot have been dropped: the caller holds the store's
    /// gate (a publish shares it, maintenance and transfers hold it exclusively), and a
    /// drop takes it exclusively.
    fn held_partition_mut(&mut self, table: &str, partition: PartitionId) -> &mut PartitionState {
        &mut self
            .tables
            .get_mut(table)
            .expect("tables outlive the store's gate, which the caller holds")
            .partitions[partition.0 as usize]
    }

    fn partition(&self, table: &str, partition: PartitionId) -> Result<&PartitionState> {
        let partitions = &self.table(table)?.partitions;
        partitions
            .get(partition.0 as usize)
            .ok_or_else(|| StorageError::UnknownPartition {
                table: table.to_string(),
                partition,
                partitions: partitions.len(),
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
            history: self.history.clone(),
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

impl Store {
    /// Keeps every component that some manifest names now on disk until the guard drops,
    /// even if a merge or an install drops it from its manifest meanwhile (it is then
    /// deleted once no older guard is left). Take it while holding the state lock that the
    /// component list to read was taken under.
    fn pin_components(&self) -> ReaderGuard {
        let mut registry = self.readers.lock().expect("reader registry lock");
        let generation = registry.generation;
        *registry.active.entry(generation).or_insert(0) += 1;
        ReaderGuard {
            registry: self.readers.clone(),
            generation,
        }
    }
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
    gate: gate::Gate,
    /// Held by a flush from its freeze to its install, and by a bulk publish (which
    /// flushes too): one flush at a time (see `maintenance.rs`). Taken before the gate.
    flushing: Mutex<()>,
    wal: Wal,
    verified: verified::VerifiedComponents,
    readers: Arc<Mutex<ReaderRegistry>>,
    poisoned: Mutex<Option<String>>,
    /// The erasure-coded archive's fragments this node holds.
    fragments: crate::archive::FragmentStore,
    /// Checkpoints written since the store opened (see [`Store::checkpoints_written`]).
    checkpoints_written: std::sync::atomic::AtomicU64,
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
        let read_format = checkpoint.format;
        let (state, report) = replay(checkpoint, log.records, log.torn_bytes)?;
        // Appending to the last segment is safe: recovery cut any torn tail off it.
        let wal = Wal::start(&wal_dir, log.last_segment.max(1))?;
        // Checks an earlier process of this boot made of components unchanged since.
        let verified =
            verified::VerifiedComponents::open(dir, &components_dir, verified::current_boot_id());
        let store = Store {
            dir: dir.to_path_buf(),
            components_dir,
            ring: PartitionRing::new(config.partitions),
            config,
            state: Mutex::new(state),
            gate: gate::Gate::default(),
            flushing: Mutex::new(()),
            wal,
            verified,
            readers: Arc::new(Mutex::new(ReaderRegistry::default())),
            poisoned: Mutex::new(None),
            fragments: crate::archive::FragmentStore::open(&dir.join("fragments"))?,
            checkpoints_written: Default::default(),
            _lock: lock,
        };
        store.delete_unreferenced_component_files()?;
        if read_format < crate::checkpoint::FORMAT_VERSION {
            // Before anything of the newer format is written: a build that reads only the
            // older one must then refuse this directory rather than misread it.
            store.write_checkpoint(&store.state())?;
            tracing::info!(
                from = read_format,
                to = crate::checkpoint::FORMAT_VERSION,
                "data format upgraded"
            );
        }
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
        match self.poisoned_by() {
            Some(reason) => Err(StorageError::Poisoned(reason)),
            None => Ok(()),
        }
    }

    /// Why the store stopped taking writes (a failed write or fsync of its log or data),
    /// if it did: nothing it holds beyond its last good fsync can be trusted.
    pub fn poisoned_by(&self) -> Option<String> {
        self.poisoned
            .lock()
            .expect("poison lock")
            .clone()
            .or_else(|| self.wal.poisoned())
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
        self.checkpoints_written
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.or_poison(result)
    }

    /// How many checkpoints (every table's manifests, written and fsynced) this store has
    /// written since it opened: each is a whole-store write, so work done in bulk should
    /// write one, not one per partition.
    pub fn checkpoints_written(&self) -> u64 {
        self.checkpoints_written
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn empty_table(&self, def: TableDef) -> TableState {
        let partitions = (0..self.ring.partition_count())
            .map(|_| PartitionState::default())
            .collect();
        TableState {
            def,
            partitions,
            last_allocated: Epoch::ZERO,
        }
    }

    pub fn create_table(&self, mut def: TableDef) -> Result<()> {
        let _gate = self.gate.exclusive(gate::Holder::Ddl);
        self.check_poisoned()?;
        let mut state = self.state();
        if state.tables.contains_key(&def.name) {
            return Err(StorageError::TableExists(def.name));
        }
        def.created_at = state.visible;
        state.tables.insert(def.name.clone(), self.empty_table(def));
        self.write_checkpoint(&state)
    }

    /// Changes a column of a local store's table (ALTER TABLE): epochs from the next one
    /// on see the change, earlier ones the columns as they were. Nothing is rewritten.
    pub fn alter_table(
        &self,
        name: &str,
        alter: &crate::evolution::AlterColumn,
    ) -> Result<TableDef> {
        let _gate = self.gate.exclusive(gate::Holder::Ddl);
        self.check_poisoned()?;
        let mut state = self.state();
        let from = state.next_epoch;
        let table = state.table_mut(name)?;
        let altered = table.def.altered(alter, from)?;
        table.def = altered.clone();
        self.write_checkpoint(&state)?;
        Ok(altered)
    }

    pub fn drop_table(&self, name: &str) -> Result<()> {
        let _gate = self.gate.exclusive(gate::Holder::Ddl);
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
            .map(|e| e.bytes)
            .sum::<usize>();
        self.write_checkpoint(&state)?;
        let dropped = table
            .partitions
            .iter()
            .flat_map(|p| p.manifest.components.iter().map(|c| c.hash));
        self.collect_garbage(dropped.collect(), &state)
    }
}
