//! Tessera's own session settings, under the `tessera.` prefix of DataFusion's
//! configuration: `SET tessera.recovery = 'restart'` for the session, or a hint at the
//! head of one request, `/*+ SET tessera.recovery = restart */ SELECT ...`, for that
//! request only. The settings: `tessera.recovery`, `tessera.scans_on_compute`,
//! `tessera.colocate`, `tessera.push_semi_joins`, `tessera.query_memory_limit` and
//! `tessera.answer_buffer`.

use crate::error::{Result, SqlError};
use datafusion::common::config::{
    ConfigEntry, ConfigExtension, ConfigField, ConfigOptions, ExtensionOptions, Visit,
};
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionConfig;
use std::any::Any;
use std::fmt;
use std::str::FromStr;

/// What a distributed query does when a node it runs on dies (DESIGN §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// Fail with an error naming the dead node.
    None,
    /// Cancel everywhere and run again on the survivors with a fresh partition map.
    Restart,
    /// Rebuild only the dead node's channels on the survivors, from write-ahead lineage
    /// and the producers' upstream backups; restart if that cannot go on.
    #[default]
    Lineage,
}

impl FromStr for RecoveryMode {
    type Err = DataFusionError;

    fn from_str(value: &str) -> std::result::Result<Self, Self::Err> {
        match value
            .trim()
            .trim_matches('\'')
            .to_ascii_lowercase()
            .as_str()
        {
            "none" => Ok(RecoveryMode::None),
            "restart" => Ok(RecoveryMode::Restart),
            "lineage" => Ok(RecoveryMode::Lineage),
            other => Err(DataFusionError::Configuration(format!(
                "tessera.recovery must be none, restart or lineage, not {other:?}"
            ))),
        }
    }
}

impl fmt::Display for RecoveryMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RecoveryMode::None => "none",
            RecoveryMode::Restart => "restart",
            RecoveryMode::Lineage => "lineage",
        })
    }
}

/// The settings under `tessera.`.
#[derive(Debug, Clone)]
pub struct TesseraOptions {
    pub recovery: RecoveryMode,
    /// Scan channels run on the compute nodes too, reading from the replicas.
    pub scans_on_compute: bool,
    /// Joins and aggregations on a table's partition key run where its partitions are
    /// (scans declare their storage partitioning), moving neither side.
    pub colocate: bool,
    /// Semi and anti joins (`IN`, `EXISTS`) run below the inner joins whose rows they filter
    /// (see [`crate::semi_join_pushdown`]).
    pub push_semi_joins: bool,
    /// Set by the cluster's planner, never by a user: the plan is about to be cut into
    /// stages, whose exchanges can hash as the storage does. A plan run in one process
    /// (DataFusion's own repartitions) must not see scans declare storage partitioning.
    pub planning_for_cluster: bool,
    /// The most memory one query may hold on each node, in bytes (`None`: the node's
    /// whole pool, `[exec] memory_limit_bytes`).
    pub query_memory_limit: Option<u64>,
    /// The most bytes of an answer kept before it is sent (`None`: the whole answer); a
    /// larger answer streams (see [`crate::answer`]).
    pub answer_buffer: Option<u64>,
}

impl Default for TesseraOptions {
    fn default() -> Self {
        TesseraOptions {
            recovery: RecoveryMode::default(),
            scans_on_compute: false,
            colocate: true,
            push_semi_joins: true,
            planning_for_cluster: false,
            query_memory_limit: None,
            answer_buffer: Some(crate::answer::DEFAULT_ANSWER_BUFFER_BYTES),
        }
    }
}

impl TesseraOptions {
    /// True if a scan planned under these settings declares its storage partitioning.
    pub fn scans_declare_partitioning(&self) -> bool {
        self.colocate && self.planning_for_cluster
    }
}

const RECOVERY_KEY: &str = "recovery";
const RECOVERY_DOC: &str =
    "what a query does when a node dies under it: none (fail), restart (run again on the survivors) or lineage (the default: rebuild only the dead node's work from write-ahead lineage)";
const SCANS_ON_COMPUTE_KEY: &str = "scans_on_compute";
const COLOCATE_KEY: &str = "colocate";
const COLOCATE_DOC: &str =
    "true (the default): joins and aggregations on a table's partition key run where its partitions are, moving neither side (the other side, if not partitioned alike, is hashed as the storage hashes); false: every such join hashes both sides across the nodes";
const PUSH_SEMI_JOINS_KEY: &str = "push_semi_joins";
const PUSH_SEMI_JOINS_DOC: &str =
    "true (the default): IN and EXISTS subqueries (semi and anti joins) filter the rows of the table they test before that table is joined to others, rather than after; false: they run where the query wrote them, above the joins";
const QUERY_MEMORY_LIMIT_KEY: &str = "query_memory_limit";
const QUERY_MEMORY_LIMIT_DOC: &str =
    "the most memory one query may hold on each node, as bytes or with a unit ('512MB', '2GB'); sorts and aggregations spill to disk past it, and a query that cannot (a join's build side) fails naming the limit. none (the default): the node's whole pool ([exec] memory_limit_bytes)";
const ANSWER_BUFFER_KEY: &str = "answer_buffer";
const ANSWER_BUFFER_DOC: &str =
    "the most bytes of an answer a node keeps before sending it, as bytes or with a unit ('16MB', the default): an answer within it is sent whole once the query has finished, so a query that loses a node can be run again unseen; a larger one streams as it comes, and a failure after its first rows ends it with an error. none: keep every answer whole, however large";
const SCANS_ON_COMPUTE_DOC: &str =
    "true: scans run on the compute-only nodes too, which read the partitions from their replicas; false (the default): scans run where their partitions are, and the compute nodes take the other channels";

/// `true`/`false` (or `on`/`off`, `1`/`0`), naming the setting when it is neither.
fn parse_flag(key: &str, value: &str) -> datafusion::common::Result<bool> {
    match value
        .trim()
        .trim_matches('\'')
        .to_ascii_lowercase()
        .as_str()
    {
        "true" | "on" | "1" | "yes" => Ok(true),
        "false" | "off" | "0" | "no" => Ok(false),
        other => Err(DataFusionError::Configuration(format!(
            "tessera.{key} must be true or false, not {other:?}"
        ))),
    }
}

/// A size in bytes: a number with an optional unit (`B`, `KB`, `MB`, `GB`, `TB`, powers of
/// 1024; `KiB` and so on alike), or `none`/`0` for no limit.
fn parse_size(key: &str, value: &str) -> datafusion::common::Result<Option<u64>> {
    let text = value.trim().trim_matches('\'').trim().to_ascii_lowercase();
    if text == "none" || text == "0" {
        return Ok(None);
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let shift = match unit.trim().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => u32::MAX,
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 && shift != u32::MAX && n.leading_zeros() >= shift => Ok(Some(n << shift)),
        _ => Err(DataFusionError::Configuration(format!(
            "tessera.{key} must be a size such as 536870912, '512MB' or '2GB' (or none), not {value:?}"
        ))),
    }
}

impl ConfigExtension for TesseraOptions {
    const PREFIX: &'static str = "tessera";
}

impl ExtensionOptions for TesseraOptions {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, value: &str) -> datafusion::common::Result<()> {
        match key {
            RECOVERY_KEY => {
                self.recovery = value.parse()?;
                Ok(())
            }
            SCANS_ON_COMPUTE_KEY => {
                self.scans_on_compute = parse_flag(key, value)?;
                Ok(())
            }
            COLOCATE_KEY => {
                self.colocate = parse_flag(key, value)?;
                Ok(())
            }
            PUSH_SEMI_JOINS_KEY => {
                self.push_semi_joins = parse_flag(key, value)?;
                Ok(())
            }
            QUERY_MEMORY_LIMIT_KEY => {
                self.query_memory_limit = parse_size(key, value)?;
                Ok(())
            }
            ANSWER_BUFFER_KEY => {
                self.answer_buffer = parse_size(key, value)?;
                Ok(())
            }
            other => Err(DataFusionError::Configuration(format!(
                "unknown setting tessera.{other}; the tessera settings are: tessera.{RECOVERY_KEY}, tessera.{SCANS_ON_COMPUTE_KEY}, tessera.{COLOCATE_KEY}, tessera.{PUSH_SEMI_JOINS_KEY}, tessera.{QUERY_MEMORY_LIMIT_KEY}, tessera.{ANSWER_BUFFER_KEY}"
            ))),
        }
    }

    fn entries(&self) -> Vec<ConfigEntry> {
        vec![
            ConfigEntry {
                key: format!("tessera.{RECOVERY_KEY}"),
                value: Some(self.recovery.to_string()),
                description: RECOVERY_DOC,
            },
            ConfigEntry {
                key: format!("tessera.{SCANS_ON_COMPUTE_KEY}"),
                value: Some(self.scans_on_compute.to_string()),
                description: SCANS_ON_COMPUTE_DOC,
            },
            ConfigEntry {
                key: format!("tessera.{COLOCATE_KEY}"),
                value: Some(self.colocate.to_string()),
                description: COLOCATE_DOC,
            },
            ConfigEntry {
                key: format!("tessera.{PUSH_SEMI_JOINS_KEY}"),
                value: Some(self.push_semi_joins.to_string()),
                description: PUSH_SEMI_JOINS_DOC,
            },
            ConfigEntry {
                key: format!("tessera.{QUERY_MEMORY_LIMIT_KEY}"),
                value: Some(
                    self.query_memory_limit
                        .map_or_else(|| "none".to_string(), |b| b.to_string()),
                ),
                description: QUERY_MEMORY_LIMIT_DOC,
            },
            ConfigEntry {
                key: format!("tessera.{ANSWER_BUFFER_KEY}"),
                value: Some(
                    self.answer_buffer
                        .map_or_else(|| "none".to_string(), |b| b.to_string()),
                ),
                description: ANSWER_BUFFER_DOC,
            },
        ]
    }
}

impl ConfigField for RecoveryMode {
    fn visit<V: Visit>(&self, v: &mut V, key: &str, description: &'static str) {
        v.some(key, self, description)
    }

    fn set(&mut self, _key: &str, value: &str) -> datafusion::common::Result<()> {
        *self = value.parse()?;
        Ok(())
    }
}

/// `config` with Tessera's settings at their defaults.
pub fn with_tessera_options(config: SessionConfig) -> SessionConfig {
    if config
        .options()
        .extensions
        .get::<TesseraOptions>()
        .is_some()
    {
        return config;
    }
    config.with_option_extension(TesseraOptions::default())
}

/// The session's Tessera settings.
pub fn tessera_options(config: &SessionConfig) -> TesseraOptions {
    tessera_options_of(config.options())
}

/// The Tessera settings among DataFusion's options.
pub fn tessera_options_of(options: &ConfigOptions) -> TesseraOptions {
    options
        .extensions
        .get::<TesseraOptions>()
        .cloned()
        .unwrap_or_default()
}

/// Splits the `SET name = value` hints of a leading `/*+ ... */` comment (several hints are
/// separated by `;` or `,`) from the SQL they apply to.
pub fn split_hints(sql: &str) -> Result<(Vec<(String, String)>, &str)> {
    let trimmed = sql.trim_start();
    let Some(rest) = trimmed.strip_prefix("/*+") else {
        return Ok((Vec::new(), sql));
    };
    let end = rest
        .find("*/")
        .ok_or_else(|| SqlError::Unsupported("a /*+ hint comment is not closed with */".into()))?;
    let mut hints = Vec::new();
    for hint in rest[..end]
        .split([';', ','])
        .map(str::trim)
        .filter(|h| !h.is_empty())
    {
        let body = hint
            .strip_prefix("SET ")
            .or_else(|| hint.strip_prefix("set "))
            .unwrap_or(hint);
        let (name, value) = body.split_once('=').ok_or_else(|| {
            SqlError::Unsupported(format!("hint {hint:?} is not of the form SET name = value"))
        })?;
        hints.push((
            name.trim().to_string(),
            value.trim().trim_matches('\'').to_string(),
        ));
    }
    Ok((hints, &rest[end + 2..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn setting(engine: &crate::Engine, name: &str) -> String {
        let outputs = engine.execute(&format!("SHOW {name}")).await.unwrap();
        let Some(crate::StatementOutput::Rows { batches, .. }) = outputs.into_iter().last() else {
            panic!("SHOW {name} answered no rows");
        };
        let values = batches[0].column(1).as_any();
        let values = values
            .downcast_ref::<arrow::array::StringArray>()
            .expect("SHOW answers text");
        values.value(0).to_string()
    }

    #[tokio::test]
    async fn a_set_outlasts_its_request_and_a_hint_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            tessera_storage::Store::open(dir.path(), tessera_storage::StoreConfig::default())
                .unwrap();
        let engine = crate::Engine::new(store);
        // `execute` reads every answer whole by a hint of its own; the SET must still stay.
        engine
            .execute("SET tessera.recovery = 'restart'")
            .await
            .unwrap();
        assert_eq!(setting(&engine, "tessera.recovery").await, "restart");
        engine
            .execute("/*+ SET tessera.recovery = none */ SELECT 1")
            .await
            .unwrap();
        assert_eq!(setting(&engine, "tessera.recovery").await, "restart");
        engine
            .execute("/*+ SET tessera.recovery = none */ SET tessera.colocate = false")
            .await
            .unwrap();
        assert_eq!(setting(&engine, "tessera.recovery").await, "restart");
        assert_eq!(setting(&engine, "tessera.colocate").await, "false");
    }

    #[test]
    fn recovery_modes_parse_and_bad_ones_are_named() {
        assert_eq!(
            "restart".parse::<RecoveryMode>().unwrap(),
            RecoveryMode::Restart
        );
        assert_eq!(
            "'LINEAGE'".parse::<RecoveryMode>().unwrap(),
            RecoveryMode::Lineage
        );
        let error = "sometimes".parse::<RecoveryMode>().unwrap_err().to_string();
        assert!(error.contains("\"sometimes\""), "{error}");
    }

    #[test]
    fn memory_limits_parse_with_units_and_bad_ones_are_named() {
        let mut options = TesseraOptions::default();
        assert_eq!(options.query_memory_limit, None);
        for (text, bytes) in [
            ("1048576", 1 << 20),
            ("'512MB'", 512 << 20),
            ("2 GiB", 2 << 30),
            ("64kb", 64 << 10),
        ] {
            options.set(QUERY_MEMORY_LIMIT_KEY, text).unwrap();
            assert_eq!(options.query_memory_limit, Some(bytes), "{text}");
        }
        options.set(QUERY_MEMORY_LIMIT_KEY, "none").unwrap();
        assert_eq!(options.query_memory_limit, None);
        for bad in ["lots", "12XB", "-5MB", "99999999999TB"] {
            let error = options
                .set(QUERY_MEMORY_LIMIT_KEY, bad)
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("tessera.query_memory_limit must be a size") && error.contains(bad),
                "{error}"
            );
        }
        // Co-location is on unless turned off, and only the cluster's planner plans for it.
        assert!(options.colocate && !options.scans_declare_partitioning());
        options.set(COLOCATE_KEY, "off").unwrap();
        assert!(!options.colocate);
        assert!(options.set("planning_for_cluster", "true").is_err());
    }

    #[test]
    fn scans_on_compute_is_a_flag_and_a_bad_value_is_named() {
        let mut options = TesseraOptions::default();
        assert!(
            !options.scans_on_compute,
            "scans stay with their data by default"
        );
        options.set(SCANS_ON_COMPUTE_KEY, "'on'").unwrap();
        assert!(options.scans_on_compute);
        options.set(SCANS_ON_COMPUTE_KEY, "false").unwrap();
        assert!(!options.scans_on_compute);
        let error = options
            .set(SCANS_ON_COMPUTE_KEY, "sometimes")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("tessera.scans_on_compute must be true or false")
                && error.contains("sometimes"),
            "{error}"
        );
        let unknown = options.set("nonsense", "1").unwrap_err().to_string();
        assert!(unknown.contains("tessera.scans_on_compute"), "{unknown}");
    }

    #[test]
    fn hints_are_split_from_their_statement() {
        let (hints, rest) = split_hints("  /*+ SET tessera.recovery = 'none' */ SELECT 1").unwrap();
        assert_eq!(hints, vec![("tessera.recovery".into(), "none".into())]);
        assert_eq!(rest.trim(), "SELECT 1");
        let (hints, rest) = split_hints("/* plain */ SELECT 1").unwrap();
        assert!(hints.is_empty());
        assert_eq!(rest, "/* plain */ SELECT 1");
        assert!(split_hints("/*+ SET x = 1 SELECT 1").is_err());
    }
}
