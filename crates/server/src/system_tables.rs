//! The system tables (`tessera_epochs`, `tessera_audit`, ...) built from a statement's
//! pinned view of the metadata; their columns are `tessera_sql::system`'s.

use crate::meta::{EpochKind, MetaState};
use datafusion::catalog::TableProvider;
use std::sync::Arc;
use tessera_sql::system::{
    AuditRow, EpochRow, ParticipantRow, TableRow, TagRow, UserRow, AUDIT_TABLE, EPOCHS_TABLE,
    PARTICIPANTS_TABLE, TABLES_TABLE, TAGS_TABLE, USERS_TABLE,
};

/// A system table built from the statement's view of the metadata, or `None` if `name`
/// is not one.
pub(crate) fn system_table(
    state: &MetaState,
    name: &str,
) -> Option<tessera_sql::error::Result<Arc<dyn TableProvider>>> {
    match name {
        EPOCHS_TABLE => {
            let rows: Vec<EpochRow> = state
                .epoch_log
                .range(..=state.visible)
                .map(|(epoch, record)| EpochRow {
                    epoch: epoch.0,
                    committed_at_ms: (record.visible_at_ms > 0).then_some(record.visible_at_ms),
                    kind: match record.kind {
                        EpochKind::Publish => "publish",
                        EpochKind::Placement => "placement",
                    },
                    coordinator: record.coordinator.0,
                    tables: record.tables.clone(),
                    rows_written: record.changes.iter().map(|c| c.upserts).sum(),
                    rows_deleted: record.changes.iter().map(|c| c.deletes).sum(),
                    publisher: record.publisher.clone(),
                    participant: record.participant.clone(),
                    versions: record.seal.as_ref().map(|seal| {
                        let ids: Vec<String> = seal
                            .versions
                            .iter()
                            .map(|v| format!("{}={}", v.table, &v.version.to_hex()[..16]))
                            .collect();
                        ids.join(", ")
                    }),
                    signature: state.signature_status(*epoch, record).to_string(),
                })
                .collect();
            Some(tessera_sql::system::epochs_table(&rows))
        }
        TABLES_TABLE => {
            let rows: Vec<TableRow> = state
                .tables
                .keys()
                .map(|name| {
                    let setting = state
                        .retention
                        .get(name)
                        .map(|r| r.setting)
                        .unwrap_or_default();
                    TableRow {
                        name: name.clone(),
                        owner: state.table_owner(name).map(str::to_string),
                        retain_epochs: setting.epochs,
                        retain_for: setting
                            .for_ms
                            .map(crate::meta::retention::describe_duration),
                        oldest_readable_epoch: state.retention_horizon(name).0,
                    }
                })
                .collect();
            Some(tessera_sql::system::tables_table(&rows))
        }
        TAGS_TABLE => {
            let rows: Vec<TagRow> = state
                .tags
                .iter()
                .map(|(name, tag)| TagRow {
                    name: name.clone(),
                    epoch: tag.epoch.0,
                    created_at_ms: (tag.created_at_ms > 0).then_some(tag.created_at_ms),
                })
                .collect();
            Some(tessera_sql::system::tags_table(&rows))
        }
        PARTICIPANTS_TABLE => {
            let rows: Vec<ParticipantRow> = state
                .participants
                .iter()
                .map(|(name, record)| ParticipantRow {
                    name: name.clone(),
                    created_at_ms: (record.created_at_ms > 0).then_some(record.created_at_ms),
                    users: state
                        .users
                        .values()
                        .filter(|u| u.participant.as_ref() == Some(name))
                        .count() as u64,
                    tables_owned: state.owners.values().filter(|o| *o == name).count() as u64,
                })
                .collect();
            Some(tessera_sql::system::participants_table(&rows))
        }
        USERS_TABLE => {
            let rows: Vec<UserRow> = state
                .users
                .iter()
                .map(|(name, user)| UserRow {
                    name: name.clone(),
                    participant: user.participant.clone(),
                    roles: match &user.participant {
                        None => "cluster administrator".to_string(),
                        Some(_) => user
                            .roles
                            .iter()
                            .map(|r| r.name())
                            .collect::<Vec<_>>()
                            .join(", "),
                    },
                })
                .collect();
            Some(tessera_sql::system::users_table(&rows))
        }
        AUDIT_TABLE => {
            let rows: Vec<AuditRow> = state
                .audit_log
                .iter()
                .enumerate()
                .map(|(at, record)| AuditRow {
                    seq: at as u64 + 1,
                    at_ms: (record.at_ms > 0).then_some(record.at_ms),
                    user: record.by.clone(),
                    kind: record.event.kind(),
                    detail: record.event.to_string(),
                })
                .collect();
            Some(tessera_sql::system::audit_table(&rows))
        }
        _ => None,
    }
}
