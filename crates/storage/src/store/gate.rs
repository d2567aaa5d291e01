//! The store's gate: publishes and prepares hold it shared, so they group-commit together;
//! checkpoints, merges, bulk publishes, transfers and DDL hold it exclusively, so they see
//! no publish half done.
//!
//! An exclusive section hands the gate over fairly when it ends: to the prepares and
//! publishes waiting for it, if there are any, before the next exclusive section may take
//! it. A checkpoint merges its crowded partitions one at a time, each under the gate on its
//! own, so that a prepare waits for one partition's merge. With a lock that lets the
//! releasing thread take it straight back (std's: it re-acquires before the woken reader has
//! run), a prepare arriving during the merges waited for all of them: at SF 10, 64
//! partitions of lineitem merging back to back held a one-node cluster's prepare past its
//! progress deadline.

use std::time::{Duration, Instant};

/// See the module docs.
#[derive(Default)]
pub(super) struct Gate {
    lock: parking_lot::RwLock<()>,
    /// What holds the gate exclusively now: a prepare that waits long names it in its
    /// warning.
    holder: parking_lot::Mutex<Option<Holder>>,
}

/// What holds the gate exclusively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holder {
    /// A flush putting its components in place, or trimming the log after one.
    Flush,
    /// A merge putting its output in place of its inputs.
    Merge,
    /// A publish too large for the log, written straight to components.
    BulkPublish,
    /// A standby's partitions promoted to primary, or a standby replaying its log.
    Promotion,
    /// A standby installing the components its primary shipped.
    Install,
    /// A new replica installing the partitions it copied.
    Copy,
    /// A table created, changed or dropped.
    Ddl,
    /// A tag made or dropped.
    Tag,
}

impl Holder {
    /// What the holder is doing, for a person: "a merge".
    pub(super) fn describe(self) -> &'static str {
        match self {
            Holder::Flush => "a flush",
            Holder::Merge => "a merge",
            Holder::BulkPublish => "a bulk publish",
            Holder::Promotion => "a promotion or standby replay",
            Holder::Install => "a standby's install of shipped components",
            Holder::Copy => "a new replica's copy",
            Holder::Ddl => "a table's creation, change or drop",
            Holder::Tag => "a tag's creation or drop",
        }
    }
}

/// How long [`Gate::shared_timed`] waited, and behind what.
#[derive(Debug, Clone, Copy)]
pub(super) struct Waited {
    pub(super) waited: Duration,
    /// What held the gate exclusively when the wait began (`None`: it was taken or let go
    /// at that moment).
    pub(super) behind: Option<Holder>,
}

/// Holds the gate shared until dropped.
pub(super) type Shared<'a> = parking_lot::RwLockReadGuard<'a, ()>;

/// Holds the gate exclusively until dropped; then hands it to those waiting.
pub(super) struct Exclusive<'a> {
    guard: Option<parking_lot::RwLockWriteGuard<'a, ()>>,
    holder: &'a parking_lot::Mutex<Option<Holder>>,
}

impl Gate {
    /// Waits for the publishes in flight to finish, and holds off new ones; `holder` says
    /// what for.
    pub(super) fn exclusive(&self, holder: Holder) -> Exclusive<'_> {
        let guard = self.lock.write();
        *self.holder.lock() = Some(holder);
        Exclusive {
            guard: Some(guard),
            holder: &self.holder,
        }
    }

    /// Waits for any exclusive section to end; others may share the gate meanwhile.
    pub(super) fn shared(&self) -> Shared<'_> {
        self.shared_timed().0
    }

    /// [`Gate::shared`], saying how long it waited and behind what. The wait is counted in
    /// `tessera_store_gate_wait_seconds`.
    pub(super) fn shared_timed(&self) -> (Shared<'_>, Waited) {
        let observe = |waited| {
            tessera_common::metrics::observe_seconds(
                &tessera_common::metrics::metrics().store_gate_wait_seconds,
                waited,
            )
        };
        if let Some(free) = self.lock.try_read() {
            observe(Duration::ZERO);
            let waited = Waited {
                waited: Duration::ZERO,
                behind: None,
            };
            return (free, waited);
        }
        let behind = *self.holder.lock();
        let waited_from = Instant::now();
        let shared = self.lock.read();
        let waited = waited_from.elapsed();
        observe(waited);
        (shared, Waited { waited, behind })
    }
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.take() {
            *self.holder.lock() = None;
            parking_lot::RwLockWriteGuard::unlock_fair(guard);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Holds `gate` exclusively for `holder` on another thread, `sections` times for
    /// `section` each with no pause between; returns once the first section is under way.
    /// The thread answers when its last section ended.
    fn hold_in_sections(
        gate: &Arc<Gate>,
        holder: Holder,
        sections: u32,
        section: Duration,
    ) -> std::thread::JoinHandle<Instant> {
        let started = Arc::new(AtomicBool::new(false));
        let handle = {
            let (gate, started) = (gate.clone(), started.clone());
            std::thread::spawn(move || {
                for _ in 0..sections {
                    let _exclusive = gate.exclusive(holder);
                    started.store(true, Ordering::SeqCst);
                    std::thread::sleep(section);
                }
                Instant::now()
            })
        };
        while !started.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        handle
    }

    /// One thread holds the gate exclusively again and again, for 20 ms at a time with no
    /// pause between (a checkpoint's merges); another asks for it shared once the first
    /// section is under way. It gets it when that section ends, not after all of them.
    #[test]
    fn a_shared_holder_is_not_starved_by_back_to_back_exclusive_sections() {
        const SECTION: Duration = Duration::from_millis(20);
        const SECTIONS: u32 = 50;
        let gate = Arc::new(Gate::default());
        let sections = hold_in_sections(&gate, Holder::Merge, SECTIONS, SECTION);
        let asked = Instant::now();
        drop(gate.shared());
        let waited = asked.elapsed();
        let sections_ended = sections.join().unwrap();
        assert!(
            sections_ended.saturating_duration_since(asked) > SECTION * 10,
            "the shared holder got the gate between sections, with many left"
        );
        assert!(
            waited < SECTION * 10,
            "a shared holder waited {waited:?}, through {} of the {SECTIONS} sections",
            waited.as_millis() / SECTION.as_millis()
        );
    }

    /// A shared holder that waits names what held the gate when it began to wait; one that
    /// did not wait names nothing.
    #[test]
    fn a_shared_holder_that_waited_names_the_exclusive_section() {
        const SECTION: Duration = Duration::from_millis(200);
        let gate = Arc::new(Gate::default());
        let (free, waited) = gate.shared_timed();
        assert!(waited.behind.is_none() && waited.waited.is_zero());
        drop(free);
        let section = hold_in_sections(&gate, Holder::Install, 1, SECTION);
        let (_shared, waited) = gate.shared_timed();
        section.join().unwrap();
        assert_eq!(waited.behind, Some(Holder::Install));
        assert!(waited.waited >= SECTION / 2, "{waited:?}");
        assert_eq!(*gate.holder.lock(), None);
    }
}
