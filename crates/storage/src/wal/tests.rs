use super::*;
use arrow::array::{Int64Array, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema};

/// Keys `1..=rows`, each with the value `value`.
fn batch(rows: i64, value: u64) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::UInt64, false),
    ]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(1..=rows)),
            Arc::new(UInt64Array::from(vec![value; rows as usize])),
        ],
    )
    .unwrap()
}

fn rows(lsn: u64, epoch: u64) -> WalRecord {
    let batch = batch(3, lsn);
    WalRecord::Rows {
        table: "t".into(),
        partition: PartitionId(3),
        lsn: Lsn(lsn),
        epoch: Epoch(epoch),
        batch,
    }
}

/// Rows at LSN 1, the commit of epoch 1, rows at LSN 2: the log most tests start from.
fn rows_commit_rows() -> [WalRecord; 3] {
    [
        rows(1, 1),
        WalRecord::Commit {
            epoch: Epoch(1),
            at_ms: 0,
        },
        rows(2, 2),
    ]
}

fn write_log(dir: &Path, records: &[WalRecord]) {
    let wal = Wal::start(dir, 1).unwrap();
    let frames: Vec<u8> = records
        .iter()
        .flat_map(|r| r.encode_frame().unwrap())
        .collect();
    wal.submit(frames).wait().unwrap();
}

fn segment_bytes(dir: &Path) -> Vec<u8> {
    fs::read(segment_path(dir, 1)).unwrap()
}

#[test]
fn cluster_records_round_trip_through_a_segment() {
    let dir = tempfile::tempdir().unwrap();
    let WalRecord::Rows { batch, .. } = rows(1, 1) else {
        unreachable!()
    };
    let prepared = WalRecord::Prepared {
        table: "t".into(),
        partition: PartitionId(2),
        epoch: Epoch(7),
        seq: 4,
        batch,
    };
    let commit = WalRecord::CommitPrepared {
        epoch: Epoch(7),
        lsns: vec![("t".into(), PartitionId(2), Lsn(9))],
    };
    write_log(
        dir.path(),
        &[prepared, commit, WalRecord::Abort { epoch: Epoch(8) }],
    );
    let log = recover(dir.path()).unwrap();
    assert_eq!(log.torn_bytes, 0, "every kind is a known kind");
    assert!(matches!(
        &log.records[0],
        WalRecord::Prepared { epoch: Epoch(7), seq: 4, partition: PartitionId(2), batch, .. } if batch.num_rows() == 3
    ));
    assert!(matches!(
        &log.records[1],
        WalRecord::CommitPrepared { epoch: Epoch(7), lsns } if lsns == &vec![("t".to_string(), PartitionId(2), Lsn(9))]
    ));
    assert!(matches!(
        &log.records[2],
        WalRecord::Abort { epoch: Epoch(8) }
    ));
}

#[test]
fn rows_are_logged_compressed_and_older_logs_uncompressed_or_lz4_rows_still_read() {
    let batch = batch(10_000, 7);
    let record = WalRecord::Prepared {
        table: "t".into(),
        partition: PartitionId(2),
        epoch: Epoch(7),
        seq: 4,
        batch: batch.clone(),
    };
    let frame = record.encode_frame().unwrap();
    // The same record as logs were written before their rows were compressed, and while
    // they were compressed with LZ4.
    let older_with = |options: IpcWriteOptions| {
        let mut older = Vec::new();
        encode_rows(
            &mut older,
            KIND_PREPARED,
            "t",
            PartitionId(2),
            Lsn(4),
            Epoch(7),
            &batch,
            options,
        )
        .unwrap();
        older
    };
    let uncompressed = older_with(IpcWriteOptions::default());
    let lz4 = older_with(
        IpcWriteOptions::default()
            .try_with_compression(Some(arrow_ipc::CompressionType::LZ4_FRAME))
            .unwrap(),
    );
    assert!(
        frame.len() * 2 < uncompressed.len() && frame.len() < lz4.len(),
        "{} bytes logged, {} uncompressed, {} with LZ4",
        frame.len(),
        uncompressed.len(),
        lz4.len()
    );
    for payload in [&frame[FRAME_HEADER_BYTES..], &uncompressed[..], &lz4[..]] {
        match WalRecord::decode_payload(payload).unwrap() {
            WalRecord::Prepared {
                epoch: Epoch(7),
                seq: 4,
                batch: read,
                ..
            } => assert_eq!(read, batch),
            other => panic!("expected the prepared record, read {other:?}"),
        }
    }
}

#[test]
fn a_prepared_frame_of_encoded_rows_reads_back_as_the_prepared_record() {
    let dir = tempfile::tempdir().unwrap();
    let WalRecord::Rows { batch, .. } = rows(1, 1) else {
        unreachable!()
    };
    let encoded = EncodedRows::encode(&batch).unwrap();
    let frame = PreparedFrame::new("orders", PartitionId(5), Epoch(11), &encoded).finish(3);
    assert!(
        frame
            .parts
            .iter()
            .any(|p| p.as_ptr() == encoded.body.as_ptr()),
        "the rows' body is written from where it is, not copied"
    );
    let wal = Wal::start(dir.path(), 1).unwrap();
    wal.submit_frames(vec![
        frame,
        WalRecord::Abort { epoch: Epoch(12) }
            .encode_frame()
            .unwrap()
            .into(),
    ])
    .wait()
    .unwrap();
    let log = recover(dir.path()).unwrap();
    assert_eq!(log.torn_bytes, 0, "the checksum combines to the record's");
    match &log.records[0] {
        WalRecord::Prepared {
            table,
            partition,
            epoch,
            seq,
            batch: read,
        } => {
            assert_eq!(
                (table.as_str(), *partition, *epoch, *seq),
                ("orders", PartitionId(5), Epoch(11), 3)
            );
            assert_eq!(read, &batch);
        }
        other => panic!("expected the prepared record, read {other:?}"),
    }
    assert!(matches!(
        &log.records[1],
        WalRecord::Abort { epoch: Epoch(12) }
    ));
}

#[test]
fn a_commit_record_carries_its_time_and_older_ones_decode_without() {
    let dir = tempfile::tempdir().unwrap();
    let at_ms = 1_795_000_000_123;
    write_log(
        dir.path(),
        &[WalRecord::Commit {
            epoch: Epoch(3),
            at_ms,
        }],
    );
    let log = recover(dir.path()).unwrap();
    assert!(matches!(
        &log.records[0],
        WalRecord::Commit { epoch: Epoch(3), at_ms: t } if *t == at_ms
    ));
    // A commit record as earlier versions wrote it: its kind and epoch only.
    let mut payload = vec![KIND_COMMIT];
    payload.extend_from_slice(&4u64.to_le_bytes());
    assert!(matches!(
        WalRecord::decode_payload(&payload),
        Ok(WalRecord::Commit {
            epoch: Epoch(4),
            at_ms: 0
        })
    ));
}

#[test]
fn records_round_trip_through_a_segment() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path(), &rows_commit_rows());
    let log = recover(dir.path()).unwrap();
    assert_eq!(log.records.len(), 3);
    assert_eq!(log.torn_bytes, 0);
    match &log.records[2] {
        WalRecord::Rows {
            lsn,
            epoch,
            batch,
            table,
            partition,
        } => {
            assert_eq!(
                (
                    lsn.0,
                    epoch.0,
                    table.as_str(),
                    partition.0,
                    batch.num_rows()
                ),
                (2, 2, "t", 3, 3)
            );
        }
        other => panic!("expected rows, got {other:?}"),
    }
}

#[test]
fn every_truncation_of_the_tail_recovers_a_prefix() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path(), &rows_commit_rows());
    let full = segment_bytes(dir.path());
    let first_two = rows(1, 1).encode_frame().unwrap().len()
        + WalRecord::Commit {
            epoch: Epoch(1),
            at_ms: 0,
        }
        .encode_frame()
        .unwrap()
        .len();
    for cut in (first_two..full.len()).step_by(7) {
        fs::write(segment_path(dir.path(), 1), &full[..cut]).unwrap();
        let log = recover(dir.path()).unwrap();
        assert_eq!(log.records.len(), 2, "cut at {cut}");
        assert_eq!(
            fs::metadata(segment_path(dir.path(), 1)).unwrap().len() as usize,
            first_two,
            "torn tail is cut off on disk"
        );
    }
}

#[test]
fn garbage_after_the_last_frame_is_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    write_log(
        dir.path(),
        &[
            rows(1, 1),
            WalRecord::Commit {
                epoch: Epoch(1),
                at_ms: 0,
            },
        ],
    );
    let mut bytes = segment_bytes(dir.path());
    bytes.extend_from_slice(&[0xAB; 100]);
    fs::write(segment_path(dir.path(), 1), &bytes).unwrap();
    let log = recover(dir.path()).unwrap();
    assert_eq!(log.records.len(), 2);
    assert_eq!(log.torn_bytes, 100);
}

#[test]
fn a_flipped_bit_before_valid_frames_is_corruption_not_a_tail() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path(), &rows_commit_rows());
    let mut bytes = segment_bytes(dir.path());
    bytes[20] ^= 0x40;
    fs::write(segment_path(dir.path(), 1), &bytes).unwrap();
    match recover(dir.path()) {
        Err(StorageError::CorruptLog { offset, .. }) => assert_eq!(offset, 0),
        Err(other) => panic!("expected CorruptLog, got {other}"),
        Ok(_) => panic!("expected CorruptLog, got a recovery"),
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// The log parser reads bytes from disk: arbitrary damage to a valid log yields a
    /// prefix of its records or a `CorruptLog` error, never a panic or a wrong record.
    #[test]
    fn damaged_logs_yield_a_prefix_or_an_error(flips in proptest::collection::vec((0usize..4096, 1u8..=255), 0..4), cut in 0usize..4096) {
        let dir = tempfile::tempdir().unwrap();
        let records = [rows(1, 1), WalRecord::Commit { epoch: Epoch(1), at_ms: 0 }, rows(2, 2), WalRecord::Commit { epoch: Epoch(2), at_ms: 0 }];
        write_log(dir.path(), &records);
        let mut bytes = segment_bytes(dir.path());
        for (at, mask) in &flips {
            let len = bytes.len();
            bytes[at % len] ^= mask;
        }
        bytes.truncate(bytes.len().saturating_sub(cut % 64));
        fs::write(segment_path(dir.path(), 1), &bytes).unwrap();
        match recover(dir.path()) {
            Ok(log) => {
                proptest::prop_assert!(log.records.len() <= records.len());
                for (got, want) in log.records.iter().zip(&records) {
                    proptest::prop_assert_eq!(format!("{got:?}"), format!("{want:?}"));
                }
            }
            Err(StorageError::CorruptLog { .. }) => {}
            Err(other) => proptest::prop_assert!(false, "unexpected error {}", other),
        }
    }
}

#[test]
fn rotation_starts_a_new_segment_and_old_ones_can_go() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::start(dir.path(), 1).unwrap();
    wal.submit(rows(1, 1).encode_frame().unwrap())
        .wait()
        .unwrap();
    assert_eq!(wal.rotate().unwrap(), 2);
    wal.submit(rows(2, 2).encode_frame().unwrap())
        .wait()
        .unwrap();
    wal.delete_segments_before(2).unwrap();
    assert_eq!(list_segments(dir.path()).unwrap(), vec![2]);
    assert_eq!(recover(dir.path()).unwrap().records.len(), 1);
}
