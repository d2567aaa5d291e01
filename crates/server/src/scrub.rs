//! The scrubber (Pond's self-verifying blocks): every node hashes the components its
//! manifests name again, at a bounded rate, and repairs those that no longer match their
//! name (bit rot, a torn or deleted file) before a query or a copy trips over them.
//!
//! A damaged component is first replaced by another replica's copy of the same component
//! (components are named by their hash, so any copy that hashes right is the same one: a
//! cold standby holds its primary's very components). Where no replica has it (replicas
//! that flushed on their own hold the same rows in other components), this node's replica
//! of the partition is refused and copied whole, as `tessera verify` does.
//!
//! A pass runs `[scrub] every_ms` after the previous one ended, reading at most
//! `[scrub] bytes_per_sec`; `tessera scrub` runs one now on every node, unthrottled.

use crate::meta::MetaCommand;
use crate::node::Node;
use crate::rpc::{CallError, Refusal};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};
use tessera_common::NodeId;
use tessera_exec::scan::Damaged;

/// A client asks a node to scrub now ([`ScrubRequest`]); it answers every report.
pub const ACTION_SCRUB: &str = "scrub";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScrubRequest {
    /// Also have every other live node scrub, and gather their reports.
    pub everywhere: bool,
}

/// What one pass on one node checked and did.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScrubReport {
    pub node: NodeId,
    /// When it started, in milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    pub elapsed_ms: u64,
    pub components: usize,
    /// Archive fragments this node holds, checked.
    #[serde(default)]
    pub fragments: usize,
    /// Fragments no archived epoch placed here any more, deleted.
    #[serde(default)]
    pub collected_fragments: usize,
    pub bytes: u64,
    /// Each damaged component found, and what was wrong.
    pub damaged: Vec<String>,
    /// How each was repaired.
    pub repaired: Vec<String>,
    /// Those it could not repair, and why.
    pub unrepaired: Vec<String>,
}

/// This process's last finished pass.
static LAST: LazyLock<Mutex<Option<ScrubReport>>> = LazyLock::new(Default::default);

/// The last pass this node finished, if any.
pub fn last_scrub() -> Option<ScrubReport> {
    LAST.lock().expect("last scrub lock").clone()
}

/// Runs passes for ever, as `[scrub]` says (none if its rate is 0).
pub async fn scrub_loop(node: Arc<Node>) {
    let settings = node.config.scrub.clone();
    if settings.bytes_per_sec == 0 {
        return;
    }
    loop {
        tokio::time::sleep(Duration::from_millis(settings.every_ms)).await;
        let report = scrub(&node, settings.bytes_per_sec).await;
        if !report.damaged.is_empty() {
            tracing::warn!(damaged = ?report.damaged, repaired = ?report.repaired, unrepaired = ?report.unrepaired, "scrub found damaged components");
        }
    }
}

/// One pass over every component this node holds, reading at most `bytes_per_sec` (0: as
/// fast as the disk goes); repairs what it finds damaged.
pub async fn scrub(node: &Arc<Node>, bytes_per_sec: u64) -> ScrubReport {
    let started = Instant::now();
    let mut report = ScrubReport {
        node: node.id(),
        started_at_ms: tessera_common::time::now_ms(),
        elapsed_ms: 0,
        components: 0,
        fragments: 0,
        collected_fragments: 0,
        bytes: 0,
        damaged: Vec::new(),
        repaired: Vec::new(),
        unrepaired: Vec::new(),
    };
    let held = node.store.held_components();
    for component in held {
        let store = node.store.clone();
        let hash = component.hash;
        let checked = tokio::task::spawn_blocking(move || store.rehash_component(&hash))
            .await
            .unwrap_or_else(|e| panic!("scrubbing a component panicked: {e}"));
        report.components += 1;
        report.bytes += component.bytes;
        // A component replaced (merged, or dropped by retention) since the pass listed it
        // is gone on purpose, not damaged.
        if checked.is_err() && !node.store.holds_component(&hash) {
            continue;
        }
        if let Err(why) = checked {
            let places: Vec<String> = component
                .holders
                .iter()
                .map(|(table, partition)| format!("{table} {partition}"))
                .collect();
            // The error names the component, its file and what is wrong with it.
            report.damaged.push(format!("{}: {why}", places.join(", ")));
            repair(node, &component, &why.to_string(), &mut report).await;
        }
        keep_under(bytes_per_sec, report.bytes, started).await;
    }
    scrub_fragments(node, bytes_per_sec, started, &mut report).await;
    collect_fragments(node, &mut report).await;
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    let metrics = tessera_common::metrics::metrics();
    metrics.scrubbed_bytes.inc_by(report.bytes);
    metrics.scrub_damaged.inc_by(report.damaged.len() as u64);
    *LAST.lock().expect("last scrub lock") = Some(report.clone());
    report
}

/// Keeps a pass's average read rate under `bytes_per_sec` (0: no limit): waits until the
/// `read` bytes so far are due.
async fn keep_under(bytes_per_sec: u64, read: u64, started: Instant) {
    if bytes_per_sec > 0 {
        let due = Duration::from_secs_f64(read as f64 / bytes_per_sec as f64);
        if let Some(ahead) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(ahead).await;
        }
    }
}

/// Hashes again every archive fragment the metadata places on this node; rebuilds one
/// that is missing or damaged from `k` others (checked against its recorded hash).
async fn scrub_fragments(
    node: &Arc<Node>,
    bytes_per_sec: u64,
    started: Instant,
    report: &mut ScrubReport,
) {
    let state = node.meta.view().state.clone();
    for component in state.archived_components() {
        for fragment in component.fragments.iter().filter(|f| f.node == node.id()) {
            let store = node.store.clone();
            let hash = fragment.hash;
            let checked =
                tokio::task::spawn_blocking(move || store.fragments().read_verified(&hash))
                    .await
                    .unwrap_or_else(|e| panic!("scrubbing a fragment panicked: {e}"));
            report.fragments += 1;
            match checked {
                Ok(bytes) => report.bytes += bytes.len() as u64,
                Err(why) => {
                    let what = format!(
                        "archive fragment {} of component {} (partition {})",
                        fragment.index, component.component.hash, component.partition
                    );
                    report.damaged.push(format!("{what}: {why}"));
                    match tessera_replication::archive::rebuild_fragment(
                        &node.replication,
                        component,
                        fragment.index,
                    )
                    .await
                    {
                        Ok(()) => report.repaired.push(format!(
                            "{what} rebuilt from {} others",
                            component.data_fragments
                        )),
                        Err(e) => report.unrepaired.push(format!("{what}: {e}")),
                    }
                }
            }
            keep_under(bytes_per_sec, report.bytes, started).await;
        }
    }
}

/// Deletes the fragments this node holds that no archived epoch places here any more
/// (their tag was dropped, their table dropped, or they moved while this node was away),
/// once `[archive] collect_after_ms` old: younger ones may belong to an archive being made,
/// which is recorded only once all its fragments are placed.
async fn collect_fragments(node: &Arc<Node>, report: &mut ScrubReport) {
    let grace = Duration::from_millis(node.config.archive.collect_after_ms);
    let state = node.meta.view().state.clone();
    let named: std::collections::BTreeSet<_> = state
        .archived_components()
        .iter()
        .flat_map(|c| c.fragments.iter())
        .filter(|f| f.node == node.id())
        .map(|f| f.hash)
        .collect();
    let store = node.store.clone();
    let collected = tokio::task::spawn_blocking(move || {
        let mut collected = 0;
        for (hash, _, age) in store.fragments().held()? {
            if !named.contains(&hash) && age >= grace {
                store.fragments().remove(&hash)?;
                collected += 1;
            }
        }
        Ok::<_, tessera_storage::StorageError>(collected)
    })
    .await
    .unwrap_or_else(|e| panic!("collecting fragments panicked: {e}"));
    match collected {
        Ok(n) => report.collected_fragments = n,
        Err(e) => tracing::warn!(error = %e, "collecting unnamed archive fragments failed"),
    }
}

/// Replaces a damaged component with a replica's copy; failing that, refuses this node's
/// replicas of the partitions holding it, to be copied whole.
async fn repair(
    node: &Arc<Node>,
    component: &tessera_storage::HeldComponent,
    why: &str,
    report: &mut ScrubReport,
) {
    let (_, partition) = &component.holders[0];
    let damaged = vec![Damaged {
        partition: *partition,
        hash: component.hash,
        why: why.to_string(),
    }];
    match tessera_exec::scan::repair_damaged(&node.exec, damaged).await {
        Ok(unrepaired) if unrepaired.is_empty() => {
            report.repaired.push(format!(
                "component {} replaced by another replica's copy",
                component.hash
            ));
            return;
        }
        Ok(_) | Err(_) => {}
    }
    for (table, partition) in &component.holders {
        let command = MetaCommand::MarkCorrupt {
            node: node.id(),
            partition: *partition,
            reason: format!(
                "scrub: component {} of {table} is damaged: {why}",
                component.hash
            ),
        };
        match node.meta.write(command).await {
            Ok(_) => report.repaired.push(format!(
                "node {}'s replica of {table} {partition} refused, to be copied whole (no replica holds component {})",
                node.id(),
                component.hash
            )),
            Err(e) => report.unrepaired.push(format!(
                "component {} of {table} {partition}: no replica holds it, and the replica could not be refused: {e}",
                component.hash
            )),
        }
    }
}

/// Scrubs here now, and on every other live node too if asked.
pub async fn scrub_now(node: &Arc<Node>, request: ScrubRequest) -> Vec<ScrubReport> {
    let mine = scrub(node, 0);
    if !request.everywhere {
        return vec![mine.await];
    }
    let state = node.meta.view().state.clone();
    let others = state
        .nodes
        .values()
        .filter(|n| n.id != node.id() && n.alive && !n.decommissioned)
        .map(|n| async move {
            let addr = node.meta.addr_of(n.id)?;
            let reply: Result<Result<Vec<ScrubReport>, Refusal>, CallError> = node
                .clients
                .action(
                    &addr,
                    ACTION_SCRUB,
                    ScrubRequest { everywhere: false },
                    Duration::from_secs(3600),
                )
                .await;
            match reply {
                Ok(Ok(reports)) => Some(reports),
                Ok(Err(refusal)) => {
                    tracing::warn!(node = n.id.0, ?refusal, "a node refused to scrub");
                    None
                }
                Err(error) => {
                    tracing::warn!(node = n.id.0, %error, "a node did not scrub");
                    None
                }
            }
        });
    let (mine, others) = futures::join!(mine, futures::future::join_all(others));
    let mut reports = vec![mine];
    reports.extend(others.into_iter().flatten().flatten());
    reports.sort_by_key(|r| r.node);
    reports
}
