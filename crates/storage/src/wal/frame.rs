//! A log frame written in pieces, and a prepared entry's frame built around rows already
//! encoded.

use super::*;
use crate::prepared::STREAM_END;
use bytes::Bytes;

/// One frame to append, in pieces written one after another. A prepared entry's rows stay
/// in the buffer they arrived in (a Flight message's body, shared): copying every logged
/// byte into a fresh frame cost each replica a copy and a page fault per 4 KiB.
#[derive(Debug, Clone)]
pub struct Frame {
    pub(super) parts: Vec<Bytes>,
}

impl From<Vec<u8>> for Frame {
    fn from(bytes: Vec<u8>) -> Frame {
        Frame {
            parts: vec![Bytes::from(bytes)],
        }
    }
}

/// A prepared entry's record built from rows already encoded ([`EncodedRows`]), before its
/// sequence number among the epoch's entries is known: the record's head is built and the
/// rows checksummed outside the store's lock, and [`PreparedFrame::finish`] fills in the
/// number. The record is the one [`WalRecord::Prepared`] encodes (its batch an IPC stream);
/// the rows' body is not copied but written from where it is.
pub struct PreparedFrame {
    /// The frame up to the rows' body: frame header, record header, and the IPC stream's
    /// schema message and batch message header.
    head: Vec<u8>,
    /// Where the rows' IPC stream starts in `head`; the sequence number (in the LSN slot)
    /// and the epoch are the 16 bytes before it.
    rows_at: usize,
    body: Bytes,
    /// CRC32C of the rows' whole stream (head part, body, end marker).
    rows_crc: u32,
}

impl PreparedFrame {
    pub fn new(
        table: &str,
        partition: PartitionId,
        epoch: Epoch,
        rows: &EncodedRows,
    ) -> PreparedFrame {
        let mut head = Vec::with_capacity(FRAME_HEADER_BYTES + 32 + table.len() + 1024);
        head.resize(FRAME_HEADER_BYTES, 0);
        head.push(KIND_PREPARED);
        push_table_partition_lsn(&mut head, table, partition, Lsn::ZERO);
        head.extend_from_slice(&epoch.0.to_le_bytes());
        let rows_at = head.len();
        rows.write_stream_head(&mut head);
        let body = rows.body.clone();
        assert!(
            head.len() + body.len() + STREAM_END.len() - FRAME_HEADER_BYTES <= MAX_FRAME_BYTES,
            "callers split publishes below the frame limit"
        );
        let crc = crc32c::crc32c(&head[rows_at..]);
        let crc = crc::combine(crc, crc32c::crc32c(&body), body.len());
        let rows_crc = crc::combine(crc, crc32c::crc32c(&STREAM_END), STREAM_END.len());
        PreparedFrame {
            head,
            rows_at,
            body,
            rows_crc,
        }
    }

    /// The frame, the entry numbered `seq`.
    pub fn finish(mut self, seq: u32) -> Frame {
        let seq_at = self.rows_at - 16;
        self.head[seq_at..seq_at + 8].copy_from_slice(&(seq as u64).to_le_bytes());
        let prefix_crc = crc32c::crc32c(&self.head[FRAME_HEADER_BYTES..self.rows_at]);
        let rows_len = self.head.len() - self.rows_at + self.body.len() + STREAM_END.len();
        let crc = crc::combine(prefix_crc, self.rows_crc, rows_len);
        let payload_len = (self.rows_at - FRAME_HEADER_BYTES + rows_len) as u32;
        self.head[..4].copy_from_slice(&payload_len.to_le_bytes());
        self.head[4..FRAME_HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
        Frame {
            parts: vec![
                Bytes::from(self.head),
                self.body,
                Bytes::from_static(&STREAM_END),
            ],
        }
    }
}
