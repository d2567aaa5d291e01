//! Connections to other nodes, one HTTP/2 channel per address, made lazily and reused.

use crate::envelope::{encode_envelope_from, Tagged, WireRequest};
use crate::error::CallError;
use crate::NodeId;
use arrow::array::RecordBatch;
use arrow_flight::decode::{DecodedFlightData, FlightDataDecoder, FlightRecordBatchStream};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightClient, FlightData, FlightDescriptor, Ticket};
use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tessera_common::tls::{MutualTls, CLUSTER_SERVER_NAME};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity as TlsIdentity};

/// The largest gRPC message accepted.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// HTTP/2 receive windows. All streams from one node share one connection, and an
/// exchange stream whose inbox is full stops being read (flow control) while holding up to
/// a stream window of the connection's window. The connection window must exceed what all
/// such streams can hold, or one full inbox would stall every other stream on the
/// connection, including those that would let it drain (a distributed deadlock).
pub const STREAM_WINDOW_BYTES: u32 = 2 << 20;
pub const CONNECTION_WINDOW_BYTES: u32 = 1 << 30;

/// How long a connection attempt may take before the node counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// HTTP/2 pings on idle connections, so a dead peer is noticed within a few seconds.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_millis(500);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections to other nodes, speaking for one cluster and protocol version.
pub struct Clients {
    cluster_id: String,
    protocol: u32,
    /// The node these connections speak for, named in every request; none for a client.
    from: Option<NodeId>,
    /// Mutual TLS: the cluster's CA and this side's certificate; plaintext if none.
    tls: Option<ClientTlsConfig>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Clients {
    /// Plaintext connections, for a client (no node id claimed).
    pub fn new(cluster_id: &str, protocol: u32) -> Clients {
        Clients {
            cluster_id: cluster_id.to_string(),
            protocol,
            from: None,
            tls: None,
            channels: Mutex::new(HashMap::new()),
        }
    }

    /// Connections under mutual TLS with `tls`'s certificate; plaintext if `None`.
    pub fn with_tls(mut self, tls: Option<&MutualTls>) -> Clients {
        self.tls = tls.map(|tls| {
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&tls.ca_pem))
                .identity(TlsIdentity::from_pem(&tls.cert_pem, &tls.key_pem))
                .domain_name(CLUSTER_SERVER_NAME)
        });
        self
    }

    /// Requests name node `id` as their sender.
    pub fn as_node(mut self, id: NodeId) -> Clients {
        self.from = Some(id);
        self
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    fn channel(&self, addr: &str) -> Result<Channel, CallError> {
        let mut channels = self.channels.lock().expect("channels lock");
        if let Some(channel) = channels.get(addr) {
            return Ok(channel.clone());
        }
        let bad_address = |e: tonic::transport::Error| CallError::BadAddress {
            addr: addr.to_string(),
            reason: e.to_string(),
        };
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint =
            Endpoint::from_shared(format!("{scheme}://{addr}")).map_err(bad_address)?;
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone()).map_err(bad_address)?;
        }
        let endpoint = endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
            .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(KEEP_ALIVE_TIMEOUT);
        let channel = endpoint.connect_lazy();
        tessera_common::metrics::metrics().rpc_channels_opened.inc();
        channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    /// Forgets a connection after an error so the next call reconnects.
    pub fn reset(&self, addr: &str) {
        self.channels.lock().expect("channels lock").remove(addr);
    }

    fn service(&self, addr: &str) -> Result<FlightServiceClient<Channel>, CallError> {
        Ok(FlightServiceClient::new(self.channel(addr)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    fn client(&self, addr: &str) -> Result<FlightClient, CallError> {
        Ok(FlightClient::new_from_inner(self.service(addr)?))
    }

    fn envelope<T: Serialize>(&self, body: T) -> Vec<u8> {
        encode_envelope_from(&self.cluster_id, self.protocol, self.from, body)
    }

    fn tagged<R: WireRequest>(&self, request: &R) -> Vec<u8> {
        self.envelope(Tagged(request))
    }

    /// Forgets the connection to `addr` if `result` says it broke.
    fn note<T>(&self, addr: &str, result: Result<T, CallError>) -> Result<T, CallError> {
        if let Err(CallError::Transport(reason)) = &result {
            tracing::debug!(%addr, %reason, "forgetting a connection after a transport error");
            self.reset(addr);
        }
        result
    }

    /// Sends a JSON action and decodes its JSON reply, within `timeout`.
    pub async fn action<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        kind: &str,
        body: Req,
        timeout: Duration,
    ) -> Result<Resp, CallError> {
        let call = async {
            let mut client = self.client(addr)?;
            let action = Action::new(kind, Bytes::from(self.envelope(body)));
            let mut replies = client
                .do_action(action)
                .await
                .map_err(CallError::from_flight)?;
            let reply = replies
                .next()
                .await
                .ok_or_else(|| CallError::Transport(format!("empty reply to {kind}")))?
                .map_err(CallError::from_flight)?;
            // A reply that does not decode came over a working connection: keep it.
            serde_json::from_slice(&reply).map_err(|e| CallError::Undecodable {
                what: "action reply",
                addr: addr.to_string(),
                reason: format!("{kind}: {e}"),
            })
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(CallError::Transport(format!(
                "no reply to {kind} within {} ms",
                timeout.as_millis()
            ))),
        };
        self.note(addr, result)
    }

    /// Sends a `do_put` stream of batches; returns the reply's metadata.
    pub async fn put<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
        batches: Vec<RecordBatch>,
    ) -> Result<Bytes, CallError> {
        self.put_stream(addr, request, futures::stream::iter(batches))
            .await
    }

    /// As [`Clients::put`], sending batches as they come.
    pub async fn put_stream<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
        batches: impl Stream<Item = RecordBatch> + Send + 'static,
    ) -> Result<Bytes, CallError> {
        let descriptor = FlightDescriptor::new_cmd(self.tagged(request));
        let result = async {
            let mut client = self.client(addr)?;
            let stream = encode_batches(Some(descriptor), batches);
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
        self.note(addr, result)
    }

    /// Sends a `do_put` stream of ready-made Flight messages, the request in the first
    /// one's descriptor; returns the last reply's metadata.
    pub async fn put_flight<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
        messages: impl Stream<Item = FlightData> + Send + 'static,
    ) -> Result<Bytes, CallError> {
        let descriptor = FlightDescriptor::new_cmd(self.tagged(request));
        let mut first = true;
        let messages = messages.map(move |mut message| {
            if std::mem::take(&mut first) {
                message.flight_descriptor = Some(descriptor.clone());
            }
            message
        });
        let result = async {
            let mut client = self.service(addr)?;
            let mut replies = client
                .do_put(messages)
                .await
                .map_err(CallError::from_status)?
                .into_inner();
            let mut metadata = Bytes::new();
            while let Some(reply) = replies.message().await.map_err(CallError::from_status)? {
                metadata = reply.app_metadata;
            }
            Ok(metadata)
        }
        .await;
        self.note(addr, result)
    }

    /// Sends a `do_get` request; the reply's raw Flight messages.
    async fn do_get<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
    ) -> Result<tonic::Streaming<FlightData>, CallError> {
        let result = async {
            let mut client = self.service(addr)?;
            let ticket = Ticket::new(self.tagged(request));
            Ok(client
                .do_get(ticket)
                .await
                .map_err(CallError::from_status)?
                .into_inner())
        }
        .await;
        self.note(addr, result)
    }

    /// Streams the batches a `do_get` request returns.
    pub async fn get<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
    ) -> Result<impl Stream<Item = Result<RecordBatch, CallError>> + use<R>, CallError> {
        let messages = self.do_get(addr, request).await?.map_err(FlightError::from);
        Ok(FlightRecordBatchStream::new_from_flight_data(messages).map_err(CallError::from_flight))
    }

    /// Streams a `do_get` reply decoded message by message, with each message's metadata
    /// (a reply whose first message's metadata says something, such as an export).
    pub async fn get_decoded<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
    ) -> Result<impl Stream<Item = Result<DecodedFlightData, CallError>> + use<R>, CallError> {
        let messages = self.do_get(addr, request).await?.map_err(FlightError::from);
        Ok(FlightDataDecoder::new(messages).map_err(CallError::from_flight))
    }

    /// Streams a `do_get` reply's raw Flight messages (raw bytes, or JSON in metadata).
    pub async fn get_messages<R: WireRequest>(
        &self,
        addr: &str,
        request: &R,
    ) -> Result<impl Stream<Item = Result<FlightData, CallError>> + use<R>, CallError> {
        Ok(self
            .do_get(addr, request)
            .await?
            .map_err(CallError::from_status))
    }
}

/// The Flight messages of a stream of batches, `descriptor` on the first.
pub fn encode_batches(
    descriptor: Option<FlightDescriptor>,
    batches: impl Stream<Item = RecordBatch> + Send + 'static,
) -> arrow_flight::encode::FlightDataEncoder {
    wire_encoder(
        FlightDataEncoderBuilder::new().with_flight_descriptor(descriptor),
        batches.map(Ok),
    )
}

/// Builds `builder`'s encoder over `batches` as they should travel: each batch as
/// [`tessera_common::views::for_the_wire`] cuts it, which the encoder must not split again
/// (its own slices would carry whole string buffers). An error among `batches` ends the
/// stream with it.
pub fn wire_encoder(
    builder: FlightDataEncoderBuilder,
    batches: impl Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
) -> arrow_flight::encode::FlightDataEncoder {
    builder
        .with_max_flight_data_size(tessera_common::views::WIRE_ENCODER_MESSAGE_BYTES)
        .build(batches.flat_map(wire_slices))
}

/// A batch as the slices a Flight stream carries it in, each holding only its own string
/// values ([`tessera_common::views::for_the_wire`]); an error passes as it is.
fn wire_slices(
    batch: Result<RecordBatch, FlightError>,
) -> futures::stream::Iter<std::vec::IntoIter<Result<RecordBatch, FlightError>>> {
    let slices = match batch.map(tessera_common::views::for_the_wire) {
        Ok(Ok(slices)) => slices.into_iter().map(Ok).collect(),
        Ok(Err(error)) => vec![Err(FlightError::Arrow(error))],
        Err(error) => vec![Err(error)],
    };
    futures::stream::iter(slices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    /// Bytes of the Flight messages `batches` are sent as.
    fn sent_bytes(batches: Vec<RecordBatch>) -> usize {
        let messages: Vec<FlightData> = futures::executor::block_on(
            encode_batches(None, futures::stream::iter(batches)).try_collect(),
        )
        .unwrap();
        messages
            .iter()
            .map(|m| m.data_header.len() + m.data_body.len())
            .sum()
    }

    /// A publish's 64 K-row batch with a long string column (lineitem's comments) is sent
    /// once, not once per 2 MiB slice: arrow-flight's own split kept every slice's
    /// string buffers whole, which sent them about eight times.
    #[test]
    fn a_large_batch_of_string_views_is_sent_about_once() {
        let rows = 65_536;
        let comments: StringViewArray = (0..rows)
            .map(|i| Some(format!("a comment of about forty bytes, row {i:06}")))
            .collect::<Vec<_>>()
            .into_iter()
            .collect();
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("k", DataType::Int64, false),
                Field::new("comment", DataType::Utf8View, false),
            ])),
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows as i64)),
                Arc::new(comments),
            ],
        )
        .unwrap();
        let logical: usize = batch
            .columns()
            .iter()
            .map(|c| c.get_buffer_memory_size())
            .sum();
        let sent = sent_bytes(vec![batch]);
        assert!(
            sent < logical + logical / 10,
            "{sent} bytes sent for a batch of {logical}"
        );
    }
}
