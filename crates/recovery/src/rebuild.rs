//! Lineage recovery of a running query (seed 003 §IV): when a participant dies, only its
//! channels are rebuilt, spread over the survivors stage by stage (pipeline-parallel):
//!
//! - a rebuilt scan channel runs on a surviving replica of its partitions (the dead
//!   node's spools are lost with it, so its scans are re-run to regenerate them);
//! - a rebuilt consumer reads every input bucket from the producers' spools, first in the
//!   reading order the dead node logged (write-ahead lineage), then as batches arrive;
//! - a rebuilt producer spools everything (the consumers rebuilt with it pull from it)
//!   and sends to the surviving consumers from its first batch: they drop what they
//!   already have, after checking it is the same.
//!
//! Surviving channels carry on; a surviving producer simply stopped sending to the dead
//! node when its stream broke. One failure per query is recovered this way; a second one
//! (or a recovery that cannot go on) falls back to restarting the query.

use crate::held::HeldLineage;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::bytes::physical_plan_to_bytes_with_proto_converter;
use std::collections::BTreeMap;
use std::sync::Arc;
use tessera_common::hex::to_hex;
use tessera_exec::exchange::{ExchangeReadExec, ExchangeWriteExec, Replay};
use tessera_exec::hooks::{LineageError, QueryRecovery};
use tessera_exec::plan::{leaves_of, DistributedPlan, Leaf};
use tessera_exec::run::{RunRequest, StageTask};
use tessera_exec::{ChannelId, Exec, NodeId, RecoveryOutcome, StageId};

/// What recovery knows while a query runs: where each channel runs now.
pub struct Recovery {
    lineage: bool,
    /// The reading orders the query's channels logged with this node, its initiator.
    held: Arc<HeldLineage>,
    initiator: NodeId,
    /// The node of each channel of each stage.
    hosts: Vec<Vec<NodeId>>,
    lost: Option<NodeId>,
    notes: Vec<RecoveryOutcome>,
}

impl Recovery {
    pub fn new(plan: &DistributedPlan, held: Arc<HeldLineage>) -> Recovery {
        Recovery {
            lineage: plan.lineage,
            held,
            initiator: plan.initiator,
            hosts: plan.stages.iter().map(|s| s.channels.clone()).collect(),
            lost: None,
            notes: Vec::new(),
        }
    }

    /// Rebuilds the channels of `dead` once the metadata leader confirms it dead: returns
    /// the `RunStages` requests that start them on the survivors.
    async fn rebuild_channels(
        &mut self,
        node: &Arc<Exec>,
        plan: &DistributedPlan,
        dead: NodeId,
    ) -> Result<BTreeMap<NodeId, RunRequest>, LineageError> {
        self.lost = Some(dead);
        let noticed = std::time::Instant::now();
        if !node.confirm_failed(dead).await {
            return Err(LineageError::Unconfirmed { node: dead });
        }
        // The current membership and addresses, past the leader's commit of the death.
        let view = node
            .meta()
            .read_linearizable(tessera_meta::LINEARIZABLE_READ_PATIENCE)
            .await
            .map_err(|e| LineageError::Metadata {
                reason: e.to_string(),
            })?;
        let survivors: Vec<NodeId> = view
            .state
            .live_nodes()
            .map(|n| n.id)
            .filter(|&id| id != dead)
            .collect();
        if survivors.is_empty() {
            return Err(LineageError::NoSurvivor);
        }
        let addrs: BTreeMap<NodeId, String> = view
            .state
            .nodes
            .values()
            .map(|n| (n.id, n.addr.clone()))
            .collect();

        // New homes, stage by stage.
        let mut moved: BTreeMap<StageId, BTreeMap<NodeId, Vec<usize>>> = BTreeMap::new();
        for stage in &plan.stages {
            let writer = writer_of(&stage.plan, stage.id)?;
            for channel in 0..self.hosts[stage.id.index()].len() {
                if self.hosts[stage.id.index()][channel] != dead {
                    continue;
                }
                let mut leaves = Vec::new();
                leaves_of(writer.input(), channel, &mut leaves);
                let replica = leaves.iter().find_map(|leaf| match leaf {
                    Leaf::Scan { replicas } => {
                        replicas.iter().copied().find(|r| survivors.contains(r))
                    }
                    Leaf::Exchange { .. } => None,
                });
                let spread = survivors[(stage.id.index() * 7 + channel) % survivors.len()];
                let host = replica.unwrap_or(spread);
                self.hosts[stage.id.index()][channel] = host;
                moved
                    .entry(stage.id)
                    .or_default()
                    .entry(host)
                    .or_default()
                    .push(channel);
            }
        }
        if moved.contains_key(&StageId::ANSWER) {
            return Err(LineageError::InitiatorStage);
        }

        // The reading orders the dead node logged, by (exchange, bucket).
        let mut logged: BTreeMap<StageId, BTreeMap<usize, Vec<(u32, u32)>>> = BTreeMap::new();
        let mut replayed = 0u64;
        // Fenced: a stretch the dead node sends from now on is refused, so none of its
        // output went out computed from reading order this replay does not follow.
        for inbox in self.held.fence(plan.query, dead) {
            replayed += inbox.batches;
            logged
                .entry(inbox.exchange)
                .or_default()
                .insert(inbox.bucket, inbox.runs);
        }

        let codec = tessera_exec::codec::TesseraCodec { node: node.clone() };
        let mut requests: BTreeMap<NodeId, RunRequest> = BTreeMap::new();
        let mut placed = Vec::new();
        for (&stage_id, by_host) in &moved {
            let stage = &plan.stages[stage_id.index()];
            let fragment = self.rebuilt_fragment(stage_id, &stage.plan, dead, &addrs, &logged)?;
            let bytes = physical_plan_to_bytes_with_proto_converter(
                fragment,
                &codec,
                &tessera_exec::subquery::LiteralSubqueries,
            )
            .map_err(|e| LineageError::Plan {
                stage: stage_id,
                reason: format!("encoding it: {e}"),
            })?;
            let fragment = to_hex(&bytes);
            for (&host, channels) in by_host {
                placed.push(format!(
                    "stage {stage_id} channel(s) {channels:?} on node {host}"
                ));
                requests
                    .entry(host)
                    .or_insert_with(|| RunRequest {
                        query: plan.query,
                        initiator: plan.initiator,
                        stages: vec![],
                        lineage: true,
                        memory_limit: plan.memory_limit,
                    })
                    .stages
                    .push(StageTask {
                        stage: stage_id,
                        fragment: fragment.clone(),
                        channels: channels.iter().copied().map(ChannelId).collect(),
                    });
            }
        }
        let channels: usize = moved.values().flat_map(|h| h.values()).map(Vec::len).sum();
        self.notes.push(RecoveryOutcome::Rebuilt {
            dead,
            query: plan.query,
            channels,
            replayed_batches: replayed,
            placed,
            replan_ms: noticed.elapsed().as_millis() as u64,
        });
        tracing::warn!(
            dead = dead.0,
            query = %plan.query,
            channels,
            replayed,
            "rebuilding a dead node's channels from lineage"
        );
        Ok(requests)
    }

    /// A stage's plan for its rebuilt channels: readers replay from the producers' spools
    /// (where the producers run now), and the writer sends only to surviving consumers.
    fn rebuilt_fragment(
        &self,
        stage_id: StageId,
        stage: &Arc<dyn ExecutionPlan>,
        dead: NodeId,
        addrs: &BTreeMap<NodeId, String>,
        logged: &BTreeMap<StageId, BTreeMap<usize, Vec<(u32, u32)>>>,
    ) -> Result<Arc<dyn ExecutionPlan>, LineageError> {
        let writer = writer_of(stage, stage_id)?;
        let input = writer
            .input()
            .clone()
            .transform_up(|plan| {
                let Some(reader) = plan.downcast_ref::<ExchangeReadExec>() else {
                    return Ok(Transformed::no(plan));
                };
                let exchange = reader.spec.exchange;
                let replay = Replay {
                    producers: self.hosts[exchange.index()].clone(),
                    addrs: addrs.clone(),
                    scripts: logged.get(&exchange).cloned().unwrap_or_default(),
                };
                Ok(Transformed::yes(
                    Arc::new(reader.replaying(replay)) as Arc<dyn ExecutionPlan>
                ))
            })
            .map_err(|e| LineageError::Plan {
                stage: stage_id,
                reason: e.to_string(),
            })?
            .data;
        Ok(Arc::new(writer.rebuilt(input, dead)))
    }
}

#[async_trait::async_trait]
impl QueryRecovery for Recovery {
    /// True if the death of `node` can be recovered from by lineage: the query logs it,
    /// the node is not the initiator, and no other node died before.
    fn can_recover(&self, node: NodeId) -> bool {
        self.lineage && node != self.initiator && self.lost.is_none()
    }

    /// The node whose channels were rebuilt, if any.
    fn lost(&self) -> Option<NodeId> {
        self.lost
    }

    /// One outcome per recovered failure, for the client's notice and `EXPLAIN ANALYZE`.
    fn into_outcomes(self: Box<Self>) -> Vec<RecoveryOutcome> {
        self.notes
    }

    async fn rebuild(
        &mut self,
        exec: &Arc<Exec>,
        plan: &DistributedPlan,
        dead: NodeId,
    ) -> Result<BTreeMap<NodeId, RunRequest>, LineageError> {
        self.rebuild_channels(exec, plan, dead).await
    }
}

fn writer_of(
    plan: &Arc<dyn ExecutionPlan>,
    stage: StageId,
) -> Result<&ExchangeWriteExec, LineageError> {
    plan.downcast_ref::<ExchangeWriteExec>()
        .ok_or(LineageError::NoWriter { stage })
}
