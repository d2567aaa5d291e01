//! Users and logins on a real 3-node cluster: `CREATE USER` through `psql` turns on
//! SCRAM-SHA-256 logins on every node (the user lives in the Raft metadata), through
//! `psql`, psycopg, ADBC (Flight SQL's handshake and bearer token) and the console's
//! HTTP basic authentication. A wrong password and an unknown user are refused alike; a
//! password is never shown; `ALTER USER` changes it; dropping the last user opens the
//! cluster again.

mod common;

use common::{http_get, python_ok, wait_formed, wait_until};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// Runs `psql -c sql` against node `id` as `user` (with `password`, if any); its output
/// or its stderr.
fn psql(
    cluster: &LocalCluster,
    id: u64,
    user: &str,
    password: Option<&str>,
    sql: &str,
) -> Result<String, String> {
    let addr = cluster.pg_addr(id).expect("pg_listen configured");
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut command = Command::new("psql");
    command
        .args(["-X", "-q", "-A", "-t", "-w", "-v", "ON_ERROR_STOP=1"])
        .args([
            "-h", host, "-p", port, "-U", user, "-d", "tessera", "-c", sql,
        ])
        .env_remove("PGPASSWORD");
    if let Some(password) = password {
        command.env("PGPASSWORD", password);
    }
    let output = command
        .output()
        .expect("psql is installed (apt: postgresql-client)");
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).to_string())
    }
}

/// Waits until node `id` asks for a password (`required`) or takes anyone (`!required`).
async fn wait_login_required(cluster: &LocalCluster, id: u64, required: bool) {
    let what = format!("node {id} to require a login: {required}");
    wait_until(&what, Duration::from_secs(20), || async {
        let open = psql(cluster, id, "tessera", None, "SELECT 1").is_ok();
        (open != required).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_log_in_with_scram_everywhere_and_passwords_stay_secret() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.log_to_files();
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;

    // A new cluster takes anyone, as PostgreSQL's trust does.
    assert_eq!(psql(&cluster, 2, "tessera", None, "SELECT 1").unwrap(), "1");
    psql(
        &cluster,
        1,
        "tessera",
        None,
        "CREATE USER ada WITH PASSWORD 'pencil'",
    )
    .unwrap();
    for node in 1..=3 {
        wait_login_required(&cluster, node, true).await;
    }

    let no_password = psql(&cluster, 3, "ada", None, "SELECT 1").unwrap_err();
    assert!(
        no_password.contains("no password supplied"),
        "{no_password}"
    );
    let wrong = psql(&cluster, 3, "ada", Some("pen"), "SELECT 1").unwrap_err();
    assert!(
        wrong.contains("password authentication failed for user \"ada\""),
        "{wrong}"
    );
    let unknown = psql(&cluster, 3, "bob", Some("pencil"), "SELECT 1").unwrap_err();
    assert!(
        unknown.contains("password authentication failed for user \"bob\""),
        "an unknown user fails as a wrong password does: {unknown}"
    );
    for node in 1..=3 {
        let answer = psql(&cluster, node, "ada", Some("pencil"), "SELECT 40 + 2").unwrap();
        assert_eq!(answer, "42", "ada logs in on node {node}");
    }
    let again = psql(
        &cluster,
        2,
        "ada",
        Some("pencil"),
        "CREATE USER ada WITH PASSWORD 'x'",
    )
    .unwrap_err();
    assert!(again.contains("user \"ada\" already exists"), "{again}");

    // psycopg (libpq's SCRAM) and ADBC (Flight SQL's handshake, then a bearer token).
    let pg = cluster.pg_addr(2).unwrap();
    let (host, port) = pg.rsplit_once(':').unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/logins.py");
    let uri = format!("grpc://{}", cluster.flightsql_addr(3).unwrap());
    let script = script.display().to_string();
    if let Err(output) = python_ok(&[&script, host, port, &uri]).await {
        panic!("the psycopg and ADBC logins failed:\n{output}");
    }

    // The console asks for a login too; metrics stay open to Prometheus.
    let (code, _) = http_get(&cluster, 1, "/api/status", None).await;
    assert_eq!(code, 401, "the console's JSON without a login");
    let (code, _) = http_get(&cluster, 1, "/api/status", Some("ada:nope")).await;
    assert_eq!(code, 401, "the console's JSON with a wrong password");
    let (code, status) = http_get(&cluster, 1, "/api/status", Some("ada:pencil")).await;
    assert_eq!(code, 200);
    assert!(
        status.contains("CREATE USER ada WITH PASSWORD '***'"),
        "the statement is shown, masked: {status}"
    );
    let (code, _) = http_get(&cluster, 1, "/metrics", None).await;
    assert_eq!(code, 200, "metrics need no login");
    // The password is nowhere a person could read it.
    for node in 1..=3 {
        let (_, status) = http_get(&cluster, node, "/api/status", Some("ada:pencil")).await;
        assert!(!status.contains("pencil"), "node {node} shows the password");
        let log = std::fs::read_to_string(cluster.log_path(node)).unwrap_or_default();
        assert!(
            !log.contains("pencil"),
            "node {node}'s log holds the password"
        );
    }

    psql(
        &cluster,
        1,
        "ada",
        Some("pencil"),
        "ALTER USER ada WITH PASSWORD 'crayon'",
    )
    .unwrap();
    wait_until(
        "the new password on node 2",
        Duration::from_secs(20),
        || async { psql(&cluster, 2, "ada", Some("crayon"), "SELECT 1").ok() },
    )
    .await;
    let old = psql(&cluster, 2, "ada", Some("pencil"), "SELECT 1").unwrap_err();
    assert!(old.contains("password authentication failed"), "{old}");

    // Dropping the last user opens the cluster again.
    psql(&cluster, 3, "ada", Some("crayon"), "DROP USER ada").unwrap();
    for node in 1..=3 {
        wait_login_required(&cluster, node, false).await;
    }
    let gone = psql(&cluster, 1, "tessera", None, "DROP USER ada").unwrap_err();
    assert!(gone.contains("user \"ada\" does not exist"), "{gone}");
    psql(&cluster, 1, "tessera", None, "DROP USER IF EXISTS ada").unwrap();
}
