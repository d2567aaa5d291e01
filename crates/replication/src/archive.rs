//! The erasure-coded archive's protocols (Pond's archival storage, seed 004): making an
//! archived epoch, rebuilding a component from any `k` of its fragments, and rebuilding a
//! lost or damaged fragment from `k` others.
//!
//! | step | who | what |
//! |---|---|---|
//! | due | metadata leader | a tag pins a table's horizon below its retention: [`MetaState::archive_due`] |
//! | cut | each partition's primary | the rows a reader at the epoch sees, as one component ([`tessera_storage::Store::archive_partition`]), cut into `k + m` fragments ([`ErasureCode`]) |
//! | place | the primary | fragment `i` to the `i`th live storage node on the ring after the component's hash; each holder checks it against its hash and fsyncs it |
//! | record | leader | [`MetaCommand::RecordArchive`] once every partition's fragments are durable: only then may the horizon pass the epoch |
//! | read | any node | any `k` fragments that hash right, decoded, checked against the component's hash ([`reconstruct`]) |
//! | repair | a holder (scrub) or a new holder (a node gone too long) | [`rebuild_fragment`] from `k` others, checked against the recorded hash; [`MetaCommand::MoveFragment`] for a new holder |

use crate::wire::COMPONENT_CHUNK_BYTES;
use crate::Replication;
use arrow_flight::FlightData;
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tessera_common::{ComponentHash, Epoch, NodeId, PartitionId};
use tessera_meta::archive::{ArchivedComponent, ArchivedEpoch, ArchivedFragment};
use tessera_meta::{MetaCommand, MetaState};
use tessera_net::{CallError, Clients, Refusal, WireRequest};
use tessera_storage::archive::ErasureCode;

/// The leader asks a partition's primary to archive it ([`ArchivePartitionRequest`]).
pub const ACTION_ARCHIVE_PARTITION: &str = "archive-partition";
/// A node is asked to rebuild a fragment and keep it ([`RebuildFragmentRequest`]).
pub const ACTION_REBUILD_FRAGMENT: &str = "rebuild-fragment";

/// How long the leader waits for a primary to cut and place one partition.
const ARCHIVE_PATIENCE: Duration = Duration::from_secs(300);
/// How long a reader waits for one fragment.
const FRAGMENT_PATIENCE: Duration = Duration::from_secs(60);
/// Partitions archived at once.
const PARTITIONS_IN_FLIGHT: usize = 4;

/// Cut one partition of a table at an epoch and place its fragments.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ArchivePartitionRequest {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
    pub partition: PartitionId,
    pub data_fragments: u32,
    pub parity_fragments: u32,
    /// The live storage nodes, in id order: the ring the fragments are placed on.
    pub nodes: Vec<NodeId>,
}

/// Rebuild fragment `index` of `component` from the others and keep it here.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RebuildFragmentRequest {
    pub component: ArchivedComponent,
    pub index: u32,
}

/// The bytes of one fragment, in chunks (`data_body` only), checked by the caller.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FragmentRequest {
    pub hash: ComponentHash,
}

impl WireRequest for FragmentRequest {
    const KIND: &'static str = "Fragment";
}

/// A fragment to keep: its bytes follow in the stream's `data_body`s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoreFragmentRequest {
    pub hash: ComponentHash,
}

impl WireRequest for StoreFragmentRequest {
    const KIND: &'static str = "StoreFragment";
}

fn code_of(component: &ArchivedComponent) -> Result<ErasureCode, String> {
    ErasureCode::new(
        component.data_fragments as usize,
        component.parity_fragments as usize,
    )
    .map_err(|e| e.to_string())
}

/// The `count` nodes, of `nodes` (in id order), that hold the fragments of the component
/// named `hash`: consecutive on the ring from a place the hash picks.
pub fn placement(hash: &ComponentHash, nodes: &[NodeId], count: usize) -> Vec<NodeId> {
    assert!(nodes.len() >= count, "placement needs {count} nodes");
    let start = u64::from_le_bytes(hash.0[..8].try_into().expect("8 bytes")) as usize % nodes.len();
    (0..count)
        .map(|i| nodes[(start + i) % nodes.len()])
        .collect()
}

/// The storage nodes fragments may be placed on now: live members that hold partitions.
pub fn fragment_holders(state: &MetaState) -> Vec<NodeId> {
    state
        .nodes
        .values()
        .filter(|n| n.alive && !n.decommissioned && !n.leaving && !n.compute)
        .map(|n| n.id)
        .collect()
}

/// Archives every epoch due (the leader's duty): one at a time, each whole or not at all.
/// Returns what it could not do yet, and why.
pub async fn archive_due(node: &Arc<Replication>, data: u32, parity: u32) -> Vec<String> {
    let mut waiting = Vec::new();
    let due = node.meta.view().state.archive_due();
    for (table, generation, epoch) in due {
        if let Err(why) = archive_epoch(node, &table, generation, epoch, data, parity).await {
            tracing::warn!(%table, %epoch, %why, "archiving deferred");
            waiting.push(format!("table {table:?} at epoch {epoch}: {why}"));
        }
    }
    waiting
}

async fn archive_epoch(
    node: &Arc<Replication>,
    table: &str,
    generation: u64,
    epoch: Epoch,
    data: u32,
    parity: u32,
) -> Result<(), String> {
    let state = node.meta.view().state.clone();
    let nodes = fragment_holders(&state);
    let wanted = (data + parity) as usize;
    if nodes.len() < wanted {
        return Err(format!(
            "k = {data}, m = {parity} needs {wanted} live storage nodes to place fragments on; {} are live",
            nodes.len()
        ));
    }
    let requests: Vec<(String, ArchivePartitionRequest)> = (0..state.partition_count)
        .map(|p| {
            let placement = &state.map.partitions[p as usize];
            let primary = placement
                .primary
                .ok_or_else(|| format!("partition {p} has no primary"))?;
            let addr = node
                .meta
                .addr_of(primary)
                .ok_or_else(|| format!("node {primary} has no known address"))?;
            Ok((
                addr,
                ArchivePartitionRequest {
                    table: table.to_string(),
                    generation,
                    epoch,
                    partition: PartitionId(p),
                    data_fragments: data,
                    parity_fragments: parity,
                    nodes: nodes.clone(),
                },
            ))
        })
        .collect::<Result<_, String>>()?;
    let started = std::time::Instant::now();
    let calls: Vec<_> = requests
        .into_iter()
        .map(|(addr, request)| {
            let clients = node.clients.clone();
            async move {
                let partition = request.partition;
                clients
                    .action::<_, Result<Option<ArchivedComponent>, Refusal>>(
                        &addr,
                        ACTION_ARCHIVE_PARTITION,
                        request,
                        ARCHIVE_PATIENCE,
                    )
                    .await
                    .map_err(|e| format!("partition {partition} at {addr}: {e}"))?
                    .map_err(|e| format!("partition {partition} at {addr}: {e:?}"))
            }
        })
        .collect();
    let results: Vec<Result<Option<ArchivedComponent>, String>> = futures::stream::iter(calls)
        .buffer_unordered(PARTITIONS_IN_FLIGHT)
        .collect()
        .await;
    let mut components = results
        .into_iter()
        .filter_map(Result::transpose)
        .collect::<Result<Vec<_>, String>>()?;
    components.sort_by_key(|c| c.partition);
    let bytes: u64 = components.iter().map(|c| c.component.bytes).sum();
    node.meta
        .write_checked_as_leader(MetaCommand::RecordArchive {
            archived: ArchivedEpoch {
                table: table.to_string(),
                generation,
                epoch,
                components,
                next_change: None,
            },
        })
        .await
        .map_err(|e| format!("recording the archive: {e}"))?;
    tracing::info!(%table, %epoch, bytes, elapsed_ms = started.elapsed().as_millis() as u64, "epoch archived");
    Ok(())
}

/// A primary's part: cuts one partition at the epoch and places its fragments; `None` if
/// the partition had no rows then.
pub async fn archive_partition(
    node: &Arc<Replication>,
    request: ArchivePartitionRequest,
) -> Result<Option<ArchivedComponent>, String> {
    let code = ErasureCode::new(
        request.data_fragments as usize,
        request.parity_fragments as usize,
    )
    .map_err(|e| e.to_string())?;
    node.meta
        .wait_to_read(
            &request.table,
            request.generation,
            request.epoch,
            Duration::from_secs(30),
        )
        .await
        .map_err(|e| e.to_string())?;
    let store = node.store.clone();
    let (table, partition, epoch) = (request.table.clone(), request.partition, request.epoch);
    let cut = tokio::task::spawn_blocking(move || {
        let Some((component, bytes)) = store.archive_partition(&table, partition, epoch)? else {
            return Ok(None);
        };
        let fragments = code.encode(&bytes)?;
        Ok::<_, tessera_storage::StorageError>(Some((component, fragments)))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    let Some((component, fragments)) = cut else {
        return Ok(None);
    };
    if request.nodes.len() < code.fragments() {
        return Err(format!(
            "{} fragments need as many nodes; {} were given",
            code.fragments(),
            request.nodes.len()
        ));
    }
    let holders = placement(&component.hash, &request.nodes, code.fragments());
    let placed = futures::future::join_all(fragments.into_iter().zip(holders).enumerate().map(
        |(index, (bytes, holder))| {
            let node = node.clone();
            async move {
                let hash = ComponentHash::of_bytes(&bytes);
                store_fragment(&node, holder, hash, bytes)
                    .await
                    .map_err(|e| format!("fragment {index} to node {holder}: {e}"))?;
                Ok::<_, String>(ArchivedFragment {
                    index: index as u32,
                    node: holder,
                    hash,
                })
            }
        },
    ))
    .await
    .into_iter()
    .collect::<Result<Vec<_>, String>>()?;
    Ok(Some(ArchivedComponent {
        partition: request.partition,
        component,
        data_fragments: request.data_fragments,
        parity_fragments: request.parity_fragments,
        fragments: placed,
    }))
}

/// Keeps a fragment on `holder` (here, or sent there), durably.
async fn store_fragment(
    node: &Replication,
    holder: NodeId,
    hash: ComponentHash,
    bytes: Vec<u8>,
) -> Result<(), String> {
    if holder == node.id() {
        return receive_fragment(node, hash, bytes).await;
    }
    let addr = node
        .meta
        .addr_of(holder)
        .ok_or_else(|| format!("node {holder} has no known address"))?;
    let bytes = Bytes::from(bytes);
    let chunks: Vec<FlightData> = (0..bytes.len().max(1))
        .step_by(COMPONENT_CHUNK_BYTES)
        .map(|start| FlightData {
            data_body: bytes.slice(start..(start + COMPONENT_CHUNK_BYTES).min(bytes.len())),
            ..Default::default()
        })
        .collect();
    node.clients
        .put_flight(
            &addr,
            &StoreFragmentRequest { hash },
            futures::stream::iter(chunks),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A holder's part of [`store_fragment`] (this node's, or a peer's): the bytes, checked
/// against their name, kept durably.
pub async fn receive_fragment(
    node: &Replication,
    hash: ComponentHash,
    bytes: Vec<u8>,
) -> Result<(), String> {
    let store = node.store.clone();
    tokio::task::spawn_blocking(move || store.fragments().write(&hash, &bytes))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// The bytes of a fragment from `addr` (unchecked: the caller checks them).
pub async fn fetch_fragment(
    clients: &Clients,
    addr: &str,
    hash: ComponentHash,
) -> Result<Vec<u8>, CallError> {
    let mut stream = clients
        .get_messages(addr, &FragmentRequest { hash })
        .await?;
    let mut bytes = Vec::new();
    while let Some(data) = stream.next().await {
        bytes.extend_from_slice(&data?.data_body);
    }
    Ok(bytes)
}

/// What reading a component's fragments found: enough good ones, and the bad.
pub struct Gathered {
    pub fragments: Vec<(usize, Vec<u8>)>,
    /// Fragments that were missing, damaged or unreachable, and why.
    pub bad: Vec<(u32, NodeId, String)>,
}

/// Reads fragments of `component` (all at once, data fragments first to finish) until
/// `k` hash right, skipping `except`; the ones that did not, and why.
pub async fn gather(
    clients: &Arc<Clients>,
    addr_of: &(dyn Fn(NodeId) -> Option<String> + Sync),
    component: &ArchivedComponent,
    except: Option<u32>,
) -> Gathered {
    let needed = component.data_fragments as usize;
    let fetches = component
        .fragments
        .iter()
        .filter(|f| Some(f.index) != except)
        .map(|fragment| {
            let addr = addr_of(fragment.node);
            let (clients, fragment) = (clients.clone(), fragment.clone());
            let fetch = async move {
                let addr = addr.ok_or_else(|| "no known address".to_string())?;
                let bytes = tokio::time::timeout(
                    FRAGMENT_PATIENCE,
                    fetch_fragment(&clients, &addr, fragment.hash),
                )
                .await
                .map_err(|_| format!("no answer within {FRAGMENT_PATIENCE:?}"))?
                .map_err(|e| e.to_string())?;
                let actual = ComponentHash::of_bytes(&bytes);
                if actual != fragment.hash {
                    return Err(format!("its bytes hash to {actual}, not {}", fragment.hash));
                }
                Ok(bytes)
            };
            let (index, node) = (fragment.index, fragment.node);
            async move { (index, node, fetch.await) }
        })
        // Collected, so the stream holds no closures over borrowed data across awaits.
        .collect::<Vec<_>>();
    let mut in_flight = futures::stream::iter(fetches).buffer_unordered(component.fragments.len());
    let mut gathered = Gathered {
        fragments: Vec::new(),
        bad: Vec::new(),
    };
    while let Some((index, node, result)) = in_flight.next().await {
        match result {
            Ok(bytes) => gathered.fragments.push((index as usize, bytes)),
            Err(why) => gathered.bad.push((index, node, why)),
        }
        if gathered.fragments.len() >= needed {
            break;
        }
    }
    gathered
}

/// The component's bytes from any `k` of its fragments, checked against its hash; also
/// the fragments found bad on the way (the caller has them repaired).
pub async fn reconstruct(
    clients: &Arc<Clients>,
    addr_of: &(dyn Fn(NodeId) -> Option<String> + Sync),
    component: &ArchivedComponent,
) -> Result<(Vec<u8>, Vec<(u32, NodeId, String)>), String> {
    let code = code_of(component)?;
    let gathered = gather(clients, addr_of, component, None).await;
    let hash = component.component.hash;
    if gathered.fragments.len() < code.data {
        return Err(format!(
            "archived component {hash} (partition {}) cannot be rebuilt: {} of its {} fragments are readable and {} are needed ({})",
            component.partition,
            gathered.fragments.len(),
            code.fragments(),
            code.data,
            describe_bad(&gathered.bad)
        ));
    }
    let len = component.component.bytes;
    let bytes = tokio::task::spawn_blocking(move || code.decode(len, &gathered.fragments))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let actual = ComponentHash::of_bytes(&bytes);
    if actual != hash {
        return Err(format!(
            "archived component {hash} rebuilt from fragments hashes to {actual}"
        ));
    }
    Ok((bytes, gathered.bad))
}

fn describe_bad(bad: &[(u32, NodeId, String)]) -> String {
    bad.iter()
        .map(|(index, node, why)| format!("fragment {index} on node {node}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Rebuilds fragment `index` of `component` from `k` others and keeps it on this node,
/// after checking it against the recorded hash.
pub async fn rebuild_fragment(
    node: &Arc<Replication>,
    component: &ArchivedComponent,
    index: u32,
) -> Result<(), String> {
    let code = code_of(component)?;
    let expected = component
        .fragments
        .get(index as usize)
        .ok_or_else(|| {
            format!(
                "component {} has no fragment {index}",
                component.component.hash
            )
        })?
        .hash;
    let meta = node.meta.clone();
    let addr_of = move |id: NodeId| meta.addr_of(id);
    let gathered = gather(&node.clients, &addr_of, component, Some(index)).await;
    if gathered.fragments.len() < code.data {
        return Err(format!(
            "only {} other fragments of component {} are readable; {} are needed ({})",
            gathered.fragments.len(),
            component.component.hash,
            code.data,
            describe_bad(&gathered.bad)
        ));
    }
    let len = component.component.bytes;
    let store = node.store.clone();
    tokio::task::spawn_blocking(move || {
        let bytes = code.decode(len, &gathered.fragments)?;
        let fragment = code.encode(&bytes)?.swap_remove(index as usize);
        store.fragments().write(&expected, &fragment)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())
}

/// Moves the fragments held by `lost` nodes (failed longer than `rereplicate_after`) to
/// live storage nodes that hold none of the same component: each new holder rebuilds its
/// fragment, then the metadata records the move.
pub async fn rereplicate_fragments(node: &Arc<Replication>, lost: &BTreeSet<NodeId>) {
    if lost.is_empty() {
        return;
    }
    // One move at a time: the next choice sees the metadata the last one wrote.
    while let Some((component, index, target)) = next_fragment_move(&node.meta.view().state, lost) {
        let Some(addr) = node.meta.addr_of(target) else {
            return;
        };
        let hash = component.component.hash;
        let request = RebuildFragmentRequest { component, index };
        let rebuilt = node
            .clients
            .action::<_, Result<(), Refusal>>(
                &addr,
                ACTION_REBUILD_FRAGMENT,
                request,
                ARCHIVE_PATIENCE,
            )
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| format!("{e:?}")));
        if let Err(why) = rebuilt {
            tracing::warn!(component = %hash, index, %target, %why, "re-replicating a fragment failed; retrying later");
            return;
        }
        let moved = MetaCommand::MoveFragment {
            component: hash,
            index,
            to: target,
        };
        if let Err(why) = node.meta.write_checked_as_leader(moved).await {
            tracing::warn!(%why, "recording a moved fragment failed; retrying later");
            return;
        }
        tracing::info!(component = %hash, index, to = %target, "archive fragment re-replicated");
    }
}

/// A fragment on a lost node and the live storage node to rebuild it on (the first on
/// the component's ring that holds none of its fragments).
fn next_fragment_move(
    state: &MetaState,
    lost: &BTreeSet<NodeId>,
) -> Option<(ArchivedComponent, u32, NodeId)> {
    let live = fragment_holders(state);
    state
        .archived_components()
        .into_iter()
        .find_map(|component| {
            let fragment = component
                .fragments
                .iter()
                .find(|f| lost.contains(&f.node))?;
            let holding: BTreeSet<NodeId> = component.fragments.iter().map(|f| f.node).collect();
            let target = placement(&component.component.hash, &live, live.len())
                .into_iter()
                .find(|n| !holding.contains(n))?;
            Some((component.clone(), fragment.index, target))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_meta::NodeInfo;

    fn node(id: u64, compute: bool) -> NodeInfo {
        NodeInfo {
            id: NodeId(id),
            addr: format!("127.0.0.1:{id}"),
            alive: true,
            decommissioned: false,
            leaving: false,
            incarnation: 1,
            compute,
        }
    }

    /// Seven storage nodes and a compute node; one component with fragments on nodes 1..=6.
    fn archived_state() -> (MetaState, ComponentHash) {
        let mut state = MetaState::default();
        for id in 1..=7 {
            state.nodes.insert(NodeId(id), node(id, false));
        }
        state.nodes.insert(NodeId(8), node(8, true));
        let hash = ComponentHash::of_bytes(b"component");
        let component = ArchivedComponent {
            partition: PartitionId(0),
            component: tessera_storage::ComponentMeta {
                hash,
                rows: 1,
                bytes: 100,
                min_lsn: Default::default(),
                max_lsn: Default::default(),
                min_epoch: Epoch(1),
                max_epoch: Epoch(1),
                unique_keys: true,
                tombstones: 0,
                layout: 0,
                superseded_at: Default::default(),
            },
            data_fragments: 4,
            parity_fragments: 2,
            fragments: (0..6)
                .map(|i| ArchivedFragment {
                    index: i,
                    node: NodeId(i as u64 + 1),
                    hash: ComponentHash::of_bytes(&[i as u8]),
                })
                .collect(),
        };
        let archived = ArchivedEpoch {
            table: "t".into(),
            generation: 1,
            epoch: Epoch(1),
            components: vec![component],
            next_change: None,
        };
        state
            .archive
            .entry("t".into())
            .or_default()
            .insert(Epoch(1), archived);
        (state, hash)
    }

    #[test]
    fn placement_takes_consecutive_distinct_nodes_from_where_the_hash_points() {
        let nodes: Vec<NodeId> = (1..=7).map(NodeId).collect();
        for seed in 0..50u32 {
            let hash = ComponentHash::of_bytes(&seed.to_le_bytes());
            let placed = placement(&hash, &nodes, 6);
            let distinct: BTreeSet<NodeId> = placed.iter().copied().collect();
            assert_eq!(distinct.len(), 6, "{placed:?}");
            assert_eq!(placed, placement(&hash, &nodes, 6), "deterministic");
        }
    }

    #[test]
    fn a_lost_holders_fragment_moves_to_a_storage_node_holding_none_of_the_component() {
        let (mut state, hash) = archived_state();
        let lost = BTreeSet::from([NodeId(3)]);
        state.nodes.get_mut(&NodeId(3)).unwrap().alive = false;
        let (component, index, target) = next_fragment_move(&state, &lost).expect("a move");
        assert_eq!(
            (component.component.hash, index, target),
            (hash, 2, NodeId(7))
        );
        // With node 7 holding one too, no storage node is free (node 8 computes only).
        state
            .archive
            .get_mut("t")
            .unwrap()
            .get_mut(&Epoch(1))
            .unwrap()
            .components[0]
            .fragments[2]
            .node = NodeId(7);
        let lost = BTreeSet::from([NodeId(4)]);
        state.nodes.get_mut(&NodeId(4)).unwrap().alive = false;
        assert!(next_fragment_move(&state, &lost).is_none());
        // Nothing moves while no holder is lost.
        assert!(next_fragment_move(&state, &BTreeSet::new()).is_none());
    }
}
