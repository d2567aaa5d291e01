//! Unit tests of the epoch log's compaction (see `crate::history_compaction`): with every
//! table's history bounded the log stays bounded, and every question it answered before
//! (an epoch's fate, a horizon, a time, a chain's head) is answered the same after.

use super::tests::{
    archived_epoch, bootstrapped, commit_at, open_epoch, set_retention, stamped, with_table,
};
use super::*;
use crate::history_compaction::{COMPACTION_INTERVAL, LOG_KEPT_EPOCHS};
use crate::seal::{EpochSeal, TableVersion};

fn keep_last(epochs: u64) -> crate::Retention {
    crate::Retention {
        epochs: Some(epochs),
        for_ms: None,
        archive: false,
    }
}

/// Publishes `count` epochs of `table` with requests from `first_request` on, each at
/// `at_ms(request)`, aborting those `aborts` picks; returns (committed, aborted).
fn publish_many(
    state: &mut MetaState,
    table: &str,
    first_request: u64,
    count: u64,
    aborts: impl Fn(u64) -> bool,
) -> (Vec<Epoch>, Vec<Epoch>) {
    let (mut committed, mut aborted) = (Vec::new(), Vec::new());
    for request in first_request..first_request + count {
        let epoch = open_epoch(state, table, request);
        if aborts(request) {
            let abort = MetaCommand::AbortEpoch {
                epoch,
                reason: "test".into(),
            };
            assert_eq!(state.apply(5, abort).0, MetaResponse::Done);
            aborted.push(epoch);
        } else {
            commit_at(state, epoch, 1_000 * request);
            committed.push(epoch);
        }
    }
    (committed, aborted)
}

fn tag(state: &mut MetaState, name: &str, epoch: Epoch) -> MetaResponse {
    let command = MetaCommand::CreateTag {
        name: name.into(),
        epoch: Some(epoch),
    };
    state.apply(30, stamped(state.clock_ms, command)).0
}

#[test]
fn with_every_tables_history_bounded_the_log_is_bounded_and_every_fate_reads_the_same() {
    let mut state = bootstrapped(3);
    set_retention(&mut state, "t", keep_last(5));
    let (committed, aborted) = publish_many(&mut state, "t", 1, 3_000, |r| r % 7 == 0);

    let point = state.history_compacted_below;
    assert!(point > Epoch::ZERO, "the log was never compacted");
    let bound = (LOG_KEPT_EPOCHS + COMPACTION_INTERVAL) as usize;
    assert!(
        state.epoch_log.len() <= bound,
        "{} records kept, above {bound}",
        state.epoch_log.len()
    );
    assert_eq!(
        state.epoch_log.keys().next(),
        committed.iter().find(|e| **e >= point)
    );
    // Every epoch's fate, below the point and above it.
    for epoch in (1..state.next_epoch.0).map(Epoch) {
        let was_aborted = aborted.contains(&epoch);
        assert_eq!(state.is_aborted(epoch), was_aborted, "epoch {epoch}");
        assert_eq!(state.is_committed(epoch), !was_aborted, "epoch {epoch}");
    }
    assert_eq!(state.aborted_count(), aborted.len() as u64);
    // Only the aborts below the point are kept explicitly.
    assert!(state.aborted.iter().all(|e| *e < point));
    // The horizon is still the fifth newest publish, and times above the point still read.
    assert_eq!(state.retention_horizon("t"), committed[committed.len() - 5]);
    let recent = committed[committed.len() - 100];
    assert_eq!(
        state.epoch_at(state.epoch_log[&recent].visible_at_ms),
        Ok(recent)
    );
    let too_old = state.epoch_at(1_500).unwrap_err();
    assert!(
        too_old.contains("no table retains its history before it"),
        "{too_old}"
    );
    // The audit log lets its publishes below the point go with the records.
    assert!(state.audit_log.iter().all(|record| match &record.event {
        crate::AuditEvent::Publish { epoch, .. } => *epoch >= point,
        _ => true,
    }));
    assert!(state.audit_log.len() <= bound + 10);
    // Nothing below the point can be tagged: no table retains it.
    let refused = tag(&mut state, "old", committed[3]);
    assert!(
        matches!(&refused, MetaResponse::Refused(why) if why.contains("no table retains its history below")),
        "{refused:?}"
    );
}

#[test]
fn a_table_with_unlimited_history_keeps_the_whole_log() {
    let mut state = with_table(bootstrapped(3), "u");
    set_retention(&mut state, "t", keep_last(1));
    let (committed, _) = publish_many(&mut state, "t", 1, 1_500, |_| false);
    assert_eq!(state.history_compacted_below, Epoch::ZERO);
    assert_eq!(state.epoch_log.len(), committed.len());
    assert_eq!(state.epoch_at(1_000), Ok(committed[0]));
    // Once `u` bounds its history too (and has a version to keep), the log is compacted
    // at the next interval.
    set_retention(&mut state, "u", keep_last(1));
    publish_many(&mut state, "u", 2_000, 1, |_| false);
    publish_many(&mut state, "t", 3_000, COMPACTION_INTERVAL, |_| false);
    assert!(state.history_compacted_below > Epoch::ZERO);
    assert!(state.epoch_log.len() <= (LOG_KEPT_EPOCHS + COMPACTION_INTERVAL) as usize);
}

#[test]
fn a_tag_holds_the_log_at_its_epoch_until_it_is_dropped() {
    let mut state = bootstrapped(3);
    let (early, _) = publish_many(&mut state, "t", 1, 50, |_| false);
    assert_eq!(
        tag(&mut state, "release_1", early[10]),
        MetaResponse::Epoch(early[10])
    );
    set_retention(&mut state, "t", keep_last(1));
    publish_many(&mut state, "t", 100, 2_000, |_| false);
    assert_eq!(state.history_compacted_below, early[10]);
    assert_eq!(state.epoch_log.keys().next(), Some(&early[10]));
    assert_eq!(state.tag_epoch("release_1"), Ok(early[10]));
    let drop = MetaCommand::DropTag {
        name: "release_1".into(),
    };
    assert_eq!(state.apply(31, drop).0, MetaResponse::Done);
    publish_many(&mut state, "t", 3_000, COMPACTION_INTERVAL, |_| false);
    assert!(state.history_compacted_below > early[10]);
}

#[test]
fn a_tables_chain_resumes_at_the_compaction_point() {
    let mut state = bootstrapped(3);
    set_retention(&mut state, "t", keep_last(3));
    let mut head = tessera_storage::digest::GENESIS;
    let mut versions = BTreeMap::new();
    for request in 1..=2_000u64 {
        let epoch = open_epoch(&mut state, "t", request);
        let version = ComponentHash::of_bytes(&request.to_le_bytes());
        let commit = MetaCommand::CommitEpoch {
            epoch,
            missed: vec![],
            changes: Some(vec![]),
            seal: Some(EpochSeal {
                versions: vec![TableVersion {
                    table: "t".into(),
                    previous: head,
                    version,
                }],
                signature: None,
                digest_format: tessera_storage::digest::DigestFormat::CURRENT,
            }),
            min_copies: None,
        };
        assert_eq!(state.apply(4, commit).0, MetaResponse::Epoch(epoch));
        versions.insert(epoch, version);
        head = version;
    }
    let point = state.history_compacted_below;
    assert!(point > Epoch::ZERO);
    let (_, &at_point) = versions.range(..point).next_back().unwrap();
    assert_eq!(state.history_head("t"), at_point);
    // The first record the log keeps follows exactly that head.
    let (_, first) = state.epoch_log.iter().next().unwrap();
    let link = &first.seal.as_ref().unwrap().versions[0];
    assert_eq!(link.previous, state.history_head("t"));
    assert_eq!(state.table_head("t"), head);
}

/// With `archive = true`, every version retention lets go is archived, and a read at an
/// epoch between two archived ones is served by the older if the table did not change in
/// between. Once the log is compacted past them, the archive records say so.
#[test]
fn reads_between_archived_epochs_below_the_compaction_point_are_still_served() {
    let mut state = with_table(bootstrapped(3), "u");
    let mut t = Vec::new();
    let mut request = 1;
    for _ in 0..3 {
        t.push(publish_many(&mut state, "t", request, 1, |_| false).0[0]);
        publish_many(&mut state, "u", request + 1, 20, |_| false);
        request += 100;
    }
    set_retention(&mut state, "u", keep_last(1));
    let archive_everything = crate::Retention {
        epochs: Some(1),
        for_ms: None,
        archive: true,
    };
    set_retention(&mut state, "t", archive_everything);
    loop {
        let due = state.archive_due();
        let Some((_, _, epoch)) = due.first() else {
            break;
        };
        let archived = archived_epoch(&state, "t", *epoch, 2, 1);
        let recorded = state.apply(40, MetaCommand::RecordArchive { archived }).0;
        assert_eq!(recorded, MetaResponse::Done);
    }
    assert_eq!(state.retention_horizon("t"), t[2]);
    publish_many(&mut state, "u", 10_000, 1_500, |_| false);
    assert_eq!(state.history_compacted_below, t[2], "held by t's horizon");

    let generation = state.tables["t"].generation;
    let archive = &state.archive["t"];
    assert_eq!(archive[&t[0]].next_change, Some(t[1]));
    assert_eq!(archive[&t[1]].next_change, Some(t[2]));
    // Between t[0] and t[1] only `u` changed: t[0]'s archive answers.
    let between = Epoch(t[0].0 + 5);
    assert_eq!(
        state.archived("t", generation, between).map(|a| a.epoch),
        Some(t[0])
    );
    assert_eq!(
        state
            .read_source("t", Epoch(t[1].0 + 5))
            .unwrap()
            .map(|a| a.epoch),
        Some(t[1])
    );
    // A forged next change is refused: only the metadata records it.
    let mut forged = archived_epoch(&state, "t", t[2], 2, 1);
    forged.next_change = Some(t[2]);
    let refused = state
        .apply(41, MetaCommand::RecordArchive { archived: forged })
        .0;
    assert!(
        matches!(&refused, MetaResponse::Refused(why) if why.contains("names no next change")),
        "{refused:?}"
    );
}
