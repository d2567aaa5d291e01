//! Keeping the store small and recovery short: checkpoints (flush memtables, rewrite the
//! checkpoint file, rotate the log), merges of crowded partitions, and garbage collection of
//! components nothing references.

use super::*;

impl Store {
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
    pub(super) fn checkpoint_holding_gate(&self) -> Result<()> {
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
        let work = {
            let state = self.state();
            let work: Vec<(TableDef, PartitionId, Vec<ComponentMeta>, Epoch)> = state
                .all_partitions()
                .filter(|(_, _, p)| p.manifest.components.len() > self.config.merge_threshold)
                .map(|(t, partition, p)| {
                    let horizon = state.horizon(&t.def.name);
                    (
                        t.def.clone(),
                        partition,
                        p.manifest.components.clone(),
                        horizon,
                    )
                })
                .collect();
            work
        };
        for (def, partition, inputs, retained_from) in work {
            let mut batches = Vec::new();
            for input in &inputs {
                batches.extend(self.read_verified_rows(&def, &input.hash)?);
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
            let manifest = &mut state.held_partition_mut(&def.name, partition).manifest;
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
    pub(super) fn collect_garbage(&self, dropped: Vec<ComponentHash>, state: &State) -> Result<()> {
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
    pub(super) fn delete_unreferenced_component_files(&self) -> Result<()> {
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
}
