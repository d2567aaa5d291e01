//! What distributed execution asks of lineage recovery, as traits the exchange and the
//! initiator call; the `tessera-recovery` crate implements them (write-ahead lineage,
//! spools, rebuilding a dead node's channels). Execution keeps no lineage state of its own:
//! an inbox only records the order it was read in ([`Inbox::read_since`]), a writer only
//! hands its batches to a [`Backup`] and waits where [`Lineage::wait_logged`] says.

use crate::exchange::{BatchTag, Inbox, InboxKey, QueryRegistry, ReadSpec, Replay};
use crate::plan::DistributedPlan;
use crate::run::RunRequest;
use crate::{ChannelId, Exec, NodeId, QueryId, RecoveryOutcome, StageId};
use arrow::datatypes::SchemaRef;
use arrow_flight::FlightData;
use datafusion::execution::SendableRecordBatchStream;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Why lineage could not log, back up or rebuild what a query needed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LineageError {
    /// The metadata store did not take a reading order: output computed from it is held.
    #[error("logging the lineage of exchange {exchange} bucket {bucket} failed: {reason}")]
    NotLogged {
        exchange: StageId,
        bucket: usize,
        reason: String,
    },
    /// The query ended on this node while something still waited on its lineage.
    #[error("query {query} ended on this node")]
    QueryEnded { query: QueryId },
    /// A producer's backup could not be written.
    #[error("backing up channel {channel} of exchange {exchange}: {reason}")]
    Backup {
        exchange: StageId,
        channel: ChannelId,
        reason: String,
    },
    /// A node stopped answering, but the metadata does not confirm it dead: rebuilding its
    /// channels elsewhere could run them twice.
    #[error("node {node} stopped answering, but the metadata leader still counts it alive")]
    Unconfirmed { node: NodeId },
    #[error("no node survives to rebuild on")]
    NoSurvivor,
    /// Stage 0 runs on the initiator, whose death ends the query.
    #[error("the initiator's own stage cannot be rebuilt")]
    InitiatorStage,
    #[error("stage {stage} does not end in an exchange writer")]
    NoWriter { stage: StageId },
    /// A rebuilt stage's plan could not be made or encoded.
    #[error("rebuilding stage {stage}: {reason}")]
    Plan { stage: StageId, reason: String },
    /// The initiator did not record that a channel's output starts: none of it leaves.
    #[error("recording that channel {channel} of exchange {exchange} sends output: {reason}")]
    OutputNotRecorded {
        exchange: StageId,
        channel: ChannelId,
        reason: String,
    },
}

/// Names one producer channel's upstream backup: (query, exchange, channel).
pub type BackupKey = (QueryId, StageId, ChannelId);

/// The lineage hooks of one node (seed 003 §III–IV).
#[async_trait::async_trait]
pub trait Lineage: Send + Sync + 'static {
    /// Logs the order `inbox` (a bucket several producer channels feed) is read in, for a
    /// query whose initiator is `initiator`.
    fn log_reading_order(&self, inbox: &Arc<Inbox>, initiator: NodeId);

    /// True if the reading order of `key` is logged.
    fn logs_reading_order(&self, key: InboxKey) -> bool;

    /// Waits until the reading order of `key` up to `position` is logged with the query's
    /// initiator (which holds it while the query runs, and fails with it): output computed
    /// from those batches may then leave the node (write-ahead lineage). An error if
    /// logging it failed. Returns at once for a bucket whose order is not logged.
    async fn wait_logged(&self, key: InboxKey, position: usize) -> Result<(), LineageError>;

    /// Records with the query's initiator, before anything of producer channel `key`
    /// leaves it (a batch or an end of stream, to any node, this one included), that its
    /// output starts. A channel the initiator holds no such record for when its node dies
    /// has given nobody anything: its rebuild may compute the same rows in another order
    /// and grouping, split over several streams (`rebuild.rs`).
    async fn log_output_starts(
        &self,
        key: BackupKey,
        initiator: NodeId,
    ) -> Result<(), LineageError>;

    /// Starts the upstream backup of producer channel `key`, whose batches follow the
    /// schema message `schema`.
    fn back_up(&self, key: BackupKey, schema: FlightData) -> Result<Arc<dyn Backup>, LineageError>;

    /// Bucket `bucket` of a rebuilt consumer: its input replayed from the producers'
    /// backups, first in the logged reading order. Its tasks are tracked in `registry`.
    fn replay_bucket(
        &self,
        registry: &QueryRegistry,
        spec: &ReadSpec,
        replay: &Replay,
        bucket: usize,
        schema: SchemaRef,
    ) -> SendableRecordBatchStream;

    /// The initiator's recovery of one run of `plan`. Called before any of the run's
    /// channels starts: from then on the initiator takes the lineage they log.
    fn recovery(&self, plan: &DistributedPlan) -> Box<dyn QueryRecovery>;

    /// `query` ended on this node: its logs and backups here go.
    fn end_query(&self, query: QueryId);

    /// The initiator is done with `query`: the reading orders it holds for it go, and any
    /// logged later are refused.
    fn forget(&self, query: QueryId);
}

/// Where a producer channel keeps what it sent, until its query ends.
pub trait Backup: Send + Sync {
    /// Keeps the encoded messages of batch `tag`.
    fn append(&self, tag: BatchTag, messages: &[FlightData]) -> std::io::Result<()>;
    /// The channel sent everything (or failed with `failed`): followers stop waiting.
    fn finish(&self, failed: Option<String>);
}

/// The initiator's recovery of one query run: which deaths it can survive, and the
/// channels to start on the survivors when one happens.
#[async_trait::async_trait]
pub trait QueryRecovery: Send {
    /// True if the death of `node` can be recovered from without restarting the query.
    fn can_recover(&self, node: NodeId) -> bool;

    /// Rebuilds the channels of `dead` once the metadata leader confirms it dead: the
    /// requests that start them on the survivors. `finished` are the channels that
    /// reported their end before it died: every consumer elsewhere acknowledged all their
    /// output.
    async fn rebuild(
        &mut self,
        exec: &Arc<Exec>,
        plan: &DistributedPlan,
        dead: NodeId,
        finished: &BTreeSet<(StageId, ChannelId)>,
    ) -> Result<BTreeMap<NodeId, RunRequest>, LineageError>;

    /// The node whose channels were rebuilt, if any.
    fn lost(&self) -> Option<NodeId>;

    /// One outcome per recovered failure.
    fn into_outcomes(self: Box<Self>) -> Vec<RecoveryOutcome>;
}
