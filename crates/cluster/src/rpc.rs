//! The node-to-node protocol: Arrow Flight over gRPC.
//!
//! - `do_action` carries small JSON requests: `hello`, the Raft messages, metadata writes,
//!   heartbeats and status.
//! - `do_put` carries a publish's rows to a replica (`prepare`): batches of one table whose
//!   first column names each row's partition.
//! - `do_get` streams a table's live rows from some partitions at an epoch (`scan`).
//!
//! Every request names the cluster id and protocol version, and a node refuses requests
//! meant for another cluster or spoken in another version.

use crate::error::{ClusterError, Result};
use crate::NodeId;
use arrow::array::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightClient, FlightDescriptor, Ticket};
use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tessera_common::{ComponentHash, Epoch, PartitionId};
use tessera_storage::ComponentMeta;
use tonic::transport::{Channel, Endpoint};

/// Bumped whenever a request or reply changes shape.
pub const PROTOCOL_VERSION: u32 = 1;
/// The largest gRPC message accepted.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// The cluster id a client may send when it does not know it (SQL, publish, status).
pub const ANY_CLUSTER: &str = "*";

pub const ACTION_HELLO: &str = "hello";
pub const ACTION_RAFT_APPEND: &str = "raft-append";
pub const ACTION_RAFT_VOTE: &str = "raft-vote";
pub const ACTION_RAFT_SNAPSHOT: &str = "raft-snapshot";
pub const ACTION_META_WRITE: &str = "meta-write";
pub const ACTION_HEARTBEAT: &str = "heartbeat";
pub const ACTION_STATUS: &str = "status";
pub const ACTION_READ_INDEX: &str = "read-index";

/// Every request's wrapper: who it is for.
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope<T> {
    pub cluster_id: String,
    pub protocol: u32,
    pub body: T,
}

/// The bytes of one request as it travels: the action body, the `do_get` ticket or the
/// `do_put` descriptor command.
pub fn encode_envelope<T: Serialize>(cluster_id: &str, protocol: u32, body: T) -> Vec<u8> {
    serde_json::to_vec(&Envelope {
        cluster_id: cluster_id.to_string(),
        protocol,
        body,
    })
    .expect("requests serialize")
}

/// A node's answer to `hello`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Identity {
    pub node_id: NodeId,
    pub cluster_id: String,
    pub protocol: u32,
}

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

/// What a `do_put` stream carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PutRequest {
    /// A coordinator's rows for one replica.
    Prepare(PrepareRequest),
    /// A client's rows for one table, to publish as a new epoch (this node coordinates).
    Publish { table: String, deletes: bool },
    /// One producer channel's batches of a query exchange for this node.
    Exchange(ExchangeHeader),
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

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScanRequest {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
    pub partitions: Vec<PartitionId>,
    /// User column indices to return.
    pub columns: Vec<usize>,
}

/// What a `do_get` stream returns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum GetRequest {
    /// Live rows at an epoch, for queries.
    Scan(ScanRequest),
    /// The stored row versions of one partition with an epoch at or above `since`: all of
    /// them for a new replica, the missed delta for a returning one. The source first
    /// catches up with the metadata leader, so it has applied every decided epoch.
    Versions {
        table: String,
        generation: u64,
        partition: PartitionId,
        since: Epoch,
    },
    /// What a new replica of one partition copies: the stream carries the versions still
    /// in memory, and its first message's metadata lists the components (JSON
    /// `Vec<ComponentMeta>`) to fetch by hash.
    Export {
        table: String,
        generation: u64,
        partition: PartitionId,
    },
    /// The raw bytes of one component, in chunks (`data_body` only, no Arrow framing).
    Component { hash: ComponentHash },
    /// Runs channels of a distributed query on this node; the stream carries one
    /// [`crate::query::ChannelReport`] (JSON in `app_metadata`) per channel as it ends.
    RunStages(crate::query::run::RunRequest),
    /// One producer channel's spooled batches for one bucket, from the first, following
    /// the spool while the channel still writes it (lineage recovery).
    Spool {
        query: crate::query::QueryId,
        exchange: crate::query::StageId,
        channel: usize,
        bucket: usize,
    },
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

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Heartbeat {
    pub node_id: NodeId,
}

/// A refusal that the caller can act on, sent as the message of a gRPC error.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Refusal {
    WrongCluster { node_id: NodeId, cluster_id: String },
    VersionMismatch { node_id: NodeId, protocol: u32 },
    NotLeader { leader: Option<NodeId> },
    Failed(String),
}

impl Refusal {
    pub fn into_status(self) -> tonic::Status {
        let code = match self {
            Refusal::Failed(_) => tonic::Code::Internal,
            _ => tonic::Code::FailedPrecondition,
        };
        tonic::Status::new(
            code,
            serde_json::to_string(&self).expect("refusals serialize"),
        )
    }

    pub fn from_status(status: &tonic::Status) -> Refusal {
        serde_json::from_str(status.message())
            .unwrap_or_else(|_| Refusal::Failed(status.message().to_string()))
    }
}

/// Connections to other nodes, one channel per address, made lazily and reused.
pub struct Clients {
    cluster_id: String,
    protocol: u32,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Clients {
    pub fn new(cluster_id: &str, protocol: u32) -> Clients {
        Clients {
            cluster_id: cluster_id.to_string(),
            protocol,
            channels: Mutex::new(HashMap::new()),
        }
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    fn channel(&self, addr: &str) -> Result<Channel> {
        let mut channels = self.channels.lock().expect("channels lock");
        if let Some(channel) = channels.get(addr) {
            return Ok(channel.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| ClusterError::Rejected(format!("bad node address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            .initial_stream_window_size(crate::server::STREAM_WINDOW_BYTES)
            .initial_connection_window_size(crate::server::CONNECTION_WINDOW_BYTES)
            .http2_keep_alive_interval(Duration::from_millis(500))
            .keep_alive_timeout(Duration::from_secs(2));
        let channel = endpoint.connect_lazy();
        channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    /// Forgets a connection after an error so the next call reconnects.
    pub fn reset(&self, addr: &str) {
        self.channels.lock().expect("channels lock").remove(addr);
    }

    fn client(&self, addr: &str) -> Result<FlightClient> {
        let inner = FlightServiceClient::new(self.channel(addr)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(FlightClient::new_from_inner(inner))
    }

    fn envelope<T: Serialize>(&self, body: T) -> Vec<u8> {
        encode_envelope(&self.cluster_id, self.protocol, body)
    }

    /// Sends a JSON action and decodes its JSON reply.
    pub async fn action<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        kind: &str,
        body: Req,
        timeout: Duration,
    ) -> std::result::Result<Resp, CallError> {
        let call = async {
            let mut client = self.client(addr).map_err(CallError::Local)?;
            let action = Action::new(kind, Bytes::from(self.envelope(body)));
            let mut replies = client
                .do_action(action)
                .await
                .map_err(CallError::from_flight)?;
            let reply = replies
                .next()
                .await
                .ok_or_else(|| CallError::Transport("empty reply".into()))?
                .map_err(CallError::from_flight)?;
            serde_json::from_slice(&reply)
                .map_err(|e| CallError::Transport(format!("undecodable reply to {kind}: {e}")))
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(CallError::Transport(format!(
                "no reply to {kind} within {} ms",
                timeout.as_millis()
            ))),
        };
        if matches!(result, Err(CallError::Transport(_))) {
            self.reset(addr);
        }
        result
    }

    /// Sends rows for an epoch to a replica; returns once it has logged them durably.
    pub async fn prepare(
        &self,
        addr: &str,
        request: PrepareRequest,
        batches: Vec<RecordBatch>,
    ) -> std::result::Result<PrepareReply, CallError> {
        self.prepare_stream(addr, request, futures::stream::iter(batches))
            .await
    }

    /// As [`Clients::prepare`], sending rows as they come (a primary shipping rows on while
    /// it still receives them).
    pub async fn prepare_stream(
        &self,
        addr: &str,
        request: PrepareRequest,
        batches: impl Stream<Item = RecordBatch> + Send + 'static,
    ) -> std::result::Result<PrepareReply, CallError> {
        let metadata = self
            .put_stream(addr, PutRequest::Prepare(request), batches)
            .await?;
        if metadata.is_empty() {
            return Ok(PrepareReply::default());
        }
        serde_json::from_slice(&metadata).map_err(|e| {
            CallError::Local(ClusterError::Rejected(format!(
                "undecodable prepare reply: {e}"
            )))
        })
    }

    /// Sends a `do_put` stream; returns the reply's metadata.
    pub async fn put(
        &self,
        addr: &str,
        request: PutRequest,
        batches: Vec<RecordBatch>,
    ) -> std::result::Result<Bytes, CallError> {
        self.put_stream(addr, request, futures::stream::iter(batches))
            .await
    }

    async fn put_stream(
        &self,
        addr: &str,
        request: PutRequest,
        batches: impl Stream<Item = RecordBatch> + Send + 'static,
    ) -> std::result::Result<Bytes, CallError> {
        let mut client = self.client(addr).map_err(CallError::Local)?;
        let descriptor = FlightDescriptor::new_cmd(self.envelope(request));
        let stream = FlightDataEncoderBuilder::new()
            .with_flight_descriptor(Some(descriptor))
            .build(batches.map(Ok));
        let result = async {
            let replies = client
                .do_put(stream)
                .await
                .map_err(CallError::from_flight)?;
            let replies = replies
                .try_collect::<Vec<_>>()
                .await
                .map_err(CallError::from_flight)?;
            Ok(replies
                .into_iter()
                .next()
                .map(|r| r.app_metadata)
                .unwrap_or_default())
        }
        .await;
        if matches!(result, Err(CallError::Transport(_))) {
            self.reset(addr);
        }
        result
    }

    /// Sends a `do_put` stream of ready-made Flight messages, the request in the first
    /// one's descriptor; returns the reply's metadata.
    pub async fn put_flight(
        &self,
        addr: &str,
        request: PutRequest,
        messages: impl Stream<Item = arrow_flight::FlightData> + Send + 'static,
    ) -> std::result::Result<Bytes, CallError> {
        let mut client = FlightServiceClient::new(self.channel(addr).map_err(CallError::Local)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let descriptor = FlightDescriptor::new_cmd(self.envelope(request));
        let mut first = true;
        let messages = messages.map(move |mut message| {
            if std::mem::take(&mut first) {
                message.flight_descriptor = Some(descriptor.clone());
            }
            message
        });
        let status = |s: tonic::Status| CallError::from_flight(s.into());
        let result = async {
            let mut replies = client.do_put(messages).await.map_err(status)?.into_inner();
            let mut metadata = Bytes::new();
            while let Some(reply) = replies.message().await.map_err(status)? {
                metadata = reply.app_metadata;
            }
            Ok(metadata)
        }
        .await;
        if matches!(result, Err(CallError::Transport(_))) {
            self.reset(addr);
        }
        result
    }

    /// Starts channels of a query on a node; yields their reports as they end.
    pub async fn run_stages(
        &self,
        addr: &str,
        request: crate::query::run::RunRequest,
    ) -> std::result::Result<
        impl Stream<Item = std::result::Result<crate::query::run::StagesEvent, CallError>>,
        CallError,
    > {
        let mut client = FlightServiceClient::new(self.channel(addr).map_err(CallError::Local)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let ticket = Ticket::new(self.envelope(GetRequest::RunStages(request)));
        let status = |s: tonic::Status| CallError::from_flight(s.into());
        let stream = client.do_get(ticket).await.map_err(status)?.into_inner();
        Ok(stream.map(move |message| {
            let message = message.map_err(status)?;
            serde_json::from_slice(&message.app_metadata).map_err(|e| {
                CallError::Local(ClusterError::Rejected(format!(
                    "undecodable channel report: {e}"
                )))
            })
        }))
    }

    /// A partition's export from a node: its component list and in-memory versions.
    pub async fn export(
        &self,
        addr: &str,
        request: GetRequest,
    ) -> std::result::Result<(Vec<ComponentMeta>, Vec<RecordBatch>), CallError> {
        let mut client = self.client(addr).map_err(CallError::Local)?;
        let ticket = Ticket::new(self.envelope(request));
        let mut stream = client
            .do_get(ticket)
            .await
            .map_err(CallError::from_flight)?
            .into_inner();
        let mut components = None;
        let mut batches = Vec::new();
        while let Some(data) = stream.try_next().await.map_err(CallError::from_flight)? {
            match data.payload {
                arrow_flight::decode::DecodedPayload::Schema(_) => {
                    components =
                        Some(serde_json::from_slice(&data.app_metadata()).map_err(|e| {
                            CallError::Local(ClusterError::Rejected(format!(
                                "undecodable component list: {e}"
                            )))
                        })?);
                }
                arrow_flight::decode::DecodedPayload::RecordBatch(batch) => batches.push(batch),
                arrow_flight::decode::DecodedPayload::None => {}
            }
        }
        let components = components.ok_or_else(|| {
            CallError::Local(ClusterError::Rejected(
                "an export carried no component list".into(),
            ))
        })?;
        Ok((components, batches))
    }

    /// The bytes of one component from a node (the caller checks them against the hash).
    pub async fn component(
        &self,
        addr: &str,
        hash: ComponentHash,
    ) -> std::result::Result<Vec<u8>, CallError> {
        let mut client = FlightServiceClient::new(self.channel(addr).map_err(CallError::Local)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let ticket = Ticket::new(self.envelope(GetRequest::Component { hash }));
        let status = |s: tonic::Status| CallError::from_flight(s.into());
        let mut stream = client.do_get(ticket).await.map_err(status)?.into_inner();
        let mut bytes = Vec::new();
        while let Some(data) = stream.message().await.map_err(status)? {
            bytes.extend_from_slice(&data.data_body);
        }
        Ok(bytes)
    }

    /// Streams rows from a node: live rows for a scan, or a partition's versions.
    pub async fn get(
        &self,
        addr: &str,
        request: GetRequest,
    ) -> std::result::Result<
        impl Stream<Item = std::result::Result<RecordBatch, CallError>>,
        CallError,
    > {
        let mut client = self.client(addr).map_err(CallError::Local)?;
        let ticket = Ticket::new(self.envelope(request));
        let stream: FlightRecordBatchStream = client
            .do_get(ticket)
            .await
            .map_err(CallError::from_flight)?;
        Ok(stream.map_err(CallError::from_flight))
    }
}

/// Why a call to another node failed.
#[derive(Debug)]
pub enum CallError {
    /// The node could not be reached or did not answer: it may be down.
    Transport(String),
    /// The node answered and refused.
    Refused(Refusal),
    Local(ClusterError),
}

impl CallError {
    fn from_flight(error: arrow_flight::error::FlightError) -> CallError {
        match error {
            arrow_flight::error::FlightError::Tonic(status) => match status.code() {
                tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Cancelled
                | tonic::Code::Unknown => CallError::Transport(status.to_string()),
                _ => CallError::Refused(Refusal::from_status(&status)),
            },
            other => CallError::Transport(other.to_string()),
        }
    }

    pub fn is_transport(&self) -> bool {
        matches!(self, CallError::Transport(_))
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Transport(reason) => write!(f, "{reason}"),
            CallError::Refused(Refusal::Failed(reason)) => write!(f, "{reason}"),
            CallError::Refused(refusal) => write!(f, "{refusal:?}"),
            CallError::Local(e) => write!(f, "{e}"),
        }
    }
}
