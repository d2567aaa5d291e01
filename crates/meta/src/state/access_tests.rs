//! Unit tests of participants, roles, table ownership, hand-over and the audit log, driven
//! through the state machine's commands (see `crate::access`).

use super::*;
use crate::access::DENIED;
use tessera_common::auth::ScramSecret;

/// A 3-node cluster with participants lab_a and lab_b; users ada (lab_a, writer), abe
/// (lab_a, reader), bob (lab_b, writer) and root (a cluster administrator); table `t`
/// created by ada, so lab_a's.
pub(super) fn consortium() -> MetaState {
    let mut state = MetaState::default();
    let mut index = 0;
    let mut apply = |state: &mut MetaState, command: MetaCommand| {
        index += 1;
        let (response, _) = state.apply(index, command);
        assert!(
            matches!(response, MetaResponse::Done),
            "setting up: {response:?}"
        );
    };
    apply(
        &mut state,
        MetaCommand::Bootstrap {
            cluster_id: "c".into(),
            partition_count: 4,
            replication: 3,
            hot_standby: false,
            nodes: (1..=3)
                .map(|id| (NodeId(id), format!("127.0.0.1:{id}")))
                .collect(),
        },
    );
    for name in ["lab_a", "lab_b"] {
        apply(
            &mut state,
            MetaCommand::CreateParticipant { name: name.into() },
        );
    }
    for (user, participant) in [
        ("ada", Some("lab_a")),
        ("abe", Some("lab_a")),
        ("bob", Some("lab_b")),
        ("root", None),
    ] {
        apply(
            &mut state,
            MetaCommand::CreateUser {
                name: user.into(),
                secret: ScramSecret::new("pw"),
                participant: participant.map(str::to_string),
            },
        );
    }
    for user in ["ada", "bob"] {
        apply(
            &mut state,
            MetaCommand::Grant {
                user: user.into(),
                role: Role::Writer,
            },
        );
    }
    apply(&mut state, by("ada", create_table("t")));
    state
}

pub(super) fn by(user: &str, command: MetaCommand) -> MetaCommand {
    MetaCommand::As {
        user: user.into(),
        command: Box::new(command),
    }
}

fn create_table(name: &str) -> MetaCommand {
    MetaCommand::CreateTable {
        def: super::tests::keyed_table(name),
    }
}

pub(super) fn allocate(tables: &[&str], request: u64) -> MetaCommand {
    MetaCommand::AllocateEpoch {
        coordinator: NodeId(1),
        incarnation: 0,
        tables: tables.iter().map(|t| t.to_string()).collect(),
        request,
        read_at: Default::default(),
    }
}

pub(super) fn commit(epoch: Epoch) -> MetaCommand {
    MetaCommand::CommitEpoch {
        epoch,
        missed: vec![],
        changes: Some(vec![]),
        seal: None,
        min_copies: None,
    }
}

/// The refusal's reason, or a panic naming what was answered instead.
pub(super) fn refused(response: MetaResponse) -> String {
    match response {
        MetaResponse::Refused(reason) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

pub(super) fn epoch_of(response: MetaResponse) -> Epoch {
    match response {
        MetaResponse::Epoch(epoch) => epoch,
        other => panic!("expected an epoch, got {other:?}"),
    }
}

#[test]
fn a_members_table_belongs_to_its_participant_and_only_its_writers_publish() {
    let mut state = consortium();
    assert_eq!(state.table_owner("t"), Some("lab_a"));
    let next = state.next_epoch;

    let reason = refused(state.apply(20, by("bob", allocate(&["t"], 1))).0);
    assert!(reason.starts_with(DENIED), "{reason}");
    assert!(
        reason.contains("user bob (participant lab_b")
            && reason.contains("participant lab_a owns it"),
        "names the user and the owner: {reason}"
    );
    let reason = refused(state.apply(21, by("abe", allocate(&["t"], 2))).0);
    assert!(reason.contains("needs the writer role"), "{reason}");
    assert_eq!(state.next_epoch, next, "a refused publish takes no epoch");
    assert!(state.open.is_empty());

    let epoch = epoch_of(state.apply(22, by("ada", allocate(&["t"], 3))).0);
    assert_eq!(state.open[&epoch].publisher.as_deref(), Some("ada"));
    epoch_of(state.apply(23, commit(epoch)).0);
    let record = &state.epoch_log[&epoch];
    assert_eq!(record.publisher.as_deref(), Some("ada"));
    assert_eq!(record.participant.as_deref(), Some("lab_a"));

    // The operator and cluster administrators may publish anywhere.
    epoch_of(state.apply(24, allocate(&["t"], 4)).0);
    let reason = refused(state.apply(25, by("nobody", allocate(&["t"], 5))).0);
    assert_eq!(reason, "user \"nobody\" does not exist");
}

#[test]
fn a_table_the_operator_created_has_no_owner_until_handed_over() {
    let mut state = consortium();
    assert_eq!(
        state.apply(30, create_table("shared")).0,
        MetaResponse::Done
    );
    assert_eq!(state.table_owner("shared"), None);
    let reason = refused(state.apply(31, by("ada", allocate(&["shared"], 1))).0);
    assert!(reason.contains("it has no owner"), "{reason}");
    epoch_of(state.apply(32, by("root", allocate(&["shared"], 2))).0);
}

#[test]
fn a_hand_over_aborts_the_old_owners_open_epoch_in_the_same_entry() {
    let mut state = consortium();
    let old = epoch_of(state.apply(40, by("ada", allocate(&["t"], 1))).0);

    // lab_a's admin hands the table over; a writer may not.
    let reason = refused(
        state
            .apply(
                41,
                by(
                    "ada",
                    MetaCommand::SetTableOwner {
                        table: "t".into(),
                        owner: "lab_b".into(),
                    },
                ),
            )
            .0,
    );
    assert!(reason.contains("needs the admin role"), "{reason}");
    assert_eq!(state.table_owner("t"), Some("lab_a"));
    assert!(state.open.contains_key(&old));

    let (response, effects) = state.apply(
        42,
        MetaCommand::SetTableOwner {
            table: "t".into(),
            owner: "lab_b".into(),
        },
    );
    assert_eq!(response, MetaResponse::Done);
    assert_eq!(state.table_owner("t"), Some("lab_b"));
    assert_eq!(effects, vec![LocalEffect::Abort(old)]);
    assert!(state.is_aborted(old));

    // The old owner's commit is fenced, saying why; its retry is refused.
    match state.apply(43, commit(old)).0 {
        MetaResponse::Fenced(reason) => {
            assert!(
                reason.contains("handed over to participant lab_b"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(
        !state.epoch_log.contains_key(&old),
        "nothing of it committed"
    );
    // A coordinator that failed to prepare it and aborts it itself is told why too.
    let abort = MetaCommand::AbortEpoch {
        epoch: old,
        reason: "a replica refused".into(),
    };
    match state.apply(43, abort).0 {
        MetaResponse::Fenced(reason) => {
            assert!(
                reason.contains("handed over to participant lab_b"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    let reason = refused(state.apply(44, by("ada", allocate(&["t"], 2))).0);
    assert!(reason.contains("participant lab_b owns it"), "{reason}");
    // The new owner publishes at once: the lease is free.
    let new = epoch_of(state.apply(45, by("bob", allocate(&["t"], 3))).0);
    epoch_of(state.apply(46, commit(new)).0);
    assert_eq!(state.epoch_log[&new].participant.as_deref(), Some("lab_b"));
}

#[test]
fn a_hand_over_keeps_epochs_its_publishers_may_still_write() {
    let mut state = consortium();
    // A placement change (the operator's) leases the table too; it survives.
    let placement = epoch_of(state.apply(50, allocate(&["t"], 1)).0);
    let (response, effects) = state.apply(
        51,
        MetaCommand::SetTableOwner {
            table: "t".into(),
            owner: "lab_b".into(),
        },
    );
    assert_eq!(response, MetaResponse::Done);
    assert!(effects.is_empty(), "{effects:?}");
    assert!(state.open.contains_key(&placement));
    let reason = refused(state.apply(52, create_table("t").clone()).0);
    assert!(reason.contains("already exists"));
    let missing = MetaCommand::SetTableOwner {
        table: "t".into(),
        owner: "lab_z".into(),
    };
    assert_eq!(
        refused(state.apply(53, missing).0),
        "participant \"lab_z\" does not exist"
    );
}

#[test]
fn members_manage_only_their_own_participant() {
    let mut state = consortium();
    let create = |name: &str, participant: Option<&str>| MetaCommand::CreateUser {
        name: name.into(),
        secret: ScramSecret::new("pw"),
        participant: participant.map(str::to_string),
    };
    // ada is a writer, not an admin: she may not add users.
    let reason = refused(state.apply(60, by("ada", create("amy", Some("lab_a")))).0);
    assert!(reason.contains("needs the admin role"), "{reason}");
    state.apply(
        61,
        MetaCommand::Grant {
            user: "ada".into(),
            role: Role::Admin,
        },
    );
    assert_eq!(
        state.apply(62, by("ada", create("amy", Some("lab_a")))).0,
        MetaResponse::Done
    );
    assert_eq!(state.users["amy"].roles, BTreeSet::from([Role::Reader]));
    let reason = refused(state.apply(63, by("ada", create("bea", Some("lab_b")))).0);
    assert!(
        reason.contains("may not manage the users of participant lab_b"),
        "{reason}"
    );
    let reason = refused(state.apply(64, by("ada", create("god", None))).0);
    assert!(
        reason.contains("may not manage cluster administrators"),
        "{reason}"
    );
    let grant_bob = MetaCommand::Grant {
        user: "bob".into(),
        role: Role::Admin,
    };
    let reason = refused(state.apply(65, by("ada", grant_bob)).0);
    assert!(reason.contains("participant lab_b"), "{reason}");
    let reason = refused(
        state
            .apply(
                66,
                by("ada", MetaCommand::CreateParticipant { name: "x".into() }),
            )
            .0,
    );
    assert!(reason.contains("only a cluster administrator"), "{reason}");
    let reason = refused(
        state
            .apply(67, by("ada", MetaCommand::Decommission { id: NodeId(3) }))
            .0,
    );
    assert!(
        reason.contains("may not change the cluster's nodes"),
        "{reason}"
    );

    // Anyone changes their own password; bob may not change ada's.
    let password = |name: &str| MetaCommand::AlterUser {
        name: name.into(),
        secret: ScramSecret::new("new"),
    };
    assert_eq!(
        state.apply(68, by("bob", password("bob"))).0,
        MetaResponse::Done
    );
    assert!(refused(state.apply(69, by("bob", password("ada"))).0).starts_with(DENIED));

    // A participant with users or tables cannot be dropped.
    let reason = refused(
        state
            .apply(
                70,
                MetaCommand::DropParticipant {
                    name: "lab_b".into(),
                },
            )
            .0,
    );
    assert!(reason.contains("still has user \"bob\""), "{reason}");
    let reason = refused(
        state
            .apply(
                71,
                MetaCommand::DropParticipant {
                    name: "lab_a".into(),
                },
            )
            .0,
    );
    assert!(reason.contains("still owns table \"t\""), "{reason}");

    // Revoking reader leaves a member who may do nothing.
    state.apply(
        72,
        MetaCommand::Revoke {
            user: "abe".into(),
            role: Role::Reader,
        },
    );
    assert!(state.may(Some("abe"), Action::Read).is_err());
    assert!(state.may(Some("bob"), Action::Read).is_ok());
    assert!(state.may(None, Action::Read).is_ok());
}

#[test]
fn the_audit_log_records_who_did_what_in_order() {
    let mut state = consortium();
    let epoch = epoch_of(state.apply(80, by("ada", allocate(&["t"], 1))).0);
    epoch_of(state.apply(81, commit(epoch)).0);
    state.apply(
        82,
        MetaCommand::Stamped {
            at_ms: 1_700_000_000_000,
            command: Box::new(MetaCommand::SetTableOwner {
                table: "t".into(),
                owner: "lab_b".into(),
            }),
        },
    );
    let kinds: Vec<(&str, Option<&str>)> = state
        .audit_log
        .iter()
        .map(|r| (r.event.kind(), r.by.as_deref()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("create participant", None),
            ("create participant", None),
            ("create user", None),
            ("create user", None),
            ("create user", None),
            ("create user", None),
            ("grant", None),
            ("grant", None),
            ("create table", Some("ada")),
            ("publish", Some("ada")),
            ("hand over", None),
        ]
    );
    let last = state.audit_log.last().unwrap();
    assert_eq!(last.at_ms, 1_700_000_000_000);
    assert_eq!(
        last.event.to_string(),
        "handed table t over from participant lab_a to participant lab_b"
    );
    // A refused command leaves no trace.
    let before = state.audit_log.len();
    state.apply(83, by("abe", MetaCommand::DropTable { name: "t".into() }));
    assert_eq!(state.audit_log.len(), before);
}
