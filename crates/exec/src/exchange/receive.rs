//! The receiving end of one producer channel's `do_put` exchange stream.

use super::{batch_digest, Inbox, InboxKey, QueryRegistry, StreamEnd, StreamMark};
use crate::wire::ExchangeHeader;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;

/// The receiving end of one `do_put` exchange stream: puts each batch into its bucket's
/// inbox (waiting while the bucket is full, which slows the sender through gRPC flow
/// control) and ends the sender's part of every bucket it named on its end-of-stream mark,
/// once the batches it counts there have all arrived.
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
    // A broken connection under lineage recovery fails nothing (the rebuilt channel sends
    // again); a stream that breaks the protocol fails its buckets in any mode.
    let fail_all = |reason: String| {
        for inbox in inboxes.values() {
            inbox.fail(reason.clone());
        }
        reason
    };
    let broke = |reason: String| {
        if header.lineage {
            reason
        } else {
            fail_all(reason)
        }
    };
    let mut ended: Option<StreamEnd> = None;
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
        if ended.is_some() {
            return Err(fail_all(format!(
                "exchange {} channel {} sent a batch after its end of stream",
                header.exchange, header.sender
            )));
        }
        tessera_common::metrics::metrics()
            .exchange_bytes
            .inc_by((message.inner.data_body.len() + message.inner.data_header.len()) as u64);
        let tag = match serde_json::from_slice::<StreamMark>(&message.inner.app_metadata) {
            Ok(StreamMark::Batch(tag)) => tag,
            Ok(StreamMark::End(end)) => {
                ended = Some(end);
                continue;
            }
            Err(e) => {
                return Err(fail_all(format!(
                    "exchange {} channel {} sent a message without a valid tag: {e}",
                    header.exchange, header.sender
                )))
            }
        };
        if !header.buckets.contains(&tag.bucket) {
            return Err(fail_all(format!(
                "exchange {} channel {} sent bucket {} outside its header",
                header.exchange, header.sender, tag.bucket
            )));
        }
        // No inbox: the query ended here, the batch is not needed.
        if let Some(inbox) = inboxes.get(&tag.bucket) {
            let digest = header.lineage.then(|| batch_digest(&message.inner));
            inbox
                .push(header.sender.0, tag.seq, batch, digest)
                .await
                .map_err(fail_all)?;
        }
    }
    let Some(end) = ended else {
        return Err(broke(format!(
            "exchange {} stream from channel {} stopped before its end of stream (its sender failed or was stopped)",
            header.exchange, header.sender
        )));
    };
    for (bucket, inbox) in &inboxes {
        let Some(sent) = end.sent_to(*bucket) else {
            return Err(fail_all(format!(
                "exchange {} channel {}'s end of stream does not count bucket {bucket}",
                header.exchange, header.sender
            )));
        };
        inbox.finish(header.sender.0, sent).map_err(fail_all)?;
    }
    Ok(())
}
