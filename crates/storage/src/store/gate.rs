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

/// See the module docs.
#[derive(Default)]
pub(super) struct Gate(parking_lot::RwLock<()>);

/// Holds the gate shared until dropped.
pub(super) type Shared<'a> = parking_lot::RwLockReadGuard<'a, ()>;

/// Holds the gate exclusively until dropped; then hands it to those waiting.
pub(super) struct Exclusive<'a>(Option<parking_lot::RwLockWriteGuard<'a, ()>>);

impl Gate {
    /// Waits for the publishes in flight to finish, and holds off new ones.
    pub(super) fn exclusive(&self) -> Exclusive<'_> {
        Exclusive(Some(self.0.write()))
    }

    /// Waits for any exclusive section to end; others may share the gate meanwhile. The
    /// wait is counted in `tessera_store_gate_wait_seconds`.
    pub(super) fn shared(&self) -> Shared<'_> {
        if let Some(free) = self.0.try_read() {
            tessera_common::metrics::observe_seconds(
                &tessera_common::metrics::metrics().store_gate_wait_seconds,
                std::time::Duration::ZERO,
            );
            return free;
        }
        let waited_from = std::time::Instant::now();
        let shared = self.0.read();
        tessera_common::metrics::observe_seconds(
            &tessera_common::metrics::metrics().store_gate_wait_seconds,
            waited_from.elapsed(),
        );
        shared
    }
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        if let Some(guard) = self.0.take() {
            parking_lot::RwLockWriteGuard::unlock_fair(guard);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// One thread holds the gate exclusively again and again, for 20 ms at a time with no
    /// pause between (a checkpoint's merges); another asks for it shared once the first
    /// section is under way. It gets it when that section ends, not after all of them.
    #[test]
    fn a_shared_holder_is_not_starved_by_back_to_back_exclusive_sections() {
        const SECTION: Duration = Duration::from_millis(20);
        const SECTIONS: u32 = 50;
        let gate = Arc::new(Gate::default());
        let started = Arc::new(AtomicBool::new(false));
        let sections = {
            let (gate, started) = (gate.clone(), started.clone());
            std::thread::spawn(move || {
                for _ in 0..SECTIONS {
                    let _exclusive = gate.exclusive();
                    started.store(true, Ordering::SeqCst);
                    std::thread::sleep(SECTION);
                }
                Instant::now()
            })
        };
        while !started.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
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
}
