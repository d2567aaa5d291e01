//! Check quorum (the Raft thesis §6.2; etcd's `CheckQuorum`): a metadata leader that no
//! majority has acknowledged for a while steps down, so that the nodes that still reach
//! each other elect a leader among themselves.
//!
//! Why this is needed: openraft times each AppendEntries out after one heartbeat interval.
//! A leader whose links became slow (round trips longer than that) never hears an answer
//! in time and so commits nothing; yet its followers still receive its messages, late, so
//! their leader lease keeps being renewed and none of them campaigns. Without stepping
//! down, the whole cluster would accept no metadata write (no epoch, no publish) for as
//! long as the leader's links stay slow.
//!
//! A leader whose disk stalls (an fsync that does not return) steps down the same way. It
//! applies each committed entry to its own store before it answers the write, and its
//! store's log hangs: every metadata write (every epoch, every publish) would wait until the
//! node takes the stall for fatal and stops itself (`failure.disk_stall_ms`, 20 s by
//! default). Its followers still hear it, so none campaigns unless it goes quiet.
//!
//! openraft 0.9 has no step-down call, so stepping down is done from outside: the leader
//! sends no AppendEntries (its [`Network`](crate::network::Network) refuses them, heartbeats
//! included) until another node has been elected, which its followers do once their lease
//! runs out. A step-down that no other node ends (no majority can elect anyone) is given
//! up after a deadline, and the node leads on.

use crate::Raft;
use openraft::ServerState;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether this node is stepping down as metadata leader: shared between the watchdog
/// ([`watch`]) and the Raft network, which sends no AppendEntries while it is set.
#[derive(Debug, Default)]
pub struct StepDown {
    active: AtomicBool,
}

impl StepDown {
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    fn set(&self, active: bool) {
        self.active.store(active, Ordering::Release);
    }
}

/// When a leader steps down, and for how long it waits for another to take over.
#[derive(Debug, Clone, Copy)]
pub struct QuorumPolicy {
    /// A leader steps down when no majority has acknowledged it for this long, or when one
    /// of its fsyncs has been running this long.
    pub step_down_after: Duration,
    /// A step-down that no elected successor ended by then is given up.
    pub give_up_after: Duration,
}

impl QuorumPolicy {
    /// The policy for a group whose longest election timeout is `election_timeout_max`: a
    /// leader unacknowledged for three of them steps down (long enough that a busy machine
    /// does not trip it, short against the failure timeout), and waits up to five of them
    /// for a successor (followers campaign after one, plus their lease of one).
    pub fn for_election_timeout(election_timeout_max: Duration) -> QuorumPolicy {
        QuorumPolicy {
            step_down_after: election_timeout_max * 3,
            give_up_after: election_timeout_max * 5,
        }
    }
}

/// How often the watchdog looks at the leader's metrics.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// What the watchdog decided on one look at the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Stay,
    StepDown(Why),
    /// Another node was elected: the step-down is over.
    SteppedDown,
    /// No other node was elected in time: lead on.
    GiveUp,
}

/// Why a leader steps down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// No majority acknowledged it: its links are slow or cut.
    Unacknowledged,
    /// An fsync of its own has not returned: its disk stalled.
    DiskStalled,
}

/// What the watchdog sees of this node on one look.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// This node leads a group of more than one voter.
    leading: bool,
    /// Since a majority last acknowledged it (openraft's `millis_since_quorum_ack`).
    unacknowledged_for: Option<Duration>,
    /// How long this process's oldest fsync in flight has been running.
    syncing_for: Duration,
}

/// The watchdog's state between looks; pure, so its rules are tested without a cluster.
#[derive(Debug)]
struct Watchdog {
    policy: QuorumPolicy,
    stepping_down_since: Option<Instant>,
    /// After a step-down is given up the leader's last acknowledgement is still old; it
    /// gets a full `step_down_after` from then before it may step down again.
    quiet_until: Instant,
    /// When this node last became leader: a leader no majority has acknowledged at all yet
    /// counts as unacknowledged since then.
    leading_since: Option<Instant>,
}

impl Watchdog {
    fn new(policy: QuorumPolicy, now: Instant) -> Watchdog {
        Watchdog {
            policy,
            stepping_down_since: None,
            quiet_until: now,
            leading_since: None,
        }
    }

    fn look(&mut self, seen: Seen, now: Instant) -> Decision {
        let leading = seen.leading;
        self.leading_since = match (leading, self.leading_since) {
            (false, _) => None,
            (true, since) => Some(since.unwrap_or(now)),
        };
        let unacknowledged_for = seen
            .unacknowledged_for
            .or_else(|| self.leading_since.map(|since| now.duration_since(since)))
            .unwrap_or_default();
        let why = if unacknowledged_for > self.policy.step_down_after {
            Some(Why::Unacknowledged)
        } else if seen.syncing_for > self.policy.step_down_after {
            Some(Why::DiskStalled)
        } else {
            None
        };
        match (self.stepping_down_since, why) {
            (None, Some(why)) if leading && now >= self.quiet_until => {
                self.stepping_down_since = Some(now);
                Decision::StepDown(why)
            }
            (Some(_), _) if !leading => {
                self.stepping_down_since = None;
                Decision::SteppedDown
            }
            (Some(since), _) if now.duration_since(since) > self.policy.give_up_after => {
                self.stepping_down_since = None;
                self.quiet_until = now + self.policy.step_down_after;
                Decision::GiveUp
            }
            _ => Decision::Stay,
        }
    }
}

/// Watches `raft`'s metrics and steps this node down (through `step_down`) when it leads
/// without a majority's acknowledgement, or with an fsync in flight, for
/// `policy.step_down_after`. Ends when Raft shuts down.
pub async fn watch(raft: Raft, step_down: Arc<StepDown>, policy: QuorumPolicy) {
    let metrics = raft.metrics();
    let mut watchdog = Watchdog::new(policy, Instant::now());
    let mut ticker = tokio::time::interval(CHECK_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_look = Instant::now();
    loop {
        ticker.tick().await;
        // A look held back this long means the process itself was frozen (a SIGSTOP, a
        // paused VM): the time its fsyncs were seen running says nothing of the disk.
        let frozen = last_look.elapsed() > policy.step_down_after / 2;
        last_look = Instant::now();
        if metrics.has_changed().is_err() {
            // The Raft core has stopped: nothing left to watch.
            step_down.set(false);
            return;
        }
        let oldest_sync = tessera_common::disk::oldest_sync_in_flight().filter(|_| !frozen);
        let (seen, term) = {
            let m = metrics.borrow();
            let voters = m.membership_config.membership().voter_ids().count();
            let seen = Seen {
                leading: m.state == ServerState::Leader && voters > 1,
                unacknowledged_for: m.millis_since_quorum_ack.map(Duration::from_millis),
                syncing_for: oldest_sync.as_ref().map_or(Duration::ZERO, |(d, _)| *d),
            };
            (seen, m.current_term)
        };
        match watchdog.look(seen, Instant::now()) {
            Decision::Stay => {}
            Decision::StepDown(why) => {
                match why {
                    Why::Unacknowledged => tracing::warn!(
                        term,
                        unacknowledged_ms = seen.unacknowledged_for.unwrap_or_default().as_millis() as u64,
                        "no majority has acknowledged this metadata leader for {:?}: stepping down so \
                         the nodes that reach each other elect another (its links are slow or cut)",
                        policy.step_down_after
                    ),
                    Why::DiskStalled => tracing::warn!(
                        term,
                        file = %oldest_sync.map(|(_, path)| path.display().to_string()).unwrap_or_default(),
                        syncing_ms = seen.syncing_for.as_millis() as u64,
                        "an fsync of this metadata leader has not returned for {:?}: stepping down \
                         so that metadata writes go on at another (its disk stalled)",
                        policy.step_down_after
                    ),
                }
                step_down.set(true);
                tessera_common::metrics::metrics().raft_step_downs.inc();
            }
            Decision::SteppedDown => {
                tracing::info!(term, "stepped down as metadata leader; another node leads");
                step_down.set(false);
            }
            Decision::GiveUp => {
                tracing::warn!(
                    term,
                    "no other node took over as metadata leader within {:?} of stepping down; \
                     leading on",
                    policy.give_up_after
                );
                step_down.set(false);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> QuorumPolicy {
        QuorumPolicy::for_election_timeout(Duration::from_millis(600))
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn seen(leading: bool, unacknowledged_for: Option<Duration>) -> Seen {
        Seen {
            leading,
            unacknowledged_for,
            syncing_for: Duration::ZERO,
        }
    }

    #[test]
    fn a_leader_steps_down_only_once_unacknowledged_past_the_limit() {
        let start = Instant::now();
        let mut dog = Watchdog::new(policy(), start);
        assert_eq!(dog.look(seen(true, Some(ms(1800))), start), Decision::Stay);
        assert_eq!(
            dog.look(seen(true, None), start),
            Decision::Stay,
            "no ack yet"
        );
        assert_eq!(dog.look(seen(true, None), start + ms(1000)), Decision::Stay);
        assert_eq!(
            dog.look(seen(false, Some(ms(5000))), start),
            Decision::Stay,
            "a follower"
        );
        assert_eq!(
            dog.look(seen(true, Some(ms(1801))), start),
            Decision::StepDown(Why::Unacknowledged)
        );
        assert_eq!(
            dog.look(seen(true, Some(ms(2500))), start + ms(700)),
            Decision::Stay,
            "still waiting for a successor"
        );
        assert_eq!(
            dog.look(seen(false, None), start + ms(900)),
            Decision::SteppedDown
        );
        assert_eq!(
            dog.look(seen(false, None), start + ms(1000)),
            Decision::Stay
        );
    }

    #[test]
    fn a_leader_never_acknowledged_counts_from_its_election() {
        let start = Instant::now();
        let mut dog = Watchdog::new(policy(), start);
        assert_eq!(dog.look(seen(false, None), start), Decision::Stay);
        assert_eq!(dog.look(seen(true, None), start + ms(100)), Decision::Stay);
        assert_eq!(dog.look(seen(true, None), start + ms(1900)), Decision::Stay);
        assert_eq!(
            dog.look(seen(true, None), start + ms(1901)),
            Decision::StepDown(Why::Unacknowledged)
        );
    }

    #[test]
    fn a_step_down_nobody_ends_is_given_up_and_not_retried_at_once() {
        let start = Instant::now();
        let mut dog = Watchdog::new(policy(), start);
        assert_eq!(
            dog.look(seen(true, Some(ms(2000))), start),
            Decision::StepDown(Why::Unacknowledged)
        );
        assert_eq!(
            dog.look(seen(true, Some(ms(4000))), start + ms(3000)),
            Decision::Stay
        );
        let given_up = start + ms(3001);
        assert_eq!(
            dog.look(seen(true, Some(ms(5000))), given_up),
            Decision::GiveUp
        );
        // Its last acknowledgement is still old: it leads on for a full limit first.
        assert_eq!(
            dog.look(seen(true, Some(ms(6000))), given_up + ms(1000)),
            Decision::Stay
        );
        assert_eq!(
            dog.look(seen(true, Some(ms(7000))), given_up + ms(1801)),
            Decision::StepDown(Why::Unacknowledged)
        );
    }

    #[test]
    fn a_leader_whose_fsync_hangs_steps_down_though_acknowledged() {
        let start = Instant::now();
        let mut dog = Watchdog::new(policy(), start);
        let syncing = |leading, ms_syncing| Seen {
            leading,
            unacknowledged_for: Some(ms(50)),
            syncing_for: ms(ms_syncing),
        };
        assert_eq!(dog.look(syncing(true, 1800), start), Decision::Stay);
        assert_eq!(
            dog.look(syncing(false, 9000), start),
            Decision::Stay,
            "a follower's disk is the failure detector's business"
        );
        assert_eq!(
            dog.look(syncing(true, 1801), start + ms(100)),
            Decision::StepDown(Why::DiskStalled)
        );
        assert_eq!(
            dog.look(syncing(false, 2500), start + ms(900)),
            Decision::SteppedDown
        );
    }
}
