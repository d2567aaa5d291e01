//! A table's statistics for the optimizer: its rows, extrapolated from the current replicas
//! a node holds, and their components' column statistics (min, max, nulls). They decide
//! join order, build sides and broadcasts, never an answer.
//!
//! A node that holds no current replica of a table (a compute-only node, or a storage node
//! given none of its partitions) asks a node that does, once per table version and epoch
//! ([`ACTION_TABLE_STATISTICS`]), and keeps the answer: without it, its plans would hash
//! every join instead of broadcasting small tables. The answer is the holder's own view,
//! an estimate: when no holder answers in time the query is planned without statistics.

use crate::meta::MetaState;
use crate::node::Node;
use crate::rpc::Refusal;
use prost::Message;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_common::Epoch;
use tessera_exec::scan::TableStatistics;
use tessera_storage::versions::stored_schema;
use tessera_storage::TableDef;

pub const ACTION_TABLE_STATISTICS: &str = "table-statistics";

/// How long a planning node waits for a holder's statistics before it plans without.
const ASK_PATIENCE: Duration = Duration::from_secs(2);

/// Statistics kept per node at most; the oldest half goes when full.
const KEPT: usize = 512;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StatisticsRequest {
    pub table: String,
    pub generation: u64,
    pub epoch: Epoch,
}

/// A table's estimated rows and its column statistics (DataFusion's protobuf encoding),
/// or nothing where the answering node holds no current replica either.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StatisticsReply {
    pub rows: Option<usize>,
    pub columns: Option<Vec<u8>>,
}

/// Estimated rows and column statistics, as the planner takes them.
pub type Estimates = (Option<usize>, Option<TableStatistics>);

/// What this node holds of `def` at `epoch`, scaled to the whole table; `(None, None)`
/// when it holds no current replica of any of its partitions.
pub fn local(node: &Node, state: &MetaState, def: &TableDef, epoch: Epoch) -> Estimates {
    let me = node.id();
    let Some(snapshot) = node
        .store
        .snapshot(&def.name, Some(epoch))
        .ok()
        .filter(|s| s.def.generation == def.generation)
    else {
        return (None, None);
    };
    let placements = &state.map.partitions;
    let held: Vec<&tessera_storage::PartitionSnapshot> = snapshot
        .partitions
        .iter()
        .filter(|p| {
            placements
                .get(p.partition.0 as usize)
                .is_some_and(|placement| {
                    placement.replicas.contains(&me) && !placement.stale.contains_key(&me)
                })
        })
        .collect();
    if held.is_empty() {
        return (None, None);
    }
    let rows: u64 = held.iter().map(|p| p.estimated_rows()).sum();
    let rows = (rows * placements.len() as u64 / held.len() as u64) as usize;
    let stored = stored_schema(def);
    let components: Option<Vec<Arc<datafusion::common::Statistics>>> = held
        .iter()
        .flat_map(|p| &p.components)
        .map(|c| {
            node.exec
                .queries()
                .statistics()
                .get(node.store.as_ref(), &c.hash, def)
                .ok()
        })
        .collect();
    let columns = components.and_then(|components| {
        let merged = datafusion::common::Statistics::try_merge_iter(
            components.iter().map(|s| s.as_ref()),
            &stored,
        )
        .ok()?;
        // Only the user columns; the version columns are not the table's.
        let user: Vec<usize> = (0..def.schema.fields().len()).collect();
        let mut table = merged.project(Some(&user)).to_inexact();
        table.total_byte_size = datafusion::common::stats::Precision::Absent;
        Some(Arc::new(table))
    });
    (Some(rows), columns)
}

/// Answers another node's [`StatisticsRequest`] from this node's own view of the metadata
/// (an estimate; see the module's documentation).
pub fn serve(node: &Node, request: StatisticsRequest) -> Result<StatisticsReply, Refusal> {
    let view = node.meta.view();
    let Some(def) = view
        .state
        .tables
        .get(&request.table)
        .filter(|d| d.generation == request.generation)
    else {
        return Ok(StatisticsReply::default());
    };
    let (rows, columns) = local(node, &view.state, def, request.epoch);
    Ok(StatisticsReply {
        rows,
        columns: columns.map(|c| {
            datafusion_proto_common::protobuf_common::Statistics::from(c.as_ref()).encode_to_vec()
        }),
    })
}

/// Statistics this node got from holders, by table version and epoch.
#[derive(Debug, Default)]
pub struct RemoteStatistics {
    kept: Mutex<HashMap<(String, u64, Epoch), Estimates>>,
}

impl RemoteStatistics {
    /// The statistics of `def` at `epoch`: this node's own if it holds a current replica,
    /// else those of the first holder that answers (kept for the next query), else none.
    pub async fn of(
        &self,
        node: &Node,
        state: &MetaState,
        def: &TableDef,
        epoch: Epoch,
    ) -> Estimates {
        let own = local(node, state, def, epoch);
        if own.0.is_some() {
            return own;
        }
        let key = (def.name.clone(), def.generation, epoch);
        if let Some(kept) = self.kept.lock().expect("statistics lock").get(&key) {
            return kept.clone();
        }
        let Some(estimates) = ask_holders(node, state, def, epoch).await else {
            return (None, None);
        };
        let mut kept = self.kept.lock().expect("statistics lock");
        if kept.len() >= KEPT {
            // Old epochs are asked for rarely: drop those below the newest half.
            let mut epochs: Vec<Epoch> = kept.keys().map(|(_, _, e)| *e).collect();
            epochs.sort_unstable();
            let cut = epochs[epochs.len() / 2];
            kept.retain(|(_, _, e), _| *e > cut);
        }
        kept.insert(key, estimates.clone());
        estimates
    }
}

/// Asks the primaries of `def`'s partitions, in turn, for its statistics.
async fn ask_holders(
    node: &Node,
    state: &MetaState,
    def: &TableDef,
    epoch: Epoch,
) -> Option<Estimates> {
    let mut holders: Vec<crate::NodeId> = state
        .map
        .partitions
        .iter()
        .filter_map(|p| p.primary)
        .filter(|id| *id != node.id())
        .collect();
    holders.sort_unstable();
    holders.dedup();
    let request = StatisticsRequest {
        table: def.name.clone(),
        generation: def.generation,
        epoch,
    };
    for holder in holders {
        let Some(addr) = node.meta.addr_of(holder) else {
            continue;
        };
        let reply: Result<Result<StatisticsReply, Refusal>, _> = node
            .clients
            .action(
                &addr,
                ACTION_TABLE_STATISTICS,
                request.clone(),
                ASK_PATIENCE,
            )
            .await;
        match reply {
            Ok(Ok(StatisticsReply {
                rows: Some(rows),
                columns,
            })) => {
                let columns = columns.and_then(|bytes| decode(&bytes, def));
                return Some((Some(rows), columns));
            }
            Ok(Ok(_)) => continue,
            Ok(Err(refusal)) => {
                tracing::debug!(holder = holder.0, table = %def.name, ?refusal, "no statistics from this holder")
            }
            Err(error) => {
                tracing::debug!(holder = holder.0, table = %def.name, %error, "no statistics from this holder")
            }
        }
    }
    None
}

/// Column statistics from their protobuf encoding, if they fit `def`'s user columns.
fn decode(bytes: &[u8], def: &TableDef) -> Option<TableStatistics> {
    let proto = datafusion_proto_common::protobuf_common::Statistics::decode(bytes).ok()?;
    let statistics = datafusion::common::Statistics::try_from(&proto).ok()?;
    (statistics.column_statistics.len() == def.schema.fields().len()).then(|| Arc::new(statistics))
}
