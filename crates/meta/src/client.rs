//! [`MetaClient`]: how every layer reads and writes the metadata, wherever the leader is.

use crate::error::{MetaError, Result};
use crate::wire::{ACTION_META_WRITE, ACTION_READ_INDEX};
use crate::{MetaCommand, MetaResponse, MetaView, NodeId, Raft};
use openraft::ServerState;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_common::Epoch;
use tessera_net::{CallError, Clients, Refusal};
use tokio::sync::watch;

/// How long a metadata write keeps looking for a leader.
const WRITE_PATIENCE: Duration = Duration::from_secs(15);
/// How long one forwarded write may take at the leader.
const FORWARDED_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a leader waits for its own entry to commit.
const LEADER_COMMIT_PATIENCE: Duration = FORWARDED_WRITE_TIMEOUT;
/// Pause between attempts while no leader answers.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// How long a read index from the leader may take.
const READ_INDEX_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a read that must be current waits, by default, for a leader to confirm an
/// index and this node to apply it (an election takes about a second).
pub const LINEARIZABLE_READ_PATIENCE: Duration = Duration::from_secs(10);

/// A node's handle on the metadata group: its Raft member, the state it has applied, and
/// connections to reach the leader. Cheap to clone.
#[derive(Clone)]
pub struct MetaClient {
    inner: Arc<Inner>,
}

struct Inner {
    id: NodeId,
    raft: Raft,
    applied: watch::Receiver<Arc<MetaView>>,
    clients: Arc<Clients>,
    /// The configured peers, for a node not yet in the metadata group (a joining node).
    peers: Vec<(NodeId, String)>,
}

impl std::fmt::Debug for MetaClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaClient")
            .field("node", &self.inner.id)
            .finish()
    }
}

impl MetaClient {
    pub fn new(
        id: NodeId,
        raft: Raft,
        applied: watch::Receiver<Arc<MetaView>>,
        clients: Arc<Clients>,
        peers: Vec<(NodeId, String)>,
    ) -> MetaClient {
        MetaClient {
            inner: Arc::new(Inner {
                id,
                raft,
                applied,
                clients,
                peers,
            }),
        }
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.inner.id
    }

    /// This node's Raft member (for the server's dispatch of Raft messages and the
    /// leader's membership duties).
    pub fn raft(&self) -> &Raft {
        &self.inner.raft
    }

    /// The metadata as this node last applied it: may lag the leader. A read that must see
    /// every acknowledged epoch uses [`MetaClient::read_linearizable`] instead.
    pub fn view(&self) -> Arc<MetaView> {
        self.inner.applied.borrow().clone()
    }

    pub fn leader(&self) -> Option<NodeId> {
        self.inner.raft.metrics().borrow().current_leader
    }

    pub fn is_leader(&self) -> bool {
        self.inner.raft.metrics().borrow().state == ServerState::Leader
    }

    /// Where node `id` listens, from the metadata, Raft membership or the configuration.
    pub fn addr_of(&self, id: NodeId) -> Option<String> {
        if let Some(node) = self.view().state.nodes.get(&id) {
            return Some(node.addr.clone());
        }
        let metrics = self.inner.raft.metrics().borrow().clone();
        if let Some(node) = metrics.membership_config.nodes().find(|(n, _)| **n == id) {
            return Some(node.1.addr.clone());
        }
        self.inner
            .peers
            .iter()
            .find(|(peer, _)| *peer == id)
            .map(|(_, addr)| addr.clone())
    }

    /// As [`MetaClient::addr_of`], or an error naming the node.
    pub fn require_addr(&self, id: NodeId) -> Result<String> {
        self.addr_of(id).ok_or(MetaError::NoAddress { node: id })
    }

    /// Proposes a metadata command through the leader, wherever it is, retrying while an
    /// election runs (up to [`WRITE_PATIENCE`]).
    pub async fn write(&self, command: MetaCommand) -> Result<MetaResponse> {
        let deadline = Instant::now() + WRITE_PATIENCE;
        let mut last_error = MetaError::NoLeader;
        while Instant::now() < deadline {
            match self.write_once(&command).await {
                Ok(response) => return refusal_as_error(response),
                Err(e) => last_error = e,
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        Err(last_error)
    }

    async fn write_once(&self, command: &MetaCommand) -> Result<MetaResponse> {
        let leader = match self.leader() {
            Some(leader) => leader,
            // Not yet in the metadata group (a joining node): ask the configured peers.
            None => return self.write_via_peers(command).await,
        };
        if leader == self.id() {
            return self.write_as_leader(command.clone()).await;
        }
        self.write_at(leader, command).await
    }

    async fn write_via_peers(&self, command: &MetaCommand) -> Result<MetaResponse> {
        let mut refusals = Vec::new();
        for (peer, _) in self.inner.peers.iter().filter(|(p, _)| *p != self.id()) {
            match self.write_at(*peer, command).await {
                Err(MetaError::NotLeader(Some(leader))) => {
                    return self.write_at(leader, command).await
                }
                Err(MetaError::NotLeader(None)) => {
                    refusals.push(format!("node {peer} knows no leader either"))
                }
                Err(error) => refusals.push(format!("node {peer}: {error}")),
                done => return done,
            }
        }
        if refusals.is_empty() {
            return Err(MetaError::NoLeader);
        }
        Err(MetaError::NoPeerAnswered(refusals.join("; ")))
    }

    /// Forwards a write to `leader`. Given up as soon as this node hears of another leader:
    /// the old one's entry may then never be answered (see [`unless_leadership_moves`]).
    async fn write_at(&self, leader: NodeId, command: &MetaCommand) -> Result<MetaResponse> {
        let addr = self.require_addr(leader)?;
        let forwarded = async {
            let reply: std::result::Result<std::result::Result<_, Refusal>, CallError> = self
                .inner
                .clients
                .action(&addr, ACTION_META_WRITE, command, FORWARDED_WRITE_TIMEOUT)
                .await;
            forwarded_reply(leader, &addr, reply)
        };
        let another_leads = |m: &Metrics| m.current_leader.is_some_and(|now| now != leader);
        unless_leadership_moves(forwarded, self.inner.raft.metrics(), another_leads, leader).await
    }

    /// As [`MetaClient::write_as_leader`], with the state machine's refusals as errors,
    /// as [`MetaClient::write`] gives them: for a caller that acts on the command having
    /// taken effect.
    pub async fn write_checked_as_leader(&self, command: MetaCommand) -> Result<MetaResponse> {
        refusal_as_error(self.write_as_leader(command).await?)
    }

    /// Runs a command on this node if it leads. A command the state machine refuses comes
    /// back as `Ok(MetaResponse::Refused(..))` (a forwarded write passes it on as it is);
    /// [`MetaClient::write_checked_as_leader`] makes it an error.
    pub async fn write_as_leader(&self, command: MetaCommand) -> Result<MetaResponse> {
        // Stamped with this leader's clock here, the one place commands enter the log.
        let command = match command {
            stamped @ MetaCommand::Stamped { .. } => stamped,
            command => MetaCommand::Stamped {
                at_ms: tessera_common::time::now_ms(),
                command: Box::new(command),
            },
        };
        // A leader that cannot reach a majority commits nothing until it steps down or the
        // partition heals; its callers (the duty loop among them) must not wait on it
        // forever. An entry given up on may still commit later: callers retry idempotently.
        //
        // A leader deposed meanwhile gives up at once: openraft answers an entry only once
        // it is committed or overwritten, and a deposed leader whose links are slow may hear
        // of neither for a long time (its successor cannot complete a round trip to it).
        let metrics = self.inner.raft.metrics();
        let term = metrics.borrow().current_term;
        let committed = async {
            match tokio::time::timeout(
                LEADER_COMMIT_PATIENCE,
                self.inner.raft.client_write(command),
            )
            .await
            {
                Ok(Ok(response)) => Ok(response.data),
                Ok(Err(e)) => Err(MetaError::raft(e)),
                Err(_) => Err(MetaError::Raft(format!(
                    "this leader committed no entry within {LEADER_COMMIT_PATIENCE:?} (no \
                     majority answers it); the entry may still commit"
                ))),
            }
        };
        let deposed = |m: &Metrics| m.state != ServerState::Leader || m.current_term != term;
        unless_leadership_moves(committed, metrics, deposed, self.id()).await
    }

    /// What a leader answers to a read-index request: its commit index, once it has
    /// confirmed that it still leads.
    pub async fn read_index(&self) -> std::result::Result<u64, Refusal> {
        match self.inner.raft.ensure_linearizable().await {
            Ok(log_id) => Ok(log_id.map_or(0, |l| l.index)),
            Err(e) => Err(Refusal::Failed(e.to_string())),
        }
    }

    /// A linearizable read of the metadata: waits until this node has applied every entry
    /// the leader had committed when asked (a read index), so the returned view holds every
    /// epoch acknowledged anywhere before the call. Retries while no leader answers (an
    /// election), up to `patience`; then refuses with [`MetaError::NotCurrent`] rather than
    /// return a view that may be stale. For a view that need not be current, use
    /// [`MetaClient::view`], which says so.
    pub async fn read_linearizable(&self, patience: Duration) -> Result<Arc<MetaView>> {
        let deadline = Instant::now() + patience;
        loop {
            let attempt = match self.confirmed_read_index().await {
                Ok(index) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if self
                        .wait_until(left, |view| view.applied_index >= index)
                        .await
                    {
                        return Ok(self.view());
                    }
                    format!(
                        "it applied index {} but the leader's read index is {index}",
                        self.view().applied_index
                    )
                }
                Err(reason) => reason,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(MetaError::NotCurrent {
                    node: self.id(),
                    reason: format!("after {patience:?}: {attempt}"),
                });
            }
            tokio::time::sleep(RETRY_PAUSE.min(left)).await;
        }
    }

    /// The leader's commit index, confirmed by a quorum (this node's own, if it leads).
    async fn confirmed_read_index(&self) -> std::result::Result<u64, String> {
        if self.is_leader() {
            return match tokio::time::timeout(
                READ_INDEX_TIMEOUT,
                self.inner.raft.ensure_linearizable(),
            )
            .await
            {
                Ok(Ok(log_id)) => Ok(log_id.map_or(0, |l| l.index)),
                Ok(Err(error)) => Err(format!("as leader, it could not confirm its lead: {error}")),
                Err(_) => Err("as leader, no quorum confirmed its lead in time".into()),
            };
        }
        let Some(leader) = self.leader() else {
            return Err("no metadata leader is known".into());
        };
        let Some(addr) = self.addr_of(leader) else {
            return Err(format!("leader {leader} has no known address"));
        };
        let reply: std::result::Result<std::result::Result<u64, Refusal>, CallError> = self
            .inner
            .clients
            .action(&addr, ACTION_READ_INDEX, (), READ_INDEX_TIMEOUT)
            .await;
        match reply {
            Ok(Ok(index)) => Ok(index),
            Ok(Err(refusal)) => Err(format!("leader {leader} refused a read index: {refusal:?}")),
            Err(error) => Err(format!("leader {leader} at {addr} did not answer: {error}")),
        }
    }

    /// Waits until `condition` holds of the applied metadata, up to `patience`; true if it
    /// does.
    pub async fn wait_until(
        &self,
        patience: Duration,
        condition: impl FnMut(&Arc<MetaView>) -> bool,
    ) -> bool {
        let mut applied = self.inner.applied.clone();
        tokio::time::timeout(patience, applied.wait_for(condition))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until this node's metadata shows `epoch` visible (scans at an epoch).
    pub async fn wait_for_epoch(&self, epoch: Epoch, timeout: Duration) -> Result<()> {
        if self
            .wait_until(timeout, |view| view.state.visible >= epoch)
            .await
        {
            return Ok(());
        }
        Err(MetaError::EpochNotVisible {
            node: self.id(),
            epoch,
            visible: self.view().state.visible,
        })
    }

    /// Waits until this node can read `table` as a query planned elsewhere sees it: its
    /// metadata shows `epoch` visible and has applied the table's creation (log index
    /// `generation`), so the store holds the table. A restarting node replays its log
    /// in order, and may show an epoch visible before it reaches a later entry creating
    /// a table that epoch does not yet hold rows of.
    pub async fn wait_to_read(
        &self,
        table: &str,
        generation: u64,
        epoch: Epoch,
        timeout: Duration,
    ) -> Result<()> {
        let readable = self
            .wait_until(timeout, |view| {
                view.state.visible >= epoch && view.applied_index >= generation
            })
            .await;
        if readable {
            return Ok(());
        }
        let view = self.view();
        if view.state.visible < epoch {
            return Err(MetaError::EpochNotVisible {
                node: self.id(),
                epoch,
                visible: view.state.visible,
            });
        }
        Err(MetaError::TableNotApplied {
            node: self.id(),
            table: table.to_string(),
            generation,
            applied: view.applied_index,
        })
    }

    /// Waits (up to `patience`) until the metadata shows this node alive; after a false
    /// suspicion the next heartbeat revives it.
    pub async fn wait_until_alive(&self, patience: Duration) {
        let id = self.id();
        self.wait_until(patience, |view| {
            view.state.nodes.get(&id).is_some_and(|n| n.alive)
        })
        .await;
    }

    /// Waits (up to `patience`) until the metadata shows node `id` failed, so the next
    /// placement read has promoted other replicas in its place.
    pub async fn wait_until_failed(&self, id: NodeId, patience: Duration) {
        self.wait_until(patience, |view| {
            view.state.nodes.get(&id).is_none_or(|n| !n.alive)
        })
        .await;
    }
}

/// A forwarded write's reply, as the write's outcome.
fn forwarded_reply(
    leader: NodeId,
    addr: &str,
    reply: std::result::Result<std::result::Result<MetaResponse, Refusal>, CallError>,
) -> Result<MetaResponse> {
    match reply {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(Refusal::NotLeader { leader })) => Err(MetaError::NotLeader(leader)),
        Ok(Err(refusal)) => Err(MetaError::Raft(format!("{refusal:?}"))),
        Err(e) => Err(MetaError::Unreachable {
            node: leader,
            addr: addr.to_string(),
            reason: e.to_string(),
        }),
    }
}

type Metrics = openraft::RaftMetrics<NodeId, openraft::BasicNode>;

/// Runs `write`, a write waiting on node `leader`, unless the metrics show first that the
/// lead has moved (`moved`): then it is given up with [`MetaError::LeaderChanged`], for the
/// caller to retry at the new leader.
///
/// Why: an entry a leader logged is answered only once it commits or is overwritten. A
/// leader whose links turned slow with writes in flight cannot commit them, and after its
/// successor's election it may hear neither (a round trip to it takes longer than Raft's
/// one-heartbeat timeout), so the writes would wait out their whole timeout on a node that
/// no longer leads (fault run 4702: publishes stalled 10 s).
async fn unless_leadership_moves<T>(
    write: impl std::future::Future<Output = Result<T>>,
    mut metrics: watch::Receiver<Metrics>,
    moved: impl FnMut(&Metrics) -> bool,
    leader: NodeId,
) -> Result<T> {
    let lost = async {
        // Mapped at once: the metrics guard must not be held across an await.
        let now = metrics.wait_for(moved).await.map(|m| m.current_leader);
        match now {
            Ok(now) => MetaError::LeaderChanged { was: leader, now },
            // Raft has shut down: the write's own outcome decides.
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        result = write => result,
        lost = lost => {
            tracing::info!(%lost, "gave up a metadata write waiting on a former leader; retrying at the new one");
            Err(lost)
        }
    }
}

/// The state machine's refusals of a command, as errors; what it did, as it is.
fn refusal_as_error(response: MetaResponse) -> Result<MetaResponse> {
    match response {
        MetaResponse::Refused(reason) => Err(MetaError::Refused(reason)),
        MetaResponse::TableBusy(reason) => Err(MetaError::TableBusy(reason)),
        MetaResponse::WriteConflict(reason) => Err(MetaError::WriteConflict(reason)),
        MetaResponse::Fenced(reason) => Err(MetaError::Fenced(reason)),
        response => Ok(response),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(leader: Option<u64>) -> Metrics {
        let mut m = Metrics::new_initial(NodeId(2));
        m.current_leader = leader.map(NodeId);
        m
    }

    fn another_than(leader: u64) -> impl FnMut(&Metrics) -> bool {
        move |m: &Metrics| m.current_leader.is_some_and(|now| now != NodeId(leader))
    }

    #[tokio::test]
    async fn a_write_waiting_on_a_former_leader_is_given_up_once_another_leads() {
        let (tx, rx) = watch::channel(metrics(Some(1)));
        let never_answered = std::future::pending::<Result<()>>();
        let waiting = tokio::spawn(unless_leadership_moves(
            never_answered,
            rx,
            another_than(1),
            NodeId(1),
        ));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // An election without a winner yet, then the same leader again: keep waiting.
        tx.send_replace(metrics(None));
        tx.send_replace(metrics(Some(1)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiting.is_finished(),
            "still led by node 1: the write waits"
        );
        tx.send_replace(metrics(Some(3)));
        let outcome = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("given up once node 3 leads")
            .unwrap();
        assert!(
            matches!(
                outcome,
                Err(MetaError::LeaderChanged {
                    was: NodeId(1),
                    now: Some(NodeId(3))
                })
            ),
            "{outcome:?}"
        );
    }

    #[tokio::test]
    async fn a_write_answered_before_the_lead_moves_keeps_its_answer() {
        let (tx, rx) = watch::channel(metrics(Some(1)));
        let answered = async { Ok(7) };
        let outcome = unless_leadership_moves(answered, rx, another_than(1), NodeId(1)).await;
        assert_eq!(outcome.unwrap(), 7);
        // Once Raft has stopped (no more metrics), only the write's own outcome counts.
        drop(tx);
        let (tx, rx) = watch::channel(metrics(Some(1)));
        drop(tx);
        let slow = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(8)
        };
        let outcome = unless_leadership_moves(slow, rx, another_than(1), NodeId(1)).await;
        assert_eq!(outcome.unwrap(), 8);
    }
}
