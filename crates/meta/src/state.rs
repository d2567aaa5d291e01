//! The replicated metadata: what every node agrees on through Raft.
//!
//! [`MetaState::apply`] is deterministic: every node applies the same commands in the same
//! order and reaches the same state. What applying a command means for the local store
//! (create a table, commit an epoch's prepared rows) is returned as [`LocalEffect`]s for the
//! state machine to carry out.

pub use crate::access::UserRecord;
use crate::access::{Action, AuditEvent, AuditRecord, ParticipantRecord, Role, Standing};
use crate::history::{EpochRecord, TableChangeCount, TagRecord};
use crate::NodeId;
pub use commands::{LocalEffect, MetaCommand, MetaResponse};
pub use lease_queue::LeaseClaim;
pub use lineage::{InboxLineage, LineageEntry, QueryLineage};
pub use members::NodeInfo;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use tessera_common::auth::ScramSecret;
use tessera_common::{ComponentHash, Epoch, PartitionId, QueryId};
use tessera_storage::TableDef;

/// Where one partition lives (chained declustering: `replicas` are consecutive ring nodes
/// starting at `original`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Placement {
    pub original: NodeId,
    pub replicas: Vec<NodeId>,
    /// The first live replica that holds every committed epoch; `None` while none does.
    pub primary: Option<NodeId>,
    /// Replicas that missed a committed epoch of this partition, each with the first epoch
    /// it missed: it may not serve the partition until it has fetched the versions from
    /// that epoch on (delta recovery).
    pub stale: BTreeMap<NodeId, Epoch>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct PartitionMap {
    /// Rises whenever any placement or primary changes.
    pub version: u64,
    pub partitions: Vec<Placement>,
}

impl PartitionMap {
    /// Uniform contiguous ranges over the ring, nodes ordered by id, `replication` replicas
    /// on consecutive nodes.
    pub fn uniform(partition_count: u32, replication: u32, nodes: &[NodeId]) -> PartitionMap {
        assert!(!nodes.is_empty(), "a partition map needs nodes");
        let mut nodes = nodes.to_vec();
        nodes.sort_unstable();
        let n = nodes.len() as u64;
        let copies = (replication as usize).min(nodes.len());
        let partitions = (0..partition_count as u64)
            .map(|p| {
                let first = (p * n / partition_count as u64) as usize;
                let replicas: Vec<NodeId> = (0..copies)
                    .map(|k| nodes[(first + k) % nodes.len()])
                    .collect();
                Placement {
                    original: replicas[0],
                    primary: Some(replicas[0]),
                    replicas,
                    stale: BTreeMap::new(),
                }
            })
            .collect();
        PartitionMap {
            version: 1,
            partitions,
        }
    }

    /// The partitions `node` keeps as a cold standby: those it replicates without being
    /// their primary.
    pub fn standby_of(&self, node: NodeId) -> BTreeSet<PartitionId> {
        self.partitions
            .iter()
            .enumerate()
            .filter(|(_, p)| p.replicas.contains(&node) && p.primary != Some(node))
            .map(|(i, _)| PartitionId(i as u32))
            .collect()
    }

    /// The node to read partition `p` from, if any replica can serve it.
    pub fn reader_of(&self, partition: PartitionId) -> Option<NodeId> {
        self.partitions.get(partition.0 as usize)?.primary
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpenEpoch {
    pub coordinator: NodeId,
    /// The coordinator's process that opened it.
    #[serde(default)]
    pub incarnation: u64,
    pub tables: Vec<String>,
    #[serde(default)]
    pub request: u64,
    /// The user publishing, if a user asked for it (see [`crate::access`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    /// The metadata log index of the allocation (0 in states written before it was kept):
    /// a coordinator that has applied it and no longer lists the epoch gave it up (see
    /// [`crate::wire::Heartbeat`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub allocated_at: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct MetaState {
    pub cluster_id: String,
    pub partition_count: u32,
    pub replication: u32,
    /// Replicas apply committed rows at once (hot standby) instead of keeping them in the
    /// log until promoted (cold standby).
    #[serde(default)]
    pub hot_standby: bool,
    pub nodes: BTreeMap<NodeId, NodeInfo>,
    pub map: PartitionMap,
    pub tables: BTreeMap<String, TableDef>,
    pub next_epoch: Epoch,
    /// Every epoch at or below it is committed or aborted.
    pub visible: Epoch,
    pub open: BTreeMap<Epoch, OpenEpoch>,
    /// Decided epochs above `visible`, waiting for the epochs below them.
    pub decided_above_visible: BTreeSet<Epoch>,
    /// Aborted epochs not yet at or below `visible` (and any from before the epoch log
    /// began), so a node can tell an in-doubt prepare's fate after a restart. Once every
    /// epoch below one is decided, the epoch log tells: an epoch in
    /// `aborts_derived_from..=visible` is aborted exactly when the log lacks it, so the set
    /// stays as small as the epochs in flight. (The histories here are persistent
    /// collections: every applied entry publishes a copy of the state, which must not
    /// copy every epoch ever decided.)
    pub aborted: imbl::OrdSet<Epoch>,
    /// Where the epoch log became the record of aborts (see `aborted`); zero until then.
    /// A compaction of the epoch log moves it up to where the log then begins, and puts
    /// the aborts below it back in `aborted` (see [`crate::history_compaction`]).
    #[serde(default, skip_serializing_if = "Epoch::is_zero")]
    pub aborts_derived_from: Epoch,
    /// How many aborted epochs left `aborted` for the epoch log's record.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub aborts_derived: u64,
    /// The logged reading orders of running queries under lineage recovery, by query.
    #[serde(default)]
    pub lineage: BTreeMap<QueryId, QueryLineage>,
    /// Who may log in to the SQL endpoints. While there are none, they take anyone (a new
    /// cluster is open to its operator, as PostgreSQL's `trust` is); once the first user
    /// is created, every connection must authenticate.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub users: BTreeMap<String, UserRecord>,
    /// The largest leader stamp applied (milliseconds since the Unix epoch): the metadata's
    /// clock, which never moves back.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clock_ms: u64,
    /// Every committed epoch: its kind, coordinator, tables, rows and visible time.
    #[serde(default, skip_serializing_if = "imbl::OrdMap::is_empty")]
    pub epoch_log: imbl::OrdMap<Epoch, EpochRecord>,
    /// Named epochs, for `AS OF TAG`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, TagRecord>,
    /// Tables whose history is not kept for ever, by name (see [`crate::retention`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub retention: BTreeMap<String, crate::retention::TableRetention>,
    /// The organizations sharing the cluster, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub participants: BTreeMap<String, ParticipantRecord>,
    /// Each owned table's participant, by table name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub owners: BTreeMap<String, String>,
    /// Who changed membership, rights or ownership, and every publish, in order.
    #[serde(default, skip_serializing_if = "imbl::Vector::is_empty")]
    pub audit_log: imbl::Vector<AuditRecord>,
    /// Why the newest aborted epochs were aborted (see `note_abort`): a coordinator that
    /// asks to commit or abort one later is told (a hand-over, the leader taking it for
    /// given up or left open too long).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub abort_reasons: BTreeMap<Epoch, String>,
    /// The last epoch that wrote rows of each table (see [`write_conflicts`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub table_changed_at: BTreeMap<String, Epoch>,
    /// Each published table's current version id: the head of its hash chain (see
    /// [`crate::seal`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub table_heads: BTreeMap<String, ComponentHash>,
    /// Archived epochs, by table and epoch (see [`crate::archive`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub archive: BTreeMap<String, BTreeMap<Epoch, crate::archive::ArchivedEpoch>>,
    /// `next_epoch` when a replica last lost its data outside any epoch (a node replaced,
    /// a replica refused as corrupt): its stale mark went back to the first epoch. A
    /// rebalance whose epoch is older planned its copies from the marks before that (a
    /// delta where a whole copy is now needed), so its map is refused.
    #[serde(default, skip_serializing_if = "Epoch::is_zero")]
    pub replicas_lost_at: Epoch,
    /// Every epoch below it has left the epoch log: no table retains its history there
    /// (see [`crate::history_compaction`]). Zero while the log is whole.
    #[serde(default, skip_serializing_if = "Epoch::is_zero")]
    pub history_compacted_below: Epoch,
    /// Each table's version id at `history_compacted_below`: where its hash chain resumes
    /// in the epoch log.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub history_heads: BTreeMap<String, ComponentHash>,
    /// Tables that allocations refused for a lease wait for, in turn (see [`lease_queue`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lease_claims: BTreeMap<String, LeaseClaim>,
}

/// How many of a partition's `replicas` must hold every committed epoch after a commit
/// that asks for `min_copies`: one when it names none, never more than there are.
pub fn copies_needed(min_copies: Option<u32>, replicas: usize) -> usize {
    (min_copies.unwrap_or(1).max(1) as usize).min(replicas.max(1))
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl MetaState {
    pub fn is_bootstrapped(&self) -> bool {
        !self.cluster_id.is_empty()
    }

    /// Whether the epoch's fate is known: committed or aborted.
    pub fn is_decided(&self, epoch: Epoch) -> bool {
        epoch < self.next_epoch && !self.open.contains_key(&epoch)
    }

    /// Whether `epoch` was committed (as opposed to aborted or still open).
    pub fn is_committed(&self, epoch: Epoch) -> bool {
        epoch < self.next_epoch && !self.open.contains_key(&epoch) && !self.is_aborted(epoch)
    }

    /// Whether `epoch` was aborted.
    pub fn is_aborted(&self, epoch: Epoch) -> bool {
        self.aborted.contains(&epoch) || self.is_derived_abort(epoch)
    }

    /// Whether `epoch` lies where aborts are told by the epoch log, and the log lacks it.
    fn is_derived_abort(&self, epoch: Epoch) -> bool {
        !self.aborts_derived_from.is_zero()
            && epoch >= self.aborts_derived_from
            && epoch <= self.visible
            && !self.epoch_log.contains_key(&epoch)
    }

    /// How many epochs were ever aborted.
    pub fn aborted_count(&self) -> u64 {
        self.aborted.len() as u64 + self.aborts_derived
    }

    /// The newest `limit` aborted epochs, newest last, looking back over at most `scan`
    /// epochs below the visible one for those the epoch log tells.
    pub fn recent_aborted(&self, limit: usize, scan: u64) -> Vec<Epoch> {
        let lowest = Epoch(self.visible.0.saturating_sub(scan)).max(self.aborts_derived_from);
        let derived = (lowest.0..=self.visible.0)
            .map(Epoch)
            .filter(|&epoch| self.is_derived_abort(epoch));
        let mut recent: Vec<Epoch> = self.aborted.iter().copied().chain(derived).collect();
        recent.sort_unstable();
        recent.dedup();
        let cut = recent.len().saturating_sub(limit);
        recent.split_off(cut)
    }

    pub fn live_nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.values().filter(|n| n.alive && !n.decommissioned)
    }

    /// Applies one command. `index` is the command's log index, used as the generation of
    /// tables it creates.
    pub fn apply(&mut self, index: u64, command: MetaCommand) -> (MetaResponse, Vec<LocalEffect>) {
        let visible_before = self.visible;
        let applied = match self.try_apply(index, command) {
            Ok(applied) => applied,
            Err(reason) => (MetaResponse::Refused(reason), Vec::new()),
        };
        assert!(
            self.visible >= visible_before,
            "invariant: the visible epoch never moves back ({visible_before} became {})",
            self.visible
        );
        if !matches!(applied.0, MetaResponse::Refused(_)) {
            self.compact_history_on_interval(visible_before);
        }
        debug_assert_eq!(self.broken_invariant(), None);
        // Only the log's tail changes: from the epoch visible before (whose time the next
        // visible one is compared with) on, so the check stays cheap as history grows.
        debug_assert_eq!(self.broken_history_invariant_from(visible_before), None);
        applied
    }

    /// The first cross-cutting invariant the state breaks, if any (checked after every
    /// command in debug builds and tests):
    /// - a partition's primary is one of its replicas, and never a stale one (it would
    ///   serve reads missing committed epochs);
    /// - every open epoch lies above the visible epoch (visible means decided);
    /// - open epochs' table leases are exclusive: one writer per table at a time.
    pub fn broken_invariant(&self) -> Option<String> {
        if let Err(misplaced) = self.check_only_storage_nodes_hold(&self.map) {
            return Some(misplaced);
        }
        for (p, placement) in self.map.partitions.iter().enumerate() {
            if let Some(primary) = placement.primary {
                if !placement.replicas.contains(&primary) {
                    return Some(format!(
                        "partition {p}'s primary {primary} is not among its replicas {:?}",
                        placement.replicas
                    ));
                }
                if placement.stale.contains_key(&primary) {
                    return Some(format!(
                        "partition {p}'s primary {primary} is stale (it missed epochs from {})",
                        placement.stale[&primary]
                    ));
                }
            }
        }
        let mut leased: BTreeMap<&str, Epoch> = BTreeMap::new();
        for (epoch, open) in &self.open {
            if *epoch <= self.visible {
                return Some(format!(
                    "epoch {epoch} is open, but the visible epoch {} is not below it",
                    self.visible
                ));
            }
            for table in &open.tables {
                if let Some(other) = leased.insert(table, *epoch) {
                    return Some(format!(
                        "table {table:?} is leased by open epochs {other} and {epoch} at once"
                    ));
                }
            }
        }
        None
    }

    fn try_apply(
        &mut self,
        index: u64,
        command: MetaCommand,
    ) -> Result<(MetaResponse, Vec<LocalEffect>), String> {
        if let MetaCommand::Stamped { at_ms, command } = command {
            if matches!(*command, MetaCommand::Stamped { .. }) {
                return Err("a stamped command holds another stamp".into());
            }
            // Set first: an epoch made visible by this command takes this time.
            let clock_before = self.clock_ms;
            self.clock_ms = self.clock_ms.max(at_ms);
            let applied = self.try_apply(index, *command);
            if applied.is_err() {
                self.clock_ms = clock_before; // a refused command changes nothing
            }
            return applied;
        }
        if let MetaCommand::As { user, command } = command {
            if matches!(
                *command,
                MetaCommand::Stamped { .. } | MetaCommand::As { .. }
            ) {
                return Err("a command on behalf of a user holds another wrapper".into());
            }
            return self.apply_as(index, *command, Some(&user));
        }
        self.apply_as(index, command, None)
    }

    /// Applies one unwrapped command on behalf of `by` (`None`: the operator).
    fn apply_as(
        &mut self,
        index: u64,
        command: MetaCommand,
        by: Option<&str>,
    ) -> Result<(MetaResponse, Vec<LocalEffect>), String> {
        if !self.is_bootstrapped() && !matches!(command, MetaCommand::Bootstrap { .. }) {
            return Err("the cluster is not bootstrapped yet".into());
        }
        if by.is_some() && command.is_the_clusters_own() {
            // Membership of nodes, placement and lineage are the nodes' own business.
            if self.standing(by)? != Standing::Operator {
                return Err(format!(
                    "permission denied: user {:?} may not change the cluster's nodes or placement: only a cluster administrator may",
                    by.unwrap_or_default()
                ));
            }
        }
        let mut effects = Vec::new();
        let response = match command {
            MetaCommand::Bootstrap {
                cluster_id,
                partition_count,
                replication,
                hot_standby,
                nodes,
            } => {
                if self.is_bootstrapped() {
                    return Err(format!(
                        "cluster {:?} is already bootstrapped",
                        self.cluster_id
                    ));
                }
                self.cluster_id = cluster_id;
                self.partition_count = partition_count;
                self.replication = replication;
                self.hot_standby = hot_standby;
                self.next_epoch = Epoch(1);
                // The epoch log holds every commit from the first epoch on.
                self.aborts_derived_from = Epoch(1);
                for (id, addr) in &nodes {
                    self.nodes
                        .insert(*id, NodeInfo::joining(*id, addr.clone(), false));
                }
                let ids: Vec<NodeId> = nodes.iter().map(|(id, _)| *id).collect();
                self.map = PartitionMap::uniform(partition_count, replication, &ids);
                MetaResponse::Done
            }
            MetaCommand::RegisterNode { id, addr, compute } => {
                if let Some(existing) = self.nodes.get(&id) {
                    if existing.addr != addr {
                        return Err(format!(
                            "node {id} is already a member at {}, not {addr}",
                            existing.addr
                        ));
                    }
                    if existing.compute != compute {
                        // A storage node's replicas cannot be dropped by a change of heart,
                        // nor a compute node be given partitions behind the ring's back.
                        return Err(format!(
                            "node {id} is a member as a {} node and cannot register as a {} node: decommission it and join it under a new id",
                            existing.role(),
                            if compute { "compute" } else { "storage" }
                        ));
                    }
                } else {
                    self.nodes.insert(id, NodeInfo::joining(id, addr, compute));
                }
                MetaResponse::Done
            }
            MetaCommand::SetLiveness { id, alive } => {
                let node = self
                    .nodes
                    .get_mut(&id)
                    .ok_or_else(|| format!("unknown node {id}"))?;
                node.alive = alive;
                if !alive {
                    // A dead coordinator cannot finish its publishes: abort them.
                    self.abort_epochs_opened_before(id, u64::MAX, &mut effects);
                    // Nor a dead initiator its queries: nobody will replay their lineage.
                    self.lineage.retain(|_, query| query.initiator != id);
                }
                self.recompute_primaries();
                MetaResponse::Done
            }
            MetaCommand::Started { id, incarnation } => {
                let node = self
                    .nodes
                    .get(&id)
                    .ok_or_else(|| format!("unknown node {id}"))?;
                if incarnation > node.incarnation {
                    self.enter_incarnation(id, incarnation, &mut effects);
                }
                MetaResponse::Done
            }
            MetaCommand::CreateTable { mut def } => {
                if self.tables.contains_key(&def.name) {
                    return Err(format!("table {:?} already exists", def.name));
                }
                self.may(by, Action::CreateTable)?;
                // A member's table belongs to its participant; the operator's to nobody
                // until handed over.
                let owner = match self.standing(by)? {
                    Standing::Member { participant, .. } => Some(participant.to_string()),
                    Standing::Operator => None,
                };
                if let Some(owner) = &owner {
                    self.owners.insert(def.name.clone(), owner.clone());
                }
                self.audit(
                    by,
                    AuditEvent::CreateTable {
                        table: def.name.clone(),
                        owner,
                    },
                );
                def.created_at = self.visible;
                def.generation = index;
                self.tables.insert(def.name.clone(), def.clone());
                effects.push(LocalEffect::EnsureTable(def));
                MetaResponse::Done
            }
            command @ (MetaCommand::CreateUser { .. }
            | MetaCommand::AlterUser { .. }
            | MetaCommand::DropUser { .. }
            | MetaCommand::CreateParticipant { .. }
            | MetaCommand::DropParticipant { .. }
            | MetaCommand::Grant { .. }
            | MetaCommand::Revoke { .. }
            | MetaCommand::SetTableOwner { .. }
            | MetaCommand::AddParticipantKey { .. }) => {
                self.apply_access(command, by, &mut effects)?
            }
            MetaCommand::MarkCorrupt {
                node,
                partition,
                reason,
            } => {
                self.mark_corrupt(node, partition, &reason)?;
                MetaResponse::Done
            }
            MetaCommand::DropTable { name } => {
                if let Some(open) = self.open.values().find(|o| o.tables.contains(&name)) {
                    return Err(format!(
                        "table {name:?} is being published by node {}; try again when it finishes",
                        open.coordinator
                    ));
                }
                if !self.tables.contains_key(&name) {
                    return Err(format!("table {name:?} does not exist"));
                }
                self.may(by, Action::DropTable(&name))?;
                let def = self.tables.remove(&name).expect("checked");
                self.retention.remove(&name);
                self.archive.remove(&name);
                self.owners.remove(&name);
                self.table_heads.remove(&name);
                self.history_heads.remove(&name);
                self.table_changed_at.remove(&name);
                self.audit(
                    by,
                    AuditEvent::DropTable {
                        table: name.clone(),
                    },
                );
                effects.push(LocalEffect::DropTable {
                    name,
                    generation: def.generation,
                });
                MetaResponse::Done
            }
            MetaCommand::AllocateEpoch {
                coordinator,
                incarnation,
                tables,
                request,
                read_at,
            } => {
                if let Some((epoch, _)) = self
                    .open
                    .iter()
                    .find(|(_, o)| o.coordinator == coordinator && o.request == request)
                {
                    return Ok((MetaResponse::Epoch(*epoch), vec![]));
                }
                let Some(member) = self.nodes.get(&coordinator).filter(|n| n.alive) else {
                    return Ok((
                        MetaResponse::Fenced(format!("node {coordinator} is not a live member")),
                        vec![],
                    ));
                };
                if incarnation < member.incarnation {
                    return Ok((
                        MetaResponse::Fenced(format!(
                            "node {coordinator} has restarted since this request was sent"
                        )),
                        vec![],
                    ));
                }
                if let Some(table) = tables.iter().find(|t| !self.tables.contains_key(*t)) {
                    return Err(format!("table {table:?} does not exist"));
                }
                for table in &tables {
                    self.may(by, Action::Publish(table))?;
                }
                if let Some(conflict) = self.write_conflict(&read_at) {
                    return Ok((MetaResponse::WriteConflict(conflict), vec![]));
                }
                if incarnation > member.incarnation {
                    self.enter_incarnation(coordinator, incarnation, &mut effects);
                }
                // Refused, the allocation claims its tables, so that it gets them in turn
                // (see [`lease_queue`]).
                let busy = tables.iter().find_map(|table| {
                    let (epoch, open) = self.open.iter().find(|(_, o)| o.tables.contains(table))?;
                    Some(format!(
                        "table {table:?} is owned by node {} while it publishes epoch {epoch}; one writer at a time",
                        open.coordinator
                    ))
                });
                let busy = busy.or_else(|| {
                    let (table, claim) = self.claimed_before(&tables, coordinator, request)?;
                    Some(format!(
                        "table {table:?} is claimed by a publish of node {} that has waited longer for it; leases are given in turn",
                        claim.coordinator
                    ))
                });
                if let Some(reason) = busy {
                    self.claim(&tables, coordinator, request, index);
                    return Ok((MetaResponse::TableBusy(reason), effects));
                }
                self.release_claims(coordinator, request);
                let epoch = self.next_epoch;
                self.next_epoch = epoch.next();
                self.open.insert(
                    epoch,
                    OpenEpoch {
                        coordinator,
                        incarnation,
                        tables,
                        request,
                        publisher: by.map(str::to_string),
                        allocated_at: index,
                    },
                );
                MetaResponse::Epoch(epoch)
            }
            MetaCommand::CommitEpoch {
                epoch,
                missed,
                changes,
                seal,
                min_copies,
            } => {
                if self.is_committed(epoch) {
                    // A retried commit whose first reply was lost.
                    return Ok((MetaResponse::Epoch(epoch), vec![]));
                }
                if !self.open.contains_key(&epoch) {
                    // A coordinator never commits an epoch it aborted itself: the leader
                    // aborted it when it declared the coordinator failed.
                    let reason = self
                        .abort_reasons
                        .get(&epoch)
                        .map_or("its coordinator was declared failed", String::as_str);
                    return Ok((
                        MetaResponse::Fenced(format!("epoch {epoch} was aborted: {reason}")),
                        vec![],
                    ));
                }
                // Stale marks are per partition, across tables: epochs of two tables in
                // flight at once may each miss a different replica. A commit that would
                // leave a touched partition with fewer replicas holding every committed
                // epoch than the publish asks for (`min_copies`, at most its replica
                // count, at least one) is refused: the coordinator aborts and publishes
                // again. With none the partition would have no primary and nothing to
                // copy from; with one, losing that one disk loses an acknowledged epoch.
                let mut marked: BTreeMap<usize, BTreeSet<NodeId>> = BTreeMap::new();
                for (partition, node) in &missed {
                    marked
                        .entry(partition.0 as usize)
                        .or_default()
                        .insert(*node);
                }
                for (&p, nodes) in &marked {
                    let Some(placement) = self.map.partitions.get(p) else {
                        continue;
                    };
                    let needed = copies_needed(min_copies, placement.replicas.len());
                    let complete_after: Vec<NodeId> = placement
                        .replicas
                        .iter()
                        .filter(|r| !placement.stale.contains_key(r) && !nodes.contains(r))
                        .copied()
                        .collect();
                    if complete_after.len() < needed {
                        return Err(format!(
                            "committing epoch {epoch} would leave partition p{p} with {} of its replicas holding every committed epoch ({complete_after:?}; replicas {:?}, stale since {:?}, missing this one {:?}), and it needs {needed} (replicas.min_copies); abort it and publish again once enough replicas are back",
                            complete_after.len(),
                            placement.replicas,
                            placement.stale,
                            nodes
                        ));
                    }
                }
                let open = self.open[&epoch].clone();
                if let Some(changes) = &changes {
                    self.apply_seal(epoch, &open, changes, seal.as_ref())?;
                    self.note_changed(epoch, changes);
                }
                for (partition, node) in missed {
                    if let Some(placement) = self.map.partitions.get_mut(partition.0 as usize) {
                        let newly_stale = !placement.stale.contains_key(&node);
                        let first_missed = placement.stale.entry(node).or_insert(epoch);
                        *first_missed = (*first_missed).min(epoch);
                        if !newly_stale {
                            continue;
                        }
                        let fresh: Vec<NodeId> = placement
                            .replicas
                            .iter()
                            .filter(|r| !placement.stale.contains_key(r))
                            .copied()
                            .collect();
                        // Where a partition's copies went stale, and how few fresh ones it
                        // has left: the trail of a partition that later cannot take writes.
                        tracing::info!(
                            %epoch,
                            partition = partition.0,
                            %node,
                            ?fresh,
                            "a replica missed a committed epoch and is stale until it catches up"
                        );
                    }
                }
                let publish = changes.is_some();
                self.log_commit(epoch, &open, changes, seal);
                if publish {
                    let participant = self.epoch_log[&epoch].participant.clone();
                    self.audit(
                        open.publisher.as_deref(),
                        AuditEvent::Publish {
                            epoch,
                            tables: open.tables,
                            participant,
                        },
                    );
                }
                self.decide(epoch, true);
                self.recompute_primaries();
                effects.push(LocalEffect::Commit(epoch));
                MetaResponse::Epoch(epoch)
            }
            MetaCommand::AbortEpoch { epoch, reason } => {
                if self.is_aborted(epoch) {
                    // Its coordinator learns why, where the cluster aborted it for another
                    // reason (a hand-over, the leader taking it for given up); a retried
                    // abort, its first reply lost, names the same reason and is done.
                    let response = match self.abort_reasons.get(&epoch) {
                        Some(why) if *why != reason => MetaResponse::Fenced(why.clone()),
                        _ => MetaResponse::Done,
                    };
                    return Ok((response, vec![]));
                }
                if !self.open.contains_key(&epoch) {
                    return Err(format!("epoch {epoch} is already committed"));
                }
                tracing::info!(%epoch, %reason, "epoch aborted");
                // A coordinator that asks to commit it later is told why (the leader
                // aborted an epoch it took for given up, or left open too long).
                self.note_abort(epoch, reason);
                self.decide(epoch, false);
                effects.push(LocalEffect::Abort(epoch));
                MetaResponse::Done
            }
            MetaCommand::SetPartitionMap { map, rebalance } => {
                if let Some(epoch) = rebalance.filter(|e| !self.open.contains_key(e)) {
                    return Err(format!(
                        "the partition map of rebalance epoch {epoch} is out of date: the epoch is no longer open{}",
                        if self.is_aborted(epoch) { " (it was aborted)" } else { "" }
                    ));
                }
                if let Some(epoch) = rebalance.filter(|e| *e < self.replicas_lost_at) {
                    return Err(format!(
                        "the partition map of rebalance epoch {epoch} is out of date: a replica lost its data after the rebalance planned its copies (a node replaced or a replica found corrupt); it must be copied whole"
                    ));
                }
                if map.partitions.len() != self.partition_count as usize {
                    return Err(format!(
                        "a partition map must place {} partitions, this one places {}",
                        self.partition_count,
                        map.partitions.len()
                    ));
                }
                self.check_only_storage_nodes_hold(&map)?;
                self.map = PartitionMap {
                    version: self.map.version + 1,
                    partitions: map.partitions,
                };
                self.recompute_primaries();
                MetaResponse::Done
            }
            MetaCommand::Leave { id } => {
                let node = self
                    .nodes
                    .get_mut(&id)
                    .ok_or_else(|| format!("unknown node {id}"))?;
                if node.decommissioned {
                    return Err(format!("node {id} is already decommissioned"));
                }
                node.leaving = true;
                let remaining = self
                    .nodes
                    .values()
                    .filter(|n| !n.decommissioned && !n.leaving)
                    .count();
                if remaining == 0 {
                    self.nodes.get_mut(&id).expect("checked").leaving = false;
                    return Err("the last member cannot leave".into());
                }
                MetaResponse::Done
            }
            MetaCommand::Decommission { id } => {
                let holds = self.map.partitions.iter().any(|p| p.replicas.contains(&id));
                if holds {
                    return Err(format!(
                        "node {id} still holds partitions; move them off it first"
                    ));
                }
                let node = self
                    .nodes
                    .get_mut(&id)
                    .ok_or_else(|| format!("unknown node {id}"))?;
                node.decommissioned = true;
                MetaResponse::Done
            }
            // Written by nodes of protocol version 2 and older (reading orders now go to
            // the query's initiator): still applied, as a log may hold them.
            MetaCommand::Lineage { node, entries } => {
                for entry in entries {
                    let query = self
                        .lineage
                        .entry(entry.query)
                        .or_insert_with(|| QueryLineage {
                            initiator: entry.initiator,
                            inboxes: Vec::new(),
                        });
                    // Entries are independent: a gap in one (never expected) fails only
                    // that inbox's replay later, which then falls back to a restart.
                    let _ = query.append(node, &entry);
                }
                MetaResponse::Done
            }
            MetaCommand::LineageEnd { query } => {
                self.lineage.remove(&query);
                MetaResponse::Done
            }
            MetaCommand::CreateTag { name, epoch } => {
                self.may(by, Action::KeepHistory)?;
                MetaResponse::Epoch(self.create_tag(name, epoch)?)
            }
            MetaCommand::SetRetention { table, retention } => {
                if self.tables.contains_key(&table) {
                    self.may(by, Action::AlterTable(&table))?;
                }
                MetaResponse::Epoch(self.set_retention(table, retention)?)
            }
            MetaCommand::AlterTable { table, alter } => {
                let def = self
                    .tables
                    .get(&table)
                    .ok_or_else(|| format!("table {table:?} does not exist"))?;
                self.may(by, Action::AlterTable(&table))?;
                let altered = def
                    .altered(&alter, self.next_epoch)
                    .map_err(|e| e.to_string())?;
                self.tables.insert(table, altered.clone());
                effects.push(LocalEffect::EnsureTable(altered));
                MetaResponse::Done
            }
            MetaCommand::DropTag { name } => {
                self.may(by, Action::KeepHistory)?;
                self.tags
                    .remove(&name)
                    .ok_or_else(|| format!("tag {name:?} does not exist"))?;
                self.drop_untagged_archives();
                MetaResponse::Done
            }
            MetaCommand::ReplaceNode { id } => {
                self.replace_node(id)?;
                MetaResponse::Done
            }
            MetaCommand::RecordArchive { archived } => {
                self.record_archive(archived)?;
                MetaResponse::Done
            }
            MetaCommand::MoveFragment {
                component,
                index,
                to,
            } => {
                self.move_fragment(component, index, to)?;
                MetaResponse::Done
            }
            MetaCommand::Stamped { .. } | MetaCommand::As { .. } => {
                unreachable!("unwrapped above")
            }
        };
        Ok((response, effects))
    }

    /// Records that node `id` now runs as `incarnation` and aborts the epochs its earlier
    /// processes opened: no process is left to finish them.
    fn enter_incarnation(&mut self, id: NodeId, incarnation: u64, effects: &mut Vec<LocalEffect>) {
        let node = self.nodes.get_mut(&id).expect("caller checked membership");
        assert!(incarnation > node.incarnation, "incarnations only rise");
        node.incarnation = incarnation;
        self.abort_epochs_opened_before(id, incarnation, effects);
    }

    /// Aborts the open epochs that `coordinator` opened as an incarnation below `incarnation`.
    fn abort_epochs_opened_before(
        &mut self,
        coordinator: NodeId,
        incarnation: u64,
        effects: &mut Vec<LocalEffect>,
    ) {
        let orphaned: Vec<Epoch> = self
            .open
            .iter()
            .filter(|(_, open)| open.coordinator == coordinator && open.incarnation < incarnation)
            .map(|(epoch, _)| *epoch)
            .collect();
        for epoch in orphaned {
            tracing::info!(%epoch, %coordinator, "aborting an epoch whose coordinator is gone");
            self.decide(epoch, false);
            effects.push(LocalEffect::Abort(epoch));
        }
    }

    pub(crate) fn decide(&mut self, epoch: Epoch, committed: bool) {
        self.open.remove(&epoch);
        if !committed {
            self.aborted.insert(epoch);
        }
        self.decided_above_visible.insert(epoch);
        while self.decided_above_visible.remove(&self.visible.next()) {
            self.visible = self.visible.next();
            self.log_visible(self.visible);
        }
        self.derive_aborts();
    }

    /// Drops the aborted epochs at or below `visible` from `aborted`: the epoch log tells
    /// them from there on (every committed epoch is in it, and every epoch at or below
    /// `visible` is decided). Deterministic, as everything applied is.
    fn derive_aborts(&mut self) {
        if self.aborts_derived_from.is_zero() {
            // A state from before the epoch log (bootstrap sets this): aborts are told by
            // the log from its first epoch on, and earlier ones stay in the set.
            match self.epoch_log.keys().next() {
                Some(&first) => self.aborts_derived_from = first,
                None => return,
            }
        }
        while let Some(&oldest) = self.aborted.range(self.aborts_derived_from..).next() {
            if oldest > self.visible {
                break;
            }
            debug_assert!(
                !self.epoch_log.contains_key(&oldest),
                "epoch {oldest} is both committed and aborted"
            );
            self.aborted.remove(&oldest);
            self.aborts_derived += 1;
        }
    }
}

mod commands;
mod lease_queue;
mod lineage;
mod members;
mod placement;
mod write_conflicts;

#[cfg(test)]
mod access_tests;
#[cfg(test)]
mod compaction_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod placement_tests;
#[cfg(test)]
mod seal_tests;
#[cfg(test)]
mod tests;
