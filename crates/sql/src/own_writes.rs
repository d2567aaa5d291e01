//! Reads inside a transaction see the transaction's own writes.
//!
//! Every scan of a table the transaction has written (at its current epoch, not `AS OF`
//! one) becomes: the table at the transaction's pinned epoch without the rows whose keys
//! the transaction wrote, plus the rows it wrote (for each key, the newest statement's row;
//! a key it deleted contributes no row). The rewrite is a logical plan, so it runs wherever
//! the rest of the query runs, distributed like any scan, join and union.

use crate::error::{from_datafusion, Result, SqlError};
use arrow::array::RecordBatch;
use arrow::datatypes::{Field, Schema, SchemaRef};
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{Column, JoinType};
use datafusion::datasource::provider_as_source;
use datafusion::logical_expr::{LogicalPlan, LogicalPlanBuilder, TableScan};
use std::sync::Arc;
use tessera_storage::{TableChanges, TableDef};

/// The name the transaction's written rows are scanned under, before they take the
/// table's name.
const WRITTEN_ROWS: &str = "__tessera_own_writes";
/// The name the keys the transaction wrote are scanned under, and their columns' prefix.
const WRITTEN_KEYS: &str = "__tessera_written_keys";

/// Rewrites every current scan of a table `pending` names (its definition and the
/// transaction's merged changes to it) to include the transaction's writes.
pub fn overlay(
    plan: LogicalPlan,
    pending: &dyn Fn(&str) -> Result<Option<(TableDef, TableChanges)>>,
) -> Result<LogicalPlan> {
    plan.transform_up_with_subqueries(|node| {
        let LogicalPlan::TableScan(scan) = &node else {
            return Ok(Transformed::no(node));
        };
        let name = scan.table_name.table();
        // A scan `AS OF` an epoch reads history, which the transaction did not write.
        if crate::time_travel::base_table_name(name) != name {
            return Ok(Transformed::no(node));
        }
        match pending(name).map_err(SqlError::into_datafusion)? {
            Some((def, changes)) => overlaid(scan, &def, changes)
                .map(Transformed::yes)
                .map_err(SqlError::into_datafusion),
            None => Ok(Transformed::no(node)),
        }
    })
    .map(|t| t.data)
    .map_err(from_datafusion)
}

/// `scan` minus the keys `changes` wrote, plus the rows `changes` upserts.
fn overlaid(scan: &TableScan, def: &TableDef, changes: TableChanges) -> Result<LogicalPlan> {
    // Planned from SQL, before the optimizer pushed anything into the scan.
    assert!(
        scan.projection.is_none() && scan.filters.is_empty() && scan.fetch.is_none(),
        "own writes are overlaid before optimization"
    );
    let schema = scan.source.schema();
    let upserts = changes
        .upserts
        .iter()
        .map(|batch| {
            let rows = tessera_storage::versions::conform_to_schema(def, batch)?;
            Ok(RecordBatch::try_new(
                schema.clone(),
                rows.columns().to_vec(),
            )?)
        })
        .collect::<Result<Vec<_>>>()?;
    let written_rows = LogicalPlanBuilder::scan(
        WRITTEN_ROWS,
        provider_as_source(memory_table(schema.clone(), upserts.clone())?),
        None,
    )?
    .alias(scan.table_name.clone())?
    .build()?;
    let mut visible = LogicalPlanBuilder::from(LogicalPlan::TableScan(scan.clone()));
    let key = def.primary_key_indices();
    if key.is_empty() {
        // An append-only table: its rows have no key to replace, and it takes no deletes.
        if !changes.deletes.is_empty() {
            return Err(tessera_storage::StorageError::delete_from_append_only(&def.name).into());
        }
    } else {
        let key_schema = Arc::new(Schema::new(
            key.iter()
                .enumerate()
                .map(|(i, &k)| {
                    Field::new(
                        format!("{WRITTEN_KEYS}_{i}"),
                        schema.field(k).data_type().clone(),
                        true,
                    )
                })
                .collect::<Vec<_>>(),
        ));
        let rekeyed = |columns: Vec<arrow::array::ArrayRef>| {
            RecordBatch::try_new(key_schema.clone(), columns).map_err(SqlError::from)
        };
        let mut keys = Vec::new();
        for rows in &upserts {
            keys.push(rekeyed(rows.project(&key)?.columns().to_vec())?);
        }
        for deleted in &changes.deletes {
            keys.push(rekeyed(deleted.columns().to_vec())?);
        }
        let written_keys = LogicalPlanBuilder::scan(
            WRITTEN_KEYS,
            provider_as_source(memory_table(key_schema.clone(), keys)?),
            None,
        )?
        .build()?;
        let on: (Vec<Column>, Vec<Column>) = key
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                (
                    Column::new(Some(scan.table_name.clone()), schema.field(k).name()),
                    Column::new(Some(WRITTEN_KEYS), format!("{WRITTEN_KEYS}_{i}")),
                )
            })
            .unzip();
        visible = visible.join(written_keys, JoinType::LeftAnti, on, None)?;
    }
    // A union's columns lose their table; the alias gives them back the scan's name.
    Ok(visible
        .union(written_rows)?
        .alias(scan.table_name.clone())?
        .build()?)
}

fn memory_table(schema: SchemaRef, batches: Vec<RecordBatch>) -> Result<Arc<MemTable>> {
    Ok(Arc::new(MemTable::try_new(schema, vec![batches])?))
}
