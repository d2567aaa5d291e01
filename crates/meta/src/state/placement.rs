//! Primaries and corrupt replicas: which replica of a partition serves it.

use super::*;

impl MetaState {
    /// Each partition's primary: its first live replica that holds every committed epoch.
    pub(crate) fn recompute_primaries(&mut self) {
        let mut changed = false;
        for placement in &mut self.map.partitions {
            let primary = placement.replicas.iter().copied().find(|id| {
                !placement.stale.contains_key(id)
                    && self
                        .nodes
                        .get(id)
                        .is_some_and(|n| n.alive && !n.decommissioned)
            });
            if primary != placement.primary {
                placement.primary = primary;
                changed = true;
            }
        }
        if changed {
            self.map.version += 1;
        }
    }

    /// Refuses `node`'s replica of `partition` (its versions do not reproduce the signed
    /// version ids): it is marked stale from the first epoch, so it serves nothing until
    /// the rebalance copies the partition whole from a good replica, and a primary moves
    /// to another replica. Refused if no other replica is good.
    pub(crate) fn mark_corrupt(
        &mut self,
        node: NodeId,
        partition: PartitionId,
        reason: &str,
    ) -> Result<(), String> {
        let placement = self
            .map
            .partitions
            .get(partition.0 as usize)
            .ok_or_else(|| format!("there is no partition {partition}"))?;
        if !placement.replicas.contains(&node) {
            return Err(format!(
                "node {node} holds no replica of partition {partition} (replicas {:?})",
                placement.replicas
            ));
        }
        let good_left = placement
            .replicas
            .iter()
            .any(|r| *r != node && !placement.stale.contains_key(r));
        if !good_left {
            return Err(format!(
                "node {node}'s replica of partition {partition} is corrupt ({reason}), but no other replica is up to date to repair it from"
            ));
        }
        tracing::warn!(%node, %partition, %reason, "replica refused as corrupt; it is copied again whole");
        let placement = &mut self.map.partitions[partition.0 as usize];
        placement.stale.insert(node, Epoch::ZERO);
        self.map.version += 1;
        self.recompute_primaries();
        Ok(())
    }
}
