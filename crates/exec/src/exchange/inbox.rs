//! One bucket of an exchange on its consumer's node: the batches that arrived and are not
//! yet read, under a byte budget (a full inbox makes its producers wait), in sequence per
//! producer channel, until every producer has ended its stream.

use super::{Digest, InboxKey};
use crate::now_us;
use arrow::array::RecordBatch;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Mutex;
use tessera_common::config::ExecSettings;
use tokio::sync::{Notify, Semaphore};

/// The batches of one bucket that arrived and are not yet read.
pub struct Inbox {
    key: InboxKey,
    state: Mutex<InboxState>,
    /// The whole budget, in KiB: a batch larger than that takes all of it.
    budget_kib: u32,
    /// Free budget in KiB; a producer takes some per batch, the reader gives it back.
    space: Semaphore,
    arrived: Notify,
}

struct InboxState {
    expected_senders: usize,
    /// Each batch with its sender, sequence number and the budget (KiB) it holds.
    queue: VecDeque<(RecordBatch, usize, u64, u32)>,
    /// (sender, sequence) of every batch read, in the order read: with the producers'
    /// numbered outputs, the lineage that lets this input be replayed in the same order.
    consumed: Vec<(usize, u64)>,
    finished: BTreeSet<usize>,
    next_seq: HashMap<usize, u64>,
    /// Under lineage recovery: re-sent batches (a rebuilt producer starts again from
    /// sequence 0) are checked against these digests and dropped.
    resends_expected: bool,
    digests: HashMap<usize, Vec<Option<Digest>>>,
    /// The consumer needs no more: batches are dropped on arrival.
    closed: bool,
    failed: Option<String>,
    reader_taken: bool,
    first_batch_us: Option<u64>,
}

impl Inbox {
    /// An inbox with the default budget.
    pub fn new(key: InboxKey, expected_senders: usize) -> Inbox {
        Inbox::with_budget(
            key,
            expected_senders,
            ExecSettings::default().inbox_budget_bytes,
        )
    }

    /// An inbox that holds up to `budget_bytes` unread before its producers wait.
    pub fn with_budget(key: InboxKey, expected_senders: usize, budget_bytes: usize) -> Inbox {
        let budget_kib = (budget_bytes >> 10).max(1);
        Inbox {
            budget_kib: budget_kib as u32,
            key,
            state: Mutex::new(InboxState {
                expected_senders,
                queue: VecDeque::new(),
                consumed: Vec::new(),
                finished: BTreeSet::new(),
                next_seq: HashMap::new(),
                resends_expected: false,
                digests: HashMap::new(),
                closed: false,
                failed: None,
                reader_taken: false,
                first_batch_us: None,
            }),
            space: Semaphore::new(budget_kib),
            arrived: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        self.state.lock().expect("inbox lock")
    }

    pub fn key(&self) -> InboxKey {
        self.key
    }

    /// Producers may re-send batches (lineage recovery): keep digests to check them.
    pub fn expect_resends(&self) {
        self.lock().resends_expected = true;
    }

    /// Adds a batch from producer channel `sender`, waiting while the bucket is over its
    /// budget. Batches must come in sequence from each sender; under lineage recovery a
    /// batch already received is dropped if its digest matches the first copy's.
    pub async fn push(
        &self,
        sender: usize,
        seq: u64,
        batch: RecordBatch,
        digest: Option<Digest>,
    ) -> Result<(), String> {
        if self.is_resent(sender, seq, digest)? {
            return Ok(());
        }
        // A batch decoded from a Flight message points into its body: count that once.
        let held = tessera_common::memory::held_bytes(&batch);
        let kib = ((held >> 10) as u32).clamp(1, self.budget_kib);
        match self.space.acquire_many(kib).await {
            Ok(permit) => permit.forget(),
            // Closed: the consumer is done with this bucket.
            Err(_) => return Ok(()),
        }
        let mut state = self.lock();
        if state.closed {
            return Ok(());
        }
        if state.finished.contains(&sender) {
            return Err(format!(
                "exchange {} bucket {}: channel {sender} sent a batch after its end of stream",
                self.key.exchange, self.key.bucket
            ));
        }
        let expected = state.next_seq.entry(sender).or_insert(0);
        if seq != *expected {
            return Err(format!(
                "exchange {} bucket {} of query {:x}: batch {seq} from channel {sender} arrived where batch {} was due",
                self.key.exchange, self.key.bucket, self.key.query, *expected
            ));
        }
        *expected += 1;
        if state.resends_expected {
            state.digests.entry(sender).or_default().push(digest);
        }
        state.first_batch_us.get_or_insert_with(now_us);
        state.queue.push_back((batch, sender, seq, kib));
        drop(state);
        self.arrived.notify_one();
        Ok(())
    }

    /// True if batch `seq` of `sender` arrived before (a rebuilt producer re-sending it);
    /// an error if it differs from the first copy.
    fn is_resent(&self, sender: usize, seq: u64, digest: Option<Digest>) -> Result<bool, String> {
        let state = self.lock();
        let received = state.next_seq.get(&sender).copied().unwrap_or(0);
        if seq >= received || !state.resends_expected {
            return Ok(false);
        }
        let first = state
            .digests
            .get(&sender)
            .and_then(|d| d.get(seq as usize))
            .copied()
            .flatten();
        match (first, digest) {
            (Some(first), Some(again)) if first == again => Ok(true),
            _ => Err(format!(
                "exchange {} bucket {} of query {:x}: channel {sender} re-sent batch {seq} different from the first time (its rebuilt producer is not deterministic)",
                self.key.exchange, self.key.bucket, self.key.query
            )),
        }
    }

    /// Producer channel `sender` has sent everything it will send to this bucket: `sent`
    /// batches, by its own count. Fewer arrived means batches were lost on the way: the
    /// bucket fails rather than end short (a reader would answer without those rows).
    pub fn finish(&self, sender: usize, sent: u64) -> Result<(), String> {
        let mut state = self.lock();
        let arrived = state.next_seq.get(&sender).copied().unwrap_or(0);
        if arrived != sent && !state.closed {
            let reason = format!(
                "exchange {} bucket {} of query {:x}: channel {sender} ended its stream after sending {sent} batches, but {arrived} arrived",
                self.key.exchange, self.key.bucket, self.key.query
            );
            state.failed.get_or_insert(reason.clone());
            drop(state);
            self.arrived.notify_one();
            return Err(reason);
        }
        state.finished.insert(sender);
        drop(state);
        self.arrived.notify_one();
        Ok(())
    }

    /// The exchange broke (a producer or its node failed): the reader gets `reason`.
    pub fn fail(&self, reason: String) {
        let mut state = self.lock();
        if !state.closed {
            state.failed.get_or_insert(reason);
        }
        drop(state);
        self.arrived.notify_one();
    }

    /// The consumer needs nothing more: drop what is queued and whatever still arrives, so
    /// no producer waits on a bucket nobody reads.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.queue.clear();
        drop(state);
        // What was read stays to be logged: output computed from it may still wait.
        self.space.close();
    }

    /// The (sender, sequence number) of every batch read so far, in reading order.
    pub fn consumed(&self) -> Vec<(usize, u64)> {
        self.lock().consumed.clone()
    }

    pub fn first_batch_us(&self) -> Option<u64> {
        self.lock().first_batch_us
    }

    /// The senders of the batches read from position `from` on, in reading order: the
    /// part of the reading order that lineage has not logged yet.
    pub fn read_since(&self, from: usize) -> Vec<usize> {
        let state = self.lock();
        state
            .consumed
            .get(from..)
            .unwrap_or_default()
            .iter()
            .map(|&(sender, _)| sender)
            .collect()
    }

    /// Claims the one reader of this bucket; an error if it already has one. One plan
    /// instance per node and stage reads each bucket at most once (shared build sides are
    /// collected once per instance); a second reader would split the bucket's rows.
    pub fn claim_reader(&self) -> Result<(), String> {
        let mut state = self.lock();
        if state.reader_taken {
            return Err(format!(
                "exchange {} bucket {} read twice on one node",
                self.key.exchange, self.key.bucket
            ));
        }
        state.reader_taken = true;
        Ok(())
    }

    /// How many batches have been read so far (a position in the reading order).
    pub fn read_so_far(&self) -> usize {
        self.lock().consumed.len()
    }

    /// The next batch; `None` once every sender has ended its stream and all was read.
    pub async fn next(&self) -> Option<Result<RecordBatch, String>> {
        loop {
            {
                let mut state = self.lock();
                if let Some(reason) = &state.failed {
                    return Some(Err(reason.clone()));
                }
                if let Some((batch, sender, seq, kib)) = state.queue.pop_front() {
                    state.consumed.push((sender, seq));
                    drop(state);
                    self.space.add_permits(kib as usize);
                    return Some(Ok(batch));
                }
                if state.closed || state.finished.len() >= state.expected_senders {
                    return None;
                }
            }
            // notify_one keeps a permit when nobody waits, so a push between the check
            // above and this wait is not missed.
            self.arrived.notified().await;
        }
    }
}
