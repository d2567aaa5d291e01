//! Errors of distributed execution, each naming the query, node or step at fault.

use crate::{NodeId, QueryId, StageId};
use datafusion::error::DataFusionError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ExecError {
    /// A query failed for a reason other than a node's death (a channel's error, a
    /// refused request).
    #[error("query {query:x} failed: {detail}")]
    Failed {
        query: QueryId,
        detail: String,
        /// Set when the error was the statement's own (bad data, a bad cast), not a node's.
        sqlstate: Option<&'static str>,
    },
    /// A node stopped answering, but the metadata leader does not confirm it dead: the
    /// query cannot tell a slow or cut-off node from a dead one, and stops.
    #[error("query {query:x} failed: node {node} stopped answering, but the metadata leader still counts it alive: {detail}")]
    Unconfirmed {
        query: QueryId,
        node: NodeId,
        detail: String,
    },
    /// A node the query ran on died under it (confirmed by the metadata).
    #[error("node {node} died during query {query:x} ({detail}); nothing was returned")]
    NodeLost {
        node: NodeId,
        query: QueryId,
        detail: String,
    },
    /// A node the query ran on died after part of the answer had gone to the client: those
    /// rows cannot be taken back, so the query is not run again.
    #[error("node {node} died during query {query:x} ({detail}) after {rows_sent} rows of its answer were sent; an answer larger than tessera.answer_buffer streams, and a query is run again unseen only before its first rows are sent: run it again")]
    LostMidAnswer {
        node: NodeId,
        query: QueryId,
        rows_sent: u64,
        detail: String,
    },
    /// A plan could not be executed, cut, encoded or filled in (its subqueries' values).
    #[error("{0}")]
    Plan(#[from] DataFusionError),
    /// A stage's fragment could not be decoded into a plan.
    #[error("stage {stage} arrived garbled: {reason}")]
    GarbledStage { stage: StageId, reason: String },
    #[error("stage {stage} does not end in an exchange writer")]
    NoWriter { stage: StageId },
    /// A scalar subquery's plan does not return one column.
    #[error("a scalar subquery returns one column, not {columns}")]
    SubqueryColumns { columns: usize },
    #[error("node {node} ({addr}) is unreachable: {reason}")]
    Unreachable {
        node: NodeId,
        addr: String,
        reason: String,
    },
    /// Every replica of a partition failed to answer a read; `last` is the last one's error.
    #[error("no replica of partition {partition} could be read: {last}")]
    NoReadableReplica {
        partition: tessera_common::PartitionId,
        last: String,
    },
    /// No live replica of a partition holds every committed epoch.
    #[error("partition {partition} of table {table:?} has no live replica holding every epoch (replicas {replicas:?}); it is unavailable until one returns")]
    PartitionUnavailable {
        table: String,
        partition: tessera_common::PartitionId,
        replicas: Vec<NodeId>,
    },
    /// This node cannot answer a read of a table's partitions at an epoch: its own
    /// metadata says it does not hold every version up to it (any more).
    #[error("node {node} cannot read {table:?} at epoch {epoch} here: {reason}")]
    NotHeldHere {
        node: NodeId,
        table: String,
        epoch: tessera_common::Epoch,
        reason: String,
    },
    /// Another node answered a read with an error.
    #[error("node {node}: {error}")]
    Refused {
        node: NodeId,
        error: tessera_net::CallError,
    },
    /// A task of this node's failed (panicked or was cancelled).
    #[error("{what} failed: {reason}")]
    Task { what: &'static str, reason: String },
    #[error(transparent)]
    Meta(#[from] tessera_meta::MetaError),
    #[error("{0}")]
    Storage(#[from] tessera_storage::StorageError),
    #[error("{0}")]
    Sql(#[from] tessera_sql::SqlError),
}

impl ExecError {
    /// A DataFusion error met while planning for the cluster, as SQL sees it.
    pub fn sql(error: DataFusionError) -> ExecError {
        ExecError::Sql(tessera_sql::error::from_datafusion(error))
    }
}

impl From<ExecError> for tessera_sql::SqlError {
    fn from(error: ExecError) -> Self {
        match error {
            ExecError::Storage(e) => tessera_sql::SqlError::Storage(e),
            ExecError::Sql(e) => e,
            ExecError::Failed {
                sqlstate: Some(sqlstate),
                ..
            } => tessera_sql::SqlError::Query {
                sqlstate,
                message: error.to_string(),
            },
            other => tessera_sql::SqlError::Cluster(other.to_string()),
        }
    }
}
