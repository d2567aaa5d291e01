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

    /// Whether `node` holds every version of `partition` up to `epoch`, in this state: it is
    /// one of the partition's replicas and missed no epoch at or below `epoch` there (a
    /// stale mark from a later epoch does not matter to a read at `epoch`). `Err` says why
    /// not. A read planned earlier may reach a replica that has since lost its rows (wiped
    /// and taken back empty, refused as corrupt) or been moved off the partition: this is
    /// what the replica checks before it answers.
    pub fn holds_through(
        &self,
        node: NodeId,
        partition: PartitionId,
        epoch: Epoch,
    ) -> Result<(), String> {
        let placement = self
            .map
            .partitions
            .get(partition.0 as usize)
            .ok_or_else(|| {
                format!(
                    "the cluster has no partition {partition} (it has {})",
                    self.map.partitions.len()
                )
            })?;
        if !placement.replicas.contains(&node) {
            return Err(format!(
                "node {node} is not a replica of partition {partition} (its replicas are {:?})",
                placement.replicas
            ));
        }
        match placement.stale.get(&node) {
            Some(since) if *since <= epoch => Err(format!(
                "node {node} lacks the versions of partition {partition} from epoch {since} on (it is being copied them), so it cannot answer at epoch {epoch}"
            )),
            _ => Ok(()),
        }
    }

    /// The live replicas of `partition` that can answer a read at `epoch` in this state
    /// (those [`holds_through`](Self::holds_through) accepts), its primary first. Where a
    /// read planned under an older map goes once the partition has moved.
    pub fn readers_at(&self, partition: PartitionId, epoch: Epoch) -> Vec<NodeId> {
        let Some(placement) = self.map.partitions.get(partition.0 as usize) else {
            return Vec::new();
        };
        let others = placement
            .replicas
            .iter()
            .copied()
            .filter(|&id| Some(id) != placement.primary);
        placement
            .primary
            .into_iter()
            .chain(others)
            .filter(|&id| {
                self.nodes.get(&id).is_some_and(|n| n.alive)
                    && self.holds_through(id, partition, epoch).is_ok()
            })
            .collect()
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
        self.replicas_lost_at = self.next_epoch;
        self.map.version += 1;
        self.recompute_primaries();
        Ok(())
    }

    /// Node `id` comes back with its data gone (a wiped or replaced disk): every replica it
    /// held is marked stale from the first epoch, so it serves nothing until each is copied
    /// whole from a good replica, and it is counted failed until it says it is alive.
    /// Refused, changing nothing, if it was the only up-to-date replica of a partition:
    /// that partition's newest rows exist nowhere else.
    pub(crate) fn replace_node(&mut self, id: NodeId) -> Result<(), String> {
        let node = self
            .nodes
            .get(&id)
            .ok_or_else(|| format!("node {id} is not a member"))?;
        if node.decommissioned {
            return Err(format!("node {id} is decommissioned"));
        }
        let lost: Vec<String> = self
            .map
            .partitions
            .iter()
            .enumerate()
            .filter(|(_, p)| p.replicas.contains(&id))
            .filter(|(_, p)| {
                !p.replicas
                    .iter()
                    .any(|r| *r != id && !p.stale.contains_key(r))
            })
            .map(|(i, _)| format!("p{i}"))
            .collect();
        if !lost.is_empty() {
            return Err(format!(
                "node {id} was the only up-to-date replica of partitions {}: with its data gone, their newest rows are nowhere else (bring back a replica that has them, or restore node {id}'s disk)",
                lost.join(", ")
            ));
        }
        let node = self.nodes.get_mut(&id).expect("checked");
        node.alive = false;
        for placement in &mut self.map.partitions {
            if placement.replicas.contains(&id) {
                placement.stale.insert(id, Epoch::ZERO);
            }
        }
        self.replicas_lost_at = self.next_epoch;
        self.map.version += 1;
        self.recompute_primaries();
        tracing::warn!(node = %id, "node replaced: its data is gone, its replicas are copied to it whole");
        Ok(())
    }
}
