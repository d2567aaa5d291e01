//! Crash recovery: the checkpoint plus the log records above it rebuild the state;
//! prepared rows wait for their epoch's fate, a torn tail is dropped.

use super::*;

/// Rebuilds memory from a checkpoint and the log: committed row records above each
/// manifest's max LSN go back into memtables; records of epochs without a commit record are
/// aborted and skipped.
/// Pairs prepared rows with the commit that gives them LSNs, as a log is read in order.
pub(super) struct PreparedLog<R = PendingRows> {
    /// Epochs prepared and not (yet) decided in the log read so far.
    undecided: BTreeMap<Epoch, Vec<PendingEntry<R>>>,
}

impl<R> Default for PreparedLog<R> {
    fn default() -> Self {
        PreparedLog {
            undecided: BTreeMap::new(),
        }
    }
}

/// What one log record meant to a [`PreparedLog`].
pub(super) enum LogStep {
    Prepared(Epoch),
    Aborted,
    /// The committed epoch's entries, each with the LSN its commit record assigns.
    Committed(Epoch, Vec<(PendingEntry, Lsn)>),
    /// A record of the single-node publish path, for the caller.
    Other(WalRecord),
}

impl PreparedLog {
    /// Takes in the next record read from the log.
    pub(super) fn step(&mut self, record: WalRecord) -> Result<LogStep> {
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
                    rows: PendingRows::Decoded(batch),
                };
                self.prepared(epoch, entry);
                LogStep::Prepared(epoch)
            }
            WalRecord::Abort { epoch } => {
                self.aborted(epoch);
                LogStep::Aborted
            }
            WalRecord::CommitPrepared { epoch, lsns } => {
                LogStep::Committed(epoch, self.committed(epoch, &lsns)?)
            }
            other => LogStep::Other(other),
        })
    }
}

impl<R> PreparedLog<R> {
    pub(super) fn aborted(&mut self, epoch: Epoch) {
        self.undecided.remove(&epoch);
    }

    pub(super) fn prepared(&mut self, epoch: Epoch, entry: PendingEntry<R>) {
        // A checkpoint re-logs undecided rows, so the same entry may appear twice.
        let entries = self.undecided.entry(epoch).or_default();
        entries.retain(|e| e.seq != entry.seq);
        entries.push(entry);
        entries.sort_by_key(|e| e.seq);
    }

    /// The committed epoch's entries, each with the LSN its commit record assigns.
    pub(super) fn committed(
        &mut self,
        epoch: Epoch,
        lsns: &[(String, PartitionId, Lsn)],
    ) -> Result<Vec<(PendingEntry<R>, Lsn)>> {
        let mut entries = self.undecided.remove(&epoch).unwrap_or_default();
        // Rows of a prepare that arrived as the commit was applied may be logged before the
        // commit record without being part of it (their seqs come after the committed
        // ones'); they stay undecided here, and the abort logged for them drops them.
        if !entries.is_empty() && entries.len() > lsns.len() {
            let late = entries.split_off(lsns.len());
            self.undecided.insert(epoch, late);
        }
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
            // LSN zero: the commit discarded this entry (the replica had missed the epoch
            // for that partition).
            if *lsn != Lsn::ZERO {
                paired.push((entry, *lsn));
            }
        }
        Ok(paired)
    }
}

pub(super) fn replay(
    checkpoint: Checkpoint,
    records: Vec<WalRecord>,
    torn_bytes: u64,
) -> Result<(State, RecoveryReport)> {
    // Epochs the checkpoint has no record of are recorded from the log: their time from
    // the commit record, their rows counted from the row records below.
    let mut history = checkpoint.history;
    let mut committed: HashSet<Epoch> = HashSet::new();
    let mut unrecorded: HashSet<Epoch> = HashSet::new();
    for record in &records {
        if let WalRecord::Commit { epoch, at_ms } = record {
            committed.insert(*epoch);
            if !history.commits.contains_key(epoch) {
                unrecorded.insert(*epoch);
                history.record_commit(
                    *epoch,
                    LocalCommit {
                        at_ms: *at_ms,
                        tables: BTreeMap::new(),
                    },
                );
            }
        }
    }
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
                        last_allocated: Epoch::ZERO,
                    },
                )
            })
            .collect(),
        partition_next_lsn: checkpoint.partition_next_lsn,
        next_epoch: checkpoint.next_epoch,
        visible: Epoch::ZERO,
        resolved_above_visible: BTreeSet::new(),
        decided_through: Epoch::ZERO,
        decided_above: BTreeSet::new(),
        retained_from: checkpoint.retained_from,
        horizons: BTreeMap::new(),
        memtable_bytes: 0,
        pending: BTreeMap::new(),
        next_prepare_seq: HashMap::new(),
        standby: BTreeSet::new(),
        standby_wanted: BTreeSet::new(),
        logged_bytes: 0,
        idle: super::maintenance::IdleWatch::new(),
        history,
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
                    let entry = MemEntry::new(lsn, epoch, entry.rows.into_batch()?);
                    state.memtable_bytes += entry.bytes;
                    partition_state.memtable.push(entry);
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
        if unrecorded.contains(&epoch) {
            count_rows(&mut state.history, epoch, &table, &batch);
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
        let entry = MemEntry::new(lsn, epoch, batch);
        state.memtable_bytes += entry.bytes;
        partition_state.memtable.push(entry);
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

/// Adds a logged row record's versions to its epoch's record in the history.
fn count_rows(history: &mut LocalHistory, epoch: Epoch, table: &str, batch: &RecordBatch) {
    let count = |op| crate::versions::count_ops(batch, op);
    let (written, deleted) = (count(RowOp::Upsert), count(RowOp::Delete));
    let rows = history
        .commits
        .entry(epoch)
        .or_default()
        .tables
        .entry(table.to_string())
        .or_default();
    rows.deleted += deleted;
    rows.written += written;
}
