//! Component replication to cold standbys, and the checkpoints it coordinates.
//!
//! A cold standby (the default; see `hot_standby` in `node.toml`) logs the rows of the
//! partitions it replicates but neither applies, flushes nor merges them. Instead:
//!
//! - After a checkpoint, a primary tells the standbys of each partition whose components
//!   changed ([`announce`]); each pulls the partition's component list and the epoch it
//!   covers, fetches the components it lacks by hash, and swaps them in
//!   ([`pull_from_primaries`]). The rows it logged up to that epoch are then unnecessary, and
//!   its old components (merge inputs among them) are deleted only after their replacements
//!   arrived.
//! - Before a standby truncates its own log (its [`checkpoint`]), it asks the primaries of
//!   the partitions whose logged rows are not yet covered to flush first, and pulls their
//!   components, so its log replay at promotion stays bounded by its own checkpoints. Rows
//!   committed while they flushed (a publish under way) are asked for again, a few rounds
//!   at most, and if some still are not covered, this checkpoint keeps the log for them
//!   (up to twice its usual size): applying them here would decode and flush on every
//!   standby what the primary flushes anyway (a profiled TPC-H SF 1 load at r = 3 spent a
//!   tenth of the cluster's CPU replaying such rows, before their flush). What a primary
//!   that did not answer has not covered, or what outgrew that bound, the store applies
//!   and flushes itself: no logged row is ever dropped uncovered.

use crate::error::{ReplicationError, Result};
use crate::wire::{
    ComponentsRequest, ShippedManifest, ACTION_COMPONENTS_READY, ACTION_FLUSH,
    ACTION_SHIPPED_MANIFEST,
};
use crate::NodeId;
use crate::Replication;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tessera_common::PartitionId;
use tessera_net::Refusal;

/// How long a standby waits for a primary to flush before it applies its log itself.
const FLUSH_PATIENCE: Duration = Duration::from_secs(120);
/// How many times a checkpoint asks the primaries of its lagging standby partitions to
/// flush before it applies what is still uncovered itself.
const FLUSH_ROUNDS: usize = 3;
/// How long a primary waits for a standby to take its announcement.
const ANNOUNCE_PATIENCE: Duration = Duration::from_secs(2);

/// One partition of one table generation.
pub type TablePartition = (String, u64, PartitionId);

/// Runs a checkpoint on this node, coordinated with the primaries of its standby partitions
/// and followed by shipping its own new components to its standbys.
pub async fn checkpoint(node: &Arc<Replication>) -> Result<()> {
    let mut primaries_answered = true;
    for round in 1..=FLUSH_ROUNDS {
        let lagging = lagging_by_primary(node);
        if lagging.is_empty() {
            break;
        }
        tracing::debug!(
            round,
            primaries = lagging.len(),
            "checkpoint: asking primaries of lagging standby partitions to flush"
        );
        if !flush_and_pull(node, lagging).await {
            // A primary that did not answer: its rows are applied here, not asked again.
            primaries_answered = false;
            break;
        }
        // Rows committed while the primaries flushed (a publish under way) are not covered
        // yet: asked for again, a few rounds at most.
    }
    // Rows still uncovered though every primary answered came after (publishes go on):
    // the log keeps them for the primaries' next components, up to its bound, rather than
    // this node applying and flushing them as their primaries do.
    let keep_log = primaries_answered
        && !lagging_by_primary(node).is_empty()
        && !node.store.log_outgrew_its_checkpoints();
    node.on_store("the checkpoint", move |store| {
        if keep_log {
            store.checkpoint_keeping_log()
        } else {
            store.checkpoint()
        }
    })
    .await?;
    announce(node).await;
    Ok(())
}

/// Asks each primary of `lagging` to flush, and pulls the components it shipped. False if
/// a primary did not flush: the checkpoint applies its rows here.
async fn flush_and_pull(
    node: &Arc<Replication>,
    lagging: BTreeMap<NodeId, Vec<TablePartition>>,
) -> bool {
    let mut all_answered = true;
    for (primary, partitions) in lagging {
        let Some(addr) = node.meta.addr_of(primary) else {
            all_answered = false;
            continue;
        };
        let flushed: Result<()> =
            call(node, primary, &addr, ACTION_FLUSH, (), FLUSH_PATIENCE).await;
        if let Err(error) = flushed {
            tracing::warn!(primary = primary.0, %error, "a primary did not flush for this node's checkpoint; applying its logged rows here");
            all_answered = false;
            continue;
        }
        if let Err(error) = pull_from_primaries(node, partitions).await {
            // It answered: what failed is most often a component its merge replaced
            // between its manifest and the fetch. The next round asks for the new one.
            tracing::info!(primary = primary.0, %error, "could not take a primary's components; asking again");
        }
    }
    all_answered
}

/// The partitions holding logged rows no component covers yet, by their primary.
fn lagging_by_primary(node: &Arc<Replication>) -> BTreeMap<NodeId, Vec<TablePartition>> {
    let view = node.meta.view();
    let mut lagging: BTreeMap<NodeId, Vec<TablePartition>> = BTreeMap::new();
    for (table, partition) in node.store.standby_lag() {
        let Some(def) = view.state.tables.get(&table) else {
            continue;
        };
        let placement = &view.state.map.partitions[partition.0 as usize];
        if let Some(primary) = placement.primary.filter(|p| *p != node.id()) {
            lagging
                .entry(primary)
                .or_default()
                .push((table, def.generation, partition));
        }
    }
    lagging
}

/// Tells the standbys of every partition this node is primary of, and whose components
/// changed since the last announcement, to pull them.
pub async fn announce(node: &Arc<Replication>) {
    let view = node.meta.view();
    let mut by_standby: BTreeMap<NodeId, Vec<TablePartition>> = BTreeMap::new();
    for (table, def) in &view.state.tables {
        for (i, placement) in view.state.map.partitions.iter().enumerate() {
            if placement.primary != Some(node.id()) {
                continue;
            }
            let partition = PartitionId(i as u32);
            let Ok((components, _)) = node.store.shipped_manifest(table, partition) else {
                continue;
            };
            let hashes: Vec<_> = components.iter().map(|c| c.hash).collect();
            if !node.note_shipped(table, partition, hashes) {
                continue;
            }
            for standby in placement.replicas.iter().filter(|r| {
                **r != node.id()
                    && !placement.stale.contains_key(r)
                    && view.state.nodes.get(r).is_some_and(|n| n.alive)
            }) {
                by_standby.entry(*standby).or_default().push((
                    table.clone(),
                    def.generation,
                    partition,
                ));
            }
        }
    }
    for (standby, partitions) in by_standby {
        let Some(addr) = node.meta.addr_of(standby) else {
            continue;
        };
        let request = ComponentsRequest { partitions };
        let sent: Result<()> = call(
            node,
            standby,
            &addr,
            ACTION_COMPONENTS_READY,
            request,
            ANNOUNCE_PATIENCE,
        )
        .await;
        if let Err(error) = sent {
            // It pulls at its own next checkpoint instead.
            tracing::debug!(standby = standby.0, %error, "a standby did not take a component announcement");
        }
    }
}

/// Pulls the components of `partitions` from their current primaries and installs them.
/// Returns how many partitions changed.
pub async fn pull_from_primaries(
    node: &Arc<Replication>,
    partitions: Vec<TablePartition>,
) -> Result<usize> {
    let mut installed = 0;
    for (table, generation, partition) in partitions {
        let view = node.meta.view();
        let Some(primary) = primary_to_pull(&view.state, &table, generation, partition, node.id())
        else {
            continue;
        };
        let addr = node.meta.require_addr(primary)?;
        let request = (table.clone(), generation, partition);
        let shipped: ShippedManifest = call(
            node,
            primary,
            &addr,
            ACTION_SHIPPED_MANIFEST,
            request,
            FLUSH_PATIENCE,
        )
        .await?;
        let fetched =
            crate::rebalance::fetch_missing_components(node, &addr, &shipped.components, None)
                .await
                .map_err(|e| ReplicationError::Copy {
                    from: primary,
                    reason: format!("a shipped component: {e}"),
                })?;
        let (table_name, covered) = (table.clone(), shipped.covered);
        let changed = node
            .on_store("installing shipped components", move |store| {
                store.install_shipped_components(
                    &table,
                    partition,
                    shipped.components,
                    fetched,
                    shipped.covered,
                )
            })
            .await?;
        tracing::debug!(table = %table_name, %partition, primary = primary.0, %covered, changed, "pulled a primary's components");
        installed += usize::from(changed);
    }
    Ok(installed)
}

/// The primary to pull a partition's components from, as this node's metadata knows it:
/// none if the table is gone or replaced, the partition unknown (a wiped node taken back is
/// told of checkpoints before its metadata has caught up; the next one retries), or this
/// node is the primary itself.
fn primary_to_pull(
    state: &tessera_meta::MetaState,
    table: &str,
    generation: u64,
    partition: PartitionId,
    me: NodeId,
) -> Option<NodeId> {
    let current = state
        .tables
        .get(table)
        .is_some_and(|def| def.generation == generation);
    let placement = state.map.partitions.get(partition.0 as usize)?;
    placement.primary.filter(|p| current && *p != me)
}

/// One node-to-node action whose reply may be a refusal.
async fn call<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
    node: &Replication,
    target: NodeId,
    addr: &str,
    kind: &'static str,
    body: Req,
    patience: Duration,
) -> Result<Resp> {
    let reply: std::result::Result<Resp, Refusal> = node
        .clients
        .action(addr, kind, body, patience)
        .await
        .map_err(|e| ReplicationError::Unreachable {
            node: target,
            addr: addr.to_string(),
            reason: e.to_string(),
        })?;
    reply.map_err(|refusal| ReplicationError::Refused {
        node: target,
        what: kind,
        reason: format!("{refusal:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wiped node taken back hears of a checkpoint before its metadata knows any
    /// partition: there is nothing to pull yet (it once panicked indexing the empty map).
    #[test]
    fn a_partition_the_metadata_does_not_know_yet_is_not_pulled() {
        let empty = tessera_meta::MetaState::default();
        assert!(empty.map.partitions.is_empty());
        assert_eq!(
            primary_to_pull(&empty, "kv", 1, PartitionId(0), NodeId(3)),
            None
        );
    }
}
