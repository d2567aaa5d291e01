//! What this node shows on its HTTP port (`tessera_console`): its status and statements
//! for the console, the console's SQL box run through the cluster, and the gauges
//! refreshed before each scrape from Raft, the metadata and the store.

use crate::node::Node;
use std::sync::Arc;
use tessera_common::metrics::{label, metrics};

pub struct NodeConsole {
    node: Arc<Node>,
    sessions: crate::backend::NodeSessions,
}

impl NodeConsole {
    pub fn new(node: Arc<Node>) -> NodeConsole {
        NodeConsole {
            sessions: crate::backend::NodeSessions::new(node.clone()),
            node,
        }
    }
}

/// Rows the console's SQL box shows of one statement.
const CONSOLE_ROWS: usize = 1000;

#[async_trait::async_trait]
impl tessera_console::NodeView for NodeConsole {
    fn status(&self) -> serde_json::Value {
        let mut status = serde_json::to_value(crate::server::node_status(&self.node))
            .expect("the status serializes");
        let (running, recent) = tessera_sql::activity::snapshot();
        status["running"] = serde_json::to_value(running).expect("activity serializes");
        status["recent"] = serde_json::to_value(recent).expect("activity serializes");
        status["queries"] =
            serde_json::to_value(tessera_exec::progress::snapshot()).expect("progress serializes");
        status["publishes"] =
            serde_json::to_value(tessera_replication::publish::recent_publishes())
                .expect("publishes serialize");
        status
    }

    async fn sql(&self, sql: String, user: Option<String>) -> Result<serde_json::Value, String> {
        let engine = tessera_sql::Sessions::open(&self.sessions);
        engine.act_as(user);
        let outputs = engine
            .execute_streaming(&sql)
            .await
            .map_err(|e| tessera_sql::error::one_message(&e))?;
        let mut shown = Vec::with_capacity(outputs.len());
        for output in outputs {
            shown.push(output_json(output).await?);
        }
        Ok(serde_json::Value::Array(shown))
    }

    fn login_required(&self) -> bool {
        tessera_sql::Sessions::login_required(&self.sessions)
    }

    fn user_secret(&self, name: &str) -> Option<tessera_common::auth::ScramSecret> {
        tessera_sql::Sessions::user_secret(&self.sessions, name)
    }

    fn refresh_metrics(&self) {
        let m = metrics();
        let raft = self.node.meta.raft().metrics().borrow().clone();
        m.raft_term.set(raft.current_term as i64);
        m.raft_leader
            .set(raft.current_leader.map_or(0, |leader| leader.0 as i64));
        m.raft_last_log_index
            .set(raft.last_log_index.unwrap_or(0) as i64);
        m.raft_applied_index
            .set(raft.last_applied.map_or(0, |l| l.index) as i64);
        let view = self.node.meta.view();
        let state = &view.state;
        m.visible_epoch.set(state.visible.0 as i64);
        for id in state.nodes.keys() {
            // A replica marked stale since epoch s lacks epochs s..=visible there.
            let lag = state
                .map
                .partitions
                .iter()
                .filter_map(|p| p.stale.get(id))
                .map(|since| state.visible.0.saturating_sub(since.0) + 1)
                .max()
                .unwrap_or(0);
            m.replica_lag_epochs
                .get_or_create(&label("replica", id.0.to_string()))
                .set(lag as i64);
        }
        let unapplied: u64 = self
            .node
            .store
            .table_stats()
            .iter()
            .map(|t| t.logged_rows)
            .sum();
        m.standby_unapplied_rows.set(unapplied as i64);
        m.store_memtable_bytes
            .set(self.node.store.memtable_bytes() as i64);
        let running = self.node.exec.queries().queries_running();
        m.queries_running.set(running as i64);
        let decoded = self.node.exec.queries().decoded().usage();
        m.decoded_cache_bytes.set(decoded.bytes as i64);
        m.decoded_cache_budget_bytes
            .set(decoded.budget_bytes as i64);
        if let Some(held) = tessera_common::allocator::stats() {
            m.allocator_allocated_bytes.set(held.allocated as i64);
            m.allocator_resident_bytes.set(held.resident as i64);
        }
    }
}

/// One statement's output for the console: `{tag, epoch}`, or `{columns, rows, truncated}`
/// with the rows as objects (at most [`CONSOLE_ROWS`]).
async fn output_json(output: tessera_sql::StatementOutput) -> Result<serde_json::Value, String> {
    use futures::StreamExt;
    let (schema, mut answer) = match output.into_rows() {
        Ok(rows) => rows,
        Err((tag, epoch)) => return Ok(serde_json::json!({ "tag": tag, "epoch": epoch })),
    };
    // The rows past the shown ones are counted, not kept.
    let mut total = 0;
    let mut writer = arrow::json::ArrayWriter::new(Vec::new());
    while let Some(batch) = answer.next().await {
        let batch = batch.map_err(|e| e.to_string())?;
        let left = CONSOLE_ROWS.saturating_sub(total);
        total += batch.num_rows();
        if left > 0 {
            let shown = batch.slice(0, batch.num_rows().min(left));
            writer.write(&shown).map_err(|e| e.to_string())?;
        }
    }
    writer.finish().map_err(|e| e.to_string())?;
    let bytes = writer.into_inner();
    let rows: serde_json::Value = if bytes.is_empty() {
        serde_json::json!([])
    } else {
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())?
    };
    let columns: Vec<&String> = schema.fields().iter().map(|f| f.name()).collect();
    Ok(serde_json::json!({
        "columns": columns,
        "rows": rows,
        "truncated": total > CONSOLE_ROWS,
    }))
}
