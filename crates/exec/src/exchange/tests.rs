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
    inbox.finish(0);
    assert_eq!(inbox.next().await.unwrap().unwrap().num_rows(), 3);
    // Sender 1 has not ended: the reader waits.
    let waiting = tokio::time::timeout(Duration::from_millis(100), inbox.next()).await;
    assert!(waiting.is_err(), "the inbox ended before sender 1 did");
    inbox.push(1, 0, batch(2), None).await.unwrap();
    inbox.finish(1);
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
    inbox.finish(0);
    let late = inbox.push(0, 1, batch(1), None).await.unwrap_err();
    assert!(late.contains("after its end of stream"), "{late}");
}

#[tokio::test]
async fn re_sent_batches_are_dropped_if_identical_and_refused_if_not() {
    let inbox = Inbox::new(key(0), 2);
    inbox.expect_resends();
    inbox.push(0, 0, batch(3), Some([1; 16])).await.unwrap();
    inbox.push(0, 1, batch(4), Some([2; 16])).await.unwrap();
    inbox.finish(0);
    // Sender 0's rebuilt channel sends again from its first batch, after its end.
    inbox.push(0, 0, batch(3), Some([1; 16])).await.unwrap();
    let differs = inbox.push(0, 1, batch(4), Some([9; 16])).await.unwrap_err();
    assert!(differs.contains("re-sent batch 1 different"), "{differs}");
    inbox.push(1, 0, batch(5), Some([3; 16])).await.unwrap();
    inbox.finish(1);
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
