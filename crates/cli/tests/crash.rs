//! Durability under SIGKILL, torn logs and corrupted files, with the real binary.
//!
//! `tessera debug publish-loop` publishes numbered epochs (see its module docs for the
//! workload) and prints `ACK n epoch` after each acknowledged publish. These tests kill it
//! at random moments and check, after every restart, that the visible state is exactly the
//! state after publishes `1..=c` for the counter's tag `c`, and that `c` covers every
//! acknowledged publish.

use rand::Rng;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_testkit::{run, sql_csv, temp_data_dir, TesseraProcess};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");
const ROWS: i64 = 40;
const BULK_EVERY: i64 = 5;
/// Small limits so that a short run goes through the log, group commit, checkpoints, log
/// truncation, the bulk path and merges.
const STORE_FLAGS: [&str; 8] = [
    "--partitions",
    "8",
    "--memtable-flush-bytes",
    "150000",
    "--bulk-publish-bytes",
    "100000",
    "--merge-threshold",
    "3",
];

/// Mirrors `rows_in` of the publish loop.
fn rows_in(n: i64) -> i64 {
    if n % BULK_EVERY == 0 {
        ROWS * 50
    } else {
        ROWS
    }
}

fn expected_counts(c: i64) -> BTreeMap<i64, i64> {
    (1..=c)
        .map(|t| (t, rows_in(t) - if t + 3 <= c { rows_in(t) / 2 } else { 0 }))
        .collect()
}

/// Checks the store against the model; returns the counter's tag.
fn check_consistent(data: &Path) -> i64 {
    let counter = sql_csv(
        Path::new(BIN),
        data,
        &STORE_FLAGS,
        "SELECT tag FROM kv WHERE k = -1",
    );
    let c: i64 = counter
        .first()
        .map(|row| row[0].parse().unwrap())
        .unwrap_or(0);
    let rows = sql_csv(
        Path::new(BIN),
        data,
        &STORE_FLAGS,
        "SELECT tag, count(*) FROM kv WHERE k >= 0 GROUP BY tag",
    );
    let counts: BTreeMap<i64, i64> = rows
        .iter()
        .map(|r| (r[0].parse().unwrap(), r[1].parse().unwrap()))
        .collect();
    assert_eq!(
        counts,
        expected_counts(c),
        "visible state is not exactly publishes 1..={c}"
    );
    c
}

fn start_loop(data: &Path) -> TesseraProcess {
    let mut args: Vec<&str> = STORE_FLAGS.to_vec();
    args.extend(["debug", "publish-loop", "--rows", "40", "--bulk-every", "5"]);
    TesseraProcess::spawn(Path::new(BIN), data, &args)
}

fn last_ack(lines: &[String]) -> Option<i64> {
    lines.iter().rev().find_map(|l| {
        l.strip_prefix("ACK ")
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
    })
}

/// Runs the loop, kills it at a random moment, checks, and returns the highest ack.
fn kill_at_random_and_check(data: &Path, rng: &mut impl Rng, max_acked: &mut i64) {
    let mut process = start_loop(data);
    let first = process
        .next_line(Duration::from_secs(60))
        .expect("the publish loop acknowledges a publish");
    let mut lines = vec![first];
    std::thread::sleep(Duration::from_millis(rng.random_range(0..400)));
    process.kill9();
    lines.extend(process.drain_lines());
    if let Some(n) = last_ack(&lines) {
        *max_acked = (*max_acked).max(n);
    }
    let c = check_consistent(data);
    assert!(
        c >= *max_acked,
        "publish {max_acked} was acknowledged but the store only has 1..={c}"
    );
}

fn iterations() -> usize {
    std::env::var("TESSERA_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25)
}

#[test]
fn sigkill_during_publishing_loses_no_acknowledged_epoch_and_shows_no_partial_one() {
    let (_tmp, data) = temp_data_dir();
    let mut rng = rand::rng();
    let mut max_acked = 0;
    for _ in 0..iterations() {
        kill_at_random_and_check(&data, &mut rng, &mut max_acked);
    }
    assert!(
        max_acked >= iterations() as i64,
        "each run acknowledged at least one publish"
    );
    eprintln!(
        "{} SIGKILLs; {max_acked} publishes acknowledged, every one present after restart",
        iterations()
    );
    let status = run(Path::new(BIN), &data, &["status"]);
    assert!(status.status.success());
}

fn wal_segments(data: &Path) -> Vec<PathBuf> {
    let mut segments: Vec<PathBuf> = std::fs::read_dir(data.join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segments.sort();
    segments
}

#[test]
fn a_torn_log_tail_recovers_cleanly() {
    let (_tmp, data) = temp_data_dir();
    let mut rng = rand::rng();
    let mut max_acked = 0;
    kill_at_random_and_check(&data, &mut rng, &mut max_acked);
    for cut in [1u64, 7, 100] {
        let newest = wal_segments(&data)
            .into_iter()
            .filter(|p| std::fs::metadata(p).unwrap().len() > cut)
            .last();
        if let Some(segment) = newest {
            let len = std::fs::metadata(&segment).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&segment)
                .unwrap()
                .set_len(len - cut)
                .unwrap();
        }
        // A torn tail may cut an acknowledged epoch only in a real power loss, which this
        // simulates; atomicity must hold either way.
        check_consistent(&data);
    }
    // Garbage after the last frame is a torn tail too.
    let segment = wal_segments(&data).pop().unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes.extend(std::iter::repeat_n(0x5Au8, 333));
    std::fs::write(&segment, bytes).unwrap();
    let c = check_consistent(&data);
    // And the store keeps working afterwards.
    let mut ignored = c;
    kill_at_random_and_check(&data, &mut rng, &mut ignored);
}

#[test]
fn corruption_inside_the_log_is_an_error_not_a_silent_loss() {
    let (_tmp, data) = temp_data_dir();
    // A run with a high flush limit keeps several publishes in one segment.
    let mut process = TesseraProcess::spawn(
        Path::new(BIN),
        &data,
        &[
            "--partitions",
            "8",
            "debug",
            "publish-loop",
            "--rows",
            "10",
            "--bulk-every",
            "0",
        ],
    );
    for _ in 0..5 {
        process
            .next_line(Duration::from_secs(60))
            .expect("publishes are acknowledged");
    }
    process.kill9();
    let segment = wal_segments(&data)
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    assert!(bytes.len() > 1000, "the segment holds several frames");
    bytes[20] ^= 0x01;
    std::fs::write(&segment, &bytes).unwrap();
    let output = run(
        Path::new(BIN),
        &data,
        &["sql", "-c", "SELECT count(*) FROM kv"],
    );
    assert!(
        !output.status.success(),
        "a corrupt log must not open silently"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("write-ahead log") && stderr.contains("corrupt at byte 0"),
        "unclear error: {stderr}"
    );
    assert!(
        stderr.contains(&segment.file_name().unwrap().to_string_lossy().to_string()),
        "error names the segment: {stderr}"
    );
}

#[test]
fn a_corrupted_component_is_reported_by_name() {
    let (_tmp, data) = temp_data_dir();
    let setup = "CREATE TABLE t (k BIGINT, v VARCHAR, PRIMARY KEY (k)); INSERT INTO t VALUES (1, 'one'), (2, 'two'), (3, 'three');";
    assert!(run(
        Path::new(BIN),
        &data,
        &["--partitions", "2", "sql", "-c", setup]
    )
    .status
    .success());
    assert!(run(Path::new(BIN), &data, &["checkpoint"]).status.success());
    let component = std::fs::read_dir(data.join("components"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .next()
        .expect("a component was written");
    let mut bytes = std::fs::read(&component).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    std::fs::write(&component, &bytes).unwrap();
    let output = run(Path::new(BIN), &data, &["sql", "-c", "SELECT * FROM t"]);
    assert!(
        !output.status.success(),
        "a corrupt component must not be read"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let name = component.file_stem().unwrap().to_string_lossy().to_string();
    assert!(
        stderr.contains("is corrupt") && stderr.contains(&name),
        "unclear error: {stderr}"
    );
}
