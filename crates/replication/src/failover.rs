//! The failure detector (DESIGN §6): heartbeats to the metadata leader plus dropped
//! connections reported as suspicions. The leader decides from it which nodes are alive
//! and writes each change through Raft (`SetLiveness`, which promotes a dead node's
//! standbys); a node failed for long enough is *lost*, and its replicas are rebuilt
//! elsewhere.
//!
//! The detector is pure: it is fed the time and what was observed (heartbeats,
//! suspicions, probe answers) and says what to do. The node's loops do the I/O (probes,
//! metadata writes); tests drive it on simulated time (TigerBeetle's `fault_detector`).

use crate::NodeId;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};
use tessera_common::Epoch;
use tessera_meta::wire::Heartbeat;
use tessera_meta::OpenEpoch;

/// What the leader should do about one node this round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Heard from within the timeout.
    Alive,
    /// Silent for longer than the timeout.
    Failed,
    /// Suspected by a peer while counted alive: ask it at once, and go by its answer
    /// ([`FailureDetector::probed`]).
    Probe,
}

/// One member as the metadata lists it.
#[derive(Debug, Clone, Copy)]
pub struct Member {
    pub id: NodeId,
    /// The metadata counts it alive.
    pub alive: bool,
}

#[derive(Debug)]
pub struct FailureDetector {
    /// A node silent this long is failed.
    timeout: Duration,
    /// A node failed this long is lost: its replicas are rebuilt elsewhere.
    lost_after: Duration,
    /// When each node was last heard from.
    last_seen: HashMap<NodeId, Instant>,
    /// Nodes a peer reported a dropped connection to, not yet checked.
    suspects: BTreeSet<NodeId>,
    /// On the leader: since when each failed node has been failed, as this leader saw it.
    failed_since: HashMap<NodeId, Instant>,
    /// An epoch open this long is aborted by the leader, its coordinator alive or not: a
    /// coordinator whose commit or abort keeps failing (or that is stalled) must not hold
    /// its tables' lease for ever.
    open_epoch_timeout: Duration,
    /// On the leader: since when each open epoch has been open, as this leader saw it.
    open_since: BTreeMap<Epoch, Instant>,
    /// On the leader: open epochs whose coordinator, alive, said it no longer works on
    /// them (see [`given_up`]), with that coordinator: to abort at once.
    given_up: BTreeMap<Epoch, NodeId>,
}

impl FailureDetector {
    pub fn new(timeout: Duration, lost_after: Duration) -> FailureDetector {
        assert!(
            lost_after > timeout,
            "a node is lost only after it has been failed for a while"
        );
        FailureDetector {
            timeout,
            lost_after,
            last_seen: HashMap::new(),
            suspects: BTreeSet::new(),
            failed_since: HashMap::new(),
            open_epoch_timeout: Duration::MAX,
            open_since: BTreeMap::new(),
            given_up: BTreeMap::new(),
        }
    }

    /// Open epochs are aborted after `timeout` (none by default).
    pub fn with_open_epoch_timeout(mut self, timeout: Duration) -> FailureDetector {
        self.open_epoch_timeout = timeout;
        self
    }

    /// A heartbeat (or any answer) from `node` at `now`.
    pub fn heard_from(&mut self, node: NodeId, now: Instant) {
        self.last_seen.insert(node, now);
    }

    /// A peer (or this node) lost a connection to `node`: check it at once.
    pub fn suspect(&mut self, node: NodeId) {
        self.suspects.insert(node);
    }

    /// The suspicions gathered since last taken (a follower passes them to the leader).
    pub fn take_suspects(&mut self) -> BTreeSet<NodeId> {
        std::mem::take(&mut self.suspects)
    }

    /// This node just became the leader. It has heard from nobody yet: it checks every
    /// live node at once (the old leader, if it died, answers nobody) and gives the rest a
    /// full timeout. Nodes already failed stay so until they send a heartbeat, and the
    /// time towards losing them starts again.
    pub fn became_leader(&mut self, me: NodeId, members: &[Member], now: Instant) {
        self.failed_since.clear();
        self.open_since.clear();
        self.given_up.clear();
        for member in members.iter().filter(|m| m.id != me && m.alive) {
            self.last_seen.insert(member.id, now);
            self.suspects.insert(member.id);
        }
    }

    /// What to do about each member this round, at `now`. Takes the suspicions.
    ///
    /// `me`, the leader running the check, is alive by doing so. It is named only when the
    /// metadata counts it failed: another leader declared it so while it was cut off, and
    /// it won the election back after the heal. Nobody else would revive it, and while it
    /// is counted failed its own publishes are fenced and its rebalances refused (a fault
    /// run saw a leader stay so for over 20 s, acknowledging nothing).
    pub fn check(&mut self, me: NodeId, members: &[Member], now: Instant) -> Vec<(NodeId, Check)> {
        let suspects = self.take_suspects();
        // A live node not heard from yet (one that just joined) starts its timeout now.
        for member in members.iter().filter(|m| m.alive) {
            self.last_seen.entry(member.id).or_insert(now);
        }
        members
            .iter()
            .filter(|m| m.id != me || !m.alive)
            .map(|member| {
                let check = if member.id == me {
                    Check::Alive
                } else if member.alive && suspects.contains(&member.id) {
                    Check::Probe
                } else if self.silent(member.id, now) {
                    Check::Failed
                } else {
                    Check::Alive
                };
                (member.id, check)
            })
            .collect()
    }

    fn silent(&self, node: NodeId, now: Instant) -> bool {
        self.last_seen
            .get(&node)
            .is_none_or(|seen| now.saturating_duration_since(*seen) > self.timeout)
    }

    /// The answer to a probe of `node`: it answered as itself, or not. A failed probe
    /// forgets its last heartbeat: only a new one may revive it, or the next round would
    /// find it "recently seen" and flap it back to alive.
    pub fn probed(&mut self, node: NodeId, answered: bool, now: Instant) {
        if answered {
            self.heard_from(node, now);
        } else {
            self.last_seen.remove(&node);
        }
    }

    /// Nodes failed for longer than the loss time, among `failed` (the members the metadata
    /// counts failed). The clock starts when this leader first sees a node failed, so a new
    /// leader waits the full time again: it errs towards not moving data.
    pub fn lost(&mut self, failed: &BTreeSet<NodeId>, now: Instant) -> BTreeSet<NodeId> {
        self.failed_since.retain(|id, _| failed.contains(id));
        for id in failed {
            self.failed_since.entry(*id).or_insert(now);
        }
        self.failed_since
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= self.lost_after)
            .map(|(id, _)| *id)
            .collect()
    }

    /// `epochs` are still being worked on by their coordinator (its heartbeat says so at
    /// `now`): their open-epoch timeout starts again.
    pub fn renew_epochs(&mut self, epochs: &[Epoch], now: Instant) {
        for epoch in epochs {
            if let Some(since) = self.open_since.get_mut(epoch) {
                *since = now;
            }
        }
    }

    /// A heartbeat from a coordinator, against the metadata's open epochs as this leader
    /// has applied them: what it has given up on is noted, to abort.
    pub fn gave_up(&mut self, heartbeat: &Heartbeat, open: &BTreeMap<Epoch, OpenEpoch>) {
        for epoch in given_up(heartbeat, open) {
            self.given_up.insert(epoch, heartbeat.node_id);
        }
    }

    /// The epochs of `open` (the metadata's open epochs) whose live coordinator gave them
    /// up, with that coordinator; taken.
    pub fn take_given_up(&mut self, open: &BTreeSet<Epoch>) -> Vec<(Epoch, NodeId)> {
        std::mem::take(&mut self.given_up)
            .into_iter()
            .filter(|(epoch, _)| open.contains(epoch))
            .collect()
    }

    /// The epochs of `open` (the metadata's open epochs) that have been open for the open
    /// epoch timeout at `now`, as this leader saw them: to abort. A new leader waits the
    /// full time again, from its first look.
    pub fn overdue_epochs(&mut self, open: &BTreeSet<Epoch>, now: Instant) -> Vec<Epoch> {
        self.open_since.retain(|epoch, _| open.contains(epoch));
        for epoch in open {
            self.open_since.entry(*epoch).or_insert(now);
        }
        self.open_since
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= self.open_epoch_timeout)
            .map(|(epoch, _)| *epoch)
            .collect()
    }
}

/// The open epochs of `heartbeat`'s sender that it has given up on: it had applied their
/// allocation when it built the heartbeat, and listed them neither as worked on nor as an
/// allocation awaiting its answer. A coordinator lists an allocation's request from before
/// sending it until the epoch it opened is worked on, and works on that until the epoch is
/// decided or it gives up (its commit or abort failed, its task ended), so a heartbeat
/// built after the allocation applied there and listing neither says it has given up,
/// however late the heartbeat arrives. Nothing is judged from a heartbeat without an
/// applied index, or an epoch without an allocation index (written by an older version).
pub fn given_up(heartbeat: &Heartbeat, open: &BTreeMap<Epoch, OpenEpoch>) -> Vec<Epoch> {
    if heartbeat.applied_index == 0 {
        return Vec::new();
    }
    open.iter()
        .filter(|(epoch, o)| {
            o.coordinator == heartbeat.node_id
                && o.allocated_at != 0
                && o.allocated_at <= heartbeat.applied_index
                && !heartbeat.working_on.contains(epoch)
                && !heartbeat.allocating.contains(&o.request)
        })
        .map(|(epoch, _)| *epoch)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(1500);
    const LOST_AFTER: Duration = Duration::from_secs(300);
    const ME: NodeId = NodeId(1);

    fn members(alive: &[(NodeId, bool)]) -> Vec<Member> {
        alive
            .iter()
            .map(|&(id, alive)| Member { id, alive })
            .collect()
    }

    fn verdict(
        detector: &mut FailureDetector,
        members: &[Member],
        now: Instant,
        id: NodeId,
    ) -> Check {
        detector
            .check(ME, members, now)
            .into_iter()
            .find(|(node, _)| *node == id)
            .map(|(_, check)| check)
            .unwrap()
    }

    #[test]
    fn a_coordinator_gives_up_an_epoch_only_by_not_listing_it_after_applying_its_allocation() {
        let open_epoch = |coordinator, request, allocated_at| OpenEpoch {
            coordinator: NodeId(coordinator),
            incarnation: 1,
            tables: vec![format!("t{request}")],
            request,
            publisher: None,
            allocated_at,
        };
        // Node 2 opened epoch 5 (request 50, log index 40) and epoch 6 (request 60, index 44);
        // node 3 opened epoch 7 (index 41).
        let open = BTreeMap::from([
            (Epoch(5), open_epoch(2, 50, 40)),
            (Epoch(6), open_epoch(2, 60, 44)),
            (Epoch(7), open_epoch(3, 70, 41)),
        ]);
        let heartbeat = |applied_index, working_on: &[u64], allocating: &[u64]| Heartbeat {
            node_id: NodeId(2),
            working_on: working_on.iter().map(|e| Epoch(*e)).collect(),
            allocating: allocating.to_vec(),
            applied_index,
        };
        // Built before node 2 applied either allocation: it may not know of them yet.
        assert!(given_up(&heartbeat(39, &[], &[]), &open).is_empty());
        // Applied epoch 5's allocation and lists nothing: gave it up. Epoch 6's allocation
        // is beyond what it had applied; epoch 7 is another coordinator's.
        assert_eq!(given_up(&heartbeat(42, &[], &[]), &open), vec![Epoch(5)]);
        // Listed as worked on, or its allocation still awaiting an answer: not given up.
        assert!(given_up(&heartbeat(44, &[5], &[60]), &open).is_empty());
        assert_eq!(given_up(&heartbeat(44, &[6], &[]), &open), vec![Epoch(5)]);
        // A node that does not say what it applied proves nothing.
        assert!(given_up(&heartbeat(0, &[], &[]), &open).is_empty());
        // Nor does an epoch whose allocation index was not kept.
        let old = BTreeMap::from([(Epoch(5), open_epoch(2, 50, 0))]);
        assert!(given_up(&heartbeat(100, &[], &[]), &old).is_empty());

        // The leader aborts what was given up and is still open, once.
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        detector.gave_up(&heartbeat(44, &[], &[]), &open);
        assert_eq!(
            detector.take_given_up(&BTreeSet::from([Epoch(6), Epoch(7)])),
            vec![(Epoch(6), NodeId(2))]
        );
        assert!(detector
            .take_given_up(&BTreeSet::from([Epoch(6)]))
            .is_empty());
    }

    #[test]
    fn an_epoch_left_open_is_overdue_after_the_timeout_as_the_leader_saw_it() {
        let start = Instant::now();
        let timeout = Duration::from_secs(30);
        let mut detector =
            FailureDetector::new(TIMEOUT, LOST_AFTER).with_open_epoch_timeout(timeout);
        let open = BTreeSet::from([Epoch(7), Epoch(8)]);
        assert!(detector.overdue_epochs(&open, start).is_empty());
        // Epoch 8 commits; epoch 9 opens later.
        let later = BTreeSet::from([Epoch(7), Epoch(9)]);
        assert!(detector
            .overdue_epochs(&later, start + timeout / 2)
            .is_empty());
        assert_eq!(
            detector.overdue_epochs(&later, start + timeout),
            vec![Epoch(7)]
        );
        assert_eq!(
            detector.overdue_epochs(&later, start + timeout * 3 / 2),
            vec![Epoch(7), Epoch(9)]
        );
        // A new leader starts counting again.
        let elected = start + timeout * 2;
        detector.became_leader(ME, &members(&[(NodeId(1), true)]), elected);
        assert!(detector.overdue_epochs(&later, elected).is_empty());
        assert_eq!(detector.overdue_epochs(&later, elected + timeout).len(), 2);
        // A coordinator still working on epoch 9 renews it; epoch 7 stays overdue.
        detector.renew_epochs(&[Epoch(9)], elected + timeout);
        assert_eq!(
            detector.overdue_epochs(&later, elected + timeout + timeout / 2),
            vec![Epoch(7)]
        );
        // No timeout configured: nothing is ever overdue.
        let mut patient = FailureDetector::new(TIMEOUT, LOST_AFTER);
        assert!(patient.overdue_epochs(&open, start).is_empty());
        assert!(patient
            .overdue_epochs(&open, start + Duration::from_secs(1 << 30))
            .is_empty());
    }

    #[test]
    fn a_node_silent_past_the_timeout_fails_and_a_heartbeat_revives_it() {
        let start = Instant::now();
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        let nodes = members(&[(NodeId(1), true), (NodeId(2), true)]);
        assert_eq!(
            verdict(&mut detector, &nodes, start, NodeId(2)),
            Check::Alive
        );
        detector.heard_from(NodeId(2), start + Duration::from_millis(1000));
        // Within the timeout of its last heartbeat.
        let t = start + Duration::from_millis(2400);
        assert_eq!(verdict(&mut detector, &nodes, t, NodeId(2)), Check::Alive);
        // Past it.
        let t = start + Duration::from_millis(2600);
        assert_eq!(verdict(&mut detector, &nodes, t, NodeId(2)), Check::Failed);
        let failed = members(&[(NodeId(1), true), (NodeId(2), false)]);
        assert_eq!(verdict(&mut detector, &failed, t, NodeId(2)), Check::Failed);
        detector.heard_from(NodeId(2), t + Duration::from_millis(10));
        let t = t + Duration::from_millis(20);
        assert_eq!(verdict(&mut detector, &failed, t, NodeId(2)), Check::Alive);
    }

    #[test]
    fn a_suspect_is_probed_at_once_and_a_failed_probe_does_not_flap() {
        let start = Instant::now();
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        let nodes = members(&[(NodeId(1), true), (NodeId(2), true), (NodeId(3), true)]);
        detector.heard_from(NodeId(2), start);
        detector.heard_from(NodeId(3), start);
        detector.suspect(NodeId(2));
        let t = start + Duration::from_millis(100);
        let checks = detector.check(ME, &nodes, t);
        assert_eq!(
            checks,
            vec![(NodeId(2), Check::Probe), (NodeId(3), Check::Alive)]
        );
        // The suspicion is taken: the next round does not probe again.
        detector.probed(NodeId(2), false, t);
        let failed = members(&[(NodeId(1), true), (NodeId(2), false), (NodeId(3), true)]);
        let t = t + Duration::from_millis(100);
        // Its last heartbeat (100 ms ago) no longer counts.
        assert_eq!(verdict(&mut detector, &failed, t, NodeId(2)), Check::Failed);
        // A suspect that answers stays alive.
        detector.suspect(NodeId(3));
        assert_eq!(verdict(&mut detector, &failed, t, NodeId(3)), Check::Probe);
        detector.probed(NodeId(3), true, t);
        assert_eq!(
            verdict(&mut detector, &failed, t + TIMEOUT, NodeId(3)),
            Check::Alive
        );
    }

    #[test]
    fn a_leader_the_metadata_counts_failed_declares_itself_alive() {
        let start = Instant::now();
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        let counted_failed = members(&[(ME, false), (NodeId(2), true)]);
        detector.became_leader(ME, &counted_failed, start);
        let later = start + TIMEOUT * 4;
        detector.heard_from(NodeId(2), later);
        assert_eq!(
            verdict(&mut detector, &counted_failed, later, ME),
            Check::Alive
        );
        // Counted alive, it is not named at all.
        let alive = members(&[(ME, true), (NodeId(2), true)]);
        assert!(detector
            .check(ME, &alive, later)
            .iter()
            .all(|(id, _)| *id != ME));
    }

    #[test]
    fn a_suspected_node_already_failed_is_not_probed() {
        let start = Instant::now();
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        detector.suspect(NodeId(2));
        let failed = members(&[(NodeId(1), true), (NodeId(2), false)]);
        assert_eq!(
            verdict(&mut detector, &failed, start, NodeId(2)),
            Check::Failed
        );
    }

    #[test]
    fn a_new_leader_probes_everyone_and_gives_a_full_timeout() {
        let start = Instant::now();
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        let nodes = members(&[(NodeId(1), true), (NodeId(2), true), (NodeId(3), false)]);
        detector.became_leader(ME, &nodes, start);
        let checks = detector.check(ME, &nodes, start);
        assert_eq!(
            checks,
            vec![(NodeId(2), Check::Probe), (NodeId(3), Check::Failed)]
        );
        detector.probed(NodeId(2), true, start);
        assert_eq!(
            verdict(&mut detector, &nodes, start + TIMEOUT, NodeId(2)),
            Check::Alive
        );
        assert_eq!(
            verdict(
                &mut detector,
                &nodes,
                start + TIMEOUT + Duration::from_millis(1),
                NodeId(2)
            ),
            Check::Failed
        );
    }

    #[test]
    fn a_node_failed_long_enough_is_lost_and_a_new_leader_starts_the_clock_again() {
        let start = Instant::now();
        let mut detector = FailureDetector::new(TIMEOUT, LOST_AFTER);
        let failed = BTreeSet::from([NodeId(3)]);
        assert!(detector.lost(&failed, start).is_empty());
        assert!(detector.lost(&failed, start + LOST_AFTER / 2).is_empty());
        assert_eq!(detector.lost(&failed, start + LOST_AFTER), failed);
        // It came back: no longer counted.
        assert!(detector
            .lost(&BTreeSet::new(), start + LOST_AFTER)
            .is_empty());
        assert!(detector.lost(&failed, start + LOST_AFTER * 2).is_empty());
        // A new leader waits the full time again, from its first look.
        let elected = start + LOST_AFTER * 3;
        detector.became_leader(
            ME,
            &members(&[(NodeId(1), true), (NodeId(3), false)]),
            elected,
        );
        assert!(detector.lost(&failed, elected).is_empty());
        assert!(detector.lost(&failed, elected + LOST_AFTER / 2).is_empty());
        assert_eq!(detector.lost(&failed, elected + LOST_AFTER), failed);
    }
}
