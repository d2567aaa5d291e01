//! A local store's history by time and by name: when each epoch committed, and tags.
//!
//! A cluster keeps both in its Raft metadata; a store on its own (`tessera sql`, `load`
//! and `publish` on a data directory, `tessera demo --local`) keeps them itself. A publish's commit record in
//! the log carries its commit time, so the time is as durable as the epoch, and replaying
//! the log counts the rows each epoch wrote; the checkpoint carries every epoch's record
//! and the tags, which change rarely and are written with the checkpoint when they do.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tessera_common::time::format_ms;
use tessera_common::Epoch;

/// Why a point in history or a tag change was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryRefusal {
    #[error("tag {name:?} already exists (at epoch {epoch})")]
    TagExists { name: String, epoch: Epoch },
    #[error("tag {0:?} does not exist")]
    NoSuchTag(String),
    /// A timestamp before the first timed epoch, an epoch not visible yet.
    #[error("{0}")]
    OutOfRange(String),
}

/// One tag: the epoch it names and when it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalTag {
    pub epoch: Epoch,
    pub created_at_ms: u64,
}

/// Rows one epoch wrote to one table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableRows {
    pub written: u64,
    pub deleted: u64,
}

/// One committed epoch of a local store: when, and what it changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalCommit {
    /// Milliseconds since the Unix epoch; 0 if not recorded (a log written before commit
    /// times were).
    #[serde(default)]
    pub at_ms: u64,
    /// The rows it wrote, by table.
    #[serde(default)]
    pub tables: BTreeMap<String, TableRows>,
}

/// Commit times and tags of a local store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalHistory {
    /// Every epoch committed since this store recorded its history. Times never fall as
    /// epochs rise.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub commits: BTreeMap<Epoch, LocalCommit>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, LocalTag>,
}

impl LocalHistory {
    /// The time to stamp on a commit now: the clock, but never before the last commit's
    /// time, so times stay ordered as epochs are even if the clock steps back.
    pub fn next_commit_time(&self, now_ms: u64) -> u64 {
        // Times rise with epochs, so the newest timed commit holds the latest time (epochs
        // from before times were logged have none).
        let last = self
            .commits
            .values()
            .rev()
            .map(|c| c.at_ms)
            .find(|&t| t > 0)
            .unwrap_or(0);
        now_ms.max(last)
    }

    pub fn record_commit(&mut self, epoch: Epoch, commit: LocalCommit) {
        self.commits.insert(epoch, commit);
    }

    /// When `epoch` committed, if recorded.
    pub fn commit_time(&self, epoch: Epoch) -> Option<u64> {
        self.commits.get(&epoch).map(|c| c.at_ms).filter(|&t| t > 0)
    }

    /// The newest epoch committed at or before `at_ms`, among those at or below `visible`.
    pub fn epoch_at(&self, at_ms: u64, visible: Epoch) -> Result<Epoch, HistoryRefusal> {
        let timed = || {
            self.commits
                .range(..=visible)
                .filter(|(_, c)| c.at_ms > 0)
                .map(|(epoch, c)| (*epoch, c.at_ms))
        };
        let found = timed()
            .rev()
            .find(|(_, t)| *t <= at_ms)
            .map(|(epoch, _)| epoch);
        found.ok_or_else(|| {
            HistoryRefusal::OutOfRange(match timed().next() {
                Some((epoch, first)) => format!(
                    "timestamp {} is before the first epoch: epoch {epoch} committed at {}",
                    format_ms(at_ms),
                    format_ms(first)
                ),
                None => format!(
                    "timestamp {}: no epoch with a recorded commit time has committed yet",
                    format_ms(at_ms)
                ),
            })
        })
    }

    /// The epoch tag `name` pins.
    pub fn tag_epoch(&self, name: &str) -> Result<Epoch, HistoryRefusal> {
        self.tags
            .get(name)
            .map(|t| t.epoch)
            .ok_or_else(|| HistoryRefusal::NoSuchTag(name.to_string()))
    }

    /// Names `epoch` (the visible one if `None`) `name`; refused if the name is taken or
    /// the epoch is not visible yet.
    pub fn create_tag(
        &mut self,
        name: &str,
        epoch: Option<Epoch>,
        visible: Epoch,
        now_ms: u64,
    ) -> Result<Epoch, HistoryRefusal> {
        if let Some(existing) = self.tags.get(name) {
            return Err(HistoryRefusal::TagExists {
                name: name.to_string(),
                epoch: existing.epoch,
            });
        }
        let epoch = epoch.unwrap_or(visible);
        if epoch > visible {
            return Err(HistoryRefusal::OutOfRange(format!(
                "epoch {epoch} is not visible yet (the visible epoch is {visible})"
            )));
        }
        self.tags.insert(
            name.to_string(),
            LocalTag {
                epoch,
                created_at_ms: now_ms,
            },
        );
        Ok(epoch)
    }

    pub fn drop_tag(&mut self, name: &str) -> Result<LocalTag, HistoryRefusal> {
        self.tags
            .remove(name)
            .ok_or_else(|| HistoryRefusal::NoSuchTag(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(at_ms: u64) -> LocalCommit {
        LocalCommit {
            at_ms,
            tables: BTreeMap::new(),
        }
    }

    #[test]
    fn a_timestamp_names_the_newest_epoch_committed_by_then() {
        let mut history = LocalHistory::default();
        for (epoch, at_ms) in [(1, 1_000), (2, 2_000), (3, 0), (4, 4_000)] {
            history.record_commit(Epoch(epoch), timed(at_ms));
        }
        assert_eq!(history.epoch_at(2_000, Epoch(4)), Ok(Epoch(2)));
        assert_eq!(history.epoch_at(3_999, Epoch(4)), Ok(Epoch(2)));
        assert_eq!(history.epoch_at(9_999, Epoch(4)), Ok(Epoch(4)));
        // An epoch above the visible one is not answered, whatever its time.
        assert_eq!(history.epoch_at(9_999, Epoch(2)), Ok(Epoch(2)));
        let before = history.epoch_at(999, Epoch(4)).unwrap_err().to_string();
        assert!(
            before.contains("before the first epoch: epoch 1"),
            "{before}"
        );
        let none = LocalHistory::default()
            .epoch_at(5, Epoch(0))
            .unwrap_err()
            .to_string();
        assert!(none.contains("no epoch"), "{none}");
    }

    #[test]
    fn commit_times_never_fall() {
        let mut history = LocalHistory::default();
        history.record_commit(Epoch(1), timed(5_000));
        assert_eq!(
            history.next_commit_time(4_000),
            5_000,
            "the clock stepped back"
        );
        assert_eq!(history.next_commit_time(6_000), 6_000);
    }

    #[test]
    fn tags_name_visible_epochs_once() {
        let mut history = LocalHistory::default();
        assert_eq!(history.create_tag("v1", None, Epoch(3), 10), Ok(Epoch(3)));
        assert_eq!(history.tag_epoch("v1"), Ok(Epoch(3)));
        let taken = history.create_tag("v1", Some(Epoch(1)), Epoch(3), 11);
        assert!(taken
            .unwrap_err()
            .to_string()
            .contains("already exists (at epoch 3)"));
        let future = history.create_tag("v2", Some(Epoch(7)), Epoch(3), 11);
        assert!(future.unwrap_err().to_string().contains("not visible yet"));
        assert!(history.drop_tag("v1").is_ok());
        assert_eq!(
            history.tag_epoch("v1"),
            Err(HistoryRefusal::NoSuchTag("v1".into()))
        );
        assert!(history.drop_tag("v1").is_err());
    }
}
