//! Tessera's catalog as DataFusion sees it: a schema provider whose tables are read from
//! the store, optionally pinned to an epoch (`t@42`).

use crate::error::SqlError;
use crate::scan::VersionedScanExec;
use crate::time_travel::split_epoch_name;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{SchemaProvider, Session, TableProvider};
use datafusion::common::stats::Precision;
use datafusion::common::{Constraint, Constraints, DFSchema, Result, Statistics};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::component::component_path;
use tessera_storage::versions::{stored_schema, stored_user_schema};
use tessera_storage::{Store, TableDef};

/// The `public` schema: every table in the store.
#[derive(Debug)]
pub struct TesseraSchema {
    store: Arc<Store>,
}

impl TesseraSchema {
    pub fn new(store: Arc<Store>) -> Self {
        TesseraSchema { store }
    }
}

#[async_trait]
impl SchemaProvider for TesseraSchema {
    fn table_names(&self) -> Vec<String> {
        self.store.table_names()
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        let (table, epoch) = match split_epoch_name(name) {
            Some((table, epoch)) => (table, Some(Epoch(epoch))),
            None => (name, None),
        };
        let Some(def) = self.store.table_def(table) else { return Ok(None) };
        if let Some(epoch) = epoch {
            // Fail at planning, with the store's own message, rather than mid-query.
            self.store.snapshot(table, Some(epoch)).map_err(SqlError::to_datafusion)?;
        }
        Ok(Some(Arc::new(TesseraTable::new(self.store.clone(), def, epoch))))
    }

    fn table_exist(&self, name: &str) -> bool {
        let table = split_epoch_name(name).map(|(t, _)| t).unwrap_or(name);
        self.store.table_def(table).is_some()
    }
}

/// One table, read at a fixed epoch or at whatever epoch is visible when a scan starts.
#[derive(Debug)]
pub struct TesseraTable {
    store: Arc<Store>,
    def: TableDef,
    epoch: Option<Epoch>,
    schema: SchemaRef,
    constraints: Constraints,
}

impl TesseraTable {
    pub fn new(store: Arc<Store>, def: TableDef, epoch: Option<Epoch>) -> Self {
        let schema = stored_user_schema(&def);
        let constraints = if def.primary_key.is_empty() {
            Constraints::default()
        } else {
            Constraints::new_unverified(vec![Constraint::PrimaryKey(def.primary_key_indices())])
        };
        TesseraTable { store, def, epoch, schema, constraints }
    }
}

#[async_trait]
impl TableProvider for TesseraTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn constraints(&self) -> Option<&Constraints> {
        Some(&self.constraints)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> Result<Vec<TableProviderFilterPushDown>> {
        // Filters prune Parquet row groups but DataFusion still applies them: a filter on a
        // non-key column must not hide an old version before a newer one replaces it.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(&self, state: &dyn Session, projection: Option<&Vec<usize>>, filters: &[Expr], limit: Option<usize>) -> Result<Arc<dyn ExecutionPlan>> {
        let snapshot = self.store.snapshot(&self.def.name, self.epoch).map_err(SqlError::to_datafusion)?;
        let epoch = snapshot.epoch;
        let stored = stored_schema(&self.def);
        let projection: Vec<usize> = projection.cloned().unwrap_or_else(|| (0..self.schema.fields().len()).collect());
        let mut plain = Vec::new();
        let mut versioned = Vec::new();
        for partition in snapshot.partitions.iter().filter(|p| !p.is_empty()) {
            for component in &partition.components {
                self.store.verify_component(&component.hash).map_err(SqlError::to_datafusion)?;
            }
            if partition.is_plain_scan(epoch) {
                plain.push(partition.components[0].clone());
            } else {
                versioned.push(partition.clone());
            }
        }
        let mut children: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
        if !plain.is_empty() {
            let mut source = ParquetSource::new(stored.clone());
            if let Some(predicate) = conjunction(filters.to_vec()) {
                let df_schema = DFSchema::try_from(stored.as_ref().clone())?;
                source = source.with_predicate(state.create_physical_expr(predicate, &df_schema)?);
            }
            let groups: Vec<FileGroup> = plain
                .iter()
                .map(|c| {
                    let path = component_path(self.store.components_dir(), &c.hash);
                    let location = path.to_string_lossy().trim_start_matches('/').to_string();
                    FileGroup::new(vec![PartitionedFile::new(location, c.bytes)])
                })
                .collect();
            let mut statistics = Statistics::new_unknown(&stored);
            statistics.num_rows = Precision::Exact(plain.iter().map(|c| c.rows as usize).sum());
            statistics.total_byte_size = Precision::Inexact(plain.iter().map(|c| c.bytes as usize).sum());
            let config = FileScanConfigBuilder::new(ObjectStoreUrl::local_filesystem(), Arc::new(source))
                .with_file_groups(groups)
                .with_statistics(statistics)
                .with_projection_indices(Some(projection.clone()))?
                .with_limit(limit)
                .build();
            children.push(DataSourceExec::from_data_source(config));
        }
        if !versioned.is_empty() {
            let dir = self.store.components_dir().to_path_buf();
            children.push(Arc::new(VersionedScanExec::new(snapshot.clone(), versioned, projection.clone(), dir)?));
        }
        if children.is_empty() {
            return Ok(Arc::new(EmptyExec::new(Arc::new(stored.project(&projection)?))));
        }
        UnionExec::try_new(children)
    }
}
