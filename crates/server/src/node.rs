//! One node: its store, its member of the metadata group, its RPC server, and the loops
//! that keep it in the cluster (heartbeats, failure detection, membership, checkpoints).

mod membership;

use crate::error::{ClusterError, Result};
use crate::failover::{Check, FailureDetector, Member};
use crate::meta::log_store::LogStore;
use crate::meta::network::Network;
use crate::meta::quorum_check::{self, QuorumPolicy, StepDown};
use crate::meta::state_machine::StateMachine;
use crate::meta::MetaClient;
use crate::meta::{MetaCommand, Raft};
use crate::rpc::{
    CallError, Clients, Heartbeat, Identity, Refusal, ACTION_HEARTBEAT, ACTION_HELLO,
    PROTOCOL_VERSION,
};
use crate::NodeId;
use openraft::BasicNode;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_common::tls::{CertIdentity, MutualTls};
use tessera_common::{Epoch, NodeConfig};
use tessera_replication::{Replication, Settings};
use tessera_storage::{Store, StoreConfig};

use crate::startup::{
    check_data_identity, check_peers, next_incarnation, refuse_if_data_lost, request_replacement,
    write_data_identity, REPLACING_FILE,
};
pub use crate::startup::{ACTION_REPLACE_NODE, DATA_FORMAT_VERSION, KEYS_DIR};

/// The longest a metadata follower waits without hearing from a leader before it stands
/// for election (the shortest is half of it). A lost leader is replaced within about
/// this, well inside the failure timeout, so the new leader's failure detection starts
/// soon after the old one's stopped.
pub const ELECTION_TIMEOUT_MAX_MS: u64 = 600;

/// Checkpoints one after another, at most, while rows keep the store wanting more.
const BACK_TO_BACK_CHECKPOINTS: usize = 4;

/// The shortest and longest wait after a failed rebalance before the next is planned.
const REBALANCE_BACKOFF: Duration = Duration::from_secs(1);
const REBALANCE_BACKOFF_MAX: Duration = Duration::from_secs(60);

pub struct Node {
    pub config: NodeConfig,
    pub store: Arc<Store>,
    /// The metadata group: reads, writes through the leader, this node's Raft member.
    pub meta: MetaClient,
    pub clients: Arc<Clients>,
    /// Distributed execution's handle: the exchanges and channels running here, and what
    /// they use of this node.
    pub exec: Arc<tessera_exec::Exec>,
    /// Write-ahead lineage: the reading-order log, its committer and the spools.
    pub lineage: Arc<tessera_recovery::WriteAheadLineage>,
    checkpointing: AtomicBool,
    rebalancing: AtomicBool,
    /// The leader's archive duty is running.
    archiving: AtomicBool,
    /// This process is announced to the metadata ([`MetaCommand::Started`]): until then it
    /// takes no rows, so a node the metadata has never seen run holds none.
    announced: tokio::sync::watch::Sender<bool>,
    /// What the archive duty could not do on its last round, and why.
    pub archive_waiting: std::sync::Mutex<Vec<String>>,
    protocol: u32,
    /// The replication protocols' handle: publish, shipping, failure detection, copies.
    pub replication: Arc<Replication>,
    /// Mutual TLS on the internal port: the cluster's CA and this node's certificate;
    /// `None` under `insecure = true`.
    pub mtls: Option<MutualTls>,
    /// Table statistics asked of other nodes, for planning tables this node holds none of.
    pub remote_statistics: crate::table_statistics::RemoteStatistics,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.config.node_id)
            .finish()
    }
}

impl Node {
    /// Starts a node: checks its data directory and its peers, opens its store, joins the
    /// metadata group and serves RPC on `config.listen` until the process ends.
    pub async fn start(config: NodeConfig) -> Result<Arc<Node>> {
        Self::start_with_protocol(config, PROTOCOL_VERSION).await
    }

    /// As [`Node::start`], speaking a given protocol version (tests of version checks).
    pub async fn start_with_protocol(mut config: NodeConfig, protocol: u32) -> Result<Arc<Node>> {
        let identity = check_data_identity(&config.data_dir, &config)?;
        let fresh = identity.is_none();
        // `--replace` is remembered in the data directory until the cluster has taken the
        // node back (a process killed on the way finishes the replacement when restarted),
        // and in its identity after: a replacement never founds a metadata group.
        let replacing = config.data_dir.join(REPLACING_FILE);
        if identity == Some(true) || (fresh && replacing.exists()) {
            config.replace = true;
        }
        let incarnation = next_incarnation(&config.data_dir)?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| ClusterError::Listen {
                addr: config.listen.to_string(),
                reason: e.to_string(),
            })?;
        let pg_listener = bind_optional(config.pg_listen, "pg_listen").await?;
        let http_listener = bind_optional(config.http_listen, "http_listen").await?;
        let flightsql_listener = bind_optional(config.flightsql_listen, "flightsql_listen").await?;
        let tls = read_tls(&config)?;
        let pg_tls = tls
            .as_ref()
            .map(|(cert, key)| tessera_common::tls::tls_acceptor(cert, key))
            .transpose()
            .map_err(ClusterError::Tls)?;
        let console_tls = pg_tls.clone();
        let mtls = read_mtls(&config)?;
        let clients = Arc::new(
            Clients::new(&config.cluster_id, protocol)
                .with_tls(mtls.as_ref())
                .as_node(config.node_id),
        );
        let reachable = check_peers(&config, &clients, protocol).await?;
        if fresh {
            if config.replace {
                std::fs::write(&replacing, b"").map_err(|e| ClusterError::DataDir {
                    dir: config.data_dir.display().to_string(),
                    reason: format!("recording the replacement: {e}"),
                })?;
                request_replacement(&config, &clients).await?;
            } else {
                refuse_if_data_lost(&config, &clients, &reachable).await?;
            }
            write_data_identity(&config.data_dir, &config)?;
            let _ = std::fs::remove_file(&replacing);
        } else if config.replace && identity == Some(false) {
            return Err(ClusterError::DataDir {
                dir: config.data_dir.display().to_string(),
                reason: "--replace brings back a node whose data is gone, but this data directory holds the node's data: start it without --replace".into(),
            });
        }

        let store_config = StoreConfig::with_settings(config.partitions, &config.store);
        let store_dir = config.data_dir.join("store");
        let store = tokio::task::spawn_blocking(move || Store::open(&store_dir, store_config))
            .await
            .map_err(|e| ClusterError::Task {
                what: "opening the store",
                reason: e.to_string(),
            })??;
        if store.ring().partition_count() != config.partitions {
            return Err(ClusterError::DataDir {
                dir: config.data_dir.display().to_string(),
                reason: format!(
                    "holds {} partitions, the configuration says {}",
                    store.ring().partition_count(),
                    config.partitions
                ),
            });
        }

        let raft_dir = config.data_dir.join("raft");
        let data_error = |e: std::io::Error| ClusterError::DataDir {
            dir: raft_dir.display().to_string(),
            reason: e.to_string(),
        };
        let (state_machine, meta) =
            StateMachine::open(config.node_id, &raft_dir, store.clone()).map_err(data_error)?;
        let log_store = LogStore::open(&raft_dir)
            .map_err(data_error)?
            .purge_only_behind(state_machine.snapshot_on_disk());
        let raft_config = openraft::Config {
            cluster_name: config.cluster_id.clone(),
            // Elections finish well inside the 2 s failure-detection budget.
            heartbeat_interval: 100,
            election_timeout_min: ELECTION_TIMEOUT_MAX_MS / 2,
            election_timeout_max: ELECTION_TIMEOUT_MAX_MS,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(1000),
            max_in_snapshot_log_to_keep: 200,
            ..Default::default()
        };
        let raft_config = Arc::new(raft_config.validate().map_err(ClusterError::raft)?);
        let step_down = Arc::new(StepDown::default());
        let network = Network {
            clients: clients.clone(),
            step_down: step_down.clone(),
        };
        let raft = Raft::new(
            config.node_id,
            raft_config,
            network,
            log_store,
            state_machine,
        )
        .await
        .map_err(ClusterError::raft)?;
        tokio::spawn(quorum_check::watch(
            raft.clone(),
            step_down,
            QuorumPolicy::for_election_timeout(Duration::from_millis(ELECTION_TIMEOUT_MAX_MS)),
        ));

        let peers = config
            .peers
            .iter()
            .map(|p| (p.id, p.addr.to_string()))
            .collect();
        let meta = MetaClient::new(config.node_id, raft, meta, clients.clone(), peers);
        let replication = Arc::new(Replication::new(
            incarnation,
            store.clone(),
            meta.clone(),
            clients.clone(),
            Settings {
                failure_timeout: config.failure_timeout(),
                rereplicate_after: config.rereplicate_after(),
                delta_recovery: config.replicas.delta_recovery,
                open_epoch_timeout: config.open_epoch_timeout(),
                progress_timeout: config.progress_timeout(),
                keys_dir: config.data_dir.join(KEYS_DIR),
                version_ids: config.replicas.version_ids,
                min_copies: config.replicas.min_copies,
            },
        ));
        let lineage = tessera_recovery::WriteAheadLineage::start(
            meta.clone(),
            clients.clone(),
            config.data_dir.join("spool"),
            Duration::from_millis(config.exec.spool_start_timeout_ms),
        );
        let mut exec = tessera_exec::Exec::new(
            store.clone(),
            meta.clone(),
            clients.clone(),
            replication.clone(),
            lineage.clone(),
            config.exec.clone(),
        );
        {
            let dir = config.data_dir.join("cache");
            let cache = tessera_exec::cache::ComponentCache::open(&dir, config.exec.cache_bytes)
                .map_err(|e| ClusterError::DataDir {
                    dir: dir.display().to_string(),
                    reason: format!("opening the component cache: {e}"),
                })?;
            exec = exec.with_cache(cache, config.role.is_compute());
        }
        {
            let dir = config.data_dir.join("spill");
            let memory = tessera_exec::memory::NodeMemory::new(
                config.node_id,
                config.exec.memory_limit_bytes,
                &dir,
            )
            .map_err(|e| ClusterError::DataDir {
                dir: dir.display().to_string(),
                reason: format!("preparing the spill directory: {e}"),
            })?;
            exec = exec.with_memory(memory);
        }
        let exec = Arc::new(exec);
        let node = Arc::new(Node {
            config,
            mtls,
            remote_statistics: Default::default(),
            store,
            clients,
            exec,
            lineage,
            meta,
            checkpointing: AtomicBool::new(false),
            rebalancing: AtomicBool::new(false),
            archiving: AtomicBool::new(false),
            announced: tokio::sync::watch::Sender::new(false),
            archive_waiting: Default::default(),
            protocol,
            replication,
        });
        crate::server::serve(node.clone(), listener);
        if let Some(listener) = pg_listener {
            tokio::spawn(tessera_pg::serve(
                listener,
                Arc::new(crate::backend::NodeSessions::new(node.clone())),
                tessera_pg::PgLimits {
                    max_connections: node.config.pg_max_connections,
                    tls: pg_tls,
                },
            ));
        }
        if let Some(listener) = flightsql_listener {
            tokio::spawn(tessera_flightsql::serve(
                listener,
                Arc::new(crate::backend::NodeSessions::new(node.clone())),
                node.config.flightsql_max_connections,
                tls,
            ));
        }
        if let Some(listener) = http_listener {
            tokio::spawn(tessera_console::serve(
                listener,
                Arc::new(crate::console::NodeConsole::new(node.clone())),
                console_tls,
            ));
        }
        node.initialize_if_founder().await?;
        tokio::spawn(node.clone().heartbeat_loop());
        tokio::spawn(node.clone().duty_loop());
        tokio::spawn(node.clone().registration_loop());
        tokio::spawn(crate::scrub::scrub_loop(node.clone()));
        tracing::info!(node = node.config.node_id.0, listen = %node.config.listen, "node started");
        Ok(node)
    }

    /// Why this node's disk can no longer be trusted, if it cannot: an fsync failed (of its
    /// log, a component, a checkpoint or the metadata log), or a write to its log did, or
    /// an fsync has hung past `failure.disk_stall_ms`. After that it must acknowledge
    /// nothing more (fsyncgate): the process should stop, and a restart recovers from
    /// what is durable.
    pub fn disk_failure(&self) -> Option<String> {
        tessera_common::disk::fatal_error()
            .or_else(|| self.store.poisoned_by())
            .or_else(|| tessera_common::disk::stalled_sync(self.config.disk_stall()))
    }

    /// Stops taking part in the metadata group (a clean stop; the store needs nothing).
    pub async fn shutdown(&self) {
        if let Err(error) = self.meta.raft().shutdown().await {
            tracing::warn!(%error, "metadata shutdown");
        }
    }

    pub fn id(&self) -> NodeId {
        self.config.node_id
    }

    pub fn protocol(&self) -> u32 {
        self.protocol
    }

    pub fn incarnation(&self) -> u64 {
        self.replication.incarnation()
    }

    /// Makes `id` suspect and waits for the metadata leader's verdict; see
    /// [`Replication::confirm_failed`].
    pub async fn confirm_failed(&self, id: NodeId) -> bool {
        self.replication.confirm_failed(id).await
    }

    pub fn identity(&self) -> Identity {
        Identity {
            node_id: self.id(),
            cluster_id: self.config.cluster_id.clone(),
            protocol: self.protocol,
        }
    }

    /// The lowest-id voter of a fresh cluster proposes the founding membership.
    async fn initialize_if_founder(&self) -> Result<()> {
        let voters = self.config.voter_ids();
        // A replacement joins the group that exists; it never founds one.
        if self.config.replace
            || voters.iter().next() != Some(&self.id())
            || self
                .meta
                .raft()
                .is_initialized()
                .await
                .map_err(ClusterError::raft)?
        {
            return Ok(());
        }
        let members: BTreeMap<NodeId, BasicNode> = voters
            .iter()
            .filter_map(|id| self.config.peer(*id))
            .map(|p| (p.id, BasicNode::new(p.addr.to_string())))
            .collect();
        match self.meta.raft().initialize(members).await {
            Ok(()) => Ok(()),
            Err(openraft::error::RaftError::APIError(
                openraft::error::InitializeError::NotAllowed(_),
            )) => Ok(()),
            Err(e) => Err(ClusterError::raft(e)),
        }
    }

    fn detector(&self) -> std::sync::MutexGuard<'_, FailureDetector> {
        self.replication.detector()
    }

    /// Records a heartbeat (on the leader).
    pub fn heard_from(&self, heartbeat: &Heartbeat) {
        let now = Instant::now();
        let mut detector = self.detector();
        detector.heard_from(heartbeat.node_id, now);
        detector.renew_epochs(&heartbeat.working_on, now);
        detector.gave_up(heartbeat, &self.meta.view().state.open);
    }

    /// Reports a dropped connection to `node`: the leader checks it at once.
    pub fn suspect(&self, node: NodeId) {
        self.replication.suspect(node);
    }

    /// The members as the failure detector sees them.
    fn members(state: &crate::meta::MetaState) -> Vec<Member> {
        state
            .nodes
            .values()
            .filter(|n| !n.decommissioned)
            .map(|n| Member {
                id: n.id,
                alive: n.alive,
            })
            .collect()
    }

    async fn heartbeat_loop(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(self.config.heartbeat());
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = self.replication.suspicion() => {}
            }
            let heartbeat = self.replication.heartbeat();
            match self.meta.leader() {
                Some(leader) if leader == self.id() => self.heard_from(&heartbeat),
                Some(leader) => {
                    if let Some(addr) = self.meta.addr_of(leader) {
                        let suspects: Vec<NodeId> =
                            self.detector().take_suspects().into_iter().collect();
                        let _: std::result::Result<std::result::Result<(), Refusal>, CallError> =
                            self.clients
                                .action(
                                    &addr,
                                    ACTION_HEARTBEAT,
                                    (heartbeat, suspects),
                                    self.config.heartbeat(),
                                )
                                .await;
                    }
                }
                None => {}
            }
        }
    }

    /// Leader duties (bootstrap, membership, failure detection) and local checkpoints.
    async fn duty_loop(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(Duration::from_millis(100));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut was_leader = false;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = self.replication.suspicion() => {}
            }
            let leading = self.meta.is_leader();
            if leading && !was_leader {
                let members = Self::members(&self.meta.view().state);
                self.detector()
                    .became_leader(self.id(), &members, Instant::now());
            }
            was_leader = leading;
            if leading {
                if let Err(error) = self.lead().await {
                    tracing::debug!(%error, "leader duty failed; retrying");
                }
            }
            self.maybe_checkpoint();
        }
    }

    /// A node missing from the metadata (one joining a running cluster) asks to be added,
    /// until it sees itself listed; then it announces this process (see
    /// [`MetaCommand::Started`]).
    async fn registration_loop(self: Arc<Self>) {
        let voter = self.config.voter_ids().contains(&self.id());
        let mut attempts: u64 = 0;
        loop {
            let view = self.meta.view();
            if view.state.nodes.contains_key(&self.id()) {
                break;
            }
            // A founding voter is listed by the bootstrap entry; others must ask.
            if view.state.is_bootstrapped() || !voter {
                let command = MetaCommand::RegisterNode {
                    id: self.id(),
                    addr: self.config.listen.to_string(),
                    compute: self.config.role.is_compute(),
                };
                match self.meta.write(command).await {
                    Ok(_) => tracing::info!("registered with the cluster"),
                    // Said aloud at first and then every ten seconds: a node that cannot
                    // join (a wrong certificate, a wrong address) must say why.
                    Err(error) if attempts % 20 == 0 => {
                        tracing::warn!(%error, "could not register with the cluster yet")
                    }
                    Err(error) => tracing::info!(%error, "could not register with the cluster yet"),
                }
                attempts += 1;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let announcement = MetaCommand::Started {
            id: self.id(),
            incarnation: self.incarnation(),
        };
        while let Err(error) = self.meta.write(announcement.clone()).await {
            tracing::info!(%error, "could not announce this process yet");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.announced.send_replace(true);
        tracing::info!(incarnation = self.incarnation(), "process announced");
    }

    /// Waits (at most `patience`) until this process is announced to the metadata. Rows
    /// (prepares, copies) are taken only after it, so that a node the metadata has never
    /// seen run holds none: one that comes back with a new data directory then either
    /// never held any, or is known to have run and refuses to start (see
    /// [`ClusterError::DataLost`]).
    pub async fn wait_announced(&self, patience: Duration) -> std::result::Result<(), String> {
        let mut announced = self.announced.subscribe();
        let waited = tokio::time::timeout(patience, announced.wait_for(|a| *a))
            .await
            .map(|r| r.is_ok());
        match waited {
            Ok(true) => Ok(()),
            _ => Err(format!(
                "node {} has not yet announced its process to the metadata (after {patience:?}): it takes no rows until then",
                self.id()
            )),
        }
    }

    async fn lead(self: &Arc<Self>) -> Result<()> {
        let state = self.meta.view().state.clone();
        if !state.is_bootstrapped() {
            let nodes = self
                .config
                .peers
                .iter()
                .map(|p| (p.id, p.addr.to_string()))
                .collect();
            self.meta
                .write_as_leader(MetaCommand::Bootstrap {
                    cluster_id: self.config.cluster_id.clone(),
                    partition_count: self.config.partitions,
                    replication: self.config.replication,
                    hot_standby: self.config.replicas.hot_standby,
                    nodes,
                })
                .await?;
            return Ok(());
        }
        // Every member takes part in Raft: voters as configured, the rest as learners.
        let metrics = self.meta.raft().metrics().borrow().clone();
        let in_raft: BTreeSet<NodeId> = metrics
            .membership_config
            .nodes()
            .map(|(id, _)| *id)
            .collect();
        for node in state
            .nodes
            .values()
            .filter(|n| !n.decommissioned && !n.leaving)
        {
            if !in_raft.contains(&node.id) {
                self.meta
                    .raft()
                    .add_learner(node.id, BasicNode::new(node.addr.clone()), false)
                    .await
                    .map_err(ClusterError::raft)?;
            }
        }
        self.finish_joint_membership(&metrics).await;
        self.promote_caught_up_voters(&state, &metrics).await?;
        self.move_partitions(&state, &metrics).await?;
        self.maintain_archive(&state);
        // Failure detection.
        let checks = self
            .detector()
            .check(self.id(), &Self::members(&state), Instant::now());
        for (id, check) in checks {
            let node = &state.nodes[&id];
            let alive = match check {
                Check::Alive => true,
                Check::Failed => false,
                Check::Probe => self.probe(id, &node.addr).await,
            };
            if alive != node.alive {
                tracing::warn!(node = id.0, alive, "node liveness changed");
                self.meta
                    .write_as_leader(MetaCommand::SetLiveness { id, alive })
                    .await?;
                if !alive {
                    // Declaring a node failed promotes other replicas of its partitions.
                    tessera_common::metrics::metrics().failovers.inc();
                }
            }
        }
        // Epochs whose coordinator, alive, gave them up (its commit or abort failed, its
        // task ended): aborted now, not after the open-epoch timeout. Then epochs left open
        // too long, whoever coordinates them.
        let open: BTreeSet<Epoch> = state.open.keys().copied().collect();
        let timeout = self.config.open_epoch_timeout();
        let mut to_abort: Vec<(Epoch, String)> = self
            .detector()
            .take_given_up(&open)
            .into_iter()
            .map(|(epoch, coordinator)| (epoch, format!(
                "its coordinator, node {coordinator}, is alive but no longer working on it (its commit or abort failed, or its task ended)"
            )))
            .collect();
        let overdue = self.detector().overdue_epochs(&open, Instant::now());
        to_abort.extend(overdue.into_iter().map(|epoch| {
            (
                epoch,
                format!(
                    "it was open for {timeout:?} without its coordinator committing or aborting it"
                ),
            )
        }));
        for (epoch, reason) in to_abort {
            tracing::warn!(%epoch, %reason, "aborting an open epoch");
            self.meta
                .write_as_leader(MetaCommand::AbortEpoch { epoch, reason })
                .await?;
        }
        Ok(())
    }

    /// Membership changes: rebalance onto joined nodes and off leaving ones, then retire
    /// nodes left holding nothing.
    async fn move_partitions(
        self: &Arc<Self>,
        state: &crate::meta::MetaState,
        metrics: &openraft::RaftMetrics<NodeId, BasicNode>,
    ) -> Result<()> {
        let lost = self.lost_nodes(state);
        if crate::rebalance::wanted_map(state, &lost).is_some()
            && !self.rebalancing.swap(true, Ordering::SeqCst)
        {
            let node = self.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                if let Err(error) = crate::rebalance::rebalance(&node.replication, &lost).await {
                    // Each attempt leases every table; back off so publishes get through, as
                    // long as the failed attempt took (a copy into a node that stalls holds
                    // the leases until it is given up), so they get at least half the time.
                    let backoff = started
                        .elapsed()
                        .clamp(REBALANCE_BACKOFF, REBALANCE_BACKOFF_MAX);
                    tracing::warn!(%error, backoff_s = backoff.as_secs_f64(), "rebalance failed; retrying after the backoff");
                    node.back_off_rebalance(backoff).await;
                }
                node.rebalancing.store(false, Ordering::SeqCst);
            });
        }
        for node in state
            .nodes
            .values()
            .filter(|n| n.leaving && !n.decommissioned)
        {
            if state
                .map
                .partitions
                .iter()
                .any(|p| p.replicas.contains(&node.id))
            {
                continue;
            }
            self.meta
                .write_checked_as_leader(MetaCommand::Decommission { id: node.id })
                .await?;
            let voters: BTreeSet<NodeId> =
                metrics.membership_config.membership().voter_ids().collect();
            if !voters.contains(&node.id) {
                self.meta
                    .raft()
                    .change_membership(
                        openraft::ChangeMembers::RemoveNodes(BTreeSet::from([node.id])),
                        false,
                    )
                    .await
                    .map_err(ClusterError::raft)?;
            }
            tracing::info!(node = node.id.0, "node decommissioned");
        }
        Ok(())
    }

    /// Waits out a failed rebalance's `backoff` (at least [`REBALANCE_BACKOFF`]), which
    /// leaves publishes the time the attempt held their leases. Cut short once a partition
    /// takes no publishes until a replica catches up: then no publish gains from the wait,
    /// and only the next rebalance lets any through (fault run 5301: a 33 s backoff after
    /// a rebalance failed on a wiped node kept every table's writes refused 30 s past the
    /// heal, the cluster whole again).
    async fn back_off_rebalance(&self, backoff: Duration) {
        let until = Instant::now() + backoff;
        loop {
            let now = Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep(REBALANCE_BACKOFF.min(until - now)).await;
            let state = self.meta.view().state.clone();
            if let Some(partition) = tessera_replication::publish::partition_refusing_publishes(
                &state,
                self.config.replicas.min_copies,
            ) {
                tracing::info!(%partition, "rebalance backoff cut short: a partition takes no publishes until a replica catches up");
                return;
            }
        }
    }

    /// The archive's duties, off the heartbeat's path: archive the tagged epochs retention
    /// has passed, and rebuild the fragments of nodes gone too long on live ones.
    fn maintain_archive(self: &Arc<Self>, state: &crate::meta::MetaState) {
        let lost = self.lost_nodes(state);
        let fragments_lost = state
            .archived_components()
            .iter()
            .any(|c| c.fragments.iter().any(|f| lost.contains(&f.node)));
        if state.archive_due().is_empty() && !fragments_lost {
            self.archive_waiting
                .lock()
                .expect("archive waiting lock")
                .clear();
            return;
        }
        if self.archiving.swap(true, Ordering::SeqCst) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let code = &node.config.archive;
            let waiting = tessera_replication::archive::archive_due(
                &node.replication,
                code.data_fragments,
                code.parity_fragments,
            )
            .await;
            *node.archive_waiting.lock().expect("archive waiting lock") = waiting;
            tessera_replication::archive::rereplicate_fragments(&node.replication, &lost).await;
            node.archiving.store(false, Ordering::SeqCst);
        });
    }

    /// Nodes failed for longer than `rereplicate_after`: their replicas are rebuilt on the
    /// other nodes.
    fn lost_nodes(&self, state: &crate::meta::MetaState) -> BTreeSet<NodeId> {
        let failed = state
            .nodes
            .values()
            .filter(|n| !n.alive && !n.decommissioned)
            .map(|n| n.id)
            .collect();
        self.detector().lost(&failed, Instant::now())
    }

    /// Takes node `id` back with its data gone (on the metadata leader; others forward):
    /// removes it from the metadata group, so its empty log never counts towards a quorum,
    /// and marks every replica it held stale from the first epoch. The leader's duties add
    /// it back as a learner once it runs, copy its partitions to it whole, and make it a
    /// voter again (if configured as one) once it has caught up.
    pub async fn replace(&self, id: NodeId) -> Result<()> {
        let leader = self.meta.leader();
        if leader != Some(self.id()) {
            let no_leader = || ClusterError::Meta(tessera_meta::MetaError::NoLeader);
            let leader = leader.ok_or_else(no_leader)?;
            let addr = self.meta.addr_of(leader).ok_or_else(no_leader)?;
            let reply: std::result::Result<std::result::Result<(), Refusal>, CallError> = self
                .clients
                .action(&addr, ACTION_REPLACE_NODE, id, Duration::from_secs(30))
                .await;
            return match reply {
                Ok(Ok(())) => Ok(()),
                Ok(Err(refusal)) => Err(ClusterError::Meta(tessera_meta::MetaError::Refused(
                    format!("{refusal:?}"),
                ))),
                Err(error) => Err(ClusterError::Meta(tessera_meta::MetaError::Refused(
                    error.to_string(),
                ))),
            };
        }
        let metrics = self.meta.raft().metrics().borrow().clone();
        let membership = metrics.membership_config.membership().clone();
        if membership.voter_ids().any(|v| v == id) {
            self.meta
                .raft()
                .change_membership(
                    openraft::ChangeMembers::RemoveVoters(BTreeSet::from([id])),
                    false,
                )
                .await
                .map_err(ClusterError::raft)?;
        }
        let metrics = self.meta.raft().metrics().borrow().clone();
        if metrics.membership_config.nodes().any(|(n, _)| *n == id) {
            self.meta
                .raft()
                .change_membership(
                    openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id])),
                    false,
                )
                .await
                .map_err(ClusterError::raft)?;
        }
        // Refused if it was the only up-to-date replica of a partition: then it must not
        // start empty as though it held those rows.
        match self
            .meta
            .write_checked_as_leader(MetaCommand::ReplaceNode { id })
            .await
        {
            Err(tessera_meta::MetaError::Refused(reason)) => {
                Err(ClusterError::Meta(tessera_meta::MetaError::Refused(
                    format!("{}: {reason}", crate::startup::REPLACEMENT_REFUSED),
                )))
            }
            other => other.map(|_| ()).map_err(ClusterError::from),
        }
    }

    /// Asks a node to leave: refuses metadata voters, whose departure would change the
    /// quorum.
    pub async fn decommission(&self, id: NodeId) -> Result<()> {
        let metrics = self.meta.raft().metrics().borrow().clone();
        if metrics
            .membership_config
            .membership()
            .voter_ids()
            .any(|v| v == id)
        {
            return Err(ClusterError::VoterCannotLeave { node: id });
        }
        self.meta.write(MetaCommand::Leave { id }).await?;
        Ok(())
    }

    /// Asks a suspected node who it is; a prompt answer clears the suspicion.
    async fn probe(&self, id: NodeId, addr: &str) -> bool {
        let reply: std::result::Result<Identity, CallError> = self
            .clients
            .action(addr, ACTION_HELLO, (), Duration::from_millis(300))
            .await;
        let alive = reply.is_ok_and(|identity| identity.node_id == id);
        self.detector().probed(id, alive, Instant::now());
        alive
    }

    /// Starts a checkpoint on a task of its own when the store wants one and none is under
    /// way.
    fn maybe_checkpoint(self: &Arc<Self>) {
        if !self.store.wants_checkpoint() || self.checkpointing.swap(true, Ordering::SeqCst) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            // Rows that came while it flushed may want another at once, rather than at the
            // duty loop's next tick, behind its leader duties (slow under load). A few in
            // a row at most: the next tick takes over from there.
            for _ in 0..BACK_TO_BACK_CHECKPOINTS {
                if let Err(error) = crate::shipping::checkpoint(&node.replication).await {
                    tracing::error!(%error, "checkpoint failed");
                    break;
                }
                if !node.store.wants_checkpoint() {
                    break;
                }
            }
            node.checkpointing.store(false, Ordering::SeqCst);
        });
    }

    /// Flushes memory to components now and ships them to the standbys: a standby asks
    /// this of its primary before it truncates its own log. (Not a checkpoint, which would
    /// coordinate with this node's own primaries in turn, and could wait on the asker.)
    pub async fn flush_and_ship(self: &Arc<Self>) -> Result<()> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.flush())
            .await
            .map_err(|e| ClusterError::Task {
                what: "flushing the store",
                reason: e.to_string(),
            })??;
        crate::shipping::announce(&self.replication).await;
        Ok(())
    }

    /// [`Store::settle`](tessera_storage::Store::settle) (a flush, then every partition
    /// this node holds merged down to one component, but those it keeps as a cold
    /// standby), and ships the ones it leads to their cold standbys, which take them in
    /// place of their own copies.
    pub async fn settle_and_ship(self: &Arc<Self>) -> Result<()> {
        let store = self.store.clone();
        let merged = tokio::task::spawn_blocking(move || store.settle())
            .await
            .map_err(|e| ClusterError::Task {
                what: "settling the store",
                reason: e.to_string(),
            })??;
        tracing::info!(
            merged,
            "settled: every partition held here (but a cold standby's) in one component"
        );
        crate::shipping::announce(&self.replication).await;
        Ok(())
    }
}

/// Binds a client-facing port if it is configured (`what` names its setting in errors).
/// The client ports' certificate chain and key, read (and checked) at start, so a bad
/// path stops the node with its name rather than leave a port without TLS.
/// The internal port's mutual TLS files, read and checked: the certificate must be this
/// node's (name `node-<id>.tessera`).
fn read_mtls(config: &NodeConfig) -> Result<Option<MutualTls>, ClusterError> {
    let Some(settings) = &config.mtls else {
        return Ok(None);
    };
    let tls = MutualTls::load(&settings.ca, &settings.cert, &settings.key)
        .map_err(|e| ClusterError::Tls(format!("[mtls]: {e}")))?;
    if tls.identity != CertIdentity::Node(config.node_id) {
        return Err(ClusterError::Tls(format!(
            "[mtls]: {} is the certificate of {}, but this is node {} (make one with `tessera certs node --id {}`)",
            settings.cert.display(),
            tls.identity,
            config.node_id,
            config.node_id
        )));
    }
    Ok(Some(tls))
}

fn read_tls(config: &NodeConfig) -> Result<Option<(Vec<u8>, Vec<u8>)>, ClusterError> {
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return Ok(None);
    };
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|e| ClusterError::Tls(format!("{}: {e}", path.display())))
    };
    let (cert, key) = (read(cert)?, read(key)?);
    tessera_common::tls::tls_acceptor(&cert, &key).map_err(ClusterError::Tls)?;
    Ok(Some((cert, key)))
}

async fn bind_optional(
    addr: Option<std::net::SocketAddr>,
    what: &str,
) -> Result<Option<tokio::net::TcpListener>, ClusterError> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    tokio::net::TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|e| ClusterError::Listen {
            addr: format!("{addr} ({what})"),
            reason: e.to_string(),
        })
}
