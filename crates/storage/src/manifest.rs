//! A partition's manifest: the immutable components that hold its flushed rows.

use crate::component::ComponentMeta;
use serde::{Deserialize, Serialize};
use tessera_common::{Epoch, Lsn};

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub components: Vec<ComponentMeta>,
    /// Every log record of this (table, partition) at or below this LSN is in a component.
    pub max_lsn: Lsn,
    /// Every committed version of this (table, partition) up to this epoch came in whole
    /// from another replica (a failback or rebalance copy, or a primary's shipped
    /// components): rows of such an epoch prepared here, arriving late, are the same
    /// versions again and are never applied.
    #[serde(default, skip_serializing_if = "Epoch::is_zero")]
    pub complete_through: Epoch,
}

impl Manifest {
    /// The components holding any row version at or below `epoch`: what a diff, a copy or a
    /// check of the versions up to `epoch` reads.
    pub fn components_at(&self, epoch: Epoch) -> Vec<ComponentMeta> {
        self.components
            .iter()
            .filter(|c| c.min_epoch <= epoch)
            .cloned()
            .collect()
    }

    /// The components a read of the table at `epoch` needs: those of
    /// [`Manifest::components_at`] less the history components every version of which is
    /// superseded at or below `epoch`.
    pub fn components_read_at(&self, epoch: Epoch) -> Vec<ComponentMeta> {
        self.components
            .iter()
            .filter(|c| c.read_at(epoch))
            .cloned()
            .collect()
    }

    pub fn add(&mut self, component: ComponentMeta) {
        assert!(
            component.max_lsn >= self.max_lsn || component.max_lsn == Lsn::ZERO,
            "LSNs rise: a new component may not end below the manifest's max LSN"
        );
        self.max_lsn = self.max_lsn.max(component.max_lsn);
        self.components.push(component);
    }

    /// Records that every committed version up to `epoch` is held (see `complete_through`).
    pub fn hold_complete_through(&mut self, epoch: Epoch) {
        self.complete_through = self.complete_through.max(epoch);
    }

    pub fn row_count(&self) -> u64 {
        self.components.iter().map(|c| c.rows).sum()
    }
}
