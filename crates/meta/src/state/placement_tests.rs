//! Placement in the metadata state machine: which replica is read (never a stale one),
//! the invariant check, and rebalances that must not switch to a map whose copies were
//! planned from stale marks.

use super::tests::{allocate, allocate_as, bootstrapped};
use super::*;

#[test]
fn a_replica_that_missed_an_epoch_is_not_read() {
    let mut state = bootstrapped(3);
    let epoch = allocate(&mut state, NodeId(2));
    state.apply(
        8,
        MetaCommand::CommitEpoch {
            epoch,
            missed: vec![(PartitionId(0), NodeId(1))],
            changes: None,
            seal: None,
            min_copies: None,
        },
    );
    assert_eq!(state.map.partitions[0].primary, Some(NodeId(2)));
    state.apply(
        9,
        MetaCommand::SetLiveness {
            id: NodeId(1),
            alive: true,
        },
    );
    assert_eq!(state.map.partitions[0].primary, Some(NodeId(2)));
}

#[test]
fn a_replica_holds_a_partition_through_an_epoch_only_if_it_missed_none_up_to_it() {
    // Four nodes, three replicas per partition: one node holds none of partition 0.
    let mut state = bootstrapped(4);
    let replicas = state.map.partitions[0].replicas.clone();
    let (kept, missing) = (replicas[0], replicas[1]);
    assert_eq!(state.holds_through(kept, PartitionId(0), Epoch(9)), Ok(()));
    state.map.partitions[0].stale.insert(missing, Epoch(5));
    // A stale mark from epoch 5 leaves every version below it in place.
    assert_eq!(
        state.holds_through(missing, PartitionId(0), Epoch(4)),
        Ok(())
    );
    let refused = state
        .holds_through(missing, PartitionId(0), Epoch(5))
        .unwrap_err();
    assert!(refused.contains("from epoch 5 on"), "{refused}");
    // Taken back empty: nothing is held at any epoch.
    state.map.partitions[0].stale.insert(missing, Epoch::ZERO);
    assert!(state
        .holds_through(missing, PartitionId(0), Epoch(1))
        .is_err());
    let outsider = (1..=4)
        .map(NodeId)
        .find(|id| !state.map.partitions[0].replicas.contains(id))
        .expect("a node that is no replica");
    let refused = state
        .holds_through(outsider, PartitionId(0), Epoch(1))
        .unwrap_err();
    assert!(
        refused.contains("is not a replica of partition"),
        "{refused}"
    );
    let unknown = state
        .holds_through(kept, PartitionId(99), Epoch(1))
        .unwrap_err();
    assert!(unknown.contains("has no partition"), "{unknown}");
}

#[test]
fn the_readers_of_a_partition_are_its_live_replicas_holding_the_epoch_primary_first() {
    let mut state = bootstrapped(4);
    let placement = state.map.partitions[0].clone();
    let primary = placement.primary.unwrap();
    let others: Vec<NodeId> = placement
        .replicas
        .iter()
        .copied()
        .filter(|&id| id != primary)
        .collect();
    assert_eq!(others.len(), 2);
    let readers = state.readers_at(PartitionId(0), Epoch(9));
    assert_eq!(readers[0], primary);
    assert_eq!(readers.len(), 3, "{readers:?}");
    // A replica stale from epoch 5 still reads epoch 4, not epoch 5.
    state.map.partitions[0].stale.insert(others[0], Epoch(5));
    assert!(state
        .readers_at(PartitionId(0), Epoch(4))
        .contains(&others[0]));
    assert!(!state
        .readers_at(PartitionId(0), Epoch(5))
        .contains(&others[0]));
    // A dead replica is no reader; a node moved off the partition is none either.
    state.nodes.get_mut(&others[1]).unwrap().alive = false;
    assert_eq!(state.readers_at(PartitionId(0), Epoch(5)), vec![primary]);
    state.map.partitions[0].replicas.retain(|&id| id != primary);
    state.map.partitions[0].primary = None;
    assert!(state.readers_at(PartitionId(0), Epoch(5)).is_empty());
    assert!(state.readers_at(PartitionId(99), Epoch(1)).is_empty());
}

#[test]
fn the_invariant_check_names_a_stale_primary_and_a_shared_lease() {
    let mut state = bootstrapped(3);
    assert_eq!(state.broken_invariant(), None);
    let mut stale = state.clone();
    let primary = stale.map.partitions[0].primary.unwrap();
    stale.map.partitions[0].stale.insert(primary, Epoch(4));
    assert!(
        stale.broken_invariant().is_some_and(
            |broken| broken.contains("partition 0's primary") && broken.contains("stale")
        )
    );
    let lease = |tables: &[&str]| OpenEpoch {
        coordinator: NodeId(1),
        incarnation: 0,
        tables: tables.iter().map(|t| t.to_string()).collect(),
        request: 0,
        publisher: None,
        allocated_at: 0,
    };
    state.open.insert(Epoch(7), lease(&["t"]));
    state.open.insert(Epoch(8), lease(&["u", "t"]));
    assert!(state
        .broken_invariant()
        .is_some_and(|broken| broken.contains("leased by open epochs 7 and 8")));
}

#[test]
fn an_aborted_rebalance_cannot_switch_the_map_and_clear_newer_stale_marks() {
    let mut state = bootstrapped(3);
    // A rebalance leases every table and computes its map: no replica is stale yet.
    let rebalance = allocate(&mut state, NodeId(1));
    let computed = state.map.clone();
    // Its coordinator is declared failed: the epoch is aborted, the leases freed.
    state.apply(
        4,
        MetaCommand::AbortEpoch {
            epoch: rebalance,
            reason: "coordinator declared failed".into(),
        },
    );
    // An epoch commits that node 3 missed on partition 0.
    let later = allocate_as(&mut state, NodeId(2), 0, 8);
    let MetaResponse::Epoch(later) = later else {
        panic!("{later:?}")
    };
    state.apply(
        5,
        MetaCommand::CommitEpoch {
            epoch: later,
            missed: vec![(PartitionId(0), NodeId(3))],
            changes: None,
            seal: None,
            min_copies: None,
        },
    );
    assert_eq!(state.map.partitions[0].stale.get(&NodeId(3)), Some(&later));
    // The old rebalance finishes its copies and tries to switch to its map.
    let (response, _) = state.apply(
        6,
        MetaCommand::SetPartitionMap {
            map: computed,
            rebalance: Some(rebalance),
        },
    );
    assert!(
        matches!(&response, MetaResponse::Refused(r) if r.contains("no longer open")),
        "{response:?}"
    );
    assert_eq!(
        state.map.partitions[0].stale.get(&NodeId(3)),
        Some(&later),
        "node 3 still counts as missing the epoch"
    );
}

#[test]
fn a_rebalance_planned_before_a_node_was_replaced_cannot_clear_its_whole_copy() {
    let mut state = bootstrapped(3);
    // Node 3 misses an epoch on partition 0: a delta from it would bring node 3 back.
    let missed = allocate(&mut state, NodeId(1));
    state.apply(
        4,
        MetaCommand::CommitEpoch {
            epoch: missed,
            missed: vec![(PartitionId(0), NodeId(3))],
            changes: None,
            seal: None,
            min_copies: None,
        },
    );
    assert_eq!(state.map.partitions[0].stale.get(&NodeId(3)), Some(&missed));
    // A rebalance leases every table and plans that delta: once it is copied, node 3's
    // replica is complete.
    let rebalance = allocate_as(&mut state, NodeId(1), 0, 8);
    let MetaResponse::Epoch(rebalance) = rebalance else {
        panic!("{rebalance:?}")
    };
    let mut computed = state.map.clone();
    computed.partitions[0].stale.remove(&NodeId(3));
    // Meanwhile node 3 comes back with its disk wiped: it needs every epoch again.
    let (replaced, _) = state.apply(5, MetaCommand::ReplaceNode { id: NodeId(3) });
    assert_eq!(replaced, MetaResponse::Done);
    assert_eq!(
        state.map.partitions[0].stale.get(&NodeId(3)),
        Some(&Epoch::ZERO)
    );
    // The delta ends and the rebalance tries to switch to its map: refused, since the
    // delta lacks every epoch before the one node 3 had missed.
    let (response, _) = state.apply(
        6,
        MetaCommand::SetPartitionMap {
            map: computed,
            rebalance: Some(rebalance),
        },
    );
    assert!(
        matches!(&response, MetaResponse::Refused(r) if r.contains("lost its data")),
        "{response:?}"
    );
    assert_eq!(
        state.map.partitions[0].stale.get(&NodeId(3)),
        Some(&Epoch::ZERO),
        "node 3 still needs a whole copy"
    );
    // A rebalance planned after the replacement switches its map.
    state.apply(
        7,
        MetaCommand::AbortEpoch {
            epoch: rebalance,
            reason: "its map was refused".into(),
        },
    );
    let again = allocate_as(&mut state, NodeId(1), 0, 9);
    let MetaResponse::Epoch(again) = again else {
        panic!("{again:?}")
    };
    let mut copied = state.map.clone();
    copied.partitions[0].stale.remove(&NodeId(3));
    let (switched, _) = state.apply(
        8,
        MetaCommand::SetPartitionMap {
            map: copied,
            rebalance: Some(again),
        },
    );
    assert_eq!(switched, MetaResponse::Done);
}
