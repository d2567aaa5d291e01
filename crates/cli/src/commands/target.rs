//! Where a command sends its work: a store in this process (`--data-dir`), or a running
//! cluster through one of its nodes (`--node`).

use anyhow::{bail, Result};
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_server::ClusterClient;
use tessera_sql::{Engine, StatementOutput};
use tessera_storage::{Store, TableChanges, TableDef};

pub enum Target {
    Local(Engine),
    Cluster(ClusterClient),
}

impl Target {
    pub fn local(store: Arc<Store>) -> Target {
        Target::Local(Engine::new(store))
    }

    pub fn cluster(addr: &str) -> Target {
        Target::Cluster(ClusterClient::new(addr))
    }

    pub async fn execute(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        Ok(match self {
            Target::Local(engine) => engine.execute(sql).await?,
            Target::Cluster(client) => {
                let (outputs, notices) = client.sql_with_notices(sql).await?;
                for notice in notices {
                    eprintln!("NOTICE: {}", notice.message);
                }
                outputs
            }
        })
    }

    pub async fn table_def(&self, name: &str) -> Result<Option<TableDef>> {
        Ok(match self {
            Target::Local(engine) => engine.backend().table_def(name),
            // The current catalog, not the node's own view: a node just restarted may not
            // have applied the latest CREATE or DROP yet.
            Target::Cluster(client) => client.current_metadata().await?.tables.remove(name),
        })
    }

    /// Publishes one table's upserts or deletes as a new epoch.
    pub async fn publish(&self, changes: TableChanges) -> Result<Epoch> {
        match self {
            // Rows from a file, not computed from a read of the table: nothing to conflict.
            Target::Local(engine) => Ok(engine
                .backend()
                .publish(vec![changes], &Default::default())
                .await?),
            Target::Cluster(client) => {
                let deletes = !changes.deletes.is_empty();
                if deletes && !changes.upserts.is_empty() {
                    bail!("publish upserts and deletes separately to a cluster");
                }
                let rows = if deletes {
                    changes.deletes
                } else {
                    changes.upserts
                };
                Ok(client.publish(&changes.table, rows, deletes).await?)
            }
        }
    }
}
