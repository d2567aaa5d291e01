//! `tessera demo` as a new user meets it: a fresh data directory, the real binary starting
//! real node processes. Its output must tell the true story (the exact answer of a query
//! whose node was SIGKILLed, the recovery notice, a catch-up by delta), and every process
//! it started must be gone when it ends: interrupted during the load, stopped with Ctrl-C
//! after the story, or run to its end with `--exit`. A second run resumes and reuses the
//! data.

use std::path::Path;
use std::time::{Duration, Instant};
use tessera_testkit::TesseraProcess;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const LONG_QUERY: usize = 18;

/// Four runs of three consecutive free ports: node RPC, PostgreSQL, HTTP, Flight SQL.
fn port_args() -> Vec<String> {
    let mut bases: Vec<u16> = Vec::new();
    'search: for _ in 0..200 {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = probe.local_addr().unwrap().port();
        drop(probe);
        if base > u16::MAX - 3 || bases.iter().any(|b| b.abs_diff(base) < 3) {
            continue;
        }
        for port in base..base + 3 {
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue 'search;
            }
        }
        bases.push(base);
        if bases.len() == 4 {
            break;
        }
    }
    assert_eq!(bases.len(), 4, "found no free ports");
    [
        "--base-port",
        "--pg-port",
        "--http-port",
        "--flightsql-port",
    ]
    .iter()
    .zip(&bases)
    .flat_map(|(flag, base)| [flag.to_string(), base.to_string()])
    .collect()
}

/// The pids of running processes whose command line names `dir` (the demo's nodes are
/// started with `--config <dir>/node-N/node.toml`).
fn processes_under(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().to_string();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = state
            .rsplit(") ")
            .next()
            .is_some_and(|rest| rest.starts_with('Z'));
        if cmdline.contains(&needle) && !zombie {
            pids.push(pid);
        }
    }
    pids
}

/// Kills whatever is left under the directory when the test ends, passed or not.
struct Sweep<'a>(&'a Path);

impl Drop for Sweep<'_> {
    fn drop(&mut self) {
        for pid in processes_under(self.0) {
            // SAFETY: kill(2) on processes this test's demo started.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

/// Reads the demo's output until a line containing `marker`, returning every line read.
fn read_until(demo: &mut TesseraProcess, marker: &str, timeout: Duration, seen: &mut Vec<String>) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match demo.next_line(Duration::from_millis(200)) {
            Some(line) => {
                let found = line.contains(marker);
                seen.push(line);
                if found {
                    return;
                }
            }
            None => {
                if let Some(status) = demo.exit_status() {
                    panic!(
                        "the demo exited ({status}) before printing {marker:?}; it printed:\n{}",
                        seen.join("\n")
                    );
                }
            }
        }
    }
    panic!(
        "the demo did not print {marker:?} within {timeout:?}; it printed:\n{}",
        seen.join("\n")
    );
}

/// Waits for the demo to exit and checks that it left no process behind.
fn ends_cleanly(mut demo: TesseraProcess, data: &Path, seen: &mut Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = demo.exit_status() {
            break status;
        }
        assert!(Instant::now() < deadline, "the demo did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    seen.extend(demo.drain_lines());
    assert!(
        status.success(),
        "the demo failed ({status}):\n{}",
        seen.join("\n")
    );
    // The demo reaps its nodes before it exits; a node left running would still be here.
    let left = processes_under(data);
    assert!(left.is_empty(), "the demo left processes behind: {left:?}");
}

/// The rows of the first table printed after the line starting with `after`, as the text
/// between its `|` separators.
fn table_after(lines: &[String], after: &str) -> Vec<Vec<String>> {
    let start = lines
        .iter()
        .position(|l| l.starts_with(after))
        .unwrap_or_else(|| panic!("no line starts with {after:?}"));
    lines[start + 1..]
        .iter()
        .skip_while(|l| !l.starts_with('+'))
        .take_while(|l| l.starts_with('+') || l.starts_with('|'))
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|cell| cell.trim().to_string())
                .collect()
        })
        .collect()
}

fn expected_long_query(sf: f64) -> Vec<Vec<String>> {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let batches = runtime.block_on(async {
        let oracle = tessera_tpch::oracle::oracle(sf).unwrap();
        oracle
            .sql(tessera_tpch::query(LONG_QUERY))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap()
    });
    let text = arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    let lines: Vec<String> = std::iter::once("answer:".to_string())
        .chain(text.lines().map(str::to_string))
        .collect();
    table_after(&lines, "answer:")
}

#[test]
fn the_demo_tells_the_whole_story_and_leaves_nothing_running() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("demo");
    let _sweep = Sweep(&data);
    let ports = port_args();
    let args = |extra: &[&str]| -> Vec<String> {
        let mut all = vec!["demo".to_string()];
        all.extend(ports.iter().cloned());
        all.extend(extra.iter().map(|s| s.to_string()));
        all
    };
    let spawn = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        TesseraProcess::spawn(Path::new(BINARY), &data, &args)
    };

    // 1. Interrupted (Ctrl-C) while loading: it stops its nodes and exits.
    let mut demo = spawn(&args(&[]));
    let mut seen = Vec::new();
    read_until(&mut demo, "loaded", Duration::from_secs(120), &mut seen);
    assert!(!processes_under(&data).is_empty(), "the nodes run");
    demo.signal(libc::SIGINT);
    ends_cleanly(demo, &data, &mut seen);
    assert!(
        seen.iter().any(|l| l == "interrupted"),
        "{}",
        seen.join("\n")
    );

    // 2. Run again: it resumes the load, tells the story, and stays up until Ctrl-C.
    let mut demo = spawn(&args(&[]));
    let mut seen = Vec::new();
    read_until(
        &mut demo,
        "Ctrl-C stops it",
        Duration::from_secs(600),
        &mut seen,
    );
    let story = seen.join("\n");
    assert!(
        story.contains("resuming an unfinished load"),
        "the second run reuses what the first loaded:\n{story}"
    );
    // The node killed mid-query: its notice, and the exact answer (plain DataFusion's).
    assert!(
        seen.iter()
            .any(|l| l.starts_with("NOTICE: node ") && l.contains("died during query")),
        "no recovery notice:\n{story}"
    );
    assert!(
        story.contains("identical to the answer before the kill"),
        "{story}"
    );
    assert!(story.contains("the query survived"), "{story}");
    let answer = table_after(&seen, "answer:");
    assert_eq!(
        answer,
        expected_long_query(0.1),
        "Q{LONG_QUERY} after the kill"
    );
    // The write it missed, and a catch-up fetching only that.
    let catch_up = seen
        .iter()
        .find(|l| l.contains(" back in "))
        .unwrap_or_else(|| panic!("no catch-up line:\n{story}"));
    assert!(
        catch_up.contains("fetched only what it missed, 1 row version(s) by delta")
            && !catch_up.contains("whole"),
        "the returning node should fetch the one updated row by delta: {catch_up}"
    );
    assert!(
        catch_up.contains("0 of them while publishes waited"),
        "nothing was published while it caught up, so it fetched it all before the lease: {catch_up}"
    );
    // Time travel: the update's before and after.
    let diff = table_after(&seen, "SELECT change, n_nationkey");
    assert_eq!(diff.len(), 2, "header and one change: {diff:?}");
    assert_eq!(diff[1][0], "update");
    assert_ne!(diff[1][2], diff[1][3], "before and after differ");
    assert!(diff[1][3].starts_with("changed by the demo"), "{diff:?}");
    // The cluster it leaves up answers other clients until Ctrl-C.
    let node = ports[1].parse::<u16>().unwrap();
    let rows = tessera_testkit::sql_csv(
        Path::new(BINARY),
        &data,
        &["--node", &format!("127.0.0.1:{}", node + 1)],
        "SELECT count(*) FROM lineitem",
    );
    assert_eq!(rows, vec![vec!["600572".to_string()]]);
    demo.signal(libc::SIGINT);
    ends_cleanly(demo, &data, &mut seen);

    // 3. A third run reuses everything and, with --exit, stops at the end by itself.
    let mut demo = spawn(&args(&["--exit"]));
    let mut seen = Vec::new();
    read_until(&mut demo, "What next", Duration::from_secs(600), &mut seen);
    ends_cleanly(demo, &data, &mut seen);
    let story = seen.join("\n");
    assert!(story.contains("TPC-H already loaded"), "{story}");
    assert!(
        story.contains("identical to the answer before the kill"),
        "{story}"
    );

    // 4. Another scale factor over the same directory is refused, by name, and stops.
    let output = std::process::Command::new(BINARY)
        .arg("--data-dir")
        .arg(&data)
        .args(args(&["--exit", "--sf", "0.05"]))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("holds TPC-H at another scale") && stderr.contains("SF 0.05"),
        "{stderr}"
    );
    let left = processes_under(&data);
    assert!(
        left.is_empty(),
        "the refused demo left processes behind: {left:?}"
    );
}
