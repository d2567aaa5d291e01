//! Semi and anti joins pushed below inner joins, to the input whose rows they filter
//! (Spark's `PushLeftSemiLeftAntiThroughJoin`).
//!
//! `IN (subquery)` and `EXISTS` become a left semi join (`NOT IN`, `NOT EXISTS`: a left
//! anti join), which DataFusion leaves where the predicate was written: above every join
//! of the `FROM` clause. Yet such a join only keeps or drops each left row, by a test of
//! that row's own columns against the whole right side. When every column it tests comes
//! from one input of an inner join below it, the test gives the same answer on that
//! input's rows before the join, and a row the join would have multiplied is kept or
//! dropped with all its copies alike; so the semi join can run there, first.
//!
//! That matters when the test is selective. TPC-H Q18 keeps the 57 orders (of 1.5 M at
//! SF 1) whose lines sum past 300: run first, on `orders`, it leaves the joins with
//! `customer` and `lineitem` 57 orders to match instead of 1.5 M; on a cluster the
//! orders no longer travel to the customers' partitions and back, and the semi join
//! itself runs where both of its sides already are (both are partitioned by order key).
//!
//! Only inner joins are passed through (an outer join's padded rows are not rows of its
//! input), and projections that pass the tested columns on unchanged.

use crate::options::tessera_options_of;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Column, DFSchema, Result};
use datafusion::logical_expr::{Expr, Join, JoinType, LogicalPlan, Projection};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use std::collections::HashSet;
use std::sync::Arc;

/// The rule (on unless `tessera.push_semi_joins` is false).
#[derive(Debug, Default)]
pub struct PushSemiJoins;

impl OptimizerRule for PushSemiJoins {
    fn name(&self) -> &str {
        "tessera_push_semi_joins"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        // Top down: a semi join moved one level is looked at again from its new place, as
        // the optimizer goes on into the children.
        Some(ApplyOrder::TopDown)
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let options = tessera_options_of(&config.options());
        if !options.push_semi_joins {
            return Ok(Transformed::no(plan));
        }
        let join = match plan {
            LogicalPlan::Join(join) => join,
            other => return Ok(Transformed::no(other)),
        };
        match push_one_level(&join)? {
            Some(pushed) => Ok(Transformed::yes(pushed)),
            None => Ok(Transformed::no(LogicalPlan::Join(join))),
        }
    }
}

/// `semi` moved one level down its left input, if it is a semi or anti join that may go
/// there.
fn push_one_level(semi: &Join) -> Result<Option<LogicalPlan>> {
    if !matches!(semi.join_type, JoinType::LeftSemi | JoinType::LeftAnti) {
        return Ok(None);
    }
    let Some(tested) = tested_columns(semi) else {
        return Ok(None);
    };
    match semi.left.as_ref() {
        LogicalPlan::Projection(projection) if passes_on(projection, &tested) => {
            let below = with_inputs(semi, projection.input.clone(), semi.right.clone())?;
            let projection = Projection::try_new(projection.expr.clone(), Arc::new(below))?;
            Ok(Some(LogicalPlan::Projection(projection)))
        }
        LogicalPlan::Join(inner) if inner.join_type == JoinType::Inner => {
            let (mut left, mut right) = (inner.left.clone(), inner.right.clone());
            if holds_all(left.schema(), &tested) && !filters_rows(&right) {
                left = Arc::new(with_inputs(semi, left, semi.right.clone())?);
            } else if holds_all(right.schema(), &tested) && !filters_rows(&left) {
                right = Arc::new(with_inputs(semi, right, semi.right.clone())?);
            } else {
                return Ok(None);
            }
            Ok(Some(with_inputs(inner, left, right)?))
        }
        _ => Ok(None),
    }
}

/// The columns of the semi join's left side that it tests: those of its left keys and
/// those of its filter that are not the right side's. `None` if a name is on both sides,
/// where it could not be told which is meant.
fn tested_columns(semi: &Join) -> Option<HashSet<Column>> {
    let right = semi.right.schema();
    let left = semi.left.schema();
    let mut tested = HashSet::new();
    let key_columns = semi.on.iter().flat_map(|(l, _)| l.column_refs());
    let filter_columns = semi.filter.iter().flat_map(Expr::column_refs);
    for column in key_columns.chain(filter_columns) {
        match (left.has_column(column), right.has_column(column)) {
            (true, true) => return None,
            (true, false) => {
                tested.insert(column.clone());
            }
            (false, _) => {}
        }
    }
    Some(tested)
}

/// Whether `plan` keeps only some of its tables' rows: a filter, a scan with filters, a
/// semi or anti join, a limit. An inner join with such an input likely drops many rows
/// of its other input, and a semi join is then best left above it, testing only the rows
/// that survive: in TPC-H Q21 the join with one nation's suppliers and the finished
/// orders keeps a few percent of the late lineitems, and moving the `EXISTS` and
/// `NOT EXISTS` tests below it made them test every late lineitem, taking Q21 from 0.5 s
/// to 1 s. Without row estimates at this stage this is a heuristic; a join with an
/// unfiltered table on its key (Q18's customer and lineitem) keeps every row it is given.
fn filters_rows(plan: &LogicalPlan) -> bool {
    plan.exists(|node| {
        Ok(match node {
            LogicalPlan::Filter(_) | LogicalPlan::Limit(_) => true,
            LogicalPlan::TableScan(scan) => !scan.filters.is_empty(),
            LogicalPlan::Join(join) => matches!(
                join.join_type,
                JoinType::LeftSemi | JoinType::LeftAnti | JoinType::RightSemi | JoinType::RightAnti
            ),
            _ => false,
        })
    })
    .unwrap_or(true)
}

fn holds_all(schema: &DFSchema, columns: &HashSet<Column>) -> bool {
    columns.iter().all(|c| schema.has_column(c))
}

/// Whether `projection` passes every tested column on as it is, under the same name, so
/// the semi join reads the same values below it.
fn passes_on(projection: &Projection, tested: &HashSet<Column>) -> bool {
    tested.iter().all(|column| {
        projection
            .expr
            .iter()
            .any(|e| matches!(e, Expr::Column(c) if c == column))
            && projection.input.schema().has_column(column)
    })
}

/// `join` over other inputs, its conditions unchanged (its schema is computed again: a
/// semi join's is then its new left input's).
fn with_inputs(
    join: &Join,
    left: Arc<LogicalPlan>,
    right: Arc<LogicalPlan>,
) -> Result<LogicalPlan> {
    Ok(LogicalPlan::Join(Join::try_new(
        left,
        right,
        join.on.clone(),
        join.filter.clone(),
        join.join_type,
        join.join_constraint,
        join.null_equality,
        join.null_aware,
    )?))
}

#[cfg(test)]
mod tests;
