//! The requests of the cluster's protocols between nodes, on the transport of
//! [`tessera_net`] (Arrow Flight over gRPC):
//!
//! - `do_action` carries small JSON requests: `hello`, the Raft messages, metadata writes,
//!   heartbeats and status;
//! - `do_put` carries a publish's rows to a replica ([`PrepareRequest`]), a client's rows
//!   to publish ([`PublishRequest`]), and a query's exchange batches ([`ExchangeHeader`]);
//! - `do_get` streams rows back: live rows at an epoch ([`ScanRequest`]), a partition's
//!   versions or export, a component's bytes, a query's channel reports and spools.
//!
//! Each `do_get`/`do_put` request is a [`WireRequest`] of its own, tagged on the wire with
//! its kind; the tags are those of the enums these types replaced, so the encoding is
//! unchanged (pinned by `tests/wire_golden.rs`).

use serde::{Deserialize, Serialize};
use tessera_common::{Epoch, PartitionId};

/// The replication protocols' requests (publish, log shipping, copies, component shipping).
pub use tessera_replication::wire::*;

pub use tessera_net::{
    encode_envelope, CallError, Clients, Envelope, Identity, Refusal, WireRequest, ACTION_HELLO,
    ANY_CLUSTER, MAX_MESSAGE_BYTES, PROTOCOL_VERSION,
};

pub use tessera_meta::wire::{
    Heartbeat, ACTION_HEARTBEAT, ACTION_META_WRITE, ACTION_RAFT_APPEND, ACTION_RAFT_SNAPSHOT,
    ACTION_RAFT_VOTE, ACTION_READ_INDEX,
};

pub const ACTION_STATUS: &str = "status";

/// Opens a producer channel's exchange stream to one node: every batch carries its
/// bucket and sequence number ([`crate::query::exchange::BatchTag`]) as metadata, and the
/// stream's end is the channel's end of stream in each of `buckets`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExchangeHeader {
    pub query: crate::query::QueryId,
    pub exchange: crate::query::StageId,
    /// The producer channel.
    pub sender: usize,
    /// Producer channels that feed each bucket (for the receiver's end-of-stream count).
    pub senders_per_bucket: usize,
    pub buckets: Vec<usize>,
    /// The query recovers by lineage: see [`crate::query::exchange::receive`].
    #[serde(default)]
    pub lineage: bool,
}

impl WireRequest for ExchangeHeader {
    const KIND: &'static str = "Exchange";
}

/// Ends a query on a node: stop its channels, drop its exchange buffers.
pub const ACTION_QUERY_END: &str = "query-end";

/// What a client's SQL produced, statement by statement.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum SqlOutput {
    /// Rows as an Arrow IPC stream, hex-encoded.
    Rows {
        ipc_hex: String,
    },
    Done {
        tag: String,
        epoch: Option<Epoch>,
    },
    /// Something the client should know, such as a query that recovered from a node's
    /// failure. Comes before the outputs of the request.
    Notice {
        message: String,
        /// Set when the notice tells how a query survived a node's death.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        recovery: Option<crate::query::RecoveryOutcome>,
    },
}

pub const ACTION_SQL: &str = "sql";
/// Live rows of some partitions of a table at an epoch, for queries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScanRequest {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
    pub partitions: Vec<PartitionId>,
    /// User column indices to return.
    pub columns: Vec<usize>,
}

impl WireRequest for ScanRequest {
    const KIND: &'static str = "Scan";
}

/// One producer channel's spooled batches for one bucket, from the first, following the
/// spool while the channel still writes it (lineage recovery).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpoolRequest {
    pub query: crate::query::QueryId,
    pub exchange: crate::query::StageId,
    pub channel: usize,
    pub bucket: usize,
}

impl WireRequest for SpoolRequest {
    const KIND: &'static str = "Spool";
}
