//! A local store's history by time and by name (see [`crate::history`]).

use super::*;
use crate::history::{LocalHistory, LocalTag};

impl Store {
    /// The newest visible epoch that committed at or before `at_ms` (milliseconds since the
    /// Unix epoch).
    pub fn epoch_at(&self, at_ms: u64) -> Result<Epoch> {
        let state = self.state();
        Ok(state.history.epoch_at(at_ms, state.visible)?)
    }

    /// When `epoch` committed, if this store recorded it.
    pub fn commit_time(&self, epoch: Epoch) -> Option<u64> {
        self.state().history.commit_time(epoch)
    }

    /// Every visible committed epoch this store recorded, and its tags: what
    /// `tessera_epochs` and `tessera_tags` show.
    pub fn history(&self) -> LocalHistory {
        let state = self.state();
        let mut history = state.history.clone();
        history.commits.retain(|epoch, _| *epoch <= state.visible);
        history
    }

    /// The epoch tag `name` pins.
    pub fn tag_epoch(&self, name: &str) -> Result<Epoch> {
        Ok(self.state().history.tag_epoch(name)?)
    }

    /// Every tag, by name.
    pub fn tags(&self) -> BTreeMap<String, LocalTag> {
        self.state().history.tags.clone()
    }

    /// Names `epoch` (the visible one if `None`) `name`, durably; returns the epoch.
    pub fn create_tag(&self, name: &str, epoch: Option<Epoch>) -> Result<Epoch> {
        let _gate = self.gate.exclusive(gate::Holder::Tag);
        self.check_poisoned()?;
        let mut state = self.state();
        let visible = state.visible;
        let epoch =
            state
                .history
                .create_tag(name, epoch, visible, tessera_common::time::now_ms())?;
        self.write_checkpoint(&state)?;
        Ok(epoch)
    }

    /// Drops tag `name`, durably.
    pub fn drop_tag(&self, name: &str) -> Result<()> {
        let _gate = self.gate.exclusive(gate::Holder::Tag);
        self.check_poisoned()?;
        let mut state = self.state();
        state.history.drop_tag(name)?;
        self.write_checkpoint(&state)
    }
}
