//! What this node gives the archive: one partition of a table as one component holding
//! exactly the rows a reader at an epoch sees, and the fragments it keeps for others.

use super::*;
use crate::archive::FragmentStore;

impl Store {
    /// One partition of `table` as the archive keeps it at `epoch`: every key's version a
    /// reader at `epoch` sees, ordered by key, as Parquet bytes with their description
    /// (`None` if the partition had no rows then). Replicas that hold the same rows
    /// produce the same bytes, whatever their components look like. `epoch` must still be
    /// retained here.
    pub fn archive_partition(
        &self,
        table: &str,
        partition: PartitionId,
        epoch: Epoch,
    ) -> Result<Option<(ComponentMeta, Vec<u8>)>> {
        self.replay_standby(&[partition])?;
        let snapshot = self.snapshot(table, Some(epoch))?;
        let def = &snapshot.def;
        let part = snapshot
            .partitions
            .get(partition.0 as usize)
            .ok_or_else(|| StorageError::UnknownPartition {
                table: table.to_string(),
                partition,
                partitions: snapshot.partitions.len(),
            })?;
        let mut batches = self.read_components(def, &part.components)?;
        batches.extend(part.memtable.iter().cloned());
        let batches = versions::versions_before(batches, Epoch(epoch.0 + 1))?;
        if batches.is_empty() {
            return Ok(None);
        }
        let key = def.primary_key_indices();
        let seen = versions::merge_versions(&batches, &key, epoch, def.append_only)?;
        if seen.num_rows() == 0 {
            return Ok(None);
        }
        let stats = versions::version_stats(&seen, &key, def.append_only)?;
        let bytes = component::encode_parquet(std::slice::from_ref(&seen))?;
        let meta = ComponentMeta {
            hash: ComponentHash::of_bytes(&bytes),
            rows: seen.num_rows() as u64,
            bytes: bytes.len() as u64,
            min_lsn: Lsn(0),
            max_lsn: Lsn(0),
            min_epoch: stats.min_epoch,
            max_epoch: stats.max_epoch,
            unique_keys: stats.unique_keys,
            tombstones: stats.tombstones,
            layout: def.layout(),
            superseded_at: Epoch::ZERO,
        };
        Ok(Some((meta, bytes)))
    }

    /// The archive fragments this node holds.
    pub fn fragments(&self) -> &FragmentStore {
        &self.fragments
    }
}
