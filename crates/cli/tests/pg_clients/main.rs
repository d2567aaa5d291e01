//! Real PostgreSQL clients against a real 3-node cluster: `psql` (the binary, as a user
//! runs it) and `tokio-postgres` (a driver speaking the extended protocol: prepared
//! statements, binary parameters and results). Every TPC-H query answers through `psql`
//! exactly as plain DataFusion does; transactions publish one epoch or nothing; settings
//! belong to one connection; errors carry their SQLSTATE; no update is lost.

use std::path::Path;
use std::process::Command;
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

#[path = "../common/mod.rs"]
mod common;
use common::{load_tpch, metric, wait_formed, wait_until};

/// Answers that stream, and statements stopped by a cancel.
mod streaming;
/// Sessions on different nodes updating the same rows.
mod write_conflicts;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const PARTITIONS: u32 = 8;
const SF: f64 = 0.02;

/// Clusters run one at a time on a 2-core machine.
static ONE_CLUSTER_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    ONE_CLUSTER_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn cluster(root: &Path) -> LocalCluster {
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root, 3, PARTITIONS, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    cluster
}

/// Runs `psql` against node `id`: its rows (unaligned, fields split on the unit
/// separator, NULL as `None`), or its stderr as the error.
fn psql(
    cluster: &LocalCluster,
    id: u64,
    args: &[&str],
) -> Result<(Vec<Vec<Option<String>>>, String), String> {
    let addr = cluster.pg_addr(id).expect("pg_listen configured");
    let (host, port) = addr.rsplit_once(':').unwrap();
    let output = Command::new("psql")
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-F",
            "\x1f",
            "-P",
            "null=\x1e",
            "-v",
            "ON_ERROR_STOP=1",
        ])
        .args(["-h", host, "-p", port, "-U", "tessera", "-d", "tessera"])
        .args(args)
        .output()
        .expect("psql is installed (apt: postgresql-client)");
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    if !output.status.success() {
        return Err(stderr);
    }
    let rows = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            line.split('\x1f')
                .map(|cell| (cell != "\x1e").then(|| cell.to_string()))
                .collect()
        })
        .collect();
    Ok((rows, stderr))
}

/// [`psql`] with `input` on its standard input (the rows of a `COPY ... FROM STDIN`).
fn psql_with_input(
    cluster: &LocalCluster,
    id: u64,
    command: &str,
    input: &str,
) -> Result<String, String> {
    use std::io::Write;
    let addr = cluster.pg_addr(id).expect("pg_listen configured");
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut child = Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .args(["-h", host, "-p", port, "-U", "tessera", "-d", "tessera"])
        .args(["-c", command])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psql is installed (apt: postgresql-client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    if !output.status.success() {
        return Err(stderr);
    }
    Ok(String::from_utf8_lossy(&output.stdout).to_string())
}

/// The libpq connection string for node `id`'s PostgreSQL endpoint.
fn conninfo(cluster: &LocalCluster, id: u64) -> String {
    let addr = cluster.pg_addr(id).expect("pg_listen configured");
    let (host, port) = addr.rsplit_once(':').unwrap();
    format!("host={host} port={port} user=tessera dbname=tessera")
}

async fn connect(cluster: &LocalCluster, id: u64) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&conninfo(cluster, id), NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to node {id}: {e}"));
    tokio::spawn(connection);
    client
}

async fn visible_epoch(cluster: &LocalCluster) -> u64 {
    ClusterClient::new(cluster.addr(1))
        .status()
        .await
        .unwrap()
        .meta
        .visible
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_answers_every_tpch_query_exactly_and_describes_tables() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let cluster = cluster(root.path()).await;
    load_tpch(&cluster, SF).await;
    let oracle = tessera_tpch::oracle::oracle(SF).unwrap();
    let mut failures = Vec::new();
    for q in 1..=22 {
        let sql = tessera_tpch::query(q);
        let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
        let id = 1 + (q as u64 % 3);
        match psql(&cluster, id, &["-c", sql]) {
            Ok((rows, _)) => {
                if let Err(diff) = tessera_tpch::compare::same_text_answer(&expected, &rows, 1e-9) {
                    failures.push(format!("Q{q} on node {id}: {diff}"));
                }
            }
            Err(error) => failures.push(format!("Q{q} on node {id} failed: {error}")),
        }
    }
    assert!(
        failures.is_empty(),
        "answers differ:\n{}",
        failures.join("\n")
    );

    // psql's own catalog queries: \dt lists the tables, \d describes one.
    let (tables, _) = psql(&cluster, 2, &["-c", "\\dt"]).unwrap();
    let names: Vec<&str> = tables
        .iter()
        .filter_map(|row| row.get(1).and_then(|c| c.as_deref()))
        .collect();
    for table in [
        "customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier",
    ] {
        assert!(names.contains(&table), "\\dt lists {table}: {tables:?}");
    }
    let (columns, _) = psql(&cluster, 3, &["-c", "\\d lineitem"]).unwrap();
    let column_names: Vec<&str> = columns
        .iter()
        .filter_map(|row| row.first().and_then(|c| c.as_deref()))
        .collect();
    for column in [
        "l_orderkey",
        "l_linenumber",
        "l_extendedprice",
        "l_shipdate",
    ] {
        assert!(
            column_names.contains(&column),
            "\\d lineitem shows {column}: {columns:?}"
        );
    }

    // Time travel through psql: the count as of the load's epoch stays put after a write.
    let epoch = visible_epoch(&cluster).await;
    let count = |sql: &str| {
        psql(&cluster, 1, &["-c", sql]).unwrap().0[0][0]
            .clone()
            .unwrap()
    };
    let before = count("SELECT count(*) FROM region");
    psql(
        &cluster,
        1,
        &["-c", "DELETE FROM region WHERE r_regionkey = 0"],
    )
    .unwrap();
    assert_eq!(count("SELECT count(*) FROM region"), "4");
    assert_eq!(
        count(&format!("SELECT count(*) FROM region AS OF EPOCH {epoch}")),
        before
    );

    // A bad statement gets one clear message, and psql's exit status says it failed.
    let error = psql(&cluster, 1, &["-c", "SELECT * FROM nosuch"]).unwrap_err();
    assert!(error.contains("nosuch"), "{error}");
    assert_eq!(
        error.matches("nosuch").count(),
        1,
        "the message names the table once: {error}"
    );

    // A node killed just before a query (the cluster still counts it alive, so the plan
    // places work on it): the exact answer arrives, with a NOTICE saying how it survived.
    let mut cluster = cluster;
    cluster.kill9(3);
    let sql = tessera_tpch::query(1);
    let (rows, stderr) = psql(&cluster, 1, &["-c", sql]).expect("the query survives the lost node");
    let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
    tessera_tpch::compare::same_text_answer(&expected, &rows, 1e-9).unwrap();
    assert!(
        stderr.contains("NOTICE"),
        "psql shows the recovery notice: {stderr:?}"
    );
    // The console lists the statement among node 1's recent ones with how it recovered.
    let (code, body) = common::http_get(&cluster, 1, "/api/status", None).await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let recovered = status["recent"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| {
            s["sql"]
                .as_str()
                .is_some_and(|q| q.contains("l_returnflag"))
        })
        .unwrap_or_else(|| panic!("Q1 is among the recent statements: {body}"));
    let lines = recovered["recoveries"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        lines
            .iter()
            .any(|l| l.as_str().is_some_and(|l| l.contains("node 3"))),
        "the statement's recovery names the dead node: {recovered}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drivers_get_transactions_prepared_statements_and_sqlstates() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let cluster = cluster(root.path()).await;
    let a = connect(&cluster, 1).await;
    let b = connect(&cluster, 2).await;
    a.batch_execute(
        "CREATE TABLE accounts (id BIGINT NOT NULL, owner VARCHAR, balance DOUBLE, PRIMARY KEY (id)); \
         CREATE TABLE audit (id BIGINT NOT NULL, note VARCHAR, PRIMARY KEY (id))",
    )
    .await
    .unwrap();

    // Prepared statements with binary parameters and results (tokio-postgres binds
    // parameters in binary and reads binary rows).
    let insert = a
        .prepare("INSERT INTO accounts (id, owner, balance) VALUES ($1, $2, $3)")
        .await
        .unwrap();
    for (id, owner, balance) in [(1i64, "ada", 10.5f64), (2, "bob", 20.25), (3, "cy", 0.0)] {
        assert_eq!(
            a.execute(&insert, &[&id, &owner, &balance]).await.unwrap(),
            1
        );
    }
    let select = b
        .prepare("SELECT owner, balance FROM accounts WHERE id = $1")
        .await
        .unwrap();
    let row = b.query_one(&select, &[&2i64]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "bob");
    assert_eq!(row.get::<_, f64>(1), 20.25);
    let rows = b
        .query(
            "SELECT id FROM accounts WHERE balance > $1 ORDER BY id",
            &[&5.0f64],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(ids, vec![1, 2]);

    // A transaction publishes its writes to both tables as one epoch, seen by nobody
    // before COMMIT.
    let before = visible_epoch(&cluster).await;
    a.batch_execute("BEGIN").await.unwrap();
    let updated = a
        .execute("UPDATE accounts SET balance = 99.0 WHERE id = 3", &[])
        .await
        .unwrap();
    assert_eq!(updated, 1);
    a.execute("INSERT INTO accounts VALUES (4, 'dee', 5.0)", &[])
        .await
        .unwrap();
    a.execute("INSERT INTO audit VALUES (1, 'opened 4')", &[])
        .await
        .unwrap();
    let seen = b
        .query("SELECT id FROM accounts WHERE id = 4", &[])
        .await
        .unwrap();
    assert!(
        seen.is_empty(),
        "an uncommitted write is invisible to others"
    );
    assert_eq!(
        visible_epoch(&cluster).await,
        before,
        "nothing published yet"
    );
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        visible_epoch(&cluster).await,
        before + 1,
        "one epoch for the whole transaction"
    );
    let row = b
        .query_one("SELECT balance FROM accounts WHERE id = 3", &[])
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, f64>(0),
        99.0,
        "the UPDATE inside the transaction committed"
    );
    let row = b
        .query_one("SELECT owner FROM accounts WHERE id = 4", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "dee");
    let audit = b.query("SELECT note FROM audit", &[]).await.unwrap();
    assert_eq!(audit.len(), 1);

    // ROLLBACK publishes nothing; so does a connection dropped mid-transaction.
    a.batch_execute("BEGIN; INSERT INTO audit VALUES (2, 'rolled back'); ROLLBACK")
        .await
        .unwrap();
    {
        let c = connect(&cluster, 3).await;
        c.batch_execute("BEGIN").await.unwrap();
        c.execute("INSERT INTO audit VALUES (3, 'dropped')", &[])
            .await
            .unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let audit = b
        .query("SELECT id FROM audit ORDER BY id", &[])
        .await
        .unwrap();
    assert_eq!(
        audit.iter().map(|r| r.get::<_, i64>(0)).collect::<Vec<_>>(),
        vec![1]
    );

    // Inside a transaction, reads see its own writes (distributed like any query, joins
    // included); other connections do not, and ROLLBACK drops them.
    a.batch_execute(
        "BEGIN; INSERT INTO audit VALUES (4, 'then read'); DELETE FROM audit WHERE id = 1",
    )
    .await
    .unwrap();
    a.execute("UPDATE accounts SET owner = 'dee2' WHERE id = 4", &[])
        .await
        .unwrap();
    let own = a
        .query("SELECT id, note FROM audit ORDER BY id", &[])
        .await
        .unwrap();
    assert_eq!(
        own.iter()
            .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1)))
            .collect::<Vec<_>>(),
        vec![(4, "then read".to_string())]
    );
    let joined = a
        .query(
            "SELECT owner, note FROM accounts JOIN audit ON accounts.id = audit.id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(joined.len(), 1);
    assert_eq!(joined[0].get::<_, String>(0), "dee2");
    assert_eq!(joined[0].get::<_, String>(1), "then read");
    let others = b
        .query("SELECT id FROM audit ORDER BY id", &[])
        .await
        .unwrap();
    assert_eq!(
        others
            .iter()
            .map(|r| r.get::<_, i64>(0))
            .collect::<Vec<_>>(),
        vec![1]
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    let after = a
        .query("SELECT id FROM audit ORDER BY id", &[])
        .await
        .unwrap();
    assert_eq!(
        after.iter().map(|r| r.get::<_, i64>(0)).collect::<Vec<_>>(),
        vec![1]
    );

    // Errors carry their SQLSTATE.
    let code = |e: tokio_postgres::Error| e.code().cloned();
    let missing = b.query("SELECT * FROM nosuch", &[]).await.unwrap_err();
    assert_eq!(code(missing), Some(SqlState::UNDEFINED_TABLE));
    let syntax = b.query("SELEC 1", &[]).await.unwrap_err();
    assert_eq!(code(syntax), Some(SqlState::SYNTAX_ERROR));
    let duplicate = b
        .execute("INSERT INTO accounts VALUES (1, 'again', 0.0)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(duplicate), Some(SqlState::UNIQUE_VIOLATION));

    // A failed statement aborts the transaction until it ends; COMMIT then rolls back.
    b.batch_execute("BEGIN").await.unwrap();
    b.execute("INSERT INTO audit VALUES (5, 'lost')", &[])
        .await
        .unwrap();
    assert!(b.query("SELECT * FROM nosuch", &[]).await.is_err());
    let aborted = b.query("SELECT 1", &[]).await.unwrap_err();
    assert_eq!(code(aborted), Some(SqlState::IN_FAILED_SQL_TRANSACTION));
    b.batch_execute("COMMIT").await.unwrap();
    let audit = b
        .query("SELECT id FROM audit ORDER BY id", &[])
        .await
        .unwrap();
    assert_eq!(audit.len(), 1, "the failed transaction published nothing");

    // Settings belong to one connection.
    a.batch_execute("SET tessera.recovery = 'restart'")
        .await
        .unwrap();
    let shown = |rows: Vec<tokio_postgres::SimpleQueryMessage>| {
        rows.into_iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(1).map(str::to_string),
                _ => None,
            })
            .unwrap()
    };
    assert_eq!(
        shown(a.simple_query("SHOW tessera.recovery").await.unwrap()),
        "restart"
    );
    assert_ne!(
        shown(b.simple_query("SHOW tessera.recovery").await.unwrap()),
        "restart"
    );

    // Distributed queries reuse node 1's connections to the other nodes: a query's end
    // once read as a broken connection, and each query opened a new TCP and TLS one.
    const OPENED: &str = "tessera_rpc_channels_opened_total";
    let before = metric(&cluster, 1, OPENED)
        .await
        .expect("the metric is served");
    for _ in 0..20 {
        a.query_one("SELECT count(*) FROM accounts", &[])
            .await
            .unwrap();
    }
    let after = metric(&cluster, 1, OPENED).await.unwrap();
    assert_eq!(
        before,
        after,
        "20 queries opened {} connections",
        after - before
    );
}

/// psycopg 3, the Python driver most notebooks use (`pip install "psycopg[binary]"`;
/// `.ci/run` installs it): `tests/clients/psycopg_smoke.py` prints "ok" when its checks hold.
/// `COPY ... FROM STDIN` publishes its rows as one epoch (CSV with quotes and NULLs, or
/// text), bad rows and duplicate keys publish nothing and name the problem, a COPY inside
/// a transaction joins its epoch, and `COPY ... TO STDOUT` gives the rows back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_from_stdin_publishes_one_epoch_and_copy_to_stdout_reads_it_back() {
    use futures::SinkExt;
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let cluster = cluster(root.path()).await;
    psql(
        &cluster,
        1,
        &[
            "-c",
            "CREATE TABLE people (id BIGINT PRIMARY KEY, name VARCHAR, score DOUBLE PRECISION)",
        ],
    )
    .unwrap();
    let count = |node| {
        psql(&cluster, node, &["-c", "SELECT count(*) FROM people"])
            .unwrap()
            .0[0][0]
            .clone()
            .unwrap()
    };

    let mut csv = String::from("id,name,score\n");
    csv.push_str("1,\"Smith, \"\"Jo\"\"\",1.5\n2,,\n");
    for id in 3..=1000 {
        csv.push_str(&format!("{id},person {id},{}\n", id as f64 / 4.0));
    }
    let before = visible_epoch(&cluster).await;
    let tag = psql_with_input(
        &cluster,
        2,
        "COPY people FROM STDIN WITH (FORMAT csv, HEADER)",
        &csv,
    )
    .unwrap();
    assert_eq!(tag.trim(), "", "psql -q prints no tag");
    assert_eq!(
        visible_epoch(&cluster).await,
        before + 1,
        "one COPY, one epoch"
    );
    assert_eq!(count(3), "1000", "every copied row, through another node");
    let (rows, _) = psql(
        &cluster,
        3,
        &[
            "-c",
            "SELECT name, score FROM people WHERE id <= 2 ORDER BY id",
        ],
    )
    .unwrap();
    assert_eq!(
        rows,
        vec![
            vec![Some("Smith, \"Jo\"".to_string()), Some("1.5".to_string())],
            vec![None, None],
        ],
        "quotes, commas and NULLs arrive as written"
    );

    // A bad value in row 500, and a key that already exists: nothing is published.
    let mut bad = String::new();
    for id in 2001..=2600 {
        let value = if id == 2500 {
            "many".to_string()
        } else {
            id.to_string()
        };
        bad.push_str(&format!("{value}\tsomeone\t1\n"));
    }
    let error = psql_with_input(&cluster, 1, "COPY people FROM STDIN", &bad).unwrap_err();
    assert!(
        error.contains("COPY column \"id\"") && error.contains("many"),
        "{error}"
    );
    let error =
        psql_with_input(&cluster, 1, "COPY people FROM STDIN", "5\tagain\t0\n").unwrap_err();
    assert!(error.contains("duplicate key"), "{error}");
    let error = psql(&cluster, 1, &["-c", "COPY people FROM '/etc/passwd'"]).unwrap_err();
    assert!(
        error.contains("only FROM STDIN and TO STDOUT") && error.contains("tessera export"),
        "{error}"
    );
    assert_eq!(
        visible_epoch(&cluster).await,
        before + 1,
        "no epoch for a failed COPY"
    );
    assert_eq!(count(1), "1000");

    // Text format through a driver, inside a transaction with an INSERT: one epoch.
    let mut client = connect(&cluster, 3).await;
    let transaction = client.transaction().await.unwrap();
    let sink = transaction
        .copy_in("COPY people (id, name) FROM STDIN")
        .await
        .unwrap();
    futures::pin_mut!(sink);
    sink.send(bytes::Bytes::from_static(b"3001\ttab\\there\n3002\t\\N\n"))
        .await
        .unwrap();
    assert_eq!(sink.finish().await.unwrap(), 2, "COPY 2");
    transaction
        .execute("INSERT INTO people VALUES (3003, 'inserted', 2.0)", &[])
        .await
        .unwrap();
    assert_eq!(
        visible_epoch(&cluster).await,
        before + 1,
        "nothing before COMMIT"
    );
    transaction.commit().await.unwrap();
    assert_eq!(
        visible_epoch(&cluster).await,
        before + 2,
        "the COPY and the INSERT are one epoch"
    );
    let row = client
        .query_one("SELECT name, score FROM people WHERE id = 3001", &[])
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, Option<String>>(0).as_deref(),
        Some("tab\there")
    );
    assert_eq!(
        row.get::<_, Option<f64>>(1),
        None,
        "a column left out is NULL"
    );

    let out = psql_with_input(
        &cluster,
        2,
        "COPY (SELECT id, name, score FROM people WHERE id IN (1, 2, 3001) ORDER BY id) TO STDOUT WITH (FORMAT csv, HEADER)",
        "",
    )
    .unwrap();
    assert_eq!(
        out,
        "id,name,score\n1,\"Smith, \"\"Jo\"\"\",1.5\n2,,\n3001,tab\there,\n"
    );
    let out = psql_with_input(&cluster, 2, "COPY people (id, name) TO STDOUT", "").unwrap();
    assert_eq!(out.lines().count(), 1003, "every row, as text");
    assert!(
        out.contains("3001\ttab\\there\n") && out.contains("2\t\\N\n"),
        "text escapes and NULL"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg_runs_transactions_and_binary_prepared_statements() {
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let cluster = cluster(root.path()).await;
    let addr = cluster.pg_addr(2).unwrap();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/psycopg_smoke.py");
    let output = tokio::process::Command::new("python3")
        .arg(&script)
        .args([host, port])
        .output()
        .await
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim() == "ok",
        "psycopg smoke test failed (is psycopg installed? pip install \"psycopg[binary]\"):\n{stdout}\n{stderr}"
    );
}

/// pgJDBC, what DBeaver and JVM services use (`tests/clients/JdbcSmoke.java`, run by `java`
/// in source-file mode, prints "ok" when its checks hold): the driver's start-up,
/// `getTables` and `getColumns`, prepared statements with typed parameters (run often
/// enough that the driver prepares them on the server), a transaction across two tables
/// that publishes one epoch, a rollback that publishes none, and SQLSTATEs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgjdbc_lists_tables_binds_parameters_and_commits_one_epoch() {
    let jar = common::maven_jar("org.postgresql", "postgresql", "42.7.4");
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let cluster = cluster(root.path()).await;
    let before = visible_epoch(&cluster).await;
    let addr = cluster.pg_addr(3).unwrap();
    let (host, port) = addr.rsplit_once(':').unwrap();
    common::java_ok(&jar, "JdbcSmoke.java", &[], &[host, port])
        .await
        .unwrap_or_else(|failed| panic!("the pgJDBC smoke test failed:\n{failed}"));
    assert_eq!(
        visible_epoch(&cluster).await,
        before + 1,
        "the transaction's hundred inserts into two tables are one epoch; the rollback and the refused insert none"
    );
}

/// Connections are bounded: one over `pg_max_connections` is refused with SQLSTATE 53300
/// while the others keep working, a freed slot is taken again, and garbage on the port
/// closes only that connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_bounded_and_bad_input_loses_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _exclusive = exclusive();
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, PARTITIONS, 3);
    cluster.set_option("pg_max_connections", "8");
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(connect(&cluster, 1).await);
    }
    let addr = cluster.pg_addr(1).unwrap();
    let refused = tokio_postgres::connect(&conninfo(&cluster, 1), NoTls)
        .await
        .err()
        .expect("a connection over the limit is refused");
    assert_eq!(
        refused.code(),
        Some(&SqlState::TOO_MANY_CONNECTIONS),
        "{refused:?}"
    );
    let row = held[7].query_one("SELECT 40 + 2", &[]).await.unwrap();
    assert_eq!(row.get::<_, i64>(0), 42, "held connections keep working");

    drop(held.pop());
    let again = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            if let Ok((client, connection)) =
                tokio_postgres::connect(&conninfo(&cluster, 1), NoTls).await
            {
                tokio::spawn(connection);
                return client;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a freed slot is taken again");
    again.simple_query("SELECT 1").await.unwrap();
    drop(again);
    drop(held);
    // The node frees a slot when it sees its connection close, a moment after the drop.
    common::wait_until(
        "the held connections to close",
        std::time::Duration::from_secs(30),
        || async {
            (common::metric(&cluster, 1, "tessera_pg_connections").await == Some(0.0)).then_some(())
        },
    )
    .await;

    // Garbage instead of a start-up message: that connection ends, the node serves on.
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(&[0, 0, 0, 12, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4])
        .await
        .unwrap();
    let mut buffer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        socket.read_to_end(&mut buffer),
    )
    .await;
    let client = connect(&cluster, 1).await;
    client.simple_query("SELECT 1").await.unwrap();

    // A query over the 16 MiB limit is refused by name (54000); the connection goes on.
    let huge = format!("SELECT 1 -- {}", "x".repeat(17 << 20));
    let refused = client
        .simple_query(&huge)
        .await
        .expect_err("a 17 MiB query is refused");
    assert_eq!(
        refused.code(),
        Some(&SqlState::PROGRAM_LIMIT_EXCEEDED),
        "{refused:?}"
    );
    let row = client.query_one("SELECT 40 + 2", &[]).await.unwrap();
    assert_eq!(row.get::<_, i64>(0), 42, "the connection goes on");

    // A client that goes away in the middle of a 100 MB result: its slot comes back and
    // the node serves on.
    let connections = || async {
        common::metric(&cluster, 1, "tessera_pg_connections")
            .await
            .unwrap()
    };
    // Only `client` is open once the connections dropped above have closed.
    common::wait_until(
        "the dropped connections to close",
        std::time::Duration::from_secs(30),
        || async { (connections().await == 1.0).then_some(()) },
    )
    .await;
    let (reader, connection) = tokio_postgres::connect(&conninfo(&cluster, 1), NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let mut rows = Box::pin(
        reader
            .query_raw(
                "SELECT repeat('x', 1000) AS r FROM generate_series(1, 100000)",
                Vec::<i64>::new(),
            )
            .await
            .unwrap(),
    );
    use futures::StreamExt;
    rows.next().await.unwrap().unwrap();
    connection.abort();
    drop(rows);
    drop(reader);
    common::wait_until(
        "the abandoned connection's slot to come back",
        std::time::Duration::from_secs(30),
        || async { (connections().await == 1.0).then_some(()) },
    )
    .await;
    let row = client.query_one("SELECT 40 + 2", &[]).await.unwrap();
    assert_eq!(row.get::<_, i64>(0), 42, "the node serves on");
}
