//! A node's exchanges and running channels, by query: inboxes are made on first use by
//! whichever end comes first, and everything of a query goes when it ends here.

use super::{Inbox, InboxKey};
use crate::QueryId;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use tessera_common::config::ExecSettings;
use tessera_sql::decoded::{DecodedComponents, DecodedLimits};
use tokio::sync::Notify;

/// Queries remembered as ended, so late batches for them are dropped, not buffered.
const ENDED_QUERIES_KEPT: usize = 4096;

/// A node's exchanges and running channels, by query.
pub struct QueryRegistry {
    /// Unread bytes each inbox holds before its producers wait.
    inbox_budget_bytes: usize,
    inboxes: Mutex<HashMap<InboxKey, Arc<Inbox>>>,
    ended: Mutex<(HashSet<QueryId>, VecDeque<QueryId>)>,
    /// Woken whenever a query ends here.
    ended_now: Notify,
    running: Mutex<HashMap<QueryId, Vec<tokio::task::AbortHandle>>>,
    /// Component statistics read for scans on this node.
    statistics: tessera_sql::provider::ComponentStatistics,
    /// Small components kept decoded for scans on this node.
    decoded: Arc<DecodedComponents>,
}

impl Default for QueryRegistry {
    fn default() -> Self {
        QueryRegistry::new(&ExecSettings::default())
    }
}

impl QueryRegistry {
    /// A registry whose inboxes hold up to `settings.inbox_budget_bytes` each.
    pub fn new(settings: &ExecSettings) -> QueryRegistry {
        QueryRegistry {
            inbox_budget_bytes: settings.inbox_budget_bytes,
            inboxes: Mutex::default(),
            ended: Mutex::default(),
            ended_now: Notify::new(),
            running: Mutex::default(),
            statistics: Default::default(),
            decoded: Arc::new(DecodedComponents::new(DecodedLimits::from(settings))),
        }
    }

    /// The inbox of `key`, made on first use by whichever end comes first. `None` if the
    /// query has ended here: whatever still arrives for it is not needed.
    pub fn inbox(&self, key: InboxKey, expected_senders: usize) -> Option<Arc<Inbox>> {
        if self.has_ended(key.query) {
            return None;
        }
        let mut inboxes = self.inboxes.lock().expect("inboxes lock");
        Some(
            inboxes
                .entry(key)
                .or_insert_with(|| {
                    Arc::new(Inbox::with_budget(
                        key,
                        expected_senders,
                        self.inbox_budget_bytes,
                    ))
                })
                .clone(),
        )
    }

    /// The inbox of `key` if it exists, without making one.
    pub fn peek(&self, key: InboxKey) -> Option<Arc<Inbox>> {
        self.inboxes
            .lock()
            .expect("inboxes lock")
            .get(&key)
            .cloned()
    }

    pub fn has_ended(&self, query: QueryId) -> bool {
        self.ended.lock().expect("ended lock").0.contains(&query)
    }

    /// Waits until `query` ends on this node.
    pub async fn wait_ended(&self, query: QueryId) {
        loop {
            let ended = self.ended_now.notified();
            if self.has_ended(query) {
                return;
            }
            ended.await;
        }
    }

    /// The consumer of `key` on this node needs no more of it.
    pub fn close(&self, key: InboxKey) {
        if let Some(inbox) = self.inbox(key, 0) {
            inbox.close();
        }
    }

    /// Tracks a channel task so ending the query stops it.
    pub fn track(&self, query: QueryId, task: tokio::task::AbortHandle) {
        self.running
            .lock()
            .expect("running lock")
            .entry(query)
            .or_default()
            .push(task);
    }

    /// Ends `query` on this node: stops its channels, drops its inboxes, and
    /// remembers it so late batches are dropped. Idempotent.
    pub fn end_query(&self, query: QueryId) {
        {
            let mut ended = self.ended.lock().expect("ended lock");
            if ended.0.insert(query) {
                ended.1.push_back(query);
                if ended.1.len() > ENDED_QUERIES_KEPT {
                    if let Some(old) = ended.1.pop_front() {
                        ended.0.remove(&old);
                    }
                }
            }
        }
        self.ended_now.notify_waiters();
        if let Some(tasks) = self.running.lock().expect("running lock").remove(&query) {
            for task in tasks {
                task.abort();
            }
        }
        {
            let mut inboxes = self.inboxes.lock().expect("inboxes lock");
            inboxes.retain(|key, inbox| {
                if key.query == query {
                    inbox.close();
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Component statistics read for scans on this node, cached.
    pub fn statistics(&self) -> &tessera_sql::provider::ComponentStatistics {
        &self.statistics
    }

    /// Small components kept decoded for scans on this node.
    pub fn decoded(&self) -> &Arc<DecodedComponents> {
        &self.decoded
    }

    /// Queries with channels still running on this node (a gauge at each scrape: after a
    /// cancel or an error it falls back to zero on every node).
    pub fn queries_running(&self) -> usize {
        let running = self.running.lock().expect("running lock");
        running
            .values()
            .filter(|tasks| tasks.iter().any(|task| !task.is_finished()))
            .count()
    }

    /// Inboxes held now (for tests and status).
    pub fn open_inboxes(&self) -> usize {
        self.inboxes.lock().expect("inboxes lock").len()
    }
}

impl std::fmt::Debug for QueryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryRegistry")
            .field("open_inboxes", &self.open_inboxes())
            .finish()
    }
}
