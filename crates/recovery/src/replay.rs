//! Replaying a rebuilt consumer's input (seed 003 §IV): every producer channel's batches
//! for one bucket, pulled from its spool on the node that holds the channel now, delivered
//! first in the reading order the dead consumer logged, then as they arrive.

use crate::SpoolRequest;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::sync::Arc;
use tessera_exec::exchange::{tokio_stream_from, ExchangeMode, QueryRegistry, ReadSpec, Replay};
use tessera_net::Clients;
use tokio::sync::mpsc;

/// Bucket `bucket` of a rebuilt consumer: every producer channel's batches for it, pulled
/// from its spool (on the node that holds the channel now), delivered first in the logged
/// order, then as they arrive.
pub fn replay_bucket(
    clients: &Arc<Clients>,
    registry: &QueryRegistry,
    spec: &ReadSpec,
    replay: &Replay,
    bucket: usize,
    schema: SchemaRef,
) -> SendableRecordBatchStream {
    let senders: Vec<usize> = match spec.mode {
        ExchangeMode::Gather => vec![bucket],
        ExchangeMode::Hash
        | ExchangeMode::Storage { .. }
        | ExchangeMode::RoundRobin
        | ExchangeMode::Collect => (0..spec.producer_channels).collect(),
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
            channel: tessera_exec::ChannelId(sender),
            bucket,
        };
        let clients = clients.clone();
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
        registry.track(spec.query, follow.abort_handle());
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
    registry.track(spec.query, deliver.abort_handle());
    Box::pin(RecordBatchStreamAdapter::new(schema, tokio_stream_from(rx)))
}

fn replay_error(message: String) -> DataFusionError {
    DataFusionError::Execution(format!("lineage replay: {message}"))
}
