//! Running a distributed plan: the initiator sends each node the fragments of the stages
//! it hosts channels of; each node starts those channels at once (all stages together, so
//! they pipeline) and reports each channel as it ends. The initiator reads the answer from
//! the result exchange while the reports come in.

use crate::codec::TesseraCodec;
use crate::exchange::{ExchangeMode, ExchangeReadExec, ExchangeWriteExec, InboxKey, ReadSpec};
use crate::plan::{leaves_of, DistributedPlan, Leaf};
use crate::settings::ExecutionSettings;
use crate::Exec;
use crate::ExecError;
use crate::NodeId;
use crate::{ChannelId, ChannelReport, QueryId, StageId};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::Result as DfResult;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_proto_converter,
};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tessera_common::hex::{from_hex, to_hex};
use tokio::sync::mpsc;

/// How long the initiator waits, once it has the answer, for the remaining channels to
/// report (their receivers' acknowledgements) before it ends the query everywhere.
const REPORT_GRACE: Duration = Duration::from_secs(2);
const QUERY_END_TIMEOUT: Duration = Duration::from_secs(2);

/// The channels one node runs for a query.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRequest {
    pub query: QueryId,
    pub initiator: NodeId,
    pub stages: Vec<StageTask>,
    /// Lineage recovery: the node keeps the query (its spools) until the initiator ends
    /// it, not only until its channels are done.
    #[serde(default)]
    pub lineage: bool,
    /// The most memory the query may hold on the node (`tessera.query_memory_limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<u64>,
    /// The session's execution settings, which the channels run with.
    #[serde(default, skip_serializing_if = "ExecutionSettings::is_empty")]
    pub execution: ExecutionSettings,
}

impl tessera_net::WireRequest for RunRequest {
    const KIND: &'static str = "RunStages";
}

/// Starts channels of a query on the node at `addr`; yields their reports as they end.
pub async fn run_stages_at(
    clients: &tessera_net::Clients,
    addr: &str,
    request: &RunRequest,
) -> Result<
    impl futures::Stream<Item = Result<StagesEvent, tessera_net::CallError>> + use<>,
    tessera_net::CallError,
> {
    let stream = clients.get_messages(addr, request).await?;
    let addr = addr.to_string();
    Ok(stream.map(move |message| {
        serde_json::from_slice(&message?.app_metadata).map_err(|e| {
            tessera_net::CallError::Undecodable {
                what: "channel report",
                addr: addr.clone(),
                reason: e.to_string(),
            }
        })
    }))
}

/// What a node's `RunStages` stream carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum StagesEvent {
    /// A channel ended.
    Report(ChannelReport),
    /// Every channel of the request has ended.
    AllDone,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageTask {
    pub stage: StageId,
    /// The fragment as datafusion-proto bytes, hex-encoded.
    pub fragment: String,
    pub channels: Vec<ChannelId>,
}

/// The task context channels run in: the default session settings and one runtime per
/// process, so Parquet footers stay cached across queries.
pub fn task_context() -> Arc<TaskContext> {
    static CONTEXT: OnceLock<Arc<TaskContext>> = OnceLock::new();
    CONTEXT
        .get_or_init(|| SessionContext::new_with_config(SessionConfig::new()).task_ctx())
        .clone()
}

/// A channel's task context: [`task_context`]'s functions with a query's `config` (its
/// session's execution settings) and `runtime` (its memory pool).
pub fn task_context_with(
    config: SessionConfig,
    runtime: Arc<datafusion::execution::runtime_env::RuntimeEnv>,
) -> Arc<TaskContext> {
    let base = task_context();
    Arc::new(TaskContext::new(
        None,
        base.session_id(),
        config,
        base.scalar_functions().clone(),
        base.higher_order_functions().clone(),
        base.aggregate_functions().clone(),
        base.window_functions().clone(),
        runtime,
    ))
}

/// Starts the channels `request` names on this node. The receiver yields each channel's
/// report as it ends, and closes when all have.
pub fn run_stages(
    node: &Arc<Exec>,
    request: RunRequest,
) -> Result<mpsc::Receiver<ChannelReport>, ExecError> {
    let ctx = task_context();
    let codec = TesseraCodec { node: node.clone() };
    let mut plans = Vec::with_capacity(request.stages.len());
    for task in &request.stages {
        let bytes = from_hex(&task.fragment).ok_or_else(|| ExecError::GarbledStage {
            stage: task.stage,
            reason: "not hex".into(),
        })?;
        let plan =
            physical_plan_from_bytes_with_extension_codec(&bytes, &ctx, &codec).map_err(|e| {
                ExecError::GarbledStage {
                    stage: task.stage,
                    reason: e.to_string(),
                }
            })?;
        plans.push((
            plan,
            task.stage,
            task.channels.iter().map(|c| c.0).collect(),
        ));
    }
    start_plans(
        node,
        request.query,
        request.memory_limit,
        &request.execution,
        plans,
    )
}

/// Starts channels of stage plans already in memory (the initiator's own share).
fn start_plans(
    node: &Arc<Exec>,
    query: QueryId,
    memory_limit: Option<u64>,
    execution: &ExecutionSettings,
    plans: Vec<(Arc<dyn ExecutionPlan>, StageId, Vec<usize>)>,
) -> Result<mpsc::Receiver<ChannelReport>, ExecError> {
    let here: usize = plans.iter().map(|(_, _, channels)| channels.len()).sum();
    let config = execution.session_config()?;
    let ctx = || node.task_context(query, memory_limit, here, &config);
    let (tx, rx) = mpsc::channel(256);
    for (plan, stage, channels) in plans {
        start_stage(node, query, stage, plan, channels, &ctx, &tx)?;
    }
    Ok(rx)
}

/// Starts `channels` of one stage's plan instance. When a channel ends, the inboxes that
/// no other channel of the instance still reads are closed, so their producers stop
/// waiting on them (a join whose build side is empty never reads its probe side).
fn start_stage(
    node: &Arc<Exec>,
    query: QueryId,
    stage: StageId,
    plan: Arc<dyn ExecutionPlan>,
    channels: Vec<usize>,
    ctx: &dyn Fn() -> Arc<TaskContext>,
    reports: &mpsc::Sender<ChannelReport>,
) -> Result<(), ExecError> {
    let writer = plan
        .downcast_ref::<ExchangeWriteExec>()
        .ok_or_else(|| ExecError::NoWriter { stage })?;
    let started_at_us = writer.spec.started_at_us;
    // A rebuilt channel replays its input from spools: the inboxes under its keys belong
    // to the original instance of its stage on this node, if any, and stay open.
    let closes_inboxes = !writer.spec.rebuilt;
    let mut reads: HashMap<usize, Vec<InboxKey>> = HashMap::new();
    let readers: Arc<Mutex<HashMap<InboxKey, usize>>> = Arc::default();
    for &channel in &channels {
        let mut leaves = Vec::new();
        leaves_of(writer.input(), channel, &mut leaves);
        let keys: Vec<InboxKey> = leaves
            .into_iter()
            .filter_map(|leaf| match leaf {
                Leaf::Exchange { exchange, bucket } => Some(InboxKey {
                    query,
                    exchange,
                    bucket,
                }),
                Leaf::Scan { .. } => None,
            })
            .collect();
        let mut counts = readers.lock().expect("readers lock");
        for key in &keys {
            *counts.entry(*key).or_insert(0) += 1;
        }
        reads.insert(channel, keys);
    }
    for channel in channels {
        let (here, plan, ctx, reports, readers) = (
            node.clone(),
            plan.clone(),
            ctx(),
            reports.clone(),
            readers.clone(),
        );
        let keys = reads.remove(&channel).unwrap_or_default();
        // Every log line of the channel names it, so one grep follows a query across nodes.
        let span = tracing::info_span!("channel", query = %query, stage = stage.0, channel);
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                let node = here;
                let result = drain(plan.clone(), channel, ctx).await;
                let writer = plan
                    .downcast_ref::<ExchangeWriteExec>()
                    .expect("checked above");
                let mut report = match result {
                    Ok(()) => writer.report(channel).unwrap_or_default(),
                    Err(error) => {
                        let error = tessera_sql::error::from_datafusion(error);
                        ChannelReport {
                            sqlstate: Some(error.sqlstate().to_string()),
                            error: Some(tessera_sql::error::one_message(&error)),
                            ..Default::default()
                        }
                    }
                };
                report.stage = stage;
                report.channel = ChannelId(channel);
                report.node = node.id();
                report.first_input_us = keys
                    .iter()
                    .filter_map(|key| node.queries.peek(*key)?.first_batch_us())
                    .min()
                    .map(|at| at.saturating_sub(started_at_us));
                {
                    let mut counts = readers.lock().expect("readers lock");
                    for key in &keys {
                        let left = counts.get_mut(key).expect("counted above");
                        *left -= 1;
                        if *left == 0 && closes_inboxes {
                            node.queries.close(*key);
                        }
                    }
                }
                let _ = reports.send(report).await;
            },
            span,
        ));
        node.queries.track(query, task.abort_handle());
    }
    Ok(())
}

async fn drain(
    plan: Arc<dyn ExecutionPlan>,
    channel: usize,
    ctx: Arc<TaskContext>,
) -> DfResult<()> {
    let mut stream = plan.execute(channel, ctx)?;
    while let Some(batch) = stream.next().await {
        batch?;
    }
    Ok(())
}

/// What a distributed query returned.
#[derive(Debug)]
pub struct QueryOutcome {
    pub batches: Vec<RecordBatch>,
    /// What lineage recovery rebuilt after a node died, one line per failure.
    pub recoveries: Vec<crate::RecoveryOutcome>,
    /// Every channel's report that arrived, sorted by stage and channel.
    pub reports: Vec<ChannelReport>,
    pub elapsed: Duration,
}

enum Event {
    Report(ChannelReport),
    NodeDone(NodeId),
    /// The node's `RunStages` stream broke: the node is suspect.
    NodeFailed(NodeId, String),
    /// The node answered, but refused or failed the request.
    NodeRefused(NodeId, String),
    /// The node's `RunStages` stream broke after all its channels had ended. Nothing the
    /// query needs is lost with it under lineage recovery, but a producer elsewhere may
    /// still have been sending to it (a consumer may end before reading all its input, as
    /// a join with an empty build side does), and fails: the node's loss is then that
    /// failure's cause.
    FinishedNodeFailed(NodeId),
}

impl Event {
    /// The event for a `RunStages` call to `at` that ended in `error`. A broken
    /// connection makes `at` suspect at once: the metadata leader hears of it with this
    /// node's heartbeat, sent at once, and probes it at once.
    fn broken(node: &Exec, at: NodeId, error: tessera_net::CallError) -> Event {
        if error.is_transport() {
            node.suspect(at);
            Event::NodeFailed(at, error.to_string())
        } else {
            Event::NodeRefused(at, error.to_string())
        }
    }
}

/// Why a query stopped before its answer was complete.
enum Failure {
    /// A participant's stream broke.
    Node(NodeId, String),
    /// A channel or the answer reported an error, with its SQLSTATE where one is known.
    Other(String, Option<&'static str>),
    /// Whoever read the answer stopped (a client that went away): nothing to report.
    Abandoned,
}

/// How long after a channel's error the initiator waits for a participant's stream to
/// break: a dead node's peers often notice it (their exchange streams to it fail) a moment
/// before the initiator's own stream to it does.
const SUSPECT_GRACE: Duration = Duration::from_millis(1500);

/// Turns a failure into the query's error: [`ExecError::NodeLost`] if a participant's
/// stream broke (or breaks within [`SUSPECT_GRACE`]) and the metadata leader confirms that
/// node dead; the failure as it was otherwise.
async fn diagnose(
    node: &Arc<Exec>,
    query: QueryId,
    failure: Failure,
    finished_and_failed: Option<NodeId>,
    incoming: &mut mpsc::Receiver<Event>,
) -> ExecError {
    let (suspect, detail) = match failure {
        Failure::Node(at, detail) => (Some(at), detail),
        Failure::Abandoned => (None, "the answer's reader went away".to_string()),
        // The statement's own fault (a division by zero, a bad cast): no node is to blame.
        Failure::Other(detail, Some(sqlstate))
            if tessera_sql::SqlError::is_statement_error(sqlstate) =>
        {
            return ExecError::Failed {
                query,
                detail,
                sqlstate: Some(sqlstate),
            };
        }
        Failure::Other(detail, _) => {
            // A participant whose channels all ended may have died while a producer still
            // sent to it: a stream breaking mid-work is the likelier cause, so it is waited
            // for first, but such a node is the cause when none breaks.
            let mut finished_and_failed = finished_and_failed;
            let broke = tokio::time::timeout(SUSPECT_GRACE, async {
                while let Some(event) = incoming.recv().await {
                    match event {
                        Event::NodeFailed(at, _) => return Some(at),
                        Event::FinishedNodeFailed(at) => {
                            finished_and_failed.get_or_insert(at);
                        }
                        _ => {}
                    }
                }
                None
            })
            .await
            .ok()
            .flatten();
            if let (None, Some(node)) = (broke, finished_and_failed) {
                tracing::warn!(
                    node = node.0,
                    %query,
                    "a node lost after all its channels ended is taken as the failure's cause"
                );
            }
            (broke.or(finished_and_failed), detail)
        }
    };
    let Some(suspect) = suspect else {
        return ExecError::Failed {
            query,
            detail,
            sqlstate: None,
        };
    };
    if node.confirm_failed(suspect).await {
        ExecError::NodeLost {
            node: suspect,
            query,
            detail,
        }
    } else {
        node.note_unreachable(suspect);
        ExecError::Unconfirmed {
            query,
            node: suspect,
            detail,
        }
    }
}

/// A distributed plan's channels, ready to start: fragments encoded for the other nodes,
/// plans in memory for this one.
pub struct Work {
    remote: BTreeMap<NodeId, RunRequest>,
    local: Vec<(Arc<dyn ExecutionPlan>, StageId, Vec<usize>)>,
}

/// Encodes each stage once for the nodes that run its channels. Fails (before anything
/// starts) if a stage holds an operator that cannot travel.
pub fn encode(node: &Arc<Exec>, plan: &DistributedPlan) -> DfResult<Work> {
    let me = node.id();
    let codec = TesseraCodec { node: node.clone() };
    let mut remote: BTreeMap<NodeId, RunRequest> = BTreeMap::new();
    let mut local = Vec::new();
    for stage in &plan.stages {
        let mut by_node: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        for (channel, &at) in stage.channels.iter().enumerate() {
            by_node.entry(at).or_default().push(channel);
        }
        let mut fragment: Option<String> = None;
        for (at, channels) in by_node {
            if at == me {
                local.push((stage.plan.clone(), stage.id, channels));
                continue;
            }
            if fragment.is_none() {
                let bytes = physical_plan_to_bytes_with_proto_converter(
                    stage.plan.clone(),
                    &codec,
                    &crate::subquery::LiteralSubqueries,
                )?;
                fragment = Some(to_hex(&bytes));
            }
            remote
                .entry(at)
                .or_insert_with(|| RunRequest {
                    query: plan.query,
                    initiator: me,
                    stages: vec![],
                    lineage: plan.lineage,
                    memory_limit: plan.memory_limit,
                    execution: plan.execution.clone(),
                })
                .stages
                .push(StageTask {
                    stage: stage.id,
                    fragment: fragment.clone().unwrap_or_default(),
                    channels: channels.into_iter().map(ChannelId).collect(),
                });
        }
    }
    Ok(Work { remote, local })
}

/// Starts a `RunStages` call to `at`; its reports and its end become events.
fn call_run_stages(node: &Arc<Exec>, at: NodeId, request: RunRequest, events: mpsc::Sender<Event>) {
    let node = node.clone();
    let query = request.query;
    tokio::spawn(async move {
        let Some(addr) = node.meta.addr_of(at) else {
            let _ = events
                .send(Event::NodeRefused(at, "no known address".into()))
                .await;
            return;
        };
        let mut stream = match run_stages_at(&node.clients, &addr, &request).await {
            Ok(stream) => stream,
            Err(error) => {
                let _ = events.send(Event::broken(&node, at, error)).await;
                return;
            }
        };
        let event = loop {
            match stream.next().await {
                Some(Ok(StagesEvent::Report(report))) => {
                    let _ = events.send(Event::Report(report)).await;
                }
                Some(Ok(StagesEvent::AllDone)) | None => break Event::NodeDone(at),
                Some(Err(error)) => break Event::broken(&node, at, error),
            }
        };
        let done = matches!(event, Event::NodeDone(_));
        let _ = events.send(event).await;
        if done {
            // The node holds on to the query (under lineage recovery, its spools) while
            // this stream is open, until the query ends. It ends there when told so, or
            // when the query ends here and this side drops the stream (should the word
            // not reach it).
            let ended_here = node.queries.wait_ended(query);
            tokio::pin!(ended_here);
            loop {
                tokio::select! {
                    item = stream.next() => match item {
                        Some(Ok(_)) => {}
                        Some(Err(error)) => {
                            if error.is_transport() {
                                node.suspect(at);
                                let _ = events.send(Event::FinishedNodeFailed(at)).await;
                            }
                            break;
                        }
                        None => break,
                    },
                    () = &mut ended_here => break,
                }
            }
        }
    });
}

/// Runs `plan` from this node (the initiator) and returns its answer. Under lineage
/// recovery a participant's death is survived by rebuilding its channels on the others
/// (the [`crate::hooks::QueryRecovery`]); otherwise it ends the query with the node's loss.
pub async fn execute(
    node: &Arc<Exec>,
    plan: &DistributedPlan,
    work: Work,
    schema: SchemaRef,
) -> Result<QueryOutcome, ExecError> {
    let (sink, mut answer) = mpsc::channel(ANSWER_QUEUE);
    let run = async {
        let outcome = execute_into(node, plan, work, schema, &sink).await;
        drop(sink);
        outcome
    };
    let collect = async {
        let mut batches = Vec::new();
        while let Some(Ok(batch)) = answer.recv().await {
            batches.push(batch);
        }
        batches
    };
    let (outcome, batches) = tokio::join!(run, collect);
    Ok(QueryOutcome {
        batches,
        ..outcome?
    })
}

/// The answer's batches on their way out of [`execute_into`], which sends only `Ok`s; a
/// streaming reader's task adds the query's error at the end ([`crate::answer`]).
pub(crate) type AnswerSink = mpsc::Sender<DfResult<RecordBatch>>;
/// Answer batches the initiator holds ahead of a slow reader before it stops reading them.
pub(crate) const ANSWER_QUEUE: usize = 4;

/// Runs a distributed plan from this node, sending its answer's batches to `sink` as they
/// arrive. The outcome it returns has no batches.
pub(crate) async fn execute_into(
    node: &Arc<Exec>,
    plan: &DistributedPlan,
    work: Work,
    schema: SchemaRef,
    sink: &AnswerSink,
) -> Result<QueryOutcome, ExecError> {
    let span = tracing::info_span!("query", query = %plan.query, initiator = node.id().0);
    tracing::Instrument::instrument(execute_here(node, plan, work, schema, sink), span).await
}

async fn execute_here(
    node: &Arc<Exec>,
    plan: &DistributedPlan,
    work: Work,
    schema: SchemaRef,
    sink: &AnswerSink,
) -> Result<QueryOutcome, ExecError> {
    let started = std::time::Instant::now();
    let watch = crate::progress::Watch::start(plan);
    let me = node.id();
    let Work {
        remote: requests,
        local,
    } = work;

    // The answer: stage 0's single channel gathers it here.
    let reader = ExchangeReadExec::new(
        ReadSpec {
            query: plan.query,
            exchange: StageId::ANSWER,
            mode: ExchangeMode::Gather,
            buckets: 1,
            producer_channels: 1,
            lineage: plan.lineage,
            initiator: me,
            replay: None,
        },
        schema,
        node.clone(),
    );
    let mut answer = reader.execute(0, task_context()).map_err(ExecError::Plan)?;

    let (events, mut incoming) = mpsc::channel::<Event>(1024);
    let mut participants: Vec<NodeId> = requests.keys().copied().collect();
    participants.push(me);
    let mut end = EndEverywhere {
        node: node.clone(),
        query: plan.query,
        participants,
        lineage: plan.lineage,
    };
    // Before any channel runs: from here on this node takes the lineage they log.
    let mut recovery = node.lineage.recovery(plan);
    // RunStages calls not yet done, per node.
    let mut outstanding: BTreeMap<NodeId, usize> = BTreeMap::new();
    {
        let mut reports = start_plans(node, plan.query, plan.memory_limit, &plan.execution, local)?;
        let events = events.clone();
        tokio::spawn(async move {
            while let Some(report) = reports.recv().await {
                let _ = events.send(Event::Report(report)).await;
            }
            let _ = events.send(Event::NodeDone(me)).await;
        });
        outstanding.insert(me, 1);
    }
    for (at, request) in requests {
        call_run_stages(node, at, request, events.clone());
        *outstanding.entry(at).or_default() += 1;
    }
    // Kept while recovery may start more calls (the loop then ends on `outstanding`).
    let events = plan.lineage.then_some(events);

    // A batch read from the answer and not yet taken by the sink: the answer is read no
    // faster than the client takes it, while node failures are still handled meanwhile.
    let mut unsent: Option<RecordBatch> = None;
    let mut reports = Vec::new();
    let mut answered = false;
    let mut events_open = true;
    // The first participant lost after all its channels had ended.
    let mut finished_and_failed: Option<NodeId> = None;
    let failure = loop {
        tokio::select! {
            permit = sink.reserve(), if unsent.is_some() => match permit {
                Ok(permit) => permit.send(Ok(unsent.take().expect("a batch to send"))),
                Err(_) => break Some(Failure::Abandoned),
            },
            batch = answer.next(), if !answered && unsent.is_none() => match batch {
                Some(Ok(batch)) => {
                    watch.answer_rows(batch.num_rows());
                    unsent = Some(batch);
                }
                Some(Err(error)) => {
                    let error = tessera_sql::error::from_datafusion(error);
                    let sqlstate = error.sqlstate();
                    break Some(Failure::Other(tessera_sql::error::one_message(&error), Some(sqlstate)));
                }
                None => answered = true,
            },
            event = incoming.recv(), if events_open => match event {
                Some(Event::Report(report)) => {
                    if let Some(error) = &report.error {
                        let sqlstate = report.sqlstate.as_deref().and_then(tessera_sql::error::known_sqlstate);
                        break Some(Failure::Other(format!(
                            "stage {} channel {} on node {} failed: {error}",
                            report.stage, report.channel, report.node
                        ), sqlstate));
                    }
                    watch.channel_done(&report);
                    reports.push(report);
                }
                Some(Event::NodeDone(at)) => settle(&mut outstanding, at),
                Some(Event::NodeFailed(at, error)) => {
                    tracing::info!(node = at.0, %error, "a participant's stream broke");
                    settle(&mut outstanding, at);
                    let Some(events) = events.as_ref().filter(|_| recovery.can_recover(at)) else {
                        break Some(Failure::Node(at, error));
                    };
                    let finished: BTreeSet<(StageId, ChannelId)> = reports
                        .iter()
                        .filter(|report| report.node == at)
                        .map(|report| (report.stage, report.channel))
                        .collect();
                    match recovery.rebuild(node, plan, at, &finished).await {
                        Ok(requests) => {
                            let requests: Vec<_> = requests.into_iter().collect();
                            watch.rebuilt(&requests);
                            outstanding.remove(&at);
                            for (host, request) in requests {
                                call_run_stages(node, host, request, events.clone());
                                *outstanding.entry(host).or_default() += 1;
                                if !end.participants.contains(&host) {
                                    end.participants.push(host);
                                }
                            }
                        }
                        Err(why) => break Some(Failure::Node(at, format!("{error}; lineage recovery failed: {why}"))),
                    }
                }
                Some(Event::NodeRefused(at, error)) => {
                    break Some(Failure::Other(format!("node {at} refused its stages: {error}"), None))
                }
                // Nothing is lost yet; a failure that follows may be this loss's doing.
                Some(Event::FinishedNodeFailed(at)) => {
                    finished_and_failed.get_or_insert(at);
                }
                // Every node finished, so the answer's stream is about to end.
                None => events_open = false,
            },
        }
        if answered && unsent.is_none() && (!events_open || outstanding.is_empty()) {
            break None;
        }
    };
    if failure.is_none() && !outstanding.is_empty() {
        // The answer is complete; give the last acknowledgements a moment to land.
        let _ = tokio::time::timeout(REPORT_GRACE, async {
            while let Some(event) = incoming.recv().await {
                match event {
                    Event::Report(report) => reports.push(report),
                    Event::NodeDone(at) => {
                        settle(&mut outstanding, at);
                        if outstanding.is_empty() {
                            break;
                        }
                    }
                    Event::NodeFailed(..) | Event::NodeRefused(..) => break,
                    Event::FinishedNodeFailed(_) => {}
                }
            }
        })
        .await;
    }
    drop(end);
    drop(events);
    if let Some(failure) = failure {
        // Whatever fails after a lineage recovery began (a rebuilt channel that did not
        // reproduce its output, a second death) is that node's loss: the query restarts.
        let failure = match (failure, recovery.lost()) {
            (Failure::Other(detail, _), Some(dead)) => Failure::Node(
                dead,
                format!("after rebuilding node {dead}'s channels: {detail}"),
            ),
            (failure, _) => failure,
        };
        return Err(diagnose(
            node,
            plan.query,
            failure,
            finished_and_failed,
            &mut incoming,
        )
        .await);
    }
    reports.sort_by_key(|r| (r.stage, r.channel));
    Ok(QueryOutcome {
        batches: Vec::new(),
        reports,
        elapsed: started.elapsed(),
        recoveries: recovery.into_outcomes(),
    })
}

/// One `RunStages` call to `at` is over.
fn settle(outstanding: &mut BTreeMap<NodeId, usize>, at: NodeId) {
    if let Some(calls) = outstanding.get_mut(&at) {
        *calls -= 1;
        if *calls == 0 {
            outstanding.remove(&at);
        }
    }
}

/// Ends the query on every node that took part when dropped: when the initiator has the
/// answer, gives up, or is itself cancelled (its client went away). Here at once;
/// elsewhere in the background, so the answer does not wait for it.
struct EndEverywhere {
    node: Arc<Exec>,
    query: QueryId,
    participants: Vec<NodeId>,
    /// The query logged lineage: the metadata store drops it.
    lineage: bool,
}

impl Drop for EndEverywhere {
    fn drop(&mut self) {
        self.node.end_query(self.query);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let query = self.query;
        if self.lineage {
            self.node.lineage.forget(query);
        }
        let calls: Vec<_> = self
            .participants
            .iter()
            .filter(|&&at| at != self.node.id())
            .filter_map(|&at| self.node.meta.addr_of(at))
            .map(|addr| {
                let clients = self.node.clients.clone();
                async move {
                    // The reply's type must match the server's, or every query's end
                    // would read as a broken connection and open a new one next time.
                    let _: Result<Result<(), tessera_net::Refusal>, _> = clients
                        .action(
                            &addr,
                            crate::wire::ACTION_QUERY_END,
                            query,
                            QUERY_END_TIMEOUT,
                        )
                        .await;
                }
            })
            .collect();
        runtime.spawn(futures::future::join_all(calls));
    }
}
