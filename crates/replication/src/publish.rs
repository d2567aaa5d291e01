//! The publish coordinator. Any node coordinates: it checks and routes the rows, takes an
//! epoch (and the tables' ownership lease) from the metadata, has every live replica of each
//! touched partition log its rows durably (prepare), and then commits the epoch in Raft. An
//! epoch whose coordinator dies before the commit is aborted by the metadata leader, and
//! its prepared rows are discarded everywhere.

use crate::error::{PrepareFailed, ReplicationError, Result};
use crate::route::{change_counts, route, Routed};
use crate::wire::{Forward, PrepareRequest, PrepareRows, PreparedRows, PARTITION_COLUMN};
use crate::NodeId;
use crate::{Replication, WorkingOn};
use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Schema};
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tessera_common::{Epoch, PartitionId, ReadEpochs};
use tessera_meta::MetaError;
use tessera_meta::{MetaCommand, MetaResponse, MetaState, LINEARIZABLE_READ_PATIENCE};
use tessera_storage::{versions, StorageError, TableChanges};

/// Prepends the partition column to one partition's rows.
fn with_partition_column(partition: PartitionId, batch: &RecordBatch) -> Result<RecordBatch> {
    let mut fields = vec![Arc::new(Field::new(
        PARTITION_COLUMN,
        DataType::UInt32,
        false,
    ))];
    fields.extend(batch.schema().fields().iter().cloned());
    let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt32Array::from(vec![
        partition.0;
        batch.num_rows()
    ]))];
    columns.extend(batch.columns().iter().cloned());
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

/// One prepare stream: the rows of some partitions of a table (upserts, deletes or before
/// images) for the head of their log shipping, which logs them and ships them on to the
/// partitions' other replicas.
struct Shipment {
    /// The partitions' primary (or another current replica where it is left out). Where
    /// that is this node, the rows are logged here, without a hop over the network to
    /// itself (and under mutual TLS, without encrypting them to itself).
    head: NodeId,
    request: PrepareRequest,
    partitions: Vec<PartitionId>,
    batches: Vec<RecordBatch>,
    /// Replica → the partitions of this shipment it logs.
    replicas: BTreeMap<NodeId, Vec<PartitionId>>,
    /// The publish cannot go on without these targets (the head among them): they are the
    /// last current replicas of one of its partitions, so each is waited for up to the
    /// open-epoch timeout rather than given up when it stalls.
    last_copies: BTreeSet<NodeId>,
}

/// How many times a publish is retried with a new epoch (the aborted one is never
/// visible): after this node was declared failed while it coordinated (a false suspicion: a
/// node starved of CPU misses heartbeats), or after a partition primary died while logging
/// the rows (the retry logs them on the replica promoted in its place).
const RETRIES: usize = 3;

/// How long an acknowledgement waits for the open epochs below a committed one to be
/// decided. They end by their coordinators' commits or aborts, or are aborted when a
/// coordinator is declared failed or stops renewing them.
const VISIBLE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// Publishes `changes` as one epoch across the cluster; returns once it is committed and
/// visible.
///
/// Visible, not only committed: the visible epoch is the prefix of decided epochs, and a
/// query reads at it, so an epoch committed while an earlier one (another table's) is still
/// open would be missed by a read started after its acknowledgement (a stale read).
///
/// `publisher` is the user it is published for (`None`: the operator): the metadata
/// refuses the epoch unless that user may publish to every table (see
/// `tessera_meta::access`), and records who published it. `read_at` names the epoch the
/// statement behind the changes read each table at, if it computed them from what it read
/// (an UPDATE, a DELETE): the publish is refused, as a write conflict, if one of those
/// tables changed since (see `tessera_meta::state::write_conflicts`).
pub async fn publish(
    node: &Arc<Replication>,
    changes: Vec<TableChanges>,
    publisher: Option<&str>,
    read_at: &ReadEpochs,
) -> Result<Epoch> {
    let started = std::time::Instant::now();
    let tables: Vec<String> = changes.iter().map(|c| c.table.clone()).collect();
    let (rows, bytes) = changes
        .iter()
        .flat_map(|c| c.upserts.iter().chain(&c.deletes))
        .fold((0, 0), |(rows, bytes), batch| {
            (
                rows + batch.num_rows() as u64,
                bytes + versions::rows_bytes(batch) as u64,
            )
        });
    let result = async {
        refuse_oversized(node, bytes as usize)?;
        let epoch = publish_committed(node, changes, publisher, read_at).await?;
        let committed_at = started.elapsed();
        wait_visible(node, epoch).await?;
        tracing::debug!(
            %epoch,
            committed_ms = committed_at.as_millis() as u64,
            visible_ms = started.elapsed().as_millis() as u64,
            "publish visible"
        );
        Ok(epoch)
    }
    .await;
    record_recent(RecentPublish {
        epoch: result.as_ref().ok().map(|e| e.0),
        tables: tables.clone(),
        rows,
        bytes,
        elapsed_ms: started.elapsed().as_millis() as u64,
        at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        error: result.as_ref().err().map(ToString::to_string),
    });
    let metrics = tessera_common::metrics::metrics();
    let outcome = match &result {
        Ok(_) => {
            metrics.publish_rows.inc_by(rows);
            metrics.publish_bytes.inc_by(bytes);
            tessera_common::metrics::observe_seconds(&metrics.publish_seconds, started.elapsed());
            "acknowledged"
        }
        Err(ReplicationError::Aborted { .. } | ReplicationError::CommitRefused { .. }) => "aborted",
        Err(_) => "failed",
    };
    tessera_common::metrics::count(&metrics.publishes, "outcome", outcome);
    result
}

/// Refuses a publish of more than `store.max_publish_bytes` of Arrow data, as a single
/// store does: its coordinator holds its rows as given and as routed, and its replicas
/// while they log them, so one that does not fit would take a node down for memory rather
/// than fail by itself.
pub fn refuse_oversized(node: &Replication, bytes: usize) -> Result<()> {
    let limit = node.store.config().max_publish_bytes;
    if bytes > limit {
        return Err(StorageError::PublishTooLarge { bytes, limit }.into());
    }
    Ok(())
}

/// Publishes kept after they end, for the console.
const RECENT_PUBLISHES_KEPT: usize = 30;

/// A publish this node coordinated, as the console lists it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecentPublish {
    /// The epoch it became; `None` if it failed.
    pub epoch: Option<u64>,
    pub tables: Vec<String>,
    pub rows: u64,
    /// Arrow bytes of its rows.
    pub bytes: u64,
    pub elapsed_ms: u64,
    /// When it ended, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub error: Option<String>,
}

static RECENT_PUBLISHES: std::sync::LazyLock<
    std::sync::Mutex<std::collections::VecDeque<RecentPublish>>,
> = std::sync::LazyLock::new(Default::default);

fn record_recent(publish: RecentPublish) {
    let mut recent = RECENT_PUBLISHES.lock().expect("recent publishes lock");
    recent.push_front(publish);
    recent.truncate(RECENT_PUBLISHES_KEPT);
}

/// The publishes this node (process) coordinated most recently, newest first.
pub fn recent_publishes() -> Vec<RecentPublish> {
    RECENT_PUBLISHES
        .lock()
        .expect("recent publishes lock")
        .iter()
        .cloned()
        .collect()
}

/// Waits until this node's metadata shows `epoch` visible (every epoch below it decided).
async fn wait_visible(node: &Arc<Replication>, epoch: Epoch) -> Result<()> {
    if node
        .meta
        .wait_until(VISIBLE_PATIENCE, |view| view.state.visible >= epoch)
        .await
    {
        return Ok(());
    }
    let view = node.meta.view();
    let undecided = view
        .state
        .open
        .keys()
        .copied()
        .find(|&open| open < epoch)
        .unwrap_or(view.state.visible.next());
    Err(ReplicationError::CommittedNotVisible {
        epoch,
        undecided,
        waited: VISIBLE_PATIENCE,
    })
}

/// Publishes `changes` as one epoch across the cluster; returns once it is committed.
async fn publish_committed(
    node: &Arc<Replication>,
    changes: Vec<TableChanges>,
    publisher: Option<&str>,
    read_at: &ReadEpochs,
) -> Result<Epoch> {
    let state = node
        .meta
        .read_linearizable(LINEARIZABLE_READ_PATIENCE)
        .await?
        .state
        .clone();
    let tables: Vec<String> = changes.iter().map(|c| c.table.clone()).collect();
    crate::seal::check_can_sign(node, &state, &tables, publisher)?;
    // Routing is CPU work proportional to the rows; keep it off the threads that answer
    // heartbeats and Raft.
    let checked_reads = read_at.clone();
    let routing = std::time::Instant::now();
    let routed = tokio::task::spawn_blocking(move || route(&state, changes, &checked_reads))
        .await
        .map_err(ReplicationError::task("routing the rows"))??;
    tracing::debug!(
        routed_ms = routing.elapsed().as_millis() as u64,
        "routed the publish's rows"
    );
    let routed = Arc::new(routed);
    // Waiting here, before an epoch is taken, spares the cluster an epoch allocated only to
    // be aborted when a touched partition lacks copies (a replica catching up). If the
    // wait runs out, the attempt below is refused, naming the partition.
    let copies_patience_left = wait_for_copies(node, &routed).await;
    // Primaries that stalled on an earlier attempt: the next ones leave them out.
    let mut stalled_primaries: BTreeSet<NodeId> = BTreeSet::new();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match publish_routed(node, &routed, publisher, read_at, &stalled_primaries).await {
            Err(ReplicationError::Meta(MetaError::Fenced(reason))) if attempt <= RETRIES => {
                tracing::warn!(%reason, attempt, "publish fenced; retrying once this node is alive again");
                node.meta
                    .wait_until_alive(std::time::Duration::from_secs(10))
                    .await;
            }
            Err(ReplicationError::PrimaryLost {
                node: lost,
                epoch,
                reason,
            }) if attempt <= RETRIES => {
                tracing::warn!(node = lost.0, %epoch, %reason, attempt, "a primary was lost mid-publish; retrying once the metadata has a new one");
                wait_for_new_primary(node, lost, &routed).await;
            }
            Err(ReplicationError::PrimaryStalled {
                node: stalled,
                epoch,
                reason,
            }) if attempt <= RETRIES => {
                // Alive to the cluster, so no new primary is coming: the next attempt goes
                // to another current replica, and this one misses the epoch (it is marked
                // stale, so no longer primary, and catches up once it makes progress).
                tracing::warn!(node = stalled.0, %epoch, %reason, attempt, "the head of a partition's log shipping made no progress; publishing again without it");
                stalled_primaries.insert(stalled);
            }
            Err(ReplicationError::TooFewCopies { partition, .. })
                if attempt <= RETRIES
                    && copies_patience_left
                    && wait_for_copies(node, &routed).await =>
            {
                tracing::warn!(%partition, attempt, "a partition had too few current replicas; publishing again now that it has enough");
            }
            Err(ReplicationError::CommitRefused { epoch, reason }) if attempt <= RETRIES => {
                // Aborted; the next attempt routes by a fresh view, to a complete replica.
                tracing::warn!(%epoch, %reason, attempt, "a commit was refused; publishing again");
            }
            done => return done,
        }
    }
}

/// Waits (up to twice the failure timeout) until `lost` is no primary of a partition the
/// publish touches: the metadata declared it failed, or had already failed its partitions
/// over and then seen it return (a healed partition), so a retry at once goes to the new
/// primaries instead of waiting for a verdict on a node that is alive again.
async fn wait_for_new_primary(node: &Replication, lost: NodeId, routed: &BTreeMap<String, Routed>) {
    let touched = touched_partitions(routed);
    node.meta
        .wait_until(node.settings.failure_timeout * 2, |view| {
            let failed = view.state.nodes.get(&lost).is_none_or(|n| !n.alive);
            failed
                || touched.iter().all(|partition| {
                    view.state.map.partitions[partition.0 as usize].primary != Some(lost)
                })
        })
        .await;
}

/// The partitions a publish writes rows to or deletes rows from.
fn touched_partitions(routed: &BTreeMap<String, Routed>) -> BTreeSet<PartitionId> {
    routed
        .values()
        .flat_map(|r| r.upserts.keys().chain(r.deletes.keys()))
        .copied()
        .collect()
}

/// How long a publish waits for a partition it touches to have enough current replicas
/// (`replicas.min_copies`) again: a replica catching up after a restart takes seconds; a
/// partition with replicas down for longer refuses the publish, naming them.
const COPIES_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits (up to [`COPIES_PATIENCE`]) until this node's metadata shows every partition the
/// publish touches with enough live replicas holding every committed epoch; false if not.
async fn wait_for_copies(node: &Replication, routed: &BTreeMap<String, Routed>) -> bool {
    let touched = touched_partitions(routed);
    node.meta
        .wait_until(COPIES_PATIENCE, |view| {
            touched.iter().all(|&p| {
                writable_replicas(&view.state, p, node.settings.min_copies, &BTreeSet::new())
                    .is_ok()
            })
        })
        .await
}

/// One attempt at publishing routed rows: an epoch, prepares on every live replica, commit.
async fn publish_routed(
    node: &Arc<Replication>,
    routed: &Arc<BTreeMap<String, Routed>>,
    publisher: Option<&str>,
    read_at: &ReadEpochs,
    left_out: &BTreeSet<NodeId>,
) -> Result<Epoch> {
    let started = std::time::Instant::now();
    let tables: Vec<String> = routed.keys().cloned().collect();
    let working = allocate_epoch(node, tables.clone(), publisher, read_at).await?;
    let span = tracing::info_span!("publish", epoch = %working.epoch(), ?tables);
    let publishing = publish_epoch(node, routed, working, publisher, left_out, started);
    tracing::Instrument::instrument(publishing, span).await
}

/// Prepares an allocated epoch's rows on every live replica, then commits it (or aborts it).
async fn publish_epoch(
    node: &Arc<Replication>,
    routed: &Arc<BTreeMap<String, Routed>>,
    working: WorkingOn<'_>,
    publisher: Option<&str>,
    left_out: &BTreeSet<NodeId>,
    started: std::time::Instant,
) -> Result<Epoch> {
    // The placement is read only now, under the lease: a partition move or a refresh of a
    // stale replica (which leases every table) has finished before it and cannot start
    // until this epoch is decided, so the replicas and their staleness hold until the commit.
    let allocated_at = started.elapsed();
    // Until it is dropped, committed or aborted or given up, heartbeats list the epoch.
    let epoch = working.epoch();
    let prepared = async {
        let view = node
            .meta
            .read_linearizable(LINEARIZABLE_READ_PATIENCE)
            .await?;
        // The version ids hash the rows while the replicas log them: the digests are CPU
        // work proportional to the rows, kept off the threads that answer Raft.
        let digests = {
            let (state, routed) = (view.state.clone(), routed.clone());
            let sealed = node.settings.version_ids;
            tokio::task::spawn_blocking(move || {
                let started = std::time::Instant::now();
                let digests = sealed
                    .then(|| crate::seal::digest_routed(&state, &routed, epoch))
                    .transpose();
                (digests, started.elapsed())
            })
        };
        let (missed, digests) = futures::join!(
            prepare_everywhere(node, &view.state, epoch, routed, left_out),
            digests
        );
        let (digests, hashed_in) = digests.map_err(ReplicationError::task("hashing the rows"))?;
        let digests = digests?;
        if digests.is_some() {
            tracing::debug!(%epoch, hashed_ms = hashed_in.as_millis() as u64, "hashed the publish's rows for its version ids");
        }
        let changes = change_counts(routed);
        let seal = match digests {
            Some(digests) => Some(crate::seal::seal(
                node,
                &view.state,
                epoch,
                publisher,
                &digests,
                &changes,
            )?),
            None => None,
        };
        Ok::<_, ReplicationError>((missed?, changes, seal))
    };
    let prepared = async {
        let (missed, changes, seal) = prepared.await?;
        let prepared_at = started.elapsed();
        let commit = MetaCommand::CommitEpoch {
            epoch,
            missed,
            changes: Some(changes),
            seal,
            min_copies: Some(node.settings.min_copies),
        };
        match node.meta.write(commit.clone()).await {
            // The metadata refused the commit for good (it would leave a partition with no
            // complete replica): the epoch is aborted below.
            Err(MetaError::Refused(reason)) => {
                Err(ReplicationError::CommitRefused { epoch, reason })
            }
            other => Ok((other, commit, prepared_at)),
        }
    };
    match prepared.await {
        Ok((committed, commit, prepared_at)) => {
            match committed {
                Ok(_) => {}
                // Aborted by the cluster (this node declared failed, or the epoch given
                // up): the caller publishes again.
                Err(fenced @ MetaError::Fenced(_)) => return Err(fenced.into()),
                Err(unknown) => resolve_commit(node, working, commit, unknown).await?,
            }
            tracing::info!(
                %epoch,
                allocated_ms = allocated_at.as_millis() as u64,
                prepared_ms = prepared_at.as_millis() as u64,
                committed_ms = started.elapsed().as_millis() as u64,
                "epoch committed"
            );
            Ok(epoch)
        }
        Err(error) => {
            let mut reason = error.to_string();
            match node
                .meta
                .write(MetaCommand::AbortEpoch {
                    epoch,
                    reason: reason.clone(),
                })
                .await
            {
                Ok(_) => {}
                // The cluster had aborted it already, and says why (a hand-over of one
                // of its tables): that, not the replicas' refusals it caused, is the story.
                Err(MetaError::Fenced(why)) => reason = why,
                Err(abort_error) => {
                    tracing::warn!(%epoch, %abort_error, "could not abort epoch; the leader aborts it once this node's heartbeat no longer lists it")
                }
            }
            Err(match error {
                lost @ (ReplicationError::PrimaryLost { .. }
                | ReplicationError::PrimaryStalled { .. }) => lost,
                refused @ ReplicationError::CommitRefused { .. } => refused,
                _ => ReplicationError::Aborted { epoch, reason },
            })
        }
    }
}

/// A commit whose write failed without a verdict (`error`: the metadata was unreachable,
/// or its leader changed, for longer than a write's patience): it may have committed, or
/// may yet. The epoch is given up, so the leader aborts it on this node's next heartbeat
/// unless it committed, and the commit is sent again (a commit is idempotent): Raft orders
/// the two, and its answer is the outcome. An epoch left open instead would hold its
/// tables' lease, and keep every later epoch invisible, until the open-epoch timeout (a
/// fault run saw one held 94 s).
async fn resolve_commit(
    node: &Arc<Replication>,
    working: WorkingOn<'_>,
    commit: MetaCommand,
    error: MetaError,
) -> Result<()> {
    let epoch = working.epoch();
    tracing::warn!(%epoch, %error, "the commit's outcome is unknown; giving the epoch up and asking the metadata");
    drop(working);
    match node.meta.write(commit).await {
        Ok(_) => Ok(()),
        // Aborted meanwhile, by the leader: the caller publishes again.
        Err(fenced @ MetaError::Fenced(_)) => Err(fenced.into()),
        Err(MetaError::Refused(reason)) => Err(ReplicationError::CommitRefused { epoch, reason }),
        Err(again) => Err(ReplicationError::CommitUnknown {
            epoch,
            reason: format!("{error}; asked again: {again}"),
        }),
    }
}

/// How long a publish waits for another writer of its tables (or a partition move) to finish.
const LEASE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// Takes an epoch and the ownership lease of `tables`, waiting while another writer holds
/// one of them; for `publisher`, if a user (see [`publish`]). Refused as a write conflict
/// if a table changed after the epoch `read_at` names for it.
pub async fn allocate_epoch<'a>(
    node: &'a Arc<Replication>,
    tables: Vec<String>,
    publisher: Option<&str>,
    read_at: &ReadEpochs,
) -> Result<WorkingOn<'a>> {
    let deadline = std::time::Instant::now() + LEASE_PATIENCE;
    let request: u64 = rand::random();
    // Listed by heartbeats from before it is sent: the leader then knows the epoch it opens
    // is being worked on before this node knows its number. Dropped on an error, the epoch
    // (if it opened after all) is given up, and the leader aborts it.
    let allocating = node.allocating(request);
    loop {
        let command = MetaCommand::AllocateEpoch {
            coordinator: node.id(),
            incarnation: node.incarnation(),
            tables: tables.clone(),
            request,
            read_at: read_at.clone(),
        };
        let command = match publisher {
            Some(user) => MetaCommand::As {
                user: user.to_string(),
                command: Box::new(command),
            },
            None => command,
        };
        match node.meta.write(command).await {
            Ok(MetaResponse::Epoch(epoch)) => return Ok(allocating.opened(epoch)),
            Ok(other) => {
                return Err(ReplicationError::Meta(MetaError::Raft(format!(
                    "unexpected reply {other:?} to an epoch allocation"
                ))))
            }
            Err(MetaError::TableBusy(reason)) if std::time::Instant::now() < deadline => {
                tracing::debug!(%reason, "waiting for the table lease");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Whether node `id` is a live member of the cluster that still holds data.
fn is_live(state: &MetaState, id: &NodeId) -> bool {
    state
        .nodes
        .get(id)
        .is_some_and(|n| n.alive && !n.decommissioned)
}

/// The replicas of `partition` a publish logs its rows on: the live ones holding every
/// committed epoch, but those `left_out`. Refused when they are fewer than `min_copies`
/// (at most the replica count): acknowledged with fewer, an epoch could be lost with one
/// disk.
pub(crate) fn writable_replicas(
    state: &MetaState,
    partition: PartitionId,
    min_copies: u32,
    left_out: &BTreeSet<NodeId>,
) -> Result<Vec<NodeId>> {
    let placement = &state.map.partitions[partition.0 as usize];
    let (stalled, current): (Vec<NodeId>, Vec<NodeId>) = placement
        .replicas
        .iter()
        .copied()
        .filter(|id| is_live(state, id) && !placement.stale.contains_key(id))
        .partition(|id| left_out.contains(id));
    let needed = tessera_meta::copies_needed(Some(min_copies), placement.replicas.len());
    if current.len() < needed && !stalled.is_empty() {
        // Only this publish's retry lacks them: not a partition short of replicas.
        return Err(ReplicationError::StalledCopies {
            partition,
            stalled,
            current,
            needed,
        });
    }
    if current.len() < needed {
        return Err(ReplicationError::TooFewCopies {
            partition,
            replicas: placement.replicas.clone(),
            current,
            needed,
        });
    }
    Ok(current)
}

/// The first partition that takes no publishes until another replica returns or catches
/// up: fewer of its live replicas hold every committed epoch than a publish needs
/// (`min_copies`). While there is one, only a rebalance lets publishes to it through.
pub fn partition_refusing_publishes(state: &MetaState, min_copies: u32) -> Option<PartitionId> {
    (0..state.map.partitions.len() as u32)
        .map(PartitionId)
        .find(|&p| writable_replicas(state, p, min_copies, &BTreeSet::new()).is_err())
}

/// Has every live, up-to-date replica of each touched partition log its rows: the rows go
/// to the head of the partition's log shipping (its primary, logging here without a
/// network hop where that is this node), which ships them on to the other replicas.
/// Returns the (partition, replica) pairs that did not log them (dead, stale or unreachable
/// replicas); fails with [`ReplicationError::PrimaryLost`] if a primary died before answering.
async fn prepare_everywhere(
    node: &Arc<Replication>,
    state: &MetaState,
    epoch: Epoch,
    routed: &BTreeMap<String, Routed>,
    left_out: &BTreeSet<NodeId>,
) -> Result<Vec<(PartitionId, NodeId)>> {
    let mut shipments: BTreeMap<(NodeId, String, PreparedRows), Shipment> = BTreeMap::new();
    let mut touched: BTreeSet<PartitionId> = BTreeSet::new();
    for (table, routed) in routed {
        for (kind, by_partition) in routed.by_kind() {
            for (&partition, batches) in by_partition {
                touched.insert(partition);
                let placement = &state.map.partitions[partition.0 as usize];
                let min_copies = node.settings.min_copies;
                let mut targets = writable_replicas(state, partition, min_copies, left_out)?;
                // The primary heads the shipping, so that the logging and forwarding of a
                // large publish spread over the nodes as its partitions' primaries do.
                if let Some(i) = targets.iter().position(|id| Some(*id) == placement.primary) {
                    targets[..=i].rotate_right(1);
                }
                let head = targets[0];
                let needed =
                    tessera_meta::copies_needed(Some(min_copies), placement.replicas.len());
                let last_copies = targets.len() <= needed;
                let rows: Vec<RecordBatch> = batches
                    .iter()
                    .map(|b| with_partition_column(partition, b))
                    .collect::<Result<_>>()?;
                let shipment = shipments
                    .entry((head, table.clone(), kind))
                    .or_insert_with(|| Shipment {
                        head,
                        request: PrepareRequest {
                            epoch,
                            table: table.clone(),
                            deletes: kind == PreparedRows::Deletes,
                            before_images: kind == PreparedRows::BeforeImages,
                            forward: Vec::new(),
                            as_logged: false,
                        },
                        partitions: Vec::new(),
                        batches: Vec::new(),
                        replicas: BTreeMap::new(),
                        last_copies: BTreeSet::new(),
                    });
                if last_copies {
                    shipment.last_copies.extend(targets.iter().copied());
                }
                shipment.partitions.push(partition);
                shipment.batches.extend(rows);
                for replica in &targets[1..] {
                    shipment
                        .replicas
                        .entry(*replica)
                        .or_default()
                        .push(partition);
                }
            }
        }
    }
    let sends = shipments.into_values().map(|mut shipment| async move {
        shipment.request.forward = shipment
            .replicas
            .iter()
            .map(|(node, partitions)| Forward {
                node: *node,
                partitions: partitions.clone(),
                last_copy: shipment.last_copies.contains(node),
            })
            .collect();
        let head = shipment.head;
        let batches = std::mem::take(&mut shipment.batches);
        // The head's own forwards give up after one `progress_timeout`; it then answers,
        // naming the replicas it gave up on, so the coordinator waits twice as long.
        let last_copy = shipment.last_copies.contains(&head);
        let usual = node.settings.progress_timeout * 2;
        let patience = crate::Patience::for_peer(last_copy, usual, &node.settings);
        let result = if head == node.id() {
            node.prepare_here_within_deadlines(&shipment.request, batches, patience)
                .await
        } else {
            node.prepare_within_deadlines(
                "a prepare",
                head,
                &shipment.request,
                PrepareRows::Batches(futures::stream::iter(batches).boxed()),
                patience,
            )
            .await
            .map(Ok)
        };
        (head, shipment.replicas, result)
    });
    let results = futures::future::join_all(sends).await;
    let mut failed: BTreeSet<(PartitionId, NodeId)> = BTreeSet::new();
    for (primary, replicas, result) in results {
        match result {
            // Logging here failed: this node's own error (its store refused the rows).
            Ok(Err(error)) => return Err(error),
            Ok(Ok(reply)) => {
                for replica in reply.unreachable {
                    let partitions = replicas.get(&replica).into_iter().flatten();
                    failed.extend(partitions.map(|p| (*p, replica)));
                }
            }
            Err(error @ PrepareFailed::Stalled { .. }) => {
                return Err(ReplicationError::PrimaryStalled {
                    node: primary,
                    epoch,
                    reason: error.to_string(),
                });
            }
            Err(error) if error.is_transport() => {
                node.suspect(primary);
                return Err(ReplicationError::PrimaryLost {
                    node: primary,
                    epoch,
                    reason: error.to_string(),
                });
            }
            Err(error) => {
                return Err(ReplicationError::Refused {
                    node: primary,
                    what: "an epoch's rows",
                    reason: error.to_string(),
                })
            }
        }
    }
    // Every replica that did not log the rows missed the epoch: dead or stale ones (not
    // sent any) and unreachable ones.
    let mut missed: BTreeSet<(PartitionId, NodeId)> = failed;
    for partition in touched {
        let placement = &state.map.partitions[partition.0 as usize];
        for id in &placement.replicas {
            if !is_live(state, id) || placement.stale.contains_key(id) || left_out.contains(id) {
                missed.insert((partition, *id));
            }
        }
    }
    Ok(missed.into_iter().collect())
}
