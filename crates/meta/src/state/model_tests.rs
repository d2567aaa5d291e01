//! Model-based tests of the metadata state machine: seeded random sequences of the
//! commands the cluster really sends (epoch allocations and retries, commits with missed
//! replicas, aborts, liveness changes, restarts, replica moves and catch-ups, joins and
//! decommissions), with invariants checked after every step against a small model kept
//! beside it:
//! - [`MetaState::broken_invariant`]: a primary is a replica and never stale, open epochs
//!   lie above the visible epoch, open epochs' table leases are exclusive;
//! - the visible epoch never moves back, and is exactly the last epoch below which every
//!   epoch is decided;
//! - a decided epoch stays decided the same way;
//! - every committed epoch's missed replicas are marked stale from at most that epoch,
//!   until a map change clears the mark (a replica that caught up);
//! - every partition keeps a replica that is not stale (a commit that would mark the last
//!   one is refused), so it always has a complete copy to serve and copy from; a commit
//!   that would leave fewer complete replicas than it asks for (`min_copies`) is refused;
//! - a partition has a primary whenever one of its replicas is live and fresh, and it is
//!   the first such;
//! - every open epoch's coordinator is alive, in the incarnation that opened it;
//! - a retried allocation gets the same epoch; an allocation of a leased table by another
//!   request is refused as busy.

use super::*;
use arrow::datatypes::{DataType, Field, Schema};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TABLES: [&str; 3] = ["a", "b", "c"];
const PARTITIONS: u32 = 6;

fn table(name: &str) -> TableDef {
    TableDef::new(
        name,
        Schema::new(vec![Field::new("k", DataType::Int64, false)]),
        vec!["k".into()],
        None,
    )
    .expect("a valid table")
}

/// What the test knows independently of the state machine.
#[derive(Default)]
struct Model {
    committed: BTreeSet<Epoch>,
    aborted: BTreeSet<Epoch>,
    /// Stale marks that commits made, by (partition, node): the first missed epoch.
    missed: BTreeMap<(usize, NodeId), Epoch>,
    /// Requests sent per coordinator, to retry one.
    requests: BTreeMap<NodeId, u64>,
}

struct Run {
    rng: StdRng,
    state: MetaState,
    model: Model,
    index: u64,
    /// The leader's clock, which stamps every command as the metadata client does: it
    /// moves on by up to [`MAX_STEP_MS`] per command.
    clock_ms: u64,
    nodes: u64,
}

/// The most the leader's clock moves on between two commands.
const MAX_STEP_MS: u64 = 400;

impl Run {
    fn new(seed: u64) -> Run {
        let mut run = Run {
            rng: StdRng::seed_from_u64(seed),
            state: MetaState::default(),
            model: Model::default(),
            index: 0,
            clock_ms: 1,
            nodes: 5,
        };
        run.apply(MetaCommand::Bootstrap {
            cluster_id: "model".into(),
            partition_count: PARTITIONS,
            replication: 3,
            hot_standby: false,
            nodes: (1..=5).map(|id| (NodeId(id), format!("n{id}"))).collect(),
        });
        for name in TABLES {
            run.apply(MetaCommand::CreateTable { def: table(name) });
        }
        run
    }

    fn apply(&mut self, command: MetaCommand) -> MetaResponse {
        self.index += 1;
        self.clock_ms += self.rng.random_range(0..=MAX_STEP_MS);
        let stamped = MetaCommand::Stamped {
            at_ms: self.clock_ms,
            command: Box::new(command),
        };
        self.state.apply(self.index, stamped).0
    }

    fn node(&mut self) -> NodeId {
        NodeId(self.rng.random_range(1..=self.nodes))
    }

    fn some_epoch(&mut self) -> Option<Epoch> {
        let open: Vec<Epoch> = self.state.open.keys().copied().collect();
        if !open.is_empty() && self.rng.random_bool(0.8) {
            return Some(open[self.rng.random_range(0..open.len())]);
        }
        let next = self.state.next_epoch.0;
        (next > 1).then(|| Epoch(self.rng.random_range(1..next)))
    }

    /// One random step; returns what it did, for a failure's message.
    fn step(&mut self) -> String {
        match self.rng.random_range(0..100) {
            0..=29 => self.allocate(),
            30..=54 => {
                let Some(epoch) = self.some_epoch() else {
                    return "nothing to commit".into();
                };
                let mut missed = Vec::new();
                if self.rng.random_bool(0.3) {
                    let p = self.rng.random_range(0..PARTITIONS as usize);
                    let replicas = self.state.map.partitions[p].replicas.clone();
                    let node = replicas[self.rng.random_range(0..replicas.len())];
                    missed.push((PartitionId(p as u32), node));
                }
                let was_open = self.state.open.contains_key(&epoch);
                let min_copies = [None, Some(1), Some(2), Some(3)][self.rng.random_range(0..4)];
                let leaves_too_few = missed.iter().any(|(p, node)| {
                    let placement = &self.state.map.partitions[p.0 as usize];
                    let complete_after = placement
                        .replicas
                        .iter()
                        .filter(|r| *r != node && !placement.stale.contains_key(r))
                        .count();
                    complete_after < super::copies_needed(min_copies, placement.replicas.len())
                });
                let response = self.apply(MetaCommand::CommitEpoch {
                    epoch,
                    missed: missed.clone(),
                    changes: None,
                    seal: None,
                    min_copies,
                });
                if was_open && leaves_too_few {
                    assert!(
                        matches!(response, MetaResponse::Refused(_)),
                        "a commit leaving a partition with fewer complete replicas than {min_copies:?} must be refused, got {response:?}"
                    );
                    assert!(
                        self.state.open.contains_key(&epoch),
                        "a refused commit changes nothing"
                    );
                } else if was_open {
                    assert_eq!(
                        response,
                        MetaResponse::Epoch(epoch),
                        "committing open {epoch}"
                    );
                    self.model.committed.insert(epoch);
                    for (p, node) in &missed {
                        let mark = self
                            .model
                            .missed
                            .entry((p.0 as usize, *node))
                            .or_insert(epoch);
                        *mark = (*mark).min(epoch);
                    }
                }
                format!("commit {epoch} missing {missed:?}: {response:?}")
            }
            55..=64 => {
                let Some(epoch) = self.some_epoch() else {
                    return "nothing to abort".into();
                };
                let was_open = self.state.open.contains_key(&epoch);
                let response = self.apply(MetaCommand::AbortEpoch {
                    epoch,
                    reason: "model".into(),
                });
                if was_open {
                    assert_eq!(response, MetaResponse::Done);
                    self.model.aborted.insert(epoch);
                }
                format!("abort {epoch}: {response:?}")
            }
            65..=74 => {
                let id = self.node();
                let alive = self.rng.random_bool(0.6);
                let orphaned = self.epochs_of(id);
                self.apply(MetaCommand::SetLiveness { id, alive });
                if !alive {
                    self.model.aborted.extend(orphaned);
                }
                format!("node {id} alive = {alive}")
            }
            75..=79 => {
                let id = self.node();
                let current = self.state.nodes[&id].incarnation;
                let orphaned = self.epochs_of(id);
                self.apply(MetaCommand::Started {
                    id,
                    incarnation: current + 1,
                });
                self.model.aborted.extend(orphaned);
                format!("node {id} restarted as incarnation {}", current + 1)
            }
            80..=89 => self.move_or_catch_up(),
            90..=94 => {
                if self.nodes < 8 {
                    self.nodes += 1;
                    let id = NodeId(self.nodes);
                    let compute = self.rng.random_bool(0.3);
                    self.apply(MetaCommand::RegisterNode {
                        id,
                        addr: format!("n{}", id.0),
                        compute,
                    });
                    if compute {
                        // Whatever map a step proposes, a compute node is refused in it.
                        let mut map = self.state.map.clone();
                        map.partitions[0].replicas[0] = id;
                        let refused = self.state.clone().apply(
                            0,
                            MetaCommand::SetPartitionMap {
                                map,
                                rebalance: None,
                            },
                        );
                        assert!(
                            matches!(&refused.0, MetaResponse::Refused(why) if why.contains("compute node")),
                            "a map placing a partition on compute node {id} was accepted: {refused:?}"
                        );
                    }
                    format!(
                        "node {id} joined ({})",
                        if compute { "compute" } else { "storage" }
                    )
                } else {
                    "no more nodes".into()
                }
            }
            _ => {
                let id = self.node();
                let response = self.apply(MetaCommand::Decommission { id });
                format!("decommission {id}: {response:?}")
            }
        }
    }

    fn epochs_of(&self, coordinator: NodeId) -> Vec<Epoch> {
        self.state
            .open
            .iter()
            .filter(|(_, o)| o.coordinator == coordinator)
            .map(|(e, _)| *e)
            .collect()
    }

    fn allocate(&mut self) -> String {
        let coordinator = self.node();
        let incarnation = self.state.nodes[&coordinator].incarnation;
        let count = self.rng.random_range(1..=2);
        let mut tables: Vec<String> = Vec::new();
        while tables.len() < count {
            let name = TABLES[self.rng.random_range(0..TABLES.len())].to_string();
            if !tables.contains(&name) {
                tables.push(name);
            }
        }
        let retry = self.rng.random_bool(0.2);
        let sent = self.model.requests.entry(coordinator).or_insert(0);
        if !retry {
            *sent += 1;
        }
        let request = *sent;
        let already = self
            .state
            .open
            .iter()
            .find(|(_, o)| o.coordinator == coordinator && o.request == request)
            .map(|(e, _)| *e);
        let leased_elsewhere = tables.iter().any(|t| {
            self.state.open.values().any(|o| {
                o.tables.contains(t) && !(o.coordinator == coordinator && o.request == request)
            })
        });
        let response = self.apply(MetaCommand::AllocateEpoch {
            coordinator,
            incarnation,
            tables: tables.clone(),
            request,
            read_at: Default::default(),
        });
        if let Some(epoch) = already {
            assert_eq!(
                response,
                MetaResponse::Epoch(epoch),
                "a retried allocation gets its epoch again"
            );
        } else if leased_elsewhere && self.state.nodes[&coordinator].alive {
            assert!(
                matches!(response, MetaResponse::TableBusy(_)),
                "allocating a leased table must be refused as busy, got {response:?}"
            );
        }
        format!("allocate {tables:?} for {coordinator} request {request}: {response:?}")
    }

    /// Moves a replica of a partition to another node (it starts stale, from the next
    /// epoch), or clears a stale mark (the replica caught up), as the rebalancer does.
    fn move_or_catch_up(&mut self) -> String {
        let mut map = self.state.map.clone();
        let p = self.rng.random_range(0..PARTITIONS as usize);
        let placement = &mut map.partitions[p];
        let description = if !placement.stale.is_empty() && self.rng.random_bool(0.5) {
            let node = *placement.stale.keys().next().expect("not empty");
            placement.stale.remove(&node);
            self.model.missed.remove(&(p, node));
            format!("partition {p}: node {node} caught up")
        } else {
            let candidates: Vec<NodeId> = self
                .state
                .nodes
                .values()
                .filter(|n| !n.compute && !n.decommissioned && !placement.replicas.contains(&n.id))
                .map(|n| n.id)
                .collect();
            if candidates.is_empty() {
                return "no node to move to".into();
            }
            let to = candidates[self.rng.random_range(0..candidates.len())];
            let slot = self.rng.random_range(0..placement.replicas.len());
            let from = placement.replicas[slot];
            let last_fresh = !placement.stale.contains_key(&from)
                && placement
                    .replicas
                    .iter()
                    .all(|r| *r == from || placement.stale.contains_key(r));
            if last_fresh {
                // The rebalancer never moves a partition's only complete replica away.
                return format!("partition {p}: replica {from} is its last complete one; kept");
            }
            placement.replicas[slot] = to;
            placement.stale.remove(&from);
            self.model.missed.remove(&(p, from));
            placement.stale.insert(to, self.state.visible.next());
            self.model.missed.insert((p, to), self.state.visible.next());
            format!("partition {p}: replica {from} moved to {to}")
        };
        let response = self.apply(MetaCommand::SetPartitionMap {
            map,
            rebalance: None,
        });
        assert_eq!(response, MetaResponse::Done, "{description}");
        description
    }

    /// Every invariant, against the model; `Err` names the first broken one.
    fn check(&self, visible_before: Epoch) -> Result<(), String> {
        let state = &self.state;
        if let Some(broken) = state.broken_invariant() {
            return Err(broken);
        }
        if state.visible < visible_before {
            return Err(format!(
                "visible moved back from {visible_before} to {}",
                state.visible
            ));
        }
        // Visible is the last epoch below which everything is decided.
        let mut expected_visible = Epoch(0);
        while expected_visible.next() < state.next_epoch
            && !state.open.contains_key(&expected_visible.next())
        {
            expected_visible = expected_visible.next();
        }
        if state.visible != expected_visible {
            return Err(format!(
                "visible is {}, but every epoch up to {expected_visible} is decided and the next is not",
                state.visible
            ));
        }
        for &epoch in &self.model.committed {
            if !state.is_committed(epoch) {
                return Err(format!("committed epoch {epoch} is no longer committed"));
            }
        }
        for &epoch in &self.model.aborted {
            if !state.is_aborted(epoch) || state.is_committed(epoch) {
                return Err(format!("aborted epoch {epoch} is not recorded as aborted"));
            }
        }
        if state.aborted_count() != self.model.aborted.len() as u64 {
            return Err(format!(
                "{} epochs were aborted, the state counts {}",
                self.model.aborted.len(),
                state.aborted_count()
            ));
        }
        // The set keeps only the aborts the epoch log cannot tell yet.
        let told_by_log = state.aborts_derived_from..=state.visible;
        if let Some(kept) = state.aborted.iter().find(|e| told_by_log.contains(e)) {
            return Err(format!(
                "aborted epoch {kept} is at or below visible {} and still kept in the set",
                state.visible
            ));
        }
        for (&(p, node), &first) in &self.model.missed {
            let placement = &state.map.partitions[p];
            if !placement.replicas.contains(&node) {
                continue;
            }
            match placement.stale.get(&node) {
                Some(&mark) if mark <= first => {}
                other => {
                    return Err(format!(
                        "node {node} missed epoch {first} of partition {p}, but its stale mark is {other:?}"
                    ))
                }
            }
        }
        for (p, placement) in state.map.partitions.iter().enumerate() {
            if placement
                .replicas
                .iter()
                .all(|r| placement.stale.contains_key(r))
            {
                return Err(format!(
                    "partition {p} has no complete replica: every one of {:?} is stale ({:?})",
                    placement.replicas, placement.stale
                ));
            }
            let fresh_live = placement.replicas.iter().copied().find(|id| {
                !placement.stale.contains_key(id)
                    && state
                        .nodes
                        .get(id)
                        .is_some_and(|n| n.alive && !n.decommissioned)
            });
            if placement.primary != fresh_live {
                return Err(format!(
                    "partition {p}'s primary is {:?}, but its first live fresh replica is {fresh_live:?}",
                    placement.primary
                ));
            }
        }
        for (epoch, open) in &state.open {
            let coordinator = &state.nodes[&open.coordinator];
            if !coordinator.alive || open.incarnation < coordinator.incarnation {
                return Err(format!(
                    "epoch {epoch} is open for node {} which is dead or has restarted since",
                    open.coordinator
                ));
            }
        }
        Ok(())
    }
}

#[test]
fn random_command_sequences_keep_every_invariant() {
    let base: u64 = std::env::var("TESSERA_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7e55e7a);
    let sequences: u64 = std::env::var("TESSERA_MODEL_SEQUENCES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    for seed in base..base + sequences {
        let mut run = Run::new(seed);
        let mut trail: Vec<String> = Vec::new();
        for step in 0..400 {
            let visible_before = run.state.visible;
            let did = run.step();
            trail.push(did);
            if let Err(broken) = run.check(visible_before) {
                let recent = trail[trail.len().saturating_sub(8)..].join("\n  ");
                panic!("seed {seed}, step {step}: {broken}\nlast steps:\n  {recent}");
            }
        }
        assert!(
            !run.model.committed.is_empty(),
            "seed {seed}: a run that commits nothing checks little"
        );
    }
}
