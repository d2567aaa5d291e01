//! Execution's requests between nodes, on the transport of [`tessera_net`]. The tags are
//! those of the enums these types replaced, so the encoding is unchanged (pinned by the
//! server's `tests/wire_golden.rs`). Starting channels is [`crate::run::RunRequest`].

use crate::{ChannelId, QueryId, StageId};
use serde::{Deserialize, Serialize};
use tessera_common::{Epoch, PartitionId};
use tessera_net::WireRequest;
use tessera_storage::versions::RowOrder;

/// Opens a producer channel's exchange stream to one node: every batch carries its
/// bucket and sequence number ([`crate::exchange::BatchTag`]) as metadata, and the
/// stream's end is the channel's end of stream in each of `buckets`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExchangeHeader {
    pub query: QueryId,
    pub exchange: StageId,
    /// The producer channel.
    pub sender: ChannelId,
    /// Producer channels that feed each bucket (for the receiver's end-of-stream count).
    pub senders_per_bucket: usize,
    pub buckets: Vec<usize>,
    /// The query recovers by lineage: see [`crate::exchange::receive`].
    #[serde(default)]
    pub lineage: bool,
}

impl WireRequest for ExchangeHeader {
    const KIND: &'static str = "Exchange";
}

/// Ends a query on a node: stop its channels, drop its exchange buffers.
pub const ACTION_QUERY_END: &str = "query-end";

/// Live rows of some partitions of a table at an epoch, for queries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScanRequest {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
    pub partitions: Vec<PartitionId>,
    /// User column indices to return (with `changes_since`, indices of the diff's columns).
    pub columns: Vec<usize>,
    /// Return the changes from this epoch to `epoch` instead of the rows at `epoch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changes_since: Option<Epoch>,
    /// The order each partition's rows come in (ignored for a diff).
    #[serde(default, skip_serializing_if = "RowOrder::is_logged")]
    pub order: RowOrder,
}

impl WireRequest for ScanRequest {
    const KIND: &'static str = "Scan";
}
