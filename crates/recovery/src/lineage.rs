//! Write-ahead lineage (seed 003 §III): under `tessera.recovery = lineage` every consumer
//! bucket fed by several producer channels logs the order it read their batches in, as
//! runs of (sender, batches). A channel's output waits until the reading order it was
//! computed from is logged with the query's initiator ([`LineageLog::wait_logged`],
//! [`crate::held`]), so whatever a consumer elsewhere has used can be recomputed exactly,
//! by [`crate::replay::replay_bucket`], from the producers' spools in the logged order.
//!
//! A node's [`commit_rounds`] task logs on demand, with one committer per initiator: when
//! output waits, one round carries everything the logged inboxes of that initiator's
//! queries on the node have read so far, however many inboxes and queries. Logging as
//! batches are read instead (not only when output needs it) cost four times the rounds
//! and about a quarter of the query time (measured when rounds were Raft writes). Each
//! initiator has its own committer so that one slow to answer (busy, or dying before it
//! is declared failed) holds up only its own queries' output, for at most
//! [`LOG_TIMEOUT`], not every query on the node.

use crate::held::{HeldLineage, ACTION_LOG_LINEAGE};
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_common::NodeId;
use tessera_exec::exchange::{Inbox, InboxKey};
use tessera_exec::hooks::LineageError;
use tessera_exec::QueryId;
use tessera_meta::{LineageEntry, MetaClient};
use tessera_net::{Clients, Refusal};
use tokio::sync::{watch, Notify};

/// One inbox whose reading order is logged.
struct Logged {
    inbox: Arc<Inbox>,
    /// The query's initiator (its lineage is dropped if the initiator dies).
    initiator: NodeId,
    /// Entries of the reading order handed to the committer.
    handed: usize,
    /// How many entries the metadata store holds, or why logging them failed.
    committed: watch::Sender<Result<usize, String>>,
}

/// The reading orders of this node's logged inboxes, and the committers they wake.
#[derive(Default)]
pub struct LineageLog {
    inboxes: Mutex<HashMap<InboxKey, Logged>>,
    /// Initiators whose queries' output waits on a round since the dispatcher last looked.
    demands: Mutex<BTreeSet<NodeId>>,
    committer: Notify,
}

/// Reading order handed to the committer: runs of (sender, batches) from `from` on.
#[derive(Debug, PartialEq)]
pub struct Unlogged {
    pub key: InboxKey,
    pub initiator: NodeId,
    pub from: usize,
    pub runs: Vec<(u32, u32)>,
}

impl Unlogged {
    /// The stretch of reading order this hand-over carries, as logged.
    fn entry(&self) -> LineageEntry {
        LineageEntry {
            query: self.key.query,
            initiator: self.initiator,
            exchange: self.key.exchange,
            bucket: self.key.bucket,
            from: self.from as u64,
            runs: self.runs.clone(),
        }
    }

    /// The position in the reading order this hand-over reaches.
    pub fn upto(&self) -> usize {
        self.from + self.runs.iter().map(|&(_, n)| n as usize).sum::<usize>()
    }
}

impl LineageLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InboxKey, Logged>> {
        self.inboxes.lock().expect("lineage log lock")
    }

    /// Logs the reading order of `inbox` from now on.
    pub fn log(&self, inbox: &Arc<Inbox>, initiator: NodeId) {
        self.lock().entry(inbox.key()).or_insert_with(|| Logged {
            inbox: inbox.clone(),
            initiator,
            handed: 0,
            committed: watch::Sender::new(Ok(0)),
        });
    }

    pub fn logs(&self, key: InboxKey) -> bool {
        self.lock().contains_key(&key)
    }

    /// Waits until the reading order of `key` up to `position` is held by its query's
    /// initiator. Wakes that initiator's committer if it is behind: a round covers whatever
    /// every logged inbox here of the initiator's queries has read, so a channel that only
    /// emits at its end costs one round, not one per batch.
    pub async fn wait_logged(&self, key: InboxKey, position: usize) -> Result<(), LineageError> {
        let (mut watch, initiator) = {
            let inboxes = self.lock();
            let Some(logged) = inboxes.get(&key) else {
                return Ok(());
            };
            (logged.committed.subscribe(), logged.initiator)
        };
        if matches!(&*watch.borrow(), Ok(at) if *at < position) {
            self.demands.lock().expect("demands lock").insert(initiator);
            self.committer.notify_one();
        }
        let reached = watch
            .wait_for(|committed| match committed {
                Ok(at) => *at >= position,
                Err(_) => true,
            })
            .await
            .map_err(|_| LineageError::QueryEnded { query: key.query })?;
        match &*reached {
            Ok(_) => Ok(()),
            Err(reason) => Err(LineageError::NotLogged {
                exchange: key.exchange,
                bucket: key.bucket,
                reason: reason.clone(),
            }),
        }
    }

    /// Waits until output waits on the log (a writer called [`LineageLog::wait_logged`]);
    /// the initiators it waits on.
    pub async fn demanded(&self) -> BTreeSet<NodeId> {
        loop {
            self.committer.notified().await;
            let demands = std::mem::take(&mut *self.demands.lock().expect("demands lock"));
            if !demands.is_empty() {
                return demands;
            }
        }
    }

    /// The reading order not yet handed over of every logged inbox of `initiator`'s
    /// queries; marks it handed.
    pub fn take_unlogged(&self, initiator: NodeId) -> Vec<Unlogged> {
        let mut inboxes = self.lock();
        let mut taken = Vec::new();
        for (&key, logged) in inboxes.iter_mut() {
            if logged.initiator != initiator {
                continue;
            }
            let senders = logged.inbox.read_since(logged.handed);
            if senders.is_empty() {
                continue;
            }
            let mut runs: Vec<(u32, u32)> = Vec::new();
            for sender in senders {
                match runs.last_mut() {
                    Some((last, count)) if *last == sender as u32 => *count += 1,
                    _ => runs.push((sender as u32, 1)),
                }
            }
            let from = logged.handed;
            let unlogged = Unlogged {
                key,
                initiator: logged.initiator,
                from,
                runs,
            };
            logged.handed = unlogged.upto();
            taken.push(unlogged);
        }
        taken.sort_by_key(|u| u.key);
        taken
    }

    /// The metadata store holds the reading order of `key` up to `position`.
    pub fn committed_up_to(&self, key: InboxKey, position: usize) {
        if let Some(logged) = self.lock().get(&key) {
            logged
                .committed
                .send_if_modified(|committed| match committed {
                    Ok(at) if *at < position => {
                        *at = position;
                        true
                    }
                    _ => false,
                });
        }
    }

    /// Logging the reading order of `key` failed: whoever waits on it fails with `reason`.
    pub fn commit_failed(&self, key: InboxKey, reason: String) {
        if let Some(logged) = self.lock().get(&key) {
            let _ = logged.committed.send_replace(Err(reason));
        }
    }

    /// `query` ended on this node: its inboxes are no longer logged.
    pub fn end_query(&self, query: QueryId) {
        self.lock().retain(|key, _| key.query != query);
    }
}

/// How long a node waits for an initiator to take a round of its queries' lineage.
const LOG_TIMEOUT: Duration = Duration::from_secs(10);

/// Logs the reading order of this node's inboxes with their queries' initiators
/// ([`crate::held`]), in rounds: one round carries everything read since the previous one
/// began, one message per initiator (none for this node's own queries).
pub async fn commit_rounds(
    log: Arc<LineageLog>,
    held: Arc<HeldLineage>,
    meta: MetaClient,
    clients: Arc<Clients>,
) {
    let me = meta.id();
    let log_round = move |initiator: NodeId, entries: Vec<LineageEntry>| {
        let (held, meta, clients) = (held.clone(), meta.clone(), clients.clone());
        async move {
            if initiator == me {
                held.append(me, &entries)
            } else {
                send(&meta, &clients, initiator, &entries).await
            }
        }
    };
    dispatch_rounds(log, log_round).await
}

/// Starts a committer for each initiator the first time output waits on its lineage, and
/// wakes it whenever output waits again.
async fn dispatch_rounds<S, F>(log: Arc<LineageLog>, log_round: S)
where
    S: Fn(NodeId, Vec<LineageEntry>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<(), String>> + Send + 'static,
{
    // One per initiator this node has run channels for: at most the cluster's nodes.
    let mut committers: HashMap<NodeId, Arc<Notify>> = HashMap::new();
    loop {
        for initiator in log.demanded().await {
            let wake = committers.entry(initiator).or_insert_with(|| {
                let wake = Arc::new(Notify::new());
                let committer = commit_for(log.clone(), initiator, wake.clone(), log_round.clone());
                tokio::spawn(committer);
                wake
            });
            // Stored if the committer is mid-round: it takes one more round after it.
            wake.notify_one();
        }
    }
}

/// The rounds of `initiator`'s queries' lineage, one at a time, so that each inbox's
/// stretches reach the initiator in order.
async fn commit_for<S, F>(log: Arc<LineageLog>, initiator: NodeId, wake: Arc<Notify>, log_round: S)
where
    S: Fn(NodeId, Vec<LineageEntry>) -> F,
    F: Future<Output = Result<(), String>>,
{
    loop {
        wake.notified().await;
        let unlogged = log.take_unlogged(initiator);
        if unlogged.is_empty() {
            continue;
        }
        let started = std::time::Instant::now();
        let entries: Vec<LineageEntry> = unlogged.iter().map(Unlogged::entry).collect();
        match log_round(initiator, entries).await {
            Ok(()) => {
                for u in &unlogged {
                    log.committed_up_to(u.key, u.upto());
                }
            }
            Err(reason) => {
                tracing::warn!(initiator = initiator.0, %reason, "could not log query lineage");
                for u in &unlogged {
                    log.commit_failed(u.key, reason.clone());
                }
            }
        }
        tracing::debug!(
            initiator = initiator.0,
            took_us = started.elapsed().as_micros() as u64,
            "lineage round logged"
        );
    }
}

/// Sends a round of this node's lineage to `initiator`; the reason if it was not taken.
async fn send(
    meta: &MetaClient,
    clients: &Clients,
    initiator: NodeId,
    entries: &[LineageEntry],
) -> Result<(), String> {
    send_to_initiator(
        meta,
        clients,
        initiator,
        ACTION_LOG_LINEAGE,
        (meta.id(), entries),
    )
    .await
}

/// Sends a query's initiator `action` with `body`, within [`LOG_TIMEOUT`]; the reason if
/// it was not taken.
pub(crate) async fn send_to_initiator<B: serde::Serialize>(
    meta: &MetaClient,
    clients: &Clients,
    initiator: NodeId,
    action: &str,
    body: B,
) -> Result<(), String> {
    let addr = meta
        .addr_of(initiator)
        .ok_or_else(|| format!("initiator {initiator} has no address"))?;
    let reply: Result<(), Refusal> = clients
        .action(&addr, action, body, LOG_TIMEOUT)
        .await
        .map_err(|e| format!("initiator {initiator}: {e}"))?;
    reply.map_err(|refusal| match refusal {
        Refusal::Failed(reason) => format!("initiator {initiator} refused it: {reason}"),
        other => format!("initiator {initiator} refused it: {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::time::Duration;
    use tessera_exec::StageId;

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![1]))]).unwrap()
    }

    fn key(bucket: usize) -> InboxKey {
        InboxKey {
            query: QueryId(7),
            exchange: StageId(1),
            bucket,
        }
    }

    #[tokio::test]
    async fn output_waits_until_the_reading_order_is_committed() {
        let log = Arc::new(LineageLog::default());
        let inbox = Arc::new(Inbox::new(key(0), 2));
        inbox.push(0, 0, batch(), None).await.unwrap();
        inbox.push(1, 0, batch(), None).await.unwrap();
        inbox.push(0, 1, batch(), None).await.unwrap();
        log.log(&inbox, NodeId(1));
        assert!(log.logs(key(0)) && !log.logs(key(1)));
        for _ in 0..3 {
            inbox.next().await.unwrap().unwrap();
        }
        let waiting = {
            let log = log.clone();
            tokio::spawn(async move { log.wait_logged(key(0), 3).await })
        };
        let demanded = tokio::time::timeout(Duration::from_secs(5), log.demanded())
            .await
            .expect("a waiting writer wakes the committer");
        assert_eq!(demanded, BTreeSet::from([NodeId(1)]));
        assert!(
            log.take_unlogged(NodeId(2)).is_empty(),
            "another initiator's"
        );
        let unlogged = log.take_unlogged(NodeId(1));
        assert_eq!(
            unlogged,
            vec![Unlogged {
                key: key(0),
                initiator: NodeId(1),
                from: 0,
                runs: vec![(0, 1), (1, 1), (0, 1)]
            }]
        );
        assert!(log.take_unlogged(NodeId(1)).is_empty(), "handed over once");
        log.committed_up_to(key(0), 2);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiting.is_finished(),
            "output went out before its lineage was logged"
        );
        log.committed_up_to(key(0), 3);
        waiting.await.unwrap().unwrap();
        log.commit_failed(key(0), "no leader".into());
        let failed = log.wait_logged(key(0), 4).await.unwrap_err();
        assert!(
            matches!(&failed, LineageError::NotLogged { reason, .. } if reason == "no leader"),
            "{failed}"
        );
        assert!(
            log.wait_logged(key(1), 9).await.is_ok(),
            "a bucket whose order is not logged never waits"
        );
        log.end_query(QueryId(7));
        assert!(!log.logs(key(0)), "an ended query's inboxes are not logged");
    }

    #[tokio::test]
    async fn a_later_round_hands_over_only_what_was_read_since() {
        let log = LineageLog::default();
        let inbox = Arc::new(Inbox::new(key(0), 2));
        log.log(&inbox, NodeId(1));
        inbox.push(1, 0, batch(), None).await.unwrap();
        inbox.next().await.unwrap().unwrap();
        assert_eq!(log.take_unlogged(NodeId(1))[0].upto(), 1);
        inbox.push(1, 1, batch(), None).await.unwrap();
        inbox.push(0, 0, batch(), None).await.unwrap();
        inbox.next().await.unwrap().unwrap();
        inbox.next().await.unwrap().unwrap();
        let round = log.take_unlogged(NodeId(1));
        assert_eq!(
            (round[0].from, round[0].runs.clone()),
            (1, vec![(1, 1), (0, 1)])
        );
    }

    #[tokio::test]
    async fn an_initiator_slow_to_take_a_round_holds_up_only_its_own_queries() {
        let log = Arc::new(LineageLog::default());
        let (slow, quick) = (NodeId(2), NodeId(3));
        let inbox = |query: u64| {
            Arc::new(Inbox::new(
                InboxKey {
                    query: QueryId(query),
                    exchange: StageId(1),
                    bucket: 0,
                },
                1,
            ))
        };
        let (of_slow, of_quick) = (inbox(1), inbox(2));
        log.log(&of_slow, slow);
        log.log(&of_quick, quick);
        let round = |initiator: NodeId, _entries: Vec<LineageEntry>| async move {
            if initiator == NodeId(2) {
                // Never answers within this test (as an initiator that froze).
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            Ok(())
        };
        tokio::spawn(dispatch_rounds(log.clone(), round));

        for inbox in [&of_slow, &of_quick] {
            inbox.push(0, 0, batch(), None).await.unwrap();
            inbox.next().await.unwrap().unwrap();
        }
        let waiting_on_slow = {
            let log = log.clone();
            tokio::spawn(async move { log.wait_logged(of_slow.key(), 1).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        tokio::time::timeout(Duration::from_secs(5), log.wait_logged(of_quick.key(), 1))
            .await
            .expect("the quick initiator's round is not held up by the slow one's")
            .unwrap();
        // And the quick initiator's later rounds go on while the slow one's is out.
        of_quick.push(0, 1, batch(), None).await.unwrap();
        of_quick.next().await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_secs(5), log.wait_logged(of_quick.key(), 2))
            .await
            .expect("a second round of the quick initiator's")
            .unwrap();
        assert!(
            !waiting_on_slow.is_finished(),
            "the slow initiator took nothing"
        );
    }
}
