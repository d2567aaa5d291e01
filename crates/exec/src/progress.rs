//! The distributed queries this node initiated and is running, for the console's live
//! progress: each stage's channels, the node each runs on, which have finished and with how
//! many rows, the answer's rows so far, and the recoveries that moved channels. The
//! initiator learns a channel's end from its report, as it arrives; a running channel's
//! rows are not known until then.

use crate::plan::DistributedPlan;
use crate::run::RunRequest;
use crate::{ChannelReport, NodeId, QueryId};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

/// One query in flight, as the console draws it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct QueryProgress {
    /// The query id in hex, as log lines and notices show it.
    pub query: String,
    /// The statement (of the node's activity list) that started it, when known.
    pub statement: Option<u64>,
    pub elapsed_ms: u64,
    /// Rows of the answer this node has received so far.
    pub answer_rows: u64,
    /// Nodes whose channels lineage recovery rebuilt elsewhere.
    pub recoveries: u32,
    /// Leaves first, as data flows.
    pub stages: Vec<StageProgress>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StageProgress {
    pub stage: usize,
    pub channels: Vec<ChannelProgress>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChannelProgress {
    pub channel: usize,
    pub node: NodeId,
    pub done: bool,
    /// Rows the channel produced; known once it is done.
    pub rows: u64,
}

struct InFlight {
    progress: QueryProgress,
    started: Instant,
}

static IN_FLIGHT: LazyLock<Mutex<BTreeMap<QueryId, InFlight>>> = LazyLock::new(Mutex::default);

/// The queries in flight from this node, oldest first.
pub fn snapshot() -> Vec<QueryProgress> {
    let in_flight = IN_FLIGHT.lock().expect("progress lock");
    let mut queries: Vec<(Instant, QueryProgress)> = in_flight
        .values()
        .map(|q| {
            let mut progress = q.progress.clone();
            progress.elapsed_ms = q.started.elapsed().as_millis() as u64;
            (q.started, progress)
        })
        .collect();
    queries.sort_by_key(|(started, _)| *started);
    queries.into_iter().map(|(_, progress)| progress).collect()
}

/// A query's entry in the list while the initiator runs it; dropping it removes the entry.
pub(crate) struct Watch {
    query: QueryId,
}

impl Watch {
    pub(crate) fn start(plan: &DistributedPlan) -> Watch {
        let mut stages: Vec<StageProgress> = plan
            .stages
            .iter()
            .map(|stage| StageProgress {
                stage: stage.id.0,
                channels: stage
                    .channels
                    .iter()
                    .enumerate()
                    .map(|(channel, node)| ChannelProgress {
                        channel,
                        node: *node,
                        done: false,
                        rows: 0,
                    })
                    .collect(),
            })
            .collect();
        stages.sort_by_key(|s| std::cmp::Reverse(s.stage));
        let progress = QueryProgress {
            query: plan.query.to_string(),
            statement: tessera_common::statement::current(),
            elapsed_ms: 0,
            answer_rows: 0,
            recoveries: 0,
            stages,
        };
        IN_FLIGHT.lock().expect("progress lock").insert(
            plan.query,
            InFlight {
                progress,
                started: Instant::now(),
            },
        );
        Watch { query: plan.query }
    }

    fn update(&self, change: impl FnOnce(&mut QueryProgress)) {
        if let Some(q) = IN_FLIGHT
            .lock()
            .expect("progress lock")
            .get_mut(&self.query)
        {
            change(&mut q.progress);
        }
    }

    fn channel(
        progress: &mut QueryProgress,
        stage: usize,
        channel: usize,
    ) -> Option<&mut ChannelProgress> {
        progress
            .stages
            .iter_mut()
            .find(|s| s.stage == stage)?
            .channels
            .get_mut(channel)
    }

    pub(crate) fn channel_done(&self, report: &ChannelReport) {
        self.update(|progress| {
            if let Some(channel) = Self::channel(progress, report.stage.0, report.channel.0) {
                channel.done = true;
                channel.rows = report.rows;
                channel.node = report.node;
            }
        });
    }

    pub(crate) fn answer_rows(&self, rows: usize) {
        self.update(|progress| progress.answer_rows += rows as u64);
    }

    /// Lineage recovery rebuilt a dead node's channels on `hosts`: they run again there.
    pub(crate) fn rebuilt(&self, hosts: &[(NodeId, RunRequest)]) {
        self.update(|progress| {
            progress.recoveries += 1;
            for (host, request) in hosts {
                for task in &request.stages {
                    for channel in &task.channels {
                        if let Some(c) = Self::channel(progress, task.stage.0, channel.0) {
                            c.node = *host;
                            c.done = false;
                            c.rows = 0;
                        }
                    }
                }
            }
        });
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        IN_FLIGHT.lock().expect("progress lock").remove(&self.query);
    }
}
