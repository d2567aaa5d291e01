//! Uncorrelated scalar subqueries across nodes.
//!
//! DataFusion plans `x > (SELECT avg(...) ...)` as a `ScalarSubqueryExec` whose subquery
//! results fill a container that the main plan's `ScalarSubqueryExpr`s read in memory.
//! Those expressions cannot travel to another node on their own, so the initiator runs
//! each subquery first (distributed, like any query), fills the container, drops the
//! `ScalarSubqueryExec`, and [`LiteralSubqueries`] sends every filled subquery expression
//! as the literal value it now stands for.

use crate::plan::{distribute, PlanOptions};
use crate::run::{encode, execute};
use crate::Exec;
use crate::ExecError;
use arrow::array::RecordBatch;
use datafusion::common::{DataFusionError, Result as DfResult, ScalarValue};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::expressions::Literal;
use datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::scalar_subquery::ScalarSubqueryExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr_with_converter;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr_with_converter;
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalPlanNodeExt,
    PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf::{PhysicalExprNode, PhysicalPlanNode};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tessera_meta::MetaView;

type Resolved<'a> =
    Pin<Box<dyn Future<Output = Result<Arc<dyn ExecutionPlan>, ExecError>> + Send + 'a>>;

/// Runs every scalar subquery in `plan` on the cluster, under the session's `options`
/// (its memory limit, its execution settings; a subquery restarts rather than recovers
/// by lineage), and returns the plan without its `ScalarSubqueryExec`s, their expressions
/// filled in.
pub fn resolve<'a>(
    node: &'a Arc<Exec>,
    view: &'a MetaView,
    plan: Arc<dyn ExecutionPlan>,
    started_at_us: u64,
    buckets: usize,
    options: &'a PlanOptions,
) -> Resolved<'a> {
    Box::pin(async move {
        let resolve = |plan| resolve(node, view, plan, started_at_us, buckets, options);
        if let Some(exec) = plan.downcast_ref::<ScalarSubqueryExec>() {
            for link in exec.subqueries() {
                let subquery = resolve(link.plan.clone()).await?;
                let value =
                    run_scalar(node, view, subquery, started_at_us, buckets, options).await?;
                exec.results()
                    .set(link.index, value)
                    .map_err(ExecError::Plan)?;
            }
            return resolve(exec.input().clone()).await;
        }
        let mut children = Vec::new();
        for child in plan.children() {
            children.push(resolve(child.clone()).await?);
        }
        if children.is_empty() {
            return Ok(plan);
        }
        replace_children_if_necessary(plan, children).map_err(ExecError::Plan)
    })
}

/// A subquery's single value: NULL for no row, an error for more than one.
async fn run_scalar(
    node: &Arc<Exec>,
    view: &MetaView,
    plan: Arc<dyn ExecutionPlan>,
    started_at_us: u64,
    buckets: usize,
    options: &PlanOptions,
) -> Result<ScalarValue, ExecError> {
    let schema = plan.schema();
    if schema.fields().len() != 1 {
        return Err(ExecError::SubqueryColumns {
            columns: schema.fields().len(),
        });
    }
    let query = crate::QueryId(rand::random());
    let distributed = distribute(
        node,
        query,
        plan,
        &view.state,
        started_at_us,
        buckets,
        PlanOptions {
            lineage: false,
            ..options.clone()
        },
    )
    .map_err(ExecError::Plan)?;
    let work = encode(node, &distributed).map_err(ExecError::Plan)?;
    let outcome = execute(node, &distributed, work, schema.clone()).await?;
    let mut value = None;
    for batch in outcome.batches.iter().filter(|b| b.num_rows() > 0) {
        if value.is_some() || batch.num_rows() > 1 {
            return Err(ExecError::Sql(tessera_sql::SqlError::DataFusion(
                DataFusionError::Execution("Scalar subquery returned more than one row".into()),
            )));
        }
        value = Some(ScalarValue::try_from_array(batch.column(0), 0).map_err(ExecError::Plan)?);
    }
    match value {
        Some(value) => Ok(value),
        None => ScalarValue::try_from(schema.field(0).data_type()).map_err(ExecError::Plan),
    }
}

/// datafusion-proto's converter, except that a filled scalar subquery expression is
/// written as its value.
pub struct LiteralSubqueries;

impl PhysicalProtoConverterExtension for LiteralSubqueries {
    fn proto_to_execution_plan(
        &self,
        proto: &PhysicalPlanNode,
        ctx: &PhysicalPlanDecodeContext<'_>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        proto.try_into_physical_plan_with_context(ctx, self)
    }

    fn execution_plan_to_proto(
        &self,
        plan: &Arc<dyn ExecutionPlan>,
        codec: &dyn PhysicalExtensionCodec,
    ) -> DfResult<PhysicalPlanNode> {
        PhysicalPlanNode::try_from_physical_plan_with_converter(plan.clone(), codec, self)
    }

    fn proto_to_physical_expr(
        &self,
        proto: &PhysicalExprNode,
        input_schema: &arrow::datatypes::Schema,
        ctx: &PhysicalPlanDecodeContext<'_>,
    ) -> DfResult<Arc<dyn PhysicalExpr>> {
        parse_physical_expr_with_converter(proto, input_schema, ctx, self)
    }

    fn physical_expr_to_proto(
        &self,
        expr: &Arc<dyn PhysicalExpr>,
        codec: &dyn PhysicalExtensionCodec,
    ) -> DfResult<PhysicalExprNode> {
        if let Some(subquery) = expr.downcast_ref::<ScalarSubqueryExpr>() {
            // A filled subquery expression ignores its input: evaluating it reads the value
            // (and fails if the subquery has not run).
            let empty = RecordBatch::new_empty(Arc::new(arrow::datatypes::Schema::empty()));
            let ColumnarValue::Scalar(value) = subquery.evaluate(&empty)? else {
                return Err(DataFusionError::Internal(
                    "a scalar subquery evaluated to an array".into(),
                ));
            };
            let literal: Arc<dyn PhysicalExpr> = Arc::new(Literal::new(value));
            return serialize_physical_expr_with_converter(&literal, codec, self);
        }
        serialize_physical_expr_with_converter(expr, codec, self)
    }
}
