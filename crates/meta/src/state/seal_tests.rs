//! Unit tests of signed, chained epochs (see `crate::seal`): the state machine commits a
//! publish only with a version that follows its table's chain and, once the owner has a
//! key, only with the owner's signature; a record edited later no longer checks.

use super::access_tests::{allocate, by, consortium, epoch_of, refused};
use super::*;
use crate::seal::{signed_message, EpochSeal, EpochSignature, SignatureStatus, TableVersion};
use tessera_common::signing::SigningKey;
use tessera_storage::digest::{DigestFormat, GENESIS};

fn version(byte: u8) -> ComponentHash {
    ComponentHash([byte; 32])
}

/// A seal of table `t` moving from `previous` to `next`, signed by `key` for `user`.
fn seal(
    state: &MetaState,
    epoch: Epoch,
    user: &str,
    previous: ComponentHash,
    next: ComponentHash,
    key: Option<&SigningKey>,
) -> EpochSeal {
    let versions = vec![TableVersion {
        table: "t".into(),
        previous,
        version: next,
    }];
    let participant = state.participant_of(Some(user));
    let signature = key.map(|key| {
        let message = signed_message(
            &state.cluster_id,
            epoch,
            Some(user),
            participant.as_deref(),
            &versions,
            DigestFormat::CURRENT,
            &[],
        );
        EpochSignature {
            key: key.public_hex(),
            signature: key.sign_hex(&message),
        }
    });
    EpochSeal {
        versions,
        signature,
        digest_format: DigestFormat::CURRENT,
    }
}

fn commit_sealed(epoch: Epoch, seal: EpochSeal) -> MetaCommand {
    MetaCommand::CommitEpoch {
        epoch,
        missed: vec![],
        changes: Some(vec![]),
        seal: Some(seal),
        min_copies: None,
    }
}

fn add_key(state: &mut MetaState, index: u64, key: &SigningKey) {
    let response = state
        .apply(
            index,
            MetaCommand::AddParticipantKey {
                participant: "lab_a".into(),
                key: key.public_hex(),
            },
        )
        .0;
    assert!(matches!(response, MetaResponse::Done), "{response:?}");
}

#[test]
fn versions_must_follow_the_tables_chain() {
    let mut state = consortium();
    assert_eq!(state.table_head("t"), GENESIS);
    let epoch = epoch_of(state.apply(20, by("ada", allocate(&["t"], 1))).0);
    // A version that claims to follow anything but the head is refused, and the epoch
    // stays open.
    let forked = seal(&state, epoch, "ada", version(9), version(1), None);
    let reason = refused(state.apply(21, commit_sealed(epoch, forked)).0);
    assert!(reason.contains("the table's chain is at"), "{reason}");
    assert!(state.open.contains_key(&epoch));
    let good = seal(&state, epoch, "ada", GENESIS, version(1), None);
    epoch_of(state.apply(22, commit_sealed(epoch, good)).0);
    assert_eq!(state.table_head("t"), version(1));
    assert_eq!(
        state.epoch_log[&epoch].seal.as_ref().unwrap().versions[0].version,
        version(1)
    );

    let next = epoch_of(state.apply(23, by("ada", allocate(&["t"], 2))).0);
    let stale = seal(&state, next, "ada", GENESIS, version(2), None);
    refused(state.apply(24, commit_sealed(next, stale)).0);
    let good = seal(&state, next, "ada", version(1), version(2), None);
    epoch_of(state.apply(25, commit_sealed(next, good)).0);
    assert_eq!(state.table_head("t"), version(2));
}

#[test]
fn once_the_owner_has_a_key_only_its_signature_commits() {
    let mut state = consortium();
    let key = SigningKey::generate();
    add_key(&mut state, 20, &key);
    let epoch = epoch_of(state.apply(21, by("ada", allocate(&["t"], 1))).0);

    let unsigned = seal(&state, epoch, "ada", GENESIS, version(1), None);
    let reason = refused(state.apply(22, commit_sealed(epoch, unsigned)).0);
    assert!(reason.contains("unsigned"), "{reason}");

    let stranger = SigningKey::generate();
    let forged = seal(&state, epoch, "ada", GENESIS, version(1), Some(&stranger));
    let reason = refused(state.apply(23, commit_sealed(epoch, forged)).0);
    assert!(
        reason.contains("not registered with participant lab_a"),
        "{reason}"
    );

    // Signed for another version than the one proposed: the signature does not check.
    let mut swapped = seal(&state, epoch, "ada", GENESIS, version(1), Some(&key));
    swapped.versions[0].version = version(7);
    let reason = refused(state.apply(24, commit_sealed(epoch, swapped)).0);
    assert!(reason.contains("signature does not match"), "{reason}");
    assert_eq!(state.table_head("t"), GENESIS, "nothing moved");

    let signed = seal(&state, epoch, "ada", GENESIS, version(1), Some(&key));
    epoch_of(state.apply(25, commit_sealed(epoch, signed)).0);
    let record = state.epoch_log[&epoch].clone();
    assert_eq!(
        state.signature_status(epoch, &record),
        SignatureStatus::Valid {
            participant: "lab_a".into()
        }
    );
    // The record edited after the fact (a forged publisher) no longer checks.
    let mut edited = record;
    edited.publisher = Some("abe".into());
    assert!(matches!(
        state.signature_status(epoch, &edited),
        SignatureStatus::Invalid(_)
    ));
}

#[test]
fn the_operator_may_not_publish_unsigned_to_a_signing_owners_table() {
    let mut state = consortium();
    add_key(&mut state, 20, &SigningKey::generate());
    // A node (or any operator) can take the lease, but not commit in lab_a's name.
    let epoch = epoch_of(state.apply(21, allocate(&["t"], 1)).0);
    let unsigned = EpochSeal {
        versions: vec![TableVersion {
            table: "t".into(),
            previous: GENESIS,
            version: version(1),
        }],
        signature: None,
        digest_format: DigestFormat::CURRENT,
    };
    let reason = refused(state.apply(22, commit_sealed(epoch, unsigned)).0);
    assert!(
        reason.contains("participant lab_a signs the epochs of its tables"),
        "{reason}"
    );
    let bare = MetaCommand::CommitEpoch {
        epoch,
        missed: vec![],
        changes: Some(vec![]),
        seal: None,
        min_copies: None,
    };
    refused(state.apply(23, bare).0);
    assert!(state.open.contains_key(&epoch));
}

#[test]
fn only_the_participants_admin_registers_its_keys() {
    let mut state = consortium();
    let key = SigningKey::generate().public_hex();
    let register = |participant: &str| MetaCommand::AddParticipantKey {
        participant: participant.into(),
        key: key.clone(),
    };
    let reason = refused(state.apply(20, by("ada", register("lab_a"))).0);
    assert!(reason.contains("needs the admin role"), "{reason}");
    let reason = refused(state.apply(21, by("bob", register("lab_a"))).0);
    assert!(
        reason.contains("may not register signing keys for participant lab_a"),
        "{reason}"
    );
    let reason = refused(
        state
            .apply(
                22,
                MetaCommand::AddParticipantKey {
                    participant: "lab_a".into(),
                    key: "not hex".into(),
                },
            )
            .0,
    );
    assert!(reason.contains("64 hex digits"), "{reason}");
    assert!(matches!(
        state.apply(23, register("lab_a")).0,
        MetaResponse::Done
    ));
    assert_eq!(state.participant_keys("lab_a").len(), 1);
    assert!(state.audit_log.iter().any(|r| r.event.kind() == "add key"));
}

#[test]
fn a_corrupt_replica_is_refused_and_its_primary_moves_while_a_good_one_is_left() {
    let mut state = consortium();
    let p = PartitionId(0);
    let replicas = state.map.partitions[0].replicas.clone();
    let primary = state.map.partitions[0].primary.unwrap();
    let mark = |node: NodeId| MetaCommand::MarkCorrupt {
        node,
        partition: p,
        reason: "test".into(),
    };
    let reason = refused(state.apply(20, by("ada", mark(primary))).0);
    assert!(reason.starts_with("permission denied"), "{reason}");
    assert!(matches!(
        state.apply(21, mark(primary)).0,
        MetaResponse::Done
    ));
    let placement = &state.map.partitions[0];
    assert_eq!(placement.stale.get(&primary), Some(&Epoch::ZERO));
    assert_ne!(
        placement.primary,
        Some(primary),
        "a corrupt replica serves nothing"
    );
    for (i, node) in replicas.iter().filter(|n| **n != primary).enumerate() {
        let response = state.apply(22 + i as u64, mark(*node)).0;
        if i + 2 < replicas.len() {
            assert!(matches!(response, MetaResponse::Done));
        } else {
            let reason = refused(response);
            assert!(
                reason.contains("no other replica is up to date"),
                "{reason}"
            );
        }
    }
}
