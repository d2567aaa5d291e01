//! Log shipping, the participant side (DESIGN §6). The head of a partition's log shipping
//! (its primary; the coordinator calls this directly where that is itself) checks the rows
//! of a prepare stream, stamps them and encodes each partition's once
//! (`tessera_storage::prepared`); it ships those messages on to the replicas named in the
//! request and logs the same bytes durably (`Prepared` WAL records, fsynced) meanwhile. It
//! answers only once the replicas have logged them too, naming the ones it could not reach.
//! A replica logs the messages as they arrive, without decoding them, unless it serves the
//! partition (a hot standby); a cold standby decodes them only when a promotion replays its
//! log. Both log in chunks, each by a task of its own while the next arrives, in the order
//! received.

use crate::error::{PrepareFailed, ReplicationError, Result};
use crate::wire::{
    logged_rows_message, logged_schema_message, LoggedMessage, PrepareReply, PrepareRequest,
    PrepareRows, PreparedRows, PARTITION_COLUMN,
};
use crate::{NodeId, Replication};
use arrow::array::{Array, RecordBatch, UInt32Array};
use arrow_flight::FlightData;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, SinkExt, Stream, StreamExt, TryStreamExt};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_common::PartitionId;
use tessera_storage::prepared::EncodedRows;
use tessera_storage::{PartitionChanges, PreparedEntry, StorageError, Store};

/// A chunk is handed to the logger as soon as the logger is idle and the chunk holds
/// [`MIN_CHUNK_BYTES`], so logging keeps pace with a stream and what is left to log once it
/// ends (when the sender waits for the answer, under its progress deadline) is only what
/// arrived during the last chunk's logging. While the logger is busy a chunk grows up to
/// [`MAX_CHUNK_BYTES`] and the stream then waits for it: that bounds a stream's memory, and
/// the fsyncs adapt to the disk (fixed 8 MiB chunks cost `bench replication` at SF 0.1
/// about 10% at r = 1). Fixed 32 MiB chunks left a whole publish's share to log after its
/// stream ended, past the progress deadline on a loaded machine.
const MIN_CHUNK_BYTES: usize = 4 << 20;
const MAX_CHUNK_BYTES: usize = 32 << 20;
/// How long a replica waits to learn of a table a prepare names (just created elsewhere).
const TABLE_PATIENCE: Duration = Duration::from_secs(10);
/// Messages queued for one replica's stream before the head waits for it.
const OUTLET_MESSAGES: usize = 16;

/// A replica the head ships logged rows on to: the partitions it takes, the sender feeding
/// its stream, and the schema last declared on it.
struct Outlet {
    partitions: Vec<PartitionId>,
    sender: futures::channel::mpsc::Sender<FlightData>,
    schema: Option<Bytes>,
}
/// A replica and the task shipping rows to it.
type Shipping = (
    NodeId,
    tokio::task::JoinHandle<std::result::Result<PrepareReply, PrepareFailed>>,
);

/// Logs the rows of one prepare stream durably as the head of their log shipping, shipping
/// them on to `request.forward` as it logs them.
pub async fn receive(
    node: &Arc<Replication>,
    request: PrepareRequest,
    stream: impl Stream<Item = std::result::Result<RecordBatch, impl std::fmt::Display>> + Unpin,
) -> Result<PrepareReply> {
    let span = tracing::info_span!("prepare", epoch = %request.epoch, table = %request.table);
    tracing::Instrument::instrument(receive_logged(node, request, stream), span).await
}

/// Logs the rows a head shipped on as it logged them ([`PrepareRequest::as_logged`]).
pub async fn receive_as_logged(
    node: &Arc<Replication>,
    request: PrepareRequest,
    messages: impl Stream<Item = std::result::Result<FlightData, impl std::fmt::Display>> + Unpin,
) -> Result<PrepareReply> {
    let span = tracing::info_span!("prepare", epoch = %request.epoch, table = %request.table, as_logged = true);
    tracing::Instrument::instrument(receive_shipped(node, request, messages), span).await
}

async fn receive_logged(
    node: &Arc<Replication>,
    request: PrepareRequest,
    mut stream: impl Stream<Item = std::result::Result<RecordBatch, impl std::fmt::Display>> + Unpin,
) -> Result<PrepareReply> {
    wait_for_table(node, &request.table).await;
    let (outlets, shipping) = start_shipping(node, &request);
    let outlets = Arc::new(tokio::sync::Mutex::new(outlets));
    let started = Instant::now();
    let mut logger = ChunkLogger::new({
        let (node, request, outlets) = (node.clone(), Arc::new(request.clone()), outlets.clone());
        move |chunk| log_and_ship(node.clone(), request.clone(), chunk, outlets.clone()).boxed()
    });
    let received = async {
        while let Some(batch) = stream
            .try_next()
            .await
            .map_err(|e| ReplicationError::BadPrepare(e.to_string()))?
        {
            let (partition, rows) = split_partition_column(&batch)?;
            let bytes = tessera_storage::versions::rows_bytes(&rows);
            let mut change = PartitionChanges {
                table: request.table.clone(),
                partition,
                upserts: vec![],
                deletes: vec![],
                before_images: vec![],
            };
            match request.rows() {
                PreparedRows::Upserts => change.upserts.push(rows),
                PreparedRows::Deletes => change.deletes.push(rows),
                PreparedRows::BeforeImages => change.before_images.push(rows),
            }
            logger.push(change, bytes).await?;
        }
        logger.hand_over_rest().await
    }
    .await;

    // A chunk still being logged is waited for whatever ended the stream; a failed logger's
    // error is the one reported (the stream was cut short because of it).
    let logged = logger.wait().await;
    // Ends the replicas' streams; one that carried nothing still names its request.
    for mut outlet in std::mem::take(&mut *outlets.lock().await) {
        if outlet.schema.is_none() {
            let _ = outlet.sender.send(FlightData::default()).await;
        }
    }
    logged.and(received)?;
    let logged_here = started.elapsed();
    let mut unreachable = Vec::new();
    for (replica, task) in shipping {
        match task.await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) if error.is_transport() => {
                tracing::warn!(node = replica.0, epoch = %request.epoch, %error, "replica unreachable during log shipping");
                node.suspect(replica);
                unreachable.push(replica);
            }
            Ok(Err(error)) => {
                return Err(ReplicationError::Refused {
                    node: replica,
                    what: "an epoch's rows",
                    reason: error.to_string(),
                })
            }
            Err(join_error) => return Err(ReplicationError::task("log shipping")(join_error)),
        }
    }
    // How much of a prepare the replicas add: the wait past this node's own logging.
    tracing::debug!(
        logged_here_ms = logged_here.as_millis() as u64,
        replicas_logged_ms = started.elapsed().as_millis() as u64,
        replicas = request.forward.len(),
        "prepare logged"
    );
    Ok(PrepareReply { unreachable })
}

async fn receive_shipped(
    node: &Arc<Replication>,
    request: PrepareRequest,
    mut messages: impl Stream<Item = std::result::Result<FlightData, impl std::fmt::Display>> + Unpin,
) -> Result<PrepareReply> {
    if !request.forward.is_empty() {
        return Err(ReplicationError::BadPrepare(
            "rows shipped as logged are not shipped on again".into(),
        ));
    }
    wait_for_table(node, &request.table).await;
    let mut logger = ChunkLogger::new({
        let (node, request) = (node.clone(), Arc::new(request.clone()));
        move |chunk| log_received(node.clone(), request.clone(), chunk).boxed()
    });
    let mut schema: Option<Bytes> = None;
    let bad = |reason: String| ReplicationError::BadPrepare(reason);
    let received = async {
        while let Some(message) = messages.try_next().await.map_err(|e| bad(e.to_string()))? {
            match LoggedMessage::of(message).map_err(bad)? {
                LoggedMessage::Empty => {}
                LoggedMessage::Schema(declared) => schema = Some(declared),
                LoggedMessage::Rows(partition, header, body) => {
                    let schema = schema
                        .clone()
                        .ok_or_else(|| bad("logged rows arrived before their schema".into()))?;
                    let rows = EncodedRows::received(schema, header, body)?;
                    let bytes = rows.bytes();
                    logger.push((partition, rows), bytes).await?;
                }
            }
        }
        logger.hand_over_rest().await
    }
    .await;
    let logged = logger.wait().await;
    logged.and(received)?;
    Ok(PrepareReply::default())
}

/// Waits (up to [`TABLE_PATIENCE`]) for `table` to exist here. It may have been created
/// moments ago and this node not have applied that yet: it lags the majority that committed
/// it, or (a node that just started) has not been added to the metadata group yet.
async fn wait_for_table(node: &Replication, table: &str) {
    let deadline = Instant::now() + TABLE_PATIENCE;
    while node.store.table_def(table).is_none() && Instant::now() < deadline {
        // Catching up with the leader applies the table's creation if it is committed; the
        // loop checks the store again either way, until its own deadline.
        let left = deadline.saturating_duration_since(Instant::now());
        if let Err(error) = node.meta.read_linearizable(left).await {
            tracing::debug!(table, %error, "could not catch up while waiting for a table");
        }
        tracing::debug!(
            table,
            applied = node.meta.view().applied_index,
            "a prepare for a table this store does not hold yet"
        );
        if node.store.table_def(table).is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Opens one prepare stream to each replica in `request.forward`, for the rows as this
/// node logs them. Returns, per replica, the partitions it takes and the sender feeding
/// its stream, and the task that ends once it has logged them.
fn start_shipping(
    node: &Arc<Replication>,
    request: &PrepareRequest,
) -> (Vec<Outlet>, Vec<Shipping>) {
    let mut outlets = Vec::new();
    let mut shipping = Vec::new();
    for forward in &request.forward {
        let (sender, receiver) = futures::channel::mpsc::channel::<FlightData>(OUTLET_MESSAGES);
        outlets.push(Outlet {
            partitions: forward.partitions.clone(),
            sender,
            schema: None,
        });
        let onward = PrepareRequest {
            forward: Vec::new(),
            as_logged: true,
            ..request.clone()
        };
        let node = node.clone();
        let replica = forward.node;
        // A replica that fails or stalls mid-stream missed the epoch: it is reported
        // unreachable, marked stale, and catches up (unless the publish cannot go on
        // without it: then it is waited for longer).
        let patience = crate::Patience::for_peer(
            forward.last_copy,
            node.settings.progress_timeout,
            &node.settings,
        );
        let task = tokio::spawn(async move {
            node.prepare_within_deadlines(
                "a forwarded prepare",
                replica,
                &onward,
                PrepareRows::AsLogged(receiver.boxed()),
                patience,
            )
            .await
        });
        shipping.push((replica, task));
    }
    (outlets, shipping)
}

/// Sends each replica the entries of the partitions it takes, to all of them at once.
async fn ship(outlets: &mut [Outlet], entries: &[PreparedEntry]) {
    let sends = outlets.iter_mut().map(|outlet| async move {
        for entry in entries
            .iter()
            .filter(|e| outlet.partitions.contains(&e.partition))
        {
            // A closed outlet means that replica's stream failed; its task reports it.
            if outlet.schema.as_ref() != Some(&entry.rows.schema) {
                let _ = outlet.sender.send(logged_schema_message(&entry.rows)).await;
                outlet.schema = Some(entry.rows.schema.clone());
            }
            let _ = outlet
                .sender
                .send(logged_rows_message(entry.partition, &entry.rows))
                .await;
        }
    });
    futures::future::join_all(sends).await;
}

/// Logs a prepare stream's chunks durably, one at a time and in the order handed over,
/// each in a task of its own so that the stream goes on arriving meanwhile. It gathers the
/// stream's items (of type `T`) into the chunk it hands over next.
struct ChunkLogger<T> {
    log: Box<dyn Fn(Arc<Vec<T>>) -> BoxFuture<'static, Result<()>> + Send + Sync>,
    logging: Option<tokio::task::JoinHandle<Result<()>>>,
    chunk: Vec<T>,
    chunk_bytes: usize,
}

impl<T> ChunkLogger<T> {
    fn new(
        log: impl Fn(Arc<Vec<T>>) -> BoxFuture<'static, Result<()>> + Send + Sync + 'static,
    ) -> Self {
        ChunkLogger {
            log: Box::new(log),
            logging: None,
            chunk: Vec::new(),
            chunk_bytes: 0,
        }
    }

    /// Adds an item of `bytes` to the chunk, and hands the chunk over if it is full, or
    /// large enough and the last chunk handed over is logged (or failed to be). An error
    /// is the earlier chunk's: the stream stops there.
    async fn push(&mut self, item: T, bytes: usize) -> Result<()> {
        self.chunk.push(item);
        self.chunk_bytes += bytes;
        let idle = self.logging.as_ref().is_none_or(|task| task.is_finished());
        if self.chunk_bytes >= MAX_CHUNK_BYTES || (self.chunk_bytes >= MIN_CHUNK_BYTES && idle) {
            self.hand_over_rest().await?;
        }
        Ok(())
    }

    /// Waits for the chunk being logged, if any, then starts logging what has gathered
    /// since (the stream's end, or a full chunk).
    async fn hand_over_rest(&mut self) -> Result<()> {
        self.wait().await?;
        if !self.chunk.is_empty() {
            let chunk = Arc::new(std::mem::take(&mut self.chunk));
            self.chunk_bytes = 0;
            self.logging = Some(tokio::spawn((self.log)(chunk)));
        }
        Ok(())
    }

    /// Waits for the last chunk handed over to be logged.
    async fn wait(&mut self) -> Result<()> {
        match self.logging.take() {
            Some(task) => task
                .await
                .map_err(ReplicationError::task("logging prepared rows"))?,
            None => Ok(()),
        }
    }
}

/// The head's chunk: checked, stamped and encoded once, shipped on to the replicas in that
/// form while this node logs it.
async fn log_and_ship(
    node: Arc<Replication>,
    request: Arc<PrepareRequest>,
    chunk: Arc<Vec<PartitionChanges>>,
    outlets: Arc<tokio::sync::Mutex<Vec<Outlet>>>,
) -> Result<()> {
    let epoch = request.epoch;
    let started = Instant::now();
    let entries = on_store_catching_up(&node, "encoding prepared rows", move |store| {
        store.encode_prepared(epoch, &chunk)
    })
    .await?;
    let encoded = started.elapsed();
    ship(&mut outlets.lock().await, &entries).await;
    let shipped = started.elapsed();
    let bytes: usize = entries.iter().map(|e| e.rows.bytes()).sum();
    node.on_store("logging prepared rows", move |store| {
        store.log_prepared(epoch, entries)
    })
    .await?;
    // Logged from the chunk's own task, outside the stream's span: it names its epoch.
    tracing::debug!(
        %epoch,
        table = %request.table,
        bytes,
        encoded_ms = encoded.as_millis() as u64,
        shipped_ms = shipped.as_millis() as u64,
        logged_ms = started.elapsed().as_millis() as u64,
        "chunk encoded, shipped on and logged"
    );
    discard_if_late(&node, &request).await
}

/// A replica's chunk, as its head logged it.
async fn log_received(
    node: Arc<Replication>,
    request: Arc<PrepareRequest>,
    chunk: Arc<Vec<(PartitionId, EncodedRows)>>,
) -> Result<()> {
    let epoch = request.epoch;
    let table = request.table.clone();
    on_store_catching_up(&node, "logging prepared rows", move |store| {
        store.prepare_received(epoch, &table, &chunk)
    })
    .await?;
    discard_if_late(&node, &request).await
}

/// Runs `work` on the store; if the rows are in columns this node does not know yet (their
/// ALTER TABLE is committed but not applied here), catches up with the leader and runs it
/// once more.
async fn on_store_catching_up<T: Send + 'static>(
    node: &Replication,
    what: &'static str,
    work: impl Fn(&Store) -> std::result::Result<T, StorageError> + Send + Sync + Clone + 'static,
) -> Result<T> {
    let retry = work.clone();
    match node.on_store(what, move |store| work(store)).await {
        Err(ReplicationError::Storage(StorageError::SchemaMismatch { table, reason })) => {
            tracing::debug!(
                table,
                reason,
                "prepared rows do not fit the table here; catching up"
            );
            node.meta.read_linearizable(TABLE_PATIENCE).await?;
            node.on_store(what, move |store| retry(store)).await
        }
        other => other,
    }
}

/// A prepare that reaches this node after its epoch was decided (a stream held up in a slow
/// or cut link past the coordinator's deadline) must not stay: nothing would decide it
/// again, and a commit of it would add rows that the failback copy of a replica marked as
/// having missed the epoch brings as well. The store decides that under the lock its
/// decisions take: the metadata view is published only after a whole batch of entries is
/// applied, so checking it instead left a window in which a decision was applied but not
/// yet visible, and the prepare stayed pending for ever (an orphan that later held up a
/// fenced copy).
async fn discard_if_late(node: &Replication, request: &PrepareRequest) -> Result<()> {
    let epoch = request.epoch;
    let late = node
        .on_store("discarding a late prepare", move |store| {
            store.discard_late_prepare(epoch)
        })
        .await?;
    if late {
        return Err(ReplicationError::BadPrepare(format!(
            "epoch {epoch} was already decided when its rows arrived here; they are discarded"
        )));
    }
    Ok(())
}

/// A prepare batch's rows without the partition column, and that (single) partition.
fn split_partition_column(batch: &RecordBatch) -> Result<(PartitionId, RecordBatch)> {
    let bad = |reason: String| ReplicationError::BadPrepare(reason);
    let partitions = batch
        .column(0)
        .as_any()
        .downcast_ref::<UInt32Array>()
        .filter(|_| batch.schema().field(0).name() == PARTITION_COLUMN)
        .ok_or_else(|| {
            bad(format!(
                "prepare batches start with a UInt32 column {PARTITION_COLUMN:?}"
            ))
        })?;
    if partitions.null_count() > 0 || partitions.is_empty() {
        return Err(bad(
            "a prepare batch needs rows, each naming its partition".into()
        ));
    }
    let first = partitions.value(0);
    if partitions.values().iter().any(|p| *p != first) {
        return Err(bad("a prepare batch holds rows of one partition".into()));
    }
    let columns: Vec<usize> = (1..batch.num_columns()).collect();
    Ok((PartitionId(first), batch.project(&columns)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    fn batch(partitions: Vec<Option<u32>>, name: &str) -> RecordBatch {
        let rows = partitions.len() as i64;
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new(name, DataType::UInt32, true),
                Field::new("k", DataType::Int64, false),
            ])),
            vec![
                Arc::new(UInt32Array::from(partitions)),
                Arc::new(Int64Array::from_iter_values(0..rows)),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_prepare_batch_is_split_from_its_partition_column() {
        let (partition, rows) =
            split_partition_column(&batch(vec![Some(3), Some(3)], PARTITION_COLUMN)).unwrap();
        assert_eq!(partition, PartitionId(3));
        assert_eq!(rows.num_columns(), 1);
        assert_eq!(rows.schema().field(0).name(), "k");
    }

    #[test]
    fn malformed_prepare_batches_are_refused_by_name() {
        let message = |b: RecordBatch| split_partition_column(&b).unwrap_err().to_string();
        assert!(message(batch(vec![Some(1)], "p")).contains("start with a UInt32 column"));
        assert!(message(batch(vec![Some(1), Some(2)], PARTITION_COLUMN))
            .contains("rows of one partition"));
        assert!(message(batch(vec![None], PARTITION_COLUMN)).contains("each naming its partition"));
        assert!(message(batch(vec![], PARTITION_COLUMN)).contains("each naming its partition"));
    }
}
