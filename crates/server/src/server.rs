//! The RPC server of a node: the Flight service behind [`crate::rpc`].

use crate::meta::{MetaCommand, MetaResponse};
use crate::node::Node;
use crate::rpc::*;
use crate::NodeId;
use arrow::array::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tessera_common::tls::CertIdentity;
use tessera_common::PartitionId;
use tessera_exec::run::RunRequest;
use tessera_net::{Caller, TaggedRequest};
use tessera_replication::archive::{FragmentRequest, StoreFragmentRequest};
use tessera_storage::versions::stored_user_schema;
use tessera_storage::TableChanges;
use tonic::{Request, Response, Status, Streaming};

pub use crate::status::{node_status, HistorySizes, NodeStatus, TableCount, STATUS_HISTORY};

/// How long a request carrying rows waits for a starting node to announce its process.
const ANNOUNCE_PATIENCE: Duration = Duration::from_secs(10);

/// The HTTP/2 receive windows both ends of a connection use (see
/// [`tessera_net::CONNECTION_WINDOW_BYTES`] for why the connection's is so large).
use tessera_net::{CONNECTION_WINDOW_BYTES, STREAM_WINDOW_BYTES};

/// Serves the node's RPC on `listener` in the background.
pub fn serve(node: Arc<Node>, listener: tokio::net::TcpListener) {
    let gate = tessera_net::Gate {
        node_id: node.id(),
        cluster_id: node.config.cluster_id.clone(),
        protocol: node.protocol(),
    };
    let tls = node.mtls.as_ref().map(|tls| {
        tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                &tls.cert_pem,
                &tls.key_pem,
            ))
            .client_ca_root(tonic::transport::Certificate::from_pem(&tls.ca_pem))
    });
    let mtls = tls.is_some();
    let service = FlightServiceServer::new(NodeService { node, gate, mtls })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .expect("a TLS identity checked when the node started");
    }
    tokio::spawn(async move {
        if let Err(error) = builder
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!(%error, "RPC server stopped");
        }
    });
}

struct NodeService {
    node: Arc<Node>,
    gate: tessera_net::Gate,
    /// The port is under mutual TLS: every caller has a certificate of the cluster's CA.
    mtls: bool,
}

fn failed(error: impl std::fmt::Display) -> Status {
    Refusal::Failed(error.to_string()).into_status()
}

fn reply<T: Serialize>(
    value: &T,
) -> Result<Response<BoxStream<'static, Result<arrow_flight::Result, Status>>>, Status> {
    let body = serde_json::to_vec(value).map_err(failed)?;
    let item = arrow_flight::Result {
        body: Bytes::from(body),
    };
    Ok(Response::new(
        futures::stream::once(async { Ok(item) }).boxed(),
    ))
}

impl NodeService {
    /// Opens a node-to-node request, refusing one for another cluster or protocol version.
    fn open<T: DeserializeOwned>(&self, caller: &Caller, bytes: &[u8]) -> Result<T, Status> {
        self.gate.open(caller, bytes).map_err(Refusal::into_status)
    }

    /// Opens a client request: clients may leave the cluster id open (`*`).
    fn open_from_client<T: DeserializeOwned>(
        &self,
        caller: &Caller,
        bytes: &[u8],
    ) -> Result<T, Status> {
        self.gate
            .open_from_client(caller, bytes)
            .map_err(Refusal::into_status)
    }

    /// Opens a `do_get` or `do_put` request; the one kind `from_clients` names may also
    /// come from a client that does not know the cluster's id.
    fn open_tagged(
        &self,
        caller: &Caller,
        bytes: &[u8],
        from_clients: &str,
    ) -> Result<TaggedRequest, Status> {
        let envelope: Envelope<TaggedRequest> = self
            .gate
            .open_envelope(bytes)
            .map_err(Refusal::into_status)?;
        self.gate
            .check_caller(caller, envelope.from)
            .map_err(Refusal::into_status)?;
        self.gate
            .check_cluster(&envelope.cluster_id, envelope.body.kind == from_clients)
            .map_err(Refusal::into_status)?;
        Ok(envelope.body)
    }

    /// Who sent `request`: under mutual TLS, whom its certificate names.
    fn caller<T>(&self, request: &Request<T>) -> Caller {
        if !self.mtls {
            return Caller::Plaintext;
        }
        match request.peer_certs() {
            Some(chain) if !chain.is_empty() => Caller::Certified(
                tessera_common::tls::cert_identity(&chain[0])
                    .unwrap_or(tessera_common::tls::CertIdentity::Unknown(Vec::new())),
            ),
            _ => Caller::Uncertified,
        }
    }

    /// The user a client's request runs for: under mutual TLS, the user its certificate
    /// names (`NAME.client.tessera` is user `NAME`, who must exist once the cluster has
    /// users); the administrator's certificate, a node's, or a plaintext port: the
    /// operator (`None`).
    fn acting_user(&self, caller: &Caller) -> Result<Option<String>, Status> {
        let Caller::Certified(CertIdentity::Client(name)) = caller else {
            return Ok(None);
        };
        let view = self.node.meta.view();
        if name == tessera_common::tls::ADMIN_CLIENT || view.state.users.is_empty() {
            return Ok(None);
        }
        if !view.state.users.contains_key(name) {
            return Err(Refusal::Unauthenticated {
                node_id: self.node.id(),
                reason: format!(
                    "the client certificate names user {name:?}, but the cluster has no such user (CREATE USER {name} ... makes one; {} is the administrator's certificate)",
                    tessera_common::tls::client_dns_name(tessera_common::tls::ADMIN_CLIENT)
                ),
            }
            .into_status());
        }
        Ok(Some(name.clone()))
    }

    /// Under mutual TLS a node speaks only for itself: `what`, sent for node `id`, must come
    /// with node `id`'s certificate (not another node's, nor a client's).
    fn check_speaks_for(&self, caller: &Caller, id: NodeId, what: &str) -> Result<(), Status> {
        match caller {
            Caller::Plaintext => Ok(()),
            Caller::Certified(tessera_common::tls::CertIdentity::Node(node)) if *node == id => {
                Ok(())
            }
            Caller::Certified(identity) => Err(Refusal::Unauthenticated {
                node_id: self.node.id(),
                reason: format!("{what} for node {id} came with the certificate of {identity}"),
            }
            .into_status()),
            Caller::Uncertified => Err(Refusal::Unauthenticated {
                node_id: self.node.id(),
                reason: format!("{what} for node {id} came with no certificate"),
            }
            .into_status()),
        }
    }

    /// A Raft message speaks for the node its vote names (the leader sending entries or a
    /// snapshot, the candidate asking for a vote).
    fn check_raft_sender(
        &self,
        caller: &Caller,
        vote: &openraft::Vote<NodeId>,
        what: &str,
    ) -> Result<(), Status> {
        match vote.leader_id().voted_for() {
            Some(sender) => self.check_speaks_for(caller, sender, what),
            None => Ok(()),
        }
    }

    async fn action(
        &self,
        caller: Caller,
        action: Action,
    ) -> Result<Response<BoxStream<'static, Result<arrow_flight::Result, Status>>>, Status> {
        let node = &self.node;
        let body = action.body.as_ref();
        match action.r#type.as_str() {
            ACTION_HELLO => {
                self.open::<()>(&caller, body)?;
                reply(&node.identity())
            }
            ACTION_RAFT_APPEND => {
                let request: openraft::raft::AppendEntriesRequest<crate::meta::TypeConfig> =
                    self.open(&caller, body)?;
                self.check_raft_sender(&caller, &request.vote, "Raft entries")?;
                reply(&node.meta.raft().append_entries(request).await)
            }
            ACTION_RAFT_VOTE => {
                let request: openraft::raft::VoteRequest<NodeId> = self.open(&caller, body)?;
                self.check_raft_sender(&caller, &request.vote, "a Raft vote request")?;
                reply(&node.meta.raft().vote(request).await)
            }
            ACTION_RAFT_SNAPSHOT => {
                let request: openraft::raft::InstallSnapshotRequest<crate::meta::TypeConfig> =
                    self.open(&caller, body)?;
                self.check_raft_sender(&caller, &request.vote, "a Raft snapshot")?;
                reply(&node.meta.raft().install_snapshot(request).await)
            }
            ACTION_META_WRITE => {
                let command: MetaCommand = self.open(&caller, body)?;
                match &command {
                    MetaCommand::RegisterNode { id, .. } => {
                        self.check_speaks_for(&caller, *id, "a registration")?
                    }
                    MetaCommand::Started { id, .. } => {
                        self.check_speaks_for(&caller, *id, "a process start")?
                    }
                    _ => {}
                }
                let result: Result<MetaResponse, Refusal> = if node.meta.is_leader() {
                    node.meta
                        .write_as_leader(command)
                        .await
                        .map_err(|e| Refusal::Failed(e.to_string()))
                } else {
                    Err(Refusal::NotLeader {
                        leader: node.meta.leader(),
                    })
                };
                reply(&result)
            }
            ACTION_READ_INDEX => {
                self.open::<()>(&caller, body)?;
                reply(&node.meta.read_index().await)
            }
            ACTION_HEARTBEAT => {
                let (heartbeat, suspects): (Heartbeat, Vec<NodeId>) = self.open(&caller, body)?;
                self.check_speaks_for(&caller, heartbeat.node_id, "a heartbeat")?;
                node.heard_from(&heartbeat);
                for suspect in suspects {
                    node.suspect(suspect);
                }
                reply(&Ok::<(), Refusal>(()))
            }
            ACTION_QUERY_END => {
                let query: tessera_exec::QueryId = self.open(&caller, body)?;
                node.exec.end_query(query);
                reply(&Ok::<(), Refusal>(()))
            }
            tessera_recovery::held::ACTION_LOG_LINEAGE => {
                let (from, entries): (NodeId, Vec<tessera_meta::LineageEntry>) =
                    self.open(&caller, body)?;
                self.check_speaks_for(&caller, from, "query lineage")?;
                let taken = node
                    .lineage
                    .take_lineage(from, &entries)
                    .map_err(Refusal::Failed);
                reply(&taken)
            }
            tessera_recovery::held::ACTION_LOG_OUTPUT => {
                let (from, key): (NodeId, tessera_exec::hooks::BackupKey) =
                    self.open(&caller, body)?;
                self.check_speaks_for(&caller, from, "query output")?;
                let taken = node
                    .lineage
                    .take_output_start(from, key)
                    .map_err(Refusal::Failed);
                reply(&taken)
            }
            crate::node::ACTION_REPLACE_NODE => {
                let id: NodeId = self.open(&caller, body)?;
                self.check_speaks_for(&caller, id, "a replacement")?;
                let result = node
                    .replace(id)
                    .await
                    .map_err(|e| Refusal::Failed(e.to_string()));
                reply(&result)
            }
            ACTION_DECOMMISSION => {
                let id: NodeId = self.open_from_client(&caller, body)?;
                let result = node
                    .decommission(id)
                    .await
                    .map_err(|e| Refusal::Failed(e.to_string()));
                reply(&result)
            }
            ACTION_FLUSH => {
                // Clients may ask too (after a bulk load, so standbys scan what primaries do).
                self.open_from_client::<()>(&caller, body)?;
                let result = node
                    .flush_and_ship()
                    .await
                    .map_err(|e| Refusal::Failed(e.to_string()));
                reply(&result)
            }
            ACTION_SETTLE => {
                self.open_from_client::<()>(&caller, body)?;
                let result = node
                    .settle_and_ship()
                    .await
                    .map_err(|e| Refusal::Failed(e.to_string()));
                reply(&result)
            }
            ACTION_SHIPPED_MANIFEST => {
                let (table, generation, partition): (String, u64, PartitionId) =
                    self.open(&caller, body)?;
                // Only the partition's primary, as the metadata says now, ships: a node that
                // lost the role (it was failed over while cut off) may lack committed epochs
                // its components would claim to cover.
                let result = match self.check_primary_now(partition).await {
                    Err(refusal) => Err(refusal),
                    Ok(()) => match self.local_table(&table, generation) {
                        Ok(_) => node
                            .store
                            .shipped_manifest(&table, partition)
                            .map(|(components, covered)| ShippedManifest {
                                components,
                                covered,
                            })
                            .map_err(|e| Refusal::Failed(e.to_string())),
                        Err(status) => Err(Refusal::Failed(status.message().to_string())),
                    },
                };
                reply(&result)
            }
            ACTION_COMPONENTS_READY => {
                let request: ComponentsRequest = self.open(&caller, body)?;
                let node = node.clone();
                // Answered at once: the primary does not wait for its standbys' downloads.
                tokio::spawn(async move {
                    if let Err(error) =
                        crate::shipping::pull_from_primaries(&node.replication, request.partitions)
                            .await
                    {
                        tracing::warn!(%error, "pulling a primary's components failed; the next checkpoint retries");
                    }
                });
                reply(&Ok::<(), Refusal>(()))
            }
            ACTION_COPY_PARTITIONS => {
                let request: CopyRequest = self.open(&caller, body)?;
                let result = match node.wait_announced(ANNOUNCE_PATIENCE).await {
                    Ok(()) => crate::rebalance::copy_partitions(&node.replication, request)
                        .await
                        .map_err(|e| Refusal::Failed(e.to_string())),
                    Err(why) => Err(Refusal::Failed(why)),
                };
                reply(&result)
            }
            ACTION_PREFETCH_COMPONENTS => {
                let request: CopyRequest = self.open(&caller, body)?;
                let result = crate::rebalance::fetch_before_lease(&node.replication, request)
                    .await
                    .map_err(|e| Refusal::Failed(e.to_string()));
                reply(&result)
            }
            ACTION_CURRENT_METADATA => {
                self.open_from_client::<()>(&caller, body)?;
                let view = node
                    .meta
                    .read_linearizable(crate::meta::LINEARIZABLE_READ_PATIENCE)
                    .await
                    .map_err(|e| Refusal::Failed(e.to_string()).into_status())?;
                reply(&crate::status::newest_history(&view.state))
            }
            crate::verify::ACTION_PARTITION_DIGESTS => {
                let request: crate::verify::DigestsRequest = self.open(&caller, body)?;
                let digests = crate::verify::local_digests(node, request).await;
                reply(&Ok::<_, Refusal>(digests))
            }
            tessera_exec::remote_snapshot::ACTION_SNAPSHOT_MANIFEST => {
                let request: tessera_exec::remote_snapshot::ManifestRequest =
                    self.open(&caller, body)?;
                reply(&tessera_exec::remote_snapshot::serve(&node.exec, request).await)
            }
            crate::table_statistics::ACTION_TABLE_STATISTICS => {
                let request: crate::table_statistics::StatisticsRequest =
                    self.open(&caller, body)?;
                reply(&crate::table_statistics::serve(node, request))
            }
            tessera_replication::archive::ACTION_ARCHIVE_PARTITION => {
                let request: tessera_replication::archive::ArchivePartitionRequest =
                    self.open(&caller, body)?;
                let result =
                    tessera_replication::archive::archive_partition(&node.replication, request)
                        .await
                        .map_err(Refusal::Failed);
                reply(&result)
            }
            tessera_replication::archive::ACTION_REBUILD_FRAGMENT => {
                let request: tessera_replication::archive::RebuildFragmentRequest =
                    self.open(&caller, body)?;
                let result = tessera_replication::archive::rebuild_fragment(
                    &node.replication,
                    &request.component,
                    request.index,
                )
                .await
                .map_err(Refusal::Failed);
                reply(&result)
            }
            crate::scrub::ACTION_SCRUB => {
                let request: crate::scrub::ScrubRequest = self.open_from_client(&caller, body)?;
                let reports = crate::scrub::scrub_now(node, request).await;
                reply(&Ok::<_, Refusal>(reports))
            }
            crate::verify::ACTION_VERIFY => {
                let request: crate::verify::VerifyRequest = self.open_from_client(&caller, body)?;
                let result = crate::verify::verify(node, request)
                    .await
                    .map_err(Refusal::Failed);
                reply(&result)
            }
            ACTION_STATUS => {
                self.open_from_client::<()>(&caller, body)?;
                let status = node_status(&node);
                reply(&status)
            }
            other => Err(Status::unimplemented(format!("unknown action {other:?}"))),
        }
    }
}

/// Ends a query's part on this node when the initiator stops listening (it finished,
/// gave up, or died), or when every channel here has ended.
struct EndQueryOnDrop {
    node: Arc<Node>,
    query: tessera_exec::QueryId,
}

impl Drop for EndQueryOnDrop {
    fn drop(&mut self) {
        self.node.exec.end_query(self.query);
    }
}

impl NodeService {
    /// Starts a query's channels here; the reply streams their reports as they end.
    fn run_stages(
        &self,
        run: tessera_exec::run::RunRequest,
    ) -> Result<Response<BoxStream<'static, Result<FlightData, Status>>>, Status> {
        use tessera_exec::run::StagesEvent;
        let query = run.query;
        let reports = tessera_exec::run::run_stages(&self.node.exec, run).map_err(failed)?;
        let guard = EndQueryOnDrop {
            node: self.node.clone(),
            query,
        };
        let node = self.node.clone();
        // Each channel's report as it ends, then word that all have. The stream then stays
        // open until the query ends: under lineage recovery this node keeps its spools for
        // consumers rebuilt after another node dies; in every mode the initiator learns of
        // this node's death after its channels ended (a producer still sending to it then
        // fails, and the query must be diagnosed as this node's loss).
        let events = futures::stream::unfold(reports, |mut reports| async move {
            let report = reports.recv().await?;
            Some((StagesEvent::Report(report), reports))
        })
        .chain(futures::stream::once(async { StagesEvent::AllDone }))
        .chain(
            futures::stream::once(async move {
                node.exec.queries().wait_ended(query).await;
                drop(guard);
            })
            .filter_map(|()| async { None }),
        );
        let stream = events.map(|event| {
            serde_json::to_vec(&event)
                .map(|json| FlightData {
                    app_metadata: Bytes::from(json),
                    ..Default::default()
                })
                .map_err(failed)
        });
        Ok(Response::new(stream.boxed()))
    }

    /// Streams one bucket of a producer channel's spool, waiting for batches it has yet
    /// to write, until the channel finishes.
    fn follow_spool(
        &self,
        key: tessera_recovery::spool::SpoolKey,
        bucket: usize,
    ) -> Result<Response<BoxStream<'static, Result<FlightData, Status>>>, Status> {
        if self.node.exec.queries().has_ended(key.0) {
            return Err(Status::failed_precondition(format!(
                "query {:x} has ended on this node",
                key.0
            )));
        }
        let messages = self.node.lineage.follow_spool(key, bucket).map_err(failed);
        Ok(Response::new(messages.boxed()))
    }

    fn local_table(
        &self,
        table: &str,
        generation: u64,
    ) -> Result<tessera_storage::TableDef, Status> {
        self.node
            .store
            .table_def(table)
            .filter(|d| d.generation == generation)
            .ok_or_else(|| {
                failed(format!(
                    "table {table:?} (generation {generation}) is not on node {}",
                    self.node.id()
                ))
            })
    }

    /// Refuses unless this node is `partition`'s primary in a linearizable read of the
    /// metadata (so it holds every committed epoch of the partition).
    async fn check_primary_now(&self, partition: PartitionId) -> Result<(), Refusal> {
        let view = self
            .node
            .meta
            .read_linearizable(crate::meta::LINEARIZABLE_READ_PATIENCE)
            .await
            .map_err(|e| Refusal::Failed(e.to_string()))?;
        let me = self.node.id();
        let primary = view
            .state
            .map
            .partitions
            .get(partition.0 as usize)
            .ok_or_else(|| Refusal::Failed(format!("there is no partition {partition}")))?
            .primary;
        if primary != Some(me) {
            let now = primary.map_or("none".to_string(), |p| format!("node {p}"));
            return Err(Refusal::Failed(format!(
                "node {me} is not the primary of partition {partition} (the primary is {now}): it ships no components for it"
            )));
        }
        Ok(())
    }

    async fn scan(
        &self,
        scan: ScanRequest,
    ) -> Result<(arrow::datatypes::SchemaRef, Vec<RecordBatch>), Status> {
        let node = self.node.clone();
        tessera_exec::scan::wait_to_hold(
            &node.exec,
            &scan.table,
            scan.generation,
            scan.epoch,
            &scan.partitions,
        )
        .await
        .map_err(failed)?;
        let def = self.local_table(&scan.table, scan.generation)?;
        let full = match scan.changes_since {
            Some(_) => tessera_storage::changes::changes_schema(&def),
            None => stored_user_schema(&def),
        };
        let schema = Arc::new(full.project(&scan.columns).map_err(failed)?);
        // Damaged or missing components are replaced from another replica first.
        let store = node.store.clone();
        let (table, partitions) = (scan.table.clone(), scan.partitions.clone());
        let damaged = tokio::task::spawn_blocking(move || {
            // A diff reads history components too: check those it will read.
            let snapshot = match scan.changes_since {
                Some(_) => store.versions_snapshot(&table, Some(scan.epoch))?,
                None => store.snapshot(&table, Some(scan.epoch))?,
            };
            Ok::<_, tessera_storage::StorageError>(tessera_exec::scan::find_damaged(
                &store,
                &snapshot,
                &partitions,
            ))
        })
        .await
        .map_err(failed)?
        .map_err(failed)?;
        let unrepaired = tessera_exec::scan::repair_damaged(&node.exec, damaged)
            .await
            .map_err(failed)?;
        if !unrepaired.is_empty() {
            // The reader goes on to another replica.
            return Err(failed(unrepaired.join("; ")));
        }
        let store = node.store.clone();
        let batches = tokio::task::spawn_blocking(move || {
            tessera_sql::backend::read_local(
                &store,
                &def,
                Some(scan.epoch),
                scan.changes_since,
                &scan.partitions,
                &scan.columns,
                scan.order,
            )
        })
        .await
        .map_err(failed)?
        .map_err(failed)?;
        Ok((schema, batches))
    }
}

#[tonic::async_trait]
impl FlightService for NodeService {
    type HandshakeStream = BoxStream<'static, Result<HandshakeResponse, Status>>;
    type ListFlightsStream = BoxStream<'static, Result<FlightInfo, Status>>;
    type DoGetStream = BoxStream<'static, Result<FlightData, Status>>;
    type DoPutStream = BoxStream<'static, Result<PutResult, Status>>;
    type DoActionStream = BoxStream<'static, Result<arrow_flight::Result, Status>>;
    type ListActionsStream = BoxStream<'static, Result<ActionType, Status>>;
    type DoExchangeStream = BoxStream<'static, Result<FlightData, Status>>;

    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented("handshake"))
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(Status::unimplemented("list_flights"))
    }

    async fn get_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(Status::unimplemented("get_flight_info"))
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented("poll_flight_info"))
    }

    async fn get_schema(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(Status::unimplemented("get_schema"))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        let caller = self.caller(&request);
        // Clients send SQL without knowing the cluster's id; nodes name it.
        let request = self.open_tagged(&caller, &request.into_inner().ticket, SqlRequest::KIND)?;
        let decode_error = Refusal::into_status;
        let mut metadata = Bytes::new();
        let (schema, batches) = match request.kind.as_str() {
            SqlRequest::KIND => {
                let SqlRequest { sql } = request.decode().map_err(decode_error)?;
                let user = self.acting_user(&caller)?;
                let answers = crate::sql_answers::answer(self.node.clone(), user, sql);
                return Ok(Response::new(answers));
            }
            ScanRequest::KIND => self.scan(request.decode().map_err(decode_error)?).await?,
            RunRequest::KIND => return self.run_stages(request.decode().map_err(decode_error)?),
            SpoolRequest::KIND => {
                let spool: SpoolRequest = request.decode().map_err(decode_error)?;
                return self
                    .follow_spool((spool.query, spool.exchange, spool.channel), spool.bucket);
            }
            VersionsRequest::KIND => {
                let versions: VersionsRequest = request.decode().map_err(decode_error)?;
                // A failback source must hold every epoch committed in Raft, or the
                // returning replica would be marked fresh without some of them.
                let view = self
                    .node
                    .meta
                    .read_linearizable(crate::meta::LINEARIZABLE_READ_PATIENCE)
                    .await
                    .map_err(failed)?;
                tessera_replication::rebalance::may_serve_a_copy(
                    &view.state,
                    self.node.id(),
                    self.node.incarnation(),
                    versions.partition,
                )
                .map_err(failed)?;
                let def = self.local_table(&versions.table, versions.generation)?;
                let store = self.node.store.clone();
                let batches = tokio::task::spawn_blocking(move || {
                    store.partition_versions(&versions.table, versions.partition, versions.since)
                })
                .await
                .map_err(failed)?
                .map_err(failed)?;
                (tessera_storage::versions::stored_schema(&def), batches)
            }
            ExportRequest::KIND => {
                let export: ExportRequest = request.decode().map_err(decode_error)?;
                self.node
                    .meta
                    .read_linearizable(crate::meta::LINEARIZABLE_READ_PATIENCE)
                    .await
                    .map_err(failed)?;
                let def = self.local_table(&export.table, export.generation)?;
                let (components, memtable) = self
                    .node
                    .store
                    .export_partition(&export.table, export.partition)
                    .map_err(failed)?;
                metadata = Bytes::from(serde_json::to_vec(&components).map_err(failed)?);
                (tessera_storage::versions::stored_schema(&def), memtable)
            }
            ComponentRequest::KIND | FragmentRequest::KIND => {
                let store = self.node.store.clone();
                let bytes = if request.kind == ComponentRequest::KIND {
                    let ComponentRequest { hash } = request.decode().map_err(decode_error)?;
                    tokio::task::spawn_blocking(move || store.component_bytes(&hash)).await
                } else {
                    let FragmentRequest { hash } = request.decode().map_err(decode_error)?;
                    tokio::task::spawn_blocking(move || store.fragments().read_verified(&hash))
                        .await
                }
                .map_err(failed)?
                .map_err(failed)?;
                let bytes = Bytes::from(bytes);
                let chunks: Vec<Result<FlightData, Status>> = (0..bytes.len())
                    .step_by(COMPONENT_CHUNK_BYTES)
                    .map(|start| {
                        let end = (start + COMPONENT_CHUNK_BYTES).min(bytes.len());
                        Ok(FlightData {
                            data_body: bytes.slice(start..end),
                            ..Default::default()
                        })
                    })
                    .collect();
                return Ok(Response::new(futures::stream::iter(chunks).boxed()));
            }
            other => {
                return Err(failed(format!(
                    "malformed request: unknown do_get request {other:?}"
                )))
            }
        };
        let stream = tessera_net::wire_encoder(
            FlightDataEncoderBuilder::new()
                .with_schema(schema)
                .with_metadata(metadata),
            futures::stream::iter(batches).map(Ok),
        )
        .map_err(failed);
        Ok(Response::new(stream.boxed()))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let caller = self.caller(&request);
        let mut input = request.into_inner();
        let first = input
            .message()
            .await?
            .ok_or_else(|| failed("empty prepare stream"))?;
        let descriptor = first
            .flight_descriptor
            .clone()
            .ok_or_else(|| failed("a prepare stream starts with a descriptor"))?;
        // Clients publish without knowing the cluster's id; nodes name it.
        let request = self.open_tagged(&caller, &descriptor.cmd, PublishRequest::KIND)?;
        let decode_error = Refusal::into_status;
        let rest = input.map_err(arrow_flight::error::FlightError::from);
        let data = futures::stream::once(async { Ok(first) }).chain(rest);
        let app_metadata = match request.kind.as_str() {
            PrepareRequest::KIND => {
                let prepare: PrepareRequest = request.decode().map_err(decode_error)?;
                self.node
                    .wait_announced(ANNOUNCE_PATIENCE)
                    .await
                    .map_err(failed)?;
                let replication = &self.node.replication;
                let reply = if prepare.as_logged {
                    let data = std::pin::pin!(data);
                    tessera_replication::log_shipping::receive_as_logged(replication, prepare, data)
                        .await
                } else {
                    let batches = FlightRecordBatchStream::new_from_flight_data(data);
                    tessera_replication::log_shipping::receive(replication, prepare, batches).await
                }
                .map_err(failed)?;
                Bytes::from(serde_json::to_vec(&reply).map_err(failed)?)
            }
            StoreFragmentRequest::KIND => {
                let StoreFragmentRequest { hash } = request.decode().map_err(decode_error)?;
                let mut bytes = Vec::new();
                let mut data = std::pin::pin!(data);
                while let Some(message) = data.next().await {
                    bytes.extend_from_slice(&message.map_err(failed)?.data_body);
                }
                tessera_replication::archive::receive_fragment(&self.node.replication, hash, bytes)
                    .await
                    .map_err(failed)?;
                Bytes::new()
            }
            ExchangeHeader::KIND => {
                let header: ExchangeHeader = request.decode().map_err(decode_error)?;
                let messages = arrow_flight::decode::FlightDataDecoder::new(data);
                tessera_exec::exchange::receive(self.node.exec.queries(), &header, messages)
                    .await
                    .map_err(failed)?;
                Bytes::new()
            }
            PublishRequest::KIND => {
                let PublishRequest { table, deletes } = request.decode().map_err(decode_error)?;
                let mut batches = FlightRecordBatchStream::new_from_flight_data(data);
                // Refused as soon as it outgrows the limit, not once all of it is held.
                let (mut rows, mut bytes) = (Vec::new(), 0);
                while let Some(batch) = batches.try_next().await.map_err(failed)? {
                    bytes += tessera_storage::versions::rows_bytes(&batch);
                    tessera_replication::publish::refuse_oversized(&self.node.replication, bytes)
                        .map_err(failed)?;
                    rows.push(batch);
                }
                let changes = if deletes {
                    TableChanges::deletes(table, rows)
                } else {
                    TableChanges::upserts(table, rows)
                };
                let publisher = self.acting_user(&caller)?;
                // Rows a client sends, not computed here from a read: nothing to conflict.
                let read_nothing = tessera_common::ReadEpochs::new();
                let publish = crate::publish::publish(
                    &self.node.replication,
                    vec![changes],
                    publisher.as_deref(),
                    &read_nothing,
                );
                let epoch = publish.await.map_err(|error| match error {
                    tessera_replication::ReplicationError::Aborted { epoch, .. }
                    | tessera_replication::ReplicationError::PrimaryLost { epoch, .. }
                    | tessera_replication::ReplicationError::PrimaryStalled { epoch, .. }
                    | tessera_replication::ReplicationError::CommitRefused { epoch, .. } => {
                        Refusal::Aborted {
                            epoch,
                            detail: error.to_string(),
                        }
                        .into_status()
                    }
                    other => failed(other),
                })?;
                Bytes::from(serde_json::to_vec(&epoch).map_err(failed)?)
            }
            other => {
                return Err(failed(format!(
                    "malformed request: unknown do_put request {other:?}"
                )))
            }
        };
        let done = PutResult { app_metadata };
        Ok(Response::new(
            futures::stream::once(async { Ok(done) }).boxed(),
        ))
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("do_exchange"))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let caller = self.caller(&request);
        self.action(caller, request.into_inner()).await
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        Err(Status::unimplemented("list_actions"))
    }
}
