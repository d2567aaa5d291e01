//! What readers see: a table's snapshot at an epoch, component verification, table
//! versions and statistics.

use super::verified::FileStamp;
use super::*;

/// Which components a snapshot names.
#[derive(Debug, Clone, Copy)]
enum SnapshotScope {
    /// Those a read of the table at the snapshot's epoch needs.
    Read,
    /// Every one holding a version at or below the snapshot's epoch.
    Versions,
}

impl Store {
    /// A consistent view of `table` at `epoch` (the visible epoch if `None`) for reading the
    /// table as it was then: merges' history components every version of which is
    /// superseded at or below `epoch` are left out.
    pub fn snapshot(&self, table: &str, epoch: Option<Epoch>) -> Result<Arc<TableSnapshot>> {
        self.snapshot_of(table, epoch, SnapshotScope::Read)
    }

    /// A consistent view of `table` with every row version at or below `epoch` (the visible
    /// epoch if `None`): what a diff, a copy to another replica or a check of the
    /// components reads.
    pub fn versions_snapshot(
        &self,
        table: &str,
        epoch: Option<Epoch>,
    ) -> Result<Arc<TableSnapshot>> {
        self.snapshot_of(table, epoch, SnapshotScope::Versions)
    }

    fn snapshot_of(
        &self,
        table: &str,
        epoch: Option<Epoch>,
        scope: SnapshotScope,
    ) -> Result<Arc<TableSnapshot>> {
        let state = self.state();
        let epoch = epoch.unwrap_or(state.visible);
        if epoch > state.visible {
            return Err(StorageError::EpochNotVisible {
                requested: epoch,
                visible: state.visible,
            });
        }
        let horizon = state.horizon(table);
        if epoch < horizon {
            return Err(StorageError::EpochNotRetained {
                table: table.to_string(),
                requested: epoch,
                retained_from: horizon,
            });
        }
        let table = state.table(table)?;
        let partitions = table
            .partitions
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Ok(PartitionSnapshot {
                    partition: PartitionId(i as u32),
                    rows_in_log: p.unapplied.iter().any(|l| l.epoch <= epoch),
                    components: match scope {
                        SnapshotScope::Read => p.manifest.components_read_at(epoch),
                        SnapshotScope::Versions => p.manifest.components_at(epoch),
                    },
                    // Rows logged under an earlier definition are read in today's.
                    memtable: p
                        .memtable
                        .iter()
                        .filter(|e| e.epoch <= epoch)
                        .map(|e| crate::evolution::conform_stored(&table.def, &e.batch))
                        .collect::<Result<_>>()?,
                })
            })
            .collect::<Result<_>>()?;
        // Taken with the state lock still held: no component named above is garbage yet.
        let reader = self.pin_components();
        Ok(Arc::new(TableSnapshot {
            def: table.def.clone(),
            epoch,
            partitions,
            _reader: Some(reader),
        }))
    }

    /// A snapshot at `to` to read the changes since `from` from: `from` must still be
    /// retained (its versions not merged away) and not above `to`.
    pub fn changes_snapshot(
        &self,
        table: &str,
        from: Epoch,
        to: Epoch,
    ) -> Result<Arc<TableSnapshot>> {
        if from > to {
            return Err(StorageError::BackwardDiff { from, to });
        }
        // Checks `from` the way a read at it is checked.
        drop(self.snapshot(table, Some(from))?);
        self.versions_snapshot(table, Some(to))
    }

    /// Sets every table's retention horizon, as the metadata computes it. A horizon never
    /// falls (merges may already have used it); a table not listed keeps every epoch.
    pub fn set_retention_horizons(&self, horizons: Vec<(String, Epoch)>) {
        let mut state = self.state();
        let old = std::mem::take(&mut state.horizons);
        state.horizons = horizons
            .into_iter()
            .map(|(table, horizon)| {
                let kept = old.get(&table).copied().unwrap_or(Epoch::ZERO);
                (table, horizon.max(kept))
            })
            .collect();
    }

    /// `table`'s retention horizon here: the oldest epoch still read exactly.
    pub fn retention_horizon(&self, table: &str) -> Epoch {
        self.state().horizon(table)
    }

    /// Checks that a component's bytes hash to its name: once per process, or once per
    /// boot for a file unchanged since (see `verified.rs`).
    pub fn verify_component(&self, hash: &ComponentHash) -> Result<()> {
        if self.verified.contains(hash) {
            return Ok(());
        }
        self.hash_component_now(hash).map(|_| ())
    }

    /// Reads component `hash`'s file and checks it against its name now, whatever an
    /// earlier check said; readers then trust it, or stop trusting it. Returns its bytes.
    pub(super) fn hash_component_now(&self, hash: &ComponentHash) -> Result<Vec<u8>> {
        // The file's identity before its bytes are read: a change since shows after a restart.
        let stamp = self.file_stamp(hash);
        let checked = component::read_verified(&self.components_dir, hash);
        match &checked {
            Ok(_) => self.verified.insert(*hash, stamp),
            Err(_) => self.verified.remove(hash),
        }
        checked
    }

    fn file_stamp(&self, hash: &ComponentHash) -> Option<FileStamp> {
        FileStamp::of(&component::component_path(&self.components_dir, hash))
    }

    /// True if reads of component `hash` skip hashing it: this process checked it, or an
    /// earlier one of this boot did and its file has not changed since.
    pub fn is_verified(&self, hash: &ComponentHash) -> bool {
        self.verified.contains(hash)
    }

    /// Trusts a component this node just wrote from bytes it hashed.
    pub(super) fn trust_written(&self, hash: ComponentHash) {
        self.verified.insert(hash, self.file_stamp(&hash));
    }

    /// The row versions of a component, its bytes checked against its name first.
    pub(super) fn read_verified_rows(
        &self,
        def: &TableDef,
        hash: &ComponentHash,
    ) -> Result<Vec<RecordBatch>> {
        self.verify_component(hash)?;
        component::read_component(&self.components_dir, def, hash, None)
    }

    /// The row versions of `components`, each checked against its name first.
    pub(super) fn read_components(
        &self,
        def: &TableDef,
        components: &[ComponentMeta],
    ) -> Result<Vec<RecordBatch>> {
        let mut batches = Vec::new();
        for component in components {
            batches.extend(self.read_verified_rows(def, &component.hash)?);
        }
        Ok(batches)
    }

    /// The change digest of every epoch this node holds of one partition of `table`, from
    /// its components (each hashed again now) and memory, each in the format `format_of`
    /// gives for its epoch, with the table's retention horizon: epochs at or below it may
    /// have been merged away, so their digests are not reproducible (see [`crate::digest`]).
    pub fn partition_digests(
        &self,
        table: &str,
        partition: PartitionId,
        format_of: impl Fn(Epoch) -> crate::digest::DigestFormat,
    ) -> Result<(Epoch, BTreeMap<Epoch, ComponentHash>)> {
        let def = self
            .table_def(table)
            .ok_or_else(|| StorageError::UnknownTable(table.to_string()))?;
        let versions = self.read_partition_versions(table, partition, Epoch::ZERO, true)?;
        let digests = crate::digest::digests_by_epoch(&def, &versions, format_of)?;
        Ok((self.retention_horizon(table), digests))
    }

    /// Memory the memtables hold: what a checkpoint's threshold and the memory stall
    /// compare against (`store.memtable_flush_bytes`).
    pub fn memtable_bytes(&self) -> usize {
        self.state().memtable_bytes
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
