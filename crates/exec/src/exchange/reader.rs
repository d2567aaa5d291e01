//! The consumer end of an exchange in a plan: output partition `m` reads bucket `m`'s
//! inbox, or, for a channel rebuilt after a node died, replays the bucket from the
//! producers' backups through the lineage hooks.

use super::ExchangeMode;
use super::{Inbox, InboxKey};
use crate::{Exec, NodeId, QueryId, StageId};
use arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a consumer stage reads from one exchange.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReadSpec {
    pub query: QueryId,
    pub exchange: StageId,
    pub mode: ExchangeMode,
    pub buckets: usize,
    pub producer_channels: usize,
    /// Under lineage recovery: the reading order of buckets with several senders is
    /// logged, and re-sent batches are checked and dropped.
    #[serde(default)]
    pub lineage: bool,
    /// The query's initiator (its lineage is dropped if the initiator dies).
    #[serde(default)]
    pub initiator: NodeId,
    /// A rebuilt consumer reads its buckets from the producers' spools instead.
    #[serde(default)]
    pub replay: Option<Replay>,
}

/// Where a rebuilt consumer's input comes from, and in what order it was first read.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Replay {
    /// The node that now holds each producer channel's spool.
    pub producers: Vec<NodeId>,
    pub addrs: BTreeMap<NodeId, String>,
    /// For each bucket with a logged reading order: runs of (sender, batches).
    pub scripts: BTreeMap<usize, Vec<(u32, u32)>>,
}

/// The consumer end of an exchange: output partition `m` is bucket `m`'s batches, from
/// every producer channel that feeds it, as they arrive.
#[derive(Debug)]
pub struct ExchangeReadExec {
    pub spec: ReadSpec,
    schema: SchemaRef,
    node: Arc<Exec>,
    properties: Arc<PlanProperties>,
}

impl ExchangeReadExec {
    pub fn new(spec: ReadSpec, schema: SchemaRef, node: Arc<Exec>) -> Self {
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(spec.buckets),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        ExchangeReadExec {
            spec,
            schema,
            node,
            properties,
        }
    }

    pub fn key(&self, bucket: usize) -> InboxKey {
        InboxKey {
            query: self.spec.query,
            exchange: self.spec.exchange,
            bucket,
        }
    }

    /// The same reader, rebuilt to replay its input from spools.
    pub fn replaying(&self, replay: Replay) -> ExchangeReadExec {
        let mut spec = self.spec.clone();
        spec.replay = Some(replay);
        ExchangeReadExec::new(spec, self.schema.clone(), self.node.clone())
    }
}

impl DisplayAs for ExchangeReadExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "ExchangeReadExec: exchange={}, mode={}, buckets={}, from {} channel(s) of stage {}",
            self.spec.exchange,
            self.spec.mode,
            self.spec.buckets,
            self.spec.producer_channels,
            self.spec.exchange
        )
    }
}

/// Closes its inbox when the reader stops early, so producers never wait on it.
struct CloseOnDrop(Arc<Inbox>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl ExecutionPlan for ExchangeReadExec {
    tessera_sql::leaf_plan_methods!("ExchangeReadExec", no_expressions);

    fn execute(
        &self,
        bucket: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        if bucket >= self.spec.buckets {
            return Err(DataFusionError::Internal(format!(
                "exchange {} has {} buckets, not {bucket}",
                self.spec.exchange, self.spec.buckets
            )));
        }
        let senders = self
            .spec
            .mode
            .senders_per_bucket(self.spec.producer_channels);
        if let Some(replay) = &self.spec.replay {
            return Ok(self.node.lineage.replay_bucket(
                &self.node.queries,
                &self.spec,
                replay,
                bucket,
                self.schema.clone(),
            ));
        }
        let key = self.key(bucket);
        let registry = &self.node.queries;
        let inbox = registry.inbox(key, senders).ok_or_else(|| {
            DataFusionError::Execution(format!("query {:x} has ended on this node", key.query))
        })?;
        inbox.claim_reader().map_err(DataFusionError::Internal)?;
        if self.spec.lineage {
            inbox.expect_resends();
            if senders > 1 {
                self.node
                    .lineage
                    .log_reading_order(&inbox, self.spec.initiator);
            }
        }
        let guard = CloseOnDrop(inbox);
        let stream = futures::stream::unfold(guard, |guard| async move {
            let next = guard.0.next().await?;
            Some((next.map_err(DataFusionError::Execution), guard))
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            stream,
        )))
    }
}
