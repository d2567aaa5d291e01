//! Unit tests of inboxes, flow control and end of stream, on one node.

use super::*;
use crate::{QueryId, StageId};
use tessera_common::config::ExecSettings;

/// The default inbox budget, which `Inbox::new` takes.
fn budget() -> usize {
    ExecSettings::default().inbox_budget_bytes
}
use arrow::array::Int64Array;
use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema};
use std::sync::Arc;
use std::time::Duration;

fn batch(rows: i64) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
    RecordBatch::try_new(
        schema,
        vec![Arc::new(Int64Array::from_iter_values(0..rows))],
    )
    .unwrap()
}

fn key(bucket: usize) -> InboxKey {
    InboxKey {
        query: QueryId(7),
        exchange: StageId(1),
        bucket,
    }
}

#[tokio::test]
async fn an_inbox_ends_only_when_every_sender_has_ended() {
    let inbox = Inbox::new(key(0), 2);
    inbox.push(0, 0, batch(3), None).await.unwrap();
    inbox.finish(0, 1).unwrap();
    assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 3);
    // Sender 1 has not ended: the reader waits.
    let waiting = tokio::time::timeout(Duration::from_millis(100), inbox.next()).await;
    assert!(waiting.is_err(), "the inbox ended before sender 1 did");
    inbox.push(1, 0, batch(2), None).await.unwrap();
    inbox.finish(1, 1).unwrap();
    assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 2);
    assert!(inbox.next().await.is_none());
    assert_eq!(
        inbox.consumed(),
        vec![(0, 0), (1, 0)],
        "the reading order is recorded"
    );
}

#[tokio::test]
async fn batches_out_of_sequence_or_after_the_end_are_refused() {
    let inbox = Inbox::new(key(0), 1);
    inbox.push(0, 0, batch(1), None).await.unwrap();
    let gap = inbox.push(0, 2, batch(1), None).await.unwrap_err();
    assert!(
        gap.contains("batch 2 from channel 0 arrived where batch 1 was due"),
        "{gap}"
    );
    inbox.finish(0, 1).unwrap();
    let late = inbox.push(0, 1, batch(1), None).await.unwrap_err();
    assert!(late.contains("after its end of stream"), "{late}");
}

#[tokio::test]
async fn re_sent_batches_are_dropped_if_identical_and_refused_if_not() {
    let inbox = Inbox::new(key(0), 2);
    inbox.expect_resends();
    inbox.push(0, 0, batch(3), Some([1; 16])).await.unwrap();
    inbox.push(0, 1, batch(4), Some([2; 16])).await.unwrap();
    inbox.finish(0, 2).unwrap();
    // Sender 0's rebuilt channel sends again from its first batch, after its end.
    inbox.push(0, 0, batch(3), Some([1; 16])).await.unwrap();
    let differs = inbox.push(0, 1, batch(4), Some([9; 16])).await.unwrap_err();
    assert!(differs.contains("re-sent batch 1 different"), "{differs}");
    inbox.push(1, 0, batch(5), Some([3; 16])).await.unwrap();
    inbox.finish(1, 1).unwrap();
    let mut rows = Vec::new();
    while let Some(batch) = inbox.next().await {
        rows.push(batch.unwrap().num_rows());
    }
    assert_eq!(rows, vec![3, 4, 5], "each batch is read once");
}

#[tokio::test]
async fn a_full_inbox_holds_its_sender_until_the_reader_takes_a_batch() {
    let inbox = Arc::new(Inbox::new(key(0), 1));
    // Each batch is a little over a quarter of the budget: three fit, a fourth does not.
    let rows = (budget() / 8 / 4 + 1024) as i64;
    for seq in 0..3 {
        inbox.push(0, seq, batch(rows), None).await.unwrap();
    }
    let sender = {
        let inbox = inbox.clone();
        tokio::spawn(async move { inbox.push(0, 3, batch(rows), None).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !sender.is_finished(),
        "a sender went past the inbox's budget"
    );
    inbox.next().await.unwrap().unwrap();
    tokio::time::timeout(Duration::from_secs(5), sender)
        .await
        .expect("reading made room")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn closing_an_inbox_releases_a_waiting_sender_and_drops_what_arrives() {
    let inbox = Arc::new(Inbox::new(key(0), 1));
    let rows = (budget() / 8) as i64;
    inbox.push(0, 0, batch(rows), None).await.unwrap();
    let sender = {
        let inbox = inbox.clone();
        tokio::spawn(async move { inbox.push(0, 1, batch(rows), None).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!sender.is_finished());
    inbox.close();
    tokio::time::timeout(Duration::from_secs(5), sender)
        .await
        .expect("closing released the sender")
        .unwrap()
        .unwrap();
    assert!(
        inbox.next().await.is_none(),
        "a closed inbox yields nothing"
    );
}

#[tokio::test]
async fn a_failed_exchange_reaches_the_reader() {
    let inbox = Inbox::new(key(0), 1);
    inbox.fail("node 3 went away".into());
    let error = inbox.next().await.unwrap().unwrap_err();
    assert_eq!(error, "node 3 went away");
}

#[test]
fn an_ended_query_takes_no_more_batches() {
    let registry = QueryRegistry::default();
    let inbox = registry.inbox(key(0), 1).unwrap();
    registry.end_query(QueryId(7));
    assert!(registry.inbox(key(0), 1).is_none());
    assert_eq!(registry.open_inboxes(), 0);
    drop(inbox);
    // Another query is unaffected.
    let other = InboxKey {
        query: QueryId(8),
        ..key(0)
    };
    assert!(registry.inbox(other, 1).is_some());
}

#[tokio::test]
async fn a_sender_ending_with_fewer_batches_than_it_counts_fails_the_bucket() {
    let inbox = Inbox::new(key(0), 1);
    inbox.push(0, 0, batch(3), None).await.unwrap();
    let short = inbox.finish(0, 2).unwrap_err();
    assert!(
        short.contains("after sending 2 batches, but 1 arrived"),
        "{short}"
    );
    assert_eq!(inbox.next().await.unwrap().unwrap_err(), short);
}

/// A `do_put` exchange stream as a sender writes it: the schema, then each batch tagged
/// with its bucket and sequence number, then (if `end` is given) the end-of-stream mark.
fn exchange_stream(
    batches: &[(usize, u64, RecordBatch)],
    end: Option<StreamEnd>,
) -> arrow_flight::decode::FlightDataDecoder {
    use arrow_flight::{FlightData, SchemaAsIpc};
    use arrow_ipc::writer::{
        DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions,
    };
    let options = IpcWriteOptions::default();
    let schema = batch(0).schema();
    let encode = |batch: &RecordBatch, mark: &StreamMark| {
        let (_, encoded) = IpcDataGenerator::default()
            .encode(
                batch,
                &mut DictionaryTracker::new(false),
                &options,
                &mut IpcWriteContext::default(),
            )
            .unwrap();
        FlightData::from(encoded).with_app_metadata(serde_json::to_vec(mark).unwrap())
    };
    let mut messages = vec![FlightData::from(SchemaAsIpc::new(&schema, &options))];
    for (bucket, seq, rows) in batches {
        let tag = BatchTag {
            bucket: *bucket,
            seq: *seq,
        };
        messages.push(encode(rows, &StreamMark::Batch(tag)));
    }
    if let Some(end) = end {
        messages.push(encode(&batch(0), &StreamMark::End(end)));
    }
    arrow_flight::decode::FlightDataDecoder::new(futures::stream::iter(
        messages.into_iter().map(Ok),
    ))
}

fn header(lineage: bool) -> crate::wire::ExchangeHeader {
    crate::wire::ExchangeHeader {
        query: QueryId(7),
        exchange: StageId(1),
        sender: crate::ChannelId(0),
        senders_per_bucket: 1,
        buckets: vec![0, 1],
        lineage,
    }
}

fn end_mark(sent: &[(usize, u64)]) -> StreamEnd {
    StreamEnd {
        sent: sent.iter().copied().collect(),
    }
}

/// Every row read from bucket `bucket`, or the error that ended it.
async fn rows_of(registry: &QueryRegistry, bucket: usize) -> Result<usize, String> {
    let inbox = registry.inbox(key(bucket), 1).unwrap();
    let mut rows = 0;
    while let Some(batch) = tokio::time::timeout(Duration::from_secs(5), inbox.next())
        .await
        .expect("the bucket neither ended nor failed")
    {
        rows += batch?.num_rows();
    }
    Ok(rows)
}

#[tokio::test]
async fn a_stream_with_its_end_mark_ends_its_buckets() {
    let registry = QueryRegistry::default();
    let stream = exchange_stream(
        &[(0, 0, batch(3)), (1, 0, batch(4)), (0, 1, batch(5))],
        Some(end_mark(&[(0, 2), (1, 1)])),
    );
    receive(&registry, &header(false), stream).await.unwrap();
    assert_eq!(rows_of(&registry, 0).await, Ok(8));
    assert_eq!(rows_of(&registry, 1).await, Ok(4));
}

#[tokio::test]
async fn a_stream_that_stops_before_its_end_mark_fails_its_buckets_instead_of_ending_them() {
    // A sender whose channel fails drops its side of the stream, which ends the request
    // cleanly: without the mark the receiver would take it for the end and a reader would
    // answer without the rows that never came.
    let registry = QueryRegistry::default();
    let stream = exchange_stream(&[(0, 0, batch(3)), (1, 0, batch(4))], None);
    let error = receive(&registry, &header(false), stream)
        .await
        .unwrap_err();
    assert!(
        error.contains("stopped before its end of stream"),
        "{error}"
    );
    for bucket in [0, 1] {
        let read = rows_of(&registry, bucket).await;
        assert_eq!(read, Err(error.clone()), "bucket {bucket} ended short");
    }
}

#[tokio::test]
async fn an_end_mark_counting_batches_that_never_arrived_fails_the_bucket() {
    let registry = QueryRegistry::default();
    let stream = exchange_stream(&[(0, 0, batch(3))], Some(end_mark(&[(0, 2), (1, 0)])));
    let error = receive(&registry, &header(false), stream)
        .await
        .unwrap_err();
    assert!(
        error.contains("after sending 2 batches, but 1 arrived"),
        "{error}"
    );
    assert!(rows_of(&registry, 0).await.is_err(), "bucket 0 ended short");
    // Bucket 1 got all it was sent (none), but the stream broke its protocol.
    assert!(rows_of(&registry, 1).await.is_err());
}

#[tokio::test]
async fn under_lineage_a_stopped_stream_leaves_its_buckets_open_for_the_resend() {
    let registry = QueryRegistry::default();
    let stream = exchange_stream(&[(0, 0, batch(3))], None);
    receive(&registry, &header(true), stream).await.unwrap_err();
    let inbox = registry.inbox(key(0), 1).unwrap();
    assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 3);
    let waiting = tokio::time::timeout(Duration::from_millis(100), inbox.next()).await;
    assert!(
        waiting.is_err(),
        "the bucket ended without its sender's end mark"
    );
    // The rebuilt channel sends everything again, then its end mark.
    let again = exchange_stream(
        &[(0, 0, batch(3)), (0, 1, batch(2))],
        Some(end_mark(&[(0, 2), (1, 0)])),
    );
    receive(&registry, &header(true), again).await.unwrap();
    assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 2);
    assert!(inbox.next().await.is_none());
}

/// A bucket's rows taken from a batch with long strings travel with their own strings
/// only: the taken batch shares all of the input's string buffers, which IPC sent whole
/// with every bucket.
#[test]
fn a_bucket_taken_from_a_larger_batch_is_sent_with_its_own_strings_only() {
    use arrow::array::{StringViewArray, UInt32Array};
    let rows = 10_000;
    let names: StringViewArray = (0..rows)
        .map(|i| Some(format!("Customer#{i:020}")))
        .collect::<Vec<_>>()
        .into_iter()
        .collect();
    let input = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new(
            "c_name",
            DataType::Utf8View,
            false,
        )])),
        vec![Arc::new(names)],
    )
    .unwrap();
    // One bucket of eight: every eighth row.
    let bucket = arrow::compute::take_record_batch(
        &input,
        &UInt32Array::from_iter_values((0..rows as u32).step_by(8)),
    )
    .unwrap();
    let mark = StreamMark::Batch(BatchTag { bucket: 0, seq: 0 });
    let messages = writer::encode_marked(
        &bucket,
        &mark,
        &arrow_ipc::writer::IpcWriteOptions::default(),
    )
    .unwrap();
    let sent: usize = messages.iter().map(|m| m.data_body.len()).sum();
    // 1250 rows: 16 bytes of view and 29 of name each, and a little padding.
    assert!(
        sent < 1250 * 48,
        "{sent} bytes sent for a bucket of 1250 rows"
    );
}

#[test]
fn a_session_batch_size_sets_the_rows_of_each_batch_sent() {
    let default_batch_size = datafusion::prelude::SessionConfig::new().batch_size();
    // The session left DataFusion's default: the node's setting holds.
    assert_eq!(writer::send_batch_rows(4096, default_batch_size), 4096);
    // The session set its own, smaller or larger: the exchanges follow it.
    assert_eq!(writer::send_batch_rows(8192, 1000), 1000);
    assert_eq!(writer::send_batch_rows(8192, 32768), 32768);
}
