//! Prepared rows as the log holds them: the stamped row versions of one partition of a
//! table, as two Arrow IPC messages (the schema's and the batch's, each a flatbuffer header
//! and, for the batch, a body).
//!
//! A partition's primary, heading the log shipping of a publish (DESIGN §6), checks and
//! stamps the rows and encodes them once: the same messages go into its own log and, as
//! Flight messages, to the other replicas. Those log them as they arrive, without decoding,
//! checking or encoding them again; a cold standby never decodes them until a promotion
//! replays its log. What a replica checks on arrival is the messages' framing (a batch
//! header whose body is the length it says), so that its log never holds a message a
//! replay could not read past.
//!
//! The messages' buffers are zstd-compressed ([`log_ipc_options`]): the head compresses a
//! partition's rows once, and every replica receives, logs and fsyncs the smaller form.

use crate::error::{Result, StorageError};
use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteOptions};
use arrow_ipc::CompressionType;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Arc;

/// The IPC continuation marker that starts every message of a stream.
const CONTINUATION: [u8; 4] = [0xff; 4];
/// The end-of-stream marker that closes an IPC stream.
pub const STREAM_END: [u8; 8] = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];
/// A message's metadata is padded so that its body starts at a multiple of this.
const METADATA_ALIGNMENT: usize = 8;

/// How rows are written as Arrow IPC into a log record (of this node's log, or shipped
/// to a replica's): each buffer zstd-compressed at level 1.
///
/// A publish's rows are compressed once, by the head of their log shipping, but written
/// once per replica and, between nodes, cross TLS once per replica hop; uncompressed, a
/// TPC-H lineitem row is about 218 bytes of IPC (its strings as views). zstd at level 1
/// writes 42% fewer bytes than LZ4 (TPC-H SF 1 lineitem: 213 against 368 MB) for about
/// 0.15 µs more CPU a row at the head; at r = 3 the bytes it saves are copied into the
/// page cache, fsynced, encrypted and decrypted two or three times, so a replicated
/// publish costs less CPU in all (`tessera bench replication --sf 1`: 32.4 s of the
/// nodes' CPU per publish at r = 3, was 34.9 with LZ4) while an unreplicated one costs a
/// little more (27.9 s, was 26.1). Query exchanges stay LZ4: their batches are read once.
/// Older log records, written uncompressed or with LZ4, still read: a batch message names
/// its compression, and readers follow it.
pub fn log_ipc_options() -> IpcWriteOptions {
    IpcWriteOptions::default()
        .try_with_compression(Some(CompressionType::ZSTD))
        .and_then(|options| options.try_with_compression_level(Some(1)))
        .expect("arrow-ipc is built with its zstd feature")
}

/// One partition's prepared rows as IPC messages.
#[derive(Debug, Clone)]
pub struct EncodedRows {
    /// The flatbuffer of the schema message.
    pub schema: Bytes,
    /// The flatbuffer of the record batch message.
    pub header: Bytes,
    /// The batch message's body.
    pub body: Bytes,
    rows: usize,
}

impl EncodedRows {
    /// Encodes a batch (without dictionaries: stored tables have none).
    pub fn encode(batch: &RecordBatch) -> Result<EncodedRows> {
        let generator = IpcDataGenerator::default();
        let options = log_ipc_options();
        let mut dictionaries = DictionaryTracker::new(false);
        let schema = generator.schema_to_bytes_with_dictionary_tracker(
            &batch.schema(),
            &mut dictionaries,
            &options,
        );
        let (dictionary_messages, encoded) =
            generator.encode(batch, &mut dictionaries, &options, &mut Default::default())?;
        if !dictionary_messages.is_empty() {
            return Err(malformed("stored rows have no dictionary-encoded columns"));
        }
        Ok(EncodedRows {
            schema: Bytes::from(schema.ipc_message),
            header: Bytes::from(encoded.ipc_message),
            body: Bytes::from(encoded.arrow_data),
            rows: batch.num_rows(),
        })
    }

    /// Rows as they arrived from the head of their log shipping: checks that `schema` is
    /// a schema message and `header` a record batch message whose body is `body`.
    pub fn received(schema: Bytes, header: Bytes, body: Bytes) -> Result<EncodedRows> {
        let schema_message = arrow::ipc::root_as_message(&schema)
            .map_err(|e| malformed(format!("the schema message is unreadable: {e}")))?;
        if schema_message.header_as_schema().is_none() {
            return Err(malformed("the first message is not a schema"));
        }
        let message = arrow::ipc::root_as_message(&header)
            .map_err(|e| malformed(format!("a batch message is unreadable: {e}")))?;
        let batch = message
            .header_as_record_batch()
            .ok_or_else(|| malformed("a message after the schema is not a record batch"))?;
        if message.bodyLength() != body.len() as i64 {
            return Err(malformed(format!(
                "a batch message says its body has {} bytes, but {} arrived",
                message.bodyLength(),
                body.len()
            )));
        }
        let rows = usize::try_from(batch.length())
            .map_err(|_| malformed(format!("a batch of {} rows", batch.length())))?;
        Ok(EncodedRows {
            schema,
            header,
            body,
            rows,
        })
    }

    pub fn num_rows(&self) -> usize {
        self.rows
    }

    /// Bytes the rows take (their messages' bodies, compressed).
    pub fn bytes(&self) -> usize {
        self.body.len()
    }

    /// The schema the messages declare.
    pub fn decode_schema(&self) -> Result<SchemaRef> {
        let schema = arrow::ipc::convert::try_schema_from_flatbuffer_bytes(&self.schema)?;
        Ok(Arc::new(schema))
    }

    /// The rows, decoded (and validated) from the messages.
    pub fn decode(&self) -> Result<RecordBatch> {
        let schema = self.decode_schema()?;
        let message = arrow::ipc::root_as_message(&self.header)
            .map_err(|e| malformed(format!("a batch message is unreadable: {e}")))?;
        let batch = message
            .header_as_record_batch()
            .ok_or_else(|| malformed("not a record batch message"))?;
        Ok(arrow::ipc::reader::read_record_batch(
            &Buffer::from(self.body.clone()),
            batch,
            schema,
            &HashMap::new(),
            None,
            &message.version(),
        )?)
    }

    /// Appends the rows as an IPC stream (schema, batch, end of stream), as a log record
    /// holds them.
    pub fn write_stream(&self, out: &mut Vec<u8>) {
        self.write_stream_head(out);
        out.extend_from_slice(&self.body);
        out.extend_from_slice(&STREAM_END);
    }

    /// The stream of [`EncodedRows::write_stream`] up to the batch's body: the stream is
    /// this, then [`EncodedRows::body`], then [`STREAM_END`]. A log record is written in
    /// those pieces, so the body is never copied.
    pub fn write_stream_head(&self, out: &mut Vec<u8>) {
        write_message(out, &self.schema, &[]);
        write_message(out, &self.header, &[]);
    }

    /// The length of [`EncodedRows::write_stream`]'s output.
    pub fn stream_len(&self) -> usize {
        message_len(&self.schema, &[]) + message_len(&self.header, &self.body) + 8
    }
}

fn padded_metadata_len(header: &[u8]) -> usize {
    (8 + header.len()).next_multiple_of(METADATA_ALIGNMENT) - 8
}

fn message_len(header: &[u8], body: &[u8]) -> usize {
    8 + padded_metadata_len(header) + body.len()
}

/// One encapsulated IPC message: the continuation marker, the padded metadata length, the
/// metadata flatbuffer and its padding, then the body.
fn write_message(out: &mut Vec<u8>, header: &[u8], body: &[u8]) {
    let padded = padded_metadata_len(header);
    out.extend_from_slice(&CONTINUATION);
    out.extend_from_slice(&(padded as i32).to_le_bytes());
    out.extend_from_slice(header);
    out.resize(out.len() + padded - header.len(), 0);
    out.extend_from_slice(body);
}

fn malformed(reason: impl Into<String>) -> StorageError {
    StorageError::MalformedRows(reason.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::ipc::reader::StreamReader;

    fn rows() -> RecordBatch {
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("k", DataType::Int64, false),
                Field::new("s", DataType::Utf8View, true),
            ])),
            vec![
                Arc::new(Int64Array::from_iter_values(0..1000)),
                Arc::new(StringViewArray::from_iter((0..1000).map(|i| {
                    (i % 7 != 0).then(|| format!("a string long enough not to be inlined {i}"))
                }))),
            ],
        )
        .unwrap()
    }

    #[test]
    fn encoded_rows_decode_to_the_same_batch_and_read_as_an_ipc_stream() {
        let batch = rows();
        let encoded = EncodedRows::encode(&batch).unwrap();
        assert_eq!(encoded.num_rows(), 1000);
        assert_eq!(encoded.decode().unwrap(), batch);
        let received = EncodedRows::received(
            encoded.schema.clone(),
            encoded.header.clone(),
            encoded.body.clone(),
        )
        .unwrap();
        assert_eq!(received.num_rows(), 1000);
        let mut stream = Vec::new();
        received.write_stream(&mut stream);
        assert_eq!(stream.len(), received.stream_len());
        let mut reader = StreamReader::try_new(std::io::Cursor::new(stream), None).unwrap();
        assert_eq!(reader.next().unwrap().unwrap(), batch);
        assert!(reader.next().is_none(), "the stream ends after its batch");
    }

    #[test]
    fn rows_are_encoded_compressed() {
        let batch = rows();
        let encoded = EncodedRows::encode(&batch).unwrap();
        let (_, uncompressed) = IpcDataGenerator::default()
            .encode(
                &batch,
                &mut DictionaryTracker::new(false),
                &IpcWriteOptions::default(),
                &mut Default::default(),
            )
            .unwrap();
        assert!(
            encoded.bytes() * 2 < uncompressed.arrow_data.len(),
            "{} bytes compressed, {} uncompressed",
            encoded.bytes(),
            uncompressed.arrow_data.len()
        );
    }

    #[test]
    fn messages_that_do_not_frame_a_batch_are_refused_by_name() {
        let encoded = EncodedRows::encode(&rows()).unwrap();
        let refuse = |schema: &Bytes, header: &Bytes, body: Bytes| {
            EncodedRows::received(schema.clone(), header.clone(), body)
                .unwrap_err()
                .to_string()
        };
        let short = encoded.body.slice(..encoded.body.len() - 8);
        assert!(refuse(&encoded.schema, &encoded.header, short).contains("says its body has"));
        assert!(
            refuse(&encoded.header, &encoded.header, encoded.body.clone()).contains("not a schema")
        );
        assert!(
            refuse(&encoded.schema, &encoded.schema, encoded.body.clone())
                .contains("not a record batch")
        );
        let garbage = Bytes::from_static(b"\x01\x02\x03");
        assert!(refuse(&encoded.schema, &garbage, encoded.body.clone()).contains("unreadable"));
    }
}
