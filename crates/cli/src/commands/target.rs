//! Where a command sends its work: a store in this process (`--data-dir`), or a running
//! cluster through one of its nodes (`--node`).

use anyhow::{anyhow, bail, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use futures::stream::BoxStream;
use futures::StreamExt;
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_server::sql_answers::SqlEvent;
use tessera_server::ClusterClient;
use tessera_sql::{Engine, StatementOutput};
use tessera_storage::{Store, TableChanges, TableDef};

pub enum Target {
    /// A store on this machine, and the engine over it.
    Local(Engine, Arc<Store>),
    Cluster(ClusterClient),
}

impl Target {
    pub fn local(store: Arc<Store>) -> Target {
        Target::Local(Engine::new(store.clone()), store)
    }

    pub fn cluster(addr: &str) -> Target {
        Target::Cluster(ClusterClient::new(addr))
    }

    /// Ends a bulk load: every live node (or the local store) flushes and merges each
    /// partition it holds down to one component, so queries open one file per partition
    /// however the load was cut into publishes.
    pub async fn settle(&self) -> Result<()> {
        match self {
            Target::Local(_, store) => {
                let store = store.clone();
                tokio::task::spawn_blocking(move || store.settle()).await??;
            }
            Target::Cluster(client) => {
                let status = client.status().await?;
                for node in status.meta.live_nodes() {
                    ClusterClient::new(&node.addr).settle().await?;
                }
            }
        }
        Ok(())
    }

    pub async fn execute(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        Ok(match self {
            Target::Local(engine, _) => engine.execute(sql).await?,
            Target::Cluster(client) => {
                let (outputs, notices) = client.sql_with_notices(sql).await?;
                for notice in notices {
                    eprintln!("NOTICE: {}", notice.message);
                }
                outputs
            }
        })
    }

    /// Runs `sql` and prints what each statement returns as it arrives (from a cluster) or
    /// once it is done (a local store).
    pub async fn print(
        &self,
        sql: &str,
        format: crate::Format,
        out: &mut impl std::io::Write,
    ) -> Result<()> {
        match self {
            Target::Local(engine, _) => {
                for output in engine.execute(sql).await? {
                    crate::output::print_output(&output, format, out)?;
                }
                Ok(())
            }
            Target::Cluster(client) => {
                let events = client.sql_stream(sql).await?.boxed();
                crate::output::print_events(events, format, out).await
            }
        }
    }

    /// Runs `sql`, whose statement with rows is its last; that answer's schema, and its
    /// rows as they come, never held whole (a cluster's node streams them).
    pub async fn rows(
        &self,
        sql: &str,
    ) -> Result<(SchemaRef, BoxStream<'static, Result<RecordBatch>>)> {
        match self {
            Target::Local(engine, _) => match engine.execute_streaming(sql).await?.pop() {
                Some(StatementOutput::Rows { schema, batches }) => Ok((
                    schema,
                    futures::stream::iter(batches.into_iter().map(Ok)).boxed(),
                )),
                Some(StatementOutput::Streaming { schema, stream }) => {
                    Ok((schema, stream.map(|batch| Ok(batch?)).boxed()))
                }
                _ => bail!("{sql} returns no rows"),
            },
            Target::Cluster(client) => {
                let mut events = client.sql_stream(sql).await?.boxed();
                let schema = loop {
                    match events.next().await.transpose()? {
                        Some(SqlEvent::Rows(schema)) => break schema,
                        Some(SqlEvent::Notice(notice)) => eprintln!("NOTICE: {}", notice.message),
                        // A statement before the one with rows (such as a SET).
                        Some(SqlEvent::Done { .. }) => {}
                        Some(SqlEvent::Batch(_)) => unreachable!("rows come after their schema"),
                        None => bail!("{sql} returns no rows"),
                    }
                };
                let sql = sql.to_string();
                let batches = events.filter_map(move |event| {
                    let sql = sql.clone();
                    async move {
                        match event {
                            Ok(SqlEvent::Batch(batch)) => Some(Ok(batch)),
                            Ok(SqlEvent::Notice(notice)) => {
                                eprintln!("NOTICE: {}", notice.message);
                                None
                            }
                            Ok(SqlEvent::Rows(_) | SqlEvent::Done { .. }) => Some(Err(anyhow!(
                                "{sql}: a statement follows the one with rows; give one query"
                            ))),
                            Err(error) => Some(Err(error.into())),
                        }
                    }
                });
                Ok((schema, batches.boxed()))
            }
        }
    }

    pub async fn table_def(&self, name: &str) -> Result<Option<TableDef>> {
        Ok(match self {
            Target::Local(engine, _) => engine.backend().table_def(name),
            // The current catalog, not the node's own view: a node just restarted may not
            // have applied the latest CREATE or DROP yet.
            Target::Cluster(client) => client.current_metadata().await?.tables.remove(name),
        })
    }

    /// Publishes one table's upserts or deletes as a new epoch.
    pub async fn publish(&self, changes: TableChanges) -> Result<Epoch> {
        match self {
            // Rows from a file, not computed from a read of the table: nothing to conflict.
            Target::Local(engine, _) => Ok(engine
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
