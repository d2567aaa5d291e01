//! The erasure-coded archive's record (Pond's archival storage, seed 004): which epochs of
//! which tables left the replicated window into the archive, the component each partition
//! became there, and which node holds each of its fragments.
//!
//! An epoch is archived when a tag pins it below where its table's retention wants the
//! horizon (with the table option `archive = true`, every version retention lets go): once the archive holds it, the tag no longer holds the horizon back, merges
//! drop its versions from the replicas, and `AS OF` it reads the archive instead. The
//! record is written only after every fragment is durable on its node, so the horizon
//! never passes an epoch that nothing can rebuild.

use crate::state::MetaState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tessera_common::{ComponentHash, Epoch, NodeId, PartitionId};
use tessera_storage::ComponentMeta;

/// One fragment of an archived component: its place in the code and where it lives.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ArchivedFragment {
    /// `0..k` carry the component's bytes, `k..k+m` parity.
    pub index: u32,
    pub node: NodeId,
    /// The BLAKE3 hash of the fragment's bytes: its name on the node.
    pub hash: ComponentHash,
}

/// One partition of an archived epoch: a component holding the rows a reader at the epoch
/// sees, kept as `data + parity` fragments on distinct nodes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ArchivedComponent {
    pub partition: PartitionId,
    pub component: ComponentMeta,
    pub data_fragments: u32,
    pub parity_fragments: u32,
    /// Every fragment, in index order.
    pub fragments: Vec<ArchivedFragment>,
}

/// A table as it was at an epoch, in the archive.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ArchivedEpoch {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
    /// The partitions that had rows then.
    pub components: Vec<ArchivedComponent>,
    /// The first publish after `epoch` that changed the table, recorded when the epoch log
    /// is compacted past `epoch` (the log then no longer tells); `None` while the log does,
    /// or if none had by then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_change: Option<Epoch>,
}

/// What `tessera status` says of the archive.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ArchiveHealth {
    pub epochs: usize,
    pub components: usize,
    pub fragments: usize,
    /// The fewest fragments of one component on live nodes, and the most a component
    /// may lose of them (its parity); `None` with nothing archived.
    pub fewest_live: Option<(usize, usize)>,
}

impl ArchivedComponent {
    /// Checks the fragment list against the code: one per index, each on its own node.
    fn check(&self, state: &MetaState) -> Result<(), String> {
        let (k, m) = (self.data_fragments as usize, self.parity_fragments as usize);
        if k == 0 || m == 0 || self.fragments.len() != k + m {
            return Err(format!(
                "partition {} of the archive has {} fragments for a code of k = {k}, m = {m}",
                self.partition,
                self.fragments.len()
            ));
        }
        let mut nodes = std::collections::BTreeSet::new();
        for (i, fragment) in self.fragments.iter().enumerate() {
            if fragment.index as usize != i {
                return Err(format!(
                    "partition {}'s fragments are out of order at {i}",
                    self.partition
                ));
            }
            if !state.nodes.contains_key(&fragment.node) {
                return Err(format!(
                    "fragment {i} of partition {} is placed on node {}, which is not a member",
                    self.partition, fragment.node
                ));
            }
            if !nodes.insert(fragment.node) {
                return Err(format!(
                    "partition {} has two fragments on node {}: each must be on its own node",
                    self.partition, fragment.node
                ));
            }
        }
        Ok(())
    }
}

impl MetaState {
    /// Where `table` (of `generation`) at `epoch` is in the archive: the archived epoch
    /// whose rows a reader at `epoch` sees (the newest at or below it, if the table did not
    /// change between them).
    pub fn archived(&self, table: &str, generation: u64, epoch: Epoch) -> Option<&ArchivedEpoch> {
        let (&at, archived) = self.archive.get(table)?.range(..=epoch).next_back()?;
        if archived.generation != generation {
            return None;
        }
        // Below where the log was compacted, the archive record tells the next change.
        let changed_since = archived.next_change.is_some_and(|change| change <= epoch)
            || self.publishes_to(table, at.next().max(self.history_compacted_below), epoch);
        (!changed_since).then_some(archived)
    }

    /// Whether a publish in `from..=to` changed `table`, as the epoch log tells.
    fn publishes_to(&self, table: &str, from: Epoch, to: Epoch) -> bool {
        from <= to
            && self
                .epoch_log
                .range(from..=to)
                .any(|(_, r)| r.changed(table))
    }

    /// Before the epoch log lets its records below `point` go: each archived epoch below
    /// it learns the first publish after it that changed its table, if the log has one.
    pub(crate) fn note_archived_next_changes(&mut self, point: Epoch) {
        let log = &self.epoch_log;
        for (table, archived) in &mut self.archive {
            for (at, archived) in archived.range_mut(..point) {
                if archived.next_change.is_none() {
                    archived.next_change = log
                        .range(at.next()..)
                        .find(|(_, r)| r.changed(table))
                        .map(|(epoch, _)| *epoch);
                }
            }
        }
    }

    /// Where a read of `table` at `epoch` finds its rows: the replicas (`None`), or the
    /// archive; refused below the retention horizon if the archive does not hold it.
    pub fn read_source(&self, table: &str, epoch: Epoch) -> Result<Option<&ArchivedEpoch>, String> {
        let Err(refusal) = self.check_retained(table, epoch) else {
            return Ok(None);
        };
        let generation = self.tables.get(table).map_or(0, |d| d.generation);
        self.archived(table, generation, epoch)
            .map(Some)
            .ok_or(refusal)
    }

    /// The epochs of `table` that must be archived before its horizon may pass them, and
    /// the archive does not hold yet, oldest first: the tagged ones; with `archive = true`
    /// also the table as it was at its floor and at every publish that changed it after,
    /// below where retention `wanted` the horizon.
    pub(crate) fn unarchived_wanted(
        &self,
        table: &str,
        retention: &crate::retention::TableRetention,
        wanted: Epoch,
    ) -> Vec<Epoch> {
        let archived = self.archive.get(table);
        let mut epochs: Vec<Epoch> = self.tags.values().map(|t| t.epoch).collect();
        if retention.setting.archive && retention.floor < wanted {
            epochs.push(retention.floor);
            epochs.extend(
                self.epoch_log
                    .range(retention.floor.next()..wanted)
                    .filter(|(_, r)| r.changed(table))
                    .map(|(epoch, _)| *epoch),
            );
        }
        epochs.sort_unstable();
        epochs.dedup();
        epochs.retain(|e| !archived.is_some_and(|a| a.contains_key(e)));
        epochs
    }

    /// The (table, epoch) pairs to archive now: tagged epochs that hold a table's horizon
    /// below where its retention setting wants it.
    pub fn archive_due(&self) -> Vec<(String, u64, Epoch)> {
        let mut due = Vec::new();
        for (table, retention) in &self.retention {
            let Some(def) = self.tables.get(table) else {
                continue;
            };
            let wanted = self.horizon_of_setting(table, &retention.setting);
            for epoch in self.unarchived_wanted(table, retention, wanted) {
                if epoch < wanted {
                    due.push((table.clone(), def.generation, epoch));
                }
            }
        }
        due
    }

    /// Records an archived epoch whose fragments are all durable on their nodes.
    pub(crate) fn record_archive(&mut self, archived: ArchivedEpoch) -> Result<(), String> {
        let def = self
            .tables
            .get(&archived.table)
            .ok_or_else(|| format!("table {:?} does not exist", archived.table))?;
        if archived.next_change.is_some() {
            return Err(
                "an archive record names no next change: the metadata records it when the epoch log is compacted".into(),
            );
        }
        if def.generation != archived.generation {
            return Err(format!(
                "table {:?} was dropped and created again since this archive was made",
                archived.table
            ));
        }
        if archived.epoch > self.visible {
            return Err(format!(
                "epoch {} is not visible yet (visible: {})",
                archived.epoch, self.visible
            ));
        }
        if self
            .check_retained(&archived.table, archived.epoch)
            .is_err()
        {
            return Err(format!(
                "epoch {} of table {:?} is already below its retention horizon: the replicas may no longer hold what this archive was made from",
                archived.epoch, archived.table
            ));
        }
        let mut partitions = std::collections::BTreeSet::new();
        for component in &archived.components {
            if component.partition.0 >= self.partition_count
                || !partitions.insert(component.partition)
            {
                return Err(format!(
                    "the archive of table {:?} at epoch {} names partition {} twice or out of range",
                    archived.table, archived.epoch, component.partition
                ));
            }
            component.check(self)?;
        }
        self.archive
            .entry(archived.table.clone())
            .or_default()
            .insert(archived.epoch, archived);
        Ok(())
    }

    /// Moves fragment `index` of component `component` (in every archived epoch that
    /// shares it) to node `to`, which has rebuilt it.
    pub(crate) fn move_fragment(
        &mut self,
        component: ComponentHash,
        index: u32,
        to: NodeId,
    ) -> Result<(), String> {
        if !self.nodes.contains_key(&to) {
            return Err(format!("node {to} is not a member"));
        }
        let mut moved = false;
        for archived in self.archive.values_mut().flat_map(|t| t.values_mut()) {
            for c in archived
                .components
                .iter_mut()
                .filter(|c| c.component.hash == component)
            {
                if c.fragments.iter().any(|f| f.node == to && f.index != index) {
                    return Err(format!(
                        "node {to} already holds another fragment of component {component}"
                    ));
                }
                let fragment = c
                    .fragments
                    .get_mut(index as usize)
                    .ok_or_else(|| format!("component {component} has no fragment {index}"))?;
                fragment.node = to;
                moved = true;
            }
        }
        if !moved {
            return Err(format!("no archived epoch holds component {component}"));
        }
        Ok(())
    }

    /// Forgets archived epochs no tag names any more, of tables not archived whole.
    pub(crate) fn drop_untagged_archives(&mut self) {
        let tagged: std::collections::BTreeSet<Epoch> =
            self.tags.values().map(|t| t.epoch).collect();
        for (table, epochs) in self.archive.iter_mut() {
            if self.retention.get(table).is_some_and(|r| r.setting.archive) {
                continue;
            }
            epochs.retain(|epoch, _| tagged.contains(epoch));
        }
        self.archive.retain(|_, epochs| !epochs.is_empty());
    }

    /// Every distinct archived component, once (components shared by epochs are stored once).
    pub fn archived_components(&self) -> Vec<&ArchivedComponent> {
        let mut seen = BTreeMap::new();
        for component in self
            .archive
            .values()
            .flat_map(|t| t.values())
            .flat_map(|a| a.components.iter())
        {
            seen.entry(component.component.hash).or_insert(component);
        }
        seen.into_values().collect()
    }

    /// The archive's size and how close any component is to being lost.
    pub fn archive_health(&self) -> ArchiveHealth {
        let components = self.archived_components();
        let alive = |node: &NodeId| self.nodes.get(node).is_some_and(|n| n.alive);
        ArchiveHealth {
            epochs: self.archive.values().map(|t| t.len()).sum(),
            components: components.len(),
            fragments: components.iter().map(|c| c.fragments.len()).sum(),
            fewest_live: components
                .iter()
                .map(|c| {
                    (
                        c.fragments.iter().filter(|f| alive(&f.node)).count(),
                        c.parity_fragments as usize,
                    )
                })
                .min(),
        }
    }
}
