//! Reading the log of a running store without reading its rows: each row record is told by
//! its header (kind, table, partition, LSN or entry number, epoch) and where it lies; only
//! the small records (commits, aborts) are read whole. A cold standby's checkpoint wants the
//! rows of a few of its records out of a log of many (its primaries' components cover the
//! rest), so it skims the log and then reads just those ([`read_frame`]): reading and
//! decoding every record cost an r = 3 replica about a fifth of its CPU.

use super::*;
use std::io::{Read, Seek, SeekFrom};

/// Where one frame lies in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameAt {
    segment: u64,
    offset: u64,
    /// Payload bytes, after the frame header.
    len: usize,
}

/// A log record as [`skim`] finds it.
#[derive(Debug)]
pub enum Skimmed {
    /// A cluster epoch's prepared rows, not read.
    Prepared {
        table: String,
        partition: PartitionId,
        epoch: Epoch,
        seq: u32,
        at: FrameAt,
    },
    /// Rows of a single-node publish, not read.
    Rows,
    /// Any other record, read whole.
    Record(WalRecord),
}

/// Bytes of a row record's payload before its table name: kind and name length.
const NAME_AT: usize = 3;
/// Bytes of a row record's payload after its table name and before its rows: partition,
/// LSN (or entry number) and epoch.
const AFTER_NAME: usize = 4 + 8 + 8;

/// Every record of the log in `dir`, in order, row records unread. The caller keeps appends
/// away (it holds the store's gate); a frame that runs past the end of the last segment is a
/// torn tail and ends the skim, as recovery would cut it. Row records' checksums are not
/// checked here but by [`read_frame`], when their rows are read.
pub fn skim(dir: &Path) -> Result<Vec<Skimmed>> {
    let segments = list_segments(dir)?;
    let mut records = Vec::new();
    for (i, &segment) in segments.iter().enumerate() {
        let path = segment_path(dir, segment);
        let is_last = i + 1 == segments.len();
        skim_segment(&path, segment, is_last, &mut records)?;
    }
    Ok(records)
}

fn skim_segment(path: &Path, segment: u64, is_last: bool, out: &mut Vec<Skimmed>) -> Result<()> {
    let io = |e| StorageError::io(path, e);
    let mut file = disk::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let corrupt = |offset: u64, reason: String| StorageError::CorruptLog {
        path: path.to_path_buf(),
        offset,
        reason,
    };
    let mut offset = 0u64;
    while offset < size {
        let mut header = [0u8; FRAME_HEADER_BYTES];
        let payload_at = offset + FRAME_HEADER_BYTES as u64;
        let len = if payload_at <= size {
            file.seek(SeekFrom::Start(offset)).map_err(io)?;
            file.read_exact(&mut header).map_err(io)?;
            u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize
        } else {
            0
        };
        let fits = len > 0 && len <= MAX_FRAME_BYTES && payload_at + len as u64 <= size;
        if !fits {
            if is_last {
                return Ok(());
            }
            return Err(corrupt(
                offset,
                format!("frame of {len} bytes does not fit the segment"),
            ));
        }
        let at = FrameAt {
            segment,
            offset,
            len,
        };
        let mut kind = [0u8; NAME_AT];
        file.read_exact(&mut kind[..NAME_AT.min(len)]).map_err(io)?;
        let record = match kind[0] {
            // Its rows are never wanted here (a single-node publish's, not a standby's).
            KIND_ROWS => Skimmed::Rows,
            KIND_PREPARED if len >= NAME_AT => {
                let name_len = u16::from_le_bytes([kind[1], kind[2]]) as usize;
                if NAME_AT + name_len + AFTER_NAME > len {
                    return Err(corrupt(offset, "row record header cut short".into()));
                }
                let mut rest = vec![0u8; name_len + AFTER_NAME];
                file.read_exact(&mut rest).map_err(io)?;
                let (name, numbers) = rest.split_at(name_len);
                let table = String::from_utf8(name.to_vec())
                    .map_err(|_| corrupt(offset, "table name is not UTF-8".into()))?;
                let partition =
                    PartitionId(u32::from_le_bytes(numbers[0..4].try_into().expect("4")));
                let number = u64::from_le_bytes(numbers[4..12].try_into().expect("8"));
                let epoch = Epoch(u64::from_le_bytes(numbers[12..20].try_into().expect("8")));
                Skimmed::Prepared {
                    table,
                    partition,
                    epoch,
                    seq: u32::try_from(number).map_err(|_| {
                        corrupt(offset, "prepared entry number out of range".into())
                    })?,
                    at,
                }
            }
            _ => Skimmed::Record(read_frame_from(&mut file, path, at)?),
        };
        out.push(record);
        offset = payload_at + len as u64;
    }
    Ok(())
}

/// The record of one frame [`skim`] found, read whole and checked against its checksum.
pub fn read_frame(dir: &Path, at: FrameAt) -> Result<WalRecord> {
    let path = segment_path(dir, at.segment);
    let mut file = disk::open(&path).map_err(|e| StorageError::io(&path, e))?;
    read_frame_from(&mut file, &path, at)
}

fn read_frame_from(file: &mut File, path: &Path, at: FrameAt) -> Result<WalRecord> {
    let io = |e| StorageError::io(path, e);
    file.seek(SeekFrom::Start(at.offset)).map_err(io)?;
    let mut frame = vec![0u8; FRAME_HEADER_BYTES + at.len];
    file.read_exact(&mut frame).map_err(io)?;
    parse_frame(&frame)
        .map(|(record, _)| record)
        .map_err(|reason| StorageError::CorruptLog {
            path: path.to_path_buf(),
            offset: at.offset,
            reason,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    fn batch(values: Vec<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(values))]).unwrap()
    }

    fn prepared(table: &str, partition: u32, epoch: u64, seq: u32, values: Vec<i64>) -> WalRecord {
        WalRecord::Prepared {
            table: table.into(),
            partition: PartitionId(partition),
            epoch: Epoch(epoch),
            seq,
            batch: batch(values),
        }
    }

    /// Two segments: prepared rows, single-node rows, a commit, an abort.
    fn two_segments(dir: &Path) {
        let wal = Wal::start(dir, 1).unwrap();
        let frames = |records: Vec<WalRecord>| -> Vec<Frame> {
            records
                .iter()
                .map(|r| r.encode_frame().unwrap().into())
                .collect()
        };
        wal.submit_frames(frames(vec![
            prepared("orders", 2, 7, 0, vec![1, 2, 3]),
            WalRecord::Rows {
                table: "t".into(),
                partition: PartitionId(1),
                lsn: Lsn(4),
                epoch: Epoch(6),
                batch: batch(vec![9]),
            },
        ]))
        .wait()
        .unwrap();
        wal.rotate().unwrap();
        wal.submit_frames(frames(vec![
            prepared("lineitem_with_a_long_name", 5, 7, 1, vec![4, 5]),
            WalRecord::CommitPrepared {
                epoch: Epoch(7),
                lsns: vec![("orders".into(), PartitionId(2), Lsn(3))],
            },
            WalRecord::Abort { epoch: Epoch(8) },
        ]))
        .wait()
        .unwrap();
    }

    #[test]
    fn a_skim_names_every_record_and_reads_the_rows_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        two_segments(dir.path());
        let skimmed = skim(dir.path()).unwrap();
        assert_eq!(skimmed.len(), 5);
        let Skimmed::Prepared {
            table,
            partition,
            epoch,
            seq,
            at,
        } = &skimmed[0]
        else {
            panic!("first a prepared record: {:?}", skimmed[0]);
        };
        assert_eq!(
            (table.as_str(), *partition, *epoch, *seq),
            ("orders", PartitionId(2), Epoch(7), 0)
        );
        assert!(matches!(skimmed[1], Skimmed::Rows));
        let Skimmed::Prepared {
            table,
            seq,
            at: second,
            ..
        } = &skimmed[2]
        else {
            panic!("a prepared record in the second segment: {:?}", skimmed[2]);
        };
        assert_eq!((table.as_str(), *seq), ("lineitem_with_a_long_name", 1));
        assert!(matches!(
            &skimmed[3],
            Skimmed::Record(WalRecord::CommitPrepared { epoch: Epoch(7), lsns }) if lsns.len() == 1
        ));
        assert!(matches!(
            skimmed[4],
            Skimmed::Record(WalRecord::Abort { epoch: Epoch(8) })
        ));
        for (at, rows) in [(at, vec![1, 2, 3]), (second, vec![4, 5])] {
            let WalRecord::Prepared { batch: read, .. } = read_frame(dir.path(), *at).unwrap()
            else {
                panic!("a prepared record reads back as one");
            };
            assert_eq!(read, batch(rows));
        }
    }

    #[test]
    fn a_torn_tail_ends_the_skim_and_a_damaged_record_is_named_when_read() {
        let dir = tempfile::tempdir().unwrap();
        two_segments(dir.path());
        let last = segment_path(dir.path(), 2);
        let mut bytes = fs::read(&last).unwrap();
        // Half a frame header at the end: a write cut short by a crash.
        bytes.extend_from_slice(&[9, 0, 0]);
        fs::write(&last, &bytes).unwrap();
        assert_eq!(
            skim(dir.path()).unwrap().len(),
            5,
            "the torn tail is no record"
        );

        // A flipped byte in the rows of the first record: its skim still reads its header,
        // and reading its rows names the damage.
        let first = segment_path(dir.path(), 1);
        let mut bytes = fs::read(&first).unwrap();
        let len = u32::from_le_bytes(bytes[0..4].try_into().unwrap()) as usize;
        bytes[FRAME_HEADER_BYTES + len - 10] ^= 0xFF;
        fs::write(&first, &bytes).unwrap();
        let skimmed = skim(dir.path()).unwrap();
        let Skimmed::Prepared { at, .. } = &skimmed[0] else {
            panic!("the header is intact: {:?}", skimmed[0]);
        };
        let error = read_frame(dir.path(), *at).unwrap_err().to_string();
        assert!(error.contains("CRC32C mismatch"), "{error}");
        assert!(error.contains("0000000000000001.wal"), "{error}");

        // A frame that runs past the end of a segment that is not the last is corruption.
        bytes.truncate(bytes.len() - 4);
        fs::write(&first, &bytes).unwrap();
        let error = skim(dir.path()).unwrap_err().to_string();
        assert!(error.contains("does not fit the segment"), "{error}");
    }
}
