//! ALTER TABLE's column changes: `ADD [COLUMN] c type [NOT NULL] [DEFAULT value]`,
//! `DROP [COLUMN] c`, `RENAME COLUMN a TO b` and `ALTER [COLUMN] c [SET DATA] TYPE t` (a
//! widening change). Each becomes a new version of the table's definition
//! ([`tessera_storage::evolution`]); nothing stored is rewritten. The changes of one
//! statement are applied one after the other. Retention (`SET (...)`) is
//! [`crate::retention`].

use crate::error::{from_datafusion, Result, SqlError};
use arrow::datatypes::{DataType, Field};
use datafusion::prelude::SessionContext;
use datafusion::sql::sqlparser::ast::{
    AlterColumnOperation, AlterTable, AlterTableOperation, ColumnDef, ColumnOption,
};
use tessera_storage::evolution::AlterColumn;

/// The table an ALTER TABLE names and the column changes it asks for.
pub async fn column_changes(
    ctx: &SessionContext,
    alter: &AlterTable,
) -> Result<(String, Vec<AlterColumn>)> {
    let table = alter
        .name
        .0
        .last()
        .and_then(|part| part.as_ident())
        .map(|ident| ident.value.clone())
        .ok_or_else(|| SqlError::Syntax(format!("ALTER TABLE of {}", alter.name)))?;
    let mut changes = Vec::with_capacity(alter.operations.len());
    for operation in &alter.operations {
        match operation {
            AlterTableOperation::AddColumn {
                column_def,
                column_position: None,
                ..
            } => changes.push(added_column(ctx, column_def).await?),
            AlterTableOperation::DropColumn { column_names, .. } => {
                changes.extend(column_names.iter().map(|name| AlterColumn::Drop {
                    name: name.value.clone(),
                }))
            }
            AlterTableOperation::RenameColumn {
                old_column_name,
                new_column_name,
            } => changes.push(AlterColumn::Rename {
                from: old_column_name.value.clone(),
                to: new_column_name.value.clone(),
            }),
            AlterTableOperation::AlterColumn {
                column_name,
                op: AlterColumnOperation::SetDataType {
                    data_type,
                    using: None,
                    ..
                },
            } => changes.push(AlterColumn::Widen {
                name: column_name.value.clone(),
                to: arrow_type(ctx, &data_type.to_string()).await?,
            }),
            other => {
                return Err(SqlError::Unsupported(format!(
                    "ALTER TABLE ... {other}: Tessera changes columns with ADD COLUMN, DROP COLUMN, RENAME COLUMN and ALTER COLUMN ... TYPE (widening), and retention with SET (...)"
                )))
            }
        }
    }
    Ok((table, changes))
}

async fn added_column(ctx: &SessionContext, column: &ColumnDef) -> Result<AlterColumn> {
    let data_type = arrow_type(ctx, &column.data_type.to_string()).await?;
    let mut nullable = true;
    let mut default = None;
    for option in &column.options {
        match &option.option {
            ColumnOption::Null => nullable = true,
            ColumnOption::NotNull => nullable = false,
            ColumnOption::Default(expr) => {
                default =
                    Some(default_text(ctx, &expr.to_string(), &column.data_type.to_string()).await?)
            }
            other => {
                return Err(SqlError::Unsupported(format!(
                    "column option {other} in ADD COLUMN (NULL, NOT NULL and DEFAULT are)"
                )))
            }
        }
    }
    Ok(AlterColumn::Add {
        field: Field::new(&column.name.value, data_type, nullable),
        default,
    })
}

/// The Arrow type DataFusion gives a SQL type name.
async fn arrow_type(ctx: &SessionContext, sql_type: &str) -> Result<DataType> {
    let plan = ctx
        .state()
        .create_logical_plan(&format!("SELECT CAST(NULL AS {sql_type})"))
        .await
        .map_err(from_datafusion)?;
    Ok(plan.schema().field(0).data_type().clone())
}

/// A default value, evaluated once, as text the storage layer casts back to the column's
/// type; NULL is no default.
async fn default_text(ctx: &SessionContext, expr: &str, sql_type: &str) -> Result<String> {
    let not_a_value = |e: datafusion::error::DataFusionError| {
        SqlError::InvalidValue(format!(
            "DEFAULT {expr} is not a value of type {sql_type}: {}",
            crate::error::one_message(&from_datafusion(e))
        ))
    };
    let batches = ctx
        .sql(&format!("SELECT CAST({expr} AS {sql_type})"))
        .await
        .map_err(not_a_value)?
        .collect()
        .await
        .map_err(not_a_value)?;
    let value = batches
        .first()
        .filter(|b| b.num_rows() == 1)
        .ok_or_else(|| SqlError::InvalidValue(format!("DEFAULT {expr} is not one value")))?;
    if value.column(0).is_null(0) {
        return Err(SqlError::InvalidValue(format!(
            "DEFAULT {expr} is NULL; leave DEFAULT out for a column that starts NULL"
        )));
    }
    Ok(arrow::util::display::array_value_to_string(
        value.column(0),
        0,
    )?)
}
