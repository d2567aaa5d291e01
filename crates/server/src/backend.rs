//! The SQL engine's view of the cluster: the catalog from the metadata, scans that read each
//! partition on a replica, queries distributed over the nodes (the `tessera-exec` crate), and
//! publishes through the coordinator.

use crate::error::ClusterError;
use crate::meta::{MetaCommand, MetaError, MetaResponse, MetaState, MetaView};
use crate::node::Node;
use crate::system_tables::system_table;
use crate::NodeId;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{SchemaProvider, Session, TableProvider};
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use datafusion::prelude::SessionContext;
use futures::{StreamExt, TryStreamExt};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tessera_common::{Epoch, PartitionId, PartitionRing};
use tessera_exec::scan::{read_from, DistributedScanExec, ReadRows, ScanSpec};
use tessera_exec::{ExecError, Recoveries, RecoveryOutcome};
use tessera_sql::access::AccessStatement;
use tessera_sql::changes::{ChangesSource, ChangesTable};
use tessera_sql::options::RecoveryMode;
use tessera_sql::provider::{RowSource, VersionedTable};
use tessera_sql::retention::RetentionStatement;
use tessera_sql::system::{is_system_table, SYSTEM_TABLES};
use tessera_sql::tags::TagStatement;
use tessera_sql::time_travel::{base_table_name, split_as_of, AsOf};
use tessera_sql::users::UserChange;
use tessera_sql::StatementOutput;
use tessera_sql::{Backend, SqlError};
use tessera_storage::versions::{stored_user_schema, RowOrder};
use tessera_storage::{StorageError, TableChanges, TableDef};

/// The SQL error for a right the acting user lacks (or a user dropped while connected).
fn denied(reason: String) -> SqlError {
    match reason.starts_with(crate::meta::DENIED) {
        true => SqlError::PermissionDenied(reason),
        false => SqlError::PermissionDenied(format!("{}{reason}", crate::meta::DENIED)),
    }
}

/// The SQL error for a metadata command refused with `reason`.
fn refusal(reason: String) -> SqlError {
    if reason.starts_with(crate::meta::DENIED) {
        SqlError::PermissionDenied(reason)
    } else if reason.contains("already exists") {
        SqlError::DuplicateObject(reason)
    } else if reason.ends_with("does not exist") {
        SqlError::UndefinedObject(reason)
    } else {
        SqlError::InvalidValue(reason)
    }
}

fn external(error: ExecError) -> DataFusionError {
    match error {
        ExecError::Storage(e) => SqlError::to_datafusion(e),
        other => DataFusionError::External(Box::new(other)),
    }
}

/// The metadata a statement runs against: pinned when it starts, or else the node's latest.
#[derive(Debug, Clone)]
struct StatementView {
    node: Arc<Node>,
    pinned: Arc<Mutex<Option<Arc<MetaView>>>>,
}

impl StatementView {
    fn get(&self) -> Arc<MetaView> {
        self.pinned
            .lock()
            .expect("pinned lock")
            .clone()
            .unwrap_or_else(|| self.node.meta.view())
    }

    fn pin(&self, view: Arc<MetaView>) {
        *self.pinned.lock().expect("pinned lock") = Some(view);
    }
}

/// The cluster as one database, seen from `node`.
pub struct ClusterBackend {
    node: Arc<Node>,
    view: StatementView,
    /// How this backend's statements survived node failures, until taken.
    recoveries: Recoveries,
    /// The user its statements run for (`None`: the operator).
    actor: Mutex<Option<String>>,
}

impl ClusterBackend {
    pub fn new(node: Arc<Node>) -> ClusterBackend {
        ClusterBackend {
            view: StatementView {
                node: node.clone(),
                pinned: Arc::default(),
            },
            recoveries: Recoveries::default(),
            actor: Mutex::default(),
            node,
        }
    }

    fn actor(&self) -> Option<String> {
        self.actor.lock().expect("actor lock").clone()
    }

    /// Writes `command` to the metadata on behalf of this backend's user, who must be
    /// allowed to (see `tessera_meta::access`); a refusal becomes the SQL error that
    /// names it.
    async fn write_as_actor(
        &self,
        command: MetaCommand,
    ) -> tessera_sql::error::Result<MetaResponse> {
        let command = match self.actor() {
            Some(user) => MetaCommand::As {
                user,
                command: Box::new(command),
            },
            None => command,
        };
        self.node
            .meta
            .write(command)
            .await
            .map_err(|error| match error {
                MetaError::Refused(reason) => refusal(reason),
                other => ClusterError::from(other).into(),
            })
    }

    fn view(&self) -> Arc<MetaView> {
        self.view.get()
    }

    /// How the statements run so far survived node failures (each is also a notice).
    pub fn take_recoveries(&self) -> Vec<RecoveryOutcome> {
        self.recoveries.take()
    }
}

#[async_trait]
impl Backend for ClusterBackend {
    fn table_def(&self, name: &str) -> Option<TableDef> {
        self.view().state.tables.get(name).cloned()
    }

    fn ring(&self) -> PartitionRing {
        PartitionRing::new(self.view().state.partition_count)
    }

    fn schema_provider(&self) -> Arc<dyn SchemaProvider> {
        Arc::new(ClusterSchema {
            node: self.node.clone(),
            view: self.view.clone(),
        })
    }

    /// Pins a linearizable view of the metadata: the statement sees every epoch
    /// acknowledged anywhere before it started, or is refused.
    async fn begin_statement(&self) -> tessera_sql::error::Result<()> {
        let view = self
            .node
            .meta
            .read_linearizable(crate::meta::LINEARIZABLE_READ_PATIENCE)
            .await
            .map_err(ClusterError::from)?;
        let actor = self.actor();
        view.state
            .may(actor.as_deref(), crate::meta::Action::Read)
            .map_err(denied)?;
        self.view.pin(view);
        Ok(())
    }

    async fn create_table(&self, def: TableDef) -> tessera_sql::error::Result<()> {
        self.write_as_actor(MetaCommand::CreateTable { def })
            .await?;
        // CREATE TABLE AS inserts next, within this statement: it must see the new table.
        self.begin_statement().await
    }

    async fn drop_table(&self, name: &str) -> tessera_sql::error::Result<()> {
        self.write_as_actor(MetaCommand::DropTable {
            name: name.to_string(),
        })
        .await
        .map_err(|error| match error {
            SqlError::UndefinedObject(_) => StorageError::UnknownTable(name.to_string()).into(),
            other => other,
        })?;
        self.begin_statement().await
    }

    async fn alter_table(
        &self,
        table: &str,
        alter: tessera_storage::evolution::AlterColumn,
    ) -> tessera_sql::error::Result<()> {
        let command = MetaCommand::AlterTable {
            table: table.to_string(),
            alter,
        };
        match self.write_as_actor(command).await {
            Ok(_) => {}
            Err(SqlError::UndefinedObject(reason))
                if reason == format!("table {table:?} does not exist") =>
            {
                return Err(StorageError::UnknownTable(table.to_string()).into())
            }
            Err(other) => return Err(other),
        }
        // The statements after this one must see the change.
        self.begin_statement().await
    }

    async fn change_user(&self, change: UserChange) -> tessera_sql::error::Result<()> {
        let command = match change {
            UserChange::Create {
                name,
                secret,
                participant,
            } => {
                // A participant's administrator adds users to its own participant.
                let view = self.node.meta.view();
                let participant =
                    participant.or_else(|| view.state.participant_of(self.actor().as_deref()));
                MetaCommand::CreateUser {
                    name,
                    secret,
                    participant,
                }
            }
            UserChange::Alter { name, secret } => MetaCommand::AlterUser { name, secret },
            UserChange::Drop { name } => MetaCommand::DropUser { name },
        };
        self.write_as_actor(command).await.map(|_| ())
    }

    fn act_as(&self, user: Option<String>) {
        *self.actor.lock().expect("actor lock") = user;
    }

    async fn change_access(&self, change: AccessStatement) -> tessera_sql::error::Result<()> {
        let role = |name: &str| {
            crate::meta::Role::parse(name).ok_or_else(|| {
                SqlError::InvalidValue(format!(
                    "unknown role {name:?}: the roles are reader, writer and admin"
                ))
            })
        };
        let command = match change {
            AccessStatement::CreateParticipant { name, .. } => {
                MetaCommand::CreateParticipant { name }
            }
            AccessStatement::DropParticipant { name, .. } => MetaCommand::DropParticipant { name },
            AccessStatement::Grant { role: r, user } => MetaCommand::Grant {
                user,
                role: role(&r)?,
            },
            AccessStatement::Revoke { role: r, user } => MetaCommand::Revoke {
                user,
                role: role(&r)?,
            },
            AccessStatement::SetOwner { table, owner } => {
                if !self.view().state.tables.contains_key(&table) {
                    return Err(StorageError::UnknownTable(table).into());
                }
                MetaCommand::SetTableOwner { table, owner }
            }
            AccessStatement::AddKey { participant, key } => {
                MetaCommand::AddParticipantKey { participant, key }
            }
        };
        self.write_as_actor(command).await?;
        // The statements after this one must see the change.
        self.begin_statement().await
    }

    fn check_publish(&self, table: &str) -> tessera_sql::error::Result<()> {
        let actor = self.actor();
        self.view()
            .state
            .may(actor.as_deref(), crate::meta::Action::Publish(table))
            .map_err(denied)
    }

    fn participant_exists(&self, name: &str) -> bool {
        self.node.meta.view().state.participants.contains_key(name)
    }

    fn user_exists(&self, name: &str) -> bool {
        self.node.meta.view().state.users.contains_key(name)
    }

    async fn change_tag(&self, change: TagStatement) -> tessera_sql::error::Result<Option<Epoch>> {
        let command = match change {
            TagStatement::Create { name, epoch, .. } => MetaCommand::CreateTag {
                name,
                epoch: epoch.map(Epoch),
            },
            TagStatement::Drop { name, .. } => MetaCommand::DropTag { name },
        };
        match self.write_as_actor(command).await? {
            MetaResponse::Epoch(epoch) => Ok(Some(epoch)),
            _ => Ok(None),
        }
    }

    fn tag_exists(&self, name: &str) -> bool {
        self.node.meta.view().state.tags.contains_key(name)
    }

    async fn change_retention(
        &self,
        change: &RetentionStatement,
    ) -> tessera_sql::error::Result<Epoch> {
        let view = self.view();
        if !view.state.tables.contains_key(&change.table) {
            return Err(StorageError::UnknownTable(change.table.clone()).into());
        }
        // Options the statement does not name keep their value.
        let mut retention = view
            .state
            .retention
            .get(&change.table)
            .map(|r| r.setting)
            .unwrap_or_default();
        if let Some(epochs) = change.epochs {
            retention.epochs = epochs;
        }
        if let Some(for_ms) = change.for_ms {
            retention.for_ms = for_ms;
        }
        if let Some(archive) = change.archive {
            retention.archive = archive;
        }
        let command = MetaCommand::SetRetention {
            table: change.table.clone(),
            retention,
        };
        match self.write_as_actor(command).await {
            Ok(MetaResponse::Epoch(horizon)) => Ok(horizon),
            Ok(other) => Err(SqlError::Cluster(format!(
                "setting retention answered {other:?}"
            ))),
            Err(SqlError::UndefinedObject(_)) => {
                Err(StorageError::UnknownTable(change.table.clone()).into())
            }
            Err(other) => Err(other),
        }
    }

    fn resolve_as_of(&self, point: &AsOf) -> tessera_sql::error::Result<Epoch> {
        resolve_as_of(&self.view().state, point)
    }

    fn visible_epoch(&self) -> Epoch {
        self.view().state.visible
    }

    fn changes_table(
        &self,
        def: TableDef,
        from: Epoch,
        to: Epoch,
    ) -> tessera_sql::error::Result<Arc<dyn TableProvider>> {
        let view = self.view();
        let visible = view.state.visible;
        if to > visible {
            return Err(StorageError::EpochNotVisible {
                requested: to,
                visible,
            }
            .into());
        }
        view.state
            .check_retained(&def.name, from)
            .map_err(SqlError::InvalidValue)?;
        let source = ClusterChanges {
            node: self.node.clone(),
            view: self.view.clone(),
        };
        Ok(Arc::new(ChangesTable::new(def, from, to, source)))
    }

    async fn publish(
        &self,
        changes: Vec<TableChanges>,
        read_at: &tessera_common::ReadEpochs,
    ) -> tessera_sql::error::Result<Epoch> {
        // A task of its own, so it runs to its decision even if the statement is dropped (a
        // client's cancel, a closed connection): a publish cut short would keep its tables
        // leased until its epoch timed out. No re-pin afterwards: the next statement
        // catches up with the leader anyway.
        let replication = self.node.replication.clone();
        let publisher = self.actor();
        let read_at = read_at.clone();
        let publish = tokio::spawn(async move {
            crate::publish::publish(&replication, changes, publisher.as_deref(), &read_at).await
        });
        let published = publish
            .await
            .map_err(|e| SqlError::Cluster(format!("the publish task failed: {e}")))?;
        match published {
            Ok(epoch) => Ok(epoch),
            Err(tessera_replication::ReplicationError::Meta(
                crate::meta::MetaError::WriteConflict(reason),
            )) => Err(SqlError::WriteConflict(reason)),
            Err(other) => Err(ClusterError::from(other).into()),
        }
    }

    async fn run_query(
        &self,
        ctx: &SessionContext,
        plan: LogicalPlan,
    ) -> tessera_sql::error::Result<StatementOutput> {
        let statement = Recoveries::default();
        let output = tessera_recovery::restart::run_restarting(
            &self.node.exec,
            ctx,
            plan,
            || self.view(),
            |fresh| self.view.pin(fresh),
            &statement,
        )
        .await
        .map_err(ClusterError::from)?;
        let recoveries = statement.take();
        tessera_common::metrics::metrics()
            .query_recoveries
            .inc_by(recoveries.len() as u64);
        tessera_sql::activity::note_recoveries(recoveries.iter().map(RecoveryOutcome::to_string));
        // The notices of a statement that answered; a failed one's error says it all.
        self.recoveries.extend(recoveries);
        Ok(match output {
            // What lineage recovery rebuilds while the answer streams (counted and listed
            // where it happens) is a notice once the answer has ended.
            StatementOutput::Streaming { schema, stream } => {
                let notices = self.recoveries.clone();
                let stream = tessera_sql::answer::on_end(stream, move |end| {
                    // A failed answer's error says it all; a dropped one has no reader.
                    if matches!(end, tessera_sql::answer::End::Finished) {
                        notices.extend(statement.take());
                    }
                });
                StatementOutput::Streaming { schema, stream }
            }
            whole => whole,
        })
    }

    fn take_notices(&self) -> Vec<String> {
        self.take_recoveries()
            .iter()
            .map(RecoveryOutcome::to_string)
            .collect()
    }

    async fn read_partitions(
        &self,
        def: &TableDef,
        partitions: Vec<PartitionId>,
        columns: Vec<usize>,
    ) -> tessera_sql::error::Result<Vec<RecordBatch>> {
        let view = self.view();
        let scan = ClusterScanExec::new(
            self.node.clone(),
            &view.state,
            def.clone(),
            view.state.visible,
            &partitions,
            columns,
        )
        .map_err(ClusterError::from)?;
        let mut batches = Vec::new();
        for i in 0..scan.groups.len() {
            let stream = scan.execute_group(i);
            batches.extend(
                stream
                    .try_collect::<Vec<_>>()
                    .await
                    .map_err(tessera_sql::error::from_datafusion)?,
            );
        }
        Ok(batches)
    }
}

/// The `public` schema of the cluster.
#[derive(Debug)]
struct ClusterSchema {
    node: Arc<Node>,
    view: StatementView,
}

impl ClusterSchema {
    fn view(&self) -> Arc<MetaView> {
        self.view.get()
    }
}

#[async_trait]
impl SchemaProvider for ClusterSchema {
    fn table_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.view().state.tables.keys().cloned().collect();
        names.extend(SYSTEM_TABLES.iter().map(|name| name.to_string()));
        names
    }

    async fn table(&self, name: &str) -> DfResult<Option<Arc<dyn TableProvider>>> {
        let view = self.view();
        if let Some(system) = system_table(&view.state, name) {
            return system.map(Some).map_err(SqlError::into_datafusion);
        }
        let (table, point) = match split_as_of(name) {
            Some((table, point)) => (table, Some(point)),
            None => (name, None),
        };
        let Some(def) = view.state.tables.get(table).cloned() else {
            return Ok(None);
        };
        let as_of = match point {
            Some(point) => {
                Some(resolve_as_of(&view.state, &point).map_err(SqlError::into_datafusion)?)
            }
            None => None,
        };
        let epoch = as_of.unwrap_or(view.state.visible);
        if epoch > view.state.visible {
            return Err(SqlError::to_datafusion(StorageError::EpochNotVisible {
                requested: epoch,
                visible: view.state.visible,
            }));
        }
        let archive = view
            .state
            .read_source(table, epoch)
            .map_err(|why| SqlError::InvalidValue(why).into_datafusion())?
            .map(|archived| archived.components.clone());
        Ok(Some(Arc::new(VersionedTable::new(
            def,
            as_of,
            ClusterRows {
                node: self.node.clone(),
                view: self.view.clone(),
                epoch,
                time_travel: as_of.is_some(),
                archive,
            },
        ))))
    }

    fn table_exist(&self, name: &str) -> bool {
        is_system_table(name) || self.view().state.tables.contains_key(base_table_name(name))
    }
}

/// The epoch a time-travel point names, from the statement's view of the metadata.
fn resolve_as_of(state: &MetaState, point: &AsOf) -> tessera_sql::error::Result<Epoch> {
    match point {
        AsOf::Epoch(epoch) => Ok(Epoch(*epoch)),
        AsOf::Timestamp(at_ms) => {
            tessera_sql::time_travel::refuse_future(point)?;
            state.epoch_at(*at_ms).map_err(SqlError::InvalidValue)
        }
        AsOf::Tag(name) => state.tag_epoch(name).map_err(SqlError::UndefinedObject),
    }
}

/// A table's rows across the cluster: each channel reads a group of partitions on a
/// live replica.
#[derive(Debug)]
struct ClusterRows {
    node: Arc<Node>,
    /// The statement's metadata: re-pinned when a query restarts after a node failure, so
    /// a restarted scan reads from the survivors (at the same epoch).
    view: StatementView,
    epoch: Epoch,
    /// The statement names the epoch (`AS OF`): older than what some replicas have merged.
    time_travel: bool,
    /// The epoch is below the table's retention horizon and read from the archive.
    archive: Option<Vec<tessera_meta::archive::ArchivedComponent>>,
}

#[async_trait]
impl RowSource for ClusterRows {
    async fn plan_scan(
        &self,
        def: &TableDef,
        state: &dyn Session,
        projection: Vec<usize>,
        predicate: Option<Arc<dyn datafusion::physical_expr::PhysicalExpr>>,
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let (partitions, replicas) = channels_of(&self.node, &self.view, def)?;
        let options = tessera_sql::options::tessera_options_of(state.config_options());
        let key_partitioned = options
            .scans_declare_partitioning()
            .then_some(self.view.get().state.partition_count);
        // Below a merge's epochs, only key order is the same on every replica, and lineage
        // recovery re-runs a dead node's scan on another; a read at the current epoch is
        // the same in the order it was logged (`RowOrder`).
        let order = match (self.time_travel, options.recovery) {
            (true, RecoveryMode::Lineage) => RowOrder::ByKey,
            _ => RowOrder::Logged,
        };
        let (estimated_rows, statistics) = self
            .node
            .remote_statistics
            .of(&self.node, &self.view.get().state, def, self.epoch)
            .await;
        let spec = ScanSpec {
            def: def.clone(),
            epoch: self.epoch,
            projection,
            partitions,
            replicas,
            limit,
            estimated_rows,
            changes_since: None,
            archive: self.archive.clone(),
            key_partitioned,
            order,
        };
        Ok(Arc::new(
            DistributedScanExec::try_new(spec, predicate, self.node.exec.clone())?
                .with_statistics(statistics),
        ))
    }
}

/// A table's diff across the cluster: each channel asks a replica of its partitions for
/// their changes, like a scan asks for rows.
#[derive(Debug)]
struct ClusterChanges {
    node: Arc<Node>,
    view: StatementView,
}

#[async_trait]
impl ChangesSource for ClusterChanges {
    async fn plan_changes(
        &self,
        def: &TableDef,
        from: Epoch,
        to: Epoch,
        projection: Vec<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let (partitions, replicas) = channels_of(&self.node, &self.view, def)?;
        let spec = ScanSpec {
            def: def.clone(),
            epoch: to,
            projection,
            partitions,
            replicas,
            limit: None,
            estimated_rows: None,
            changes_since: Some(from),
            archive: None,
            key_partitioned: None,
            order: RowOrder::Logged,
        };
        Ok(Arc::new(DistributedScanExec::try_new(
            spec,
            None,
            self.node.exec.clone(),
        )?))
    }
}

/// The channels a scan of `def` planned on `node` has, under the statement's metadata.
fn channels_of(
    node: &Node,
    view: &StatementView,
    def: &TableDef,
) -> DfResult<(Vec<Vec<PartitionId>>, Vec<Vec<NodeId>>)> {
    let view = view.get();
    scan_channels(
        &view.state,
        def,
        tessera_exec::cores_per_node(&view.state, node.id()),
    )
    .map_err(external)
}

/// How a scan of `def` splits into channels: the partitions with the same replicas (the
/// same primary, under chained declustering) in as many contiguous groups as a node has
/// cores for channels, each group with those replicas. Fewer, larger channels than one per partition
/// keep the exchanges' streams and batches few and large.
fn scan_channels(
    state: &MetaState,
    def: &TableDef,
    cores: usize,
) -> Result<(Vec<Vec<PartitionId>>, Vec<Vec<NodeId>>), ExecError> {
    let mut by_replicas: Vec<(Vec<NodeId>, Vec<PartitionId>)> = Vec::new();
    for index in 0..state.partition_count {
        let partition = PartitionId(index);
        let replicas = current_replicas(state, def, partition)?;
        match by_replicas.iter_mut().find(|(r, _)| *r == replicas) {
            Some((_, partitions)) => partitions.push(partition),
            None => by_replicas.push((replicas, vec![partition])),
        }
    }
    let mut groups = Vec::new();
    let mut replicas = Vec::new();
    for (holders, partitions) in by_replicas {
        let chunk = partitions.len().div_ceil(cores);
        for group in partitions.chunks(chunk) {
            groups.push(group.to_vec());
            replicas.push(holders.clone());
        }
    }
    Ok((groups, replicas))
}

/// A partition's replicas that hold every committed epoch, its primary first; an error if
/// it has none (it is unavailable until one returns).
fn current_replicas(
    state: &MetaState,
    def: &TableDef,
    partition: PartitionId,
) -> Result<Vec<NodeId>, ExecError> {
    let placement = &state.map.partitions[partition.0 as usize];
    let primary = placement
        .primary
        .ok_or_else(|| ExecError::PartitionUnavailable {
            table: def.name.clone(),
            partition,
            replicas: placement.replicas.clone(),
        })?;
    let mut replicas = vec![primary];
    replicas.extend(placement.replicas.iter().copied().filter(|id| {
        *id != primary
            && !placement.stale.contains_key(id)
            && state.nodes.get(id).is_some_and(|n| n.alive)
    }));
    Ok(replicas)
}

/// Partitions read from one node.
#[derive(Debug, Clone)]
struct ReadGroup {
    node: NodeId,
    partitions: Vec<PartitionId>,
    /// For each partition, the other replicas able to serve it, in ring order.
    fallbacks: Vec<Vec<NodeId>>,
}

/// Reads a table's live rows at an epoch: one output partition per node holding primaries.
#[derive(Debug)]
pub struct ClusterScanExec {
    node: Arc<Node>,
    def: TableDef,
    epoch: Epoch,
    columns: Vec<usize>,
    schema: SchemaRef,
    groups: Vec<ReadGroup>,
    properties: Arc<PlanProperties>,
}

impl ClusterScanExec {
    fn new(
        node: Arc<Node>,
        state: &MetaState,
        def: TableDef,
        epoch: Epoch,
        partitions: &[PartitionId],
        columns: Vec<usize>,
    ) -> Result<Self, ClusterError> {
        let schema = Arc::new(stored_user_schema(&def).project(&columns)?);
        let mut by_node: BTreeMap<NodeId, ReadGroup> = BTreeMap::new();
        for &partition in partitions {
            let mut fallbacks = current_replicas(state, &def, partition)?;
            let reader = fallbacks.remove(0);
            let group = by_node.entry(reader).or_insert_with(|| ReadGroup {
                node: reader,
                partitions: Vec::new(),
                fallbacks: Vec::new(),
            });
            group.partitions.push(partition);
            group.fallbacks.push(fallbacks);
        }
        let groups: Vec<ReadGroup> = by_node.into_values().collect();
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(groups.len().max(1)),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(ClusterScanExec {
            node,
            def,
            epoch,
            columns,
            schema,
            groups,
            properties,
        })
    }

    /// Streams one group's rows; if its node cannot be reached before it sends anything,
    /// each partition is read from its next replica instead.
    fn execute_group(&self, index: usize) -> SendableRecordBatchStream {
        let group = self.groups[index].clone();
        let node = self.node.clone();
        let def = self.def.clone();
        let epoch = self.epoch;
        let columns = self.columns.clone();
        let read = async move {
            match read_from(
                &node.exec,
                group.node,
                &def,
                ReadRows::at(epoch),
                &group.partitions,
                &columns,
            )
            .await
            {
                Ok(batches) => Ok(batches),
                Err(error) if group.node != node.id() && is_unreachable(&error) => {
                    tracing::warn!(from = group.node.0, %error, "replica unreachable; reading its partitions from the next replica");
                    node.suspect(group.node);
                    let mut batches = Vec::new();
                    for (partition, fallbacks) in group.partitions.iter().zip(&group.fallbacks) {
                        let mut last = error.to_string();
                        let mut done = false;
                        for replica in fallbacks {
                            match read_from(
                                &node.exec,
                                *replica,
                                &def,
                                ReadRows::at(epoch),
                                &[*partition],
                                &columns,
                            )
                            .await
                            {
                                Ok(more) => {
                                    batches.extend(more);
                                    done = true;
                                    break;
                                }
                                Err(e) => last = e.to_string(),
                            }
                        }
                        if !done {
                            return Err(ExecError::NoReadableReplica {
                                partition: *partition,
                                last,
                            });
                        }
                    }
                    Ok(batches)
                }
                Err(error) => Err(error),
            }
        };
        let stream = futures::stream::once(read)
            .map(|result| match result {
                Ok(batches) => futures::stream::iter(batches.into_iter().map(Ok)).boxed(),
                Err(error) => futures::stream::once(async move { Err(external(error)) }).boxed(),
            })
            .flatten();
        Box::pin(RecordBatchStreamAdapter::new(self.schema.clone(), stream))
    }
}

fn is_unreachable(error: &ExecError) -> bool {
    matches!(error, ExecError::Unreachable { .. })
}

impl DisplayAs for ClusterScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|g| format!("node {}: {} partitions", g.node, g.partitions.len()))
            .collect();
        write!(
            f,
            "ClusterScanExec: table={}, epoch={}, [{}]",
            self.def.name,
            self.epoch,
            groups.join(", ")
        )
    }
}

impl ExecutionPlan for ClusterScanExec {
    tessera_sql::leaf_plan_methods!("ClusterScanExec", no_expressions);

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        if partition >= self.groups.len() {
            return Err(DataFusionError::Internal(format!(
                "ClusterScanExec has no partition {partition}"
            )));
        }
        Ok(self.execute_group(partition))
    }
}

/// Engines over the cluster for the SQL endpoints, one per connection.
pub struct NodeSessions {
    node: Arc<Node>,
}

impl NodeSessions {
    pub fn new(node: Arc<Node>) -> NodeSessions {
        NodeSessions { node }
    }
}

impl tessera_pg::Sessions for NodeSessions {
    fn open(&self) -> tessera_sql::Engine {
        tessera_sql::Engine::with_backend(
            Arc::new(ClusterBackend::new(self.node.clone())),
            datafusion::prelude::SessionConfig::new(),
        )
    }

    // This node's copy of the metadata: a user created a moment ago on another node may
    // need the entry to arrive here before it can log in.
    fn login_required(&self) -> bool {
        !self.node.meta.view().state.users.is_empty()
    }

    fn user_secret(&self, name: &str) -> Option<tessera_common::auth::ScramSecret> {
        let view = self.node.meta.view();
        view.state.users.get(name).map(|user| user.secret.clone())
    }
}
