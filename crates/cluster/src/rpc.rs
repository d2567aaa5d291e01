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

use crate::NodeId;
use arrow::array::RecordBatch;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tessera_common::{ComponentHash, Epoch, PartitionId};
use tessera_storage::ComponentMeta;

pub use tessera_net::{
    encode_envelope, CallError, Clients, Envelope, Identity, Refusal, WireRequest, ACTION_HELLO,
    ANY_CLUSTER, MAX_MESSAGE_BYTES, PROTOCOL_VERSION,
};

pub use tessera_meta::wire::{
    Heartbeat, ACTION_HEARTBEAT, ACTION_META_WRITE, ACTION_RAFT_APPEND, ACTION_RAFT_SNAPSHOT,
    ACTION_RAFT_VOTE, ACTION_READ_INDEX,
};

pub const ACTION_STATUS: &str = "status";

/// The rows of one table a coordinator sends a partition primary for an epoch (or a
/// primary ships on to a replica).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareRequest {
    pub epoch: Epoch,
    pub table: String,
    /// Upserts carry the table's columns; deletes its key columns.
    pub deletes: bool,
    /// Replicas the receiver ships the rows on to (log shipping, DESIGN §6): it answers
    /// only once it and every one of them has logged them, or names those that could not
    /// be reached.
    #[serde(default)]
    pub forward: Vec<Forward>,
}

impl WireRequest for PrepareRequest {
    const KIND: &'static str = "Prepare";
}

/// A replica that must log the rows of some partitions of a prepare stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Forward {
    pub node: NodeId,
    pub partitions: Vec<PartitionId>,
}

/// A primary's answer to a prepare: the replicas it could not reach (they missed the
/// epoch). Every other replica it was asked to ship to logged the rows durably.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PrepareReply {
    pub unreachable: Vec<NodeId>,
}

/// Sends rows for an epoch to a replica as they come (a primary shipping rows on while it
/// still receives them); returns once it has logged them durably.
pub async fn prepare(
    clients: &Clients,
    addr: &str,
    request: &PrepareRequest,
    batches: impl Stream<Item = RecordBatch> + Send + 'static,
) -> Result<PrepareReply, CallError> {
    let metadata = clients.put_stream(addr, request, batches).await?;
    if metadata.is_empty() {
        return Ok(PrepareReply::default());
    }
    serde_json::from_slice(&metadata).map_err(|e| CallError::Undecodable {
        what: "prepare reply",
        addr: addr.to_string(),
        reason: e.to_string(),
    })
}

/// A client's rows for one table, to publish as a new epoch (the receiver coordinates).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublishRequest {
    pub table: String,
    pub deletes: bool,
}

impl WireRequest for PublishRequest {
    const KIND: &'static str = "Publish";
}

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
pub const ACTION_DECOMMISSION: &str = "decommission";

/// The first column of every `prepare` batch: the partition of each row.
pub const PARTITION_COLUMN: &str = "__tessera_partition";

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

/// The stored row versions of one partition with an epoch at or above `since`: all of
/// them for a new replica, the missed delta for a returning one. The source first
/// catches up with the metadata leader, so it has applied every decided epoch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VersionsRequest {
    pub table: String,
    pub generation: u64,
    pub partition: PartitionId,
    pub since: Epoch,
}

impl WireRequest for VersionsRequest {
    const KIND: &'static str = "Versions";
}

/// What a new replica of one partition copies: the stream carries the versions still
/// in memory, and its first message's metadata lists the components (JSON
/// `Vec<ComponentMeta>`) to fetch by hash.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExportRequest {
    pub table: String,
    pub generation: u64,
    pub partition: PartitionId,
}

impl WireRequest for ExportRequest {
    const KIND: &'static str = "Export";
}

/// A partition's export from a node: its component list and in-memory versions.
pub async fn export(
    clients: &Clients,
    addr: &str,
    request: &ExportRequest,
) -> Result<(Vec<ComponentMeta>, Vec<RecordBatch>), CallError> {
    use arrow_flight::decode::DecodedPayload;
    let undecodable = |reason: String| CallError::Undecodable {
        what: "partition export",
        addr: addr.to_string(),
        reason,
    };
    let mut stream = clients.get_decoded(addr, request).await?;
    let mut components = None;
    let mut batches = Vec::new();
    while let Some(data) = stream.try_next().await? {
        match data.payload {
            DecodedPayload::Schema(_) => {
                components = Some(
                    serde_json::from_slice(&data.app_metadata())
                        .map_err(|e| undecodable(format!("its component list: {e}")))?,
                );
            }
            DecodedPayload::RecordBatch(batch) => batches.push(batch),
            DecodedPayload::None => {}
        }
    }
    let components = components.ok_or_else(|| undecodable("no component list".into()))?;
    Ok((components, batches))
}

/// The raw bytes of one component, in chunks (`data_body` only, no Arrow framing).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ComponentRequest {
    pub hash: ComponentHash,
}

impl WireRequest for ComponentRequest {
    const KIND: &'static str = "Component";
}

/// The bytes of one component from a node (the caller checks them against the hash).
pub async fn component(
    clients: &Clients,
    addr: &str,
    hash: ComponentHash,
) -> Result<Vec<u8>, CallError> {
    let mut stream = clients
        .get_messages(addr, &ComponentRequest { hash })
        .await?;
    let mut bytes = Vec::new();
    while let Some(data) = stream.next().await {
        bytes.extend_from_slice(&data?.data_body);
    }
    Ok(bytes)
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

/// Bytes per message when a component travels.
pub const COMPONENT_CHUNK_BYTES: usize = 4 << 20;

/// The leader asks a node to copy partitions it is about to hold.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CopyRequest {
    pub moves: Vec<PartitionMove>,
    /// (table, generation) of every table.
    pub tables: Vec<(String, u64)>,
}

/// One partition a node is to fetch: whole (`since` is epoch 0: a new replica) or only
/// the versions from `since` on (a returning replica that missed epochs from then).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct PartitionMove {
    pub partition: PartitionId,
    pub source: NodeId,
    pub since: Epoch,
}

pub const ACTION_COPY_PARTITIONS: &str = "copy-partitions";

/// A standby asks a primary to checkpoint (flush) now, before it truncates its own log.
pub const ACTION_FLUSH: &str = "flush";
/// A standby asks a primary for one partition's components: `(table, generation,
/// partition)`, answered by a [`ShippedManifest`].
pub const ACTION_SHIPPED_MANIFEST: &str = "shipped-manifest";
/// A primary tells a standby that partitions' components changed ([`ComponentsRequest`]).
pub const ACTION_COMPONENTS_READY: &str = "components-ready";

/// What a cold standby installs for one partition: the primary's components, and the
/// epoch through which they hold every version of the partition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShippedManifest {
    pub components: Vec<ComponentMeta>,
    pub covered: Epoch,
}

/// Partitions (table, generation, partition) whose components a standby should pull.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ComponentsRequest {
    pub partitions: Vec<(String, u64, PartitionId)>,
}
