//! Raft messages between nodes, carried as Flight actions.

use crate::quorum_check::StepDown;
use crate::wire::{ACTION_RAFT_APPEND, ACTION_RAFT_SNAPSHOT, ACTION_RAFT_VOTE};
use crate::NodeId;
use crate::TypeConfig;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{AnyError, BasicNode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use tessera_net::{CallError, Clients};

/// The shortest time a Raft message is given to be answered.
const RPC_TIMEOUT_FLOOR: std::time::Duration = std::time::Duration::from_millis(500);

/// The first pause before the leader tries again a follower it could not reach.
const FIRST_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

/// The longest pause between tries: two Raft heartbeat intervals. A follower that stays
/// down costs the leader a refused connection (and openraft an error line) five times a
/// second; openraft's own default, a constant 500 ms, left a follower that came back
/// without the entries it missed for up to half a second.
const LONGEST_RETRY: std::time::Duration = std::time::Duration::from_millis(200);

/// The pauses between the leader's tries to reach a follower that did not answer: from
/// [`FIRST_RETRY`], doubling up to [`LONGEST_RETRY`]. openraft sends a follower nothing
/// while it waits, and a node that comes back cannot serve a query until it has the
/// entries it missed (its scans wait for their epoch and for its own start to be
/// applied): one that restarts at once (a crash under a supervisor, an upgrade) hears
/// from the leader within tens of milliseconds, any other within [`LONGEST_RETRY`].
pub fn unreachable_retry_pauses() -> impl Iterator<Item = std::time::Duration> + Send + 'static {
    std::iter::successors(Some(FIRST_RETRY), |pause| {
        Some((*pause * 2).min(LONGEST_RETRY))
    })
}

#[derive(Clone)]
pub struct Network {
    pub clients: Arc<Clients>,
    /// Set while this node steps down as leader: it then sends no AppendEntries.
    pub step_down: Arc<StepDown>,
}

pub struct Connection {
    clients: Arc<Clients>,
    step_down: Arc<StepDown>,
    target: NodeId,
    addr: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Connection {
        Connection {
            clients: self.clients.clone(),
            step_down: self.step_down.clone(),
            target,
            addr: node.addr.clone(),
        }
    }
}

impl Connection {
    async fn call<Req, Resp, E>(
        &self,
        kind: &str,
        request: Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        // openraft's deadline is one heartbeat interval; a busy machine can miss that
        // without anything being wrong, so allow a little more.
        let timeout = option.hard_ttl().max(RPC_TIMEOUT_FLOOR);
        let reply: Result<Result<Resp, RaftError<NodeId, E>>, CallError> = self
            .clients
            .action(&self.addr, kind, request, timeout)
            .await;
        match reply {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(raft_error)) => Err(RPCError::RemoteError(RemoteError::new(
                self.target,
                raft_error,
            ))),
            Err(CallError::Transport(reason)) => Err(RPCError::Unreachable(Unreachable::new(
                &AnyError::error(format!("node {} at {}: {reason}", self.target, self.addr)),
            ))),
            Err(other) => Err(RPCError::Network(NetworkError::new(&AnyError::error(
                format!("node {} at {}: {other}", self.target, self.addr),
            )))),
        }
    }
}

impl Connection {
    /// While this node steps down as leader it sends nothing that renews its followers'
    /// lease (entries, heartbeats, snapshots), so that they elect another leader.
    fn refuse_while_stepping_down<E: std::error::Error>(
        &self,
    ) -> Result<(), RPCError<NodeId, BasicNode, E>> {
        if !self.step_down.is_active() {
            return Ok(());
        }
        Err(RPCError::Unreachable(Unreachable::new(&AnyError::error(
            format!(
                "not sent to node {}: this node is stepping down as metadata leader",
                self.target
            ),
        ))))
    }
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.refuse_while_stepping_down()?;
        self.call(ACTION_RAFT_APPEND, rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.refuse_while_stepping_down()?;
        self.call(ACTION_RAFT_SNAPSHOT, rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(ACTION_RAFT_VOTE, rpc, &option).await
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(unreachable_retry_pauses())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_unreachable_follower_is_tried_again_soon_then_less_often() {
        let pauses: Vec<Duration> = unreachable_retry_pauses().take(8).collect();
        let ms: Vec<u128> = pauses.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [20, 40, 80, 160, 200, 200, 200, 200]);
    }

    #[test]
    fn the_connection_gives_openraft_these_pauses() {
        let connection = Connection {
            clients: Arc::new(Clients::new("test-cluster", 1)),
            step_down: Arc::new(StepDown::default()),
            target: NodeId(2),
            addr: "127.0.0.1:1".into(),
        };
        let given: Vec<Duration> = connection.backoff().take(8).collect();
        let ours: Vec<Duration> = unreachable_retry_pauses().take(8).collect();
        assert_eq!(given, ours, "not openraft's constant 500 ms");
    }
}
