//! Local publishes: a batch of changes checked and made one new epoch, through the log
//! (small: group-committed WAL frames into memtables) or in bulk (large: one component per
//! touched partition, committed by the checkpoint file).

use super::*;
use crate::routing::{self, RowsOf};

impl Store {
    /// Publishes a batch of changes as one new epoch, visible atomically once this returns.
    pub fn publish(&self, changes: Vec<TableChanges>) -> Result<Epoch> {
        self.publish_read_at(changes, &ReadEpochs::new())
    }

    /// [`Store::publish`] of rows a statement computed from what it read of each table at
    /// the epoch `read_at` names for it (an UPDATE, a DELETE): refused as a write conflict
    /// if one of those tables changed after that epoch, which its rows would overwrite
    /// unseen (a lost update). Checked where the epoch is allocated, so no publish slips in
    /// between.
    pub fn publish_read_at(
        &self,
        changes: Vec<TableChanges>,
        read_at: &ReadEpochs,
    ) -> Result<Epoch> {
        self.check_poisoned()?;
        let prepared = self.prepare(changes, read_at)?;
        let bytes: usize = prepared.iter().map(|p| p.bytes()).sum();
        if bytes > self.config.max_publish_bytes {
            return Err(StorageError::PublishTooLarge {
                bytes,
                limit: self.config.max_publish_bytes,
            });
        }
        let epoch = if bytes >= self.config.bulk_publish_bytes {
            self.publish_bulk(prepared, read_at)?
        } else {
            self.publish_logged(prepared, read_at)?
        };
        if self.state().memtable_bytes >= self.config.memtable_flush_bytes {
            self.checkpoint()?;
        }
        Ok(epoch)
    }

    /// Validates changes against the catalog: schemas, keys, duplicates within the publish,
    /// before images only where the table's read epoch is checked.
    fn prepare(
        &self,
        changes: Vec<TableChanges>,
        read_at: &ReadEpochs,
    ) -> Result<Vec<PreparedChanges>> {
        let mut prepared: Vec<PreparedChanges> = Vec::new();
        for change in changes {
            let def = self
                .table_def(&change.table)
                .ok_or_else(|| StorageError::UnknownTable(change.table.clone()))?;
            if def.append_only && change.deletes.iter().any(|b| b.num_rows() > 0) {
                return Err(StorageError::delete_from_append_only(&def.name));
            }
            change.refuse_unchecked_before_images(read_at)?;
            let checked = PreparedChanges::checked(
                def,
                &change.upserts,
                &change.deletes,
                &change.before_images,
            )?;
            if let Some(existing) = prepared.iter_mut().find(|p| p.def.name == checked.def.name) {
                existing.upserts.extend(checked.upserts);
                existing.deletes.extend(checked.deletes);
                existing.before_images.extend(checked.before_images);
            } else {
                prepared.push(checked);
            }
        }
        for p in &prepared {
            let all: Vec<RecordBatch> = p.upserts.iter().chain(&p.deletes).cloned().collect();
            versions::reject_duplicate_keys(&p.def, &all)?;
        }
        // Before images alone change nothing.
        prepared.retain(|p| !p.upserts.is_empty() || !p.deletes.is_empty());
        Ok(prepared)
    }

    /// The log path: row records and a commit record go to the log, group-committed.
    fn publish_logged(
        &self,
        prepared: Vec<PreparedChanges>,
        read_at: &ReadEpochs,
    ) -> Result<Epoch> {
        self.wait_while_memory_is_full();
        let _gate = self.gate.shared();
        // Tables can only disappear under the exclusive gate; recheck now that we hold it.
        let mut state = self.state();
        for p in &prepared {
            state.table(&p.def.name)?;
        }
        state.refuse_write_conflict(read_at)?;
        let epoch = state.allocate_publish_epoch(prepared.iter().map(|p| p.def.name.as_str()));
        let commit = commit_record(&state.history, &prepared);
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
                        MemEntry::new(lsn, epoch, batch),
                    ));
                }
            }
            frames.extend(
                WalRecord::Commit {
                    epoch,
                    at_ms: commit.at_ms,
                }
                .encode_frame()?,
            );
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
                state.memtable_bytes += entry.bytes;
                state
                    .held_partition_mut(&table, partition)
                    .memtable
                    .push(entry);
            }
            state.history.record_commit(epoch, commit);
        }
        state.resolve(epoch);
        durable.map(|()| epoch)
    }

    /// The bulk path: rows become components directly; the checkpoint that lists them is
    /// the commit point.
    fn publish_bulk(&self, prepared: Vec<PreparedChanges>, read_at: &ReadEpochs) -> Result<Epoch> {
        let _one_flush_at_a_time = self.one_flush_at_a_time();
        let gate = self.gate.exclusive(gate::Holder::BulkPublish);
        self.check_poisoned()?;
        // Flushing first keeps LSNs rising within each manifest.
        self.flush_memtables()?;
        let epoch = {
            let mut state = self.state();
            for p in &prepared {
                state.table(&p.def.name)?;
            }
            state.refuse_write_conflict(read_at)?;
            state.allocate_publish_epoch(prepared.iter().map(|p| p.def.name.as_str()))
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
            state
                .held_partition_mut(&table, partition)
                .manifest
                .add(meta);
        }
        let commit = commit_record(&state.history, &prepared);
        state.history.record_commit(epoch, commit);
        state.resolve(epoch);
        self.write_checkpoint(&state)?;
        drop(state);
        // Memtables were just flushed, so checkpointing now is cheap: it trims the log, and
        // (once the gate is let go) merges the partitions this publish crowded. The epoch is
        // committed either way; a failure here poisons the store or is retried by the next
        // checkpoint.
        if let Err(error) = self.checkpoint_holding_gate() {
            tracing::error!(%error, %epoch, "checkpoint after bulk publish failed");
        }
        drop(gate);
        if let Err(error) = self.merge_crowded_partitions() {
            tracing::error!(%error, %epoch, "merges after bulk publish failed");
        }
        Ok(epoch)
    }

    pub(super) fn write_component(
        &self,
        def: &TableDef,
        batches: &[RecordBatch],
        min_lsn: Lsn,
        max_lsn: Lsn,
    ) -> Result<ComponentMeta> {
        // Rows logged or read under earlier versions of the definition take today's.
        let batches = batches
            .iter()
            .map(|b| crate::evolution::conform_stored(def, b))
            .collect::<Result<Vec<_>>>()?;
        let batch = concat_batches(&versions::stored_schema(def), &batches)?;
        let stats = versions::version_stats(&batch, &def.primary_key_indices(), def.append_only)?;
        let bytes = component::encode_parquet(std::slice::from_ref(&batch))?;
        let (hash, written) = component::write_new_component(&self.components_dir, &bytes)?;
        match written {
            component::Written::New => self.trust_written(hash),
            // Already there, and intact: checked now (or before) and trusted since.
            component::Written::AlreadyThere if self.verify_component(&hash).is_ok() => {}
            // A damaged file under this name: the bytes in hand are the component.
            component::Written::AlreadyThere => {
                component::replace_checked_component(&self.components_dir, &hash, &bytes)?;
                self.trust_written(hash);
            }
        }
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
            layout: def.layout(),
            superseded_at: Epoch::ZERO,
        })
    }

    /// Writes every in-memory component to disk and records the new manifests. Callers hold
    /// the gate exclusively, so memtables do not change underneath: the three stages of a
    /// flush ([`Store::flush_in_stages`]) in one.
    pub(super) fn flush_memtables(&self) -> Result<()> {
        let frozen = self.freeze_memtables();
        if frozen.is_empty() {
            return Ok(());
        }
        let written = self.write_frozen(frozen)?;
        let all_installed = self.install_flushed(written)?;
        debug_assert!(all_installed, "memtables changed under the exclusive gate");
        Ok(())
    }
}

/// What the local history records of a publish of `prepared` committing now.
fn commit_record(history: &LocalHistory, prepared: &[PreparedChanges]) -> LocalCommit {
    let rows = |batches: &[RecordBatch]| batches.iter().map(|b| b.num_rows() as u64).sum();
    LocalCommit {
        at_ms: history.next_commit_time(tessera_common::time::now_ms()),
        tables: prepared
            .iter()
            .map(|p| {
                let rows = TableRows {
                    written: rows(&p.upserts),
                    deleted: rows(&p.deletes),
                };
                (p.def.name.clone(), rows)
            })
            .collect(),
    }
}

pub(super) struct PreparedChanges {
    def: TableDef,
    upserts: Vec<RecordBatch>,
    deletes: Vec<RecordBatch>,
    before_images: Vec<RecordBatch>,
}

impl PreparedChanges {
    /// Upserts and before images conformed to the table's schema and deletes turned into
    /// tombstones; empty batches dropped.
    pub(super) fn checked(
        def: TableDef,
        upserts: &[RecordBatch],
        deletes: &[RecordBatch],
        before_images: &[RecordBatch],
    ) -> Result<Self> {
        let conformed = |batches: &[RecordBatch]| -> Result<Vec<RecordBatch>> {
            batches
                .iter()
                .filter(|b| b.num_rows() > 0)
                .map(|b| versions::conform_to_schema(&def, b))
                .collect()
        };
        let upserts = conformed(upserts)?;
        let before_images = if def.append_only {
            // No key changes in place: every row is an insert, and a diff needs no image.
            Vec::new()
        } else {
            conformed(before_images)?
        };
        Ok(PreparedChanges {
            upserts,
            before_images,
            deletes: deletes
                .iter()
                .filter(|b| b.num_rows() > 0)
                .map(|b| versions::tombstone_rows(&def, b))
                .collect::<Result<_>>()?,
            def,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        self.upserts
            .iter()
            .chain(&self.deletes)
            .chain(&self.before_images)
            .map(versions::rows_bytes)
            .sum()
    }

    /// Row versions of this publish, stamped with `epoch`, grouped by partition.
    pub(super) fn stamped_by_partition(
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
        for batch in &self.before_images {
            stamped.push(versions::stamp(&self.def, batch, epoch, RowOp::Before)?);
        }
        routing::gather_by_partition(&self.def, ring, stamped, RowsOf::TableColumns)?
            .into_iter()
            .map(
                |(partition, batches)| match <[RecordBatch; 1]>::try_from(batches) {
                    Ok([batch]) => Ok((partition, batch)),
                    Err(batches) => {
                        Ok((partition, concat_batches(&batches[0].schema(), &batches)?))
                    }
                },
            )
            .collect()
    }
}
