//! Tessera's catalog as DataFusion sees it: a schema provider whose tables are read from
//! the store, optionally pinned to an epoch (`t@42`).

use crate::decoded::DecodedComponents;
use crate::error::SqlError;
use crate::key_bounds::KeyBounds;
pub use crate::snapshot_scan::{
    plan_in_id_order, plan_snapshot_scan, FileGrouping, InIdOrder, ReadLayout, SnapshotScan,
};
use crate::system;
use crate::time_travel::{base_table_name, split_as_of};
use arrow::datatypes::{Field, Schema, SchemaRef};
use async_trait::async_trait;
use datafusion::catalog::{SchemaProvider, Session, TableProvider};
use datafusion::common::{Constraint, Constraints, DFSchema, Result, Statistics};
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{cast, lit, Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_expr::expressions::{CastExpr, Column as PhysicalColumn};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::ExecutionPlan;
use parquet::file::reader::{FileReader, SerializedFileReader};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tessera_common::ComponentHash;
use tessera_common::Epoch;
use tessera_storage::component::component_path;
use tessera_storage::evolution::{ColumnChange, FileLayout};
use tessera_storage::versions::{stored_schema, stored_user_schema};
use tessera_storage::{Store, TableDef};

/// Where a scan finds the component files a snapshot names, and how it checks one against
/// its name before reading it: a node's own store, or a compute node's cache of other
/// nodes' components.
pub trait ComponentFiles: Send + Sync {
    /// The directory holding the files, each named by its hash (`component_path`).
    fn dir(&self) -> &std::path::Path;
    /// Refuses a file whose bytes do not hash to its name (at most once per file).
    fn verify(&self, hash: &ComponentHash) -> Result<(), tessera_storage::StorageError>;
}

impl ComponentFiles for Store {
    fn dir(&self) -> &std::path::Path {
        self.components_dir()
    }

    fn verify(&self, hash: &ComponentHash) -> Result<(), tessera_storage::StorageError> {
        self.verify_component(hash)
    }
}

/// How a scan lays storage partitions out as DataFusion output partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScanLayout {
    /// Plain components are packed into as many groups as the session has target
    /// partitions (cores): the fastest layout for a query that runs on this node.
    #[default]
    Packed,
    /// Exactly one output partition per non-empty storage partition, so that a partition's
    /// rows can be placed, shipped or re-read on their own (distributed execution).
    PerStoragePartition,
}

/// The `public` schema: every table in the store.
#[derive(Debug)]
pub struct TesseraSchema {
    store: Arc<Store>,
    layout: ScanLayout,
    statistics: Arc<ComponentStatistics>,
    decoded: Arc<DecodedComponents>,
}

impl TesseraSchema {
    pub fn new(store: Arc<Store>, layout: ScanLayout) -> Self {
        TesseraSchema {
            store,
            layout,
            statistics: Arc::default(),
            decoded: Arc::default(),
        }
    }

    /// The small components this schema's scans keep decoded.
    pub fn decoded(&self) -> &Arc<DecodedComponents> {
        &self.decoded
    }
}

/// Column statistics (row count, min, max, nulls) of components, read once from their
/// Parquet footers: a component never changes, so neither do its statistics. They let
/// DataFusion's optimizer choose join sides and orders as it does for its own tables.
#[derive(Debug, Default)]
pub struct ComponentStatistics {
    by_hash: Mutex<HashMap<ComponentHash, Arc<OwnStatistics>>>,
    /// Whole-key bounds, per component and table layout (see [`KeyBounds`]).
    key_bounds: Mutex<HashMap<(ComponentHash, u32), Option<Arc<KeyBounds>>>>,
}

/// A component's columns as written and their statistics.
#[derive(Debug)]
struct OwnStatistics {
    schema: SchemaRef,
    stats: Statistics,
}

impl ComponentStatistics {
    /// The statistics of one component, in `def`'s stored schema: a component written under
    /// an earlier definition has fewer columns, perhaps narrower, so its own statistics are
    /// conformed as its rows are (by position; nothing known of columns it predates).
    pub fn get(
        &self,
        store: &dyn ComponentFiles,
        hash: &ComponentHash,
        def: &TableDef,
    ) -> Result<Arc<Statistics>> {
        let cached = self
            .by_hash
            .lock()
            .expect("statistics lock")
            .get(hash)
            .cloned();
        let own = match cached {
            Some(own) => own,
            None => {
                let own = Arc::new(Self::read(store, hash)?);
                self.by_hash
                    .lock()
                    .expect("statistics lock")
                    .insert(*hash, own.clone());
                own
            }
        };
        conform_statistics(&own, def).map(Arc::new)
    }

    /// A component's smallest and largest key under `def` (read once per component).
    pub fn key_bounds(
        &self,
        store: &dyn ComponentFiles,
        hash: &ComponentHash,
        def: &TableDef,
    ) -> Result<Option<Arc<KeyBounds>>> {
        let id = (*hash, def.layout());
        if let Some(known) = self.key_bounds.lock().expect("key bounds lock").get(&id) {
            return Ok(known.clone());
        }
        let bounds = KeyBounds::read(store, hash, def)?.map(Arc::new);
        self.key_bounds
            .lock()
            .expect("key bounds lock")
            .insert(id, bounds.clone());
        Ok(bounds)
    }

    /// A component's statistics over its own columns, from its Parquet footer.
    fn read(store: &dyn ComponentFiles, hash: &ComponentHash) -> Result<OwnStatistics> {
        let path = component_path(store.dir(), hash);
        let file = std::fs::File::open(&path)
            .map_err(|e| SqlError::to_datafusion(tessera_storage::StorageError::io(&path, e)))?;
        let reader = SerializedFileReader::new(file)?;
        let metadata = reader.metadata().file_metadata();
        let own = parquet::arrow::parquet_to_arrow_schema(
            metadata.schema_descr(),
            metadata.key_value_metadata(),
        )?;
        let schema = Arc::new(own);
        let stats =
            DFParquetMetadata::statistics_from_parquet_metadata(reader.metadata(), &schema)?;
        Ok(OwnStatistics { schema, stats })
    }
}

/// A component's own statistics (its user columns, then the epoch and operation columns)
/// in `def`'s stored schema: columns it predates are unknown, widened ones cast.
fn conform_statistics(own: &OwnStatistics, def: &TableDef) -> Result<Statistics> {
    let stored = stored_schema(def);
    let layout = FileLayout::of(def, own.schema.fields().len()).map_err(SqlError::to_datafusion)?;
    let in_own = |column: usize| layout.position(column);
    let own_type = |at: usize| own.schema.field(at).data_type();
    let mut columns = Vec::with_capacity(stored.fields().len());
    for (column, field) in stored.fields().iter().enumerate() {
        columns.push(match in_own(column) {
            None => datafusion::common::ColumnStatistics::new_unknown(),
            Some(at) if own_type(at) == field.data_type() => {
                own.stats.column_statistics[at].clone()
            }
            Some(at) => {
                let stats = &own.stats.column_statistics[at];
                let as_stored = |value: &datafusion::common::stats::Precision<_>| {
                    value
                        .cast_to(field.data_type())
                        .unwrap_or(datafusion::common::stats::Precision::Absent)
                };
                datafusion::common::ColumnStatistics {
                    null_count: stats.null_count,
                    max_value: as_stored(&stats.max_value),
                    min_value: as_stored(&stats.min_value),
                    ..datafusion::common::ColumnStatistics::new_unknown()
                }
            }
        });
    }
    Ok(Statistics {
        num_rows: own.stats.num_rows,
        total_byte_size: own.stats.total_byte_size,
        column_statistics: columns,
    })
}

#[async_trait]
impl SchemaProvider for TesseraSchema {
    fn table_names(&self) -> Vec<String> {
        let mut names = self.store.table_names();
        names.extend(LOCAL_SYSTEM_TABLES.iter().map(|name| name.to_string()));
        names
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        if let Some(system) = local_system_table(&self.store, name) {
            return system.map(Some).map_err(SqlError::into_datafusion);
        }
        let (table, epoch) = match split_as_of(name) {
            Some((table, point)) => {
                let epoch = crate::backend::resolve_local_as_of(&self.store, &point)
                    .map_err(SqlError::into_datafusion)?;
                (table, Some(epoch))
            }
            None => (name, None),
        };
        let Some(def) = self.store.table_def(table) else {
            return Ok(None);
        };
        if let Some(epoch) = epoch {
            // Fail at planning, with the store's own message, rather than mid-query.
            self.store
                .snapshot(table, Some(epoch))
                .map_err(SqlError::to_datafusion)?;
        }
        Ok(Some(Arc::new(TesseraTable::local(
            self.store.clone(),
            def,
            epoch,
            self.layout,
            self.statistics.clone(),
            self.decoded.clone(),
        ))))
    }

    fn table_exist(&self, name: &str) -> bool {
        LOCAL_SYSTEM_TABLES.contains(&name) || self.store.table_def(base_table_name(name)).is_some()
    }
}

/// The system tables a store on its own has: its history (the others describe a
/// cluster's participants, users and retention, which it has none of).
const LOCAL_SYSTEM_TABLES: [&str; 2] = [system::EPOCHS_TABLE, system::TAGS_TABLE];

/// `tessera_epochs` or `tessera_tags` of a store on its own, or `None` for another name.
fn local_system_table(
    store: &Store,
    name: &str,
) -> Option<crate::error::Result<Arc<dyn TableProvider>>> {
    if !LOCAL_SYSTEM_TABLES.contains(&name) {
        return None;
    }
    if name == system::TAGS_TABLE {
        let rows: Vec<system::TagRow> = store
            .tags()
            .iter()
            .map(|(name, tag)| system::TagRow {
                name: name.clone(),
                epoch: tag.epoch.0,
                created_at_ms: Some(tag.created_at_ms),
            })
            .collect();
        return Some(system::tags_table(&rows));
    }
    let history = store.history();
    let rows: Vec<system::EpochRow> = history
        .commits
        .iter()
        .map(|(epoch, commit)| system::EpochRow {
            epoch: epoch.0,
            committed_at_ms: history.commit_time(*epoch),
            kind: "publish",
            // No node coordinates a store's own publishes.
            coordinator: 0,
            tables: commit.tables.keys().cloned().collect(),
            rows_written: commit.tables.values().map(|r| r.written).sum(),
            rows_deleted: commit.tables.values().map(|r| r.deleted).sum(),
            publisher: None,
            participant: None,
            versions: None,
            signature: "unsigned".to_string(),
        })
        .collect();
    Some(system::epochs_table(&rows))
}

/// The primary key as DataFusion's constraint (none for an append-only table).
pub fn primary_key_constraints(def: &TableDef) -> Constraints {
    if def.primary_key.is_empty() {
        Constraints::default()
    } else {
        Constraints::new_unverified(vec![Constraint::PrimaryKey(def.primary_key_indices())])
    }
}

/// How a versioned table's rows are read for a query: from this node's store
/// ([`LocalRows`]), or from replicas across a cluster.
#[async_trait]
pub trait RowSource: std::fmt::Debug + Send + Sync + 'static {
    /// Plans a scan of `def`'s user columns `projection` (indices into its user schema),
    /// pruning by `predicate` (over its stored schema) where it can.
    async fn plan_scan(
        &self,
        def: &TableDef,
        state: &dyn Session,
        projection: Vec<usize>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>>;
}

/// One versioned table as DataFusion sees it: its user columns as of the epoch it is read
/// at (see [`tessera_storage::evolution`]), its primary key, and the source its rows are
/// read from.
#[derive(Debug)]
pub struct VersionedTable<S> {
    def: TableDef,
    /// The columns the reader sees: each one's stored position and its field then.
    columns: Vec<(usize, Field)>,
    schema: SchemaRef,
    constraints: Constraints,
    /// The DEFAULT of each column ALTER TABLE added with one, for INSERTs that leave it out.
    defaults: HashMap<String, Expr>,
    source: S,
}

impl<S: RowSource> VersionedTable<S> {
    /// `def` read at `as_of` (the current epoch, and the current columns, if `None`).
    pub fn new(def: TableDef, as_of: Option<Epoch>, source: S) -> Self {
        // Nullable as stored: a delete's tombstone carries only its key.
        let stored = stored_user_schema(&def);
        let columns: Vec<(usize, Field)> = def
            .columns_at(as_of)
            .into_iter()
            .map(|(i, f)| (i, f.with_nullable(stored.field(i).is_nullable())))
            .collect();
        let schema = Arc::new(Schema::new(
            columns.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>(),
        ));
        let key_positions: Vec<usize> = def
            .primary_key_indices()
            .iter()
            .filter_map(|k| columns.iter().position(|(i, _)| i == k))
            .collect();
        let constraints = if key_positions.is_empty() {
            Constraints::default()
        } else {
            Constraints::new_unverified(vec![Constraint::PrimaryKey(key_positions)])
        };
        let defaults = def
            .changes
            .iter()
            .filter_map(|change| match &change.kind {
                ColumnChange::Added {
                    default: Some(text),
                } => {
                    let field = def.schema.field(change.column);
                    Some((
                        field.name().clone(),
                        cast(lit(text.as_str()), field.data_type().clone()),
                    ))
                }
                _ => None,
            })
            .collect();
        VersionedTable {
            def,
            columns,
            schema,
            constraints,
            defaults,
            source,
        }
    }

    pub fn source(&self) -> &S {
        &self.source
    }

    /// Whether every column reads under its stored name and type (no rename or widening
    /// since the reader's epoch), so expressions over the columns fit the stored schema.
    fn reads_as_stored(&self) -> bool {
        let stored = stored_user_schema(&self.def);
        self.columns.iter().all(|(i, f)| {
            let s = stored.field(*i);
            s.name() == f.name() && s.data_type() == f.data_type()
        })
    }
}

#[async_trait]
impl<S: RowSource> TableProvider for VersionedTable<S> {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn constraints(&self) -> Option<&Constraints> {
        Some(&self.constraints)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn get_column_default(&self, column: &str) -> Option<&Expr> {
        self.defaults.get(column)
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        // Filters prune Parquet row groups but DataFusion still applies them: a filter on a
        // non-key column must not hide an old version before a newer one replaces it.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let projection = projection
            .cloned()
            .unwrap_or_else(|| (0..self.schema.fields().len()).collect());
        let stored_columns: Vec<usize> = projection.iter().map(|&c| self.columns[c].0).collect();
        let reads_as_stored = self.reads_as_stored();
        // Pruning only: the filters name the columns as the reader sees them, which must
        // be the stored ones for the predicate to apply to the files.
        let predicate = match conjunction(filters.to_vec()) {
            Some(predicate) if reads_as_stored => {
                let stored = stored_schema(&self.def);
                let df_schema = DFSchema::try_from(stored.as_ref().clone())?;
                Some(state.create_physical_expr(predicate, &df_schema)?)
            }
            _ => None,
        };
        let plan = self
            .source
            .plan_scan(&self.def, state, stored_columns, predicate, limit)
            .await?;
        if reads_as_stored {
            return Ok(plan);
        }
        // Stored names and types become the reader's: a renamed column's name then, a
        // widened one's type then (every value it could see fits).
        let input = plan.schema();
        let exprs = projection
            .iter()
            .enumerate()
            .map(|(j, &c)| {
                let field = &self.columns[c].1;
                let column: Arc<dyn PhysicalExpr> =
                    Arc::new(PhysicalColumn::new(input.field(j).name(), j));
                let expr = if input.field(j).data_type() == field.data_type() {
                    column
                } else {
                    Arc::new(CastExpr::new(column, field.data_type().clone(), None))
                };
                ProjectionExpr::new(expr, field.name().clone())
            })
            .collect::<Vec<_>>();
        Ok(Arc::new(ProjectionExec::try_new(exprs, plan)?))
    }
}

/// A table of this node's store, read at a fixed epoch or at whatever epoch is visible
/// when a scan starts.
#[derive(Debug)]
pub struct LocalRows {
    store: Arc<Store>,
    epoch: Option<Epoch>,
    layout: ScanLayout,
    statistics: Arc<ComponentStatistics>,
    decoded: Arc<DecodedComponents>,
}

/// A table of this node's store.
pub type TesseraTable = VersionedTable<LocalRows>;

impl TesseraTable {
    pub fn local(
        store: Arc<Store>,
        def: TableDef,
        epoch: Option<Epoch>,
        layout: ScanLayout,
        statistics: Arc<ComponentStatistics>,
        decoded: Arc<DecodedComponents>,
    ) -> Self {
        VersionedTable::new(
            def,
            epoch,
            LocalRows {
                store,
                epoch,
                layout,
                statistics,
                decoded,
            },
        )
    }
}

#[async_trait]
impl RowSource for LocalRows {
    async fn plan_scan(
        &self,
        def: &TableDef,
        state: &dyn Session,
        projection: Vec<usize>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let snapshot = self
            .store
            .snapshot(&def.name, self.epoch)
            .map_err(SqlError::to_datafusion)?;
        // This reads every partition of a local store; cold standbys exist only in a cluster,
        // whose scans replay them first (`read_local_partitions`, the distributed scan).
        if let Some(cold) = snapshot.partitions.iter().find(|p| p.rows_in_log) {
            return Err(datafusion::error::DataFusionError::Internal(format!(
                "partition {} of {:?} holds rows in its log only (a cold standby); replay it before reading",
                cold.partition, def.name
            )));
        }
        let layout = match self.layout {
            ScanLayout::PerStoragePartition => FileGrouping::PerStoragePartition,
            ScanLayout::Packed => FileGrouping::Packed(state.config().target_partitions()),
        };
        plan_snapshot_scan(SnapshotScan {
            store: self.store.as_ref(),
            snapshot: &snapshot,
            partitions: None,
            projection,
            predicate,
            limit,
            grouping: layout,
            statistics: &self.statistics,
            decoded: Some(&self.decoded),
            runtime: state.runtime_env(),
            parquet: state.table_options().parquet.clone(),
            order: Default::default(),
        })
    }
}
