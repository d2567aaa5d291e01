//! A statement that returns rows, as a cluster node runs it: planned by DataFusion for the
//! whole cluster, distributed, executed; `EXPLAIN` shows the distributed plan and
//! `EXPLAIN ANALYZE` runs it and shows what every channel did.

use crate::explain::{describe, describe_with_metrics};
use crate::now_us;
use crate::plan::{distribute, DistributedPlan};
use crate::run::{encode, execute, Work};
use crate::Exec;
use crate::ExecError;
use arrow::array::{RecordBatch, StringArray};
use arrow::datatypes::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::TreeNode;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionState;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use std::sync::Arc;
use tessera_meta::MetaView;
use tessera_sql::StatementOutput;

fn sql_error(error: datafusion::error::DataFusionError) -> ExecError {
    ExecError::sql(error)
}

/// Hash-exchange buckets for a query: a channel per core of every live node (the
/// initiator sees only its own machine; nodes of one cluster are alike).
pub fn exchange_buckets(node: &Exec, view: &MetaView) -> usize {
    let nodes = view.state.live_nodes().count().max(1);
    nodes * crate::cores_per_node(&view.state, node.id())
}

/// The optimizer settings for a plan that will be cut into stages.
fn configure(options: &mut ConfigOptions, buckets: usize) {
    options.execution.target_partitions = buckets;
    // Round-robin repartitions only spread work over one node's cores; channels already
    // do that across nodes.
    options.optimizer.enable_round_robin_repartition = false;
    // Dynamic filters are shared in memory between a join and its probe-side scan, which
    // here run on other nodes.
    options.optimizer.enable_dynamic_filter_pushdown = false;
    options.optimizer.enable_join_dynamic_filter_pushdown = false;
    options.optimizer.enable_topk_dynamic_filter_pushdown = false;
    options.optimizer.enable_aggregate_dynamic_filter_pushdown = false;
    // Scans may now declare their storage partitioning: every exchange of this plan is
    // cut by `distribute`, which hashes as the storage does where a join needs it.
    if let Some(tessera) = options
        .extensions
        .get_mut::<tessera_sql::options::TesseraOptions>()
    {
        tessera.planning_for_cluster = true;
    }
}

/// The session's state with the settings of a plan cut into stages over the cluster.
fn cluster_state(node: &Exec, view: &MetaView, ctx: &SessionContext) -> SessionState {
    let mut state = ctx.state();
    configure(
        state.config_mut().options_mut(),
        exchange_buckets(node, view),
    );
    state
}

/// True if the plan reads a Tessera table (anything else, such as `information_schema`,
/// runs where it is asked).
fn reads_tables(plan: &LogicalPlan) -> bool {
    plan.exists(|node| {
        // The system catalogs (DataFusion's `information_schema`, PostgreSQL clients'
        // `pg_catalog`) live in every node's memory: read here.
        // So do Tessera's system tables, built from the metadata this node pinned.
        Ok(matches!(node, LogicalPlan::TableScan(scan)
            if !matches!(scan.table_name.schema(), Some("information_schema" | "pg_catalog"))
                && !tessera_sql::system::is_system_table(scan.table_name.table())))
    })
    .unwrap_or(true)
}

/// A statement ready to run: distributed, or (when some operator cannot be distributed)
/// on this node alone.
pub enum Prepared {
    Distributed {
        plan: DistributedPlan,
        work: Work,
        schema: SchemaRef,
    },
    InProcess {
        reason: String,
    },
}

/// Plans `plan` for the cluster, cuts it into placed stages, and encodes them.
pub async fn prepare(
    node: &Arc<Exec>,
    view: &MetaView,
    ctx: &SessionContext,
    plan: &LogicalPlan,
) -> Result<Prepared, ExecError> {
    let state = cluster_state(node, view, ctx);
    // The buckets the cluster's settings planned for (`configure`), not counted again.
    let buckets = state.config().options().execution.target_partitions;
    let physical = state.create_physical_plan(plan).await.map_err(sql_error)?;
    let schema = physical.schema();
    let started_at_us = now_us();
    let settings = tessera_sql::options::tessera_options(ctx.state().config());
    let options = crate::plan::PlanOptions {
        lineage: settings.recovery == tessera_sql::options::RecoveryMode::Lineage,
        scans_on_compute: settings.scans_on_compute,
        memory_limit: settings.query_memory_limit,
        execution: crate::settings::ExecutionSettings::of(ctx.state().config().options()),
    };
    // Scalar subqueries run first, on their own; a node's death there restarts the query.
    let physical =
        crate::subquery::resolve(node, view, physical, started_at_us, buckets, &options).await?;
    let query = crate::QueryId(rand::random());
    let not_distributable = |error: DataFusionError| match error {
        DataFusionError::NotImplemented(reason) => Ok(Prepared::InProcess { reason }),
        other => Err(sql_error(other)),
    };
    let distributed = match distribute(
        node,
        query,
        physical,
        &view.state,
        started_at_us,
        buckets,
        options,
    ) {
        Ok(plan) => plan,
        Err(error) => return not_distributable(error),
    };
    match encode(node, &distributed) {
        Ok(work) => Ok(Prepared::Distributed {
            plan: distributed,
            work,
            schema,
        }),
        Err(error) => not_distributable(error),
    }
}

fn explain_rows(
    schema: SchemaRef,
    rows: Vec<(&str, String)>,
) -> Result<StatementOutput, ExecError> {
    let types: Vec<&str> = rows.iter().map(|(t, _)| *t).collect();
    let plans: Vec<&str> = rows.iter().map(|(_, p)| p.as_str()).collect();
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(StringArray::from(types)),
            Arc::new(StringArray::from(plans)),
        ],
    )
    .map_err(|e| ExecError::Plan(e.into()))?;
    Ok(StatementOutput::Rows {
        schema,
        batches: vec![batch],
    })
}

/// Runs a statement that returns rows. `recoveries` describes the earlier runs of this
/// statement that a node failure ended (`EXPLAIN ANALYZE` lists them); what lineage
/// recovery rebuilt during this run is added to it, for a streamed answer when it ends.
pub async fn run_query(
    node: &Arc<Exec>,
    view: &MetaView,
    ctx: &SessionContext,
    plan: LogicalPlan,
    recoveries: &crate::Recoveries,
) -> Result<StatementOutput, ExecError> {
    let in_process = |reason: &str| {
        tracing::info!(%reason, "running a statement on this node only");
    };
    match &plan {
        LogicalPlan::Explain(explain) if reads_tables(&explain.plan) => {
            let schema: SchemaRef = Arc::new(explain.schema.as_arrow().clone());
            // Optimized as `prepare` will optimize it: under the cluster's settings.
            let logical = cluster_state(node, view, ctx)
                .optimize(&explain.plan)
                .map_err(sql_error)?
                .display_indent()
                .to_string();
            let distributed = match prepare(node, view, ctx, &explain.plan).await? {
                Prepared::Distributed { plan, .. } => describe(&plan),
                Prepared::InProcess { reason } => {
                    format!("runs on the initiating node only: {reason}")
                }
            };
            explain_rows(
                schema,
                vec![("logical_plan", logical), ("distributed_plan", distributed)],
            )
        }
        LogicalPlan::Analyze(analyze) if reads_tables(&analyze.input) => {
            let schema: SchemaRef = Arc::new(analyze.schema.as_arrow().clone());
            match prepare(node, view, ctx, &analyze.input).await? {
                Prepared::Distributed {
                    plan: distributed,
                    work,
                    schema: output,
                } => {
                    let outcome = execute(node, &distributed, work, output).await?;
                    recoveries.extend(outcome.recoveries.iter().cloned());
                    let mut text = describe_with_metrics(&distributed, &outcome);
                    // What was recomputed: every earlier run, lost with a node.
                    for recovery in recoveries.snapshot() {
                        text.push_str(&format!("\nRecovery: {recovery}"));
                    }
                    explain_rows(schema, vec![("Plan with Metrics", text)])
                }
                Prepared::InProcess { reason } => {
                    in_process(&reason);
                    Ok(tessera_sql::backend::run_in_process(ctx, plan).await?)
                }
            }
        }
        plan if reads_tables(plan) => match prepare(node, view, ctx, plan).await? {
            Prepared::Distributed {
                plan: distributed,
                work,
                schema,
            } => {
                let buffer =
                    tessera_sql::options::tessera_options(ctx.state().config()).answer_buffer;
                let (answer, outcome) =
                    crate::answer::execute_stream(node.clone(), distributed, work, schema);
                match tessera_sql::answer::buffered(answer, buffer).await {
                    Ok(StatementOutput::Streaming { schema, stream }) => {
                        Ok(StatementOutput::Streaming {
                            schema,
                            stream: crate::answer::sent_as_it_comes(
                                stream,
                                outcome,
                                recoveries.clone(),
                            ),
                        })
                    }
                    Ok(whole) => {
                        // The stream ended without error, so the outcome was sent.
                        if let Ok(outcome) = outcome.await {
                            crate::answer::trace_recovered_channels(&outcome);
                            recoveries.extend(outcome.recoveries);
                        }
                        Ok(whole)
                    }
                    // Nothing was sent yet: the caller may still run it again.
                    Err(error) => Err(crate::answer::exec_error(error)),
                }
            }
            Prepared::InProcess { reason } => {
                in_process(&reason);
                Ok(tessera_sql::backend::run_in_process(ctx, plan.clone()).await?)
            }
        },
        _ => Ok(tessera_sql::backend::run_in_process(ctx, plan).await?),
    }
}
