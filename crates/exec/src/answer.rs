//! A distributed query's answer as a stream: the query runs in a task of its own and its
//! answer's batches arrive as the initiator reads them, at the pace of whoever reads the
//! stream (the initiator reads no further ahead than [`crate::run::ANSWER_QUEUE`]
//! batches). Dropping the stream ends the query on every node.
//!
//! The stream's last item is the query's error, if it failed, as an
//! [`ExecError`] inside [`DataFusionError::External`]: [`exec_error`] takes it back out, so
//! a caller that has sent nothing yet can still run the query again.

use crate::run::{execute_into, QueryOutcome, Work, ANSWER_QUEUE};
use crate::{Exec, ExecError, Recoveries, RecoveryOutcome};
use arrow::datatypes::SchemaRef;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::SendableRecordBatchStream;
use futures::{stream, StreamExt};
use std::sync::Arc;
use tessera_sql::SqlError;
use tokio::sync::{mpsc, oneshot};

/// Starts `plan` and returns its answer as a stream, with the query's outcome (its reports
/// and what lineage recovery rebuilt), ready once the stream has ended without error.
pub fn execute_stream(
    node: Arc<Exec>,
    plan: crate::plan::DistributedPlan,
    work: Work,
    schema: SchemaRef,
) -> (SendableRecordBatchStream, oneshot::Receiver<QueryOutcome>) {
    let (sink, answer) = mpsc::channel(ANSWER_QUEUE);
    let (outcome_tx, outcome) = oneshot::channel();
    // The task works for the statement the caller works for (the console lists it there).
    let statement = tessera_common::statement::current();
    let run = {
        let schema = schema.clone();
        async move {
            match execute_into(&node, &plan, work, schema, &sink).await {
                // Before the stream ends (the sink drops after this), so a reader that saw
                // the end finds the outcome.
                Ok(outcome) => drop(outcome_tx.send(outcome)),
                Err(error) => drop(sink.send(Err(external(error))).await),
            }
        }
    };
    let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
        match statement {
            Some(id) => tessera_common::statement::within(id, run).await,
            None => run.await,
        }
    }));
    let stopper = AbortOnDrop(task);
    let batches = stream::unfold((answer, stopper), |(mut answer, stopper)| async move {
        let item = answer.recv().await?;
        Some((item, (answer, stopper)))
    });
    (
        Box::pin(RecordBatchStreamAdapter::new(schema, batches)),
        outcome,
    )
}

/// Ends the query's task (and so the query everywhere) when its answer is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn external(error: ExecError) -> DataFusionError {
    DataFusionError::External(Box::new(error))
}

/// The [`ExecError`] a query's answer stream ended in, or the error as a plan error.
pub fn exec_error(error: DataFusionError) -> ExecError {
    match error {
        DataFusionError::External(inner) => match inner.downcast::<ExecError>() {
            Ok(exec) => *exec,
            Err(other) => ExecError::Plan(DataFusionError::External(other)),
        },
        other => ExecError::Plan(other),
    }
}

/// The rest of an answer that has begun to reach its client: counts the rows that went
/// out, so that a node lost from here on is reported as cutting the answer short (it cannot
/// be run again unseen), and, at its end, adds what lineage recovery rebuilt to the
/// statement's `recoveries` (the client's notices) before the end is seen.
pub fn sent_as_it_comes(
    answer: SendableRecordBatchStream,
    outcome: oneshot::Receiver<QueryOutcome>,
    recoveries: Recoveries,
) -> SendableRecordBatchStream {
    let schema = answer.schema();
    // The stream is read by the client's connection, outside the statement's task.
    let statement = tessera_common::statement::current();
    let rows = stream::unfold(
        (answer, 0_u64, Some((outcome, recoveries))),
        move |(mut answer, sent, mut end)| async move {
            match answer.next().await {
                Some(Ok(batch)) => {
                    let sent = sent + batch.num_rows() as u64;
                    Some((Ok(batch), (answer, sent, end)))
                }
                Some(Err(error)) => Some((Err(cut_short(error, sent)), (answer, sent, None))),
                None => {
                    if let Some((mut outcome, recoveries)) = end.take() {
                        if let Ok(done) = outcome.try_recv() {
                            note_recoveries(done, statement, &recoveries);
                        }
                    }
                    None
                }
            }
        },
    );
    Box::pin(RecordBatchStreamAdapter::new(schema, rows))
}

/// A streaming answer's error, as the client gets it: a node lost after rows went out
/// says so; the cluster's errors are [`SqlError::Cluster`] (a client may retry them), the
/// statement's own keep their SQLSTATE.
fn cut_short(error: DataFusionError, rows_sent: u64) -> DataFusionError {
    let cluster = |error: ExecError| DataFusionError::External(Box::new(SqlError::from(error)));
    match exec_error(error) {
        ExecError::NodeLost {
            node,
            query,
            detail,
        } => cluster(ExecError::LostMidAnswer {
            node,
            query,
            rows_sent,
            detail,
        }),
        ExecError::Plan(error) => error,
        other => cluster(other),
    }
}

/// What each channel of a query that survived a node's loss did and when, rebuilt ones
/// included, in the log: where the recovery's time went.
pub(crate) fn trace_recovered_channels(outcome: &QueryOutcome) {
    if outcome.recoveries.is_empty() {
        return;
    }
    for report in &outcome.reports {
        let channel = crate::explain::channel_line(report);
        tracing::info!(stage = %report.stage, %channel, "a recovered query's channel");
    }
}

/// What lineage recovery rebuilt while an answer streamed: the statement's notices, its
/// entry among the node's statements (the console), the log and the node's metrics.
fn note_recoveries(outcome: QueryOutcome, statement: Option<u64>, recoveries: &Recoveries) {
    for recovery in &outcome.recoveries {
        tracing::warn!(%recovery, "a streamed answer survived the loss of a node");
    }
    trace_recovered_channels(&outcome);
    tessera_common::metrics::metrics()
        .query_recoveries
        .inc_by(outcome.recoveries.len() as u64);
    if let Some(statement) = statement {
        let lines = outcome.recoveries.iter().map(RecoveryOutcome::to_string);
        tessera_sql::activity::note_recoveries_of(statement, lines);
    }
    recoveries.extend(outcome.recoveries);
}
