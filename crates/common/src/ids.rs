//! Newtypes for the identifiers that cross module boundaries. Bare integers never do.

use serde::{Deserialize, Serialize};
use std::fmt;

/// An immutable, numbered version of the whole store. Epoch 0 is the empty store that
/// exists before anything is published.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub struct Epoch(pub u64);

impl Epoch {
    pub const ZERO: Epoch = Epoch(0);

    pub fn is_zero(&self) -> bool {
        *self == Epoch::ZERO
    }

    pub fn next(self) -> Epoch {
        Epoch(self.0.checked_add(1).expect("epoch counter overflowed u64"))
    }
}

/// A node of the cluster: a positive integer fixed in its configuration, and its Raft node
/// id. Shown (and debug-printed) as the bare number, as in configurations and messages.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Names one distributed query cluster-wide: random, chosen by its initiator; shown in hex
/// (the form log lines and notices use).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(transparent)]
pub struct QueryId(pub u64);

impl fmt::Display for QueryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

impl fmt::LowerHex for QueryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

impl fmt::Debug for QueryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QueryId({:x})", self.0)
    }
}

/// A stage's index in its query's plan; a stage's output exchange has the same number, and
/// stage 0 gathers the answer on the initiator.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct StageId(pub usize);

impl StageId {
    /// The top stage: one channel on the initiator, gathering the answer.
    pub const ANSWER: StageId = StageId(0);

    /// The stage's position in its plan's list of stages.
    pub fn index(self) -> usize {
        self.0
    }
}

/// One of a stage's channels (an output partition of its fragment); a producer channel is
/// also the sender its consumers' inboxes sequence batches by.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct ChannelId(pub usize);

/// One of the `P` equal, contiguous ranges of the 64-bit hash ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PartitionId(pub u32);

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

/// A log sequence number. LSNs are per partition and assigned by the partition's primary,
/// so the same LSN means the same record on every replica.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    pub fn next(self) -> Lsn {
        Lsn(self.0.checked_add(1).expect("LSN counter overflowed u64"))
    }
}

/// The BLAKE3 hash of a component's bytes. A component's id *is* its hash: a file whose
/// bytes do not hash to its name is corrupt.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComponentHash(pub [u8; 32]);

impl ComponentHash {
    pub fn of_bytes(bytes: &[u8]) -> ComponentHash {
        ComponentHash(*blake3::hash(bytes).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    pub fn from_hex(hex: &str) -> Option<ComponentHash> {
        blake3::Hash::from_hex(hex)
            .ok()
            .map(|h| ComponentHash(*h.as_bytes()))
    }
}

impl fmt::Debug for ComponentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ComponentHash({})", self.to_hex())
    }
}

impl fmt::Display for ComponentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for ComponentHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ComponentHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        ComponentHash::from_hex(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("not a BLAKE3 hex hash: {text:?}")))
    }
}

/// `Display` as the bare number: how these ids are written in configurations, messages
/// and logs.
macro_rules! display_as_number {
    ($($id:ty),*) => {
        $(impl fmt::Display for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        })*
    };
}

display_as_number!(Epoch, Lsn, NodeId, StageId, ChannelId);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_hash_round_trips_through_hex_and_json() {
        let hash = ComponentHash::of_bytes(b"tessera");
        assert_eq!(ComponentHash::from_hex(&hash.to_hex()), Some(hash));
        let json = serde_json::to_string(&hash).unwrap();
        assert_eq!(serde_json::from_str::<ComponentHash>(&json).unwrap(), hash);
        assert!(serde_json::from_str::<ComponentHash>("\"zz\"").is_err());
    }
}
