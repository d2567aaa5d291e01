//! The version columns every stored row carries next to the table's own columns.
//!
//! A row is one version of a key: it was written at `EPOCH_COLUMN` and is either an upsert
//! or a delete tombstone (`OP_COLUMN`). Readers at epoch `e` see, per key, the newest version
//! at or below `e` unless it is a tombstone.
//!
//! A third kind of row is no version at all: a *before image* ([`RowOp::Before`]), the row
//! a key held just before the epoch that stamps it changed the key, written by an UPDATE or
//! DELETE (which read that row) so that a diff finds it without opening older files.
//! Readers of versions skip before images.

/// Hidden column holding the epoch that wrote the row version (UInt64).
pub const EPOCH_COLUMN: &str = "__tessera_epoch";
/// Hidden column holding the [`RowOp`] of the row version (UInt8).
pub const OP_COLUMN: &str = "__tessera_op";

/// What a row version does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RowOp {
    Upsert = 0,
    Delete = 1,
    /// Not a version: the key's row before this epoch changed it (see the module docs).
    Before = 2,
}

impl RowOp {
    pub fn from_u8(value: u8) -> Option<RowOp> {
        match value {
            0 => Some(RowOp::Upsert),
            1 => Some(RowOp::Delete),
            2 => Some(RowOp::Before),
            _ => None,
        }
    }
}

/// True for a column name that users may not use because it is reserved for versions.
pub fn is_reserved_column(name: &str) -> bool {
    name.starts_with("__tessera_")
}

/// The epoch at which a statement read each table it then wrote (an UPDATE's or DELETE's
/// rows come from what it read). Its publish is refused as a write conflict if one of the
/// tables changed after that epoch: the rows it computed would overwrite a change they
/// never saw (a lost update).
pub type ReadEpochs = std::collections::BTreeMap<String, crate::Epoch>;
