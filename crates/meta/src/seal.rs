//! Signed, verifiable epochs (Pond's version ids and signed updates).
//!
//! Each publish commits with a [`EpochSeal`]: per table it touched, the table's version id
//! after it and the id it follows (see `tessera_storage::digest`), so each table's ids form
//! a hash chain, and, when the publisher's participant has registered a public key, the
//! participant's ed25519 signature over the epoch's record ([`signed_message`]).
//!
//! The state machine checks both before it commits: a version that does not follow the
//! table's chain, a missing or wrong signature, are refused, so no node can commit a record
//! in a participant's name without its key. What is committed can be checked again later
//! by anyone holding the public keys ([`MetaState::signature_status`]): a record edited
//! after the fact no longer matches its signature.

use crate::access::{RegisteredKey, DENIED};
use crate::history::{EpochRecord, TableChangeCount};
use crate::state::MetaState;
use serde::{Deserialize, Serialize};
use tessera_common::{ComponentHash, Epoch};
use tessera_storage::digest::{DigestFormat, GENESIS};

/// One table's link in its version chain.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TableVersion {
    pub table: String,
    /// The version id the table had before this epoch.
    pub previous: ComponentHash,
    /// The version id after it.
    pub version: ComponentHash,
}

/// A participant's signature over an epoch's record.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EpochSignature {
    /// The public key it checks against (hex), one registered with the participant.
    pub key: String,
    /// The ed25519 signature (hex).
    pub signature: String,
}

/// What a publish commits with: its tables' new version ids, and its signature if the
/// publisher's participant signs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EpochSeal {
    pub versions: Vec<TableVersion>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<EpochSignature>,
    /// The form its change digests were made in; seals from before the form was recorded
    /// used the first one.
    #[serde(default = "first_format", skip_serializing_if = "is_first_format")]
    pub digest_format: DigestFormat,
}

fn first_format() -> DigestFormat {
    DigestFormat::Rows
}

fn is_first_format(format: &DigestFormat) -> bool {
    *format == DigestFormat::Rows
}

/// The bytes a participant signs for an epoch: everything its record says about the
/// publish (not the commit time, which the metadata assigns later). The digest format is
/// signed too (where it is not the first, so older signatures still check): a record whose
/// format was changed is then a forged record, not a replica that hashes wrongly.
pub fn signed_message(
    cluster_id: &str,
    epoch: Epoch,
    publisher: Option<&str>,
    participant: Option<&str>,
    versions: &[TableVersion],
    digest_format: DigestFormat,
    changes: &[TableChangeCount],
) -> Vec<u8> {
    #[derive(Serialize)]
    struct Signed<'a> {
        domain: &'static str,
        cluster: &'a str,
        epoch: Epoch,
        publisher: Option<&'a str>,
        participant: Option<&'a str>,
        versions: &'a [TableVersion],
        #[serde(skip_serializing_if = "is_first_format")]
        digest_format: DigestFormat,
        changes: &'a [TableChangeCount],
    }
    serde_json::to_vec(&Signed {
        domain: "tessera epoch record v1",
        cluster: cluster_id,
        epoch,
        publisher,
        participant,
        versions,
        digest_format,
        changes,
    })
    .expect("a record always serializes")
}

/// Whether an epoch's record carries a good signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignatureStatus {
    /// Signed by the participant, with a key registered for it.
    Valid { participant: String },
    /// Not signed: a placement change, the operator's publish, or a participant with no key.
    Unsigned,
    /// Signed, but the signature does not check (the record was changed after it was
    /// signed, or the key is not the participant's); says why.
    Invalid(String),
    /// A participant with a key published it, yet it carries no signature.
    Missing { participant: String },
}

impl std::fmt::Display for SignatureStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SignatureStatus::Valid { participant } => write!(f, "valid ({participant})"),
            SignatureStatus::Unsigned => f.write_str("unsigned"),
            SignatureStatus::Invalid(why) => write!(f, "INVALID: {why}"),
            SignatureStatus::Missing { participant } => {
                write!(f, "MISSING: participant {participant} signs its epochs")
            }
        }
    }
}

impl MetaState {
    /// The version id `table` has now (the genesis id before its first publish).
    pub fn table_head(&self, table: &str) -> ComponentHash {
        self.table_heads.get(table).copied().unwrap_or(GENESIS)
    }

    /// The public keys registered for `participant`, oldest first.
    pub fn participant_keys(&self, participant: &str) -> &[RegisteredKey] {
        self.participants
            .get(participant)
            .map_or(&[], |p| p.keys.as_slice())
    }

    /// The participant whose signature a publish of `tables` at `epoch` needs: an owner of
    /// one of them that had registered a key by then. An error if the tables have two
    /// such owners (no one signature can speak for both).
    pub fn required_signer(&self, tables: &[String], epoch: Epoch) -> Result<Option<&str>, String> {
        let mut signers = tables.iter().filter_map(|table| {
            let owner = self.table_owner(table)?;
            let signs = self.participant_keys(owner).iter().any(|k| k.from <= epoch);
            signs.then_some((table, owner))
        });
        let Some((table, owner)) = signers.next() else {
            return Ok(None);
        };
        if let Some((other_table, other)) = signers.find(|(_, o)| *o != owner) {
            return Err(format!(
                "tables {table:?} and {other_table:?} are owned by participants {owner} and {other}, which each sign their own epochs: publish them separately"
            ));
        }
        Ok(Some(owner))
    }

    /// Checks a publish's seal (if it has one) against the tables' chains and the key of
    /// the participant that must sign it, then moves the chains on. Nothing changes if it
    /// is refused.
    pub(crate) fn apply_seal(
        &mut self,
        epoch: Epoch,
        open: &crate::OpenEpoch,
        changes: &[TableChangeCount],
        seal: Option<&EpochSeal>,
    ) -> Result<(), String> {
        let publisher = open.publisher.as_deref();
        let participant = self.participant_of(publisher);
        let signer = self.required_signer(&open.tables, epoch)?;
        if let Some(signer) = signer {
            if participant.as_deref() != Some(signer) {
                return Err(format!(
                    "{DENIED}participant {signer} signs the epochs of its tables, so only its users may publish to them (publisher: {})",
                    publisher.unwrap_or("the operator")
                ));
            }
        }
        let Some(seal) = seal else {
            return match signer {
                Some(signer) => Err(format!(
                    "epoch {epoch} is unsigned, but participant {signer} signs its epochs"
                )),
                None => Ok(()),
            };
        };
        let sealed: Vec<&str> = seal.versions.iter().map(|v| v.table.as_str()).collect();
        let mut leased: Vec<&str> = open.tables.iter().map(String::as_str).collect();
        leased.sort_unstable();
        let mut sorted = sealed.clone();
        sorted.sort_unstable();
        if sorted != leased {
            return Err(format!(
                "epoch {epoch}'s seal covers tables {sealed:?}, but it leased {leased:?}"
            ));
        }
        for link in &seal.versions {
            let head = self.table_head(&link.table);
            if link.previous != head {
                return Err(format!(
                    "epoch {epoch}'s version of table {:?} follows {}, but the table's chain is at {head}",
                    link.table, link.previous
                ));
            }
        }
        match (signer, &seal.signature) {
            (Some(signer), None) => {
                return Err(format!(
                    "epoch {epoch} is unsigned, but participant {signer} signs its epochs: publish through a node holding its key"
                ));
            }
            (_, Some(signature)) => {
                let Some(participant) = participant.as_deref() else {
                    return Err(format!(
                        "epoch {epoch} is signed, but its publisher belongs to no participant"
                    ));
                };
                let message = signed_message(
                    &self.cluster_id,
                    epoch,
                    publisher,
                    Some(participant),
                    &seal.versions,
                    seal.digest_format,
                    changes,
                );
                self.check_signature(participant, &message, signature)
                    .map_err(|why| format!("epoch {epoch}'s signature is refused: {why}"))?;
            }
            (None, None) => {}
        }
        for link in &seal.versions {
            self.table_heads.insert(link.table.clone(), link.version);
        }
        Ok(())
    }

    fn check_signature(
        &self,
        participant: &str,
        message: &[u8],
        signature: &EpochSignature,
    ) -> Result<(), String> {
        if !self
            .participant_keys(participant)
            .iter()
            .any(|k| k.key == signature.key)
        {
            return Err(format!(
                "key {} is not registered with participant {participant}",
                short(&signature.key)
            ));
        }
        tessera_common::signing::verify(&signature.key, message, &signature.signature)
    }

    /// Checks a committed epoch's record against its signature, as it is stored now.
    pub fn signature_status(&self, epoch: Epoch, record: &EpochRecord) -> SignatureStatus {
        let signature = record.seal.as_ref().and_then(|s| s.signature.as_ref());
        let must_sign = |participant: &str| {
            self.participant_keys(participant)
                .iter()
                .any(|k| k.from <= epoch)
        };
        match (&record.participant, signature) {
            (Some(participant), None) if must_sign(participant) => SignatureStatus::Missing {
                participant: participant.clone(),
            },
            (_, None) => SignatureStatus::Unsigned,
            (None, Some(_)) => SignatureStatus::Invalid(
                "signed, but its publisher belongs to no participant".into(),
            ),
            (Some(participant), Some(signature)) => {
                let versions = record.seal.as_ref().map_or(&[][..], |s| &s.versions);
                let format = record
                    .seal
                    .as_ref()
                    .map_or(DigestFormat::Rows, |s| s.digest_format);
                let message = signed_message(
                    &self.cluster_id,
                    epoch,
                    record.publisher.as_deref(),
                    Some(participant),
                    versions,
                    format,
                    &record.changes,
                );
                match self.check_signature(participant, &message, signature) {
                    Ok(()) => SignatureStatus::Valid {
                        participant: participant.clone(),
                    },
                    Err(why) => SignatureStatus::Invalid(why),
                }
            }
        }
    }
}

/// The first 16 hex digits of a key or id, as messages show it.
pub fn short(hex: &str) -> &str {
    &hex[..hex.len().min(16)]
}
