//! A client of a running cluster, for the CLI and tests: SQL, publishes and status through
//! any node.

use crate::error::{ClusterError, Result};
use crate::rpc::{
    CallError, Clients, PublishRequest, ScanRequest, SqlRequest, ACTION_CURRENT_METADATA,
    ACTION_STATUS, PROTOCOL_VERSION,
};
use crate::server::NodeStatus;
use crate::sql_answers::SqlEvent;
use arrow::array::RecordBatch;
use futures::{StreamExt, TryStreamExt};
use std::time::Duration;
use tessera_common::tls::MutualTls;
use tessera_common::{Epoch, PartitionId};
use tessera_sql::StatementOutput;

/// Something a node told the client beside a statement's output.
#[derive(Debug, Clone, PartialEq)]
pub struct Notice {
    pub message: String,
    /// How a query survived a node's death, when that is what the notice is about.
    pub recovery: Option<tessera_exec::RecoveryOutcome>,
}

/// How a client names a failed call: the node's address, and whether the client spoke
/// TLS to it and for which cluster.
#[derive(Clone)]
struct CallErrors {
    addr: String,
    tls: bool,
    cluster_id: String,
}

impl CallErrors {
    fn call_error(&self, error: CallError) -> ClusterError {
        let text = error.to_string();
        if !self.tls && looks_like_tls_refusal(&text) {
            return ClusterError::AddressUnreachable {
                addr: self.addr.clone(),
                reason: format!(
                    "{text} (the connection broke at once: if the cluster uses mutual TLS on its internal port, give this client a certificate of its CA, e.g. `tessera --certs DIR`)"
                ),
            };
        }
        match error {
            CallError::Refused(crate::rpc::Refusal::WrongCluster {
                node_id,
                cluster_id,
            }) => ClusterError::WrongCluster {
                node: node_id,
                addr: self.addr.clone(),
                ours: self.cluster_id.clone(),
                theirs: cluster_id,
            },
            CallError::Transport(reason) => ClusterError::AddressUnreachable {
                addr: self.addr.clone(),
                reason,
            },
            CallError::Refused(crate::rpc::Refusal::Aborted { epoch, detail }) => {
                ClusterError::PublishAborted { epoch, detail }
            }
            other => ClusterError::Call(other),
        }
    }
}

pub struct ClusterClient {
    addr: String,
    clients: Clients,
}

/// The certificate this process's clients present under mutual TLS, unless told
/// otherwise: the CLI sets it once from `--certs`, or from the cluster it started.
static DEFAULT_TLS: std::sync::RwLock<Option<MutualTls>> = std::sync::RwLock::new(None);

/// Sets the certificate [`ClusterClient::new`] presents from now on (`None`: plaintext).
pub fn set_default_tls(tls: Option<MutualTls>) {
    *DEFAULT_TLS.write().expect("default TLS lock") = tls;
}

/// The certificate [`ClusterClient::new`] presents, if any.
pub fn default_tls() -> Option<MutualTls> {
    DEFAULT_TLS.read().expect("default TLS lock").clone()
}

impl ClusterClient {
    /// A client of the node at `addr`, whatever cluster it belongs to, with this process's
    /// certificate ([`set_default_tls`]) if it has one.
    pub fn new(addr: &str) -> ClusterClient {
        ClusterClient::with_tls(addr, default_tls().as_ref())
    }

    /// A client of the node at `addr` presenting `tls`'s certificate (plaintext if `None`).
    pub fn with_tls(addr: &str, tls: Option<&MutualTls>) -> ClusterClient {
        ClusterClient {
            addr: addr.to_string(),
            clients: Clients::new(crate::rpc::ANY_CLUSTER, PROTOCOL_VERSION).with_tls(tls),
        }
    }

    fn call_error(&self, error: CallError) -> ClusterError {
        self.errors().call_error(error)
    }

    /// What [`ClusterClient::call_error`] needs, for a stream that outlives the borrow.
    fn errors(&self) -> CallErrors {
        CallErrors {
            addr: self.addr.clone(),
            tls: self.clients.is_tls(),
            cluster_id: self.clients.cluster_id().to_string(),
        }
    }
    pub async fn sql(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        Ok(self.sql_with_notices(sql).await?.0)
    }

    /// As [`ClusterClient::sql`], with the notices the node raised (such as a query that
    /// recovered from a node failure).
    pub async fn sql_with_notices(&self, sql: &str) -> Result<(Vec<StatementOutput>, Vec<Notice>)> {
        let mut events = std::pin::pin!(self.sql_stream(sql).await?);
        let mut notices = Vec::new();
        let mut results = Vec::new();
        while let Some(event) = events.next().await {
            match event? {
                SqlEvent::Rows(schema) => results.push(StatementOutput::Rows {
                    schema,
                    batches: Vec::new(),
                }),
                SqlEvent::Batch(batch) => match results.last_mut() {
                    Some(StatementOutput::Rows { batches, .. }) => batches.push(batch),
                    _ => unreachable!("the reply reader refuses rows before their schema"),
                },
                SqlEvent::Done { tag, epoch } => results.push(StatementOutput::Done { tag, epoch }),
                SqlEvent::Notice(notice) => notices.push(notice),
            }
        }
        Ok((results, notices))
    }

    /// Runs `sql` (one or more statements); their answers as they arrive, batch by batch.
    pub async fn sql_stream(
        &self,
        sql: &str,
    ) -> Result<impl futures::Stream<Item = Result<SqlEvent>> + Send + 'static> {
        let request = SqlRequest {
            sql: sql.to_string(),
        };
        let messages = self
            .clients
            .get_messages(&self.addr, &request)
            .await
            .map_err(|e| self.call_error(e))?;
        let errors = self.errors();
        let messages = messages.map_err(move |e| errors.call_error(e));
        Ok(crate::sql_answers::read_reply(messages, self.addr.clone()))
    }

    /// Runs SQL whose last statement returns rows; also returns the node's notices.
    pub async fn query_with_notices(&self, sql: &str) -> Result<(Vec<RecordBatch>, Vec<Notice>)> {
        let (mut outputs, notices) = self.sql_with_notices(sql).await?;
        match outputs.pop() {
            Some(StatementOutput::Rows { batches, .. }) => Ok((batches, notices)),
            other => Err(ClusterError::UnexpectedOutput {
                expected: "rows",
                got: format!("{other:?}"),
            }),
        }
    }

    /// Runs SQL whose last statement returns rows.
    pub async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>> {
        match self.sql(sql).await?.pop() {
            Some(StatementOutput::Rows { batches, .. }) => Ok(batches),
            other => Err(ClusterError::UnexpectedOutput {
                expected: "rows",
                got: format!("{other:?}"),
            }),
        }
    }

    /// Publishes rows of one table as a new epoch, coordinated by this client's node.
    pub async fn publish(
        &self,
        table: &str,
        rows: Vec<RecordBatch>,
        deletes: bool,
    ) -> Result<Epoch> {
        let request = PublishRequest {
            table: table.to_string(),
            deletes,
        };
        let metadata = self
            .clients
            .put(&self.addr, &request, rows)
            .await
            .map_err(|e| self.call_error(e))?;
        serde_json::from_slice(&metadata).map_err(|e| ClusterError::Undecodable {
            addr: self.addr.clone(),
            what: "a publish reply",
            reason: e.to_string(),
        })
    }

    /// Starts moving node `id`'s partitions away; the cluster then retires it.
    pub async fn decommission(&self, id: u64) -> Result<()> {
        self.unit_action(crate::rpc::ACTION_DECOMMISSION, id, Duration::from_secs(30))
            .await
    }

    /// Flushes this node's in-memory rows to components and ships them to the standbys
    /// of the partitions it leads (after a bulk load: standbys then hold, and scan, the
    /// very components their primaries do).
    pub async fn flush(&self) -> Result<()> {
        self.unit_action(crate::rpc::ACTION_FLUSH, (), Duration::from_secs(300))
            .await
    }

    /// Flushes this node's in-memory rows, merges each partition it holds down to one
    /// component (however many publishes loaded it; a cold standby's partitions take their
    /// primary's instead) and ships them to the standbys: what a bulk load ends with, so
    /// that queries open one file per partition.
    pub async fn settle(&self) -> Result<()> {
        self.unit_action(crate::rpc::ACTION_SETTLE, (), Duration::from_secs(600))
            .await
    }

    async fn unit_action(
        &self,
        action: &str,
        body: impl serde::Serialize,
        patience: Duration,
    ) -> Result<()> {
        let reply: std::result::Result<std::result::Result<(), crate::rpc::Refusal>, CallError> =
            self.clients
                .action(&self.addr, action, body, patience)
                .await;
        match reply.map_err(|e| self.call_error(e))? {
            Ok(()) => Ok(()),
            Err(refusal) => Err(self.call_error(CallError::Refused(refusal))),
        }
    }

    /// Reads one partition of `table` at `epoch` from this node's own store, whether or not
    /// it is the partition's primary: how a test or an operator checks that replicas agree.
    /// Node-to-node reads name their cluster, so the caller gives its id.
    pub async fn read_replica(
        &self,
        cluster_id: &str,
        table: &str,
        partition: PartitionId,
        epoch: Epoch,
    ) -> Result<Vec<RecordBatch>> {
        let status = self.status().await?;
        let def = status
            .meta
            .tables
            .get(table)
            .ok_or_else(|| ClusterError::UnknownTable {
                table: table.to_string(),
            })?;
        let request = ScanRequest {
            table: table.to_string(),
            generation: def.generation,
            epoch,
            partitions: vec![partition],
            columns: (0..def.schema.fields().len()).collect(),
            changes_since: None,
            order: Default::default(),
        };
        let clients = Clients::new(cluster_id, PROTOCOL_VERSION).with_tls(default_tls().as_ref());
        let stream = clients
            .get(&self.addr, &request)
            .await
            .map_err(|e| self.call_error(e))?;
        stream
            .try_collect()
            .await
            .map_err(|e: CallError| self.call_error(e))
    }

    /// Checks the cluster's data against its signed version ids (see [`crate::verify`]).
    pub async fn verify(
        &self,
        request: crate::verify::VerifyRequest,
    ) -> Result<crate::verify::VerifyReport> {
        let reply: std::result::Result<crate::verify::VerifyReport, crate::rpc::Refusal> = self
            .clients
            .action(
                &self.addr,
                crate::verify::ACTION_VERIFY,
                request,
                Duration::from_secs(3600),
            )
            .await
            .map_err(|e| self.call_error(e))?;
        reply.map_err(|refusal| self.call_error(CallError::Refused(refusal)))
    }

    /// Has every live node hash its components again now and repair the damaged ones
    /// (see [`crate::scrub`]); each node's report.
    pub async fn scrub(&self) -> Result<Vec<crate::scrub::ScrubReport>> {
        let reply: std::result::Result<Vec<crate::scrub::ScrubReport>, crate::rpc::Refusal> = self
            .clients
            .action(
                &self.addr,
                crate::scrub::ACTION_SCRUB,
                crate::scrub::ScrubRequest { everywhere: true },
                Duration::from_secs(3600),
            )
            .await
            .map_err(|e| self.call_error(e))?;
        reply.map_err(|refusal| self.call_error(CallError::Refused(refusal)))
    }

    pub async fn status(&self) -> Result<NodeStatus> {
        self.clients
            .action(&self.addr, ACTION_STATUS, (), Duration::from_secs(5))
            .await
            .map_err(|e| self.call_error(e))
    }

    /// The cluster's metadata as of a linearizable read through this node: every table
    /// created and every epoch committed before the call, or an error. Its histories (the
    /// epoch log, aborted epochs, the audit log) hold their newest
    /// [`crate::status::STATUS_HISTORY`] entries; the whole epoch log is the
    /// `tessera_epochs` table. [`Self::status`]
    /// shows the node's own view instead, which a restarting node may not yet have
    /// brought up to date.
    pub async fn current_metadata(&self) -> Result<crate::meta::MetaState> {
        self.clients
            .action(
                &self.addr,
                ACTION_CURRENT_METADATA,
                (),
                crate::meta::LINEARIZABLE_READ_PATIENCE + Duration::from_secs(5),
            )
            .await
            .map_err(|e| self.call_error(e))
    }
}

/// Whether a plaintext call's transport error is what a TLS port answers it with: the
/// connection closed or reset before any HTTP/2 reply.
fn looks_like_tls_refusal(reason: &str) -> bool {
    [
        "connection reset",
        "connection closed",
        "broken pipe",
        "h2 protocol error",
        "frame with invalid size",
        "connection error",
    ]
    .iter()
    .any(|sign| reason.to_ascii_lowercase().contains(sign))
}
