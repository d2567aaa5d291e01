//! The metadata group's voters, kept as configured: a membership change a former leader
//! left half done is finished, and a configured voter taken back as a learner votes again
//! once it has caught up.

use super::Node;
use crate::error::{ClusterError, Result};
use crate::NodeId;
use openraft::BasicNode;
use std::collections::BTreeSet;

impl Node {
    /// Finishes a membership change a former leader left half done. A change commits a
    /// joint configuration (the old voters and the new must both agree) and then the new one
    /// alone; a leader that crashes or is deposed between the two leaves the joint one in
    /// force for good (so openraft's `change_membership` documents), and then losing any
    /// one voter of the smaller set stops every election and write. Fault run 5301 (second
    /// run): the leader crashed just after the joint configuration that made a replaced
    /// node a voter again ({2, 3} and {1, 2, 3}); 20 s later node 2 was wiped, and no
    /// election could win again. The change is finished towards its new voters; a failure
    /// (another change under way) is left to the next round of duties.
    pub(super) async fn finish_joint_membership(
        &self,
        metrics: &openraft::RaftMetrics<NodeId, BasicNode>,
    ) {
        let configs = metrics.membership_config.membership().get_joint_config();
        let Some(target) = configs.last().filter(|_| configs.len() > 1).cloned() else {
            return;
        };
        tracing::warn!(
            ?configs,
            ?target,
            "finishing a membership change a former leader left in its joint configuration"
        );
        if let Err(error) = self
            .meta
            .raft()
            .change_membership(openraft::ChangeMembers::ReplaceAllVoters(target), true)
            .await
        {
            tracing::info!(%error, "could not finish the joint membership yet");
        }
    }

    /// A configured voter that is only a learner (it came back as a replacement, its log
    /// empty) becomes a voter again once it is alive and has caught up with the log.
    pub(super) async fn promote_caught_up_voters(
        &self,
        state: &crate::meta::MetaState,
        metrics: &openraft::RaftMetrics<NodeId, BasicNode>,
    ) -> Result<()> {
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let learners: BTreeSet<NodeId> = membership.learner_ids().collect();
        let last = metrics.last_log_index.unwrap_or(0);
        for id in self.config.voter_ids() {
            if voters.contains(&id) || !learners.contains(&id) {
                continue;
            }
            let matched = metrics
                .replication
                .as_ref()
                .and_then(|r| r.get(&id).cloned().flatten())
                .map_or(0, |log_id| log_id.index);
            let alive = state.nodes.get(&id).is_some_and(|n| n.alive);
            if alive && matched + 10 >= last {
                tracing::info!(
                    node = id.0,
                    matched,
                    last,
                    "a configured voter caught up: it votes again"
                );
                self.meta
                    .raft()
                    .change_membership(
                        openraft::ChangeMembers::AddVoterIds(BTreeSet::from([id])),
                        true,
                    )
                    .await
                    .map_err(ClusterError::raft)?;
            }
        }
        Ok(())
    }
}
