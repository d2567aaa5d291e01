//! Keeping the store small and recovery short: checkpoints (flush memtables, rewrite the
//! checkpoint file, rotate the log), merges of crowded partitions, and garbage collection of
//! components nothing references.

use super::*;

/// How many times the flush threshold the memtables may hold before new rows wait for a
/// flush under way ([`Store::wait_while_memory_is_full`]).
pub const MEMTABLE_STALL_FACTOR: usize = 4;

/// Whether a flush ends by dropping the log segments it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogAfterFlush {
    Truncate,
    Keep,
}

/// What [`Store::flush_in_stages`] did.
struct Flushed {
    /// How long it held the gate exclusively, both ends together.
    gate_held: std::time::Duration,
}

/// One partition's memtable entries frozen for a flush, their LSNs in order.
pub(super) struct FrozenRows {
    def: TableDef,
    partition: PartitionId,
    batches: Vec<RecordBatch>,
    lsns: Vec<Lsn>,
}

impl FrozenRows {
    fn min_lsn(&self) -> Lsn {
        *self.lsns.iter().min().expect("frozen rows are not empty")
    }

    fn max_lsn(&self) -> Lsn {
        *self.lsns.iter().max().expect("frozen rows are not empty")
    }
}

/// Which partitions a merge takes.
#[derive(Debug, Clone, Copy)]
enum MergeRule {
    /// Those whose components crowd: more than the merge threshold, or (tiered merges)
    /// smaller ones adding up to half the largest. What every checkpoint does.
    Crowded,
    /// Every partition with more than one live component that is not a cold standby's
    /// ([`Store::settle`]).
    Settle,
}

/// What [`Store::merge_crowded_partitions`] did: how many partitions it merged, and the
/// longest any one's install held the gate.
#[derive(Debug, Default)]
pub(super) struct Merged {
    partitions: usize,
    longest: std::time::Duration,
}

/// How long the memtables have held the same bytes: rows that stopped arriving are
/// flushed after [`StoreConfig::idle_checkpoint_ms`], rather than staying in memory (and
/// in the log) until more rows cross a threshold, perhaps never. Scans read components
/// faster than memtable rows, and a restart replays less.
pub(super) struct IdleWatch {
    memtable_bytes: usize,
    since: std::time::Instant,
    /// A checkpoint ran since the memtables last changed: what is left it could not flush,
    /// and another would not either.
    settled: bool,
}

impl IdleWatch {
    pub(super) fn new() -> Self {
        IdleWatch {
            memtable_bytes: 0,
            since: std::time::Instant::now(),
            settled: true,
        }
    }

    /// Notes the memtables' size now; true once they held these (non-zero) bytes,
    /// unchanged and not yet checkpointed, for `idle`.
    fn idle_for(&mut self, memtable_bytes: usize, idle: std::time::Duration) -> bool {
        if memtable_bytes != self.memtable_bytes {
            self.memtable_bytes = memtable_bytes;
            self.since = std::time::Instant::now();
            self.settled = false;
        }
        memtable_bytes > 0 && !self.settled && self.since.elapsed() >= idle
    }

    fn checkpointed(&mut self, memtable_bytes: usize) {
        self.memtable_bytes = memtable_bytes;
        self.since = std::time::Instant::now();
        self.settled = true;
    }
}

impl Store {
    /// True once memory holds enough rows that a checkpoint should run, or once rows have
    /// waited in memory with no more arriving for `idle_checkpoint_ms`.
    pub fn wants_checkpoint(&self) -> bool {
        let state = &mut *self.state();
        state.memtable_bytes >= self.config.memtable_flush_bytes
            || state.logged_bytes >= self.config.checkpoint_log_bytes
            || (self.config.idle_checkpoint_ms > 0
                && state.idle.idle_for(
                    state.memtable_bytes,
                    std::time::Duration::from_millis(self.config.idle_checkpoint_ms),
                ))
    }

    /// Flushes memory to components, records manifests, drops log segments the checkpoint
    /// covers, and merges partitions that have too many components.
    ///
    /// The flush holds the store's gate exclusively only at its two ends (see
    /// [`Store::flush_in_stages`]): prepares, commits and publishes go on while it writes
    /// the components, which at SF 10 takes seconds.
    pub fn checkpoint(&self) -> Result<()> {
        self.checkpoint_then(LogAfterFlush::Truncate)
    }

    /// A checkpoint that keeps the log: for a cold standby whose primaries, alive and
    /// answering, have not yet shipped components covering all the rows it logged for them
    /// (rows committed while they flushed for it). Its own rows are flushed and merged as
    /// by [`Store::checkpoint`]; the log stays until a later checkpoint finds the rest
    /// covered, instead of this node decoding and flushing them as their primary does.
    /// Bounded by [`Store::log_outgrew_its_checkpoints`].
    pub fn checkpoint_keeping_log(&self) -> Result<()> {
        self.checkpoint_then(LogAfterFlush::Keep)
    }

    /// Whether the log has grown to twice the size at which it asks for a checkpoint
    /// since one last truncated it: a standby then stops keeping it for its primaries'
    /// components, and its checkpoint applies what they have not covered.
    pub fn log_outgrew_its_checkpoints(&self) -> bool {
        self.state().logged_bytes >= self.config.checkpoint_log_bytes.saturating_mul(2)
    }

    fn checkpoint_then(&self, log: LogAfterFlush) -> Result<()> {
        let started = std::time::Instant::now();
        let memtable_bytes = self.state().memtable_bytes;
        let flushed = self.flush_in_stages(log)?;
        let flushed_at = started.elapsed();
        let merged = self.merge_crowded_partitions()?;
        {
            let state = &mut *self.state();
            state.idle.checkpointed(state.memtable_bytes);
        }
        tracing::info!(
            memtable_bytes,
            log_kept = matches!(log, LogAfterFlush::Keep),
            flush_s = flushed_at.as_secs_f64(),
            gate_held_s = flushed.gate_held.as_secs_f64(),
            merged_partitions = merged.partitions,
            longest_merge_s = merged.longest.as_secs_f64(),
            total_s = started.elapsed().as_secs_f64(),
            "checkpoint (the flush and each partition's merge hold the store's gate only to freeze and to install)"
        );
        Ok(())
    }

    /// Flushes memory to components without truncating the log: what a primary does when
    /// a cold standby of its partitions wants components before truncating its own log.
    pub fn flush(&self) -> Result<()> {
        self.flush_in_stages(LogAfterFlush::Keep).map(|_| ())
    }

    /// Flushes memory to components (keeping the log, as [`Store::flush`]), then merges
    /// every partition this store is not a cold standby of down to one live component:
    /// what a client asks for once a bulk load is done. The merge rules leave a table
    /// loaded in a few publishes of unequal size in two or three components per partition
    /// (a small last publish waits for the count rule, which a table that stopped changing
    /// never reaches), and every query then opens them all. A cold standby's partitions
    /// take their primary's settled components when it ships them. Returns how many
    /// partitions were merged.
    pub fn settle(&self) -> Result<usize> {
        self.flush()?;
        Ok(self.merge_partitions(MergeRule::Settle)?.partitions)
    }

    /// Flushes the memtables in three stages, so that the gate is held exclusively only
    /// briefly:
    ///
    /// 1. *Freeze*, under the gate: each partition's memtable entries so far are the ones
    ///    to flush. When the log is to be truncated, it is rotated here too, and the
    ///    undecided epochs' rows are logged again in the new segment. Everything the old
    ///    segments hold is then either frozen or logged anew, and every later record (a
    ///    commit of one of those epochs included) follows its rows in the new segment.
    /// 2. *Write*, with the gate open: the frozen entries become components. Reads still
    ///    find those rows in the memtables, and new rows join the memtables behind them.
    /// 3. *Install*, under the gate: each partition whose memtable still begins with its
    ///    frozen entries gets the component in their place, in one step under the state
    ///    lock. Then the checkpoint file records the manifests and counters, and the old
    ///    segments go, unless some frozen rows are still only in memory and in them.
    ///
    /// One flush runs at a time (`flushing`); a bulk publish, which flushes under the
    /// gate, waits for it too.
    fn flush_in_stages(&self, log: LogAfterFlush) -> Result<Flushed> {
        let _one_at_a_time = self.one_flush_at_a_time();
        let mut gate_held = std::time::Duration::ZERO;
        let froze = std::time::Instant::now();
        let (frozen, segment) = {
            let _gate = self.gate.exclusive(gate::Holder::Flush);
            self.check_poisoned()?;
            // The segments about to go may hold a cold standby's only copy of committed
            // rows not yet covered by components from its primary: apply them, so the
            // flush keeps them.
            let replayed = match log {
                LogAfterFlush::Truncate => self.replay_standby_holding_gate(|_| true)?,
                LogAfterFlush::Keep => 0,
            };
            if replayed > 0 {
                tracing::info!(
                    replayed,
                    "applied cold-standby rows the primary has not shipped components for"
                );
            }
            let frozen = self.freeze_memtables();
            let segment = match log {
                LogAfterFlush::Truncate => {
                    self.state().logged_bytes = 0;
                    let segment = self.or_poison(self.wal.rotate())?;
                    self.relog_undecided()?;
                    Some(segment)
                }
                LogAfterFlush::Keep => None,
            };
            (frozen, segment)
        };
        gate_held += froze.elapsed();
        let written = self.write_frozen(frozen)?;
        let installing = std::time::Instant::now();
        {
            let _gate = self.gate.exclusive(gate::Holder::Flush);
            self.check_poisoned()?;
            let all_installed = self.install_flushed(written)?;
            if let Some(segment) = segment {
                if all_installed {
                    self.or_poison(self.wal.delete_segments_before(segment))?;
                }
            }
        }
        gate_held += installing.elapsed();
        Ok(Flushed { gate_held })
    }

    /// Holds back new rows while the memtables hold more than
    /// [`MEMTABLE_STALL_FACTOR`] times the flush threshold and a flush is under way: until
    /// it frees them. Rows arriving faster than flushes write them would otherwise grow
    /// memory without bound, now that a flush no longer holds the gate while it writes.
    pub(super) fn wait_while_memory_is_full(&self) -> std::time::Duration {
        let full = self
            .config
            .memtable_flush_bytes
            .saturating_mul(MEMTABLE_STALL_FACTOR);
        if self.state().memtable_bytes < full {
            return std::time::Duration::ZERO;
        }
        let waited_from = std::time::Instant::now();
        drop(self.one_flush_at_a_time());
        let waited = waited_from.elapsed();
        tracing::debug!(
            waited_s = waited.as_secs_f64(),
            "new rows waited for a flush: the memtables were full"
        );
        waited
    }

    /// Waits for any flush under way, and holds off others until dropped. (A flush that
    /// panicked left nothing half done here: its rows are still in memory and the log.)
    pub(super) fn one_flush_at_a_time(&self) -> std::sync::MutexGuard<'_, ()> {
        self.flushing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Each partition's memtable entries, as they are now (stage 1 of
    /// [`Store::flush_in_stages`]).
    pub(super) fn freeze_memtables(&self) -> Vec<FrozenRows> {
        let state = self.state();
        state
            .all_partitions()
            .filter(|(_, _, p)| !p.memtable.is_empty())
            .map(|(t, partition, p)| FrozenRows {
                def: t.def.clone(),
                partition,
                batches: p.memtable.iter().map(|e| e.batch.clone()).collect(),
                lsns: p.memtable.iter().map(|e| e.lsn).collect(),
            })
            .collect()
    }

    /// The frozen rows as components, one per partition (stage 2 of
    /// [`Store::flush_in_stages`]); a failed write poisons the store.
    pub(super) fn write_frozen(
        &self,
        frozen: Vec<FrozenRows>,
    ) -> Result<Vec<(FrozenRows, ComponentMeta)>> {
        frozen
            .into_iter()
            .map(|rows| {
                let meta = self.or_poison(self.write_component(
                    &rows.def,
                    &rows.batches,
                    rows.min_lsn(),
                    rows.max_lsn(),
                ))?;
                Ok((rows, meta))
            })
            .collect()
    }

    /// Puts each written component in place of the frozen entries it holds, where the
    /// memtable still begins with them, and writes the checkpoint file (stage 3 of
    /// [`Store::flush_in_stages`]). False if some frozen rows are still only in memory:
    /// the log that holds them must stay.
    pub(super) fn install_flushed(
        &self,
        written: Vec<(FrozenRows, ComponentMeta)>,
    ) -> Result<bool> {
        let mut state = self.state();
        let mut all_installed = true;
        for (rows, meta) in written {
            let Some(part) = state
                .tables
                .get_mut(&rows.def.name)
                .and_then(|t| t.partitions.get_mut(rows.partition.0 as usize))
            else {
                // The table was dropped meanwhile: its rows are not wanted.
                continue;
            };
            let frozen = rows.lsns.len();
            let unchanged = part.memtable.len() >= frozen
                && part
                    .memtable
                    .iter()
                    .zip(&rows.lsns)
                    .all(|(e, &lsn)| e.lsn == lsn)
                && meta.max_lsn >= part.manifest.max_lsn;
            if unchanged {
                part.memtable.drain(..frozen);
                part.manifest.add(meta);
                continue;
            }
            // Another hand took the rows meanwhile (components shipped from the primary,
            // a copy of the partition, the table recreated): the component is garbage. If
            // some of them are still here, so must their log records stay.
            let still_here = part.memtable.iter().any(|e| rows.lsns.contains(&e.lsn));
            if still_here {
                tracing::warn!(
                    table = %rows.def.name,
                    partition = %rows.partition,
                    "a partition's memtable changed during a flush; its log stays until the next checkpoint"
                );
                all_installed = false;
            }
        }
        // Counted again from what is left, each entry at the bytes it was counted at, so
        // no remainder of entries that left by other hands keeps asking for checkpoints.
        state.memtable_bytes = state
            .all_partitions()
            .flat_map(|(_, _, p)| &p.memtable)
            .map(|e| e.bytes)
            .sum();
        self.write_checkpoint(&state)?;
        Ok(all_installed)
    }

    /// Logs the undecided epochs' rows again, in the segment the log was just rotated to:
    /// they must outlive the segments about to be deleted.
    fn relog_undecided(&self) -> Result<()> {
        let relogged = {
            let state = self.state();
            let mut frames = Vec::new();
            for (epoch, entries) in &state.pending {
                for entry in entries {
                    frames.push(entry.rows.frame(
                        &entry.table,
                        entry.partition,
                        *epoch,
                        entry.seq,
                    )?);
                }
            }
            frames
        };
        if !relogged.is_empty() {
            self.or_poison(self.wal.submit_frames(relogged).wait())?;
        }
        Ok(())
    }

    /// The body of [`Store::checkpoint`] but its merges, for callers already holding the
    /// gate exclusively (they merge once they let it go).
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
        self.relog_undecided()?;
        self.or_poison(self.wal.delete_segments_before(segment))
    }

    /// Merges each partition's components once there are more than the merge threshold:
    /// into one *current* component, each key's newest version, and one *history*
    /// component, the versions those supersede (marked with the newest merged epoch, at or
    /// after which no read needs them). A read at the newest epoch then scans the current
    /// component alone, however many versions the table keeps. History components are
    /// merged among themselves when they crowd, and dropped whole once the retention
    /// horizon passes the epoch that superseded them.
    ///
    /// Each partition is merged on its own, planned afresh, and without the gate: a merge of
    /// a large partition reads, merges and writes for seconds (at SF 10), and prepares and
    /// publishes (which take the gate shared) would wait for all of it. The gate is held
    /// only to put the merged components in place of their inputs, if those are all still
    /// there ([`Store::install_merge`]).
    ///
    /// A cold standby's partitions hold its primary's components, which the primary
    /// merges itself and ships once merged (the standby then deletes whatever it merged):
    /// they are merged here by the count rule only, for a standby whose primary stops
    /// shipping, never early by the tiered rule. Each standby once merged every partition
    /// its primary had flushed for it (the flush a standby asks for before its own
    /// checkpoint does not merge), only to throw that merge away at the next shipment.
    pub(super) fn merge_crowded_partitions(&self) -> Result<Merged> {
        self.merge_partitions(MergeRule::Crowded)
    }

    /// Merges the partitions `rule` picks, one after another, each installed under the
    /// exclusive gate on its own (see [`Store::merge_crowded_partitions`]).
    fn merge_partitions(&self, rule: MergeRule) -> Result<Merged> {
        let plan_of = |state: &State, table: &TableState, partition, p: &PartitionState| {
            let cold_standby = state.standby.contains(&partition);
            let (threshold, tiered) = match rule {
                MergeRule::Crowded => (
                    self.config.merge_threshold,
                    self.config.tiered_merges && !cold_standby,
                ),
                MergeRule::Settle if cold_standby => return None,
                MergeRule::Settle => (1, false),
            };
            MergePlan::of(
                &table.def,
                partition,
                &p.manifest.components,
                state.horizon(&table.def.name),
                threshold,
                tiered,
            )
        };
        let crowded: Vec<(String, PartitionId)> = {
            let state = self.state();
            state
                .all_partitions()
                .filter(|&(t, partition, p)| plan_of(&state, t, partition, p).is_some())
                .map(|(t, partition, _)| (t.def.name.clone(), partition))
                .collect()
        };
        let mut merged = Merged::default();
        for (table, partition) in crowded {
            let planned = {
                let state = self.state();
                // Merged meanwhile by another checkpoint, or moved away: nothing to do.
                let Ok(t) = state.table(&table) else { continue };
                let Ok(p) = state.partition(&table, partition) else {
                    continue;
                };
                // Another merge of the partition (a checkpoint's beside a settle), a
                // standby's install or a copy may replace these inputs while this one
                // reads them: their files stay until it is done, and its install then
                // finds them gone from the manifest and drops its output.
                plan_of(&state, t, partition, p).map(|plan| (plan, self.pin_components()))
            };
            let Some((plan, inputs_pinned)) = planned else {
                continue;
            };
            self.check_poisoned()?;
            let written = self.write_merge(&plan)?;
            // Before the install, whose garbage collection then deletes what the pin kept
            // (after a failed write, the next install's does).
            drop(inputs_pinned);
            let installing = std::time::Instant::now();
            let _gate = self.gate.exclusive(gate::Holder::Merge);
            self.check_poisoned()?;
            if self.install_merge(&plan, written)? {
                merged.partitions += 1;
            }
            merged.longest = merged.longest.max(installing.elapsed());
        }
        Ok(merged)
    }

    /// Reads, merges and writes the components `plan` merges, without the gate: the inputs
    /// are immutable, and nothing references the outputs until [`Store::install_merge`].
    fn write_merge(&self, plan: &MergePlan) -> Result<MergeOutput> {
        let key = plan.def.primary_key_indices();
        let mut output = MergeOutput::default();
        if !plan.live.is_empty() {
            let batches = self.read_components(&plan.def, &plan.live)?;
            let split = versions::merge_and_split_versions(
                &batches,
                &key,
                plan.horizon,
                plan.def.append_only,
                plan.tombstones_droppable,
            )?;
            let (min_lsn, max_lsn) = lsn_range(&plan.live);
            let superseded_at = plan
                .live
                .iter()
                .map(|c| c.max_epoch)
                .max()
                .expect("a merge has inputs");
            if split.history.num_rows() > 0 {
                let mut meta =
                    self.write_component(&plan.def, &[split.history], min_lsn, max_lsn)?;
                meta.superseded_at = superseded_at;
                output.history.push(meta);
            }
            if split.current.num_rows() > 0 {
                output.current =
                    Some(self.write_component(&plan.def, &[split.current], min_lsn, max_lsn)?);
            }
        }
        if !plan.history.is_empty() {
            let batches = self.read_components(&plan.def, &plan.history)?;
            // Every version here is older than its key's versions in the current and
            // newer components, so retention may judge them among themselves.
            let merged = versions::merge_versions(&batches, &key, plan.horizon, false)?;
            if merged.num_rows() > 0 {
                let (min_lsn, max_lsn) = lsn_range(&plan.history);
                let mut meta = self.write_component(&plan.def, &[merged], min_lsn, max_lsn)?;
                meta.superseded_at = plan
                    .history
                    .iter()
                    .map(|c| c.superseded_at)
                    .max()
                    .expect("a merge has inputs");
                output.history.insert(0, meta);
            }
        }
        Ok(output)
    }

    /// Under the exclusive gate: puts a merge's output in place of its inputs, if the
    /// partition still holds every input and its table's horizon has not moved back (else
    /// a copy, a standby's install or another merge replaced them, or a longer retention
    /// keeps versions the merge dropped: the output is deleted, and the next checkpoint
    /// plans afresh). Returns whether it did.
    fn install_merge(&self, plan: &MergePlan, output: MergeOutput) -> Result<bool> {
        let removed: Vec<ComponentHash> = plan
            .live
            .iter()
            .chain(&plan.history)
            .chain(&plan.expired)
            .map(|c| c.hash)
            .collect();
        let mut state = self.state();
        // A horizon that moved on since is fine: the output only keeps versions it no
        // longer needs. One that moved back (a longer retention) wants versions it dropped.
        let unchanged = state.horizon(&plan.def.name) >= plan.horizon
            && state
                .partition(&plan.def.name, plan.partition)
                .is_ok_and(|p| {
                    removed
                        .iter()
                        .all(|h| p.manifest.components.iter().any(|c| c.hash == *h))
                });
        if !unchanged {
            tracing::debug!(
                table = %plan.def.name,
                partition = %plan.partition,
                "a merge's inputs changed while it ran; its output is dropped"
            );
            self.collect_garbage(output.hashes(), &state)?;
            return Ok(false);
        }
        let manifest = &mut state
            .held_partition_mut(&plan.def.name, plan.partition)
            .manifest;
        // Components flushed while the merge ran are newer than its inputs: they stay
        // after its current component, in the order they were logged.
        let (kept_history, kept_live): (Vec<_>, Vec<_>) = std::mem::take(&mut manifest.components)
            .into_iter()
            .filter(|c| !removed.contains(&c.hash))
            .partition(|c| c.is_history());
        manifest.components = kept_history
            .into_iter()
            .chain(output.history)
            .chain(output.current)
            .chain(kept_live)
            .collect();
        self.write_checkpoint(&state)?;
        tracing::debug!(
            table = %plan.def.name,
            partition = %plan.partition,
            merged = plan.live.len(),
            history_merged = plan.history.len(),
            history_expired = plan.expired.len(),
            "merged components"
        );
        self.collect_garbage(removed, &state)?;
        Ok(true)
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
            self.verified.remove(&hash);
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
            let hash = name.strip_suffix(".parquet").map(ComponentHash::from_hex);
            let orphan = match hash {
                Some(hash) => hash.is_some_and(|h| !referenced.contains(&h)),
                None => name.ends_with(".tmp"),
            };
            if orphan {
                let path = entry.path();
                std::fs::remove_file(&path).map_err(|e| StorageError::io(&path, e))?;
                // An earlier process may have checked it: a copy must fetch it again.
                if let Some(Some(hash)) = hash {
                    self.verified.remove(&hash);
                }
            }
        }
        Ok(())
    }
}

/// What one partition's merge does at a checkpoint.
struct MergePlan {
    def: TableDef,
    partition: PartitionId,
    /// The table's retention horizon: versions no read at or after it sees are dropped.
    horizon: Epoch,
    /// Every component that is not history, to merge into a current and a history
    /// component; empty if they do not crowd.
    live: Vec<ComponentMeta>,
    /// History components to merge into one; empty if they do not crowd.
    history: Vec<ComponentMeta>,
    /// History components no retained epoch reads: dropped without reading.
    expired: Vec<ComponentMeta>,
    /// No history component that a read at or after the horizon opens outlives the merge:
    /// a tombstone at or below the horizon hides nothing any more and may go. Otherwise
    /// such a component may hold an older version of its key, which dropping the tombstone
    /// would bring back for reads between the horizon and that component's
    /// `superseded_at` (found by the versioned model test: deleted keys seen again `AS OF`
    /// an epoch above the horizon).
    tombstones_droppable: bool,
}

/// The components a merge wrote: what replaces its inputs.
#[derive(Debug, Default)]
struct MergeOutput {
    /// The merged history, oldest first.
    history: Vec<ComponentMeta>,
    /// Each merged key's newest version.
    current: Option<ComponentMeta>,
}

impl MergeOutput {
    fn hashes(&self) -> Vec<ComponentHash> {
        self.history
            .iter()
            .chain(&self.current)
            .map(|c| c.hash)
            .collect()
    }
}

impl MergePlan {
    /// The merge one partition's components need, if any.
    fn of(
        def: &TableDef,
        partition: PartitionId,
        components: &[ComponentMeta],
        horizon: Epoch,
        threshold: usize,
        tiered: bool,
    ) -> Option<MergePlan> {
        // Decided by counting, so the many idle partitions of a checkpoint copy nothing.
        let live = |c: &ComponentMeta| !c.is_history();
        let kept_history = |c: &ComponentMeta| c.is_history() && c.superseded_at > horizon;
        let expired = |c: &ComponentMeta| c.is_history() && c.superseded_at <= horizon;
        let crowded = |kind: &dyn Fn(&ComponentMeta) -> bool| {
            components.iter().filter(|c| kind(c)).count() > threshold
        };
        let live_bytes: Vec<u64> = components
            .iter()
            .filter(|c| live(c))
            .map(|c| c.bytes)
            .collect();
        let merge_live = crowded(&live) || (tiered && tiered_merge_due(&live_bytes));
        let merge_history = crowded(&kept_history);
        let drop_expired = components.iter().any(expired);
        if !(merge_live || merge_history || drop_expired) {
            return None;
        }
        let those = |wanted: bool, kind: &dyn Fn(&ComponentMeta) -> bool| -> Vec<ComponentMeta> {
            if wanted {
                components.iter().filter(|c| kind(c)).cloned().collect()
            } else {
                Vec::new()
            }
        };
        Some(MergePlan {
            def: def.clone(),
            partition,
            horizon,
            live: those(merge_live, &live),
            history: those(merge_history, &kept_history),
            expired: those(drop_expired, &expired),
            tombstones_droppable: !components.iter().any(kept_history),
        })
    }
}

/// Whether a partition's live components (their sizes in bytes) are merged before they
/// crowd: two or more, and all but the largest add up to at least half of it. A table
/// loaded in a few large publishes (a cluster loads SF 1 lineitem as three) is then read as
/// one file per partition, which scans much faster than several. Small changes after a
/// large base wait for the count rule instead. Each merge this allows grows the partition's
/// largest component by half or more, so a byte is rewritten a bounded number of times
/// (about three in all for steady appends), not once per checkpoint.
pub(crate) fn tiered_merge_due(live_bytes: &[u64]) -> bool {
    let Some(&largest) = live_bytes.iter().max() else {
        return false;
    };
    let rest: u64 = live_bytes.iter().sum::<u64>() - largest;
    live_bytes.len() >= 2 && rest.saturating_mul(2) >= largest
}

/// The log positions a merge's output covers: those of all its inputs.
fn lsn_range(inputs: &[ComponentMeta]) -> (Lsn, Lsn) {
    let min = inputs.iter().map(|c| c.min_lsn).min();
    let max = inputs.iter().map(|c| c.max_lsn).max();
    (
        min.expect("a merge has inputs"),
        max.expect("a merge has inputs"),
    )
}

#[cfg(test)]
mod tests {
    use super::tiered_merge_due;

    #[test]
    fn components_merge_early_once_the_smaller_ones_reach_half_the_largest() {
        const MB: u64 = 1 << 20;
        // A table loaded as three equal publishes, and the steps a load passes through.
        assert!(tiered_merge_due(&[3 * MB / 2, 3 * MB / 2, 3 * MB / 2]));
        assert!(tiered_merge_due(&[3 * MB / 2, 3 * MB / 2]));
        assert!(tiered_merge_due(&[3 * MB, 3 * MB / 2]));
        // Small changes after a large base wait for the count rule.
        assert!(!tiered_merge_due(&[45 * MB / 10, MB / 1024]));
        assert!(!tiered_merge_due(&[4 * MB, MB, MB / 2]));
        assert!(tiered_merge_due(&[4 * MB, MB, MB]));
        // One component, or none, is never merged for this.
        assert!(!tiered_merge_due(&[MB]));
        assert!(!tiered_merge_due(&[]));
    }
}
