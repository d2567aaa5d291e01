//! `EXPLAIN` and `EXPLAIN ANALYZE` of a distributed plan: its stages, where their channels
//! run, what each sends where, and (after a run) what every channel did.
//!
//! The per-channel lines of `EXPLAIN ANALYZE` have a fixed shape that tools may parse:
//! `channel C on node N: rows=R batches=B bytes_sent=S started_ms=T first_input_ms=F
//! finished_ms=E` (times since the query started; `F` is `-` for a channel that reads no
//! exchange).

use crate::exchange::ExchangeWriteExec;
use crate::plan::{DistributedPlan, Stage};
use crate::run::QueryOutcome;
use crate::ChannelReport;
use crate::NodeId;
use datafusion::physical_plan::display::DisplayableExecutionPlan;
use std::collections::BTreeMap;
use std::fmt::Write;

fn placement(stage: &Stage) -> String {
    let mut by_node: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
    for (channel, &node) in stage.channels.iter().enumerate() {
        by_node.entry(node).or_default().push(channel);
    }
    by_node
        .iter()
        .map(|(node, channels)| format!("node {node}: {}", ranges(channels)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// `0-3,7` for [0, 1, 2, 3, 7].
fn ranges(values: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let start = values[i];
        let mut end = start;
        while i + 1 < values.len() && values[i + 1] == end + 1 {
            i += 1;
            end = values[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

fn output(stage: &Stage, plan: &DistributedPlan) -> String {
    let writer = stage
        .plan
        .downcast_ref::<ExchangeWriteExec>()
        .expect("every stage ends in an exchange writer");
    if stage.id == crate::StageId::ANSWER {
        return format!("answer gathered on node {}", plan.initiator);
    }
    let mut consumers: Vec<NodeId> = writer.spec.destinations.iter().flatten().copied().collect();
    consumers.sort_unstable();
    consumers.dedup();
    let broadcast = writer.spec.destinations.iter().any(|d| d.len() > 1);
    let consumer_stage = plan
        .stages
        .iter()
        .find(|s| s.inputs.contains(&stage.id))
        .map(|s| s.id.to_string())
        .unwrap_or_else(|| "?".into());
    format!(
        "{} exchange into {} bucket(s) of stage {consumer_stage} on node(s) {consumers:?}{}",
        writer.spec.mode,
        writer.spec.buckets,
        if broadcast { ", broadcast" } else { "" }
    )
}

/// The distributed plan, stage by stage, top first.
pub fn describe(plan: &DistributedPlan) -> String {
    let mut text = format!(
        "Distributed plan: {} stage(s), initiator node {}, partition map version {}\n",
        plan.stages.len(),
        plan.initiator,
        plan.map_version
    );
    for stage in &plan.stages {
        let _ = writeln!(text, "{}", stage_line(stage, plan));
        write_fragment(&mut text, stage);
    }
    text
}

/// `Stage S: C channel(s) [placement]; where its output goes`.
fn stage_line(stage: &Stage, plan: &DistributedPlan) -> String {
    format!(
        "Stage {}: {} channel(s) [{}]; {}",
        stage.id,
        stage.channels.len(),
        placement(stage),
        output(stage, plan)
    )
}

/// The stage's operators, indented under its line.
fn write_fragment(text: &mut String, stage: &Stage) {
    let fragment = DisplayableExecutionPlan::new(stage.plan.as_ref()).indent(true);
    for line in fragment.to_string().lines() {
        let _ = writeln!(text, "  {line}");
    }
}

fn ms(us: u64) -> String {
    format!("{:.1}", us as f64 / 1000.0)
}

pub(crate) fn channel_line(report: &ChannelReport) -> String {
    let spilled = match report.spilled_bytes {
        0 => String::new(),
        bytes => format!(" spilled_bytes={bytes}"),
    };
    let scanned = &report.scanned;
    let read: String = [
        ("read_parquet", scanned.parquet),
        ("read_decoded", scanned.decoded),
        ("read_versioned", scanned.versioned),
        ("read_files", scanned.files),
        ("read_remote", scanned.remote),
    ]
    .into_iter()
    .filter(|&(_, count)| count > 0)
    .map(|(key, count)| format!(" {key}={count}"))
    .collect();
    format!(
        "channel {} on node {}: rows={} batches={} bytes_sent={} started_ms={} first_input_ms={} finished_ms={}{read}{spilled}",
        report.channel,
        report.node,
        report.rows,
        report.batches,
        report.bytes_sent,
        ms(report.started_us),
        report.first_input_us.map(ms).unwrap_or_else(|| "-".into()),
        ms(report.finished_us)
    )
}

/// The plan with what every stage and channel did.
pub fn describe_with_metrics(plan: &DistributedPlan, outcome: &QueryOutcome) -> String {
    let total_bytes: u64 = outcome.reports.iter().map(|r| r.bytes_sent).sum();
    let spilled: u64 = outcome.reports.iter().map(|r| r.spilled_bytes).sum();
    let answer_rows: usize = outcome.batches.iter().map(|b| b.num_rows()).sum();
    let mut text = format!(
        "Distributed plan with metrics: {} stage(s), initiator node {}, {} answer row(s) in {:.1} ms, bytes exchanged {total_bytes}, bytes spilled {spilled}\n",
        plan.stages.len(),
        plan.initiator,
        answer_rows,
        outcome.elapsed.as_secs_f64() * 1e3
    );
    for stage in &plan.stages {
        let reports: Vec<&ChannelReport> = outcome
            .reports
            .iter()
            .filter(|r| r.stage == stage.id)
            .collect();
        let rows: u64 = reports.iter().map(|r| r.rows).sum();
        let bytes: u64 = reports.iter().map(|r| r.bytes_sent).sum();
        let first_input = reports.iter().filter_map(|r| r.first_input_us).min();
        let finished = reports.iter().map(|r| r.finished_us).max().unwrap_or(0);
        let _ = writeln!(
            text,
            "{}; rows={rows} bytes_sent={bytes} first_input_ms={} finished_ms={}",
            stage_line(stage, plan),
            first_input.map(ms).unwrap_or_else(|| "-".into()),
            ms(finished)
        );
        for report in &reports {
            let _ = writeln!(text, "  {}", channel_line(report));
        }
        if reports.len() < stage.channels.len() {
            let _ = writeln!(
                text,
                "  ({} channel(s) did not report before the query ended)",
                stage.channels.len() - reports.len()
            );
        }
        write_fragment(&mut text, stage);
    }
    text
}
