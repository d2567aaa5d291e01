//! Waiting for table leases in turn. An epoch allocation is all or nothing: it gets the
//! lease of every table it names, or none. Retried blindly, one that names several tables
//! (a rebalance names them all) gets them only at an instant when no publish holds any of
//! them, which busy single-table publishers may never leave it: it starves.
//!
//! So an allocation refused because a table is leased *claims* the tables it names that
//! nobody else claims. A claimed table is refused to every allocation but its claimant's
//! and older claimants' (those that claimed any table first): as each lease ends, no new
//! publish takes the table, and the claimant gets every table once their open epochs end.
//! The oldest claimant is never refused by a claim, so claims cannot deadlock.
//!
//! Every claim has a way to end: its claimant's allocation succeeds (its claims go), the
//! claimant stops retrying (a claim not renewed by a retry within [`CLAIM_TTL_MS`] of the
//! metadata's clock lapses), or the claimant's node is no longer a live member. And a
//! claim holds others back for at most [`CLAIM_PRIORITY_MS`]: a claimant waiting on an
//! epoch that stays open (its coordinator hung, until the epoch times out) would otherwise
//! stop publishes to every table it claimed, where without claims only the tables of that
//! epoch wait. After that it retries as one among others.

use super::MetaState;
use crate::NodeId;
use serde::{Deserialize, Serialize};

/// How long (by the metadata's clock, the leader's stamps) a claim lasts without its
/// claimant retrying. Coordinators retry every 100 ms while they wait for a lease.
pub const CLAIM_TTL_MS: u64 = 2_000;

/// How long after its first claim a claimant holds others back. Publishes take well under
/// a second when nothing fails, so a claimant gets its tables long before this.
pub const CLAIM_PRIORITY_MS: u64 = 10_000;

/// One waiting allocation's hold on a table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LeaseClaim {
    pub coordinator: NodeId,
    pub request: u64,
    /// The log index at which the claimant first claimed: older claimants go first.
    pub since: u64,
    /// The metadata clock at the claimant's first claim: after [`CLAIM_PRIORITY_MS`] more,
    /// its claims hold nobody back.
    pub claimed_ms: u64,
    /// The metadata clock at the claimant's latest retry.
    pub renewed_ms: u64,
}

impl LeaseClaim {
    fn is_of(&self, coordinator: NodeId, request: u64) -> bool {
        self.coordinator == coordinator && self.request == request
    }
}

impl MetaState {
    /// When the allocation (`coordinator`, `request`) first claimed (log index, clock), if
    /// it holds a claim.
    fn first_claim_of(&self, coordinator: NodeId, request: u64) -> Option<(u64, u64)> {
        self.lease_claims
            .values()
            .filter(|c| c.is_of(coordinator, request))
            .map(|c| (c.since, c.claimed_ms))
            .min()
    }

    /// Drops the claims that have lapsed: not renewed within [`CLAIM_TTL_MS`], or made by a
    /// node that is no longer a live member.
    fn drop_lapsed_claims(&mut self) {
        let now = self.clock_ms;
        let nodes = &self.nodes;
        self.lease_claims.retain(|_, claim| {
            now < claim.renewed_ms.saturating_add(CLAIM_TTL_MS)
                && nodes
                    .get(&claim.coordinator)
                    .is_some_and(|n| n.alive && !n.decommissioned)
        });
    }

    /// The first of `tables` that another allocation, waiting since before this one, has
    /// claimed, with its claim: this allocation waits for it.
    pub(super) fn claimed_before(
        &mut self,
        tables: &[String],
        coordinator: NodeId,
        request: u64,
    ) -> Option<(String, LeaseClaim)> {
        self.drop_lapsed_claims();
        let own_since = self
            .first_claim_of(coordinator, request)
            .map(|(since, _)| since);
        let now = self.clock_ms;
        tables.iter().find_map(|table| {
            let claim = self.lease_claims.get(table)?;
            let first = !claim.is_of(coordinator, request)
                && own_since.is_none_or(|own| claim.since < own)
                && now < claim.claimed_ms.saturating_add(CLAIM_PRIORITY_MS);
            first.then(|| (table.clone(), claim.clone()))
        })
    }

    /// Records that the allocation (`coordinator`, `request`) waits for `tables`: it claims
    /// those nobody claims, and renews its claims.
    pub(super) fn claim(
        &mut self,
        tables: &[String],
        coordinator: NodeId,
        request: u64,
        index: u64,
    ) {
        let now = self.clock_ms;
        let (since, claimed_ms) = self
            .first_claim_of(coordinator, request)
            .unwrap_or((index, now));
        for claim in self.lease_claims.values_mut() {
            if claim.is_of(coordinator, request) {
                claim.renewed_ms = now;
            }
        }
        for table in tables {
            self.lease_claims
                .entry(table.clone())
                .or_insert_with(|| LeaseClaim {
                    coordinator,
                    request,
                    since,
                    claimed_ms,
                    renewed_ms: now,
                });
        }
    }

    /// The allocation got its epoch: its claims go.
    pub(super) fn release_claims(&mut self, coordinator: NodeId, request: u64) {
        self.lease_claims
            .retain(|_, claim| !claim.is_of(coordinator, request));
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{bootstrapped, with_table};
    use super::*;
    use crate::{MetaCommand, MetaResponse};
    use tessera_common::Epoch;

    /// A state with tables `a`, `b` and `c` (and `t`), and its log index and clock.
    struct Log {
        state: MetaState,
        index: u64,
        clock_ms: u64,
    }

    impl Log {
        fn new() -> Log {
            let state = ["a", "b", "c"]
                .into_iter()
                .fold(bootstrapped(4), with_table);
            Log {
                state,
                index: 10,
                clock_ms: 1_000,
            }
        }

        /// Applies `command` stamped `after_ms` later than the one before.
        fn apply(&mut self, after_ms: u64, command: MetaCommand) -> MetaResponse {
            self.index += 1;
            self.clock_ms += after_ms;
            let stamped = MetaCommand::Stamped {
                at_ms: self.clock_ms,
                command: Box::new(command),
            };
            self.state.apply(self.index, stamped).0
        }

        fn allocate(&mut self, node: u64, request: u64, tables: &[&str]) -> MetaResponse {
            self.allocate_after(100, node, request, tables)
        }

        fn allocate_after(
            &mut self,
            after_ms: u64,
            node: u64,
            request: u64,
            tables: &[&str],
        ) -> MetaResponse {
            self.apply(
                after_ms,
                MetaCommand::AllocateEpoch {
                    coordinator: NodeId(node),
                    incarnation: 0,
                    tables: tables.iter().map(|t| t.to_string()).collect(),
                    request,
                    read_at: Default::default(),
                },
            )
        }

        fn commit(&mut self, epoch: Epoch) {
            let response = self.apply(
                100,
                MetaCommand::CommitEpoch {
                    epoch,
                    missed: vec![],
                    changes: None,
                    seal: None,
                    min_copies: None,
                },
            );
            assert_eq!(response, MetaResponse::Epoch(epoch));
        }
    }

    fn epoch(response: MetaResponse) -> Epoch {
        match response {
            MetaResponse::Epoch(epoch) => epoch,
            other => panic!("expected an epoch, got {other:?}"),
        }
    }

    fn is_busy(response: &MetaResponse, says: &str) -> bool {
        matches!(response, MetaResponse::TableBusy(reason) if reason.contains(says))
    }

    #[test]
    fn an_allocation_of_every_table_is_not_starved_by_single_table_publishes() {
        let mut log = Log::new();
        // Node 1 publishes to a; node 4's rebalance wants a and b.
        let a = epoch(log.allocate(1, 1, &["a"]));
        let refused = log.allocate(4, 9, &["a", "b"]);
        assert!(is_busy(&refused, "one writer at a time"), "{refused:?}");
        // Table b is free, but claimed: node 2's publish to it waits its turn.
        let waits = log.allocate(2, 1, &["b"]);
        assert!(is_busy(&waits, "leases are given in turn"), "{waits:?}");
        // So is node 1's next publish to a, once its epoch is committed.
        log.commit(a);
        let waits = log.allocate(1, 2, &["a"]);
        assert!(is_busy(&waits, "leases are given in turn"), "{waits:?}");
        // The rebalance gets both tables as soon as it retries, and its claims go.
        let rebalance = epoch(log.allocate(4, 9, &["a", "b"]));
        assert!(log.state.lease_claims.values().all(|c| c.request != 9));
        // The publishes then wait on its lease, as on any, and follow it.
        assert!(is_busy(&log.allocate(2, 1, &["b"]), "one writer at a time"));
        log.commit(rebalance);
        epoch(log.allocate(2, 1, &["b"]));
        epoch(log.allocate(1, 2, &["a"]));
    }

    #[test]
    fn the_longest_waiting_allocation_goes_first_so_claims_cannot_deadlock() {
        let mut log = Log::new();
        let a = epoch(log.allocate(1, 1, &["a"]));
        let c = epoch(log.allocate(1, 2, &["c"]));
        // Node 2 waits for a and b (a is leased); then node 3 for b and c (c is leased):
        // b is node 2's, and node 3 claims only c.
        assert!(is_busy(&log.allocate(2, 1, &["a", "b"]), "one writer"));
        assert!(is_busy(&log.allocate(3, 1, &["b", "c"]), "one writer"));
        assert_eq!(log.state.lease_claims["b"].coordinator, NodeId(2));
        assert_eq!(log.state.lease_claims["c"].coordinator, NodeId(3));
        // With c free, node 3 still waits for b, claimed by node 2 before it.
        log.commit(c);
        assert!(is_busy(&log.allocate(3, 1, &["b", "c"]), "in turn"));
        // Node 2 never waits on node 3's claim: it is older.
        log.commit(a);
        let second = epoch(log.allocate(2, 1, &["a", "b"]));
        log.commit(second);
        epoch(log.allocate(3, 1, &["b", "c"]));
    }

    #[test]
    fn a_claimant_holds_others_back_only_for_a_while() {
        let mut log = Log::new();
        // A's epoch stays open (its coordinator hangs) while node 4 waits for a and b.
        epoch(log.allocate(1, 1, &["a"]));
        assert!(is_busy(&log.allocate(4, 9, &["a", "b"]), "one writer"));
        let mut waited_ms = 100;
        while waited_ms + 1_000 < CLAIM_PRIORITY_MS {
            assert!(is_busy(&log.allocate(2, 1, &["b"]), "in turn"));
            assert!(is_busy(
                &log.allocate_after(900, 4, 9, &["a", "b"]),
                "one writer"
            ));
            waited_ms += 1_000;
        }
        // Node 4 still retries, but b is no longer held back for it.
        log.allocate_after(1_000, 4, 9, &["a", "b"]);
        epoch(log.allocate(2, 1, &["b"]));
    }

    #[test]
    fn a_claim_lapses_when_its_claimant_stops_retrying_or_fails() {
        let mut log = Log::new();
        epoch(log.allocate(1, 1, &["a"]));
        assert!(is_busy(&log.allocate(4, 9, &["a", "b"]), "one writer"));
        // Node 4 gave up (it stopped retrying): just before the claim's time is out, b is
        // still claimed; after it, b is free again.
        let waits = log.allocate_after(CLAIM_TTL_MS - 200, 2, 1, &["b"]);
        assert!(is_busy(&waits, "in turn"), "{waits:?}");
        // Node 2's own retries do not renew node 4's claim.
        let b = epoch(log.allocate_after(200, 2, 1, &["b"]));
        assert!(b > Epoch(0));

        // A claimant the cluster declares failed loses its claims at once.
        let mut log = Log::new();
        epoch(log.allocate(1, 1, &["a"]));
        assert!(is_busy(&log.allocate(4, 9, &["a", "b"]), "one writer"));
        log.state.nodes.get_mut(&NodeId(4)).expect("a member").alive = false;
        epoch(log.allocate(2, 1, &["b"]));
    }
}
