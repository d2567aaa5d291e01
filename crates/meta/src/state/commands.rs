//! The commands the metadata state machine applies, its answers, and what an applied
//! command asks of the local store.

use super::*;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum MetaCommand {
    /// The first entry: the cluster's identity, its founding nodes and their partition map.
    Bootstrap {
        cluster_id: String,
        partition_count: u32,
        replication: u32,
        /// Replicas apply rows as they commit rather than keep them in the log.
        #[serde(default)]
        hot_standby: bool,
        nodes: Vec<(NodeId, String)>,
    },
    /// A node asks to be a member (a no-op for one already known at this address).
    RegisterNode {
        id: NodeId,
        addr: String,
        /// It registers as a compute-only node, to be given no partitions.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        compute: bool,
    },
    /// The metadata leader's failure detector (or a returning node's heartbeat) speaks.
    SetLiveness {
        id: NodeId,
        alive: bool,
    },
    CreateTable {
        def: TableDef,
    },
    DropTable {
        name: String,
    },
    /// A node's process started. The epochs its earlier processes left open are aborted: a
    /// node killed and restarted before the failure detector noticed would otherwise leave
    /// them open for ever, holding their tables' leases and the visible epoch back.
    Started {
        id: NodeId,
        incarnation: u64,
    },
    /// Allocates an epoch for `coordinator`, which holds the ownership lease of `tables`
    /// until the epoch is decided.
    AllocateEpoch {
        coordinator: NodeId,
        /// The coordinator's process (see [`NodeInfo::incarnation`]).
        #[serde(default)]
        incarnation: u64,
        tables: Vec<String>,
        /// Chosen by the coordinator, so a retried request (its reply was lost in a leader
        /// change) gets the same epoch instead of leaking a second one that holds the lease.
        request: u64,
        /// The epoch the statement behind the publish read each of these tables at: the
        /// allocation is refused as a write conflict if one changed after it.
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        read_at: tessera_common::ReadEpochs,
    },
    /// Every touched partition has durably logged its rows on the replicas not in `missed`.
    CommitEpoch {
        epoch: Epoch,
        missed: Vec<(PartitionId, NodeId)>,
        /// The rows a publish wrote, per table, for the epoch log; `None` for an epoch that
        /// changed placement only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        changes: Option<Vec<TableChangeCount>>,
        /// A publish's version ids and signature (see [`crate::seal`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seal: Option<crate::seal::EpochSeal>,
        /// The fewest replicas of each touched partition that must hold every committed
        /// epoch once this one commits (the coordinator's `replicas.min_copies`); `None`
        /// (entries logged before the setting existed, and epochs that move no rows)
        /// asks for one. See [`copies_needed`](crate::state::copies_needed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min_copies: Option<u32>,
    },
    AbortEpoch {
        epoch: Epoch,
        reason: String,
    },
    /// Replaces the partition map (membership change), in one entry.
    SetPartitionMap {
        map: PartitionMap,
        /// The rebalance's epoch, which leases every table: the map (its stale marks
        /// above all) was computed while no other epoch could commit, and holds only
        /// while that epoch is open. Once it is aborted (its coordinator declared failed),
        /// epochs committed since may have marked replicas stale that this map would
        /// clear: it is refused.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rebalance: Option<Epoch>,
    },
    /// Starts moving a node's partitions away.
    Leave {
        id: NodeId,
    },
    /// Retires a node that holds no partitions.
    Decommission {
        id: NodeId,
    },
    /// Reading orders of query inboxes on `node` (write-ahead lineage), as nodes of
    /// protocol version 2 and older logged them; nodes now log them with the query's
    /// initiator. Still applied, since an upgraded cluster's log may hold some.
    Lineage {
        node: NodeId,
        entries: Vec<LineageEntry>,
    },
    /// A query ended: its lineage is no longer needed (written by protocol 2 and older).
    LineageEnd {
        query: QueryId,
    },
    /// A user who may log in to the SQL endpoints (refused if the name is taken): a user
    /// of `participant`, or with none a cluster administrator.
    CreateUser {
        name: String,
        secret: ScramSecret,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        participant: Option<String>,
    },
    /// A new password for an existing user.
    AlterUser {
        name: String,
        secret: ScramSecret,
    },
    DropUser {
        name: String,
    },
    /// Pins a name to an epoch (the visible one if `None`) for `AS OF TAG`.
    CreateTag {
        name: String,
        epoch: Option<Epoch>,
    },
    DropTag {
        name: String,
    },
    /// Sets how much of a table's history is kept (`ALTER TABLE t SET (retain_epochs =
    /// n)`); answers the new retention horizon.
    SetRetention {
        table: String,
        retention: crate::retention::Retention,
    },
    /// ALTER TABLE: a column added, dropped, renamed or widened. Epochs allocated from now
    /// on see it; earlier ones the columns as they were.
    AlterTable {
        table: String,
        alter: tessera_storage::evolution::AlterColumn,
    },
    /// An organization sharing the cluster (see [`crate::access`]).
    CreateParticipant {
        name: String,
    },
    /// Refused while it owns tables or has users.
    DropParticipant {
        name: String,
    },
    Grant {
        user: String,
        role: Role,
    },
    Revoke {
        user: String,
        role: Role,
    },
    /// `ALTER TABLE t OWNER TO p`: moves the table's ownership, and with it the right to
    /// hold its one-writer lease, in one entry (see [`MetaState::hand_over`]).
    SetTableOwner {
        table: String,
        owner: String,
    },
    /// `tessera verify` found a replica whose versions do not reproduce the signed version
    /// ids: it may no longer serve the partition until copied whole from a good replica.
    MarkCorrupt {
        node: NodeId,
        partition: PartitionId,
        reason: String,
    },
    /// Registers a public key the participant signs its epochs with (see [`crate::seal`]).
    AddParticipantKey {
        participant: String,
        key: String,
    },
    /// Node `id` returns with its data gone (a wiped or replaced disk): its replicas are
    /// copied to it whole (see [`MetaState::replace_node`]).
    ReplaceNode {
        id: NodeId,
    },
    /// A table's epoch is in the archive: every fragment is durable on its node (see
    /// [`crate::archive`]).
    RecordArchive {
        archived: crate::archive::ArchivedEpoch,
    },
    /// A fragment of an archived component was rebuilt on node `to` (its holder is gone,
    /// or was).
    MoveFragment {
        component: ComponentHash,
        index: u32,
        to: NodeId,
    },
    /// A command on behalf of `user`, who must be allowed to do it (see
    /// [`crate::access`]); a command not wrapped comes from the operator or the node.
    As {
        user: String,
        command: Box<MetaCommand>,
    },
    /// A command as the metadata leader proposed it, stamped with the leader's clock
    /// (milliseconds since the Unix epoch): the time the epoch log records.
    Stamped {
        at_ms: u64,
        command: Box<MetaCommand>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum MetaResponse {
    Done,
    Epoch(Epoch),
    /// The command was refused; the state is unchanged.
    Refused(String),
    /// A table is leased to another writer; retrying later may succeed.
    TableBusy(String),
    /// A table changed after the statement behind a publish read it: that statement must
    /// run again, reading the change (see `AllocateEpoch::read_at`).
    WriteConflict(String),
    /// The coordinator was declared failed (perhaps falsely, if it was only slow): it may not
    /// take an epoch, and its open epochs were aborted. Once it is alive again it may retry.
    Fenced(String),
}

/// What an applied command asks of the local store.
#[derive(Debug, Clone, PartialEq)]
pub enum LocalEffect {
    EnsureTable(TableDef),
    DropTable { name: String, generation: u64 },
    Commit(Epoch),
    Abort(Epoch),
}
