//! How much of a table's history is kept: a table's *retention horizon* is the oldest
//! epoch at which it can still be read exactly. Merges may drop any version no epoch at or
//! above the horizon can see; a read below it is refused, naming the horizon.
//!
//! The horizon is a function of the metadata state alone (the table's retention setting,
//! the epoch log, the metadata's clock and the tags), so every node computes the same one
//! from the same applied index. It never falls, since merges may already have used it: the
//! epoch log only grows and the clock never moves back; a new tag must be at or above it
//! (and then pins it: the horizon stays at or below every tagged epoch until the archive
//! holds that epoch, see [`crate::archive`]); and a changed
//! setting starts from the horizon the old one had reached (its *floor*), so retaining more
//! keeps more from now on but never claims history already given up.

use crate::state::MetaState;
use serde::{Deserialize, Serialize};
use tessera_common::Epoch;

/// A table's retention setting (`ALTER TABLE t SET (retain_epochs = n, retain_for =
/// '7 days')`). With both, a version is kept while either wants it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Retention {
    /// Keep the table's last `n` versions: the newest `n` publishes that changed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    /// Keep every version current at some moment of the last `ms` milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_ms: Option<u64>,
    /// Versions the other two let go move to the erasure-coded archive rather than away:
    /// the horizon passes each of the table's epochs only once the archive holds it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub archive: bool,
}

/// A table's retention as the metadata keeps it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TableRetention {
    pub setting: Retention,
    /// The horizon reached under earlier settings: the horizon never falls below it.
    #[serde(default)]
    pub floor: Epoch,
}

impl Retention {
    pub fn is_unlimited(&self) -> bool {
        self.epochs.is_none() && self.for_ms.is_none()
    }

    /// `retain_epochs = 3, retain_for = '7 days'`, as the user wrote it.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.epochs {
            parts.push(format!("retain_epochs = {n}"));
        }
        if let Some(ms) = self.for_ms {
            parts.push(format!("retain_for = '{}'", describe_duration(ms)));
        }
        if self.archive {
            parts.push("archive = true".into());
        }
        if self.is_unlimited() {
            "every epoch retained".into()
        } else {
            parts.join(", ")
        }
    }
}

/// `7 days`, `36 hours`, `90 seconds`: the largest whole unit.
pub fn describe_duration(ms: u64) -> String {
    for (unit, size) in [
        ("day", 86_400_000),
        ("hour", 3_600_000),
        ("minute", 60_000),
        ("second", 1_000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            let n = ms / size;
            return format!("{n} {unit}{}", if n == 1 { "" } else { "s" });
        }
    }
    format!("{ms} milliseconds")
}

impl MetaState {
    /// The oldest epoch at which `table` can be read exactly (`Epoch::ZERO`: all of them).
    pub fn retention_horizon(&self, table: &str) -> Epoch {
        let Some(retention) = self.retention.get(table) else {
            return Epoch::ZERO;
        };
        let wanted = self.horizon_of_setting(table, &retention.setting);
        // A tagged epoch (or any, with `archive = true`) holds the horizon until the
        // archive holds it.
        let pinned = match self.unarchived_wanted(table, retention, wanted).first() {
            Some(&kept) => wanted.min(kept),
            None => wanted,
        };
        pinned.max(retention.floor)
    }

    /// Refuses a read of `table` at `epoch` below its retention horizon.
    pub fn check_retained(&self, table: &str, epoch: Epoch) -> Result<(), String> {
        let horizon = self.retention_horizon(table);
        if epoch >= horizon {
            return Ok(());
        }
        let setting = self
            .retention
            .get(table)
            .copied()
            .unwrap_or_default()
            .setting;
        Err(format!(
            "epoch {epoch} of table {table:?} is no longer retained: its oldest readable epoch is {horizon} ({})",
            setting.describe()
        ))
    }

    /// Sets `table`'s retention. A tagged epoch it would leave behind stays readable: it
    /// pins the horizon until the archive holds it. Returns the new horizon (never below
    /// the old one).
    pub(crate) fn set_retention(
        &mut self,
        table: String,
        retention: Retention,
    ) -> Result<Epoch, String> {
        if !self.tables.contains_key(&table) {
            return Err(format!("table {table:?} does not exist"));
        }
        if retention.epochs == Some(0) {
            return Err("retain_epochs must be at least 1 (the table's current version)".into());
        }
        let floor = self.retention_horizon(&table);
        if retention.is_unlimited() && !retention.archive && floor == Epoch::ZERO {
            self.retention.remove(&table);
        } else {
            self.retention.insert(
                table.clone(),
                TableRetention {
                    setting: retention,
                    floor,
                },
            );
        }
        // With `archive` turned off, archived epochs only tags name are let go.
        self.drop_untagged_archives();
        let horizon = self.retention_horizon(&table);
        debug_assert!(horizon >= floor, "a retention horizon never falls");
        Ok(horizon)
    }

    /// Refuses a tag at `epoch` if some table's versions there may be merged away.
    pub(crate) fn check_taggable(&self, epoch: Epoch) -> Result<(), String> {
        if epoch < self.history_compacted_below {
            return Err(format!(
                "cannot tag epoch {epoch}: no table retains its history below epoch {}",
                self.history_compacted_below
            ));
        }
        for table in self.retention.keys() {
            self.check_retained(table, epoch)
                .map_err(|why| format!("cannot tag epoch {epoch}: {why}"))?;
        }
        Ok(())
    }

    /// Every table's horizon, for the stores' merges.
    pub fn retention_horizons(&self) -> Vec<(String, Epoch)> {
        self.retention
            .keys()
            .map(|table| (table.clone(), self.retention_horizon(table)))
            .collect()
    }

    /// The horizon `retention` asks for now, before tags pin it.
    pub(crate) fn horizon_of_setting(&self, table: &str, retention: &Retention) -> Epoch {
        let by_count = retention.epochs.map(|n| {
            self.epoch_log
                .range(..=self.visible)
                .rev()
                .filter(|(_, r)| r.changed(table))
                .nth(n.saturating_sub(1) as usize)
                .map_or(Epoch::ZERO, |(epoch, _)| *epoch)
        });
        let by_age = retention.for_ms.map(|ms| {
            self.clock_ms
                .checked_sub(ms)
                .and_then(|cutoff| self.epoch_at(cutoff).ok())
                .unwrap_or(Epoch::ZERO)
        });
        match (by_count, by_age) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => Epoch::ZERO,
        }
    }
}
