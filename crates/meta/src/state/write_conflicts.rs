//! Write conflicts: an UPDATE or DELETE computes its rows from what it read, at some epoch
//! `R`, and publishes them later under the table's lease. Were another publish to change
//! the table between `R` and that lease, the statement's rows would overwrite a change
//! they never saw: two `UPDATE t SET v = v + 1` at once would both write the same value,
//! and one acknowledged update would be lost.
//!
//! So the allocation names the epoch each table was read at (`AllocateEpoch::read_at`), and
//! is refused while a table's last change ([`MetaState::table_changed_at`]) is newer. Once
//! the allocation holds the lease, no other publish of the table commits until this one is
//! decided, so a check at allocation is enough. The check is per table, not per key: two
//! statements changing different rows of one table conflict too, and the one refused runs
//! again (first committer wins, as under snapshot isolation).

use super::MetaState;
use crate::history::TableChangeCount;
use tessera_common::{Epoch, ReadEpochs};

impl MetaState {
    /// Why a publish of statements that read its tables at `read_at` would lose a change,
    /// if it would.
    pub(super) fn write_conflict(&self, read_at: &ReadEpochs) -> Option<String> {
        read_at.iter().find_map(|(table, &read)| {
            let changed = *self.table_changed_at.get(table)?;
            (changed > read).then(|| {
                format!(
                    "table {table:?} changed at epoch {changed}, after the statement read it at epoch {read}; run the statement again"
                )
            })
        })
    }

    /// Records `epoch` as the last change of every table it wrote rows of.
    pub(super) fn note_changed(&mut self, epoch: Epoch, changes: &[TableChangeCount]) {
        for change in changes {
            if change.upserts + change.deletes > 0 {
                self.table_changed_at.insert(change.table.clone(), epoch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::bootstrapped;
    use super::*;
    use crate::state::{MetaCommand, MetaResponse};
    use tessera_common::NodeId;

    fn allocate(state: &mut MetaState, request: u64, read_at: ReadEpochs) -> MetaResponse {
        let command = MetaCommand::AllocateEpoch {
            coordinator: NodeId(1),
            incarnation: 0,
            tables: vec!["t".into()],
            request,
            read_at,
        };
        state.apply(10 + request, command).0
    }

    fn commit(state: &mut MetaState, epoch: Epoch, upserts: u64) {
        let changes = vec![TableChangeCount {
            table: "t".into(),
            upserts,
            deletes: 0,
        }];
        let command = MetaCommand::CommitEpoch {
            epoch,
            missed: vec![],
            changes: Some(changes),
            seal: None,
            min_copies: None,
        };
        let (response, _) = state.apply(100 + epoch.0, command);
        assert_eq!(response, MetaResponse::Epoch(epoch));
    }

    fn epoch_of(response: MetaResponse) -> Epoch {
        match response {
            MetaResponse::Epoch(epoch) => epoch,
            other => panic!("expected an epoch, got {other:?}"),
        }
    }

    #[test]
    fn a_publish_of_rows_read_before_the_tables_last_change_is_refused() {
        let mut state = bootstrapped(3);
        let read = state.visible;
        // Another statement's publish changes t after this one read it.
        let other = epoch_of(allocate(&mut state, 1, ReadEpochs::new()));
        commit(&mut state, other, 10);
        let stale = ReadEpochs::from([("t".to_string(), read)]);
        let refused = allocate(&mut state, 2, stale);
        let MetaResponse::WriteConflict(reason) = refused else {
            panic!("a lost update was allowed: {refused:?}");
        };
        assert!(
            reason.contains(&format!("changed at epoch {other}"))
                && reason.contains(&format!("read it at epoch {read}")),
            "{reason}"
        );
        assert!(state.open.is_empty(), "the refusal opened no epoch");

        // Read again, after the change: allocated.
        let fresh = ReadEpochs::from([("t".to_string(), other)]);
        epoch_of(allocate(&mut state, 3, fresh));
    }

    #[test]
    fn epochs_that_write_no_rows_of_a_table_are_no_change() {
        let mut state = bootstrapped(3);
        let read = state.visible;
        let empty = epoch_of(allocate(&mut state, 1, ReadEpochs::new()));
        commit(&mut state, empty, 0);
        let read_at = ReadEpochs::from([("t".to_string(), read)]);
        epoch_of(allocate(&mut state, 2, read_at));
    }
}
