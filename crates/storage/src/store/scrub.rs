//! Scrubbing: listing the components this node's manifests name, and hashing one again
//! now, whatever an earlier check in this process said (the disk may have changed it).

use super::*;

/// A component some of this node's partitions hold.
#[derive(Debug, Clone)]
pub struct HeldComponent {
    pub hash: ComponentHash,
    pub bytes: u64,
    /// The (table, partition) manifests that name it.
    pub holders: Vec<(String, PartitionId)>,
}

impl Store {
    /// Every component the manifests name, once each, in hash order.
    pub fn held_components(&self) -> Vec<HeldComponent> {
        let state = self.state();
        let mut held: BTreeMap<ComponentHash, HeldComponent> = BTreeMap::new();
        for (name, table) in &state.tables {
            for (p, partition) in table.partitions.iter().enumerate() {
                for component in &partition.manifest.components {
                    held.entry(component.hash)
                        .or_insert_with(|| HeldComponent {
                            hash: component.hash,
                            bytes: component.bytes,
                            holders: Vec::new(),
                        })
                        .holders
                        .push((name.clone(), PartitionId(p as u32)));
                }
            }
        }
        held.into_values().collect()
    }

    /// True if some partition's manifest still names component `hash` (a merge or a
    /// retention pass may have replaced it, and its file gone with it, since it was listed).
    pub fn holds_component(&self, hash: &ComponentHash) -> bool {
        self.state().tables.values().any(|table| {
            table
                .partitions
                .iter()
                .any(|p| p.manifest.components.iter().any(|c| c.hash == *hash))
        })
    }

    /// Hashes component `hash`'s file again now. If it no longer matches its name (or is
    /// gone), readers stop trusting the earlier check, and the error says what is wrong;
    /// if it does, readers need not hash it again.
    pub fn rehash_component(&self, hash: &ComponentHash) -> Result<()> {
        self.hash_component_now(hash).map(|_| ())
    }
}
