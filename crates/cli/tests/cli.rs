//! The `tessera` command as a user runs it: relative data directories, the prompt on
//! standard input, output formats, publishing files, and clear errors.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn tessera(cwd: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(BIN)
        .current_dir(cwd)
        .args(["--data-dir", "data", "--partitions", "4"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

fn stdout_of(output: &Output) -> String {
    assert!(
        output.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).to_string()
}

#[test]
fn a_relative_data_dir_works_across_checkpoints_and_formats() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let setup = "CREATE TABLE t (k BIGINT, v VARCHAR, PRIMARY KEY (k)); INSERT INTO t VALUES (1, 'a'), (2, 'b');";
    assert!(stdout_of(&tessera(cwd, &["sql", "-c", setup], None)).contains("INSERT 2 (epoch 1)"));
    stdout_of(&tessera(cwd, &["checkpoint"], None));
    let csv = stdout_of(&tessera(
        cwd,
        &[
            "sql",
            "--format",
            "csv",
            "-c",
            "SELECT k, v FROM t ORDER BY k",
        ],
        None,
    ));
    assert_eq!(csv, "k,v\n1,a\n2,b\n");
    let json = stdout_of(&tessera(
        cwd,
        &[
            "sql",
            "--format",
            "json",
            "-c",
            "SELECT k FROM t WHERE v = 'b'",
        ],
        None,
    ));
    assert_eq!(json.trim(), r#"[{"k":2}]"#);
    let explain = stdout_of(&tessera(
        cwd,
        &["sql", "-c", "EXPLAIN SELECT v FROM t WHERE k > 1"],
        None,
    ));
    assert!(
        explain.contains("DecodedScanExec") && !explain.contains("VersionedScanExec"),
        "small plain components are read whole, kept decoded, with no versions to resolve: {explain}"
    );
}

#[test]
fn the_prompt_runs_statements_from_stdin_and_reports_failures() {
    let tmp = tempfile::tempdir().unwrap();
    let script = "CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT);\nINSERT INTO t\n  VALUES (1, 10);\nSELECT nonsense;\nSELECT v FROM t;\n";
    let output = tessera(tmp.path(), &["sql"], Some(script));
    assert!(
        !output.status.success(),
        "a failed statement makes a script fail"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stdout.contains("| 10 |"),
        "statements after the failure still run: {stdout}"
    );
    assert!(
        stderr.contains("nonsense"),
        "the error names the problem: {stderr}"
    );
    let unfinished = tessera(tmp.path(), &["sql"], Some("SELECT 1"));
    assert!(String::from_utf8_lossy(&unfinished.stderr).contains("missing ';'"));
}

/// An error reads once, without DataFusion's category prefix or its causes repeated; and
/// statements given with -c may start with a comment (not taken for a flag).
#[test]
fn errors_read_once_and_a_command_may_start_with_a_comment() {
    let tmp = tempfile::tempdir().unwrap();
    let failed = tessera(tmp.path(), &["sql", "-c", "SELECT * FROM nosuch"], None);
    assert!(!failed.status.success());
    assert_eq!(
        String::from_utf8_lossy(&failed.stderr).trim(),
        "error: table 'tessera.public.nosuch' not found"
    );
    let commented = tessera(
        tmp.path(),
        &[
            "sql",
            "--format",
            "csv",
            "-c",
            "-- the answer\nSELECT 42 AS answer",
        ],
        None,
    );
    assert!(stdout_of(&commented).contains("42"));
}

/// At scale factor 0.001, TPC-H's generator gives some parts the same supplier twice:
/// loading partsupp is refused before any table is created, with the reason and a scale
/// factor that works; the tables without that key load at the same scale factor.
#[test]
fn a_scale_factor_whose_partsupp_repeats_keys_is_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = tessera(tmp.path(), &["load", "tpch", "--sf", "0.001"], None);
    assert!(!refused.status.success());
    let error = String::from_utf8_lossy(&refused.stderr);
    assert!(
        error.contains("repeats partsupp's key at scale factor 0.001")
            && error.contains("such as 0.01"),
        "{error}"
    );
    let nothing = tessera(
        tmp.path(),
        &["sql", "-c", "SELECT count(*) FROM region"],
        None,
    );
    assert!(!nothing.status.success(), "a table was created");
    let loaded = tessera(
        tmp.path(),
        &["load", "tpch", "--sf", "0.001", "--tables", "region,part"],
        None,
    );
    stdout_of(&loaded);
    let parts = tessera(
        tmp.path(),
        &[
            "sql",
            "--format",
            "csv",
            "-c",
            "SELECT count(*) AS n FROM part",
        ],
        None,
    );
    assert!(
        stdout_of(&parts).contains("200"),
        "part at SF 0.001 has 200 rows"
    );
}

#[test]
fn publish_reads_csv_upserts_and_deletes() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    stdout_of(&tessera(
        cwd,
        &[
            "sql",
            "-c",
            "CREATE TABLE t (k BIGINT, v VARCHAR, PRIMARY KEY (k))",
        ],
        None,
    ));
    std::fs::write(cwd.join("rows.csv"), "k,v\n1,one\n2,two\n3,three\n").unwrap();
    std::fs::write(cwd.join("keys.csv"), "k\n2\n").unwrap();
    assert!(stdout_of(&tessera(
        cwd,
        &["publish", "--table", "t", "rows.csv"],
        None
    ))
    .contains("published 3 rows to t as epoch 1"));
    assert!(stdout_of(&tessera(
        cwd,
        &["publish", "--table", "t", "--delete", "keys.csv"],
        None
    ))
    .contains("epoch 2"));
    let csv = stdout_of(&tessera(
        cwd,
        &["sql", "--format", "csv", "-c", "SELECT k FROM t ORDER BY k"],
        None,
    ));
    assert_eq!(csv, "k\n1\n3\n");
    std::fs::write(cwd.join("bad.csv"), "k,v\nnot-a-number,x\n").unwrap();
    let bad = tessera(cwd, &["publish", "--table", "t", "bad.csv"], None);
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("bad.csv") && stderr.contains("not-a-number"),
        "{stderr}"
    );
    let unknown = tessera(cwd, &["publish", "--table", "nope", "rows.csv"], None);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("\"nope\" does not exist"));

    // The header names the columns, in any order; after schema changes, the table's
    // columns as they are now (a dropped column is not asked for, an added one may be
    // left out and takes its default).
    stdout_of(&tessera(
        cwd,
        &[
            "sql",
            "-c",
            "ALTER TABLE t ADD COLUMN n BIGINT DEFAULT 5; ALTER TABLE t ADD COLUMN w INT; ALTER TABLE t DROP COLUMN v",
        ],
        None,
    ));
    std::fs::write(cwd.join("after.csv"), "w,k\n40,4\n").unwrap();
    assert!(stdout_of(&tessera(
        cwd,
        &["publish", "--table", "t", "after.csv"],
        None
    ))
    .contains("published 1 rows"));
    let csv = stdout_of(&tessera(
        cwd,
        &["sql", "--format", "csv", "-c", "SELECT * FROM t ORDER BY k"],
        None,
    ));
    assert_eq!(csv, "k,n,w\n1,5,\n3,5,\n4,5,40\n");
    std::fs::write(cwd.join("dropped.csv"), "k,v\n5,five\n").unwrap();
    let dropped = tessera(cwd, &["publish", "--table", "t", "dropped.csv"], None);
    let stderr = String::from_utf8_lossy(&dropped.stderr);
    assert!(
        !dropped.status.success()
            && stderr
                .contains("column \"v\", which table \"t\" does not have (its columns: k, n, w)"),
        "{stderr}"
    );
}

/// The table `tessera status` lists: (stored rows, components) of `table`.
fn stored_rows_and_components(cwd: &Path, table: &str) -> (u64, u64) {
    let status = stdout_of(&tessera(cwd, &["status"], None));
    let row = status
        .lines()
        .find(|line| line.split_whitespace().next() == Some(table))
        .unwrap_or_else(|| panic!("no row for {table} in: {status}"));
    let fields: Vec<u64> = row
        .split_whitespace()
        .skip(1)
        .map(|field| field.parse().unwrap())
        .collect();
    (fields[0], fields[2])
}

/// A table published in a large batch and then a small one keeps two components per
/// partition (the small one waits for the merge threshold); `tessera settle` merges each
/// partition down to one, and every row stays.
#[test]
fn settle_merges_what_a_bulk_load_left_into_one_component_per_partition() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let create = "CREATE TABLE t (k BIGINT, v VARCHAR, PRIMARY KEY (k))";
    stdout_of(&tessera(cwd, &["sql", "-c", create], None));
    let padding = "x".repeat(100);
    let rows = |keys: std::ops::Range<u64>| {
        let mut csv = String::from("k,v\n");
        for k in keys {
            csv.push_str(&format!("{k},{padding}\n"));
        }
        csv
    };
    std::fs::write(cwd.join("large.csv"), rows(0..20_000)).unwrap();
    std::fs::write(cwd.join("small.csv"), rows(20_000..20_040)).unwrap();
    for file in ["large.csv", "small.csv"] {
        stdout_of(&tessera(cwd, &["publish", "--table", "t", file], None));
        stdout_of(&tessera(cwd, &["checkpoint"], None));
    }
    let (rows_before, components_before) = stored_rows_and_components(cwd, "t");
    assert_eq!(rows_before, 20_040);
    assert!(
        components_before > 4,
        "two publishes should leave more components than the 4 partitions: {components_before}"
    );

    let settled = stdout_of(&tessera(cwd, &["settle"], None));
    assert!(settled.contains("settled"), "{settled}");
    assert_eq!(stored_rows_and_components(cwd, "t"), (20_040, 4));
    let count = stdout_of(&tessera(
        cwd,
        &[
            "sql",
            "--format",
            "csv",
            "-c",
            "SELECT count(DISTINCT k) AS n FROM t",
        ],
        None,
    ));
    assert_eq!(count, "n\n20040\n");
}

#[test]
fn a_second_process_on_the_same_data_dir_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut holder = Command::new(BIN)
        .current_dir(tmp.path())
        .args(["--data-dir", "data", "sql"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The holder has the lock once its data directory holds a checkpoint.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !tmp.path().join("data/checkpoint.json").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the first process never opened its store"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let second = tessera(tmp.path(), &["status"], None);
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use by another Tessera process"));
}

#[test]
fn the_benchmark_command_runs_and_checks_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tessera(
        tmp.path(),
        &[
            "bench",
            "tpch",
            "--sf",
            "0.01",
            "--runs",
            "1",
            "--queries",
            "1,3,6",
        ],
        None,
    );
    let stdout = stdout_of(&output);
    assert_eq!(
        stdout.matches("  same").count(),
        3,
        "every benchmarked answer equals DataFusion's: {stdout}"
    );
    assert!(stdout.contains("geometric mean ratio"), "{stdout}");
    let bad = tessera(
        tmp.path(),
        &["bench", "tpch", "--sf", "0.01", "--queries", "23"],
        None,
    );
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not 23"));
}

#[test]
fn the_cluster_benchmark_compares_nodes_with_one_node_and_datafusion() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tessera(
        tmp.path(),
        &[
            "bench",
            "tpch",
            "--nodes",
            "2",
            "--sf",
            "0.01",
            "--runs",
            "1",
            "--queries",
            "3,13",
            "--memory-limit",
            "64KB",
        ],
        None,
    );
    let stdout = stdout_of(&output);
    // A limit far below the working set: each query fails naming it, and the benchmark
    // reports that and goes on.
    assert!(
        stdout.contains("with tessera.query_memory_limit = '64KB'")
            && stdout.contains("failed: [3, 13]"),
        "{stdout}"
    );
    assert!(
        stdout.contains("peak memory per node while querying"),
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("  same").count(),
        2,
        "both clusters' answers equal DataFusion's: {stdout}"
    );
    assert!(stdout.contains("2-node / DataFusion"), "{stdout}");
    assert!(stdout.contains("total bytes exchanged"), "{stdout}");
    let exchanged: u64 = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("Q3 "))
        .and_then(|l| l.split_whitespace().nth(6))
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("no bytes column for Q3: {stdout}"));
    assert!(exchanged > 0, "a 2-node join exchanges rows: {stdout}");
    let one = tessera(
        tmp.path(),
        &["bench", "tpch", "--nodes", "1", "--sf", "0.01"],
        None,
    );
    assert!(String::from_utf8_lossy(&one.stderr).contains("give 2 or more"));
}

#[test]
fn a_node_refuses_a_bad_setting_and_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        "cluster_id = \"c\"\nnode_id = 1\nlisten = \"127.0.0.1:1\"\ndata_dir = \"d\"\ninsecure = true\n[[peers]]\nid = 1\naddr = \"127.0.0.1:1\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let refused = |overrides: &[&str]| {
        let mut args = vec!["node", "--config", config];
        for o in overrides {
            args.extend(["--set", o]);
        }
        let output = tessera(dir.path(), &args, None);
        assert!(!output.status.success(), "{overrides:?} was accepted");
        String::from_utf8_lossy(&output.stderr).to_string()
    };
    let typo = refused(&["failure.timout_ms=3000"]);
    assert!(typo.contains("unknown field `timout_ms`"), "{typo}");
    let rule = refused(&["failure.heartbeat_ms=2000"]);
    assert!(
        rule.contains("failure.timeout_ms (1500) must exceed failure.heartbeat_ms (2000)"),
        "the override reached the checks: {rule}"
    );
    let moved = refused(&["failure_timeout_ms=900"]);
    assert!(
        moved.contains("write it as `failure.timeout_ms`"),
        "{moved}"
    );
    assert!(
        !dir.path().join("d").exists(),
        "a refused configuration touches no data"
    );
}

#[test]
fn the_replication_benchmark_flushes_after_each_publish_and_sets_a_warm_up_aside() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tessera(
        tmp.path(),
        &["bench", "replication", "--sf", "0.002", "--runs", "1"],
        None,
    );
    let stdout = stdout_of(&output);
    assert!(
        stdout.contains("after a warm-up publish into each cluster"),
        "{stdout}"
    );
    // Every timed publish, the warm-up included, is followed by a flush of every node:
    // publish/flushed pairs, the flush ending after the publish.
    for row in ["each round (s)", "warm-up, not in the rounds (s)"] {
        let line = stdout
            .lines()
            .find(|line| line.starts_with(row))
            .unwrap_or_else(|| panic!("no {row:?} row: {stdout}"));
        let pairs: Vec<(f64, f64)> = line
            .split_whitespace()
            .filter_map(|word| word.trim_end_matches(')').split_once('/'))
            .filter_map(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .collect();
        assert_eq!(pairs.len(), 4, "r=1, r=2, r=3 and hot standby: {line}");
        assert!(
            pairs.iter().all(|(publish, flushed)| publish <= flushed),
            "{line}"
        );
    }
    assert!(stdout.contains("publish then flush vs r=1"), "{stdout}");
    assert!(
        stdout.contains(" of 8 timed before they were"),
        "a warm-up and one round for each of four clusters: {stdout}"
    );
}
