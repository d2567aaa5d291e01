//! The replication protocols' requests between nodes, and what they carry. Their wire
//! tags are those of the enums they replaced (pinned by the cluster's wire golden test).

use crate::NodeId;
use arrow::array::RecordBatch;
use arrow_flight::FlightData;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tessera_common::{ComponentHash, Epoch, PartitionId};
use tessera_net::{CallError, Clients, WireRequest};
use tessera_storage::prepared::EncodedRows;
use tessera_storage::ComponentMeta;

/// The rows of one table a coordinator sends a partition primary for an epoch (or a
/// primary ships on to a replica): its upserts, its deletes or its before images.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareRequest {
    pub epoch: Epoch,
    pub table: String,
    /// Upserts carry the table's columns; deletes its key columns.
    pub deletes: bool,
    /// The rows are before images, not versions (the table's columns; see
    /// `tessera_storage::TableChanges::before_images`). Left out of the encoding when
    /// false, so a prepare of versions is encoded as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub before_images: bool,
    /// Replicas the receiver ships the rows on to (log shipping, DESIGN §6): it answers
    /// only once it and every one of them has logged them, or names those that could not
    /// be reached.
    #[serde(default)]
    pub forward: Vec<Forward>,
    /// The stream carries the rows as the head of their log shipping logged them: stamped
    /// row versions, encoded once (`tessera_storage::prepared`), one Flight message per
    /// partition naming it ([`logged_rows_message`]), to be logged as they are. Set on
    /// the streams a head ships on to the other replicas; left out of the encoding when
    /// false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub as_logged: bool,
}

impl WireRequest for PrepareRequest {
    const KIND: &'static str = "Prepare";
}

impl PrepareRequest {
    pub fn rows(&self) -> PreparedRows {
        match (self.deletes, self.before_images) {
            (true, _) => PreparedRows::Deletes,
            (false, true) => PreparedRows::BeforeImages,
            (false, false) => PreparedRows::Upserts,
        }
    }
}

/// Which of a table's rows one prepare stream carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PreparedRows {
    Upserts,
    Deletes,
    BeforeImages,
}

/// A replica that must log the rows of some partitions of a prepare stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Forward {
    pub node: NodeId,
    pub partitions: Vec<PartitionId>,
    /// The publish cannot go on without this replica (one of the last current replicas of
    /// a partition): the head waits for it up to the open-epoch timeout rather than give
    /// it up after `failure.progress_timeout_ms` (see [`crate::Patience`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last_copy: bool,
}

/// A primary's answer to a prepare: the replicas it could not reach (they missed the
/// epoch). Every other replica it was asked to ship to logged the rows durably.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PrepareReply {
    pub unreachable: Vec<NodeId>,
}

/// What a prepare stream sends.
pub enum PrepareRows {
    /// Rows to check, stamp and log: a coordinator's, to the head of their log shipping.
    Batches(futures::stream::BoxStream<'static, RecordBatch>),
    /// Rows as the head logged them: its streams on to the other replicas.
    AsLogged(futures::stream::BoxStream<'static, FlightData>),
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
    decode_prepare_reply(addr, &metadata)
}

/// Sends a head's logged rows on to a replica ([`PrepareRequest::as_logged`]); returns
/// once it has logged them durably.
pub async fn prepare_as_logged(
    clients: &Clients,
    addr: &str,
    request: &PrepareRequest,
    messages: impl Stream<Item = FlightData> + Send + 'static,
) -> Result<PrepareReply, CallError> {
    let metadata = clients.put_flight(addr, request, messages).await?;
    decode_prepare_reply(addr, &metadata)
}

/// The message that declares the stored schema of the logged rows after it.
pub fn logged_schema_message(rows: &EncodedRows) -> FlightData {
    FlightData {
        data_header: rows.schema.clone(),
        ..Default::default()
    }
}

/// One partition's logged rows as a Flight message: the batch message, the partition in
/// its `app_metadata` (u32, little-endian).
pub fn logged_rows_message(partition: PartitionId, rows: &EncodedRows) -> FlightData {
    FlightData {
        data_header: rows.header.clone(),
        data_body: rows.body.clone(),
        app_metadata: bytes::Bytes::copy_from_slice(&partition.0.to_le_bytes()),
        ..Default::default()
    }
}

/// What one message of an as-logged prepare stream is.
pub enum LoggedMessage {
    /// The stored schema of the rows after it.
    Schema(bytes::Bytes),
    /// One partition's rows.
    Rows(PartitionId, bytes::Bytes, bytes::Bytes),
    /// Nothing (the lone message of a stream without rows, which names the request).
    Empty,
}

impl LoggedMessage {
    /// Reads a message's kind from its header; the rows themselves are checked as the
    /// store logs them (`EncodedRows::received`).
    pub fn of(message: FlightData) -> Result<LoggedMessage, String> {
        if message.data_header.is_empty() {
            return Ok(LoggedMessage::Empty);
        }
        if message.app_metadata.is_empty() {
            return Ok(LoggedMessage::Schema(message.data_header));
        }
        let partition: [u8; 4] = message.app_metadata[..].try_into().map_err(|_| {
            format!(
                "a logged rows message names its partition in 4 bytes of app_metadata, not {}",
                message.app_metadata.len()
            )
        })?;
        Ok(LoggedMessage::Rows(
            PartitionId(u32::from_le_bytes(partition)),
            message.data_header,
            message.data_body,
        ))
    }
}

/// A replica's prepare reply. An empty one is an error, not a success: a replica always
/// answers with the replicas it could not reach, so a stream that ended without that answer
/// (a truncated reply) proves nothing was logged.
fn decode_prepare_reply(addr: &str, metadata: &[u8]) -> Result<PrepareReply, CallError> {
    let undecodable = |reason: String| CallError::Undecodable {
        what: "prepare reply",
        addr: addr.to_string(),
        reason,
    };
    if metadata.is_empty() {
        return Err(undecodable(
            "the stream ended without one, so the rows may not be logged".into(),
        ));
    }
    serde_json::from_slice(metadata).map_err(|e| undecodable(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logged_messages_are_told_apart_and_a_malformed_partition_is_refused_by_name() {
        let batch = arrow::array::RecordBatch::try_from_iter([(
            "k",
            std::sync::Arc::new(arrow::array::Int64Array::from(vec![1, 2]))
                as arrow::array::ArrayRef,
        )])
        .unwrap();
        let rows = EncodedRows::encode(&batch).unwrap();
        assert!(matches!(
            LoggedMessage::of(logged_schema_message(&rows)),
            Ok(LoggedMessage::Schema(schema)) if schema == rows.schema
        ));
        match LoggedMessage::of(logged_rows_message(PartitionId(7), &rows)) {
            Ok(LoggedMessage::Rows(partition, header, body)) => {
                assert_eq!(partition, PartitionId(7));
                assert_eq!((header, body), (rows.header.clone(), rows.body.clone()));
            }
            _ => panic!("a rows message"),
        }
        assert!(matches!(
            LoggedMessage::of(FlightData::default()),
            Ok(LoggedMessage::Empty)
        ));
        let mut torn = logged_rows_message(PartitionId(7), &rows);
        torn.app_metadata = bytes::Bytes::from_static(&[7, 0]);
        let refused = LoggedMessage::of(torn).err().unwrap();
        assert!(
            refused.contains("4 bytes of app_metadata, not 2"),
            "{refused}"
        );
    }

    #[test]
    fn only_a_complete_prepare_reply_counts_as_logged() {
        let reply = PrepareReply {
            unreachable: vec![NodeId(3)],
        };
        let encoded = serde_json::to_vec(&reply).unwrap();
        assert_eq!(decode_prepare_reply("a:1", &encoded).unwrap(), reply);
        let empty = decode_prepare_reply("a:1", b"").unwrap_err().to_string();
        assert!(empty.contains("ended without one"), "{empty}");
        let torn = decode_prepare_reply("a:1", &encoded[..encoded.len() - 2])
            .unwrap_err()
            .to_string();
        assert!(torn.contains("prepare reply"), "{torn}");
    }
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

pub const ACTION_DECOMMISSION: &str = "decommission";

/// The first column of every `prepare` batch: the partition of each row.
pub const PARTITION_COLUMN: &str = "__tessera_partition";

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

/// Bytes per message when a component travels.
pub const COMPONENT_CHUNK_BYTES: usize = 4 << 20;

/// The leader asks a node to copy partitions it is about to hold.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CopyRequest {
    pub moves: Vec<PartitionMove>,
    /// (table, generation) of every table.
    pub tables: Vec<(String, u64)>,
    /// The rebalance's epoch: the target installs nothing over versions newer than it (a
    /// copy that outlived its aborted rebalance). `None` from senders that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<Epoch>,
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
/// The metadata leader asks each target, before a rebalance takes every table's lease, to
/// fetch what its copies will need ([`CopyRequest`], without an epoch): the components of
/// its whole copies, and its deltas up to the epochs decided then. (The name is from when
/// it fetched only components.)
pub const ACTION_PREFETCH_COMPONENTS: &str = "prefetch-components";

/// A standby asks a primary to checkpoint (flush) now, before it truncates its own log.
pub const ACTION_FLUSH: &str = "flush";
/// A client asks a node, once a bulk load is done, to flush and merge each partition it
/// holds (but a cold standby's) down to one component, then ship them to the standbys.
pub const ACTION_SETTLE: &str = "settle";
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
