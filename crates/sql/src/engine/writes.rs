//! Writes: INSERT, UPDATE and DELETE run by DataFusion's plan of their input rows, then
//! published as one epoch (or kept for COMMIT inside a transaction), with the checks a
//! primary key needs (no key updated in place, no key inserted twice).

use super::{done, Engine, StatementOutput, MAX_DML_ROWS};
use crate::backend::Backend;
use crate::error::{from_datafusion, Result, SqlError};
use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use arrow::row::{RowConverter, SortField};
use datafusion::logical_expr::{DmlStatement, LogicalPlan, WriteOp};
use std::collections::HashSet;
use tessera_common::{Epoch, PartitionId, ReadEpochs};
use tessera_storage::routing::split_by_partition;
use tessera_storage::versions::stored_user_schema;
use tessera_storage::{TableChanges, TableDef};

impl Engine {
    pub(super) async fn collect(&self, plan: LogicalPlan) -> Result<Vec<RecordBatch>> {
        let frame = self
            .ctx
            .execute_logical_plan(plan)
            .await
            .map_err(from_datafusion)?;
        let batches = frame.collect().await.map_err(from_datafusion)?;
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        if rows > MAX_DML_ROWS {
            return Err(SqlError::TooManyRows {
                rows,
                limit: MAX_DML_ROWS,
            });
        }
        Ok(batches)
    }

    pub(super) async fn execute_dml(&self, dml: DmlStatement) -> Result<StatementOutput> {
        let table = dml.table_name.table().to_string();
        let def = self.backend.table_def(&table).ok_or_else(|| {
            SqlError::Storage(tessera_storage::StorageError::UnknownTable(table.clone()))
        })?;
        match dml.op {
            WriteOp::Insert(_) | WriteOp::Ctas => {
                let batches = self.collect(dml.input.as_ref().clone()).await?;
                let (rows, epoch) = self.insert(&table, batches).await?;
                Ok(done(&format!("INSERT {rows}"), epoch))
            }
            WriteOp::Update => {
                reject_key_updates(&def, &dml.input)?;
                self.rewrite_read_rows(&def, &dml).await
            }
            WriteOp::Delete => {
                if def.append_only {
                    return Err(
                        tessera_storage::StorageError::delete_from_append_only(&table).into(),
                    );
                }
                self.rewrite_read_rows(&def, &dml).await
            }
            other => Err(SqlError::Unsupported(format!("{other} statements"))),
        }
    }

    /// UPDATE and DELETE: rows computed from what the statement read, published only if
    /// the table has not changed since it read them (else another publish's change would
    /// be overwritten unseen: a lost update). Refused with [`SqlError::WriteConflict`]; a
    /// statement on its own is then planned and run again (see
    /// [`Engine::run_statement`]); inside a transaction the conflict is found at COMMIT.
    async fn rewrite_read_rows(
        &self,
        def: &TableDef,
        dml: &DmlStatement,
    ) -> Result<StatementOutput> {
        // The epoch the statement's plan reads at (its view was pinned before planning).
        let read = self.backend.visible_epoch();
        let (tag, changes) = match dml.op {
            WriteOp::Update => {
                // Each row as the statement changes it and as it read it, from one scan.
                let mut changes = TableChanges::upserts(&def.name, Vec::new());
                match with_rows_as_read(def, &dml.input)? {
                    Some(plan) => {
                        for batch in self.collect(plan).await? {
                            let (updated, as_read) = split_rows_as_read(&batch)?;
                            changes.upserts.push(updated);
                            changes.before_images.push(as_read);
                        }
                    }
                    None => changes.upserts = self.collect(dml.input.as_ref().clone()).await?,
                }
                ("UPDATE", changes)
            }
            _ => {
                let batches = self.collect(dml.input.as_ref().clone()).await?;
                let key = def.primary_key_indices();
                let keys = batches
                    .iter()
                    .map(|b| b.project(&key))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                let mut changes = TableChanges::deletes(&def.name, keys);
                // The rows a DELETE selects are the rows as it read them.
                changes.before_images = batches;
                ("DELETE", changes)
            }
        };
        let rows: usize = changes
            .upserts
            .iter()
            .chain(&changes.deletes)
            .map(|b| b.num_rows())
            .sum();
        let epoch = self.publish(changes, rows, Some(read)).await?;
        Ok(done(&format!("{tag} {rows}"), epoch))
    }

    /// Publishes one statement's changes, or inside a transaction keeps them for COMMIT.
    /// `read` is the epoch the statement read the table at, if it computed the rows from
    /// what it read (see [`Backend::publish`]).
    pub(super) async fn publish(
        &self,
        changes: TableChanges,
        rows: usize,
        read: Option<Epoch>,
    ) -> Result<Option<Epoch>> {
        // At the statement, as PostgreSQL checks privileges, not at a later COMMIT.
        self.backend.check_publish(&changes.table)?;
        if rows == 0 {
            return Ok(None);
        }
        if let Some(open) = self.transaction.lock().expect("transaction lock").as_mut() {
            open.record(changes, read);
            return Ok(None);
        }
        let read_at: ReadEpochs = read
            .map(|read| [(changes.table.clone(), read)].into())
            .unwrap_or_default();
        Ok(Some(self.backend.publish(vec![changes], &read_at).await?))
    }

    /// INSERT: publishes new rows, refusing keys that already exist at the visible epoch.
    pub(super) async fn insert(
        &self,
        table: &str,
        batches: Vec<RecordBatch>,
    ) -> Result<(usize, Option<Epoch>)> {
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        if rows == 0 {
            return Ok((0, None));
        }
        let def = self.backend.table_def(table).ok_or_else(|| {
            SqlError::Storage(tessera_storage::StorageError::UnknownTable(
                table.to_string(),
            ))
        })?;
        if !def.append_only {
            // Inside a transaction, a key it wrote is live or not as the transaction left
            // it (a key it deleted may be inserted again), whatever its start epoch holds.
            let (written, live) = match self.transaction.lock().expect("transaction lock").as_ref()
            {
                Some(open) => (open.written_keys(&def)?, open.live_keys(&def)?),
                None => (Vec::new(), Vec::new()),
            };
            reject_existing_keys(self.backend.as_ref(), &def, &batches, &written).await?;
            reject_keys_among(&def, &batches, &live)?;
        }
        let epoch = self
            .publish(TableChanges::upserts(table, batches), rows, None)
            .await?;
        Ok((rows, epoch))
    }
}

/// UPDATE changes rows in place, so it may not change a key: DataFusion plans UPDATE as a
/// projection in which every column not assigned is a plain reference to itself.
fn reject_key_updates(def: &TableDef, input: &LogicalPlan) -> Result<()> {
    let LogicalPlan::Projection(projection) = input else {
        return Err(SqlError::Unsupported("this form of UPDATE".into()));
    };
    for (expr, field) in projection.expr.iter().zip(projection.schema.fields()) {
        if !def.primary_key.iter().any(|k| k == field.name()) {
            continue;
        }
        let unchanged = matches!(expr.clone().unalias(), datafusion::logical_expr::Expr::Column(c) if c.name == *field.name());
        if !unchanged {
            return Err(SqlError::Unsupported(format!(
                "UPDATE of primary key column {:?} of table {:?}; DELETE the row and INSERT it with the new key instead",
                field.name(),
                def.name
            )));
        }
    }
    Ok(())
}

/// The prefix of the columns [`with_rows_as_read`] adds.
const AS_READ_PREFIX: &str = "__tessera_as_read_";

/// An UPDATE's input (a projection of the table's columns as updated) with each column as
/// read added after them, named with [`AS_READ_PREFIX`]: the rows' before images, from the
/// same scan. The key columns are plain references to the table's columns (see
/// [`reject_key_updates`], which runs first), and name the table as the statement
/// qualifies it.
/// `None` for a table without a key, whose rows a diff never pairs.
fn with_rows_as_read(def: &TableDef, input: &LogicalPlan) -> Result<Option<LogicalPlan>> {
    use datafusion::logical_expr::{Expr, Projection};
    let LogicalPlan::Projection(projection) = input else {
        return Err(SqlError::Unsupported("this form of UPDATE".into()));
    };
    let key_column = projection
        .expr
        .iter()
        .zip(projection.schema.fields())
        .filter(|(_, field)| def.primary_key.iter().any(|k| k == field.name()))
        .find_map(|(expr, _)| match expr.clone().unalias() {
            Expr::Column(column) => Some(column),
            _ => None,
        });
    let Some(table_column) = key_column else {
        return Ok(None);
    };
    let mut exprs = projection.expr.clone();
    for (i, field) in projection.schema.fields().iter().enumerate() {
        let as_read = datafusion::common::Column::new(table_column.relation.clone(), field.name());
        exprs.push(Expr::Column(as_read).alias(format!("{AS_READ_PREFIX}{i}")));
    }
    let plan = Projection::try_new(exprs, projection.input.clone()).map_err(from_datafusion)?;
    Ok(Some(LogicalPlan::Projection(plan)))
}

/// A batch of [`with_rows_as_read`]'s plan split into the rows as updated and as read,
/// both under the table's column names.
fn split_rows_as_read(batch: &RecordBatch) -> Result<(RecordBatch, RecordBatch)> {
    let columns = batch.num_columns() / 2;
    debug_assert!(
        batch
            .schema()
            .field(columns)
            .name()
            .starts_with(AS_READ_PREFIX),
        "the rows as read follow the rows as updated"
    );
    let updated = batch.project(&(0..columns).collect::<Vec<_>>())?;
    let fields: Vec<arrow::datatypes::Field> = updated
        .schema()
        .fields()
        .iter()
        .zip(&batch.columns()[columns..])
        .map(|(field, column)| {
            arrow::datatypes::Field::new(field.name(), column.data_type().clone(), true)
        })
        .collect();
    let as_read = RecordBatch::try_new(
        std::sync::Arc::new(arrow::datatypes::Schema::new(fields)),
        batch.columns()[columns..].to_vec(),
    )?;
    Ok((updated, as_read))
}

/// The primary-key columns of `new_rows`, as comparable rows.
struct NewKeys {
    converter: RowConverter,
    rows: arrow::row::Rows,
    /// `new_rows` in the table's stored column order.
    conformed: RecordBatch,
}

impl NewKeys {
    fn of(def: &TableDef, new_rows: &[RecordBatch]) -> Result<NewKeys> {
        let schema = stored_user_schema(def);
        let conformed: Vec<RecordBatch> = new_rows
            .iter()
            .map(|b| tessera_storage::versions::conform_to_schema(def, b))
            .collect::<std::result::Result<_, _>>()?;
        let conformed = concat_batches(&schema, &conformed)?;
        let key = def.primary_key_indices();
        let fields: Vec<SortField> = key
            .iter()
            .map(|&i| SortField::new(schema.field(i).data_type().clone()))
            .collect();
        let converter = RowConverter::new(fields)?;
        let rows = converter.convert_columns(
            &key.iter()
                .map(|&i| conformed.column(i).clone())
                .collect::<Vec<_>>(),
        )?;
        Ok(NewKeys {
            converter,
            rows,
            conformed,
        })
    }

    /// Fails naming the first key of `existing` (batches of key columns) that is new too,
    /// leaving out the keys in `superseded` (batches of key columns).
    fn reject_among(
        &self,
        def: &TableDef,
        existing: &[RecordBatch],
        superseded: &[RecordBatch],
    ) -> Result<()> {
        let superseded: Vec<arrow::row::Rows> = superseded
            .iter()
            .map(|b| self.converter.convert_columns(b.columns()))
            .collect::<std::result::Result<_, _>>()?;
        let mut wanted: HashSet<_> = self.rows.iter().collect();
        for rows in &superseded {
            for row in rows.iter() {
                wanted.remove(&row);
            }
        }
        for batch in existing {
            let existing_keys = self.converter.convert_columns(batch.columns())?;
            if let Some(row) =
                (0..batch.num_rows()).find(|&i| wanted.contains(&existing_keys.row(i)))
            {
                let values: Vec<String> = batch
                    .columns()
                    .iter()
                    .map(|c| {
                        arrow::util::display::array_value_to_string(c, row).unwrap_or_default()
                    })
                    .collect();
                return Err(SqlError::DuplicateKey(format!(
                    "duplicate key ({}) violates the primary key of table {:?}; use UPDATE to change an existing row",
                    values.join(", "),
                    def.name
                )));
            }
        }
        Ok(())
    }
}

/// Fails if any key in `new_rows` already has a live row at the visible epoch, but for
/// the keys in `superseded` (batches of key columns), whose rows there do not count.
async fn reject_existing_keys(
    backend: &dyn Backend,
    def: &TableDef,
    new_rows: &[RecordBatch],
    superseded: &[RecordBatch],
) -> Result<()> {
    let new_keys = NewKeys::of(def, new_rows)?;
    let stamped_placeholder = tessera_storage::versions::stamp(
        def,
        &new_keys.conformed,
        Epoch::ZERO,
        tessera_common::RowOp::Upsert,
    )?;
    let touched: Vec<PartitionId> = split_by_partition(def, &backend.ring(), &stamped_placeholder)?
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    let existing = backend
        .read_partitions(def, touched, def.primary_key_indices())
        .await?;
    new_keys.reject_among(def, &existing, superseded)
}

/// Fails if any key in `new_rows` is among `existing` (batches of key columns).
fn reject_keys_among(
    def: &TableDef,
    new_rows: &[RecordBatch],
    existing: &[RecordBatch],
) -> Result<()> {
    if existing.is_empty() {
        return Ok(());
    }
    NewKeys::of(def, new_rows)?.reject_among(def, existing, &[])
}
