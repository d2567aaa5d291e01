//! Cold standbys: partitions whose rows stay in the log until a promotion replays them or
//! the primary's shipped components cover them.

use super::replay::PreparedLog;
use super::*;

impl Store {
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
        let _gate = self.gate.exclusive(gate::Holder::Promotion);
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
        let _gate = self.gate.exclusive(gate::Holder::Promotion);
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
    pub(super) fn replay_standby_holding_gate(
        &self,
        which: impl Fn(&PartitionId) -> bool,
    ) -> Result<usize> {
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
        // The log is skimmed, and only the wanted rows are read: most records are the
        // node's own partitions' or rows its primaries' components already cover.
        let mut log = PreparedLog::<wal::FrameAt>::default();
        let mut located: Vec<(String, PartitionId, Lsn, Epoch, wal::FrameAt)> = Vec::new();
        for record in wal::skim(&wal_dir)? {
            match record {
                wal::Skimmed::Prepared {
                    table,
                    partition,
                    epoch,
                    seq,
                    at,
                } => log.prepared(
                    epoch,
                    PendingEntry {
                        seq,
                        table,
                        partition,
                        rows: at,
                    },
                ),
                wal::Skimmed::Record(WalRecord::Abort { epoch }) => log.aborted(epoch),
                wal::Skimmed::Record(WalRecord::CommitPrepared { epoch, lsns }) => {
                    for (entry, lsn) in log.committed(epoch, &lsns)? {
                        let key = (entry.table, entry.partition);
                        if wanted.get(&key).is_some_and(|lsns| lsns.contains(&lsn)) {
                            located.push((key.0, key.1, lsn, epoch, entry.rows));
                        }
                    }
                }
                _ => {}
            }
        }
        let mut found: Vec<(String, PartitionId, MemEntry)> = Vec::with_capacity(located.len());
        for (table, partition, lsn, epoch, at) in located {
            let WalRecord::Prepared {
                table: logged_table,
                partition: logged_partition,
                epoch: logged_epoch,
                batch,
                ..
            } = wal::read_frame(&wal_dir, at)?
            else {
                unreachable!("a skim locates prepared records only");
            };
            assert_eq!(
                (&logged_table, logged_partition, logged_epoch),
                (&table, partition, epoch),
                "a record read back is the one skimmed"
            );
            found.push((table, partition, MemEntry::new(lsn, epoch, batch)));
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
            state.memtable_bytes += entry.bytes;
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
    /// (it flushed rows the primary had not yet flushed), or still holds an epoch up to
    /// `covered` prepared but undecided for this partition (its metadata lags the
    /// primary's: the commit, arriving later, would apply the epoch's rows again over
    /// components that hold them): a later shipment covers them.
    ///
    /// The fetched components are checked, written and fsynced before the gate is taken:
    /// that is most of an install's time, and the publishes on this node wait while the gate
    /// is held exclusively. Nothing references them until the swap, which checks they are
    /// still here; a shipment refused after all deletes them again, and a node that dies in
    /// between deletes them when it starts (they are unreferenced).
    pub fn install_shipped_components(
        &self,
        table: &str,
        partition: PartitionId,
        components: Vec<ComponentMeta>,
        fetched: HashMap<ComponentHash, Vec<u8>>,
        covered: Epoch,
    ) -> Result<bool> {
        self.check_poisoned()?;
        if !self.shipment_applies(table, partition, &components, covered)? {
            return Ok(false);
        }
        self.store_fetched_components(&components, &fetched)?;
        let _gate = self.gate.exclusive(gate::Holder::Install);
        self.check_poisoned()?;
        // Checked again: an epoch may have been prepared, or a checkpoint taken, meanwhile.
        if !self.shipment_applies(table, partition, &components, covered)? {
            let state = self.state();
            self.collect_garbage(fetched.into_keys().collect(), &state)?;
            return Ok(false);
        }
        self.confirm_stored_components(&components, &fetched)?;
        let mut state = self.state();
        let part = state.held_partition_mut(table, partition);
        // Everything at or below this LSN is now in the components: the dropped rows' log
        // records, as a table's later epochs also have later LSNs.
        let mut covered_lsn = part.manifest.max_lsn;
        for logged in part.unapplied.iter().filter(|l| l.epoch <= covered) {
            covered_lsn = covered_lsn.max(logged.lsn);
        }
        let mut freed = 0;
        for entry in part.memtable.iter().filter(|e| e.epoch <= covered) {
            covered_lsn = covered_lsn.max(entry.lsn);
            freed += entry.bytes;
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
        part.manifest.hold_complete_through(covered);
        state.memtable_bytes -= freed;
        self.write_checkpoint(&state)?;
        self.collect_garbage(dropped, &state)?;
        Ok(true)
    }

    /// Whether a shipment of `components` covering `covered` changes one partition of
    /// `table` on this standby, and may (see [`Store::install_shipped_components`]).
    fn shipment_applies(
        &self,
        table: &str,
        partition: PartitionId,
        components: &[ComponentMeta],
        covered: Epoch,
    ) -> Result<bool> {
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
        let undecided_covered = state.pending.range(..=covered).any(|(_, entries)| {
            entries
                .iter()
                .any(|e| e.table == table && e.partition == partition)
        });
        let holds_newer = part
            .manifest
            .components
            .iter()
            .any(|c| c.max_epoch > covered);
        Ok(!undecided_covered && !holds_newer && !(same && nothing_to_drop))
    }
}
