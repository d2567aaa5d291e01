//! Sealing a publish: its tables' version ids, computed from the rows the coordinator
//! routed, and the publisher's participant's signature over the epoch's record (see
//! `tessera_meta::seal` for what the metadata checks, `tessera_storage::digest` for what
//! the ids hash).
//!
//! A participant's secret key lives in the `keys` directory of the nodes it runs: a
//! publish to a table whose owner signs must be coordinated by one of them.

use crate::error::{ReplicationError, Result};
use crate::route::Routed;
use crate::Replication;
use std::collections::BTreeMap;
use tessera_common::signing::{key_path, SigningKey};
use tessera_common::{ComponentHash, Epoch, PartitionId, RowOp};
use tessera_meta::{EpochSeal, EpochSignature, MetaState, TableChangeCount, TableVersion};
use tessera_storage::digest::{table_version_id, ChangeDigester, DigestFormat};
use tessera_storage::versions::tombstone_rows;

/// A publish's change digests, per table and partition.
pub(crate) type Digests = BTreeMap<String, BTreeMap<PartitionId, ComponentHash>>;

/// The change digest of every partition each table's rows touch, as the replicas will
/// store them at `epoch`.
pub(crate) fn digest_routed(
    state: &MetaState,
    routed: &BTreeMap<String, Routed>,
    epoch: Epoch,
) -> Result<Digests> {
    let mut digests = Digests::new();
    for (table, routed) in routed {
        let def = state
            .tables
            .get(table)
            .ok_or_else(|| tessera_storage::StorageError::UnknownTable(table.clone()))?;
        let by_table = digests.entry(table.clone()).or_default();
        let partitions: std::collections::BTreeSet<PartitionId> = routed
            .upserts
            .keys()
            .chain(routed.deletes.keys())
            .copied()
            .collect();
        let mut digester = ChangeDigester::new(def, epoch, DigestFormat::CURRENT)?;
        for partition in partitions {
            for batch in routed.upserts.get(&partition).into_iter().flatten() {
                digester.add(batch, RowOp::Upsert)?;
            }
            for keys in routed.deletes.get(&partition).into_iter().flatten() {
                digester.add(&tombstone_rows(def, keys)?, RowOp::Delete)?;
            }
            by_table.insert(partition, digester.finish());
        }
    }
    Ok(digests)
}

/// Refuses, before an epoch is taken, a publish this node could not sign: the tables'
/// owner signs its epochs, and either the publisher is not one of its users or this node
/// does not hold its key.
pub(crate) fn check_can_sign(
    node: &Replication,
    state: &MetaState,
    tables: &[String],
    publisher: Option<&str>,
) -> Result<()> {
    let signer = state
        .required_signer(tables, state.next_epoch)
        .map_err(ReplicationError::Unsignable)?;
    let Some(signer) = signer else {
        return Ok(());
    };
    let participant = state.participant_of(publisher);
    if participant.as_deref() != Some(signer) {
        return Err(ReplicationError::Unsignable(format!(
            "{}participant {signer} signs the epochs of its tables, so only its users may publish to them (publisher: {})",
            tessera_meta::DENIED,
            publisher.unwrap_or("the operator")
        )));
    }
    signing_key(node, state, signer).map(|_| ())
}

/// `participant`'s secret key from this node's keys directory, checked to be one the
/// participant registered.
fn signing_key(node: &Replication, state: &MetaState, participant: &str) -> Result<SigningKey> {
    let path = key_path(&node.settings.keys_dir, participant);
    if !path.exists() {
        return Err(ReplicationError::Unsignable(format!(
            "participant {participant} signs its epochs, and node {} does not hold its key ({}): publish through one of its nodes",
            node.id(),
            path.display()
        )));
    }
    let key = SigningKey::read(&path).map_err(ReplicationError::Unsignable)?;
    let public = key.public_hex();
    if !state
        .participant_keys(participant)
        .iter()
        .any(|k| k.key == public)
    {
        return Err(ReplicationError::Unsignable(format!(
            "node {}'s key for participant {participant} ({}, public {}) is not registered with it (ALTER PARTICIPANT {participant} ADD KEY '{public}')",
            node.id(),
            path.display(),
            tessera_meta::seal::short(&public)
        )));
    }
    Ok(key)
}

/// The seal of a publish at `epoch`: each table's version id after it, chained to the
/// table's current id in `state` (read under the epoch's lease, so no other publish of the
/// table can move it meanwhile), signed by the publisher's participant if it has a key.
pub(crate) fn seal(
    node: &Replication,
    state: &MetaState,
    epoch: Epoch,
    publisher: Option<&str>,
    digests: &Digests,
    changes: &[TableChangeCount],
) -> Result<EpochSeal> {
    let versions: Vec<TableVersion> = digests
        .iter()
        .map(|(table, digests)| {
            let previous = state.table_head(table);
            TableVersion {
                table: table.clone(),
                previous,
                version: table_version_id(table, epoch, &previous, digests),
            }
        })
        .collect();
    let participant = state.participant_of(publisher);
    let signature = match participant.as_deref() {
        Some(participant) if !state.participant_keys(participant).is_empty() => {
            let key = signing_key(node, state, participant)?;
            let message = tessera_meta::seal::signed_message(
                &state.cluster_id,
                epoch,
                publisher,
                Some(participant),
                &versions,
                DigestFormat::CURRENT,
                changes,
            );
            Some(EpochSignature {
                key: key.public_hex(),
                signature: key.sign_hex(&message),
            })
        }
        _ => None,
    };
    Ok(EpochSeal {
        versions,
        signature,
        digest_format: DigestFormat::CURRENT,
    })
}
