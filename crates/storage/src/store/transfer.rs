//! Moving partitions between replicas: a partition's versions (all, or since an epoch),
//! its export (components and in-memory versions), and installing what was fetched.

use super::*;

/// One partition of one table copied whole from a replica
/// ([`Store::install_partitions_components`]).
pub struct PartitionCopy {
    pub table: String,
    pub partition: PartitionId,
    /// The source's components: they replace this node's.
    pub components: Vec<ComponentMeta>,
    /// The bytes of those of `components` this node lacked.
    pub fetched: HashMap<ComponentHash, Vec<u8>>,
    /// The source's versions still in its memory.
    pub memtable: Vec<RecordBatch>,
}

/// One partition's missed versions, for [`Store::install_partitions_since`].
#[derive(Debug)]
pub struct PartitionDelta {
    pub table: String,
    pub partition: PartitionId,
    /// The first epoch the delta replaces: every local version at or above it goes.
    pub since: Epoch,
    /// The source's versions from `since` on (the stored schema).
    pub versions: Vec<RecordBatch>,
}

impl Store {
    /// The stored row versions of one partition of `table` with an epoch at or above `since`
    /// (the stored schema, version columns included). `Epoch::ZERO` gives every version: what
    /// a new replica needs; a later epoch gives the delta a returning replica missed.
    pub fn partition_versions(
        &self,
        table: &str,
        partition: PartitionId,
        since: Epoch,
    ) -> Result<Vec<RecordBatch>> {
        self.read_partition_versions(table, partition, since, false)
    }

    /// As [`Store::partition_versions`]; with `rehash`, every component's bytes are hashed
    /// again now, even if this process checked them before (a scrub or `tessera verify`:
    /// the disk may have changed them since).
    pub(crate) fn read_partition_versions(
        &self,
        table: &str,
        partition: PartitionId,
        since: Epoch,
        rehash: bool,
    ) -> Result<Vec<RecordBatch>> {
        let horizon = self.retention_horizon(table);
        // A merge keeps every version above the horizon, but not all at or below it.
        if since != Epoch::ZERO && since <= horizon {
            return Err(StorageError::DeltaBeyondRetention {
                table: table.to_string(),
                partition,
                since,
                horizon,
            });
        }
        self.replay_standby(&[partition])?;
        let snapshot = self.snapshot_with_partition(table, partition)?;
        let part = &snapshot.partitions[partition.0 as usize];
        let mut batches = Vec::new();
        for component in part.components.iter().filter(|c| c.max_epoch >= since) {
            if rehash {
                self.rehash_component(&component.hash)?;
            }
            batches.extend(self.read_verified_rows(&snapshot.def, &component.hash)?);
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
        let snapshot = self.versions_snapshot(table, None)?;
        if snapshot.partitions.len() <= partition.0 as usize {
            return Err(StorageError::UnknownPartition {
                table: table.to_string(),
                partition,
                partitions: snapshot.partitions.len(),
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

    /// The bytes of a component, checked against its hash before they leave this node
    /// (once: a component checked before is read as it is; the receiver checks them again).
    pub fn component_bytes(&self, hash: &ComponentHash) -> Result<Vec<u8>> {
        if self.verified.contains(hash) {
            return component::read_checked_component(&self.components_dir, hash);
        }
        self.hash_component_now(hash)
    }

    /// Replaces this node's copy of a component (found damaged or missing) with `bytes`
    /// from another replica, after checking them against `hash`.
    pub fn repair_component(&self, hash: &ComponentHash, bytes: &[u8]) -> Result<()> {
        component::replace_component(&self.components_dir, hash, bytes)?;
        self.trust_written(*hash);
        Ok(())
    }

    /// Writes the `fetched` bytes of some of `components` (each checked against its name
    /// first) without installing them anywhere: a copy that follows finds them here. The
    /// others must be here already.
    pub fn keep_fetched_components(
        &self,
        components: &[ComponentMeta],
        fetched: &HashMap<ComponentHash, Vec<u8>>,
    ) -> Result<()> {
        self.store_fetched_components(components, fetched)
    }

    /// True if this node holds a component under `hash` whose bytes hash to it: a copy
    /// need not fetch it again.
    pub fn has_component(&self, hash: &ComponentHash) -> bool {
        component::component_path(&self.components_dir, hash).exists()
            && self.verify_component(hash).is_ok()
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
        fence: Option<Epoch>,
    ) -> Result<()> {
        let copy = PartitionCopy {
            table: table.to_string(),
            partition,
            components,
            fetched,
            memtable,
        };
        self.install_partitions_components(vec![copy], fence)
    }

    /// [`Store::install_partition_components`] for several partitions, under one hold of
    /// the gate and with one checkpoint for all of them: a new replica copies every
    /// partition of every table it takes on, and a checkpoint each (the whole store's
    /// manifests, written and fsynced) made much of that time.
    ///
    /// A copy refused by its checks stops the batch there: those before it stay installed,
    /// durably, and the error is returned.
    ///
    /// The fetched components are written before the gate is taken, as a standby's install
    /// does (see [`Store::install_shipped_components`]); a copy whose components cannot be
    /// stored ends the batch there too.
    pub fn install_partitions_components(
        &self,
        copies: Vec<PartitionCopy>,
        fence: Option<Epoch>,
    ) -> Result<()> {
        self.check_poisoned()?;
        let mut stored = Vec::with_capacity(copies.len());
        let mut refused = Ok(());
        for copy in copies {
            if let Err(error) = self.store_fetched_components(&copy.components, &copy.fetched) {
                refused = Err(error);
                break;
            }
            stored.push(copy);
        }
        let written = stored
            .iter()
            .flat_map(|copy| copy.fetched.keys().copied())
            .collect();
        self.install_batch(stored, written, |copy| {
            self.install_copy_holding_gate(copy, fence)
        })
        .and(refused)
    }

    /// Installs each of `items` with `install` under one hold of the gate, then writes one
    /// checkpoint for all that were installed and collects the components they replaced.
    /// Stops at the first refused item; those before it stay installed, durably.
    /// `written`: components stored for the items before the gate; those none of the
    /// installed items references (a refused one's) are collected too.
    fn install_batch<T>(
        &self,
        items: Vec<T>,
        written: Vec<ComponentHash>,
        mut install: impl FnMut(T) -> Result<Vec<ComponentHash>>,
    ) -> Result<()> {
        let _gate = self.gate.exclusive(gate::Holder::Copy);
        self.check_poisoned()?;
        let mut dropped = written;
        let mut installed = 0;
        let mut outcome = Ok(());
        for item in items {
            match install(item) {
                Ok(replaced) => {
                    dropped.extend(replaced);
                    installed += 1;
                }
                Err(error) => {
                    outcome = Err(error);
                    break;
                }
            }
        }
        // A failed write poisoned the store: nothing more is written, checkpoint included.
        if self.poisoned_by().is_none() {
            let state = self.state();
            if installed > 0 {
                self.write_checkpoint(&state)?;
            }
            self.collect_garbage(dropped, &state)?;
        }
        outcome
    }

    /// Installs one whole copy into the in-memory state (its components written, the
    /// checkpoint left to the caller); returns the components it replaced.
    fn install_copy_holding_gate(
        &self,
        copy: PartitionCopy,
        fence: Option<Epoch>,
    ) -> Result<Vec<ComponentHash>> {
        let PartitionCopy {
            table,
            partition,
            components,
            fetched,
            memtable,
        } = copy;
        let table = table.as_str();
        self.refuse_undecided(table, partition, Epoch::ZERO)?;
        self.refuse_newer_than(table, partition, fence)?;
        let def = self.state().table(table)?.def.clone();
        self.confirm_stored_components(&components, &fetched)?;
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
        let part = state.held_partition_mut(table, partition);
        let dropped: Vec<ComponentHash> = part.manifest.components.iter().map(|c| c.hash).collect();
        let freed: usize = part.memtable.iter().map(|e| e.bytes).sum();
        part.memtable.clear();
        // Standby rows in the log are older than the LSNs just allocated: replay skips them.
        part.unapplied.clear();
        part.manifest.components.clear();
        for meta in installed {
            part.manifest.add(meta);
        }
        if let Some(fence) = fence {
            part.manifest.hold_complete_through(fence);
        }
        state.memtable_bytes -= freed;
        Ok(dropped)
    }

    /// Replaces one partition of `table` with the given row versions (copied from a
    /// replica), as one durable component.
    pub fn install_partition(
        &self,
        table: &str,
        partition: PartitionId,
        versions: Vec<RecordBatch>,
    ) -> Result<()> {
        self.install_partition_since(table, partition, Epoch::ZERO, versions, None)
    }

    /// Delta recovery: replaces the versions of one partition with an epoch at or above
    /// `since` by `delta` (the primary's versions since then), keeping everything older.
    ///
    /// Idempotent: a returning replica may fail mid-failback and install the same delta
    /// again. When nothing local is at or above `since` (the usual case: the node was down),
    /// the existing components and memory stay and only the delta is written, as one more
    /// component; otherwise its components holding versions at or above `since`, and its
    /// memory, are rewritten without them, and its older components stay.
    pub fn install_partition_since(
        &self,
        table: &str,
        partition: PartitionId,
        since: Epoch,
        delta: Vec<RecordBatch>,
        fence: Option<Epoch>,
    ) -> Result<()> {
        let delta = PartitionDelta {
            table: table.to_string(),
            partition,
            since,
            versions: delta,
        };
        self.install_partitions_since(vec![delta], fence)
    }

    /// [`Store::install_partition_since`] for several partitions, under one hold of the gate
    /// and with one checkpoint for all of them. A returning replica installs dozens of small
    /// deltas while a rebalance holds every table's lease; a checkpoint each (the whole
    /// store's manifests, written and fsynced) made most of that time.
    ///
    /// A delta refused by its checks stops the batch there: those before it stay installed,
    /// durably, as if they had been installed one by one, and the error is returned.
    pub fn install_partitions_since(
        &self,
        deltas: Vec<PartitionDelta>,
        fence: Option<Epoch>,
    ) -> Result<()> {
        self.install_batch(deltas, Vec::new(), |delta| {
            self.install_delta_holding_gate(delta, fence)
        })
    }

    /// Installs one delta into the in-memory state (its component written and fsynced, the
    /// checkpoint left to the caller); returns the components it replaced.
    fn install_delta_holding_gate(
        &self,
        delta: PartitionDelta,
        fence: Option<Epoch>,
    ) -> Result<Vec<ComponentHash>> {
        let PartitionDelta {
            table,
            partition,
            since,
            versions: delta,
        } = delta;
        let table = table.as_str();
        // Only the epochs the delta replaces must be decided here first. An older prepare
        // left undecided (one logged just as its epoch's outcome was applied, with nothing
        // to apply it to) must not hold the copy up for ever: once the copy marks the
        // partition complete through its fence, `complete_through` discards that prepare's
        // rows whenever its outcome is applied.
        self.refuse_undecided(table, partition, since)?;
        self.refuse_newer_than(table, partition, fence)?;
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
                    .map(|e| crate::evolution::conform_stored(&table_state.def, &e.batch))
                    .collect::<Result<Vec<_>>>()?,
                part.memtable.iter().any(|e| e.epoch >= since),
            )
        };
        // Components wholly older than `since` hold none of the versions the delta replaces:
        // they stay as they are, and only the newer ones (with the memory) are rewritten.
        // Rewriting the whole partition made a failback's second fetch, under the
        // rebalance's lease (the first one's delta is then at or above `since`), read and
        // encode every partition it refreshed again.
        let replaced: BTreeSet<ComponentHash> = components
            .iter()
            .filter(|c| since == Epoch::ZERO || c.max_epoch >= since)
            .map(|c| c.hash)
            .collect();
        let rewrite = since == Epoch::ZERO || memtable_reaches_since || !replaced.is_empty();
        let mut rows: Vec<RecordBatch> = Vec::new();
        if rewrite && since > Epoch::ZERO {
            let mut old = Vec::new();
            for component in components.iter().filter(|c| replaced.contains(&c.hash)) {
                old.extend(self.read_verified_rows(&def, &component.hash)?);
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
        let part = state.held_partition_mut(table, partition);
        let mut dropped = Vec::new();
        let mut freed = 0;
        if rewrite {
            part.manifest
                .components
                .retain(|c| !replaced.contains(&c.hash));
            dropped = replaced.into_iter().collect();
            freed = part.memtable.iter().map(|e| e.bytes).sum();
            part.memtable.clear();
        }
        if let Some(meta) = meta {
            part.manifest.add(meta);
        }
        if let Some(fence) = fence {
            // Every epoch before the rebalance was decided when the source was read.
            part.manifest.hold_complete_through(fence);
        }
        state.memtable_bytes -= freed;
        Ok(dropped)
    }

    /// A copy made for a rebalance at epoch `fence` installs only while this partition holds
    /// nothing newer. The rebalance holds every table's lease, so no later epoch commits
    /// while it is open: a newer version here means the rebalance has ended (aborted) and
    /// this copy, made from the source's older state, arrived late; installing it would put
    /// the source's older versions over rows committed since. Checked under the gate, which
    /// commits also take, so no commit slips between the check and the install.
    fn refuse_newer_than(
        &self,
        table: &str,
        partition: PartitionId,
        fence: Option<Epoch>,
    ) -> Result<()> {
        let Some(fence) = fence else {
            return Ok(());
        };
        let state = self.state();
        let part = &state.table(table)?.partitions[partition.0 as usize];
        let prepared = state
            .pending
            .iter()
            .filter(|(_, entries)| {
                entries
                    .iter()
                    .any(|e| e.table == table && e.partition == partition)
            })
            .map(|(epoch, _)| *epoch);
        let newest = prepared
            .chain([part.newest_epoch()])
            .max()
            .unwrap_or(Epoch::ZERO);
        if newest > fence {
            return Err(StorageError::CopyOutdated {
                table: table.to_string(),
                partition,
                fence,
                newest,
            });
        }
        Ok(())
    }

    /// Refuses to replace a partition's versions from `since` on while this node still
    /// holds an epoch at or above `since` prepared for it and undecided here: the copied
    /// versions may include that epoch (decided in the metadata, but not yet applied here),
    /// and applying its commit afterwards would add its rows a second time, as versions
    /// duplicating the copied ones. The caller retries once the outcome is applied.
    fn refuse_undecided(&self, table: &str, partition: PartitionId, since: Epoch) -> Result<()> {
        let state = self.state();
        let epochs: Vec<Epoch> = state
            .pending
            .range(since..)
            .filter(|(_, entries)| {
                entries
                    .iter()
                    .any(|e| e.table == table && e.partition == partition)
            })
            .map(|(epoch, _)| *epoch)
            .collect();
        if epochs.is_empty() {
            return Ok(());
        }
        Err(StorageError::UndecidedEpochs {
            table: table.to_string(),
            partition,
            epochs,
        })
    }

    /// Writes the components among `components` that were fetched from a peer, each checked
    /// against its name first; the others must already be here, intact.
    pub(super) fn store_fetched_components(
        &self,
        components: &[ComponentMeta],
        fetched: &HashMap<ComponentHash, Vec<u8>>,
    ) -> Result<()> {
        for meta in components {
            match fetched.get(&meta.hash) {
                Some(bytes) => {
                    component::check_named_bytes(&self.components_dir, &meta.hash, bytes)?;
                    // Fetched because this node's copy is missing or damaged: a damaged
                    // file under the same name is replaced, not kept.
                    self.write_checked_bytes(&meta.hash, bytes)?;
                }
                None => self.verify_component(&meta.hash)?,
            }
        }
        Ok(())
    }

    /// Writes a component's bytes, already checked against its name, under that name.
    fn write_checked_bytes(&self, hash: &ComponentHash, bytes: &[u8]) -> Result<()> {
        self.or_poison(component::replace_checked_component(
            &self.components_dir,
            hash,
            bytes,
        ))?;
        self.trust_written(*hash);
        Ok(())
    }

    /// Under the exclusive gate, for `components` stored by [`Store::store_fetched_components`]
    /// before it was taken: each is still here. Until the swap that follows references them,
    /// a collection of garbage in between may have deleted one (dropped elsewhere, it was
    /// unreferenced); a fetched one is written again from its bytes, checked already.
    pub(super) fn confirm_stored_components(
        &self,
        components: &[ComponentMeta],
        fetched: &HashMap<ComponentHash, Vec<u8>>,
    ) -> Result<()> {
        for meta in components {
            let path = component::component_path(&self.components_dir, &meta.hash);
            if path.exists() {
                continue;
            }
            match fetched.get(&meta.hash) {
                Some(bytes) => self.write_checked_bytes(&meta.hash, bytes)?,
                None => {
                    return Err(StorageError::MissingComponent {
                        hash: meta.hash,
                        path,
                    })
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::{PartitionCopy, Store, StoreConfig, TableChanges, TableDef};
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    use tessera_common::{Epoch, PartitionId};

    fn def() -> TableDef {
        TableDef::new(
            "kv",
            Schema::new(vec![
                Field::new("k", DataType::Int64, false),
                Field::new("v", DataType::Int64, false),
            ]),
            vec!["k".into()],
            None,
        )
        .unwrap()
    }

    fn rows(keys: std::ops::Range<i64>, value: i64) -> RecordBatch {
        RecordBatch::try_new(
            Arc::new(def().schema.clone()),
            vec![
                Arc::new(Int64Array::from_iter_values(keys.clone())),
                Arc::new(Int64Array::from_iter_values(keys.map(|_| value))),
            ],
        )
        .unwrap()
    }

    fn store(dir: &std::path::Path) -> Arc<Store> {
        store_with_partitions(dir, 1)
    }

    fn store_with_partitions(dir: &std::path::Path, partitions: u32) -> Arc<Store> {
        let config = StoreConfig {
            partitions,
            ..StoreConfig::default()
        };
        let store = Store::open(dir, config).unwrap();
        store.create_table(def()).unwrap();
        store
    }

    fn publish(store: &Store, batch: RecordBatch) -> Epoch {
        store
            .publish(vec![TableChanges::upserts("kv", vec![batch])])
            .unwrap()
    }

    fn version_count(store: &Store, since: Epoch) -> usize {
        store
            .partition_versions("kv", PartitionId(0), since)
            .unwrap()
            .iter()
            .map(|b| b.num_rows())
            .sum()
    }

    #[test]
    fn a_delta_holds_only_the_versions_from_its_epoch_and_installs_idempotently() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (primary, returning) = (store(a.path()), store(b.path()));
        // Both hold epoch 1; only the primary sees epoch 2 (ten keys rewritten, five new).
        assert_eq!(publish(&primary, rows(0..20, 1)), Epoch(1));
        assert_eq!(publish(&returning, rows(0..20, 1)), Epoch(1));
        let missed = publish(&primary, rows(10..25, 2));
        assert_eq!(version_count(&primary, Epoch(0)), 35);
        let delta = primary
            .partition_versions("kv", PartitionId(0), missed)
            .unwrap();
        assert_eq!(
            delta.iter().map(|b| b.num_rows()).sum::<usize>(),
            15,
            "the delta is the missed epoch's versions only"
        );
        for _ in 0..2 {
            returning
                .install_partition_since("kv", PartitionId(0), missed, delta.clone(), None)
                .unwrap();
            // In a cluster the metadata makes the epoch visible here; snapshots read up to it.
            returning.advance_visible(missed);
            assert_eq!(version_count(&returning, Epoch(0)), 35);
            assert_eq!(version_count(&returning, missed), 15);
        }
    }

    #[test]
    fn deltas_installed_together_write_one_checkpoint_and_stop_at_a_refused_one() {
        use crate::PartitionDelta;
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (primary, returning) = (
            store_with_partitions(a.path(), 4),
            store_with_partitions(b.path(), 4),
        );
        assert_eq!(publish(&primary, rows(0..400, 1)), Epoch(1));
        assert_eq!(publish(&returning, rows(0..400, 1)), Epoch(1));
        let missed = publish(&primary, rows(0..400, 2));
        let delta_of = |partition: u32| PartitionDelta {
            table: "kv".into(),
            partition: PartitionId(partition),
            since: missed,
            versions: primary
                .partition_versions("kv", PartitionId(partition), missed)
                .unwrap(),
        };
        let versions = |store: &Store, partition: u32| -> usize {
            store
                .partition_versions("kv", PartitionId(partition), Epoch(0))
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum()
        };
        let partition_rows: Vec<usize> = (0..4).map(|p| versions(&primary, p)).collect();
        assert!(
            partition_rows.iter().all(|&n| n > 0),
            "every partition holds rows"
        );

        // Two deltas, then one for a table this store lacks, then one more.
        let before = returning.checkpoints_written();
        let mut unknown = delta_of(2);
        unknown.table = "missing".into();
        let refused = returning
            .install_partitions_since(vec![delta_of(0), delta_of(1), unknown, delta_of(3)], None);
        assert!(
            matches!(refused, Err(crate::StorageError::UnknownTable(ref t)) if t == "missing"),
            "{refused:?}"
        );
        assert_eq!(
            returning.checkpoints_written() - before,
            1,
            "the installed deltas share one checkpoint"
        );
        // In a cluster the metadata makes the epoch visible here; snapshots read up to it.
        returning.advance_visible(missed);
        for p in [0, 1] {
            assert_eq!(versions(&returning, p), partition_rows[p as usize]);
        }
        for p in [2, 3] {
            assert!(
                versions(&returning, p) < partition_rows[p as usize],
                "p{p} not installed"
            );
        }

        // The rest, together: one more checkpoint, and all of it survives a restart.
        let before = returning.checkpoints_written();
        returning
            .install_partitions_since(vec![delta_of(2), delta_of(3)], None)
            .unwrap();
        assert_eq!(returning.checkpoints_written() - before, 1);
        drop(returning);
        let config = StoreConfig {
            partitions: 4,
            ..StoreConfig::default()
        };
        let reopened = Store::open(b.path(), config).unwrap();
        reopened.advance_visible(missed);
        for p in 0..4 {
            assert_eq!(versions(&reopened, p), partition_rows[p as usize], "p{p}");
        }
    }

    #[test]
    fn whole_copies_installed_together_write_one_checkpoint_and_survive_a_restart() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (primary, replica) = (
            store_with_partitions(a.path(), 4),
            store_with_partitions(b.path(), 4),
        );
        publish(&primary, rows(0..400, 1));
        primary.checkpoint().unwrap();
        // Still in the primary's memory: copied as rows, not components.
        let newest = publish(&primary, rows(0..200, 2));
        let copy_of = |partition: u32| {
            let (components, memtable) = primary
                .export_partition("kv", PartitionId(partition))
                .unwrap();
            let fetched = components
                .iter()
                .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
                .collect();
            PartitionCopy {
                table: "kv".into(),
                partition: PartitionId(partition),
                components,
                fetched,
                memtable,
            }
        };
        let versions = |store: &Store, partition: u32| -> usize {
            store
                .partition_versions("kv", PartitionId(partition), Epoch(0))
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum()
        };
        let partition_rows: Vec<usize> = (0..4).map(|p| versions(&primary, p)).collect();
        assert!(
            partition_rows.iter().all(|&n| n > 0),
            "every partition holds rows"
        );

        // Two copies, then one of a table this store lacks, then one more: the first two
        // are installed, under one checkpoint, and the batch stops at the refused one.
        let before = replica.checkpoints_written();
        let mut unknown = copy_of(2);
        unknown.table = "missing".into();
        let refused = replica
            .install_partitions_components(vec![copy_of(0), copy_of(1), unknown, copy_of(3)], None);
        assert!(
            matches!(refused, Err(crate::StorageError::UnknownTable(ref t)) if t == "missing"),
            "{refused:?}"
        );
        assert_eq!(
            replica.checkpoints_written() - before,
            1,
            "one checkpoint for both"
        );
        replica.advance_visible(newest);
        for p in [0, 1] {
            assert_eq!(versions(&replica, p), partition_rows[p as usize], "p{p}");
        }
        for p in [2, 3] {
            assert_eq!(versions(&replica, p), 0, "p{p} not installed");
        }

        let before = replica.checkpoints_written();
        replica
            .install_partitions_components(vec![copy_of(2), copy_of(3)], None)
            .unwrap();
        assert_eq!(replica.checkpoints_written() - before, 1);
        drop(replica);
        let config = StoreConfig {
            partitions: 4,
            ..StoreConfig::default()
        };
        let reopened = Store::open(b.path(), config).unwrap();
        reopened.advance_visible(newest);
        for p in 0..4 {
            assert_eq!(versions(&reopened, p), partition_rows[p as usize], "p{p}");
        }
    }
}
