//! The metadata service: a Raft group (openraft) over [`MetaState`].

pub mod log_store;
pub mod state;
pub mod state_machine;

pub use state::{
    InboxLineage, LineageEntry, MetaCommand, MetaResponse, MetaState, NodeInfo, PartitionMap,
    Placement, QueryLineage,
};
pub use state_machine::MetaView;
use std::io::Cursor;

openraft::declare_raft_types!(
    /// Raft types of the metadata group.
    pub TypeConfig:
        D = MetaCommand,
        R = MetaResponse,
);

pub type Raft = openraft::Raft<TypeConfig>;
