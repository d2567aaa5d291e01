//! `tessera verify`: checks, from the data every replica holds, that the cluster stores
//! exactly what its publishers signed (Pond's self-verifying versions).
//!
//! For each table:
//! - **the chain**: each sealed epoch's version id follows the one before it, and the last
//!   is the table's head in the metadata (a record removed or forged breaks it);
//! - **the signatures**: each record checks against its participant's registered key as
//!   it is stored now (a record edited after the fact does not);
//! - **the data**: every up-to-date replica recomputes the change digest of each epoch
//!   from its own components (each checked against its hash) and memory; per epoch, the
//!   replicas' digests must rebuild the signed version id. A replica whose digests do not
//!   (a flipped byte, a component dropped from or added to a manifest, rows of an aborted
//!   epoch) is corrupt: it is refused and copied whole from a good replica.
//!
//! Epochs at or below a table's retention horizon may have been merged away, so only their
//! chain and signatures are checked.

use crate::meta::{
    EpochRecord, MetaCommand, MetaState, SignatureStatus, LINEARIZABLE_READ_PATIENCE,
};
use crate::node::Node;
use crate::rpc::{CallError, Refusal};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tessera_common::{ComponentHash, Epoch, NodeId, PartitionId};
use tessera_storage::digest::{table_version_id, DigestFormat};

/// A node's change digests of the partitions it holds ([`DigestsRequest`]).
pub const ACTION_PARTITION_DIGESTS: &str = "partition-digests";
/// A client asks a node to verify the cluster ([`VerifyRequest`]).
pub const ACTION_VERIFY: &str = "verify";

/// How long one node may take to hash its replicas of one table.
const DIGEST_PATIENCE: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DigestsRequest {
    pub table: String,
    pub partitions: Vec<PartitionId>,
    /// The replica first waits until it has applied every epoch through this one (the
    /// visible epoch the check reads), so a replica that is merely behind is not taken
    /// for a corrupt one.
    pub through: Epoch,
    /// The sealed epochs whose change digests are in a format other than the first, and
    /// which (every other epoch is hashed in the first).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub formats: BTreeMap<Epoch, DigestFormat>,
}

/// How long a replica waits to apply the epochs a check reads.
const CATCH_UP_PATIENCE: Duration = Duration::from_secs(30);

/// One replica's change digests of one partition, by epoch, or why it could not make them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartitionDigests {
    pub partition: PartitionId,
    pub horizon: Epoch,
    pub digests: Result<Vec<(Epoch, ComponentHash)>, Unreadable>,
    /// The digests are in the formats the request named. A node from before formats were
    /// named hashes every epoch in the first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub formats_followed: bool,
}

/// Why a replica could not hash a partition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Unreadable {
    /// Its bytes are damaged or missing (a component that does not hash to its name, an
    /// undecodable file): the replica is corrupt. Otherwise it could not answer now.
    pub damaged: bool,
    pub reason: String,
}

fn unreadable(error: tessera_storage::StorageError) -> Unreadable {
    use tessera_storage::StorageError as E;
    let damaged = matches!(
        error,
        E::CorruptComponent { .. } | E::MissingComponent { .. } | E::Parquet { .. } | E::Io { .. }
    );
    Unreadable {
        damaged,
        reason: error.to_string(),
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VerifyRequest {
    /// Only this table (every table if `None`).
    pub table: Option<String>,
    /// Only this epoch's data and signature (the chains are always checked whole).
    pub epoch: Option<Epoch>,
    /// Refuse corrupt replicas and have them copied again.
    pub repair: bool,
}

/// What one table's check found.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableVerdict {
    pub table: String,
    /// The version id at the newest sealed epoch.
    pub head: ComponentHash,
    /// Sealed epochs on its chain.
    pub epochs: usize,
    /// Of those, signed with a valid signature.
    pub signed: usize,
    /// Epochs whose data was recomputed from the replicas.
    pub data_checked: usize,
    /// Replicas (node, partition) whose digests took part.
    pub replicas: usize,
    pub horizon: Epoch,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Everything visible at this epoch when the check started was checked.
    pub visible: Epoch,
    pub tables: Vec<TableVerdict>,
    /// Every mismatch, the first one first.
    pub problems: Vec<String>,
    /// Replicas not checked, and why (a node down or unreachable).
    pub skipped: Vec<String>,
    /// Corrupt replicas refused, to be copied again.
    pub repairs: Vec<String>,
}

/// This node's digests of the asked partitions of a table.
pub async fn local_digests(node: &Arc<Node>, request: DigestsRequest) -> Vec<PartitionDigests> {
    let through = request.through;
    let caught_up = node
        .meta
        .wait_until(CATCH_UP_PATIENCE, |view| view.state.visible >= through)
        .await;
    if !caught_up {
        let behind = Unreadable {
            damaged: false,
            reason: format!(
                "node {} has not applied epoch {through} after {CATCH_UP_PATIENCE:?}",
                node.id()
            ),
        };
        return request
            .partitions
            .iter()
            .map(|&partition| PartitionDigests {
                partition,
                horizon: Epoch::ZERO,
                digests: Err(behind.clone()),
                formats_followed: true,
            })
            .collect();
    }
    let store = node.store.clone();
    let work = move || {
        let format_of = |epoch| {
            request
                .formats
                .get(&epoch)
                .copied()
                .unwrap_or(DigestFormat::Rows)
        };
        request
            .partitions
            .iter()
            .map(|&partition| {
                let (horizon, digests) =
                    match store.partition_digests(&request.table, partition, &format_of) {
                        Ok((horizon, digests)) => (horizon, Ok(digests.into_iter().collect())),
                        Err(error) => (Epoch::ZERO, Err(unreadable(error))),
                    };
                PartitionDigests {
                    partition,
                    horizon,
                    digests,
                    formats_followed: true,
                }
            })
            .collect()
    };
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| panic!("hashing replicas panicked: {e}"))
}

/// A corrupt replica and the first reason found.
type Corrupt = BTreeMap<(NodeId, PartitionId), String>;

/// Checks the cluster as [`VerifyRequest`] asks (see the module's comment).
pub async fn verify(node: &Arc<Node>, request: VerifyRequest) -> Result<VerifyReport, String> {
    let view = node
        .meta
        .read_linearizable(LINEARIZABLE_READ_PATIENCE)
        .await
        .map_err(|e| e.to_string())?;
    let state = view.state.clone();
    let tables: Vec<String> = match &request.table {
        Some(table) if !state.tables.contains_key(table) => {
            return Err(format!("table {table:?} does not exist"))
        }
        Some(table) => vec![table.clone()],
        None => state.tables.keys().cloned().collect(),
    };
    let mut report = VerifyReport {
        visible: state.visible,
        tables: Vec::new(),
        problems: Vec::new(),
        skipped: Vec::new(),
        repairs: Vec::new(),
    };
    let mut corrupt = Corrupt::new();
    for table in tables {
        let verdict = verify_table(node, &state, &table, &request, &mut report, &mut corrupt).await;
        report.tables.push(verdict);
    }
    if request.repair {
        for ((replica, partition), reason) in corrupt {
            let command = MetaCommand::MarkCorrupt {
                node: replica,
                partition,
                reason: reason.clone(),
            };
            match node.meta.write(command).await {
                Ok(_) => report.repairs.push(format!(
                    "node {replica}'s replica of partition {partition} is refused and copied again whole from a good replica"
                )),
                Err(e) => report.problems.push(format!(
                    "node {replica}'s replica of partition {partition} could not be refused: {e}"
                )),
            }
        }
    }
    Ok(report)
}

/// The sealed epochs of `table`, oldest first, with the table's link.
fn sealed_epochs<'a>(
    state: &'a MetaState,
    table: &str,
) -> Vec<(Epoch, &'a EpochRecord, &'a crate::meta::TableVersion)> {
    state
        .epoch_log
        .iter()
        .filter_map(|(epoch, record)| {
            let link = record
                .seal
                .as_ref()?
                .versions
                .iter()
                .find(|v| v.table == table)?;
            Some((*epoch, record, link))
        })
        .collect()
}

async fn verify_table(
    node: &Arc<Node>,
    state: &MetaState,
    table: &str,
    request: &VerifyRequest,
    report: &mut VerifyReport,
    corrupt: &mut Corrupt,
) -> TableVerdict {
    let sealed = sealed_epochs(state, table);
    let wanted = |epoch: Epoch| request.epoch.is_none_or(|e| e == epoch);
    // The chain and the signatures, from the metadata alone: from the genesis id, or from
    // where a compaction of the epoch log left the table's chain.
    let mut previous = state.history_head(table);
    let mut signed = 0;
    for (epoch, record, link) in &sealed {
        if link.previous != previous {
            report.problems.push(format!(
                "table {table}: epoch {epoch}'s version {} follows {}, but the epoch before it ended at {previous}: the chain is broken (a record was forged or removed)",
                link.version, link.previous
            ));
        }
        previous = link.version;
        match state.signature_status(*epoch, record) {
            SignatureStatus::Valid { .. } => signed += 1,
            SignatureStatus::Unsigned => {}
            bad if wanted(*epoch) => report
                .problems
                .push(format!("table {table}: epoch {epoch}'s signature is {bad}")),
            _ => {}
        }
    }
    if previous != state.table_head(table) {
        report.problems.push(format!(
            "table {table}: its chain ends at {previous}, but the metadata's head is {}",
            state.table_head(table)
        ));
    }
    // The data, from every up-to-date replica, each epoch hashed in its seal's format.
    let formats = digest_formats(&sealed);
    let replicas = gather_digests(node, state, table, &formats, report).await;
    let horizon = replicas
        .values()
        .map(|r| r.horizon)
        .max()
        .unwrap_or(Epoch::ZERO);
    let mut voters: BTreeMap<PartitionId, BTreeMap<NodeId, BTreeMap<Epoch, ComponentHash>>> =
        BTreeMap::new();
    for ((replica, partition), digests) in &replicas {
        match &digests.digests {
            Ok(_) if !digests.formats_followed && !formats.is_empty() => {
                report.skipped.push(format!(
                    "table {table}: node {replica}'s replica of partition {partition} (the node runs an older version, which hashes every epoch in the first digest format)"
                ))
            }
            Ok(digests) => {
                voters
                    .entry(*partition)
                    .or_default()
                    .insert(*replica, digests.iter().copied().collect());
            }
            Err(error) if !error.damaged => report.skipped.push(format!(
                "table {table}: node {replica}'s replica of partition {partition} ({})",
                error.reason
            )),
            Err(error) => {
                let problem = format!(
                    "table {table}: node {replica}'s replica of partition {partition} cannot be read: {}",
                    error.reason
                );
                corrupt
                    .entry((*replica, *partition))
                    .or_insert(problem.clone());
                report.problems.push(problem);
            }
        }
    }
    let mut data_checked = 0;
    let published: BTreeSet<Epoch> = sealed.iter().map(|(e, ..)| *e).collect();
    let checkable = |e: Epoch| e > horizon && e <= state.visible && wanted(e);
    for (epoch, _, link) in sealed.iter().filter(|(e, ..)| checkable(*e)) {
        data_checked += 1;
        check_epoch(table, *epoch, link, &voters, report, corrupt);
    }
    // Rows of epochs that published nothing to this table (an aborted epoch's, or forged).
    let unsealed_publishes: BTreeSet<Epoch> = state
        .epoch_log
        .iter()
        .filter(|(_, r)| r.seal.is_none() && r.tables.iter().any(|t| t == table))
        .map(|(e, _)| *e)
        .collect();
    for (partition, by_node) in &voters {
        for (replica, digests) in by_node {
            let stray = digests.keys().find(|e| {
                **e > horizon
                    && **e <= state.visible
                    && wanted(**e)
                    && !published.contains(e)
                    && !unsealed_publishes.contains(e)
            });
            if let Some(epoch) = stray {
                let problem = format!(
                    "table {table}: node {replica}'s replica of partition {partition} holds rows of epoch {epoch}, which published nothing to it"
                );
                corrupt
                    .entry((*replica, *partition))
                    .or_insert(problem.clone());
                report.problems.push(problem);
            }
        }
    }
    TableVerdict {
        table: table.to_string(),
        head: previous,
        epochs: sealed.len(),
        signed,
        data_checked,
        replicas: replicas.len(),
        horizon,
    }
}

/// Checks one epoch's signed version id against the replicas' digests: the majority's
/// first, then each disputed partition's other answers. Replicas that disagree with the
/// answer that rebuilds the id are corrupt.
fn check_epoch(
    table: &str,
    epoch: Epoch,
    link: &crate::meta::TableVersion,
    voters: &BTreeMap<PartitionId, BTreeMap<NodeId, BTreeMap<Epoch, ComponentHash>>>,
    report: &mut VerifyReport,
    corrupt: &mut Corrupt,
) {
    // Per partition, each replica's answer (None: no rows of this epoch), most common first.
    let mut answers: BTreeMap<PartitionId, Vec<(Option<ComponentHash>, Vec<NodeId>)>> =
        BTreeMap::new();
    for (partition, by_node) in voters {
        let mut tally: BTreeMap<Option<ComponentHash>, Vec<NodeId>> = BTreeMap::new();
        for (replica, digests) in by_node {
            tally
                .entry(digests.get(&epoch).copied())
                .or_default()
                .push(*replica);
        }
        let mut tally: Vec<_> = tally.into_iter().collect();
        tally.sort_by_key(|(_, nodes)| std::cmp::Reverse(nodes.len()));
        answers.insert(*partition, tally);
    }
    let rebuild = |choice: &BTreeMap<PartitionId, Option<ComponentHash>>| {
        let digests: BTreeMap<PartitionId, ComponentHash> = choice
            .iter()
            .filter_map(|(p, d)| d.map(|d| (*p, d)))
            .collect();
        table_version_id(table, epoch, &link.previous, &digests)
    };
    let majority: BTreeMap<PartitionId, Option<ComponentHash>> =
        answers.iter().map(|(p, tally)| (*p, tally[0].0)).collect();
    let mut found = (rebuild(&majority) == link.version).then(|| majority.clone());
    if found.is_none() {
        'search: for (partition, tally) in answers.iter().filter(|(_, t)| t.len() > 1) {
            for (answer, _) in &tally[1..] {
                let mut choice = majority.clone();
                choice.insert(*partition, *answer);
                if rebuild(&choice) == link.version {
                    found = Some(choice);
                    break 'search;
                }
            }
        }
    }
    let Some(choice) = found else {
        report.problems.push(format!(
            "table {table}: epoch {epoch}'s signed version id {} is not rebuilt by the replicas' rows (their majority gives {}): the record was forged, or every replica of a partition is wrong",
            link.version,
            rebuild(&majority)
        ));
        return;
    };
    for (partition, tally) in &answers {
        for (answer, nodes) in tally.iter().filter(|(a, _)| *a != choice[partition]) {
            for replica in nodes {
                let problem = format!(
                    "table {table}: node {replica}'s replica of partition {partition} does not reproduce epoch {epoch} (its rows there {}; the signed version needs {})",
                    describe(answer),
                    describe(&choice[partition])
                );
                corrupt
                    .entry((*replica, *partition))
                    .or_insert(problem.clone());
                report.problems.push(problem);
            }
        }
    }
}

fn describe(answer: &Option<ComponentHash>) -> String {
    match answer {
        Some(digest) => format!("hash to {}", crate::meta::seal::short(&digest.to_hex())),
        None => "are missing".into(),
    }
}

/// The digest format of each of `sealed` that is not the first.
fn digest_formats(
    sealed: &[(Epoch, &EpochRecord, &crate::meta::TableVersion)],
) -> BTreeMap<Epoch, DigestFormat> {
    sealed
        .iter()
        .filter_map(|(epoch, record, _)| {
            let format = record.seal.as_ref()?.digest_format;
            (format != DigestFormat::Rows).then_some((*epoch, format))
        })
        .collect()
}

/// Every up-to-date replica's digests of `table`, by (node, partition). Replicas of nodes
/// that are down or do not answer are listed in the report as skipped.
async fn gather_digests(
    node: &Arc<Node>,
    state: &MetaState,
    table: &str,
    formats: &BTreeMap<Epoch, DigestFormat>,
    report: &mut VerifyReport,
) -> BTreeMap<(NodeId, PartitionId), PartitionDigests> {
    let mut by_node: BTreeMap<NodeId, Vec<PartitionId>> = BTreeMap::new();
    for (p, placement) in state.map.partitions.iter().enumerate() {
        for replica in &placement.replicas {
            if !placement.stale.contains_key(replica) {
                by_node
                    .entry(*replica)
                    .or_default()
                    .push(PartitionId(p as u32));
            }
        }
    }
    let calls = by_node.into_iter().map(|(replica, partitions)| async move {
        let request = DigestsRequest {
            table: table.to_string(),
            partitions,
            through: state.visible,
            formats: formats.clone(),
        };
        let answer: Result<Vec<PartitionDigests>, String> = if replica == node.id() {
            Ok(local_digests(node, request).await)
        } else if !state.nodes.get(&replica).is_some_and(|n| n.alive) {
            Err("it is down".into())
        } else {
            match node.meta.addr_of(replica) {
                None => Err("it has no address".into()),
                Some(addr) => {
                    let reply: Result<Result<Vec<PartitionDigests>, Refusal>, CallError> = node
                        .clients
                        .action(&addr, ACTION_PARTITION_DIGESTS, request, DIGEST_PATIENCE)
                        .await;
                    match reply {
                        Ok(Ok(digests)) => Ok(digests),
                        Ok(Err(refusal)) => Err(CallError::Refused(refusal).to_string()),
                        Err(e) => Err(e.to_string()),
                    }
                }
            }
        };
        (replica, answer)
    });
    let mut gathered = BTreeMap::new();
    for (replica, answer) in futures::future::join_all(calls).await {
        match answer {
            Ok(digests) => {
                for digests in digests {
                    gathered.insert((replica, digests.partition), digests);
                }
            }
            Err(why) => report
                .skipped
                .push(format!("table {table}: node {replica}'s replicas ({why})")),
        }
    }
    gathered
}
