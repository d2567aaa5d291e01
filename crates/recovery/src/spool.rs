//! Upstream backup (seed 003 §III): under `tessera.recovery = lineage` a producer channel
//! keeps every batch it sends to another node in a spool file on its own disk, indexed by
//! (bucket, sequence number), until the query ends. When a consumer's node dies, the
//! consumer's channel is rebuilt elsewhere and *pulls* its input from these spools
//! ([`crate::SpoolRequest`]), following a spool that is still being written.
//!
//! A spool holds the encoded Flight messages exactly as they were sent (LZ4-compressed
//! Arrow IPC, each batch self-contained), so a replayed batch is byte-for-byte the batch
//! the dead consumer saw. A batch sent only to this node itself is not spooled: its
//! consumer dies only with its producer, which is then re-run anyway.

use arrow_flight::FlightData;
use bytes::Bytes;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tessera_exec::exchange::BatchTag;
use tessera_exec::hooks::{Backup, BackupKey};
use tokio::sync::Notify;

/// One producer channel's spooled batches: `(query, exchange, channel)`.
pub type SpoolKey = BackupKey;

pub struct Spool {
    path: PathBuf,
    state: Mutex<SpoolState>,
    grew: Notify,
}

#[derive(Default)]
struct SpoolState {
    /// Shared so followers read without holding the lock appends take.
    file: Option<Arc<std::fs::File>>,
    written: u64,
    /// The schema message, once the producer has started.
    schema: Option<FlightData>,
    /// (bucket, seq) -> (offset, length) of the batch's messages in the file.
    index: HashMap<(usize, u64), (u64, u64)>,
    /// The producer has sent everything (or failed: the reason).
    finished: bool,
    failed: Option<String>,
    /// The query ended: the file is gone.
    dropped: bool,
}

/// What a follower gets for one (bucket, seq).
pub enum Next {
    Batch(Vec<FlightData>),
    /// The producer finished without sending that batch: the bucket is complete.
    End,
}

impl Spool {
    pub fn new(dir: &Path, key: SpoolKey) -> Spool {
        let (query, exchange, channel) = key;
        Spool {
            path: dir.join(format!("{query:016x}-{exchange}-{channel}.spool")),
            state: Mutex::default(),
            grew: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SpoolState> {
        self.state.lock().expect("spool lock")
    }

    /// The producer starts writing: the schema every batch follows.
    pub fn start(&self, schema: FlightData) -> std::io::Result<()> {
        let mut state = self.lock();
        if state.file.is_none() && !state.dropped {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&self.path)?;
            state.file = Some(Arc::new(file));
        }
        state.schema = Some(schema);
        drop(state);
        self.grew.notify_waiters();
        Ok(())
    }

    /// Appends one batch's messages (dictionaries, then the batch, tagged).
    pub fn append(&self, tag: BatchTag, messages: &[FlightData]) -> std::io::Result<()> {
        let mut record = Vec::new();
        for message in messages {
            for part in [
                &message.data_header,
                &message.data_body,
                &message.app_metadata,
            ] {
                record.extend_from_slice(&(part.len() as u64).to_le_bytes());
                record.extend_from_slice(part);
            }
        }
        let mut state = self.lock();
        if state.dropped {
            return Ok(());
        }
        let offset = state.written;
        let file = state.file.as_deref().ok_or_else(|| {
            std::io::Error::other("a spool was written before its producer started")
        })?;
        // Page cache only: the spool must outlive a consumer's node, not this one's.
        let mut file: &std::fs::File = file;
        file.write_all(&record)?;
        state.written += record.len() as u64;
        state
            .index
            .insert((tag.bucket, tag.seq), (offset, record.len() as u64));
        drop(state);
        self.grew.notify_waiters();
        Ok(())
    }

    /// The producer is done: followers get [`Next::End`] past its last batch.
    pub fn finish(&self, failed: Option<String>) {
        let mut state = self.lock();
        state.finished = true;
        state.failed = failed;
        drop(state);
        self.grew.notify_waiters();
    }

    /// The schema message, waiting for the producer to start.
    pub async fn schema(&self) -> Result<FlightData, String> {
        loop {
            let grew = self.grew.notified();
            {
                let state = self.lock();
                if state.dropped {
                    return Err("the query ended".into());
                }
                if let Some(schema) = &state.schema {
                    return Ok(schema.clone());
                }
            }
            grew.await;
        }
    }

    /// Batch `seq` of `bucket`, waiting while the producer may still write it.
    pub async fn next(&self, bucket: usize, seq: u64) -> Result<Next, String> {
        loop {
            let grew = self.grew.notified();
            let found = {
                let state = self.lock();
                if state.dropped {
                    return Err("the query ended".into());
                }
                match state.index.get(&(bucket, seq)) {
                    Some(&(offset, length)) => Some((
                        state.file.clone().expect("an indexed spool has a file"),
                        offset,
                        length,
                    )),
                    None if state.finished => {
                        return match &state.failed {
                            Some(reason) => Err(format!("the producer failed: {reason}")),
                            None => Ok(Next::End),
                        };
                    }
                    None => None,
                }
            };
            if let Some((file, offset, length)) = found {
                let mut record = vec![0u8; length as usize];
                file.read_exact_at(&mut record, offset)
                    .map_err(|e| format!("reading spool {}: {e}", self.path.display()))?;
                return decode_record(Bytes::from(record)).map(Next::Batch);
            }
            grew.await;
        }
    }

    /// The query ended: deletes the file and wakes every follower.
    pub fn drop_file(&self) {
        let mut state = self.lock();
        state.dropped = true;
        state.index.clear();
        if state.file.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
        drop(state);
        self.grew.notify_waiters();
    }
}

impl Backup for Spool {
    fn append(&self, tag: BatchTag, messages: &[FlightData]) -> std::io::Result<()> {
        Spool::append(self, tag, messages)
    }

    fn finish(&self, failed: Option<String>) {
        Spool::finish(self, failed)
    }
}

fn decode_record(record: Bytes) -> Result<Vec<FlightData>, String> {
    let mut messages = Vec::new();
    let mut at = 0usize;
    let mut take = || -> Result<Bytes, String> {
        let length = record
            .get(at..at + 8)
            .ok_or("a truncated spool record")?
            .try_into()
            .map(u64::from_le_bytes)
            .map_err(|_| "a truncated spool record")? as usize;
        at += 8;
        let part = record
            .get(at..at + length)
            .ok_or("a truncated spool record")?;
        let part = record.slice_ref(part);
        at += length;
        Ok(part)
    };
    loop {
        let header = match take() {
            Ok(header) => header,
            Err(_) if messages.is_empty() => return Err("an empty spool record".into()),
            Err(_) => return Ok(messages),
        };
        let body = take()?;
        let metadata = take()?;
        messages.push(FlightData {
            data_header: header,
            data_body: body,
            app_metadata: metadata,
            ..Default::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_exec::{ChannelId, QueryId, StageId};

    fn message(body: &'static [u8], metadata: &'static [u8]) -> FlightData {
        FlightData {
            data_header: Bytes::from_static(b"header"),
            data_body: Bytes::from_static(body),
            app_metadata: Bytes::from_static(metadata),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_follower_reads_batches_as_they_are_written_then_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let spool = std::sync::Arc::new(Spool::new(
            dir.path(),
            (QueryId(1), StageId(2), ChannelId(3)),
        ));
        let follower = {
            let spool = spool.clone();
            tokio::spawn(async move {
                let mut bodies = Vec::new();
                let mut seq = 0;
                while let Next::Batch(messages) = spool.next(0, seq).await.unwrap() {
                    bodies.push(messages.last().unwrap().data_body.clone());
                    seq += 1;
                }
                bodies
            })
        };
        spool.start(message(b"", b"")).unwrap();
        let tag = |seq| BatchTag { bucket: 0, seq };
        spool
            .append(tag(0), &[message(b"dict", b""), message(b"first", b"t0")])
            .unwrap();
        spool
            .append(BatchTag { bucket: 1, seq: 0 }, &[message(b"other", b"")])
            .unwrap();
        spool.append(tag(1), &[message(b"second", b"t1")]).unwrap();
        spool.finish(None);
        let bodies = follower.await.unwrap();
        assert_eq!(bodies, vec![Bytes::from("first"), Bytes::from("second")]);
        let Next::Batch(first) = spool.next(0, 0).await.unwrap() else {
            panic!("batch 0 is spooled")
        };
        assert_eq!(first.len(), 2, "dictionaries travel with their batch");
        assert_eq!(first[1].app_metadata, Bytes::from("t0"));
        spool.drop_file();
        assert!(
            spool.next(0, 0).await.is_err(),
            "a dropped spool serves nothing"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
