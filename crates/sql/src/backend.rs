//! Where the engine's tables live: one local store, or a cluster. The engine plans and
//! checks statements the same way for both; a backend supplies the catalog, the scans and
//! the publish path.

use crate::access::AccessStatement;
use crate::changes::{ChangesSource, ChangesTable};
use crate::engine::StatementOutput;
use crate::error::{from_datafusion, Result, SqlError};
use crate::provider::{ScanLayout, TesseraSchema};
use crate::retention::RetentionStatement;
use crate::scan::read_visible_partition;
use crate::tags::TagStatement;
use crate::time_travel::AsOf;
use crate::users::UserChange;
use arrow::array::RecordBatch;
use async_trait::async_trait;
use datafusion::catalog::SchemaProvider;
use datafusion::catalog::TableProvider;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use std::sync::Arc;
use tessera_common::{Epoch, PartitionId, PartitionRing, ReadEpochs};
use tessera_storage::changes::changes_schema;
use tessera_storage::evolution::AlterColumn;
use tessera_storage::versions::RowOrder;
use tessera_storage::{Store, TableChanges, TableDef};

#[async_trait]
pub trait Backend: Send + Sync + 'static {
    fn table_def(&self, name: &str) -> Option<TableDef>;

    fn ring(&self) -> PartitionRing;

    /// The tables as DataFusion sees them.
    fn schema_provider(&self) -> Arc<dyn SchemaProvider>;

    /// Called before each statement is planned: a backend may fix the catalog and epoch the
    /// statement sees here, or refuse the statement (it cannot see a current catalog).
    async fn begin_statement(&self) -> Result<()> {
        Ok(())
    }

    async fn create_table(&self, def: TableDef) -> Result<()>;

    async fn drop_table(&self, name: &str) -> Result<()>;

    /// Changes one column of a table (ALTER TABLE); later statements see it.
    async fn alter_table(&self, table: &str, alter: AlterColumn) -> Result<()>;

    /// Publishes the changes as one epoch, visible when this returns. `read_at` names, for
    /// each table whose rows the statement computed from what it read (UPDATE, DELETE),
    /// the epoch it read at: if that table changed since, the publish is refused with
    /// [`SqlError::WriteConflict`], and nothing is written.
    async fn publish(&self, changes: Vec<TableChanges>, read_at: &ReadEpochs) -> Result<Epoch>;

    /// Creates, changes or drops a user of the SQL endpoints.
    async fn change_user(&self, _change: UserChange) -> Result<()> {
        Err(SqlError::Unsupported(
            "users: they live in a cluster's metadata, and a local store has none".into(),
        ))
    }

    /// Whether `name` is a user (for `IF NOT EXISTS` and `IF EXISTS`).
    fn user_exists(&self, _name: &str) -> bool {
        false
    }

    /// The user this backend's statements run for from now on (`None`: the cluster's
    /// operator): a front end sets it once its client has logged in. A backend without
    /// users (a local store) ignores it.
    fn act_as(&self, _user: Option<String>) {}

    /// Refuses a write to `table` that the acting user may not publish (the cluster
    /// checks again, authoritatively, when the publish takes its epoch).
    fn check_publish(&self, _table: &str) -> Result<()> {
        Ok(())
    }

    /// Creates or drops a participant, grants or revokes a role, hands a table over.
    async fn change_access(&self, _change: AccessStatement) -> Result<()> {
        Err(SqlError::Unsupported(
            "participants, roles and owners: they live in a cluster's metadata, and a local store has none".into(),
        ))
    }

    /// Whether participant `name` exists (for `IF NOT EXISTS` and `IF EXISTS`).
    fn participant_exists(&self, _name: &str) -> bool {
        false
    }

    /// Creates or drops a tag; returns the epoch a created tag pins.
    async fn change_tag(&self, change: TagStatement) -> Result<Option<Epoch>>;

    /// Changes how much of a table's history is kept; returns its retention horizon (the
    /// oldest epoch still readable).
    async fn change_retention(&self, _change: &RetentionStatement) -> Result<Epoch> {
        Err(SqlError::Unsupported(
            "retention: it is kept in a cluster's metadata, and a local store has none".into(),
        ))
    }

    /// Whether tag `name` exists (for `IF NOT EXISTS` and `IF EXISTS`).
    fn tag_exists(&self, name: &str) -> bool;

    /// The epoch a point in history names, as the statement sees the metadata.
    fn resolve_as_of(&self, point: &AsOf) -> Result<Epoch>;

    /// The newest epoch the statement may read.
    fn visible_epoch(&self) -> Epoch;

    /// `def`'s changes from `from` to `to` as a table (`tessera_changes`).
    fn changes_table(
        &self,
        def: TableDef,
        from: Epoch,
        to: Epoch,
    ) -> Result<Arc<dyn TableProvider>>;

    /// Runs a statement that returns rows (a query, EXPLAIN, SHOW ...). The default plans
    /// and executes it with DataFusion in this process; a cluster distributes it.
    async fn run_query(&self, ctx: &SessionContext, plan: LogicalPlan) -> Result<StatementOutput> {
        run_in_process(ctx, plan).await
    }

    /// Notices for the client raised since the last call (such as a query that recovered
    /// from a node failure), oldest first.
    fn take_notices(&self) -> Vec<String> {
        Vec::new()
    }

    /// The live rows of `partitions` of `def` at the visible epoch, keeping the user columns
    /// `columns`.
    async fn read_partitions(
        &self,
        def: &TableDef,
        partitions: Vec<PartitionId>,
        columns: Vec<usize>,
    ) -> Result<Vec<RecordBatch>>;
}

/// Plans and executes `plan` with DataFusion in this process.
pub async fn run_in_process(ctx: &SessionContext, plan: LogicalPlan) -> Result<StatementOutput> {
    let frame = ctx
        .execute_logical_plan(plan)
        .await
        .map_err(from_datafusion)?;
    let buffer = crate::options::tessera_options(ctx.state().config()).answer_buffer;
    let answer = frame.execute_stream().await.map_err(from_datafusion)?;
    crate::answer::buffered(answer, buffer)
        .await
        .map_err(from_datafusion)
}

/// Tables in one store on this machine.
pub struct LocalBackend {
    store: Arc<Store>,
    schema: Arc<TesseraSchema>,
}

impl LocalBackend {
    pub fn new(store: Arc<Store>, layout: ScanLayout) -> LocalBackend {
        LocalBackend {
            schema: Arc::new(TesseraSchema::new(store.clone(), layout)),
            store,
        }
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
}

/// The epoch a point in a local store's history names.
pub(crate) fn resolve_local_as_of(store: &Store, point: &AsOf) -> Result<Epoch> {
    crate::time_travel::refuse_future(point)?;
    let resolved = match point {
        AsOf::Epoch(epoch) => return Ok(Epoch(*epoch)),
        AsOf::Timestamp(at_ms) => store.epoch_at(*at_ms),
        AsOf::Tag(name) => store.tag_epoch(name),
    };
    resolved.map_err(history_error)
}

/// A local store's refusal of a point in its history or a tag change, as the cluster
/// words and classifies the same refusals.
fn history_error(error: tessera_storage::StorageError) -> SqlError {
    use tessera_storage::history::HistoryRefusal;
    match error {
        tessera_storage::StorageError::History(refusal) => {
            let message = refusal.to_string();
            match refusal {
                HistoryRefusal::TagExists { .. } => SqlError::DuplicateObject(message),
                HistoryRefusal::NoSuchTag(_) => SqlError::UndefinedObject(message),
                HistoryRefusal::OutOfRange(_) => SqlError::InvalidValue(message),
            }
        }
        other => other.into(),
    }
}

/// Runs blocking storage work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| crate::SqlError::Unsupported(format!("storage task failed: {e}")))?
}

#[async_trait]
impl Backend for LocalBackend {
    fn table_def(&self, name: &str) -> Option<TableDef> {
        self.store.table_def(name)
    }

    fn ring(&self) -> PartitionRing {
        self.store.ring()
    }

    fn resolve_as_of(&self, point: &AsOf) -> Result<Epoch> {
        resolve_local_as_of(&self.store, point)
    }

    async fn change_tag(&self, change: TagStatement) -> Result<Option<Epoch>> {
        let store = self.store.clone();
        blocking(move || {
            let changed = match &change {
                TagStatement::Create { name, epoch, .. } => {
                    store.create_tag(name, epoch.map(Epoch)).map(Some)
                }
                TagStatement::Drop { name, .. } => store.drop_tag(name).map(|()| None),
            };
            changed.map_err(history_error)
        })
        .await
    }

    fn tag_exists(&self, name: &str) -> bool {
        self.store.tag_epoch(name).is_ok()
    }

    fn schema_provider(&self) -> Arc<dyn SchemaProvider> {
        self.schema.clone()
    }

    async fn create_table(&self, def: TableDef) -> Result<()> {
        let store = self.store.clone();
        blocking(move || Ok(store.create_table(def)?)).await
    }

    async fn drop_table(&self, name: &str) -> Result<()> {
        let (store, name) = (self.store.clone(), name.to_string());
        blocking(move || Ok(store.drop_table(&name)?)).await
    }

    async fn alter_table(&self, table: &str, alter: AlterColumn) -> Result<()> {
        let (store, table) = (self.store.clone(), table.to_string());
        blocking(move || Ok(store.alter_table(&table, &alter).map(|_| ())?)).await
    }

    async fn publish(&self, changes: Vec<TableChanges>, read_at: &ReadEpochs) -> Result<Epoch> {
        let (store, read_at) = (self.store.clone(), read_at.clone());
        blocking(move || match store.publish_read_at(changes, &read_at) {
            Ok(epoch) => Ok(epoch),
            Err(conflict @ tessera_storage::StorageError::WriteConflict { .. }) => {
                Err(SqlError::WriteConflict(conflict.to_string()))
            }
            Err(other) => Err(other.into()),
        })
        .await
    }

    fn visible_epoch(&self) -> Epoch {
        self.store.visible_epoch()
    }

    fn changes_table(
        &self,
        def: TableDef,
        from: Epoch,
        to: Epoch,
    ) -> Result<Arc<dyn TableProvider>> {
        let source = LocalChanges {
            store: self.store.clone(),
            parallelism: std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        Ok(Arc::new(ChangesTable::new(def, from, to, source)))
    }

    async fn read_partitions(
        &self,
        def: &TableDef,
        partitions: Vec<PartitionId>,
        columns: Vec<usize>,
    ) -> Result<Vec<RecordBatch>> {
        let (store, def) = (self.store.clone(), def.clone());
        blocking(move || read_local_partitions(&store, &def, None, &partitions, &columns)).await
    }
}

/// A diff read from every partition of this node's store.
#[derive(Debug)]
struct LocalChanges {
    store: Arc<Store>,
    /// How many groups of partitions are read at once.
    parallelism: usize,
}

#[async_trait]
impl ChangesSource for LocalChanges {
    async fn plan_changes(
        &self,
        def: &TableDef,
        from: Epoch,
        to: Epoch,
        projection: Vec<usize>,
    ) -> datafusion::common::Result<Arc<dyn ExecutionPlan>> {
        // The partitions in as many groups as this machine has cores, read at once.
        let groups = partition_groups(self.store.ring().partition_count(), self.parallelism);
        let columns: Vec<usize> = (0..changes_schema(def).fields().len()).collect();
        let reads = groups.into_iter().map(|partitions| {
            let (store, def, columns) = (self.store.clone(), def.clone(), columns.clone());
            blocking(move || {
                read_local(
                    &store,
                    &def,
                    Some(to),
                    Some(from),
                    &partitions,
                    &columns,
                    RowOrder::Logged,
                )
            })
        });
        let batches = futures::future::try_join_all(reads)
            .await
            .map_err(SqlError::into_datafusion)?;
        let plan = datafusion::datasource::memory::MemorySourceConfig::try_new_exec(
            &batches,
            changes_schema(def),
            Some(projection),
        )?;
        Ok(plan)
    }
}

/// Partitions `0..count` in at most `groups` contiguous groups, none empty.
fn partition_groups(count: u32, groups: usize) -> Vec<Vec<PartitionId>> {
    let all: Vec<PartitionId> = (0..count).map(PartitionId).collect();
    let size = all.len().div_ceil(groups.max(1)).max(1);
    all.chunks(size).map(<[PartitionId]>::to_vec).collect()
}

/// The live rows of some partitions of a table in a local store at `epoch` (the store's
/// visible epoch if `None`).
pub fn read_local_partitions(
    store: &Store,
    def: &TableDef,
    epoch: Option<Epoch>,
    partitions: &[PartitionId],
    columns: &[usize],
) -> Result<Vec<RecordBatch>> {
    read_local(
        store,
        def,
        epoch,
        None,
        partitions,
        columns,
        RowOrder::Logged,
    )
}

/// What a read of some partitions of a local store returns: with `changes_since`, the
/// table's changes from that epoch to `epoch` (columns of
/// [`tessera_storage::changes::changes_schema`]); without, its live rows at `epoch` (the
/// store's visible epoch if `None`), each partition's in `order`.
pub fn read_local(
    store: &Store,
    def: &TableDef,
    epoch: Option<Epoch>,
    changes_since: Option<Epoch>,
    partitions: &[PartitionId],
    columns: &[usize],
    order: RowOrder,
) -> Result<Vec<RecordBatch>> {
    // A table dropped and created again under the same name is another table.
    if store
        .table_def(&def.name)
        .is_none_or(|d| d.generation != def.generation)
    {
        return Err(tessera_storage::StorageError::UnknownTable(def.name.clone()).into());
    }
    let snapshot_now = || match changes_since {
        Some(from) => {
            store.changes_snapshot(&def.name, from, epoch.unwrap_or(store.visible_epoch()))
        }
        None => store.snapshot(&def.name, epoch),
    };
    // A cold standby's rows may be in its log only: replay them first. A commit may add
    // more between the replay and the snapshot, so check and go round again.
    let snapshot = loop {
        store.replay_standby(partitions)?;
        let snapshot = snapshot_now()?;
        let complete = partitions.iter().all(|p| {
            snapshot
                .partitions
                .get(p.0 as usize)
                .is_none_or(|p| !p.rows_in_log)
        });
        if complete {
            break snapshot;
        }
    };
    let mut batches = Vec::new();
    for partition in partitions {
        let Some(partition) = snapshot.partitions.get(partition.0 as usize) else {
            return Err(tessera_storage::StorageError::UnknownPartition {
                table: def.name.clone(),
                partition: *partition,
                partitions: snapshot.partitions.len(),
            }
            .into());
        };
        for component in &partition.components {
            store.verify_component(&component.hash)?;
        }
        let read = match changes_since {
            Some(from) => tessera_storage::changes::partition_changes(
                store.components_dir(),
                def,
                partition,
                from,
                snapshot.epoch,
            )?
            .map(|changes| changes.project(columns))
            .transpose()?
            .into_iter()
            .collect(),
            None => read_visible_partition(
                store.components_dir(),
                def,
                snapshot.epoch,
                partition,
                columns,
                None,
                usize::MAX,
                order,
            )?,
        };
        batches.extend(read);
    }
    Ok(batches)
}
