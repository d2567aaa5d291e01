//! The store as a replica in a cluster publish (two-phase): prepared rows are logged
//! durably, then committed or aborted when the metadata decides the epoch.

use super::*;

/// A prepare's wait (for a flush to free memory, or for the store's gate) worth a line in
/// the log.
const SLOW_PREPARE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl Store {
    /// Creates a table exactly as the cluster catalog defines it. A table of that name and
    /// the same or a newer generation makes this a no-op (a replayed metadata entry); an
    /// older one is replaced.
    pub fn ensure_table(&self, def: TableDef) -> Result<()> {
        if let Some(existing) = self.table_def(&def.name) {
            if existing.generation == def.generation && existing.layout() < def.layout() {
                // An ALTER TABLE: the same table under a newer definition. Rows and files
                // already here are conformed when read.
                let _gate = self.gate.exclusive(gate::Holder::Ddl);
                self.check_poisoned()?;
                let mut state = self.state();
                let name = def.name.clone();
                state.table_mut(&name)?.def = def;
                return self.write_checkpoint(&state);
            }
            if existing.generation >= def.generation {
                return Ok(());
            }
            self.drop_table_generation(&def.name, existing.generation)?;
        }
        let _gate = self.gate.exclusive(gate::Holder::Ddl);
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
        let entries = self.encode_prepared(epoch, &changes)?;
        self.log_prepared(epoch, entries)
    }

    /// The first half of [`Store::prepare_epoch`]: checks the rows against their tables,
    /// stamps them with `epoch` and encodes each partition's as its log record will hold
    /// them. Changes nothing; [`Store::log_prepared`] logs the entries (and the head of a
    /// partition's log shipping ships their encoded rows to the other replicas meanwhile).
    pub fn encode_prepared(
        &self,
        epoch: Epoch,
        changes: &[PartitionChanges],
    ) -> Result<Vec<PreparedEntry>> {
        self.check_poisoned()?;
        let mut grouped: BTreeMap<(String, PartitionId), Vec<RecordBatch>> = BTreeMap::new();
        for change in changes {
            let def = self
                .table_def(&change.table)
                .ok_or_else(|| StorageError::UnknownTable(change.table.clone()))?;
            let prepared = PreparedChanges::checked(
                def,
                &change.upserts,
                &change.deletes,
                &change.before_images,
            )?;
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
        grouped
            .into_iter()
            .map(|((table, partition), batches)| {
                let batch = concat_batches(&batches[0].schema(), &batches)?;
                Ok(PreparedEntry {
                    table,
                    partition,
                    rows: EncodedRows::encode(&batch)?,
                    batch: Some(batch),
                })
            })
            .collect()
    }

    /// Durably logs rows of `table` for cluster epoch `epoch` that the head of their log
    /// shipping (each partition's primary) checked, stamped and encoded
    /// ([`Store::encode_prepared`]), as they arrived. Only the rows of partitions this node
    /// serves are decoded (and so validated) now; a cold standby's stay as they are until a
    /// promotion replays them. Refused with [`StorageError::SchemaMismatch`] if the rows
    /// are not in the table's stored schema here (an ALTER TABLE not applied here yet).
    pub fn prepare_received(
        &self,
        epoch: Epoch,
        table: &str,
        received: &[(PartitionId, EncodedRows)],
    ) -> Result<()> {
        self.check_poisoned()?;
        let def = self
            .table_def(table)
            .ok_or_else(|| StorageError::UnknownTable(table.to_string()))?;
        let stored = versions::stored_schema(&def);
        let mut checked_schema: Option<bytes::Bytes> = None;
        let cold = self.state().standby.clone();
        let mut entries = Vec::with_capacity(received.len());
        for (partition, rows) in received {
            let (partition, rows) = (*partition, rows.clone());
            if checked_schema.as_ref() != Some(&rows.schema) {
                let schema = rows.decode_schema()?;
                if schema.fields() != stored.fields() {
                    return Err(StorageError::SchemaMismatch {
                        table: table.to_string(),
                        reason: format!(
                            "rows shipped in the stored schema {schema:?}, but the table's here is {stored:?}"
                        ),
                    });
                }
                checked_schema = Some(rows.schema.clone());
            }
            let batch = if cold.contains(&partition) {
                None
            } else {
                Some(rows.decode().map_err(|e| {
                    StorageError::MalformedRows(format!(
                        "partition {partition} of table {table:?}: {e}"
                    ))
                })?)
            };
            entries.push(PreparedEntry {
                table: table.to_string(),
                partition,
                rows,
                batch,
            });
        }
        self.log_prepared(epoch, entries)
    }

    /// The second half of a prepare: logs `entries` durably as rows of epoch `epoch`, each
    /// its own record, numbered after the epoch's earlier entries here.
    pub fn log_prepared(&self, epoch: Epoch, entries: Vec<PreparedEntry>) -> Result<()> {
        self.check_poisoned()?;
        // Copied into their records and checksummed before the store's lock is taken.
        let frames: Vec<wal::PreparedFrame> = entries
            .iter()
            .map(|e| wal::PreparedFrame::new(&e.table, e.partition, epoch, &e.rows))
            .collect();
        // A coordinator's progress deadline counts these waits against the node, so a long
        // one is named with its cause.
        let memory_wait = self.wait_while_memory_is_full();
        if memory_wait >= SLOW_PREPARE_WAIT {
            tracing::warn!(
                %epoch,
                waited_s = memory_wait.as_secs_f64(),
                "a prepare waited for a flush to free memory: the memtables were full"
            );
        }
        let (_gate, gate_wait) = self.gate.shared_timed();
        if gate_wait.waited >= SLOW_PREPARE_WAIT {
            let behind = gate_wait
                .behind
                .map_or("an exclusive section", gate::Holder::describe);
            tracing::warn!(
                %epoch,
                waited_s = gate_wait.waited.as_secs_f64(),
                "a prepare waited for the store's gate, held by {behind}"
            );
        }
        let mut state = self.state();
        if state.is_decided(epoch) {
            return Err(StorageError::PrepareAfterDecision { epoch });
        }
        for entry in &entries {
            let complete_through = state
                .partition(&entry.table, entry.partition)?
                .manifest
                .complete_through;
            if epoch <= complete_through {
                return Err(StorageError::LatePrepare {
                    table: entry.table.clone(),
                    partition: entry.partition,
                    epoch,
                    complete_through,
                });
            }
        }
        let next_seq = state.next_prepare_seq.entry(epoch).or_insert(0);
        let first_seq = *next_seq;
        *next_seq += entries.len() as u32;
        let frames: Vec<wal::Frame> = frames
            .into_iter()
            .enumerate()
            .map(|(i, frame)| frame.finish(first_seq + i as u32))
            .collect();
        let pending: Vec<PendingEntry> = entries
            .into_iter()
            .enumerate()
            .map(|(i, entry)| PendingEntry {
                seq: first_seq + i as u32,
                table: entry.table,
                partition: entry.partition,
                rows: match entry.batch {
                    Some(batch) => PendingRows::Decoded(batch),
                    None => PendingRows::Encoded(entry.rows),
                },
            })
            .collect();
        state.next_epoch = state.next_epoch.max(epoch.next());
        let ticket = self.wal.submit_frames(frames);
        drop(state);
        let durable = ticket.wait();
        let mut state = self.state();
        let slot = state.pending.entry(epoch).or_default();
        if durable.is_ok() {
            slot.extend(pending);
            slot.sort_by_key(|e| e.seq);
        }
        durable
    }

    /// Makes the rows prepared for `epoch` part of their partitions. Returns whether this
    /// node had any; committing an epoch it never prepared (or already committed) is a no-op.
    pub fn commit_epoch(&self, epoch: Epoch) -> Result<bool> {
        self.commit_epoch_except(epoch, &BTreeSet::new())
    }

    /// [`Store::commit_epoch`], discarding the rows prepared for partitions in `missed`:
    /// the metadata counts this replica as having missed the epoch there (its prepare
    /// reached it too late, or only in part), so a failback copy brings the epoch's
    /// versions, and applying the local ones as well would store them twice. Rows for
    /// partitions a copy already brought the epoch to are discarded too, whatever the
    /// metadata says now (its stale mark ends with that copy).
    pub fn commit_epoch_except(
        &self,
        epoch: Epoch,
        missed: &BTreeSet<PartitionId>,
    ) -> Result<bool> {
        self.check_poisoned()?;
        let _gate = self.gate.shared();
        let mut state = self.state();
        state.advance_visible_to(epoch);
        state.record_decision(epoch);
        state.next_prepare_seq.remove(&epoch);
        let Some(entries) = state.pending.remove(&epoch) else {
            return Ok(false);
        };
        debug_assert!(
            entries.windows(2).all(|w| w[0].seq < w[1].seq),
            "entries sorted by seq"
        );
        state.logged_bytes += entries.iter().map(|e| e.rows.memory_size()).sum::<usize>();
        let mut lsns = Vec::with_capacity(entries.len());
        let mut assigned = Vec::with_capacity(entries.len());
        for entry in entries {
            // A copy (or shipped components) holding this epoch here already arrived: the
            // prepare that reached this node after it is the same versions again.
            let copied = state
                .partition(&entry.table, entry.partition)
                .is_ok_and(|p| epoch <= p.manifest.complete_through);
            if missed.contains(&entry.partition) || copied {
                // Logged as discarded (LSN zero), so replay drops the entry too.
                lsns.push((entry.table.clone(), entry.partition, Lsn::ZERO));
                continue;
            }
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
                    rows: entry.rows.num_rows() as u64,
                });
                continue;
            }
            let entry = MemEntry::new(lsn, epoch, entry.rows.into_batch()?);
            let bytes = entry.bytes;
            part.memtable.push(entry);
            state.memtable_bytes += bytes;
        }
        Ok(true)
    }

    /// Discards the rows prepared for `epoch`, if any.
    pub fn abort_epoch(&self, epoch: Epoch) -> Result<()> {
        self.check_poisoned()?;
        let _gate = self.gate.shared();
        let mut state = self.state();
        state.advance_visible_to(epoch);
        state.record_decision(epoch);
        state.next_prepare_seq.remove(&epoch);
        if state.pending.remove(&epoch).is_none() {
            return Ok(());
        }
        let ticket = self.wal.submit(WalRecord::Abort { epoch }.encode_frame()?);
        drop(state);
        self.or_poison(ticket.wait())
    }

    /// Cluster epochs prepared here whose fate this node has not yet learnt.
    pub fn undecided_epochs(&self) -> Vec<Epoch> {
        self.state().pending.keys().copied().collect()
    }

    /// Lets readers ask for any epoch up to `epoch`: in a cluster the metadata service, not
    /// this store, decides which epochs are visible.
    pub fn advance_visible(&self, epoch: Epoch) {
        let mut state = self.state();
        state.advance_visible_to(epoch);
        if epoch > state.decided_through {
            state.decided_through = epoch;
            state.decided_above.retain(|e| *e > epoch);
        }
    }

    /// Discards what was prepared here for `epoch` if this store has already applied the
    /// epoch's decision: a prepare that arrived after it (a stream held up past the
    /// coordinator's deadline) would otherwise stay pending for ever, since nothing decides
    /// an epoch twice. Checked against the store's own record of decisions, under the
    /// same lock the decision took, so no prepare falls between the two. Returns whether
    /// it discarded anything.
    pub fn discard_late_prepare(&self, epoch: Epoch) -> Result<bool> {
        self.check_poisoned()?;
        let _gate = self.gate.shared();
        let mut state = self.state();
        if !state.is_decided(epoch) || state.pending.remove(&epoch).is_none() {
            return Ok(false);
        }
        state.next_prepare_seq.remove(&epoch);
        let ticket = self.wal.submit(WalRecord::Abort { epoch }.encode_frame()?);
        drop(state);
        self.or_poison(ticket.wait())?;
        Ok(true)
    }
}
