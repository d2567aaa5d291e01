//! Lineage recovery of a running query (seed 003 §IV): when a participant dies, only its
//! channels are rebuilt, spread over the survivors stage by stage (pipeline-parallel):
//!
//! - a rebuilt scan channel runs on a surviving replica of its partitions (the dead
//!   node's spools are lost with it, so its scans are re-run to regenerate them);
//! - a rebuilt consumer reads every input bucket from the producers' spools, first in the
//!   reading order the dead node logged (write-ahead lineage), then as batches arrive;
//! - a rebuilt producer spools everything (the consumers rebuilt with it pull from it)
//!   and sends to the surviving consumers from its first batch: they drop what they
//!   already have, after checking it is the same;
//! - a producer whose output had not started (it records that with the initiator before
//!   anything of it leaves) gave nobody anything: it is split over as many streams as
//!   there are survivors where its operators allow (`tessera_exec::split`), so its redo
//!   takes a fraction of the time its first run did.
//!
//! Surviving channels carry on; a surviving producer simply stopped sending to the dead
//! node when its stream broke. One failure per query is recovered this way; a second one
//! (or a recovery that cannot go on) falls back to restarting the query.

use crate::held::HeldLineage;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::bytes::physical_plan_to_bytes_with_proto_converter;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tessera_common::hex::to_hex;
use tessera_exec::exchange::{ExchangeMode, ExchangeReadExec, ExchangeWriteExec, Replay};
use tessera_exec::hooks::{LineageError, QueryRecovery};
use tessera_exec::plan::{leaves_of, DistributedPlan, Leaf};
use tessera_exec::run::{RunRequest, StageTask};
use tessera_exec::split::split_channel;
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
        finished: &BTreeSet<(StageId, ChannelId)>,
    ) -> Result<BTreeMap<NodeId, RunRequest>, LineageError> {
        self.lost = Some(dead);
        let noticed = std::time::Instant::now();
        if !node.confirm_failed(dead).await {
            return Err(LineageError::Unconfirmed { node: dead });
        }
        tracing::info!(
            dead = dead.0,
            confirm_ms = noticed.elapsed().as_millis() as u64,
            "the metadata counts the node failed"
        );
        // The membership and addresses as this node applied the death: the leader's commit
        // of it is in this view, so nobody dead before it is taken for alive. A linearizable
        // read would only add a round trip to the leader on the rebuild's path; a node that
        // died since is found dead when its rebuilt channels start, and the query restarts.
        let view = node.meta().view();
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
        let mut placed = Vec::new();
        for stage in &plan.stages {
            let writer = writer_of(&stage.plan, stage.id)?;
            for channel in 0..self.hosts[stage.id.index()].len() {
                if self.hosts[stage.id.index()][channel] != dead {
                    continue;
                }
                // Its consumers all live and hold all its output: nothing to redo.
                if finished.contains(&(stage.id, ChannelId(channel)))
                    && !writer.spec.feeds(channel, dead)
                {
                    placed.push(format!(
                        "stage {} channel {channel} had delivered all its output: not rebuilt",
                        stage.id
                    ));
                    continue;
                }
                let mut leaves = Vec::new();
                leaves_of(writer.input(), channel, &mut leaves);
                let replica = leaves.iter().find_map(|leaf| match leaf {
                    Leaf::Scan { replicas, .. } => {
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
        // output went out computed from reading order this replay does not follow; nor
        // does a channel that had not yet said its output starts ever send any.
        let fenced = self.held.fence(plan.query, dead);
        for inbox in fenced.inboxes {
            replayed += inbox.batches;
            logged
                .entry(inbox.exchange)
                .or_default()
                .insert(inbox.bucket, inbox.runs);
        }

        let codec = tessera_exec::codec::TesseraCodec { node: node.clone() };
        let encode = |stage: StageId, fragment: Arc<dyn ExecutionPlan>| {
            physical_plan_to_bytes_with_proto_converter(
                fragment,
                &codec,
                &tessera_exec::subquery::LiteralSubqueries,
            )
            .map(|bytes| to_hex(&bytes))
            .map_err(|e| LineageError::Plan {
                stage,
                reason: format!("encoding it: {e}"),
            })
        };
        let mut requests: BTreeMap<NodeId, RunRequest> = BTreeMap::new();
        let mut task_on = |host: NodeId, task: StageTask| {
            requests
                .entry(host)
                .or_insert_with(|| RunRequest {
                    query: plan.query,
                    initiator: plan.initiator,
                    stages: vec![],
                    lineage: true,
                    memory_limit: plan.memory_limit,
                    execution: plan.execution.clone(),
                })
                .stages
                .push(task)
        };
        let mut split = 0usize;
        // What each storage exchange's producers hash rows by (a split channel deals the
        // bucket it reads by the same storage partitions).
        let storage_keys = |exchange: StageId| {
            let stage = plan.stages.get(exchange.index())?;
            let writer = writer_of(&stage.plan, exchange).ok()?;
            matches!(writer.spec.mode, ExchangeMode::Storage { .. })
                .then(|| writer.hash_exprs.clone())
        };
        for (&stage_id, by_host) in &moved {
            let stage = &plan.stages[stage_id.index()];
            let (writer, input) = self.rebuilt_input(stage_id, &stage.plan, &addrs, &logged)?;
            let mut whole_fragment = None;
            for (&host, channels) in by_host {
                let mut whole = Vec::new();
                for &channel in channels {
                    // Output nobody holds part of may be recomputed in any grouping of its
                    // rows: split over as many streams as there are survivors. That is a
                    // channel that gave nobody anything, or one whose consumers elsewhere
                    // have all of it and whose rows no rebuilt consumer logged reading
                    // (it then sends to nobody: the rebuilt consumers pull its spool).
                    let key = (stage_id, ChannelId(channel));
                    let silent = !fenced.sending.contains(&key);
                    let delivered = finished.contains(&key)
                        && logs_reading_order(writer, plan.stages[stage_id.index()].channels.len())
                        && !logged_reads_of(&logged, stage_id, channel);
                    let streams = (silent || delivered)
                        .then(|| split_channel(&input, channel, survivors.len(), &storage_keys))
                        .flatten();
                    let Some(streams) = streams else {
                        whole.push(channel);
                        continue;
                    };
                    split += 1;
                    placed.push(format!(
                        "stage {stage_id} channel {channel} on node {host}, split {} ways",
                        survivors.len()
                    ));
                    let fragment = Arc::new(if silent {
                        writer.rebuilt(streams, dead)
                    } else {
                        writer.rebuilt_for_the_dead_only(streams)
                    });
                    task_on(
                        host,
                        StageTask {
                            stage: stage_id,
                            fragment: encode(stage_id, fragment)?,
                            channels: vec![ChannelId(channel)],
                        },
                    );
                }
                if whole.is_empty() {
                    continue;
                }
                placed.push(format!(
                    "stage {stage_id} channel(s) {whole:?} on node {host}"
                ));
                if whole_fragment.is_none() {
                    let fragment = Arc::new(writer.rebuilt(input.clone(), dead));
                    whole_fragment = Some(encode(stage_id, fragment)?);
                }
                task_on(
                    host,
                    StageTask {
                        stage: stage_id,
                        fragment: whole_fragment.clone().expect("encoded above"),
                        channels: whole.into_iter().map(ChannelId).collect(),
                    },
                );
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
            split,
            replayed,
            "rebuilding a dead node's channels from lineage"
        );
        Ok(requests)
    }

    /// A stage's writer and the input of its rebuilt channels: readers replay from the
    /// producers' spools (where the producers run now). The rebuilt writer over it sends
    /// only to surviving consumers.
    fn rebuilt_input<'a>(
        &self,
        stage_id: StageId,
        stage: &'a Arc<dyn ExecutionPlan>,
        addrs: &BTreeMap<NodeId, String>,
        logged: &BTreeMap<StageId, BTreeMap<usize, Vec<(u32, u32)>>>,
    ) -> Result<(&'a ExchangeWriteExec, Arc<dyn ExecutionPlan>), LineageError> {
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
        Ok((writer, input))
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
        finished: &BTreeSet<(StageId, ChannelId)>,
    ) -> Result<BTreeMap<NodeId, RunRequest>, LineageError> {
        self.rebuild_channels(exec, plan, dead, finished).await
    }
}

/// True if every consumer of `writer`'s exchange, run by `channels` producer channels,
/// logs the order it reads their batches in: it then emits nothing computed from a batch
/// before that read is logged with the initiator (a bucket with one sender, such as a
/// gather's, logs nothing).
fn logs_reading_order(writer: &ExchangeWriteExec, channels: usize) -> bool {
    writer.spec.lineage && writer.spec.mode.senders_per_bucket(channels) > 1
}

/// True if a reading order the dead node logged for `exchange` read a batch of producer
/// channel `channel`: the rebuilt reader replays those very batches, so the channel must
/// reproduce them as they were.
fn logged_reads_of(
    logged: &BTreeMap<StageId, BTreeMap<usize, Vec<(u32, u32)>>>,
    exchange: StageId,
    channel: usize,
) -> bool {
    logged.get(&exchange).is_some_and(|buckets| {
        buckets
            .values()
            .flatten()
            .any(|&(sender, batches)| sender as usize == channel && batches > 0)
    })
}

fn writer_of(
    plan: &Arc<dyn ExecutionPlan>,
    stage: StageId,
) -> Result<&ExchangeWriteExec, LineageError> {
    plan.downcast_ref::<ExchangeWriteExec>()
        .ok_or(LineageError::NoWriter { stage })
}
