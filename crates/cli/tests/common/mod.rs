//! Helpers shared by the multi-process cluster tests.
#![allow(dead_code)]

pub mod history;

use arrow::array::{RecordBatch, StringArray};
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

/// Makes this test binary's panics print their message and place on one line, without a
/// backtrace. A failing multi-node test's output ends with its panic, but a backtrace
/// (CI sets `RUST_BACKTRACE`) pushes the message itself out of a log's tail, where a
/// failure report is cut. Its own stderr lines (the nodes') stay above it.
pub fn short_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            let thread = std::thread::current();
            eprintln!(
                "thread '{}' panicked: {info}",
                thread.name().unwrap_or("<unnamed>")
            );
        }))
    });
}

/// Polls `check` every 100 ms until it returns a value; panics after `timeout`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until node `via` sees a leader and exactly `alive` live nodes.
pub async fn wait_formed(cluster: &LocalCluster, via: u64, alive: usize) {
    let client = ClusterClient::new(cluster.addr(via));
    wait_until("the cluster to form", Duration::from_secs(60), || async {
        let status = client.status().await.ok()?;
        (status.leader.is_some() && status.meta.live_nodes().count() == alive).then_some(())
    })
    .await
}

/// SIGKILLs node `id` and waits until the cluster (asked through `client`) declares it
/// failed.
pub async fn kill_node(cluster: &mut LocalCluster, client: &ClusterClient, id: u64) {
    cluster.kill9(id);
    wait_until(
        &format!("node {id} declared failed"),
        Duration::from_secs(30),
        || async {
            client
                .status()
                .await
                .ok()
                .filter(|s| s.meta.nodes.values().any(|n| n.id.0 == id && !n.alive))
        },
    )
    .await;
}

/// Starts node `id` again and waits until every node is live and no partition is stale
/// anywhere; the status then.
pub async fn restart_node(
    cluster: &mut LocalCluster,
    client: &ClusterClient,
    id: u64,
) -> tessera_server::server::NodeStatus {
    cluster.start(id);
    wait_formed(cluster, 1, cluster.node_ids().len()).await;
    wait_until(
        &format!("node {id} caught up"),
        Duration::from_secs(120),
        || async {
            client
                .status()
                .await
                .ok()
                .filter(|s| s.meta.map.partitions.iter().all(|p| p.stale.is_empty()))
        },
    )
    .await
}

/// Creates and publishes the TPC-H tables, each through a different coordinator.
pub async fn load_tpch(cluster: &LocalCluster, sf: f64) {
    load_tpch_tables(cluster, sf, &[]).await;
}

/// As [`load_tpch`], only the tables named (all if none); returns the rows loaded per table.
pub async fn load_tpch_tables(
    cluster: &LocalCluster,
    sf: f64,
    only: &[&str],
) -> std::collections::HashMap<&'static str, usize> {
    let ids = cluster.node_ids();
    let mut loaded = std::collections::HashMap::new();
    let tables = tessera_tpch::TABLES
        .iter()
        .filter(|t| only.is_empty() || only.contains(&t.name));
    for (i, table) in tables.enumerate() {
        let ddl = ClusterClient::new(cluster.addr(ids[i % ids.len()]));
        ddl.sql(&tessera_tpch::create_table_sql(table))
            .await
            .unwrap();
        let coordinator = ClusterClient::new(cluster.addr(ids[(i + 1) % ids.len()]));
        let batches: Vec<RecordBatch> = table
            .generate(sf, 64 * 1024)
            .collect::<Result<_, _>>()
            .unwrap();
        loaded.insert(table.name, batches.iter().map(|b| b.num_rows()).sum());
        coordinator
            .publish(table.name, batches, false)
            .await
            .unwrap();
    }
    loaded
}

/// Flushes every node and ships the components to the standbys, so each replica holds
/// the same components as its primary.
pub async fn flush_everywhere(cluster: &LocalCluster) {
    for id in cluster.node_ids() {
        ClusterClient::new(cluster.addr(id)).flush().await.unwrap();
    }
}

/// A 3-node cluster of `binary` under `root` with table `kv`, each node configured with
/// `options` (dotted key, value); the client talks to node 1.
pub async fn kv_cluster_with(
    binary: &str,
    root: &Path,
    partitions: u32,
    replication: u32,
    options: &[(&str, &str)],
) -> (LocalCluster, ClusterClient) {
    let cluster = LocalCluster::configure(Path::new(binary), root, 3, partitions, replication);
    start_kv(cluster, options).await
}

/// Starts every node of `cluster`, each configured with `options` (dotted key, value), and
/// creates table `kv`; the client talks to node 1.
pub async fn start_kv(
    mut cluster: LocalCluster,
    options: &[(&str, &str)],
) -> (LocalCluster, ClusterClient) {
    for (key, value) in options {
        cluster.set_option(key, value);
    }
    cluster.start_all();
    wait_formed(&cluster, 1, cluster.node_ids().len()).await;
    let client = ClusterClient::new(cluster.addr(1));
    client
        .sql("CREATE TABLE kv (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
        .await
        .unwrap();
    (cluster, client)
}

/// A GET of `path` on node `id`'s HTTP port, with basic credentials if given: the status
/// code and body.
pub async fn http_get(
    cluster: &LocalCluster,
    id: u64,
    path: &str,
    credentials: Option<&str>,
) -> (u16, String) {
    use base64::Engine;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = cluster.http_addr(id).expect("http_listen configured");
    let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let authorization = credentials
        .map(|c| {
            let encoded = base64::engine::general_purpose::STANDARD.encode(c);
            format!("Authorization: Basic {encoded}\r\n")
        })
        .unwrap_or_default();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let code = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// The value of metric `name` (without labels) in node `id`'s `/metrics`.
pub async fn metric(cluster: &LocalCluster, id: u64, name: &str) -> Option<f64> {
    let (code, body) = http_get(cluster, id, "/metrics", None).await;
    assert_eq!(code, 200, "node {id}'s /metrics");
    body.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok())?
    })
}

/// A Python client that asks Flight SQL at `sys.argv[1]` for 41 + 1 through ADBC.
pub const ADBC_SELECT_42: &str = "import sys, adbc_driver_flightsql.dbapi as f\n\
    c = f.connect(sys.argv[1]).cursor(); c.execute('SELECT 41 + 1 AS x')\n\
    assert c.fetchone() == (42,); print('ok')";

/// Runs `python3 args...`: `Ok` if it printed just "ok", else what it printed.
pub async fn python_ok(args: &[&str]) -> Result<(), String> {
    program_ok("python3", args).await
}

/// A JVM client's jar in the local Maven repository, where `.ci/run` fetches it
/// (`mvn dependency:get -Dartifact=GROUP:ARTIFACT:VERSION`).
pub fn maven_jar(group: &str, artifact: &str, version: &str) -> std::path::PathBuf {
    let home = std::env::var_os("HOME").expect("HOME is set");
    let jar = std::path::Path::new(&home)
        .join(".m2/repository")
        .join(group.replace('.', "/"))
        .join(artifact)
        .join(version)
        .join(format!("{artifact}-{version}.jar"));
    assert!(
        jar.exists(),
        "{} is missing (mvn dependency:get -Dartifact={group}:{artifact}:{version})",
        jar.display()
    );
    jar
}

/// Runs a single-file Java program of `tests/clients` (source-file mode) with `jar` on its
/// class path: Ok when it exits 0 printing "ok", else what it printed.
pub async fn java_ok(
    jar: &std::path::Path,
    program: &str,
    jvm_args: &[&str],
    args: &[&str],
) -> Result<(), String> {
    let program = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients")
        .join(program);
    let mut all: Vec<String> = jvm_args.iter().map(|a| a.to_string()).collect();
    all.extend(["-cp".into(), jar.display().to_string()]);
    all.push(program.display().to_string());
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    program_ok("java", &all).await
}

/// Runs `command`: Ok when it exits 0 printing "ok", else what it printed.
async fn program_ok(command: &str, args: &[&str]) -> Result<(), String> {
    let output = tokio::process::Command::new(command)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{command} runs: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    if output.status.success() && stdout.trim() == "ok" {
        Ok(())
    } else {
        Err(format!(
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// Runs the `tessera` binary with `--node` (node 1 of `cluster`) and `args`: whether it
/// succeeded, and its standard output followed by its standard error.
pub fn tessera_at_node_1<S: AsRef<std::ffi::OsStr>>(
    binary: &str,
    cluster: &LocalCluster,
    args: impl IntoIterator<Item = S>,
) -> (bool, String) {
    let output = std::process::Command::new(binary)
        .args(["--node", cluster.addr(1)])
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// Flips one bit in the middle of a file: damage a hash check must find.
pub fn flip_a_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(path, bytes).unwrap();
}

/// A random change to table `kv (k BIGINT PRIMARY KEY, v BIGINT)`, as SQL, applied to its
/// model `rows`: half the time an insert of `inserted` new keys (from `next_key` on), else
/// an update or a delete of the keys in a random residue class.
pub fn random_kv_change(
    rng: &mut rand::rngs::StdRng,
    inserted: std::ops::Range<usize>,
    next_key: &mut i64,
    rows: &mut std::collections::BTreeMap<i64, i64>,
) -> String {
    use rand::Rng;
    match rng.random_range(0..10) {
        0..=4 => {
            let values: Vec<String> = (0..rng.random_range(inserted))
                .map(|_| {
                    let (k, v) = (*next_key, rng.random_range(0..1000));
                    *next_key += 1;
                    rows.insert(k, v);
                    format!("({k}, {v})")
                })
                .collect();
            format!("INSERT INTO kv VALUES {}", values.join(", "))
        }
        5..=7 => {
            let (m, r, d) = (
                rng.random_range(2..5),
                rng.random_range(0..2),
                rng.random_range(1..50),
            );
            for (k, v) in rows.iter_mut() {
                if k % m == r {
                    *v += d;
                }
            }
            format!("UPDATE kv SET v = v + {d} WHERE k % {m} = {r}")
        }
        _ => {
            let (m, r) = (rng.random_range(3..7), rng.random_range(0..3));
            rows.retain(|k, _| k % m != r);
            format!("DELETE FROM kv WHERE k % {m} = {r}")
        }
    }
}

/// The text of the `plan_type` row (`distributed_plan`, `Plan with Metrics`) of an
/// `EXPLAIN [ANALYZE]` statement's answer.
pub async fn plan_text(client: &ClusterClient, sql: &str, plan_type: &str) -> String {
    let batches = client.query(sql).await.unwrap();
    for batch in &batches {
        let types = batch
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        let plans = batch
            .column(1)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        for i in 0..batch.num_rows() {
            if types.value(i) == plan_type {
                return plans.value(i).to_string();
            }
        }
    }
    panic!("{sql} returned no {plan_type:?} row");
}

/// The number after `label` in an `EXPLAIN ANALYZE` text (`bytes exchanged`, `bytes
/// spilled`).
pub fn reported(text: &str, label: &str) -> u64 {
    let rest = text
        .split(label)
        .nth(1)
        .unwrap_or_else(|| panic!("no {label:?} in:\n{text}"));
    rest.trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap()
}
