//! Compacting the epoch log: once no table retains its history below an epoch, the log's
//! records there (and the audit log's publishes) are let go, so the metadata (every Raft
//! snapshot, every node's copy of the state) stays bounded when every table has a
//! retention setting, instead of growing with every epoch ever committed.
//!
//! What the records below the compaction point told is kept in a compact form:
//! - **which epochs were aborted.** Above `aborts_derived_from` an epoch is aborted when
//!   the log lacks it; the compaction moves the point up to where the log now begins, and
//!   puts the aborted epochs below it back in `aborted` (a few bytes per abort, where a
//!   record is hundreds per commit);
//! - **each table's hash chain.** `history_heads` keeps each table's version id at the
//!   compaction point, where `tessera verify` resumes the chain in the log;
//! - **whether an archived epoch still reads for later ones.** A read at an epoch below
//!   the horizon is served by the newest archived epoch at or below it if the table did
//!   not change in between: each archived epoch below the point records the first change
//!   after it (`ArchivedEpoch::next_change`).
//!
//! The point is the lowest of: every table's retention horizon, or its creation if it
//! retains every version since (a table with unlimited history holds the log from there;
//! that is the cost of unlimited history, as its data is),
//! every tag, every open epoch, and [`LOG_KEPT_EPOCHS`] below the visible one (the recent
//! history `tessera_epochs` shows). Below every horizon, no read is answered but from the
//! archive, so what the log no longer tells (and the archive records) changes no answer;
//! horizons never fall, and they are computed from records at or above themselves (the
//! newest publishes, the newest epoch before a time), which the compaction keeps.

use crate::access::AuditEvent;
use crate::state::MetaState;
use tessera_common::Epoch;

/// Epochs below the visible one whose records the log keeps, whatever retention allows.
pub const LOG_KEPT_EPOCHS: u64 = 1024;

/// The log is compacted each time the visible epoch passes a multiple of this: rarely
/// enough that finding the point (every table's horizon) costs nothing per publish.
pub const COMPACTION_INTERVAL: u64 = 256;

impl MetaState {
    /// The epoch below which the epoch log may let its records go now.
    pub fn compactable_below(&self) -> Epoch {
        let mut point = Epoch(self.visible.0.saturating_sub(LOG_KEPT_EPOCHS));
        for (table, def) in &self.tables {
            // A table's history begins where it was created.
            point = point.min(self.retention_horizon(table).max(def.created_at));
        }
        for tag in self.tags.values() {
            point = point.min(tag.epoch);
        }
        if let Some(&oldest_open) = self.open.keys().next() {
            point = point.min(oldest_open);
        }
        point
    }

    /// Compacts the log if the visible epoch moved across a multiple of
    /// [`COMPACTION_INTERVAL`] since `visible_before`. Deterministic, as everything applied.
    pub(crate) fn compact_history_on_interval(&mut self, visible_before: Epoch) {
        if self.visible.0 / COMPACTION_INTERVAL != visible_before.0 / COMPACTION_INTERVAL {
            self.compact_history(self.compactable_below());
        }
    }

    /// Lets the records below `point` go (see the module's documentation); nothing if the
    /// log is compacted that far already.
    pub(crate) fn compact_history(&mut self, point: Epoch) {
        if point <= self.history_compacted_below {
            return;
        }
        assert!(
            point <= self.visible,
            "invariant: only decided epochs leave the log ({point} is above the visible {})",
            self.visible
        );
        // The aborts the log told by lacking them, below the point, become explicit again.
        if !self.aborts_derived_from.is_zero() && self.aborts_derived_from < point {
            for epoch in (self.aborts_derived_from.0..point.0).map(Epoch) {
                if !self.epoch_log.contains_key(&epoch) {
                    self.aborted.insert(epoch);
                    debug_assert!(self.aborts_derived > 0, "epoch {epoch}'s abort was counted");
                    self.aborts_derived = self.aborts_derived.saturating_sub(1);
                }
            }
            self.aborts_derived_from = point;
        }
        self.note_archived_next_changes(point);
        let mut gone = Vec::new();
        for (epoch, record) in self.epoch_log.range(..point) {
            for link in record.seal.iter().flat_map(|seal| &seal.versions) {
                if self.tables.contains_key(&link.table) {
                    self.history_heads.insert(link.table.clone(), link.version);
                }
            }
            gone.push(*epoch);
        }
        for epoch in gone {
            self.epoch_log.remove(&epoch);
        }
        self.audit_log.retain(|record| match &record.event {
            AuditEvent::Publish { epoch, .. } => *epoch >= point,
            _ => true,
        });
        self.history_compacted_below = point;
    }

    /// Where `table`'s hash chain begins in the epoch log: its version id at the compaction
    /// point (the genesis id if the log was never compacted past one of its publishes).
    pub fn history_head(&self, table: &str) -> tessera_common::ComponentHash {
        self.history_heads
            .get(table)
            .copied()
            .unwrap_or(tessera_storage::digest::GENESIS)
    }
}
