//! Participants and table ownership on a real 3-node cluster under mutual TLS. Two
//! organizations, lab_a and lab_b, each with a user; lab_a's user creates a table, so
//! lab_a owns it. lab_b's user may read it, but each of its publishes, through psql
//! (INSERT and COPY FROM STDIN), psycopg, Flight SQL (ADBC) and the CLI (`tessera --as bob
//! sql` and `tessera --as bob publish`), is refused naming the owner, and leaves no epoch.
//! Then lab_a hands the table over (`ALTER TABLE ... OWNER TO lab_b`) while its user
//! publishes in a loop: every publish either committed under lab_a before the hand-over
//! or was refused, none lost or half-visible, and lab_b's user publishes at once. The
//! epoch log and the audit log say who did what.

mod common;

use common::{python_ok, wait_formed};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use tessera_common::tls::MutualTls;
use tessera_server::ClusterClient;
use tessera_testkit::{make_certs, tessera_certs, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// Runs `psql -c sql` against node `id` as `user`, with `stdin` as its input (for COPY);
/// its output, or its stderr (in verbose form: with the SQLSTATE).
fn psql(
    cluster: &LocalCluster,
    id: u64,
    user: &str,
    sql: &str,
    stdin: Option<&str>,
) -> Result<String, String> {
    let addr = cluster.pg_addr(id).expect("pg_listen configured");
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut child = Command::new("psql")
        .args(["-X", "-q", "-A", "-t", "-w", "-v", "ON_ERROR_STOP=1"])
        .args(["-v", "VERBOSITY=verbose"])
        .args([
            "-h", host, "-p", port, "-U", user, "-d", "tessera", "-c", sql,
        ])
        .env("PGPASSWORD", password(user))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psql is installed (apt: postgresql-client)");
    let mut input = child.stdin.take().unwrap();
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    drop(input);
    let output = child.wait_with_output().unwrap();
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).to_string())
    }
}

fn password(user: &str) -> String {
    format!("{user}-secret")
}

/// Runs the CLI against node 1 as `user` (its client certificate in `certs`).
fn cli(cluster: &LocalCluster, certs: &Path, user: &str, args: &[&str]) -> Result<String, String> {
    let output = Command::new(BINARY)
        .args(["--node", cluster.addr(1), "--certs"])
        .arg(certs)
        .args(["--as", user])
        .args(args)
        .output()
        .unwrap();
    match output.status.success() {
        true => Ok(String::from_utf8_lossy(&output.stdout).to_string()),
        false => Err(String::from_utf8_lossy(&output.stderr).to_string()),
    }
}

/// The single value a one-row, one-column query answers, as text.
async fn scalar(client: &ClusterClient, sql: &str) -> String {
    let batches = client.query(sql).await.unwrap();
    let column = batches[0].column(0);
    arrow::util::display::array_value_to_string(column, 0).unwrap()
}

/// The ids in table `readings`.
async fn ids(client: &ClusterClient) -> BTreeSet<i64> {
    let batches = client.query("SELECT id FROM readings").await.unwrap();
    batches
        .iter()
        .flat_map(|b| {
            let ids = b
                .column(0)
                .as_any()
                .downcast_ref::<arrow::array::Int64Array>()
                .unwrap();
            ids.values().to_vec()
        })
        .collect()
}

fn assert_denied(error: &str, how: &str) {
    assert!(
        error.contains("permission denied") && error.contains("participant lab_a owns it"),
        "{how}: expected a refusal naming the owner, got: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owners_users_publish_and_a_hand_over_moves_the_right_exactly() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(Path::new(BINARY), &certs, &[1, 2, 3]);
    for user in ["ada", "bob"] {
        tessera_certs(Path::new(BINARY), &certs, &["client", "--name", user]);
    }
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.use_mtls(&certs);
    cluster.log_to_files();
    cluster.start_all();
    let admin_tls = MutualTls::from_dir(&certs, "admin").unwrap();
    tessera_server::client::set_default_tls(Some(admin_tls));
    wait_formed(&cluster, 1, 3).await;
    let admin = ClusterClient::new(cluster.addr(1));

    // The operator (the administrator's certificate) sets up the two organizations.
    for sql in [
        "CREATE PARTICIPANT lab_a".to_string(),
        "CREATE PARTICIPANT lab_b".to_string(),
        format!(
            "CREATE USER ada WITH PASSWORD '{}' IN PARTICIPANT lab_a",
            password("ada")
        ),
        "GRANT admin TO ada".to_string(),
        format!(
            "CREATE USER bob WITH PASSWORD '{}' IN PARTICIPANT lab_b",
            password("bob")
        ),
        "GRANT writer TO bob".to_string(),
    ] {
        admin
            .sql(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    // ada creates a table through psql: lab_a owns it.
    psql(
        &cluster,
        2,
        "ada",
        "CREATE TABLE readings (id BIGINT PRIMARY KEY, v BIGINT)",
        None,
    )
    .unwrap();
    psql(
        &cluster,
        2,
        "ada",
        "INSERT INTO readings VALUES (1, 10)",
        None,
    )
    .unwrap();
    assert_eq!(
        scalar(
            &admin,
            "SELECT owner FROM tessera_tables WHERE name = 'readings'"
        )
        .await,
        "lab_a"
    );
    let epochs_before = scalar(&admin, "SELECT count(*) FROM tessera_epochs").await;

    // bob may read, through every client; none of his publishes goes through.
    assert_eq!(
        psql(&cluster, 3, "bob", "SELECT v FROM readings", None).unwrap(),
        "10"
    );
    let insert = psql(
        &cluster,
        3,
        "bob",
        "INSERT INTO readings VALUES (2, 20)",
        None,
    )
    .unwrap_err();
    assert_denied(&insert, "psql INSERT");
    assert!(
        insert.contains("42501"),
        "the SQLSTATE is insufficient_privilege: {insert}"
    );
    let copy = psql(
        &cluster,
        1,
        "bob",
        "COPY readings FROM STDIN",
        Some("3\t30\n"),
    )
    .unwrap_err();
    assert_denied(&copy, "psql COPY FROM STDIN");
    let pg = cluster.pg_addr(2).unwrap();
    let (host, port) = pg.rsplit_once(':').unwrap();
    let uri = format!("grpc://{}", cluster.flightsql_addr(3).unwrap());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/ownership.py");
    let script = script.display().to_string();
    let bob_password = password("bob");
    if let Err(output) = python_ok(&[&script, host, port, &uri, "bob", &bob_password]).await {
        panic!("psycopg and ADBC as a non-owner:\n{output}");
    }
    let sql = cli(
        &cluster,
        &certs,
        "bob",
        &["sql", "-c", "INSERT INTO readings VALUES (4, 40)"],
    )
    .unwrap_err();
    assert_denied(&sql, "tessera --as bob sql");
    let csv = root.path().join("rows.csv");
    std::fs::write(&csv, "id,v\n5,50\n").unwrap();
    let publish = cli(
        &cluster,
        &certs,
        "bob",
        &["publish", "--table", "readings", csv.to_str().unwrap()],
    )
    .unwrap_err();
    assert_denied(&publish, "tessera --as bob publish");
    let read = cli(
        &cluster,
        &certs,
        "bob",
        &["sql", "-c", "SELECT count(*) FROM readings"],
    )
    .unwrap();
    assert!(read.contains('1'), "bob reads through the CLI: {read}");
    assert_eq!(
        scalar(&admin, "SELECT count(*) FROM tessera_epochs").await,
        epochs_before,
        "a refused publish leaves no epoch"
    );
    assert_eq!(ids(&admin).await, BTreeSet::from([1]));

    // ada publishes in a loop (through the CLI's port, as herself) while she hands the
    // table over to lab_b.
    let ada_tls = MutualTls::from_dir(&certs, "ada").unwrap();
    let ada = ClusterClient::with_tls(cluster.addr(1), Some(&ada_tls));
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    let writer = tokio::spawn(async move {
        let mut acknowledged = BTreeSet::new();
        let mut refused = Vec::new();
        for id in 100i64.. {
            if *stop.borrow_and_update() {
                break;
            }
            match ada
                .sql(&format!("INSERT INTO readings VALUES ({id}, {id})"))
                .await
            {
                Ok(_) => {
                    acknowledged.insert(id);
                }
                Err(error) => refused.push((id, error.to_string())),
            }
        }
        (acknowledged, refused)
    });
    // Let some of ada's publishes commit first.
    common::wait_until("ada's first publishes", Duration::from_secs(30), || async {
        (ids(&admin).await.len() > 5).then_some(())
    })
    .await;
    psql(
        &cluster,
        1,
        "ada",
        "ALTER TABLE readings OWNER TO lab_b",
        None,
    )
    .unwrap();
    // The new owner publishes at once: the lease moved with the ownership.
    psql(
        &cluster,
        2,
        "bob",
        "INSERT INTO readings VALUES (7, 70)",
        None,
    )
    .expect("the new owner's first publish");
    // ada goes on trying for a while; every try now is refused.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop_tx.send(true).unwrap();
    let (acknowledged, refused) = writer.await.unwrap();
    println!(
        "ada's publishes: {} acknowledged, {} refused",
        acknowledged.len(),
        refused.len()
    );
    assert!(!acknowledged.is_empty() && !refused.is_empty());
    for (id, error) in &refused {
        assert!(
            error.contains("permission denied") || error.contains("handed over"),
            "ada's publish of {id} failed for another reason: {error}"
        );
    }
    // Nothing lost, nothing half-visible, on every node.
    let mut expected: BTreeSet<i64> = acknowledged.clone();
    expected.extend([1, 7]);
    for node in 1..=3 {
        let client = ClusterClient::new(cluster.addr(node));
        assert_eq!(ids(&client).await, expected, "the rows through node {node}");
    }
    // The epoch log: every acknowledged publish is ada's, for lab_a, and before bob's.
    let publishes = admin
        .query(
            "SELECT publisher, participant, epoch FROM tessera_epochs \
             WHERE kind = 'publish' AND tables = 'readings' ORDER BY epoch",
        )
        .await
        .unwrap();
    let rows = arrow::util::pretty::pretty_format_batches(&publishes)
        .unwrap()
        .to_string();
    let by_ada = rows.matches("| ada       | lab_a ").count();
    assert_eq!(
        by_ada,
        acknowledged.len() + 1,
        "one epoch per acknowledged publish of ada's (and her first row):\n{rows}"
    );
    let last_line = rows.lines().rev().nth(1).unwrap();
    assert!(
        last_line.contains("bob") && last_line.contains("lab_b"),
        "bob's publish is the last: {rows}"
    );
    let audit = admin
        .query("SELECT \"user\", kind, detail FROM tessera_audit WHERE kind = 'hand over'")
        .await
        .unwrap();
    let audit = arrow::util::pretty::pretty_format_batches(&audit)
        .unwrap()
        .to_string();
    assert!(
        audit.contains("ada") && audit.contains("from participant lab_a to participant lab_b"),
        "{audit}"
    );
    drop(cluster);
}
