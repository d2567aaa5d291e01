//! Exchanges between stages: the receiving end ([`Inbox`], [`ExchangeReadExec`]), the
//! sending end ([`ExchangeWriteExec`]) and the node's registry of both.
//!
//! An exchange has `buckets` input partitions on the consumer side. In a hash or
//! round-robin exchange every producer channel feeds every bucket; in a gather exchange
//! bucket `k` is exactly producer channel `k`'s output, in order (so a sort-preserving
//! merge above it still sees sorted inputs). A bucket goes to every node that hosts a
//! consumer channel reading it: normally one, several for a broadcast (the build side of
//! a join collected on each node).
//!
//! - [`inbox`]: one bucket's batches on its consumer's node: flow control, sequencing, end
//!   of stream, and the re-sent batches a rebuilt producer repeats.
//! - [`registry`]: a node's inboxes and running channels, by query.
//! - [`reader`]: [`ExchangeReadExec`], the consumer end in a plan.
//! - [`writer`]: [`ExchangeWriteExec`], the root of every stage, and its channel writer.
//! - [`receive`]: the receiving end of one producer's `do_put` stream.
//!
//! Lineage recovery is not woven in here: the exchange calls the [`crate::hooks::Lineage`]
//! hooks (log a reading order, wait for it, back up what is sent, replay a bucket), which
//! the `tessera-recovery` crate implements.

mod inbox;
mod reader;
mod receive;
mod registry;
mod writer;

pub use inbox::Inbox;
pub use reader::{ExchangeReadExec, ReadSpec, Replay};
pub use receive::receive;
pub use registry::QueryRegistry;
pub use writer::{ExchangeWriteExec, WriteSpec};

use crate::{QueryId, StageId};
use arrow_flight::FlightData;
use serde::{Deserialize, Serialize};

/// How an exchange routes a producer's rows to buckets.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ExchangeMode {
    /// By DataFusion's repartition hash of the expressions (the same on every node).
    Hash,
    /// By the storage's partition hash of the expressions (`tessera_common::partitioning`):
    /// bucket `bucket_of_partition[p]` takes the rows of ring partition `p`, so bucket `k`
    /// meets exactly the rows of scan channel `k` (see `crate::colocate`).
    Storage { bucket_of_partition: Vec<u32> },
    /// Whole batches in turn, starting at a bucket that depends on the channel.
    RoundRobin,
    /// Bucket `k` is producer channel `k`'s whole output.
    Gather,
    /// Every producer channel's whole output goes to bucket 0, the only one: a
    /// coalesce's input, read in arrival order (which lineage records, so a rebuilt
    /// consumer replays it; a coalesce over one bucket per producer would interleave
    /// them nondeterministically).
    Collect,
}

impl ExchangeMode {
    /// How many producer channels feed one bucket.
    pub fn senders_per_bucket(&self, producer_channels: usize) -> usize {
        match self {
            ExchangeMode::Gather => 1,
            ExchangeMode::Hash
            | ExchangeMode::Storage { .. }
            | ExchangeMode::RoundRobin
            | ExchangeMode::Collect => producer_channels,
        }
    }
}

impl std::fmt::Display for ExchangeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExchangeMode::Hash => "Hash",
            ExchangeMode::Storage { .. } => "Storage-hash",
            ExchangeMode::RoundRobin => "RoundRobin",
            ExchangeMode::Gather => "Gather",
            ExchangeMode::Collect => "Collect",
        })
    }
}

/// One bucket of one exchange of one query, on the node that consumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InboxKey {
    pub query: QueryId,
    pub exchange: StageId,
    pub bucket: usize,
}

/// Where a batch in an exchange stream belongs: its bucket and its sequence number among
/// the batches its producer channel sent to that bucket.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct BatchTag {
    pub bucket: usize,
    pub seq: u64,
}

/// The last message of a producer channel's `do_put` stream to one node: how many batches
/// it sent to each bucket the stream carries. The receiver ends the channel's part of a
/// bucket only on this mark and only when that many arrived: a stream that merely stops
/// (its sender failed or was dropped, which closes the request cleanly) must fail the
/// bucket, never end it short.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StreamEnd {
    /// (bucket, batches sent): a list, as an untagged enum cannot read maps keyed by number.
    pub sent: Vec<(usize, u64)>,
}

impl StreamEnd {
    /// The batches sent to `bucket`, if the mark counts it.
    pub fn sent_to(&self, bucket: usize) -> Option<u64> {
        self.sent
            .iter()
            .find(|&&(counted, _)| counted == bucket)
            .map(|&(_, sent)| sent)
    }
}

/// What an exchange message's app metadata says it is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StreamMark {
    Batch(BatchTag),
    End(StreamEnd),
}

/// A short content hash of one encoded exchange batch: a re-sent batch must match the
/// one first received, or the rebuilt producer did not reproduce its output.
pub type Digest = [u8; 16];

/// The digest of an encoded batch message (its IPC header and body).
pub fn batch_digest(message: &FlightData) -> Digest {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&message.data_header);
    hasher.update(&message.data_body);
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
    digest
}

/// A stream over a tokio channel's receiver.
pub fn tokio_stream_from<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

#[cfg(test)]
mod tests;
