//! The requests of the cluster's protocols between nodes, on the transport of
//! [`tessera_net`] (Arrow Flight over gRPC):
//!
//! - `do_action` carries small JSON requests: `hello`, the Raft messages, metadata writes,
//!   heartbeats and status;
//! - `do_put` carries a publish's rows to a replica ([`PrepareRequest`]), a client's rows
//!   to publish ([`PublishRequest`]), and a query's exchange batches ([`ExchangeHeader`]);
//! - `do_get` streams rows back: live rows at an epoch ([`ScanRequest`]), a partition's
//!   versions or export, a component's bytes, a query's channel reports and spools, and a
//!   client's SQL answers ([`SqlRequest`]).
//!
//! Each layer owns its requests (each a [`WireRequest`], tagged on the wire with its
//! kind); this module gathers them for the dispatcher. The tags are those of the enums
//! these types replaced, so the encoding is unchanged (pinned by `tests/wire_golden.rs`).

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
/// The metadata as of a linearizable read (every table and epoch committed before the
/// call), or a refusal: what a client asks when it must act on the current catalog.
pub const ACTION_CURRENT_METADATA: &str = "current-metadata";

pub use tessera_exec::wire::{ExchangeHeader, ScanRequest, ACTION_QUERY_END};
pub use tessera_recovery::SpoolRequest;

pub use crate::sql_answers::{SqlMark, SqlRequest};
