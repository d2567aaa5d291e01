//! The receiving end of one producer channel's `do_put` exchange stream.

use super::{batch_digest, BatchTag, Inbox, InboxKey, QueryRegistry};
use crate::wire::ExchangeHeader;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;

/// The receiving end of one `do_put` exchange stream: puts each batch into its bucket's
/// inbox (waiting while the bucket is full, which slows the sender through gRPC flow
/// control) and ends the sender's stream in every bucket it named once the stream ends.
///
/// Under lineage recovery a broken stream fails nothing: the sender's node died, and its
/// rebuilt channel sends again from the first batch (whose copies are checked and dropped).
pub async fn receive(
    registry: &QueryRegistry,
    header: &ExchangeHeader,
    mut messages: impl futures::Stream<
            Item = Result<
                arrow_flight::decode::DecodedFlightData,
                arrow_flight::error::FlightError,
            >,
        > + Unpin,
) -> Result<(), String> {
    let mut inboxes: HashMap<usize, Arc<Inbox>> = HashMap::new();
    for &bucket in &header.buckets {
        let key = InboxKey {
            query: header.query,
            exchange: header.exchange,
            bucket,
        };
        if let Some(inbox) = registry.inbox(key, header.senders_per_bucket) {
            if header.lineage {
                inbox.expect_resends();
            }
            inboxes.insert(bucket, inbox);
        }
    }
    let broke = |reason: String| {
        if !header.lineage {
            for inbox in inboxes.values() {
                inbox.fail(reason.clone());
            }
        }
        reason
    };
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| {
            broke(format!(
                "exchange {} stream from channel {} broke: {e}",
                header.exchange, header.sender
            ))
        })?;
        let arrow_flight::decode::DecodedPayload::RecordBatch(batch) = message.payload else {
            continue;
        };
        tessera_common::metrics::metrics()
            .exchange_bytes
            .inc_by((message.inner.data_body.len() + message.inner.data_header.len()) as u64);
        let tag: BatchTag = serde_json::from_slice(&message.inner.app_metadata)
            .map_err(|e| format!("an exchange batch without a valid tag: {e}"))?;
        if !header.buckets.contains(&tag.bucket) {
            return Err(format!(
                "exchange {} channel {} sent bucket {} outside its header",
                header.exchange, header.sender, tag.bucket
            ));
        }
        // No inbox: the query ended here, the batch is not needed.
        if let Some(inbox) = inboxes.get(&tag.bucket) {
            let digest = header.lineage.then(|| batch_digest(&message.inner));
            inbox.push(header.sender.0, tag.seq, batch, digest).await?;
        }
    }
    for inbox in inboxes.values() {
        inbox.finish(header.sender.0);
    }
    Ok(())
}
