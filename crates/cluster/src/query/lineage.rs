//! Write-ahead lineage (seed 003 §III): under `tessera.recovery = lineage` every consumer
//! bucket fed by several producer channels logs the order it read their batches in, as
//! runs of (sender, batches). A channel's output waits until the reading order it was
//! computed from is committed to the metadata store
//! ([`super::exchange::Inbox::wait_committed`]), so whatever a consumer elsewhere has used
//! can be recomputed exactly, by [`replay_bucket`], from the producers' spools in the
//! logged order.
//!
//! A node's [`commit_lineage`] task writes on demand: when output waits, one Raft entry
//! carries everything every logged inbox on the node has read so far, however many
//! inboxes and queries. Logging as batches are read instead (not only when output needs
//! it) cost four times the Raft writes and about a quarter of the query time.

use super::exchange::{tokio_stream_from, ExchangeMode, ReadSpec, Replay};
use super::Exec;
use crate::meta::{LineageEntry, MetaCommand};
use crate::rpc::SpoolRequest;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Writes the reading order of this node's logged inboxes to the metadata store, in
/// rounds: one Raft entry carries everything read since the previous round began.
pub async fn commit_lineage(node: Arc<Exec>) {
    let wake = node.queries.lineage_committer.clone();
    loop {
        // A writer waits on this node's lineage; demands made during a round wake the
        // next one, which covers them all.
        wake.notified().await;
        let mut entries = Vec::new();
        let mut marks = Vec::new();
        for inbox in node.queries.lineage_inboxes() {
            let Some((from, runs, initiator)) = inbox.take_unlogged() else {
                continue;
            };
            let key = inbox.key();
            let upto = from + runs.iter().map(|&(_, n)| n as usize).sum::<usize>();
            entries.push(LineageEntry {
                query: key.query,
                initiator,
                exchange: key.exchange,
                bucket: key.bucket,
                from: from as u64,
                runs,
            });
            marks.push((inbox, upto));
        }
        if entries.is_empty() {
            continue;
        }
        let command = MetaCommand::Lineage {
            node: node.id(),
            entries,
        };
        let started = std::time::Instant::now();
        let written = node.meta.write(command).await;
        tracing::debug!(
            took_us = started.elapsed().as_micros() as u64,
            "lineage round committed"
        );
        match written {
            Ok(_) => {
                for (inbox, upto) in marks {
                    inbox.committed_up_to(upto);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "could not log query lineage");
                for (inbox, _) in marks {
                    inbox.commit_failed(error.to_string());
                }
            }
        }
    }
}

/// Bucket `bucket` of a rebuilt consumer: every producer channel's batches for it, pulled
/// from its spool (on the node that holds the channel now), delivered first in the logged
/// order, then as they arrive.
pub fn replay_bucket(
    node: &Arc<Exec>,
    spec: &ReadSpec,
    replay: &Replay,
    bucket: usize,
    schema: SchemaRef,
) -> SendableRecordBatchStream {
    let senders: Vec<usize> = match spec.mode {
        ExchangeMode::Gather => vec![bucket],
        ExchangeMode::Hash | ExchangeMode::RoundRobin | ExchangeMode::Collect => {
            (0..spec.producer_channels).collect()
        }
    };
    let mut feeds: BTreeMap<usize, mpsc::Receiver<DfResult<RecordBatch>>> = BTreeMap::new();
    for sender in senders {
        let (tx, rx) = mpsc::channel(4);
        feeds.insert(sender, rx);
        let holder = replay.producers.get(sender).copied();
        let addr = holder.and_then(|at| replay.addrs.get(&at).cloned());
        let request = SpoolRequest {
            query: spec.query,
            exchange: spec.exchange,
            channel: sender,
            bucket,
        };
        let clients = node.clients.clone();
        let follow = tokio::spawn(async move {
            let Some(addr) = addr else {
                let _ = tx
                    .send(Err(replay_error(format!(
                        "no node holds channel {sender}'s spool"
                    ))))
                    .await;
                return;
            };
            let mut batches = match clients.get(&addr, &request).await {
                Ok(batches) => batches,
                Err(error) => {
                    let _ = tx
                        .send(Err(replay_error(format!(
                            "channel {sender}'s spool on node {holder:?}: {error}"
                        ))))
                        .await;
                    return;
                }
            };
            while let Some(batch) = batches.next().await {
                let batch = batch.map_err(|error| {
                    replay_error(format!(
                        "channel {sender}'s spool on node {holder:?}: {error}"
                    ))
                });
                let failed = batch.is_err();
                if tx.send(batch).await.is_err() || failed {
                    return;
                }
            }
        });
        node.queries.track(spec.query, follow.abort_handle());
    }
    let script = replay.scripts.get(&bucket).cloned().unwrap_or_default();
    let (out, rx) = mpsc::channel::<DfResult<RecordBatch>>(2);
    let exchange = spec.exchange;
    let deliver = tokio::spawn(async move {
        for (sender, count) in script {
            let Some(feed) = feeds.get_mut(&(sender as usize)) else {
                let _ = out
                    .send(Err(replay_error(format!(
                        "the logged order of exchange {exchange} bucket {bucket} names channel {sender}, which does not feed it"
                    ))))
                    .await;
                return;
            };
            for _ in 0..count {
                let next = feed.recv().await.unwrap_or_else(|| {
                    Err(replay_error(format!(
                        "channel {sender}'s spool ended before the batches exchange {exchange} bucket {bucket} logged from it"
                    )))
                });
                let failed = next.is_err();
                if out.send(next).await.is_err() || failed {
                    return;
                }
            }
        }
        // Past the logged order: whatever arrives, as it arrives.
        let mut rest = futures::stream::select_all(
            feeds
                .into_values()
                .map(|feed| Box::pin(tokio_stream_from(feed))),
        );
        while let Some(next) = rest.next().await {
            let failed = next.is_err();
            if out.send(next).await.is_err() || failed {
                return;
            }
        }
    });
    node.queries.track(spec.query, deliver.abort_handle());
    Box::pin(RecordBatchStreamAdapter::new(schema, tokio_stream_from(rx)))
}

fn replay_error(message: String) -> DataFusionError {
    DataFusionError::Execution(format!("lineage replay: {message}"))
}
