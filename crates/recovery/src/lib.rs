//! Lineage recovery of running queries (seed 003): the `tessera-exec` crate's
//! [`tessera_exec::hooks`], implemented by write-ahead lineage.
//!
//! | Protocol                      | What it does                                                      | File          |
//! |-------------------------------|-------------------------------------------------------------------|---------------|
//! | Write-ahead lineage           | logs each multi-sender bucket's reading order, on demand          | `lineage.rs`  |
//! | Held lineage                  | the initiator keeps its queries' reading orders while they run    | `held.rs`     |
//! | Upstream backup               | a producer keeps what it sent to other nodes in a spool file       | `spool.rs`    |
//! | Replay                        | a rebuilt consumer pulls its input from spools in the logged order | `replay.rs`   |
//! | Rebuild                       | the initiator re-places only a dead node's channels on survivors   | `rebuild.rs`  |
//! | Restart                       | the whole statement again on the survivors, at the same epochs     | `restart.rs`  |
//!
//! A second failure, or a rebuild that cannot go on, ends the run with the node's loss
//! (diagnosed by `tessera_exec::run`), and the statement is restarted whole.

pub mod held;
pub mod lineage;
pub mod rebuild;
pub mod replay;
pub mod restart;
pub mod spool;

use arrow::datatypes::SchemaRef;
use arrow_flight::FlightData;
use datafusion::execution::SendableRecordBatchStream;
use futures::stream::BoxStream;
use futures::StreamExt;
use held::HeldLineage;
use lineage::LineageLog;
use serde::{Deserialize, Serialize};
use spool::{Next, Spool, SpoolKey};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tessera_exec::exchange::{Inbox, InboxKey, QueryRegistry, ReadSpec, Replay};
use tessera_exec::hooks::{Backup, BackupKey, Lineage, LineageError, QueryRecovery};
use tessera_exec::plan::DistributedPlan;
use tessera_exec::{ChannelId, NodeId, QueryId, StageId};
use tessera_meta::{LineageEntry, MetaClient};
use tessera_net::{Clients, WireRequest};

/// One producer channel's spooled batches for one bucket, from the first, following the
/// spool while the channel still writes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpoolRequest {
    pub query: QueryId,
    pub exchange: StageId,
    pub channel: ChannelId,
    pub bucket: usize,
}

impl WireRequest for SpoolRequest {
    const KIND: &'static str = "Spool";
}

/// The producers' spools on this node, by channel, kept until their query ends.
pub struct Spools {
    dir: PathBuf,
    spools: Mutex<HashMap<SpoolKey, Arc<Spool>>>,
}

impl Spools {
    /// Spools written under `dir` (the node's data directory).
    pub fn new(dir: PathBuf) -> Spools {
        Spools {
            dir,
            spools: Mutex::default(),
        }
    }

    /// The spool of `key`, made on first use by its producer or a follower.
    pub fn spool(&self, key: SpoolKey) -> Arc<Spool> {
        self.spools
            .lock()
            .expect("spools lock")
            .entry(key)
            .or_insert_with(|| Arc::new(Spool::new(&self.dir, key)))
            .clone()
    }

    /// Deletes the spools of `query`.
    pub fn end_query(&self, query: QueryId) {
        self.spools
            .lock()
            .expect("spools lock")
            .retain(|key, spool| {
                if key.0 == query {
                    spool.drop_file();
                    false
                } else {
                    true
                }
            });
    }
}

/// Write-ahead lineage on one node: the reading-order log and its committers (one per
/// initiator), the lineage of the queries it initiates, the spools, and what replaying
/// needs (connections).
pub struct WriteAheadLineage {
    log: Arc<LineageLog>,
    held: Arc<HeldLineage>,
    spools: Spools,
    /// How long a follower waits for a spool's producer to start.
    spool_start_timeout: std::time::Duration,
    meta: MetaClient,
    clients: Arc<Clients>,
}

impl WriteAheadLineage {
    /// Lineage for the node of `meta`, spooling under `spool_dir`. Starts the committer,
    /// which runs for the life of the runtime.
    pub fn start(
        meta: MetaClient,
        clients: Arc<Clients>,
        spool_dir: PathBuf,
        spool_start_timeout: std::time::Duration,
    ) -> Arc<Self> {
        let log = Arc::new(LineageLog::default());
        let held = Arc::new(HeldLineage::default());
        tokio::spawn(lineage::commit_rounds(
            log.clone(),
            held.clone(),
            meta.clone(),
            clients.clone(),
        ));
        Arc::new(WriteAheadLineage {
            log,
            held,
            spools: Spools::new(spool_dir),
            spool_start_timeout,
            meta,
            clients,
        })
    }

    /// Takes stretches of reading order `node` logged for queries this node initiates
    /// ([`held::ACTION_LOG_LINEAGE`]); the reason if they are refused.
    pub fn take_lineage(&self, node: NodeId, entries: &[LineageEntry]) -> Result<(), String> {
        self.held.append(node, entries)
    }

    /// Records that a producer channel on `node` starts sending, for a query this node
    /// initiates ([`held::ACTION_LOG_OUTPUT`]); the reason if it is refused.
    pub fn take_output_start(&self, node: NodeId, key: BackupKey) -> Result<(), String> {
        let (query, exchange, channel) = key;
        self.held.output_starts(node, query, exchange, channel)
    }

    /// Streams bucket `bucket` of a producer channel's spool (its schema message first),
    /// waiting for batches the channel has yet to write, until it finishes.
    pub fn follow_spool(
        &self,
        key: SpoolKey,
        bucket: usize,
    ) -> BoxStream<'static, Result<FlightData, String>> {
        let spool = self.spools.spool(key);
        let schema = {
            let spool = spool.clone();
            let patience = self.spool_start_timeout;
            let (query, exchange, channel) = key;
            futures::stream::once(async move {
                tokio::time::timeout(patience, spool.schema())
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!(
                            "channel {channel} of exchange {exchange} of query {query} did not start on this node within {patience:?}"
                        ))
                    })
            })
        };
        let batches =
            futures::stream::unfold((spool, 0u64, false), move |(spool, seq, done)| async move {
                if done {
                    return None;
                }
                match spool.next(bucket, seq).await {
                    Ok(Next::Batch(messages)) => Some((Ok(messages), (spool, seq + 1, false))),
                    Ok(Next::End) => None,
                    Err(reason) => Some((Err(reason), (spool, seq, true))),
                }
            })
            .flat_map(|messages: Result<Vec<FlightData>, String>| match messages {
                Ok(messages) => futures::stream::iter(messages.into_iter().map(Ok)).boxed(),
                Err(reason) => futures::stream::once(async move { Err(reason) }).boxed(),
            });
        schema.chain(batches).boxed()
    }
}

#[async_trait::async_trait]
impl Lineage for WriteAheadLineage {
    fn log_reading_order(&self, inbox: &Arc<Inbox>, initiator: NodeId) {
        self.log.log(inbox, initiator);
    }

    fn logs_reading_order(&self, key: InboxKey) -> bool {
        self.log.logs(key)
    }

    async fn wait_logged(&self, key: InboxKey, position: usize) -> Result<(), LineageError> {
        self.log.wait_logged(key, position).await
    }

    async fn log_output_starts(
        &self,
        key: BackupKey,
        initiator: NodeId,
    ) -> Result<(), LineageError> {
        let me = self.meta.id();
        let (query, exchange, channel) = key;
        let recorded = if initiator == me {
            self.held.output_starts(me, query, exchange, channel)
        } else {
            lineage::send_to_initiator(
                &self.meta,
                &self.clients,
                initiator,
                held::ACTION_LOG_OUTPUT,
                (me, key),
            )
            .await
        };
        recorded.map_err(|reason| LineageError::OutputNotRecorded {
            exchange,
            channel,
            reason,
        })
    }

    fn back_up(&self, key: BackupKey, schema: FlightData) -> Result<Arc<dyn Backup>, LineageError> {
        let spool = self.spools.spool(key);
        spool.start(schema).map_err(|e| LineageError::Backup {
            exchange: key.1,
            channel: key.2,
            reason: format!("starting its spool: {e}"),
        })?;
        Ok(spool)
    }

    fn replay_bucket(
        &self,
        registry: &QueryRegistry,
        spec: &ReadSpec,
        replay: &Replay,
        bucket: usize,
        schema: SchemaRef,
    ) -> SendableRecordBatchStream {
        replay::replay_bucket(&self.clients, registry, spec, replay, bucket, schema)
    }

    fn recovery(&self, plan: &DistributedPlan) -> Box<dyn QueryRecovery> {
        if plan.lineage {
            self.held.begin(plan.query, plan.initiator);
        }
        Box::new(rebuild::Recovery::new(plan, self.held.clone()))
    }

    fn end_query(&self, query: QueryId) {
        self.log.end_query(query);
        self.spools.end_query(query);
    }

    fn forget(&self, query: QueryId) {
        self.held.end(query);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_exec::exchange::BatchTag;

    #[test]
    fn ending_a_query_deletes_its_spools() {
        let dir = tempfile::tempdir().unwrap();
        let spools = Spools::new(dir.path().to_path_buf());
        let spool = spools.spool((QueryId(7), StageId(1), ChannelId(0)));
        spool.start(FlightData::default()).unwrap();
        spool
            .append(BatchTag { bucket: 0, seq: 0 }, &[FlightData::default()])
            .unwrap();
        let other = spools.spool((QueryId(8), StageId(1), ChannelId(0)));
        other.start(FlightData::default()).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        spools.end_query(QueryId(7));
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "only the other query's spool is left"
        );
    }
}
