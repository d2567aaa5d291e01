//! The epoch log and tags: what a collaborator reads history by (dates and names rather
//! than epoch numbers).
//!
//! Times come from the metadata leader's clock: the leader stamps every command it
//! proposes ([`crate::MetaCommand::Stamped`]), and the state keeps the largest stamp seen,
//! so its clock never moves back across leader changes or skewed clocks. An epoch's time
//! is when it became *visible* (committed, and every epoch below it decided): the moment
//! a reader could first see it. Times therefore never decrease with the epoch number, and
//! an epoch that becomes visible later gets a time no earlier than the clock then, so
//! "the newest epoch at or before time t" does not change once t has passed.

use crate::state::MetaState;
use crate::NodeId;
use serde::{Deserialize, Serialize};
use tessera_common::time::format_ms;
use tessera_common::Epoch;

/// Rows one publish wrote to one table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TableChangeCount {
    pub table: String,
    /// Rows inserted or updated.
    pub upserts: u64,
    /// Keys deleted.
    pub deletes: u64,
}

/// What moved a committed epoch's data.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EpochKind {
    /// Rows published by a client.
    Publish,
    /// A placement change (a join, a decommission, a replica refreshed or rebuilt): data
    /// moved between nodes, no row changed.
    Placement,
}

/// One committed epoch, as the epoch log keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EpochRecord {
    pub kind: EpochKind,
    /// The node that coordinated it.
    pub coordinator: NodeId,
    /// The tables it leased.
    pub tables: Vec<String>,
    /// Rows written per table (a publish only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<TableChangeCount>,
    /// When it became visible, in milliseconds since the Unix epoch on the metadata's clock
    /// (0 while it is not yet visible, or for epochs from before the clock was kept).
    pub visible_at_ms: u64,
    /// The user who published it (`None`: the operator, or a placement change).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    /// The publisher's participant, as it was when the epoch committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub participant: Option<String>,
    /// A publish's version ids and signature (see [`crate::seal`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<crate::seal::EpochSeal>,
}

impl EpochRecord {
    /// Whether this epoch published rows to `table` (a placement change moves data, and
    /// changes none).
    pub fn changed(&self, table: &str) -> bool {
        self.kind == EpochKind::Publish && self.tables.iter().any(|t| t == table)
    }
}

/// A name pinned to a committed epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TagRecord {
    pub epoch: Epoch,
    pub created_at_ms: u64,
}

impl MetaState {
    /// The newest visible epoch that became visible at or before `at_ms`; an error naming
    /// the first epoch's time when `at_ms` predates every epoch.
    pub fn epoch_at(&self, at_ms: u64) -> Result<Epoch, String> {
        // Times never fall with the epoch number, so the answer is the newest timed epoch at
        // or before `at_ms`: searched from the newest end, as retention asks for recent
        // times on every applied command.
        let found = self
            .epoch_log
            .range(..=self.visible)
            .rev()
            .find(|(_, r)| r.visible_at_ms > 0 && r.visible_at_ms <= at_ms)
            .map(|(epoch, _)| *epoch);
        found.ok_or_else(|| {
            let first = self
                .epoch_log
                .range(..=self.visible)
                .find(|(_, r)| r.visible_at_ms > 0);
            match first {
                Some((epoch, record)) if !self.history_compacted_below.is_zero() => format!(
                    "timestamp {} is before the oldest epoch the log still holds: epoch {epoch} became visible at {}, and no table retains its history before it",
                    format_ms(at_ms),
                    format_ms(record.visible_at_ms)
                ),
                Some((epoch, record)) => format!(
                    "timestamp {} is before the first epoch: epoch {epoch} became visible at {}",
                    format_ms(at_ms),
                    format_ms(record.visible_at_ms)
                ),
                None => format!(
                    "timestamp {}: no epoch with a recorded time has committed yet",
                    format_ms(at_ms)
                ),
            }
        })
    }

    /// The epoch tag `name` pins.
    pub fn tag_epoch(&self, name: &str) -> Result<Epoch, String> {
        self.tags
            .get(name)
            .map(|t| t.epoch)
            .ok_or_else(|| format!("tag {name:?} does not exist"))
    }

    /// Records a committed epoch in the log; its time is set once it becomes visible.
    pub(crate) fn log_commit(
        &mut self,
        epoch: Epoch,
        open: &crate::OpenEpoch,
        changes: Option<Vec<TableChangeCount>>,
        seal: Option<crate::seal::EpochSeal>,
    ) {
        let kind = match changes {
            Some(_) => EpochKind::Publish,
            None => EpochKind::Placement,
        };
        let participant = self.participant_of(open.publisher.as_deref());
        self.epoch_log.insert(
            epoch,
            EpochRecord {
                kind,
                coordinator: open.coordinator,
                tables: open.tables.clone(),
                changes: changes.unwrap_or_default(),
                visible_at_ms: 0,
                publisher: open.publisher.clone(),
                participant,
                seal,
            },
        );
    }

    /// The participant `user` belongs to, if any.
    pub fn participant_of(&self, user: Option<&str>) -> Option<String> {
        user.and_then(|user| self.users.get(user))
            .and_then(|user| user.participant.clone())
    }

    /// Gives an epoch that just became visible the metadata's time now.
    pub(crate) fn log_visible(&mut self, epoch: Epoch) {
        if let Some(record) = self.epoch_log.get_mut(&epoch) {
            record.visible_at_ms = self.clock_ms;
        }
    }

    /// Pins `name` to `epoch` (if `None`, the newest committed epoch at or below the visible
    /// one), which must be committed and visible.
    pub(crate) fn create_tag(
        &mut self,
        name: String,
        epoch: Option<Epoch>,
    ) -> Result<Epoch, String> {
        if let Some(existing) = self.tags.get(&name) {
            return Err(format!(
                "tag {name:?} already exists (at epoch {})",
                existing.epoch
            ));
        }
        // Without a number, the newest committed epoch a reader sees now (the visible one
        // may be aborted: its data is its committed predecessor's).
        let epoch = epoch.unwrap_or_else(|| {
            self.epoch_log
                .range(..=self.visible)
                .next_back()
                .map_or(self.visible, |(epoch, _)| *epoch)
        });
        if epoch > self.visible {
            return Err(format!(
                "epoch {epoch} is not visible yet (the visible epoch is {})",
                self.visible
            ));
        }
        if epoch != Epoch::ZERO && !self.is_committed(epoch) {
            return Err(format!(
                "epoch {epoch} was aborted: it holds no data to tag"
            ));
        }
        self.check_taggable(epoch)?;
        self.tags.insert(
            name,
            TagRecord {
                epoch,
                created_at_ms: self.clock_ms,
            },
        );
        Ok(epoch)
    }

    /// The broken invariant of the epoch log, if any: times never decrease with the epoch
    /// number among visible epochs, and no epoch above the visible one has a time.
    /// Checked for the epochs from `from` on.
    pub(crate) fn broken_history_invariant_from(&self, from: Epoch) -> Option<String> {
        let mut last = (Epoch::ZERO, 0);
        for (epoch, record) in self.epoch_log.range(from..) {
            if *epoch > self.visible {
                if record.visible_at_ms != 0 {
                    return Some(format!(
                        "epoch {epoch} has a visible time but lies above the visible epoch {}",
                        self.visible
                    ));
                }
                continue;
            }
            if record.visible_at_ms != 0 {
                if record.visible_at_ms < last.1 {
                    return Some(format!(
                        "epoch {epoch} became visible at {} ms, before epoch {} at {} ms",
                        record.visible_at_ms, last.0, last.1
                    ));
                }
                last = (*epoch, record.visible_at_ms);
            }
        }
        None
    }
}
