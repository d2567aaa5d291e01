//! A client's SQL through the cluster port (`tessera sql`, `tessera export`, the tests'
//! client): the statements' answers stream back as one `do_get` reply, so an answer of any
//! size arrives batch by batch, within bounded memory on both sides.
//!
//! The reply's messages, in order, statement by statement:
//! - a statement's rows: an Arrow schema message, then its batches;
//! - a statement without rows: one message with no IPC header whose `app_metadata` is a
//!   [`SqlMark::Done`] in JSON;
//! - last, what the node has to tell beside the answers ([`SqlMark::Notice`]), such as a
//!   query that survived a node's death.
//!
//! An error ends the reply with a [`Refusal`] status, rows sent before it included (the
//! client then reports the error, not a partial answer).

use crate::node::Node;
use crate::rpc::{Refusal, WireRequest};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::FlightData;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tessera_common::Epoch;
use tessera_sql::StatementOutput;
use tonic::Status;

/// How many encoded messages wait for a slow client before the query waits for it.
const REPLY_BACKLOG: usize = 8;

/// The longest a client waits for the next message of an answer: a statement that runs
/// this long without a row, or a node that stopped answering.
pub const NEXT_MESSAGE_PATIENCE: Duration = Duration::from_secs(3600);

/// Runs a client's SQL (one or more statements) on the node it asks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SqlRequest {
    pub sql: String,
}

impl WireRequest for SqlRequest {
    const KIND: &'static str = "sql";
}

/// What a message of the reply without rows says (its `app_metadata`, in JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SqlMark {
    /// A statement without rows ended: its tag, and for a write the epoch that made it
    /// visible.
    Done { tag: String, epoch: Option<Epoch> },
    /// Something the client should know, such as a query that recovered from a node's
    /// failure.
    Notice {
        message: String,
        /// Set when the notice tells how a query survived a node's death.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        recovery: Option<tessera_exec::RecoveryOutcome>,
    },
}

impl SqlMark {
    fn message(&self) -> FlightData {
        FlightData {
            app_metadata: Bytes::from(serde_json::to_vec(self).expect("marks serialize")),
            ..Default::default()
        }
    }
}

/// Runs `sql` on `node` for `user` and streams its answers as the module describes. The
/// statements run on a task of their own, which stops (cancelling a running query) when
/// the client goes away.
pub(crate) fn answer(
    node: Arc<Node>,
    user: Option<String>,
    sql: String,
) -> BoxStream<'static, Result<FlightData, Status>> {
    let (sender, receiver) = tokio::sync::mpsc::channel(REPLY_BACKLOG);
    tokio::spawn(async move {
        let backend = Arc::new(crate::ClusterBackend::new(node));
        tessera_sql::Backend::act_as(&*backend, user);
        let engine = tessera_sql::Engine::with_backend(
            backend.clone(),
            datafusion::prelude::SessionConfig::new(),
        );
        let outputs = match engine.execute_streaming(&sql).await {
            Ok(outputs) => outputs,
            Err(error) => {
                let refusal = Refusal::Failed(tessera_sql::error::one_message(&error));
                let _ = sender.send(Err(refusal.into_status())).await;
                return;
            }
        };
        for output in outputs {
            let messages = match output {
                StatementOutput::Done { tag, epoch } => {
                    futures::stream::once(async move { Ok(SqlMark::Done { tag, epoch }.message()) })
                        .boxed()
                }
                StatementOutput::Rows { schema, batches } => {
                    rows_messages(schema, futures::stream::iter(batches).map(Ok))
                }
                StatementOutput::Streaming { schema, stream } => rows_messages(
                    schema,
                    stream.map(|batch| batch.map_err(|e| FlightError::ExternalError(e.into()))),
                ),
            };
            if !forward(messages, &sender).await {
                return;
            }
        }
        let notices = backend.take_recoveries().into_iter().map(|recovery| {
            Ok(SqlMark::Notice {
                message: recovery.to_string(),
                recovery: Some(recovery),
            }
            .message())
        });
        forward(futures::stream::iter(notices).boxed(), &sender).await;
    });
    futures::stream::unfold(receiver, |mut receiver| async move {
        let message = receiver.recv().await?;
        Some((message, receiver))
    })
    .boxed()
}

/// The messages of one statement's rows: its schema, then its batches.
fn rows_messages(
    schema: SchemaRef,
    batches: impl Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
) -> BoxStream<'static, Result<FlightData, Status>> {
    tessera_net::wire_encoder(FlightDataEncoderBuilder::new().with_schema(schema), batches)
        .map(|message| message.map_err(|e| Refusal::Failed(e.to_string()).into_status()))
        .boxed()
}

/// Sends `messages` to the client until one is an error; false when the reply ended
/// (an error was sent, or the client went away).
async fn forward(
    mut messages: BoxStream<'static, Result<FlightData, Status>>,
    sender: &tokio::sync::mpsc::Sender<Result<FlightData, Status>>,
) -> bool {
    while let Some(message) = messages.next().await {
        let failed = message.is_err();
        if sender.send(message).await.is_err() || failed {
            return false;
        }
    }
    true
}

/// One step of a SQL reply as the client reads it.
#[derive(Debug)]
pub enum SqlEvent {
    /// A statement's rows begin; its batches follow.
    Rows(SchemaRef),
    Batch(RecordBatch),
    Done {
        tag: String,
        epoch: Option<Epoch>,
    },
    Notice(crate::Notice),
}

/// Reads a SQL reply's messages as [`SqlEvent`]s; `addr` names the node in errors.
pub(crate) fn read_reply(
    messages: impl Stream<Item = crate::Result<FlightData>> + Send + 'static,
    addr: String,
) -> impl Stream<Item = crate::Result<SqlEvent>> + Send + 'static {
    let state = ReplyReader {
        messages: messages.boxed(),
        schema: None,
        addr,
    };
    futures::stream::unfold(Some(state), |state| async move {
        let mut state = state?;
        let next = tokio::time::timeout(NEXT_MESSAGE_PATIENCE, state.messages.next()).await;
        let message = match next {
            Err(_) => Err(crate::ClusterError::AddressUnreachable {
                addr: state.addr.clone(),
                reason: format!(
                    "no part of the answer came for {} s",
                    NEXT_MESSAGE_PATIENCE.as_secs()
                ),
            }),
            Ok(None) => return None,
            Ok(Some(Err(error))) => Err(error),
            Ok(Some(Ok(message))) => state.event(message),
        };
        // The first error ends the stream.
        let keep_going = message.is_ok();
        Some((message, keep_going.then_some(state)))
    })
}

struct ReplyReader {
    messages: BoxStream<'static, crate::Result<FlightData>>,
    /// The schema of the rows being read.
    schema: Option<SchemaRef>,
    addr: String,
}

impl ReplyReader {
    fn event(&mut self, message: FlightData) -> crate::Result<SqlEvent> {
        let undecodable = |reason: String| crate::ClusterError::Undecodable {
            addr: self.addr.clone(),
            what: "an answer",
            reason,
        };
        if message.data_header.is_empty() {
            let mark: SqlMark = serde_json::from_slice(&message.app_metadata)
                .map_err(|e| undecodable(format!("a message without rows: {e}")))?;
            self.schema = None;
            return Ok(match mark {
                SqlMark::Done { tag, epoch } => SqlEvent::Done { tag, epoch },
                SqlMark::Notice { message, recovery } => {
                    SqlEvent::Notice(crate::Notice { message, recovery })
                }
            });
        }
        let header = arrow::ipc::root_as_message(&message.data_header)
            .map_err(|e| undecodable(format!("an IPC header: {e}")))?;
        match header.header_type() {
            arrow::ipc::MessageHeader::Schema => {
                let schema = Arc::new(
                    arrow::datatypes::Schema::try_from(&message)
                        .map_err(|e| undecodable(format!("a schema: {e}")))?,
                );
                self.schema = Some(schema.clone());
                Ok(SqlEvent::Rows(schema))
            }
            arrow::ipc::MessageHeader::RecordBatch => {
                let schema = self
                    .schema
                    .clone()
                    .ok_or_else(|| undecodable("rows before their schema".into()))?;
                let batch = arrow_flight::utils::flight_data_to_arrow_batch(
                    &message,
                    schema,
                    &Default::default(),
                )
                .map_err(|e| undecodable(format!("rows: {e}")))?;
                Ok(SqlEvent::Batch(batch))
            }
            other => Err(undecodable(format!("an IPC message of kind {other:?}"))),
        }
    }
}
