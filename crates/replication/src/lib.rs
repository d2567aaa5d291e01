//! Replication (DESIGN §5, §6): how a published epoch reaches every replica durably, how a
//! dead node is detected and replaced, and how a returning or new replica catches up.
//! See `README.md` beside this crate for the table of protocols, each with its file.
//!
//! Every protocol reaches the rest of the node through [`Replication`], a handle holding
//! exactly what they use: the store, the metadata client, connections to other nodes, the
//! failure detector and the transfer counters.
//!
//! Architecture invariant: only the metadata decides an epoch's fate or a partition's
//! placement; these protocols move rows and components and then ask the metadata to record
//! the outcome. Nothing here knows about SQL or queries.
//! API boundary: [`Replication`], [`publish::publish`], [`log_shipping::receive`], [`rebalance::rebalance`],
//! [`rebalance::copy_partitions`], [`shipping`]'s checkpoint and pull, [`failover`], [`wire`].

pub mod archive;
mod batched;
pub mod catch_up;
pub mod error;
pub mod failover;
pub mod log_shipping;
pub mod publish;
pub mod rebalance;
mod route;
pub mod seal;
pub mod shipping;
pub mod stall;
pub mod wire;

pub use error::{PrepareFailed, ReplicationError, Result};
pub use tessera_common::NodeId;

use failover::FailureDetector;
use rebalance::TransferCounters;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tessera_common::{ComponentHash, Epoch, PartitionId};
use tessera_meta::MetaClient;
use tessera_net::Clients;
use tessera_storage::Store;

/// How long a prepare waits on a peer (or this node's own logging) that makes no progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patience {
    /// Gives up after this long: the publish goes on without the peer, which misses the
    /// epoch and catches up later.
    Usual(Duration),
    /// The publish cannot go on without the peer: it is one of the last current replicas
    /// of a partition, so leaving it out would leave fewer than `replicas.min_copies` (on a
    /// one-node cluster, always). Giving up would only refuse the publish, so the wait goes
    /// on, said in the log after `usual`, and ends at `epoch_open` (the open-epoch timeout,
    /// when the metadata leader aborts the epoch anyway).
    LastCopy {
        usual: Duration,
        epoch_open: Duration,
    },
}

impl Patience {
    /// `usual`, or the longer wait for a peer the publish cannot go without.
    pub fn for_peer(last_copy: bool, usual: Duration, settings: &Settings) -> Patience {
        if last_copy && settings.open_epoch_timeout > usual {
            Patience::LastCopy {
                usual,
                epoch_open: settings.open_epoch_timeout,
            }
        } else {
            Patience::Usual(usual)
        }
    }

    /// How long the peer may make no progress before it is given up.
    pub fn limit(self) -> Duration {
        match self {
            Patience::Usual(limit) => limit,
            Patience::LastCopy { epoch_open, .. } => epoch_open,
        }
    }
}

/// The settings the replication protocols follow (from `node.toml`).
#[derive(Debug, Clone)]
pub struct Settings {
    /// A node silent this long is declared failed.
    pub failure_timeout: Duration,
    /// A node failed this long loses its replicas, rebuilt on the other nodes.
    pub rereplicate_after: Duration,
    /// A returning replica fetches only the versions it missed (else its partitions whole).
    pub delta_recovery: bool,
    /// The metadata leader aborts an epoch open this long.
    pub open_epoch_timeout: Duration,
    /// A forwarded prepare whose replica makes no progress this long is given up (the
    /// replica missed the epoch); a coordinator gives its primary twice as long; a leased
    /// partition copy that fetches and installs nothing this long gives up (`failure.progress_timeout_ms`).
    pub progress_timeout: Duration,
    /// Where this node keeps the secret signing keys of the participants it publishes for
    /// (see [`seal`]).
    pub keys_dir: std::path::PathBuf,
    /// Seal publishes with version ids and signatures (see `ReplicaSettings::version_ids`).
    pub version_ids: bool,
    /// The fewest replicas of a touched partition that must hold every committed epoch
    /// for a publish to be acknowledged (`ReplicaSettings::min_copies`).
    pub min_copies: u32,
}

/// This node's part in the replication protocols.
pub struct Replication {
    id: NodeId,
    /// This process's incarnation: epochs it opens are tagged with it.
    incarnation: u64,
    pub store: Arc<Store>,
    pub meta: MetaClient,
    pub clients: Arc<Clients>,
    pub settings: Settings,
    /// What this node copied from others as a new or returning replica.
    pub transfers: TransferCounters,
    /// Heartbeats and suspicions: the leader decides liveness from them; a follower passes
    /// its suspicions on.
    detector: Mutex<FailureDetector>,
    /// Woken when a node becomes suspect: a follower passes it on at once, and the leader
    /// probes it at once, rather than on their next ticks.
    suspected: tokio::sync::Notify,
    /// The components last announced to standbys, per (table, partition) this node leads.
    shipped: Mutex<HashMap<(String, PartitionId), Vec<ComponentHash>>>,
    /// The epochs this node is coordinating now, and the allocations it awaits.
    coordinating: Mutex<Coordinating>,
    /// Held by a partition copy into this node from start to install. A copy whose
    /// rebalance gave up on it (its caller timed out, and the epoch holding the leases was
    /// aborted) still runs here; a later copy must not install before it, or the older
    /// copy's versions would replace the newer ones (found by the long fault run, seed
    /// 2605: a replica marked fresh lacked four acknowledged epochs).
    pub copying: tokio::sync::Mutex<()>,
    /// How far this node's stale partitions got before a rebalance's lease.
    caught_up: catch_up::CaughtUp,
}

/// What this node's heartbeats list as coordinated by it (see
/// [`tessera_meta::wire::Heartbeat`]): each under one lock, so an allocation turns into
/// its epoch without a moment in which a heartbeat would list neither.
#[derive(Debug, Default)]
struct Coordinating {
    /// The open epochs, with how many tasks work on each.
    epochs: BTreeMap<Epoch, usize>,
    /// The requests of allocations sent and not yet answered, with how many tasks await each.
    allocating: BTreeMap<u64, usize>,
}

fn count_up<K: Ord>(counts: &mut BTreeMap<K, usize>, key: K) {
    *counts.entry(key).or_default() += 1;
}

fn count_down<K: Ord>(counts: &mut BTreeMap<K, usize>, key: &K) {
    if let Some(count) = counts.get_mut(key) {
        *count -= 1;
        if *count == 0 {
            counts.remove(key);
        }
    }
}

/// Marks an epoch as being worked on by this node until dropped (its heartbeats renew the
/// epoch's open-epoch timeout meanwhile; once none lists it, the leader aborts it if open).
pub struct WorkingOn<'a> {
    node: &'a Replication,
    epoch: Epoch,
}

impl WorkingOn<'_> {
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }
}

impl Drop for WorkingOn<'_> {
    fn drop(&mut self) {
        count_down(&mut self.node.coordinating().epochs, &self.epoch);
    }
}

/// Marks an epoch allocation as awaited by this node, from before it is sent until dropped
/// or turned into the epoch it opened ([`Allocating::opened`]).
pub struct Allocating<'a> {
    node: &'a Replication,
    request: u64,
}

impl<'a> Allocating<'a> {
    /// The allocation opened `epoch`: worked on from now, in the same step.
    pub fn opened(self, epoch: Epoch) -> WorkingOn<'a> {
        let node = self.node;
        {
            let mut coordinating = node.coordinating();
            count_up(&mut coordinating.epochs, epoch);
            count_down(&mut coordinating.allocating, &self.request);
        }
        std::mem::forget(self);
        WorkingOn { node, epoch }
    }
}

impl Drop for Allocating<'_> {
    fn drop(&mut self) {
        count_down(&mut self.node.coordinating().allocating, &self.request);
    }
}

impl std::fmt::Debug for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replication")
            .field("node", &self.id)
            .finish()
    }
}

impl Replication {
    pub fn new(
        incarnation: u64,
        store: Arc<Store>,
        meta: MetaClient,
        clients: Arc<Clients>,
        settings: Settings,
    ) -> Replication {
        Replication {
            id: meta.id(),
            incarnation,
            detector: Mutex::new(
                FailureDetector::new(settings.failure_timeout, settings.rereplicate_after)
                    .with_open_epoch_timeout(settings.open_epoch_timeout),
            ),
            store,
            meta,
            clients,
            settings,
            transfers: TransferCounters::default(),
            suspected: tokio::sync::Notify::new(),
            shipped: Mutex::new(HashMap::new()),
            coordinating: Mutex::default(),
            copying: tokio::sync::Mutex::new(()),
            caught_up: catch_up::CaughtUp::default(),
        }
    }

    fn coordinating(&self) -> std::sync::MutexGuard<'_, Coordinating> {
        self.coordinating.lock().expect("coordinating lock")
    }

    /// This node awaits the allocation sent as `request` until the guard is dropped.
    pub fn allocating(&self, request: u64) -> Allocating<'_> {
        count_up(&mut self.coordinating().allocating, request);
        Allocating {
            node: self,
            request,
        }
    }

    /// This node's heartbeat: the open epochs it works on and the allocations it awaits,
    /// with the metadata index it had applied before looking (see
    /// [`tessera_meta::wire::Heartbeat::applied_index`]).
    pub fn heartbeat(&self) -> tessera_meta::wire::Heartbeat {
        let applied_index = self.meta.view().applied_index;
        let coordinating = self.coordinating();
        tessera_meta::wire::Heartbeat {
            node_id: self.id,
            working_on: coordinating.epochs.keys().copied().collect(),
            allocating: coordinating.allocating.keys().copied().collect(),
            applied_index,
        }
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The failure detector, for the node's heartbeat and leader loops.
    pub fn detector(&self) -> MutexGuard<'_, FailureDetector> {
        self.detector.lock().expect("failure detector lock")
    }

    /// Reports a dropped connection to `node`: the leader checks it at once.
    pub fn suspect(&self, node: NodeId) {
        self.detector().suspect(node);
        self.suspected.notify_waiters();
    }

    /// Makes `id` suspect and waits for the metadata leader's verdict (it probes the node
    /// at once, or its failure detector times it out). True once the metadata counts `id`
    /// failed.
    pub async fn confirm_failed(&self, id: NodeId) -> bool {
        self.suspect(id);
        // Long enough for a new leader's detector when the dead node led the metadata.
        let patience = (self.settings.failure_timeout * 4).max(Duration::from_secs(10));
        self.meta.wait_until_failed(id, patience).await;
        self.meta
            .view()
            .state
            .nodes
            .get(&id)
            .is_none_or(|n| !n.alive)
    }

    /// Resolves once this node's metadata counts `id` failed (at once if it does already).
    /// A call still waiting on `id` races this and gives up when it resolves: the cluster
    /// has failed `id`'s partitions over by then, so waiting out the connection's own
    /// timeout (keep-alive pings, seconds more on a silent network) only delays the retry.
    pub async fn declared_failed(&self, id: NodeId) {
        let failed =
            |view: &Arc<tessera_meta::MetaView>| view.state.nodes.get(&id).is_none_or(|n| !n.alive);
        while !self
            .meta
            .wait_until(Duration::from_secs(3600), failed)
            .await
        {
            // Not failed after an hour, or the metadata stopped answering at once (this
            // node is shutting down): never a busy loop on the runtime's threads.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Sends `request`'s prepare stream to `peer` and waits for its reply, giving up when
    /// the cluster declares `peer` failed (a transport error, as for a lost connection) or
    /// when `peer` makes no progress for as long as `patience` allows
    /// ([`PrepareFailed::Stalled`], see [`stall`]): either way the cluster goes on without
    /// it, rather than hold the epoch and its tables' lease open.
    pub async fn prepare_within_deadlines(
        &self,
        what: &'static str,
        peer: NodeId,
        request: &wire::PrepareRequest,
        rows: wire::PrepareRows,
        patience: Patience,
    ) -> std::result::Result<wire::PrepareReply, PrepareFailed> {
        use tessera_net::CallError;
        let progress = stall::Progress::new();
        let call = async {
            let Some(addr) = self.meta.addr_of(peer) else {
                return Err(CallError::Transport(format!("node {peer} has no address")).into());
            };
            use futures::FutureExt;
            let clients = &self.clients;
            let sent = match rows {
                wire::PrepareRows::Batches(batches) => {
                    wire::prepare(clients, &addr, request, progress.watch(batches)).boxed()
                }
                wire::PrepareRows::AsLogged(messages) => {
                    wire::prepare_as_logged(clients, &addr, request, progress.watch(messages))
                        .boxed()
                }
            };
            Ok(sent.await?)
        };
        self.within_deadlines(what, peer, request, &progress, call, patience)
            .await
    }

    /// Logs `request`'s rows here, as the head of their log shipping would on receiving
    /// them ([`log_shipping::receive`]), under the same deadlines as a peer's prepare: this
    /// node's own disk may hang in an fsync too, and then the coordinator goes on without
    /// it. The inner error is this node's refusal of the rows.
    pub async fn prepare_here_within_deadlines(
        self: &Arc<Self>,
        request: &wire::PrepareRequest,
        batches: Vec<arrow::array::RecordBatch>,
        patience: Patience,
    ) -> std::result::Result<Result<wire::PrepareReply>, PrepareFailed> {
        let progress = stall::Progress::new();
        let rows =
            futures::stream::iter(batches.into_iter().map(Ok::<_, std::convert::Infallible>));
        let call =
            async { Ok(log_shipping::receive(self, request.clone(), progress.watch(rows)).await) };
        let me = self.id;
        self.within_deadlines("a prepare", me, request, &progress, call, patience)
            .await
    }

    /// Runs `call`, a prepare stream sent to `peer` (or logged here), giving up when the
    /// cluster declares `peer` failed or when it makes no progress for as long as
    /// `patience` allows.
    async fn within_deadlines<T>(
        &self,
        what: &'static str,
        peer: NodeId,
        request: &wire::PrepareRequest,
        progress: &stall::Progress,
        call: impl std::future::Future<Output = std::result::Result<T, PrepareFailed>>,
        patience: Patience,
    ) -> std::result::Result<T, PrepareFailed> {
        use tessera_net::CallError;
        let given_up = async {
            if let Patience::LastCopy { usual, .. } = patience {
                let stalled = progress.stalled(usual).await;
                tracing::warn!(
                    epoch = %request.epoch,
                    peer = peer.0,
                    stalled_s = stalled.as_secs_f64(),
                    "{what}: a node the publish cannot go without (too few current replicas would be left) made no progress; waiting for it as long as the epoch may stay open (failure.open_epoch_timeout_ms)"
                );
            }
            progress.stalled(patience.limit()).await
        };
        tokio::select! {
            reply = call => reply,
            // Declared failed: its partitions are failed over, whether or not the
            // connection has noticed yet.
            () = self.declared_failed(peer) => Err(CallError::Transport(format!(
                "node {peer} was declared failed while logging the rows"
            )).into()),
            stalled = given_up => {
                tracing::warn!(
                    epoch = %request.epoch,
                    peer = peer.0,
                    stalled_s = stalled.as_secs_f64(),
                    "{what}: a node the cluster counts alive made no progress; giving up on it"
                );
                Err(PrepareFailed::Stalled {
                    peer,
                    what,
                    epoch: request.epoch,
                    stalled_s: stalled.as_secs_f64(),
                })
            }
        }
    }

    /// Resolves when some node becomes suspect.
    pub async fn suspicion(&self) {
        self.suspected.notified().await
    }

    /// Runs blocking store work (file I/O, fsync) off the async threads.
    pub async fn on_store<T: Send + 'static>(
        &self,
        what: &'static str,
        work: impl FnOnce(&Store) -> std::result::Result<T, tessera_storage::StorageError>
            + Send
            + 'static,
    ) -> Result<T> {
        let store = self.store.clone();
        Ok(tokio::task::spawn_blocking(move || work(&store))
            .await
            .map_err(ReplicationError::task(what))??)
    }

    /// Records the components last announced to the standbys of one partition; false if
    /// they are the same as last time (nothing to announce).
    pub fn note_shipped(
        &self,
        table: &str,
        partition: PartitionId,
        hashes: Vec<ComponentHash>,
    ) -> bool {
        let mut shipped = self.shipped.lock().expect("shipped lock");
        let key = (table.to_string(), partition);
        if shipped.get(&key) == Some(&hashes) {
            return false;
        }
        shipped.insert(key, hashes);
        true
    }
}
