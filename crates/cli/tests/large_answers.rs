//! Answers larger than one message on the cluster port (gRPC's 256 MiB limit) stream to
//! the client batch by batch: the cluster client reads a 300 MiB answer whole, and
//! `COPY ... TO` through the CLI writes a 1 GiB answer to a file as it arrives, its process never
//! holding the answer. An error after rows were sent fails the statement: no partial
//! answer, no file, and the node serves on.

use std::path::Path;
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

mod common;
use common::wait_formed;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// 300 rows of 1 MiB each: 300 MiB, beyond the largest message the cluster port takes.
const BIG: &str = "SELECT value AS i, repeat('x', 1048576) AS s FROM generate_series(1, 300)";
const BIG_ROWS: usize = 300;
const ROW_BYTES: usize = 1 << 20;

/// 16,384 rows of 64 KiB each: 1 GiB, exported (in two batches on the node).
const HUGE: &str = "SELECT value AS i, repeat('x', 65536) AS s FROM generate_series(1, 16384)";
const HUGE_ROWS: usize = 16384;
const HUGE_BYTES: usize = 1 << 30;

/// What a CLI run left: whether it succeeded, how many bytes it printed, the first 64 KiB
/// of them, its standard error, and its peak resident memory in bytes.
struct CliRun {
    succeeded: bool,
    printed: u64,
    said: String,
    errors: String,
    peak: u64,
}

/// Runs the CLI against `addr` and waits for it; its peak resident memory is its own
/// high-water mark (`VmHWM`) read while it runs. (Not `getrusage`: Linux counts there the
/// memory of the process that spawned it, this test's, from before its `exec`.)
fn cli_with_peak_memory(addr: &str, args: &[&str]) -> CliRun {
    let out = tempfile::tempdir().unwrap();
    let (stdout, stderr) = (out.path().join("stdout"), out.path().join("stderr"));
    let mut child = std::process::Command::new(BINARY)
        .arg("--node")
        .arg(addr)
        .args(args)
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kb = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the CLI ran 10 minutes"
        );
        let high_water = std::fs::read_to_string(&status_file).ok().and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        });
        peak_kb = peak_kb.max(high_water.unwrap_or(0));
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let mut said = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::open(&stdout).unwrap(), 64 << 10),
        &mut said,
    )
    .unwrap();
    CliRun {
        succeeded: status.success(),
        printed: std::fs::metadata(&stdout).unwrap().len(),
        said: String::from_utf8_lossy(&said).into_owned(),
        errors: std::fs::read_to_string(&stderr).unwrap(),
        peak: peak_kb * 1024,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_beyond_one_message_stream_to_clients_and_exports() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 1, 4, 1);
    cluster.start_all();
    wait_formed(&cluster, 1, 1).await;
    let client = ClusterClient::new(cluster.addr(1));

    // The cluster client reads the whole answer, which no single message could carry.
    let batches = client.query(BIG).await.expect("a 300 MiB answer");
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, BIG_ROWS);
    let bytes: usize = batches
        .iter()
        .map(|b| {
            let s = b.column(1).as_any();
            match s.downcast_ref::<arrow::array::StringArray>() {
                Some(s) => s.iter().map(|v| v.unwrap().len()).sum::<usize>(),
                None => {
                    let s = s
                        .downcast_ref::<arrow::array::StringViewArray>()
                        .expect("strings");
                    s.iter().map(|v| v.unwrap().len()).sum()
                }
            }
        })
        .sum();
    assert_eq!(bytes, BIG_ROWS * ROW_BYTES);
    drop(batches);

    // An export writes the rows as they come: the CLI never holds the answer.
    let csv = root.path().join("big.csv");
    let copy = format!("COPY ({HUGE}) TO '{}'", csv.display());
    let CliRun {
        succeeded,
        said,
        errors,
        peak,
        ..
    } = cli_with_peak_memory(cluster.addr(1), &["sql", "-c", &copy]);
    assert!(succeeded, "{said}{errors}");
    assert!(said.contains(&format!("COPY {HUGE_ROWS}")), "{said}");
    let written = std::fs::metadata(&csv).unwrap().len() as usize;
    assert!(written > HUGE_BYTES, "{written} bytes in {}", csv.display());
    assert!(
        peak < (HUGE_BYTES / 2) as u64,
        "the CLI's peak memory during the export was {} MiB, for a {} MiB answer",
        peak >> 20,
        HUGE_BYTES >> 20
    );
    eprintln!(
        "exported {} MiB; the CLI's peak memory was {} MiB",
        HUGE_BYTES >> 20,
        peak >> 20
    );
    std::fs::remove_file(&csv).unwrap();

    // Printed as CSV, the rows go to standard output as they arrive.
    let printed = cli_with_peak_memory(cluster.addr(1), &["sql", "--format", "csv", "-c", HUGE]);
    assert!(printed.succeeded, "{}", printed.errors);
    assert!(
        printed.said.starts_with("i,s\n1,xxx"),
        "{:.40}",
        printed.said
    );
    assert!(
        printed.printed as usize > HUGE_BYTES,
        "{} bytes printed",
        printed.printed
    );
    assert!(
        printed.peak < (HUGE_BYTES / 2) as u64,
        "the CLI's peak memory printing the answer was {} MiB, for a {} MiB answer",
        printed.peak >> 20,
        HUGE_BYTES >> 20
    );
    eprintln!(
        "printed {} MiB as CSV; the CLI's peak memory was {} MiB",
        printed.printed >> 20,
        printed.peak >> 20
    );

    // An error after rows were sent fails the statement, whatever had arrived.
    let failing = "SELECT 10 / (value - 200000) AS q FROM generate_series(1, 300000)";
    let error = client.query(failing).await.unwrap_err().to_string();
    assert!(error.to_lowercase().contains("divide by zero"), "{error}");
    let partial_csv = root.path().join("failing.csv");
    let copy = format!("COPY ({failing}) TO '{}'", partial_csv.display());
    let failed = cli_with_peak_memory(cluster.addr(1), &["sql", "-c", &copy]);
    assert!(!failed.succeeded);
    assert!(
        failed.errors.to_lowercase().contains("divide by zero"),
        "{}",
        failed.errors
    );
    assert!(!partial_csv.exists(), "an export that failed left its file");
    assert!(
        !root.path().join("failing.csv.partial").exists(),
        "an export that failed left its partial file"
    );

    // The node serves on.
    let after = client
        .query("SELECT count(*) FROM generate_series(1, 10)")
        .await
        .unwrap();
    assert_eq!(after[0].num_rows(), 1);
}
