//! The cluster's members as the metadata records them.

use crate::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeInfo {
    pub id: NodeId,
    pub addr: String,
    pub alive: bool,
    /// A decommissioned node holds no partitions and is no longer a member.
    pub decommissioned: bool,
    /// Asked to leave: its partitions move to the other members, then it is decommissioned.
    #[serde(default)]
    pub leaving: bool,
    /// The newest process of this node the metadata has heard from: a counter the node
    /// keeps on disk and raises at every start. Epochs opened by an older process are dead.
    #[serde(default)]
    pub incarnation: u64,
    /// A compute-only node (`role = "compute"`): a member that runs query channels but is
    /// never given partitions.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compute: bool,
}

impl NodeInfo {
    /// A new member, alive, as it registers or is founded.
    pub(super) fn joining(id: NodeId, addr: String, compute: bool) -> NodeInfo {
        NodeInfo {
            id,
            addr,
            alive: true,
            decommissioned: false,
            leaving: false,
            incarnation: 0,
            compute,
        }
    }

    /// "storage" or "compute", as `role` in `node.toml` says it.
    pub fn role(&self) -> &'static str {
        if self.compute {
            "compute"
        } else {
            "storage"
        }
    }
}

impl super::MetaState {
    /// The live compute-only nodes, by id: where the planner puts channels that read no
    /// partition first.
    pub fn live_compute_nodes(&self) -> Vec<NodeId> {
        self.live_nodes()
            .filter(|n| n.compute)
            .map(|n| n.id)
            .collect()
    }

    /// Refuses a map that gives a partition to a compute node (or to a node that is not a
    /// member): compute nodes hold no replicas, whatever computed the map.
    pub(super) fn check_only_storage_nodes_hold(
        &self,
        map: &super::PartitionMap,
    ) -> Result<(), String> {
        for (index, placement) in map.partitions.iter().enumerate() {
            for replica in &placement.replicas {
                match self.nodes.get(replica) {
                    Some(node) if node.compute => {
                        return Err(format!(
                            "partition {index} cannot be placed on node {replica}: it is a compute node, which holds no partitions"
                        ))
                    }
                    Some(_) => {}
                    None => {
                        return Err(format!(
                            "partition {index} cannot be placed on node {replica}: it is not a member"
                        ))
                    }
                }
            }
        }
        Ok(())
    }
}
