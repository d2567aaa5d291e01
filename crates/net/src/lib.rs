//! The transport between Tessera nodes: Arrow Flight over gRPC, and nothing above it.
//!
//! - `do_action` carries small JSON requests and replies ([`Clients::action`]);
//! - `do_put` carries a stream of Arrow batches whose first message names the request
//!   ([`Clients::put`], [`Clients::put_flight`]);
//! - `do_get` streams batches or raw messages back for a request ([`Clients::get`],
//!   [`Clients::get_messages`]).
//!
//! Every request travels in an [`Envelope`] naming the cluster and protocol version; a
//! node refuses one meant for another cluster or spoken in another version ([`Gate`]).
//! The layers above own their request types: a `do_get` or `do_put` request is a
//! [`WireRequest`], which travels tagged with its kind (`{"Kind": {...}}`), and a server
//! routes it by that tag ([`TaggedRequest`]) to the layer that decodes it.
//!
//! Architecture invariant: this crate knows nothing of metadata, storage or queries; it
//! moves bytes, batches and JSON between addresses, with deadlines.

mod clients;
mod envelope;
mod error;

pub use clients::{
    wire_encoder, Clients, CONNECTION_WINDOW_BYTES, MAX_MESSAGE_BYTES, STREAM_WINDOW_BYTES,
};
pub use envelope::{
    encode_envelope, encode_envelope_from, encode_request, Caller, Envelope, Gate, TaggedRequest,
    WireRequest, ANY_CLUSTER, PROTOCOL_VERSION,
};
pub use error::{CallError, Refusal};

use serde::{Deserialize, Serialize};

pub use tessera_common::NodeId;

/// The action every node answers first: who it is.
pub const ACTION_HELLO: &str = "hello";

/// A node's answer to `hello`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Identity {
    pub node_id: NodeId,
    pub cluster_id: String,
    pub protocol: u32,
}
