//! Schema evolution: ALTER TABLE's column changes as versions of a table's definition.
//!
//! A table's stored columns only grow. ADD COLUMN appends one; DROP COLUMN hides one (its
//! values stay for readers of earlier epochs, later rows store nulls, and it is renamed out
//! of the way so the name can be used again); RENAME COLUMN renames one; a widening type
//! change widens one in place. So a column is known by its position, and files and rows
//! written under any earlier version are read without rewriting: their columns are a
//! prefix of today's, cast to today's types, and the columns added since read their default
//! ([`conform_stored`]).
//!
//! Each change records the first epoch it applies to. A reader at the current epoch sees
//! the columns as they are now; a reader `AS OF` an earlier epoch sees them as they were
//! then ([`TableDef::columns_at`]).

use crate::catalog::TableDef;
use crate::error::{Result, StorageError};
use crate::versions::stored_schema;
use arrow::array::{new_null_array, ArrayRef, RecordBatch, StringArray};
use arrow::compute::{cast_with_options, CastOptions};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tessera_common::Epoch;

/// One column change in a table's history.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SchemaChange {
    /// The first epoch whose readers see the change.
    pub from: Epoch,
    /// The column's position among the table's stored columns.
    pub column: usize,
    pub kind: ColumnChange,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ColumnChange {
    /// The column was added; rows written before read `default` (its text, cast to the
    /// column's type), or null.
    Added { default: Option<String> },
    /// The column was dropped; it was called `name`.
    Dropped { name: String },
    /// The column was called `from_name` before.
    Renamed { from_name: String },
    /// The column had type `from_type` before.
    Widened { from_type: DataType },
}

/// What `ALTER TABLE` asks for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum AlterColumn {
    Add {
        field: Field,
        default: Option<String>,
    },
    Drop {
        name: String,
    },
    Rename {
        from: String,
        to: String,
    },
    Widen {
        name: String,
        to: DataType,
    },
}

impl std::fmt::Display for AlterColumn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AlterColumn::Add { field, .. } => write!(f, "ADD COLUMN {}", field.name()),
            AlterColumn::Drop { name } => write!(f, "DROP COLUMN {name}"),
            AlterColumn::Rename { from, to } => write!(f, "RENAME COLUMN {from} TO {to}"),
            AlterColumn::Widen { name, to } => write!(f, "ALTER COLUMN {name} TYPE {to}"),
        }
    }
}

/// The stored name a dropped column takes, freeing its own.
fn dropped_name(column: usize) -> String {
    format!("__tessera_dropped_{column}")
}

impl TableDef {
    /// How many changes the definition has been through: the layout its rows and files
    /// are written in (files written earlier are conformed when read).
    pub fn layout(&self) -> u32 {
        self.changes.len() as u32
    }

    /// Whether the column at stored position `column` was dropped.
    pub fn is_dropped(&self, column: usize) -> bool {
        self.changes
            .iter()
            .any(|c| c.column == column && matches!(c.kind, ColumnChange::Dropped { .. }))
    }

    /// Whether the column at stored position `column` was added by ALTER TABLE.
    pub fn was_added(&self, column: usize) -> bool {
        self.changes
            .iter()
            .any(|c| c.column == column && matches!(c.kind, ColumnChange::Added { .. }))
    }

    /// The columns a reader sees at `epoch` (now if `None`): for each, its stored position
    /// and the field as it was then.
    pub fn columns_at(&self, epoch: Option<Epoch>) -> Vec<(usize, Field)> {
        let mut columns: Vec<Option<Field>> = self
            .schema
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| (!self.is_dropped(i)).then(|| f.as_ref().clone()))
            .collect();
        if let Some(epoch) = epoch {
            // Undo, newest first, every change the reader's epoch does not see yet.
            for change in self.changes.iter().rev().filter(|c| c.from > epoch) {
                let column = &mut columns[change.column];
                match &change.kind {
                    ColumnChange::Added { .. } => *column = None,
                    ColumnChange::Dropped { name } => {
                        *column = Some(self.schema.field(change.column).clone().with_name(name))
                    }
                    ColumnChange::Renamed { from_name } => {
                        if let Some(field) = column {
                            *field = field.clone().with_name(from_name);
                        }
                    }
                    ColumnChange::Widened { from_type } => {
                        if let Some(field) = column {
                            *field = field.clone().with_data_type(from_type.clone());
                        }
                    }
                }
            }
        }
        columns
            .into_iter()
            .enumerate()
            .filter_map(|(i, f)| f.map(|f| (i, f)))
            .collect()
    }

    /// The user's schema at `epoch` (now if `None`), as [`TableDef::columns_at`] lists it.
    pub fn schema_at(&self, epoch: Option<Epoch>) -> SchemaRef {
        Arc::new(Schema::new(
            self.columns_at(epoch)
                .into_iter()
                .map(|(_, f)| f)
                .collect::<Vec<_>>(),
        ))
    }

    /// The definition after `alter`, which readers see from epoch `from` on; refused, with
    /// the reason, if the change would break the table or its history.
    pub fn altered(&self, alter: &AlterColumn, from: Epoch) -> Result<TableDef> {
        let invalid = |reason: String| StorageError::InvalidTable {
            table: self.name.clone(),
            reason,
        };
        let visible = |name: &str| {
            self.columns_at(None)
                .into_iter()
                .find(|(_, f)| f.name() == name)
                .map(|(i, _)| i)
        };
        let existing = |name: &str| {
            visible(name).ok_or_else(|| invalid(format!("column {name:?} does not exist")))
        };
        let in_keys = |name: &str| {
            self.primary_key.iter().any(|k| k == name)
                || self.partition_key.iter().any(|k| k == name)
        };
        let check_new_name = |name: &str| {
            if tessera_common::version::is_reserved_column(name) || name.is_empty() {
                return Err(invalid(format!("column name {name:?} is reserved")));
            }
            if visible(name).is_some() {
                return Err(invalid(format!("column {name:?} already exists")));
            }
            Ok(())
        };
        let mut def = self.clone();
        let mut fields: Vec<Field> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        let (column, kind) = match alter {
            AlterColumn::Add { field, default } => {
                check_new_name(field.name())?;
                if let Some(text) = default {
                    default_array(text, field.data_type(), 1).map_err(|e| {
                        invalid(format!(
                            "default {text:?} is not a value of type {}: {e}",
                            field.data_type()
                        ))
                    })?;
                } else if !field.is_nullable() {
                    return Err(invalid(format!(
                        "column {:?} is NOT NULL but has no DEFAULT: the rows already there would have no value",
                        field.name()
                    )));
                }
                fields.push(field.clone());
                (
                    fields.len() - 1,
                    ColumnChange::Added {
                        default: default.clone(),
                    },
                )
            }
            AlterColumn::Drop { name } => {
                let column = existing(name)?;
                if in_keys(name) {
                    return Err(invalid(format!(
                        "column {name:?} is part of the primary or partition key and cannot be dropped"
                    )));
                }
                if self.columns_at(None).len() == 1 {
                    return Err(invalid(format!(
                        "column {name:?} is the table's last column"
                    )));
                }
                fields[column] = fields[column]
                    .clone()
                    .with_name(dropped_name(column))
                    .with_nullable(true);
                (column, ColumnChange::Dropped { name: name.clone() })
            }
            AlterColumn::Rename { from, to } => {
                let column = existing(from)?;
                check_new_name(to)?;
                fields[column] = fields[column].clone().with_name(to);
                for key in def
                    .primary_key
                    .iter_mut()
                    .chain(def.partition_key.iter_mut())
                {
                    if key == from {
                        *key = to.clone();
                    }
                }
                (
                    column,
                    ColumnChange::Renamed {
                        from_name: from.clone(),
                    },
                )
            }
            AlterColumn::Widen { name, to } => {
                let column = existing(name)?;
                let from_type = fields[column].data_type().clone();
                if in_keys(name) {
                    return Err(invalid(format!(
                        "column {name:?} is part of the primary or partition key: its type places rows, and cannot change"
                    )));
                }
                if !is_widening(&from_type, to) {
                    return Err(invalid(format!(
                        "column {name:?} cannot change from {from_type} to {to}: only widening changes keep every stored value (a wider integer, float to double, an integer to double, a decimal with more digits, text to large text)"
                    )));
                }
                fields[column] = fields[column].clone().with_data_type(to.clone());
                (column, ColumnChange::Widened { from_type })
            }
        };
        def.schema = Schema::new_with_metadata(fields, self.schema.metadata().clone());
        def.changes.push(SchemaChange { from, column, kind });
        Ok(def)
    }
}

/// Whether every value of type `from` is exactly a value of type `to`.
pub fn is_widening(from: &DataType, to: &DataType) -> bool {
    use DataType::*;
    let rank = |t: &DataType| match t {
        Int8 => Some((true, 1)),
        Int16 => Some((true, 2)),
        Int32 => Some((true, 4)),
        Int64 => Some((true, 8)),
        UInt8 => Some((false, 1)),
        UInt16 => Some((false, 2)),
        UInt32 => Some((false, 4)),
        UInt64 => Some((false, 8)),
        _ => None,
    };
    match (from, to) {
        (Float16 | Float32, Float64) | (Float16, Float32) => true,
        (Int8 | Int16 | Int32 | UInt8 | UInt16 | UInt32, Float64) => true,
        (Utf8, LargeUtf8) | (Binary, LargeBinary) => true,
        (Decimal128(p, s), Decimal128(p2, s2)) => s == s2 && p2 > p,
        _ => match (rank(from), rank(to)) {
            (Some((signed, size)), Some((signed2, size2))) => {
                size2 > size && (signed == signed2 || (!signed && signed2))
            }
            _ => false,
        },
    }
}

/// `rows` copies of a column's default, given as text, in `data_type`.
fn default_array(text: &str, data_type: &DataType, rows: usize) -> Result<ArrayRef> {
    let texts: ArrayRef = Arc::new(StringArray::from(vec![text; rows]));
    let options = CastOptions {
        safe: false,
        ..Default::default()
    };
    Ok(cast_with_options(&texts, data_type, &options)?)
}

/// What rows written before `column` existed read there: its default, or nulls.
pub(crate) fn missing_column(def: &TableDef, column: usize, rows: usize) -> Result<ArrayRef> {
    let data_type = def.schema.field(column).data_type();
    let default = def.changes.iter().find_map(|c| match &c.kind {
        ColumnChange::Added { default } if c.column == column => default.as_deref(),
        _ => None,
    });
    match default {
        Some(text) => default_array(text, data_type, rows),
        None => Ok(new_null_array(data_type, rows)),
    }
}

/// A batch of stored rows (user columns, then the epoch and operation columns), written
/// under this or any earlier version of `def`, in `def`'s stored schema now.
pub fn conform_stored(def: &TableDef, batch: &RecordBatch) -> Result<RecordBatch> {
    let stored = stored_schema(def);
    if batch.schema() == stored {
        return Ok(batch.clone());
    }
    if batch.num_columns() < 2 {
        return Err(StorageError::SchemaMismatch {
            table: def.name.clone(),
            reason: format!(
                "{} columns are too few for stored rows",
                batch.num_columns()
            ),
        });
    }
    let layout = FileLayout::of(def, batch.num_columns())?;
    let mut columns = Vec::with_capacity(stored.fields().len());
    for (column, field) in stored.fields().iter().enumerate() {
        columns.push(match layout.position(column) {
            Some(at) => cast_to(batch.column(at), field.data_type())?,
            None => missing_column(def, column, batch.num_rows())?,
        });
    }
    Ok(RecordBatch::try_new(stored, columns)?)
}

/// Reads `columns` (positions in `def`'s stored schema, ascending) of a file written
/// under this or an earlier version of `def`: which of the file's columns to read, and
/// how to assemble what was read into the requested columns.
pub(crate) struct FileColumns {
    /// Positions in the file to read, ascending.
    pub read: Vec<usize>,
    /// For each requested column: its position among the columns read, or `None` for a
    /// column the file predates.
    sources: Vec<Option<usize>>,
    requested: Vec<usize>,
}

/// Where a file written under this or an earlier version of a definition keeps each of
/// the definition's stored columns: its user columns are a prefix of today's, then come
/// the epoch and operation columns.
#[derive(Debug, Clone, Copy)]
pub struct FileLayout {
    /// User columns in today's definition.
    user: usize,
    /// User columns in the file.
    given: usize,
}

impl FileLayout {
    /// The layout of a file with `file_columns` columns (user, epoch, operation), refused
    /// if it has more user columns than `def` (written under a newer definition).
    pub fn of(def: &TableDef, file_columns: usize) -> Result<FileLayout> {
        let user = def.schema.fields().len();
        let given = file_columns.saturating_sub(2);
        if given > user {
            return Err(StorageError::SchemaMismatch {
                table: def.name.clone(),
                reason: format!(
                    "stored rows have {given} columns, the table's definition here {user}: they were written under a newer definition than this node has applied"
                ),
            });
        }
        Ok(FileLayout { user, given })
    }

    /// The file's position of stored column `column`; `None` for one the file predates.
    pub fn position(&self, column: usize) -> Option<usize> {
        if column < self.user {
            (column < self.given).then_some(column)
        } else {
            Some(self.given + (column - self.user))
        }
    }
}

impl FileColumns {
    pub(crate) fn plan(
        def: &TableDef,
        file_columns: usize,
        requested: &[usize],
    ) -> Result<FileColumns> {
        let layout = FileLayout::of(def, file_columns)?;
        let in_file = |c: usize| layout.position(c);
        let read: Vec<usize> = requested.iter().filter_map(|&c| in_file(c)).collect();
        let sources = requested
            .iter()
            .map(|&c| in_file(c).map(|f| read.iter().position(|&r| r == f).expect("read")))
            .collect();
        Ok(FileColumns {
            read,
            sources,
            requested: requested.to_vec(),
        })
    }

    /// The requested columns of `batch` (the columns read), in `def`'s stored schema.
    pub(crate) fn assemble(&self, def: &TableDef, batch: &RecordBatch) -> Result<RecordBatch> {
        let stored = stored_schema(def);
        let schema = Arc::new(stored.project(&self.requested)?);
        let mut columns = Vec::with_capacity(self.requested.len());
        for (&column, source) in self.requested.iter().zip(&self.sources) {
            columns.push(match source {
                Some(read) => cast_to(batch.column(*read), stored.field(column).data_type())?,
                None => missing_column(def, column, batch.num_rows())?,
            });
        }
        Ok(RecordBatch::try_new_with_options(
            schema,
            columns,
            &arrow::array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
        )?)
    }
}

fn cast_to(column: &ArrayRef, data_type: &DataType) -> Result<ArrayRef> {
    if column.data_type() == data_type {
        return Ok(column.clone());
    }
    let options = CastOptions {
        safe: false,
        ..Default::default()
    };
    Ok(cast_with_options(column, data_type, &options)?)
}
