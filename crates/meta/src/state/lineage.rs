//! The logged reading orders of running queries (write-ahead lineage), as the metadata
//! keeps them: what `MetaCommand::Lineage` appends and a rebuilt consumer replays.

use crate::NodeId;
use serde::{Deserialize, Serialize};
use tessera_common::{QueryId, StageId};

/// The next stretch of one inbox's reading order: from position `from`, runs of
/// (producer channel, batches read in a row).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LineageEntry {
    pub query: QueryId,
    pub initiator: NodeId,
    pub exchange: StageId,
    pub bucket: usize,
    pub from: u64,
    pub runs: Vec<(u32, u32)>,
}

/// The logged reading orders of one running query.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct QueryLineage {
    pub initiator: NodeId,
    pub inboxes: Vec<InboxLineage>,
}

/// The reading order of one bucket on one node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InboxLineage {
    pub node: NodeId,
    pub exchange: StageId,
    pub bucket: usize,
    /// Batches read, in order, as runs of (producer channel, batches).
    pub runs: Vec<(u32, u32)>,
    pub batches: u64,
}

impl QueryLineage {
    /// Appends `entry`, a stretch of the reading order of one of `node`'s inboxes.
    pub fn append(&mut self, node: NodeId, entry: &LineageEntry) -> Result<(), String> {
        let position = self.inboxes.iter().position(|i| {
            i.node == node && i.exchange == entry.exchange && i.bucket == entry.bucket
        });
        let inbox = match position {
            Some(at) => &mut self.inboxes[at],
            None => {
                self.inboxes.push(InboxLineage {
                    node,
                    exchange: entry.exchange,
                    bucket: entry.bucket,
                    runs: Vec::new(),
                    batches: 0,
                });
                self.inboxes.last_mut().expect("just pushed")
            }
        };
        inbox.extend(entry.from, &entry.runs)
    }
}

impl InboxLineage {
    /// Appends the runs of an entry that starts at `from`, skipping what is already here
    /// (a retried write). A gap (an entry whose predecessor was lost) is refused.
    pub(crate) fn extend(&mut self, from: u64, runs: &[(u32, u32)]) -> Result<(), String> {
        if from > self.batches {
            return Err(format!(
                "lineage of exchange {} bucket {} on node {} continues at batch {from}, but {} are logged",
                self.exchange, self.bucket, self.node, self.batches
            ));
        }
        let mut skip = self.batches - from;
        for &(sender, count) in runs {
            let kept = (count as u64).saturating_sub(skip);
            skip = skip.saturating_sub(count as u64);
            if kept == 0 {
                continue;
            }
            match self.runs.last_mut() {
                Some((last, n)) if *last == sender => *n += kept as u32,
                _ => self.runs.push((sender, kept as u32)),
            }
            self.batches += kept;
        }
        Ok(())
    }
}
