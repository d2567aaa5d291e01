//! Table definitions: schema, primary key, partition key, append-only flag.

use crate::error::{Result, StorageError};
use arrow::datatypes::{Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tessera_common::version::is_reserved_column;
use tessera_common::Epoch;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TableDef {
    pub name: String,
    /// The user's columns, without the version columns.
    pub schema: Schema,
    /// Primary key columns; empty for an append-only table.
    pub primary_key: Vec<String>,
    /// Columns hashed for placement: the primary key or a prefix of it (all columns of an
    /// append-only table).
    pub partition_key: Vec<String>,
    /// Append-only tables have no key: every published row is a new row and reads skip dedup.
    pub append_only: bool,
    /// The visible epoch when the table was created.
    pub created_at: Epoch,
    /// In a cluster, the metadata log index that created the table, so replaying an old
    /// CREATE or DROP never touches a newer table of the same name; 0 in a local store.
    #[serde(default)]
    pub generation: u64,
    /// The ALTER TABLE changes the columns went through, oldest first (see
    /// [`crate::evolution`]); `schema` is the stored columns after them all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<crate::evolution::SchemaChange>,
}

impl TableDef {
    /// Validates and builds a definition. `partition_key` defaults to the primary key; a
    /// table without a primary key is append-only and partitioned by all its columns of key
    /// types (integers, strings, dates, decimals, booleans, binary).
    pub fn new(
        name: &str,
        schema: Schema,
        primary_key: Vec<String>,
        partition_key: Option<Vec<String>>,
    ) -> Result<TableDef> {
        let invalid = |reason: String| StorageError::InvalidTable {
            table: name.to_string(),
            reason,
        };
        if name.is_empty() || name.contains('@') || name.contains('/') {
            return Err(invalid(
                "table names may not be empty or contain '@' or '/'".into(),
            ));
        }
        if schema.fields().is_empty() {
            return Err(invalid("a table needs at least one column".into()));
        }
        for field in schema.fields() {
            if is_reserved_column(field.name()) {
                return Err(invalid(format!(
                    "column name {:?} is reserved",
                    field.name()
                )));
            }
        }
        for column in &primary_key {
            if schema.field_with_name(column).is_err() {
                return Err(invalid(format!(
                    "primary key column {column:?} is not a column"
                )));
            }
        }
        let append_only = primary_key.is_empty();
        let partition_key = match partition_key {
            Some(key) => {
                if append_only {
                    return Err(invalid("a partition key needs a primary key".into()));
                }
                if key.is_empty()
                    || key.len() > primary_key.len()
                    || key[..] != primary_key[..key.len()]
                {
                    return Err(invalid(format!(
                        "partition key {key:?} must be a non-empty prefix of the primary key {primary_key:?}"
                    )));
                }
                key
            }
            None if append_only => {
                let hashable: Vec<String> = schema
                    .fields()
                    .iter()
                    .filter(|f| tessera_common::is_key_type(f.data_type()))
                    .map(|f| f.name().clone())
                    .collect();
                if hashable.is_empty() {
                    return Err(invalid("an append-only table needs at least one column of a key type to place rows by".into()));
                }
                hashable
            }
            None => primary_key.clone(),
        };
        // Key columns must be hashable and comparable; checking early gives a clear error.
        for column in partition_key.iter().chain(primary_key.iter()) {
            let field = schema.field_with_name(column).expect("checked above");
            let probe = arrow::array::new_empty_array(field.data_type());
            tessera_common::partition_key_hashes(&[(column, &probe)])?;
        }
        // Primary key columns are NOT NULL whatever the declaration said.
        let fields: Vec<arrow::datatypes::Field> = schema
            .fields()
            .iter()
            .map(|f| {
                let is_key = primary_key.iter().any(|k| k == f.name());
                f.as_ref().clone().with_nullable(f.is_nullable() && !is_key)
            })
            .collect();
        let schema = Schema::new_with_metadata(fields, schema.metadata().clone());
        Ok(TableDef {
            name: name.to_string(),
            schema,
            primary_key,
            partition_key,
            append_only,
            created_at: Epoch::ZERO,
            generation: 0,
            changes: Vec::new(),
        })
    }

    pub fn schema_ref(&self) -> SchemaRef {
        Arc::new(self.schema.clone())
    }

    pub fn column_index(&self, name: &str) -> usize {
        self.schema
            .index_of(name)
            .expect("key columns are validated at table creation")
    }

    pub fn primary_key_indices(&self) -> Vec<usize> {
        self.primary_key
            .iter()
            .map(|c| self.column_index(c))
            .collect()
    }

    pub fn partition_key_indices(&self) -> Vec<usize> {
        self.partition_key
            .iter()
            .map(|c| self.column_index(c))
            .collect()
    }
}
