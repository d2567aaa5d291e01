//! System tables: the history a collaborator reads with plain SQL.
//!
//! - `tessera_epochs`: every committed epoch, when it became visible, what kind of change
//!   it was, which node coordinated it, the tables it touched and the rows it wrote.
//! - `tessera_tags`: the named epochs.
//! - `tessera_tables`: every table's owner, retention and oldest readable epoch.
//! - `tessera_participants`, `tessera_users`: the organizations sharing the cluster and
//!   the users who log in, with their participant and roles (never a password).
//! - `tessera_audit`: who changed membership, rights or ownership, and who published.
//!
//! They are read-only views of the cluster's metadata, built per statement from the view
//! the statement pinned, and answered on the node that plans the statement. Names with
//! the `tessera_` prefix are reserved for them.

use crate::error::{Result, SqlError};
use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, TimestampMillisecondArray};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::catalog::TableProvider;
use datafusion::datasource::MemTable;
use std::sync::Arc;

pub const EPOCHS_TABLE: &str = "tessera_epochs";
pub const TAGS_TABLE: &str = "tessera_tags";
pub const TABLES_TABLE: &str = "tessera_tables";
pub const PARTICIPANTS_TABLE: &str = "tessera_participants";
pub const USERS_TABLE: &str = "tessera_users";
pub const AUDIT_TABLE: &str = "tessera_audit";
/// Every system table's name.
pub const SYSTEM_TABLES: [&str; 6] = [
    EPOCHS_TABLE,
    TAGS_TABLE,
    TABLES_TABLE,
    PARTICIPANTS_TABLE,
    USERS_TABLE,
    AUDIT_TABLE,
];
/// Table names starting with it belong to Tessera.
pub const RESERVED_PREFIX: &str = "tessera_";

/// Whether `name` is one of the system tables.
pub fn is_system_table(name: &str) -> bool {
    SYSTEM_TABLES.contains(&name)
}

/// Refuses a user table named like a system table.
pub fn check_user_table_name(name: &str) -> Result<()> {
    if name.starts_with(RESERVED_PREFIX) {
        return Err(SqlError::InvalidValue(format!(
            "table name {name:?}: names starting with {RESERVED_PREFIX:?} are reserved for Tessera's system tables"
        )));
    }
    Ok(())
}

/// One row of `tessera_epochs`.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochRow {
    pub epoch: u64,
    /// Milliseconds since the Unix epoch; `None` if the time was not recorded.
    pub committed_at_ms: Option<u64>,
    /// `publish` or `placement`.
    pub kind: &'static str,
    pub coordinator: u64,
    pub tables: Vec<String>,
    pub rows_written: u64,
    pub rows_deleted: u64,
    /// The user who published it; `None` for the operator or a placement change.
    pub publisher: Option<String>,
    pub participant: Option<String>,
    /// Each table's version id after it, `table=<16 hex digits>`; `None` for a placement.
    pub versions: Option<String>,
    /// Whether its signature checks: `valid (participant)`, `unsigned`, `INVALID: ...`.
    pub signature: String,
}

/// One row of `tessera_tags`.
#[derive(Debug, Clone, PartialEq)]
pub struct TagRow {
    pub name: String,
    pub epoch: u64,
    pub created_at_ms: Option<u64>,
}

fn timestamp_field(name: &str) -> Field {
    Field::new(
        name,
        DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
        true,
    )
}

fn timestamps(values: impl Iterator<Item = Option<u64>>) -> ArrayRef {
    Arc::new(
        TimestampMillisecondArray::from(values.map(|v| v.map(|ms| ms as i64)).collect::<Vec<_>>())
            .with_timezone("UTC"),
    )
}

fn optional_strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    Arc::new(StringArray::from(values.collect::<Vec<_>>()))
}

fn table(schema: Schema, columns: Vec<ArrayRef>) -> Result<Arc<dyn TableProvider>> {
    let schema = Arc::new(schema);
    let batch = RecordBatch::try_new(schema.clone(), columns)?;
    Ok(Arc::new(MemTable::try_new(schema, vec![vec![batch]])?))
}

/// `tessera_epochs` over `rows`.
pub fn epochs_table(rows: &[EpochRow]) -> Result<Arc<dyn TableProvider>> {
    let schema = Schema::new(vec![
        Field::new("epoch", DataType::Int64, false),
        timestamp_field("committed_at"),
        Field::new("kind", DataType::Utf8, false),
        Field::new("coordinator", DataType::Int64, false),
        Field::new("tables", DataType::Utf8, false),
        Field::new("rows_written", DataType::Int64, false),
        Field::new("rows_deleted", DataType::Int64, false),
        Field::new("publisher", DataType::Utf8, true),
        Field::new("participant", DataType::Utf8, true),
        Field::new("versions", DataType::Utf8, true),
        Field::new("signature", DataType::Utf8, false),
    ]);
    // BIGINT, as PostgreSQL clients know it (they have no unsigned integers).
    let numbers = |f: fn(&EpochRow) -> u64| -> ArrayRef {
        Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| f(r) as i64),
        ))
    };
    table(
        schema,
        vec![
            numbers(|r| r.epoch),
            timestamps(rows.iter().map(|r| r.committed_at_ms)),
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.kind))),
            numbers(|r| r.coordinator),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.tables.join(", ")),
            )),
            numbers(|r| r.rows_written),
            numbers(|r| r.rows_deleted),
            optional_strings(rows.iter().map(|r| r.publisher.as_deref())),
            optional_strings(rows.iter().map(|r| r.participant.as_deref())),
            optional_strings(rows.iter().map(|r| r.versions.as_deref())),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.signature.as_str()),
            )),
        ],
    )
}

/// `tessera_tags` over `rows`.
pub fn tags_table(rows: &[TagRow]) -> Result<Arc<dyn TableProvider>> {
    let schema = Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("epoch", DataType::Int64, false),
        timestamp_field("created_at"),
    ]);
    table(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.name))),
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| r.epoch as i64),
            )),
            timestamps(rows.iter().map(|r| r.created_at_ms)),
        ],
    )
}

/// One row of `tessera_tables`.
#[derive(Debug, Clone, PartialEq)]
pub struct TableRow {
    pub name: String,
    /// The participant that owns it (only its users publish to it).
    pub owner: Option<String>,
    pub retain_epochs: Option<u64>,
    /// As the user would write it (`7 days`).
    pub retain_for: Option<String>,
    /// The retention horizon: the oldest epoch the table can be read at.
    pub oldest_readable_epoch: u64,
}

/// `tessera_tables` over `rows`.
pub fn tables_table(rows: &[TableRow]) -> Result<Arc<dyn TableProvider>> {
    let schema = Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("owner", DataType::Utf8, true),
        Field::new("retain_epochs", DataType::Int64, true),
        Field::new("retain_for", DataType::Utf8, true),
        Field::new("oldest_readable_epoch", DataType::Int64, false),
    ]);
    table(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.name))),
            optional_strings(rows.iter().map(|r| r.owner.as_deref())),
            Arc::new(Int64Array::from(
                rows.iter()
                    .map(|r| r.retain_epochs.map(|n| n as i64))
                    .collect::<Vec<_>>(),
            )),
            Arc::new(StringArray::from(
                rows.iter()
                    .map(|r| r.retain_for.clone())
                    .collect::<Vec<_>>(),
            )),
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| r.oldest_readable_epoch as i64),
            )),
        ],
    )
}

/// One row of `tessera_participants`.
#[derive(Debug, Clone, PartialEq)]
pub struct ParticipantRow {
    pub name: String,
    pub created_at_ms: Option<u64>,
    pub users: u64,
    pub tables_owned: u64,
}

/// `tessera_participants` over `rows`.
pub fn participants_table(rows: &[ParticipantRow]) -> Result<Arc<dyn TableProvider>> {
    let schema = Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        timestamp_field("created_at"),
        Field::new("users", DataType::Int64, false),
        Field::new("tables_owned", DataType::Int64, false),
    ]);
    table(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.name))),
            timestamps(rows.iter().map(|r| r.created_at_ms)),
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| r.users as i64),
            )),
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| r.tables_owned as i64),
            )),
        ],
    )
}

/// One row of `tessera_users`: never a password or its secret.
#[derive(Debug, Clone, PartialEq)]
pub struct UserRow {
    pub name: String,
    /// `None`: a cluster administrator.
    pub participant: Option<String>,
    /// Comma-separated, as granted.
    pub roles: String,
}

/// `tessera_users` over `rows`.
pub fn users_table(rows: &[UserRow]) -> Result<Arc<dyn TableProvider>> {
    let schema = Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("participant", DataType::Utf8, true),
        Field::new("roles", DataType::Utf8, false),
    ]);
    table(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.name))),
            optional_strings(rows.iter().map(|r| r.participant.as_deref())),
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.roles))),
        ],
    )
}

/// One row of `tessera_audit`.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRow {
    /// Its place in the log, from 1.
    pub seq: u64,
    pub at_ms: Option<u64>,
    /// The user who did it; `None` for the operator.
    pub user: Option<String>,
    pub kind: &'static str,
    /// What was done, in words.
    pub detail: String,
}

/// `tessera_audit` over `rows`.
pub fn audit_table(rows: &[AuditRow]) -> Result<Arc<dyn TableProvider>> {
    let schema = Schema::new(vec![
        Field::new("seq", DataType::Int64, false),
        timestamp_field("at"),
        Field::new("user", DataType::Utf8, true),
        Field::new("kind", DataType::Utf8, false),
        Field::new("detail", DataType::Utf8, false),
    ]);
    table(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| r.seq as i64),
            )),
            timestamps(rows.iter().map(|r| r.at_ms)),
            optional_strings(rows.iter().map(|r| r.user.as_deref())),
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.kind))),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| &r.detail),
            )),
        ],
    )
}
