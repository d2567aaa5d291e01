//! What this node shows on its HTTP port (`tessera_console`): the gauges refreshed before
//! each scrape from Raft, the metadata and the store.

use crate::node::Node;
use std::sync::Arc;
use tessera_common::metrics::{label, metrics};

pub struct NodeConsole {
    node: Arc<Node>,
}

impl NodeConsole {
    pub fn new(node: Arc<Node>) -> NodeConsole {
        NodeConsole { node }
    }
}

impl tessera_console::NodeView for NodeConsole {
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
    }
}
