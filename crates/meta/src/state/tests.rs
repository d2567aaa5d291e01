//! Unit tests of the metadata state machine: commands driven directly, no Raft.

use super::*;

/// Node ids from numbers.
fn ids(numbers: &[u64]) -> Vec<NodeId> {
    numbers.iter().copied().map(NodeId).collect()
}
use arrow::datatypes::{DataType, Field, Schema};
use tessera_common::{QueryId, StageId};

pub(super) fn bootstrapped(nodes: u64) -> MetaState {
    let mut state = MetaState::default();
    let (response, _) = state.apply(
        1,
        MetaCommand::Bootstrap {
            cluster_id: "c".into(),
            partition_count: 8,
            replication: 3,
            hot_standby: false,
            nodes: (1..=nodes)
                .map(|id| (NodeId(id), format!("127.0.0.1:{id}")))
                .collect(),
        },
    );
    assert_eq!(response, MetaResponse::Done);
    with_table(state, "t")
}

/// A table `name` keyed by a BIGINT `k`, its only column.
pub(super) fn keyed_table(name: &str) -> TableDef {
    TableDef::new(
        name,
        Schema::new(vec![Field::new("k", DataType::Int64, false)]),
        vec!["k".into()],
        None,
    )
    .unwrap()
}

/// `state` with a table `name` keyed by a BIGINT `k`.
pub(super) fn with_table(mut state: MetaState, name: &str) -> MetaState {
    state.apply(
        2,
        MetaCommand::CreateTable {
            def: keyed_table(name),
        },
    );
    state
}

fn lineage(query: u64, from: u64, runs: Vec<(u32, u32)>) -> MetaCommand {
    MetaCommand::Lineage {
        node: NodeId(2),
        entries: vec![LineageEntry {
            query: QueryId(query),
            initiator: NodeId(1),
            exchange: StageId(3),
            bucket: 0,
            from,
            runs,
        }],
    }
}

#[test]
fn lineage_appends_runs_skips_retried_entries_and_refuses_gaps() {
    let mut state = bootstrapped(3);
    state.apply(3, lineage(9, 0, vec![(0, 2), (1, 1)]));
    // A retry of the first entry plus one more batch: only the new batch counts.
    state.apply(4, lineage(9, 0, vec![(0, 2), (1, 2)]));
    state.apply(5, lineage(9, 4, vec![(2, 1)]));
    // Position 7 would leave batches 5 and 6 unknown.
    state.apply(6, lineage(9, 7, vec![(0, 1)]));
    let inbox = &state.lineage[&QueryId(9)].inboxes[0];
    assert_eq!(inbox.runs, vec![(0, 2), (1, 2), (2, 1)]);
    assert_eq!(inbox.batches, 5);
    assert_eq!(
        (inbox.node, inbox.exchange, inbox.bucket),
        (NodeId(2), StageId(3), 0)
    );
}

#[test]
fn lineage_is_dropped_when_its_query_ends_or_its_initiator_dies() {
    let mut state = bootstrapped(3);
    state.apply(3, lineage(9, 0, vec![(0, 1)]));
    state.apply(4, lineage(10, 0, vec![(0, 1)]));
    state.apply(5, MetaCommand::LineageEnd { query: QueryId(9) });
    assert!(!state.lineage.contains_key(&QueryId(9)));
    assert!(state.lineage.contains_key(&QueryId(10)));
    // Query 10's initiator is node 1: nobody is left to replay it.
    state.apply(
        6,
        MetaCommand::SetLiveness {
            id: NodeId(1),
            alive: false,
        },
    );
    assert!(state.lineage.is_empty());
}

pub(super) fn allocate(state: &mut MetaState, coordinator: NodeId) -> Epoch {
    match allocate_as(state, coordinator, 0, 7) {
        MetaResponse::Epoch(e) => e,
        other => panic!("{other:?}"),
    }
}

pub(super) fn allocate_as(
    state: &mut MetaState,
    coordinator: NodeId,
    incarnation: u64,
    request: u64,
) -> MetaResponse {
    let command = MetaCommand::AllocateEpoch {
        coordinator,
        incarnation,
        tables: vec!["t".into()],
        request,
        read_at: Default::default(),
    };
    state.apply(3, command).0
}

#[test]
fn retried_allocations_and_commits_are_idempotent() {
    let mut state = bootstrapped(3);
    let first = allocate(&mut state, NodeId(1));
    assert_eq!(
        allocate(&mut state, NodeId(1)),
        first,
        "the same request gets the same epoch"
    );
    assert_eq!(state.open.len(), 1);
    let commit = MetaCommand::CommitEpoch {
        epoch: first,
        missed: vec![],
        changes: None,
        seal: None,
        min_copies: None,
    };
    assert_eq!(state.apply(5, commit.clone()).0, MetaResponse::Epoch(first));
    assert_eq!(state.apply(6, commit).0, MetaResponse::Epoch(first));
    let abort = state.apply(
        7,
        MetaCommand::AbortEpoch {
            epoch: first,
            reason: "late".into(),
        },
    );
    assert!(matches!(abort.0, MetaResponse::Refused(ref r) if r.contains("already committed")));
    assert!(state.is_committed(first));
}

#[test]
fn a_commit_leaves_as_many_complete_replicas_as_it_asks_for() {
    let mut state = bootstrapped(3);
    let p = PartitionId(0);
    let [first, second, third] = state.map.partitions[0].replicas[..] else {
        panic!("r = 3 on three nodes")
    };
    let commit = |epoch, missed: &[NodeId], min_copies| MetaCommand::CommitEpoch {
        epoch,
        missed: missed.iter().map(|&node| (p, node)).collect(),
        changes: None,
        seal: None,
        min_copies,
    };
    // One replica missing leaves two complete ones: enough for two copies.
    let epoch = allocate(&mut state, NodeId(1));
    let response = state.apply(3, commit(epoch, &[third], Some(2))).0;
    assert_eq!(response, MetaResponse::Epoch(epoch));
    // A second one missing the next epoch would leave one: refused when it asks for two,
    // the epoch still open and the replica not marked.
    let epoch = allocate(&mut state, NodeId(1));
    let refused = state.apply(4, commit(epoch, &[second, third], Some(2))).0;
    let MetaResponse::Refused(reason) = refused else {
        panic!("a commit leaving one complete replica of two asked for: {refused:?}")
    };
    assert!(
        reason.contains(&format!("[{first}]")) && reason.contains("needs 2"),
        "{reason}"
    );
    assert!(state.open.contains_key(&epoch));
    assert!(!state.map.partitions[0].stale.contains_key(&second));
    // Asked for one (or, as entries logged before the setting, for none), it commits.
    for min_copies in [Some(1), None] {
        let response = state
            .apply(5, commit(epoch, &[second, third], min_copies))
            .0;
        assert_eq!(response, MetaResponse::Epoch(epoch), "{min_copies:?}");
    }
    // Never more than a partition has: a single-replica partition needs its one.
    assert_eq!(copies_needed(Some(2), 1), 1);
    assert_eq!(copies_needed(Some(0), 3), 1);
}

#[test]
fn uniform_map_uses_chained_declustering() {
    let map = PartitionMap::uniform(8, 3, &ids(&[3, 1, 2, 4]));
    assert_eq!(map.partitions[0].replicas, ids(&[1, 2, 3]));
    assert_eq!(map.partitions[7].replicas, ids(&[4, 1, 2]));
    // Contiguous, uniform runs: two partitions per node.
    let originals: Vec<NodeId> = map.partitions.iter().map(|p| p.original).collect();
    assert_eq!(originals, ids(&[1, 1, 2, 2, 3, 3, 4, 4]));
}

#[test]
fn visible_epoch_waits_for_every_earlier_epoch() {
    let mut state = bootstrapped(3);
    let first = allocate(&mut state, NodeId(1));
    state.apply(
        4,
        MetaCommand::AbortEpoch {
            epoch: first,
            reason: "test".into(),
        },
    );
    let second = allocate(&mut state, NodeId(2));
    let _third = {
        // Another table would be needed for a concurrent epoch; t is leased by `second`.
        let refused = state.apply(
            5,
            MetaCommand::AllocateEpoch {
                coordinator: NodeId(3),
                incarnation: 0,
                tables: vec!["t".into()],
                request: 8,
                read_at: Default::default(),
            },
        );
        assert!(
            matches!(refused.0, MetaResponse::TableBusy(ref r) if r.contains("one writer at a time"))
        );
    };
    assert_eq!(state.visible, first);
    state.apply(
        6,
        MetaCommand::CommitEpoch {
            epoch: second,
            missed: vec![],
            changes: None,
            seal: None,
            min_copies: None,
        },
    );
    assert_eq!(state.visible, second);
    assert!(state.is_committed(second));
    assert!(!state.is_committed(first));
}

#[test]
fn a_dead_coordinator_aborts_its_open_epochs_and_moves_primaries() {
    let mut state = bootstrapped(3);
    let epoch = allocate(&mut state, NodeId(1));
    let (_, effects) = state.apply(
        7,
        MetaCommand::SetLiveness {
            id: NodeId(1),
            alive: false,
        },
    );
    assert_eq!(effects, vec![LocalEffect::Abort(epoch)]);
    assert_eq!(state.visible, epoch);
    assert!(state
        .map
        .partitions
        .iter()
        .all(|p| p.primary != Some(NodeId(1))));
    assert!(state.map.partitions.iter().all(|p| p.primary.is_some()));
}

#[test]
fn a_restarted_coordinator_releases_what_its_earlier_process_left_open() {
    let mut state = bootstrapped(3);
    let MetaResponse::Epoch(orphan) = allocate_as(&mut state, NodeId(1), 5, 1) else {
        panic!("the first process allocates");
    };
    // Killed and restarted before the failure detector noticed: still alive, and the
    // new process announces itself.
    let (response, effects) = state.apply(
        4,
        MetaCommand::Started {
            id: NodeId(1),
            incarnation: 6,
        },
    );
    assert_eq!(response, MetaResponse::Done);
    assert_eq!(effects, vec![LocalEffect::Abort(orphan)]);
    assert_eq!(
        state.visible, orphan,
        "the aborted epoch no longer holds visibility back"
    );
    // Announcing an older or the same process again changes nothing.
    for incarnation in [5, 6] {
        let (_, effects) = state.apply(
            5,
            MetaCommand::Started {
                id: NodeId(1),
                incarnation,
            },
        );
        assert!(effects.is_empty());
    }
    // The lease is free for the new process; a late request of the old one is fenced.
    let MetaResponse::Epoch(next) = allocate_as(&mut state, NodeId(1), 6, 2) else {
        panic!("the new process allocates");
    };
    assert!(next > orphan);
    assert!(
        matches!(allocate_as(&mut state, NodeId(1), 5, 3), MetaResponse::Fenced(ref r) if r.contains("restarted"))
    );
    // A restart seen first through an allocation (no announcement yet) frees the lease too.
    let (response, effects) = {
        let response = allocate_as(&mut state, NodeId(1), 7, 4);
        (response, state.is_aborted(next))
    };
    assert!(matches!(response, MetaResponse::Epoch(e) if e > next));
    assert!(effects, "the epoch of process 6 was aborted");
    assert_eq!(state.nodes[&NodeId(1)].incarnation, 7);
}

#[test]
fn users_are_created_once_altered_and_dropped_only_if_they_exist() {
    use tessera_common::auth::ScramSecret;
    let mut state = bootstrapped(3);
    let create = |name: &str, password: &str| MetaCommand::CreateUser {
        name: name.into(),
        secret: ScramSecret::new(password),
        participant: None,
    };
    assert_eq!(state.apply(3, create("ada", "one")).0, MetaResponse::Done);
    assert!(state.users["ada"].secret.verify_password("one"));
    let again = state.apply(4, create("ada", "two")).0;
    assert_eq!(
        again,
        MetaResponse::Refused("user \"ada\" already exists".into())
    );
    assert!(
        state.users["ada"].secret.verify_password("one"),
        "unchanged"
    );
    let alter = MetaCommand::AlterUser {
        name: "ada".into(),
        secret: ScramSecret::new("two"),
    };
    assert_eq!(state.apply(5, alter).0, MetaResponse::Done);
    assert!(state.users["ada"].secret.verify_password("two"));
    let drop_bob = MetaCommand::DropUser { name: "bob".into() };
    let refused = state.apply(6, drop_bob).0;
    assert_eq!(
        refused,
        MetaResponse::Refused("user \"bob\" does not exist".into())
    );
    let drop_ada = MetaCommand::DropUser { name: "ada".into() };
    assert_eq!(state.apply(7, drop_ada).0, MetaResponse::Done);
    assert!(state.users.is_empty());
}

/// `command` as the leader proposes it, stamped at `at_ms`.
pub(super) fn stamped(at_ms: u64, command: MetaCommand) -> MetaCommand {
    MetaCommand::Stamped {
        at_ms,
        command: Box::new(command),
    }
}

pub(super) fn open_epoch(state: &mut MetaState, table: &str, request: u64) -> Epoch {
    let command = MetaCommand::AllocateEpoch {
        coordinator: NodeId(1),
        incarnation: 0,
        tables: vec![table.into()],
        request,
        read_at: Default::default(),
    };
    match state.apply(3, command).0 {
        MetaResponse::Epoch(epoch) => epoch,
        other => panic!("{other:?}"),
    }
}

pub(super) fn commit_at(state: &mut MetaState, epoch: Epoch, at_ms: u64) {
    let commit = MetaCommand::CommitEpoch {
        epoch,
        missed: vec![],
        changes: Some(vec![crate::TableChangeCount {
            table: "t".into(),
            upserts: 3,
            deletes: 1,
        }]),
        seal: None,
        min_copies: None,
    };
    assert_eq!(
        state.apply(4, stamped(at_ms, commit)).0,
        MetaResponse::Epoch(epoch)
    );
}

/// A second table, so two epochs can be open at once.
fn with_table_u(state: MetaState) -> MetaState {
    with_table(state, "u")
}

#[test]
fn an_epoch_takes_the_time_it_became_visible_and_times_never_fall() {
    let mut state = with_table_u(bootstrapped(3));
    let first = open_epoch(&mut state, "t", 1);
    commit_at(&mut state, first, 1_000);
    let second = open_epoch(&mut state, "t", 2);
    let third = open_epoch(&mut state, "u", 3);
    // The third commits first, but no reader can see it until the second is decided.
    commit_at(&mut state, third, 2_000);
    assert_eq!(state.epoch_log[&third].visible_at_ms, 0);
    commit_at(&mut state, second, 3_000);
    assert_eq!(state.epoch_log[&second].visible_at_ms, 3_000);
    assert_eq!(state.epoch_log[&third].visible_at_ms, 3_000);
    assert_eq!(state.epoch_log[&first].changes[0].upserts, 3);
    assert_eq!(state.epoch_log[&first].kind, crate::EpochKind::Publish);

    let before = state.epoch_at(999).unwrap_err();
    assert!(before.contains("before the first epoch"), "{before}");
    assert_eq!(state.epoch_at(1_000), Ok(first));
    assert_eq!(
        state.epoch_at(2_500),
        Ok(first),
        "the third was not visible at 2.5 s"
    );
    assert_eq!(state.epoch_at(3_000), Ok(third));

    // A leader whose clock lags does not move the metadata's clock back.
    let fourth = open_epoch(&mut state, "t", 4);
    commit_at(&mut state, fourth, 500);
    assert_eq!(state.epoch_log[&fourth].visible_at_ms, 3_000);
    assert_eq!(state.clock_ms, 3_000);
}

#[test]
fn an_abort_makes_the_epochs_behind_it_visible_at_its_time() {
    let mut state = with_table_u(bootstrapped(3));
    let aborted = open_epoch(&mut state, "t", 1);
    let committed = open_epoch(&mut state, "u", 2);
    commit_at(&mut state, committed, 1_000);
    let abort = MetaCommand::AbortEpoch {
        epoch: aborted,
        reason: "test".into(),
    };
    state.apply(5, stamped(4_000, abort));
    assert_eq!(state.epoch_log[&committed].visible_at_ms, 4_000);
    assert!(!state.epoch_log.contains_key(&aborted));
    assert!(state.epoch_at(3_999).is_err());
}

#[test]
fn a_refused_stamped_command_leaves_the_clock_alone() {
    let mut state = bootstrapped(3);
    let refused = state.apply(3, stamped(9_000, MetaCommand::DropTag { name: "x".into() }));
    assert!(matches!(refused.0, MetaResponse::Refused(ref r) if r.contains("does not exist")));
    assert_eq!(state.clock_ms, 0);
    let nested = state.apply(
        4,
        stamped(1, stamped(2, MetaCommand::LineageEnd { query: QueryId(1) })),
    );
    assert!(matches!(nested.0, MetaResponse::Refused(_)));
}

#[test]
fn tags_pin_committed_visible_epochs_once_each() {
    let mut state = with_table_u(bootstrapped(3));
    let first = open_epoch(&mut state, "t", 1);
    commit_at(&mut state, first, 1_000);
    let aborted = open_epoch(&mut state, "t", 2);
    state.apply(
        5,
        MetaCommand::AbortEpoch {
            epoch: aborted,
            reason: "test".into(),
        },
    );
    let open = open_epoch(&mut state, "u", 3);
    let tag = |name: &str, epoch: Option<Epoch>| MetaCommand::CreateTag {
        name: name.into(),
        epoch,
    };
    assert_eq!(
        state.apply(6, stamped(5_000, tag("now", None))).0,
        MetaResponse::Epoch(first),
        "the newest committed epoch a reader sees (the visible one was aborted)"
    );
    assert_eq!(state.tags["now"].created_at_ms, 5_000);
    assert_eq!(
        state.apply(7, tag("v1", Some(first))).0,
        MetaResponse::Epoch(first)
    );
    assert_eq!(state.tag_epoch("v1"), Ok(first));
    let refusal = |response: MetaResponse| match response {
        MetaResponse::Refused(reason) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert!(refusal(state.apply(8, tag("v1", None)).0).contains("already exists"));
    assert!(refusal(state.apply(9, tag("bad", Some(aborted))).0).contains("aborted"));
    assert!(refusal(state.apply(10, tag("early", Some(open))).0).contains("not visible"));
    assert!(!state.tags.contains_key("bad") && !state.tags.contains_key("early"));
    assert_eq!(
        state
            .apply(11, MetaCommand::DropTag { name: "v1".into() })
            .0,
        MetaResponse::Done
    );
    assert!(state
        .tag_epoch("v1")
        .unwrap_err()
        .contains("does not exist"));
}

pub(super) fn publish(state: &mut MetaState, table: &str, request: u64, at_ms: u64) -> Epoch {
    let epoch = open_epoch(state, table, request);
    commit_at(state, epoch, at_ms);
    epoch
}

pub(super) fn set_retention(
    state: &mut MetaState,
    table: &str,
    retention: crate::Retention,
) -> MetaResponse {
    state
        .apply(
            20,
            MetaCommand::SetRetention {
                table: table.into(),
                retention,
            },
        )
        .0
}

#[test]
fn retention_keeps_a_tables_last_versions_and_never_falls() {
    let mut state = with_table_u(bootstrapped(3));
    let t: Vec<Epoch> = (1..=5)
        .map(|i| publish(&mut state, "t", i, i * 1_000))
        .collect();
    let u = publish(&mut state, "u", 10, 6_000);
    assert_eq!(
        state.retention_horizon("t"),
        Epoch::ZERO,
        "every epoch by default"
    );
    let keep_two = crate::Retention {
        epochs: Some(2),
        for_ms: None,
        archive: false,
    };
    assert_eq!(
        set_retention(&mut state, "t", keep_two),
        MetaResponse::Epoch(t[3])
    );
    // Counted in t's own publishes: u's epoch does not use up t's retention.
    assert_eq!(state.retention_horizon("t"), t[3]);
    assert_eq!(state.retention_horizon("u"), Epoch::ZERO);
    assert!(state.check_retained("t", u).is_ok());
    let refused = state.check_retained("t", t[2]).unwrap_err();
    assert!(
        refused.contains(&format!("oldest readable epoch is {}", t[3]))
            && refused.contains("retain_epochs = 2"),
        "{refused}"
    );
    let next = publish(&mut state, "t", 11, 7_000);
    assert_eq!(
        state.retention_horizon("t"),
        t[4],
        "it moves with new versions"
    );
    // Retaining more keeps more from now on, but history already given up stays gone.
    let keep_ten = crate::Retention {
        epochs: Some(10),
        for_ms: None,
        archive: false,
    };
    assert_eq!(
        set_retention(&mut state, "t", keep_ten),
        MetaResponse::Epoch(t[4])
    );
    assert_eq!(
        set_retention(&mut state, "t", crate::Retention::default()),
        MetaResponse::Epoch(t[4]),
        "reset to unlimited: the floor stays"
    );
    assert!(state.check_retained("t", next).is_ok());
    assert!(state.check_retained("t", t[3]).is_err());
    // Dropping the table forgets its retention: a new table of the name keeps everything.
    state.apply(21, MetaCommand::DropTable { name: "t".into() });
    assert!(!state.retention.contains_key("t"));
}

#[test]
fn retention_by_age_keeps_what_was_current_within_the_window() {
    let mut state = bootstrapped(3);
    let first = publish(&mut state, "t", 1, 1_000);
    let second = publish(&mut state, "t", 2, 5_000);
    let third = publish(&mut state, "t", 3, 9_000);
    let a_few_seconds = crate::Retention {
        epochs: None,
        for_ms: Some(6_000),
        archive: false,
    };
    // At 9 s, the window starts at 3 s, when the first epoch was current.
    assert_eq!(
        set_retention(&mut state, "t", a_few_seconds),
        MetaResponse::Epoch(first)
    );
    // Time moves on with the next command: at 12 s the window starts at 6 s.
    state.apply(
        22,
        stamped(12_000, MetaCommand::LineageEnd { query: QueryId(9) }),
    );
    assert_eq!(state.retention_horizon("t"), second);
    // With both settings a version is kept while either wants it.
    let both = crate::Retention {
        epochs: Some(3),
        for_ms: Some(6_000),
        archive: false,
    };
    set_retention(&mut state, "t", both);
    assert_eq!(state.retention_horizon("t"), second, "the floor holds");
    let _ = third;
}

#[test]
fn a_tag_pins_the_horizon_until_the_archive_holds_its_epoch() {
    let mut state = bootstrapped(6);
    let t: Vec<Epoch> = (1..=4)
        .map(|i| publish(&mut state, "t", i, i * 1_000))
        .collect();
    state.apply(
        23,
        MetaCommand::CreateTag {
            name: "release_1".into(),
            epoch: Some(t[1]),
        },
    );
    let keep_one = crate::Retention {
        epochs: Some(1),
        for_ms: None,
        archive: false,
    };
    // Retention past the tag is taken; the tag holds the horizon while it is not archived.
    assert_eq!(
        set_retention(&mut state, "t", keep_one),
        MetaResponse::Epoch(t[1])
    );
    assert_eq!(state.retention_horizon("t"), t[1], "pinned by the tag");
    let generation = state.tables["t"].generation;
    assert_eq!(
        state.archive_due(),
        vec![("t".to_string(), generation, t[1])]
    );
    assert!(
        state.read_source("t", t[0]).is_err(),
        "below the horizon, not archived"
    );
    // A record whose fragments share a node, or name a non-member, is refused.
    let mut archived = archived_epoch(&state, "t", t[1], 4, 2);
    archived.components[0].fragments[1].node = NodeId(1);
    let refused = state.apply(30, MetaCommand::RecordArchive { archived }).0;
    assert!(
        matches!(refused, MetaResponse::Refused(ref r) if r.contains("two fragments on node 1")),
        "{refused:?}"
    );
    let mut archived = archived_epoch(&state, "t", t[1], 4, 2);
    archived.components[0].fragments[5].node = NodeId(9);
    let refused = state.apply(31, MetaCommand::RecordArchive { archived }).0;
    assert!(
        matches!(refused, MetaResponse::Refused(ref r) if r.contains("not a member")),
        "{refused:?}"
    );
    assert!(state.archive.is_empty());
    // Once archived, the horizon passes the tag, and reads of it go to the archive.
    let archived = archived_epoch(&state, "t", t[1], 4, 2);
    assert_eq!(
        state
            .apply(
                32,
                MetaCommand::RecordArchive {
                    archived: archived.clone()
                }
            )
            .0,
        MetaResponse::Done
    );
    assert_eq!(state.retention_horizon("t"), t[3]);
    assert!(state.archive_due().is_empty());
    assert_eq!(state.read_source("t", t[1]).unwrap(), Some(&archived));
    assert_eq!(
        state.read_source("t", t[3]).unwrap(),
        None,
        "the replicas hold it"
    );
    // An epoch after the tag but before the next change of the table reads the same rows.
    state = with_table(state, "other");
    publish(&mut state, "other", 40, 9_000);
    let unchanged = state.visible;
    let at_tag = state.tag_epoch("release_1").unwrap();
    assert_eq!(at_tag, t[1]);
    assert!(
        state.read_source("t", t[0]).is_err(),
        "before the archived epoch"
    );
    assert!(
        state.read_source("t", t[2]).is_err(),
        "the table changed after the archived epoch"
    );
    assert!(state.read_source("t", unchanged).is_ok());
    // A fragment moves to a node holding none of its component; not onto one that does.
    let hash = archived.components[0].component.hash;
    let refused = state
        .apply(
            33,
            MetaCommand::MoveFragment {
                component: hash,
                index: 0,
                to: NodeId(2),
            },
        )
        .0;
    assert!(
        matches!(refused, MetaResponse::Refused(ref r) if r.contains("already holds")),
        "{refused:?}"
    );
    state.nodes.get_mut(&NodeId(1)).unwrap().alive = false;
    let health = state.archive_health();
    assert_eq!(
        (health.epochs, health.components, health.fewest_live),
        (1, 1, Some((5, 2)))
    );
    // Dropping the tag forgets the archived epoch; the horizon never falls.
    let horizon = state.retention_horizon("t");
    state.apply(
        34,
        MetaCommand::DropTag {
            name: "release_1".into(),
        },
    );
    assert!(state.archive.is_empty());
    assert_eq!(
        state.retention_horizon("t"),
        horizon,
        "a horizon never falls"
    );
    // A tag below the horizon is refused: its versions may be merged away.
    let refused = state.apply(
        35,
        MetaCommand::CreateTag {
            name: "too_late".into(),
            epoch: Some(t[0]),
        },
    );
    assert!(
        matches!(refused.0, MetaResponse::Refused(ref r) if r.contains("no longer retained")),
        "{refused:?}"
    );
}

/// An archive record of `table` at `epoch`: one component in partition 0, its fragments on
/// nodes 1..=k+m.
pub(super) fn archived_epoch(
    state: &MetaState,
    table: &str,
    epoch: Epoch,
    k: u32,
    m: u32,
) -> crate::archive::ArchivedEpoch {
    let component = tessera_storage::ComponentMeta {
        hash: ComponentHash::of_bytes(b"component"),
        rows: 10,
        bytes: 1000,
        min_lsn: Default::default(),
        max_lsn: Default::default(),
        min_epoch: epoch,
        max_epoch: epoch,
        unique_keys: true,
        tombstones: 0,
        layout: 0,
        superseded_at: Default::default(),
    };
    crate::archive::ArchivedEpoch {
        table: table.into(),
        generation: state.tables[table].generation,
        epoch,
        components: vec![crate::archive::ArchivedComponent {
            partition: PartitionId(0),
            component,
            data_fragments: k,
            parity_fragments: m,
            fragments: (0..k + m)
                .map(|i| crate::archive::ArchivedFragment {
                    index: i,
                    node: NodeId(i as u64 + 1),
                    hash: ComponentHash::of_bytes(&i.to_le_bytes()),
                })
                .collect(),
        }],
        next_change: None,
    }
}

/// Opens `count` epochs of table `t` in turn and aborts those `aborts` picks (by request
/// number), committing the rest; returns the aborted epochs.
pub(super) fn publish_aborting(
    state: &mut MetaState,
    count: u64,
    aborts: impl Fn(u64) -> bool,
) -> Vec<Epoch> {
    let mut aborted = Vec::new();
    for request in 0..count {
        let epoch = open_epoch(state, "t", 100 + request);
        if aborts(request) {
            state.apply(
                5,
                MetaCommand::AbortEpoch {
                    epoch,
                    reason: "test".into(),
                },
            );
            aborted.push(epoch);
        } else {
            commit_at(state, epoch, 1_000 + request);
        }
    }
    aborted
}

/// Every applied entry publishes a copy of the state to its readers: the copy must share
/// the histories (every epoch, abort and audited change ever made) rather than copy them,
/// or each entry would cost more the longer the cluster has lived (`tessera bench meta`).
#[test]
fn a_copy_of_the_state_shares_its_histories() {
    let mut state = bootstrapped(3);
    publish_aborting(&mut state, 200, |request| request % 10 == 0);
    assert_eq!(state.epoch_log.len(), 180);
    assert_eq!(state.aborted_count(), 20);
    let copy = state.clone();
    assert!(copy.epoch_log.ptr_eq(&state.epoch_log));
    assert!(copy.aborted.ptr_eq(&state.aborted));
    assert!(copy.audit_log.ptr_eq(&state.audit_log));
    // A change to one leaves the other as it was.
    let mut changed = copy.clone();
    let epoch = open_epoch(&mut changed, "t", 999);
    commit_at(&mut changed, epoch, 5_000);
    assert_eq!(changed.epoch_log.len(), 181);
    assert_eq!(state.epoch_log.len(), 180);
}

/// The aborted set holds only the aborts the epoch log cannot tell yet (those above the
/// visible epoch): it stays as small as the epochs in flight however many were aborted,
/// and every epoch's fate reads the same.
#[test]
fn the_aborted_set_keeps_only_the_epochs_in_flight() {
    let mut state = with_table(bootstrapped(3), "held");
    // An epoch held open while later ones are aborted: their aborts wait above visible.
    let held = open_epoch(&mut state, "held", 1);
    let aborted = publish_aborting(&mut state, 300, |request| request % 3 == 0);
    assert!(state.visible < held);
    assert_eq!(
        state.aborted.len(),
        100,
        "above the held epoch, nothing is told yet"
    );
    commit_at(&mut state, held, 2_000);
    assert_eq!(
        state.visible.next(),
        state.next_epoch,
        "every epoch decided"
    );
    assert!(state.aborted.is_empty(), "{:?}", state.aborted);
    assert_eq!(state.aborted_count(), 100);
    for epoch in (1..state.next_epoch.0).map(Epoch) {
        let was_aborted = aborted.contains(&epoch);
        assert_eq!(state.is_aborted(epoch), was_aborted, "epoch {epoch}");
        assert_eq!(state.is_committed(epoch), !was_aborted, "epoch {epoch}");
    }
    // Aborting one again for the same reason (a retry) is done; for another, it names the
    // first reason.
    let abort_again = |state: &mut MetaState, reason: &str| {
        state
            .apply(
                6,
                MetaCommand::AbortEpoch {
                    epoch: aborted[7],
                    reason: reason.into(),
                },
            )
            .0
    };
    let first_reason = state.abort_reasons[&aborted[7]].clone();
    assert_eq!(abort_again(&mut state, &first_reason), MetaResponse::Done);
    assert_eq!(
        abort_again(&mut state, "another"),
        MetaResponse::Fenced(first_reason)
    );
    assert_eq!(
        state.recent_aborted(5, 10_000),
        aborted[aborted.len() - 5..].to_vec()
    );
}

/// A state from before the epoch log recorded commits: its older epochs are committed
/// though the log lacks them, so aborts are told by the log only from its first epoch.
#[test]
fn a_state_older_than_the_epoch_log_keeps_its_earlier_aborts() {
    let mut state = bootstrapped(3);
    publish_aborting(&mut state, 10, |request| request == 4);
    // As such a state loads: no log, the aborts all in the set.
    let mut old = state.clone();
    old.epoch_log = Default::default();
    old.aborts_derived_from = Epoch::ZERO;
    old.aborts_derived = 0;
    old.aborted = state.aborted.clone();
    for epoch in (1..state.next_epoch.0).map(Epoch) {
        if state.is_aborted(epoch) {
            old.aborted.insert(epoch);
        }
    }
    let before: Vec<bool> = (1..old.next_epoch.0)
        .map(|e| old.is_committed(Epoch(e)))
        .collect();
    let epoch = open_epoch(&mut old, "t", 500);
    commit_at(&mut old, epoch, 5_000);
    let after: Vec<bool> = (1..epoch.0).map(|e| old.is_committed(Epoch(e))).collect();
    assert_eq!(before, after, "no older epoch changed its fate");
    assert_eq!(
        old.aborts_derived_from, epoch,
        "the log tells from its first epoch"
    );
    assert_eq!(old.aborted_count(), 1);
}
