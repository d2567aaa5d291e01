//! The metadata service (DESIGN §3, §5): a Raft group (openraft) over [`MetaState`] — the
//! members and their liveness, the partition map, the catalog, epochs and their leases (and
//! the lineage of running queries older nodes logged here) — and [`MetaClient`], the handle every other layer
//! reads and writes it through.
//!
//! - [`state`]: the deterministic state machine: commands, their effects, the invariants.
//! - [`log_store`], [`state_machine`]: Raft's durable log and the applied state with its
//!   snapshots; applying an entry hands the local store its [`LocalEffect`]s.
//! - [`network`]: Raft messages between nodes, as Flight actions.
//! - [`quorum_check`]: a leader no majority acknowledges steps down.
//! - [`client`]: writes through the leader wherever it is, linearizable catch-up, waits on
//!   the applied state.
//!
//! Architecture invariant: this crate decides nothing about data movement or queries; it
//! records what the layers above decide, and applies it deterministically on every node.
//! API boundary: [`MetaClient`] for reads and writes; [`MetaState`] for reading a view.

pub mod access;
pub mod archive;
pub mod client;
pub mod error;
pub mod history;
pub mod history_compaction;
pub mod log_store;
pub mod network;
pub mod quorum_check;
pub mod retention;
pub mod seal;
pub mod state;
pub mod state_machine;
pub mod wire;

pub use access::{
    Action, AuditEvent, AuditRecord, ParticipantRecord, RegisteredKey, Role, Standing, DENIED,
};
pub use client::{MetaClient, LINEARIZABLE_READ_PATIENCE};
pub use error::MetaError;
pub use history::{EpochKind, EpochRecord, TableChangeCount, TagRecord};
pub use retention::{Retention, TableRetention};
pub use seal::{EpochSeal, EpochSignature, SignatureStatus, TableVersion};
pub use state::{
    copies_needed, InboxLineage, LineageEntry, LocalEffect, MetaCommand, MetaResponse, MetaState,
    NodeInfo, OpenEpoch, PartitionMap, Placement, QueryLineage,
};
pub use state_machine::MetaView;
use std::io::Cursor;
pub use tessera_common::NodeId;

openraft::declare_raft_types!(
    /// Raft types of the metadata group.
    pub TypeConfig:
        D = MetaCommand,
        R = MetaResponse,
        NodeId = NodeId,
);

pub type Raft = openraft::Raft<TypeConfig>;
