//! Restarting a statement whose run lost a node: under `tessera.recovery = restart`, or
//! when lineage recovery could not go on (a second death, a rebuild that failed), the whole
//! query runs again on the survivors with a fresh partition map, each table still at the
//! epoch it was resolved at, so the answer is the one the first run would have given.
//!
//! A run that failed because a hash join's build side did not fit in the query's memory
//! (`tessera.query_memory_limit`, or the node's pool) runs again once, before any row
//! was sent, with sort-merge joins: they sort both sides, and sorts spill to disk.

use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use std::sync::Arc;
use tessera_exec::{Exec, ExecError, Recoveries, RecoveryOutcome};
use tessera_meta::MetaView;
use tessera_sql::options::RecoveryMode;
use tessera_sql::StatementOutput;

/// How many node failures one query may restart after before it gives up.
pub const MAX_RESTARTS: usize = 3;

/// Runs a statement, restarting it after a node's death as its session's
/// `tessera.recovery` allows. `view` gives the statement's pinned metadata; `repin` pins a
/// fresh one (with the survivors' promotions) before a restart. How each run survived is
/// added to `recoveries`.
pub async fn run_restarting(
    exec: &Arc<Exec>,
    ctx: &SessionContext,
    plan: LogicalPlan,
    view: impl Fn() -> Arc<MetaView>,
    repin: impl Fn(Arc<MetaView>),
    recoveries: &Recoveries,
) -> Result<StatementOutput, ExecError> {
    let mode = tessera_sql::options::tessera_options(ctx.state().config()).recovery;
    let mut restarts = 0;
    // Set once the query runs again with joins that spill.
    let mut spilling_joins: Option<SessionContext> = None;
    loop {
        let pinned = view();
        let ctx = spilling_joins.as_ref().unwrap_or(ctx);
        let run = tessera_exec::session::run_query(exec, &pinned, ctx, plan.clone(), recoveries);
        match run.await {
            Ok(output) => return Ok(output),
            Err(error) if spilling_joins.is_none() && build_side_did_not_fit(ctx, &error) => {
                let query = match &error {
                    ExecError::Failed { query, .. } => *query,
                    _ => tessera_exec::QueryId(0),
                };
                tracing::warn!(%query, %error, "running a query again with sort-merge joins: a hash join's build side did not fit in its memory");
                spilling_joins = Some(with_spilling_joins(ctx)?);
                recoveries.push(RecoveryOutcome::SpillingJoins {
                    query,
                    refused: error.to_string(),
                });
            }
            Err(ExecError::NodeLost {
                node: lost,
                query,
                detail,
            }) if mode != RecoveryMode::None && restarts < MAX_RESTARTS => {
                restarts += 1;
                tracing::warn!(lost = lost.0, %query, %detail, "restarting a query on the survivors");
                repin(
                    exec.meta()
                        .read_linearizable(tessera_meta::LINEARIZABLE_READ_PATIENCE)
                        .await?,
                );
                recoveries.push(RecoveryOutcome::Restarted {
                    dead: lost,
                    query,
                    restart: restarts,
                    lineage_gave_up: (mode == RecoveryMode::Lineage).then_some(detail),
                });
            }
            Err(ExecError::Unconfirmed {
                node: unreachable,
                query,
                detail,
            }) if mode != RecoveryMode::None && restarts < MAX_RESTARTS => {
                // Diagnosis noted the peer as unreachable from here: the next plan avoids it.
                restarts += 1;
                tracing::warn!(unreachable = unreachable.0, %query, %detail, "restarting a query without a peer this node cannot reach");
                recoveries.push(RecoveryOutcome::Rerouted {
                    unreachable,
                    initiator: exec.id(),
                    query,
                    restart: restarts,
                });
            }
            Err(ExecError::NodeLost {
                node,
                query,
                detail,
            }) => {
                let why = if mode == RecoveryMode::None {
                    "tessera.recovery = none".to_string()
                } else {
                    format!("gave up after {MAX_RESTARTS} restarts")
                };
                return Err(ExecError::NodeLost {
                    node,
                    query,
                    detail: format!("{detail}; {why}"),
                });
            }
            Err(other) => return Err(other),
        }
    }
}

/// Whether `error` is a hash join's build side refused its memory (by the query's limit
/// or its node's), in a run whose joins were hash joins.
fn build_side_did_not_fit(ctx: &SessionContext, error: &ExecError) -> bool {
    let hash_joins = ctx.state().config().options().optimizer.prefer_hash_join;
    let refused = match error {
        ExecError::Failed { detail, .. } => tessera_exec::memory::is_build_side_refusal(detail),
        ExecError::Plan(error) => tessera_exec::memory::is_build_side_refusal(&error.to_string()),
        _ => false,
    };
    hash_joins && refused
}

/// `ctx` with sort-merge joins in place of partitioned hash joins: they sort both sides,
/// and a sort spills. They are co-located as hash joins are (`tessera_exec::colocate`).
fn with_spilling_joins(ctx: &SessionContext) -> Result<SessionContext, ExecError> {
    let mut state = ctx.state();
    let options = state.config_mut().options_mut();
    options
        .set("datafusion.optimizer.prefer_hash_join", "false")
        .map_err(ExecError::Plan)?;
    Ok(SessionContext::new_with_state(state))
}
