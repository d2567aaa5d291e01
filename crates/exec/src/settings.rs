//! The session's settings a query's channels run with, on whichever node they run.
//!
//! A plan is cut into stages on the node a client is connected to, and most settings are
//! spent there (the optimizer's, the join strategy's). But operators read some settings
//! only as they run (`datafusion.execution.batch_size`, a sort's spill reservation, an
//! aggregation's partial-skipping thresholds), from the context of the channel running
//! them. So a query carries its session's execution settings to every node it runs on
//! ([`ExecutionSettings`], in `RunRequest`), and each of its channels runs with them.

use datafusion::common::config::ConfigOptions;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::config::SessionConfig;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::OnceLock;

/// Where DataFusion's settings read while a plan runs live.
const EXECUTION: &str = "datafusion.execution.";

/// DataFusion's default `datafusion.execution.batch_size`, read once per process: a
/// session whose batch size differs from it chose its own.
pub fn default_batch_size() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| SessionConfig::new().batch_size())
}

/// Execution settings the cluster decides, not the session: the buckets of every exchange
/// (already in the plan).
const DECIDED_BY_THE_CLUSTER: [&str; 1] = ["datafusion.execution.target_partitions"];

/// A session's `datafusion.execution.*` settings that differ from DataFusion's defaults,
/// as `(key, value)`, in key order: every channel of its query runs with them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionSettings(Vec<(String, String)>);

impl ExecutionSettings {
    /// The execution settings of a session's `options` that are not DataFusion's defaults.
    pub fn of(options: &ConfigOptions) -> ExecutionSettings {
        // Each query's preparation asks: DataFusion's defaults are read once per process.
        static DEFAULTS: OnceLock<HashMap<String, Option<String>>> = OnceLock::new();
        let defaults = DEFAULTS.get_or_init(|| {
            let entries = SessionConfig::new().options().entries();
            entries.into_iter().map(|e| (e.key, e.value)).collect()
        });
        let default_of = |key: &str| defaults.get(key).cloned().flatten();
        let mut settings: Vec<(String, String)> = options
            .entries()
            .into_iter()
            .filter(|entry| {
                entry.key.starts_with(EXECUTION)
                    && !DECIDED_BY_THE_CLUSTER.contains(&entry.key.as_str())
            })
            .filter_map(|entry| {
                let value = entry.value?;
                (default_of(&entry.key).as_ref() != Some(&value)).then_some((entry.key, value))
            })
            .collect();
        settings.sort();
        ExecutionSettings(settings)
    }

    /// Whether the session changed none of them.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// DataFusion's default configuration with these settings: an error names a setting
    /// this node does not know or a value it refuses (a request from a node running
    /// another version, or a garbled one).
    pub fn session_config(&self) -> DfResult<SessionConfig> {
        let mut config = SessionConfig::new();
        for (key, value) in &self.0 {
            if !key.starts_with(EXECUTION) {
                return Err(DataFusionError::Configuration(format!(
                    "a query's channels take only {EXECUTION}* settings, not {key}"
                )));
            }
            config.options_mut().set(key, value).map_err(|error| {
                DataFusionError::Configuration(format!(
                    "the query's setting {key} = '{value}' cannot be applied here: {error}"
                ))
            })?;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_carries_only_the_execution_settings_it_changed() {
        let mut options = SessionConfig::new().options().as_ref().clone();
        assert!(ExecutionSettings::of(&options).is_empty());
        options
            .set("datafusion.execution.batch_size", "1000")
            .unwrap();
        options.execution.target_partitions = 7;
        options.optimizer.prefer_hash_join = false;
        options.execution.sort_spill_reservation_bytes = 1 << 20;
        let settings = ExecutionSettings::of(&options);
        assert_eq!(
            settings,
            ExecutionSettings(vec![
                ("datafusion.execution.batch_size".into(), "1000".into()),
                (
                    "datafusion.execution.sort_spill_reservation_bytes".into(),
                    "1048576".into()
                ),
            ])
        );
        let config = settings.session_config().unwrap();
        assert_eq!(config.batch_size(), 1000);
        assert_eq!(
            config.options().execution.sort_spill_reservation_bytes,
            1 << 20
        );
        assert!(
            config.options().optimizer.prefer_hash_join,
            "planning stays"
        );
    }

    #[test]
    fn a_setting_a_node_cannot_apply_is_refused_by_name() {
        let unknown = ExecutionSettings(vec![(
            "datafusion.execution.no_such_setting".into(),
            "1".into(),
        )]);
        let error = unknown.session_config().unwrap_err().to_string();
        assert!(
            error.contains("datafusion.execution.no_such_setting"),
            "{error}"
        );
        let wrong_type = ExecutionSettings(vec![(
            "datafusion.execution.batch_size".into(),
            "many".into(),
        )]);
        let error = wrong_type.session_config().unwrap_err().to_string();
        assert!(error.contains("batch_size = 'many'"), "{error}");
        let planning = ExecutionSettings(vec![(
            "datafusion.optimizer.prefer_hash_join".into(),
            "false".into(),
        )]);
        let error = planning.session_config().unwrap_err().to_string();
        assert!(
            error.contains("not datafusion.optimizer.prefer_hash_join"),
            "{error}"
        );
    }
}
