//! Arrow Flight SQL on every node, driven by ADBC (`adbc_driver_flightsql` from Python, as a
//! data team would) and by the Arrow Flight SQL JDBC driver: all 22 TPC-H queries equal
//! plain DataFusion's answers, `AS OF EPOCH` works, bulk ingest publishes one epoch,
//! parameters bind, and errors name the problem.

mod common;

use common::{load_tpch, python_ok, wait_formed, ADBC_SELECT_42};
use std::path::Path;
use std::time::Duration;
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const SF: f64 = 0.02;

fn read_arrow(path: &Path) -> Vec<arrow::array::RecordBatch> {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    arrow::ipc::reader::FileReader::try_new(file, None)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adbc_answers_every_tpch_query_exactly_and_ingests_in_one_epoch() {
    const STREAMED: &str = "SELECT l_orderkey, l_linenumber, l_comment FROM lineitem \
                            ORDER BY l_orderkey, l_linenumber";
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    load_tpch(&cluster, SF).await;
    let admin = ClusterClient::new(cluster.addr(1));
    let loaded_at = admin.status().await.unwrap().meta.visible;

    let queries = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    for n in 1..=22 {
        std::fs::write(
            queries.path().join(format!("q{n:02}.sql")),
            tessera_tpch::query(n),
        )
        .unwrap();
    }
    // Time travel through Flight SQL: lineitem as it was when loaded.
    std::fs::write(
        queries.path().join("z_as_of.sql"),
        format!(
            "SELECT count(*) AS n FROM lineitem AS OF EPOCH {}",
            loaded_at.0
        ),
    )
    .unwrap();

    // An answer far past its answer buffer streams through DoGet as the query runs.
    std::fs::write(
        queries.path().join("z_streamed.sql"),
        format!("/*+ SET tessera.answer_buffer = '64KB' */ {STREAMED}"),
    )
    .unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/adbc_flightsql.py");
    let uri = format!("grpc://{}", cluster.flightsql_addr(2).unwrap());
    let output = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(&uri)
        .arg(queries.path())
        .arg(out.path())
        .output()
        .await
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.trim() == "ok",
        "the ADBC client failed (is it installed? pip install adbc-driver-flightsql pyarrow):\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let oracle = tessera_tpch::oracle::oracle(SF).unwrap();
    for n in 1..=22 {
        let expected = oracle
            .sql(tessera_tpch::query(n))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let actual = read_arrow(&out.path().join(format!("q{n:02}.arrow")));
        tessera_tpch::compare::same_answer(&expected, &actual, 1e-9)
            .unwrap_or_else(|diff| panic!("TPC-H Q{n} through ADBC differs: {diff}"));
    }
    let expected = oracle
        .sql("SELECT count(*) AS n FROM lineitem")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let as_of = read_arrow(&out.path().join("z_as_of.arrow"));
    tessera_tpch::compare::same_answer(&expected, &as_of, 0.0).unwrap();
    let expected = oracle.sql(STREAMED).await.unwrap().collect().await.unwrap();
    let streamed = read_arrow(&out.path().join("z_streamed.arrow"));
    tessera_tpch::compare::same_answer(&expected, &streamed, 0.0)
        .unwrap_or_else(|diff| panic!("a streamed answer through ADBC differs: {diff}"));

    // The ingest, the INSERT, the INSERT bound to three rows and the committed transaction
    // each published one epoch; the rolled back transaction none.
    let status = admin.status().await.unwrap();
    assert_eq!(
        status.meta.visible.0,
        loaded_at.0 + 4,
        "CREATE TABLE takes no epoch; the ingest, the INSERT, the bound INSERT and the commit one each"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_connections_are_bounded_and_the_node_serves_on() {
    use tokio::io::AsyncReadExt;
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.set_option("flightsql_max_connections", "64");
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let pid = cluster.node_pid(1).unwrap();
    let open_fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let baseline = open_fds();

    let addr = cluster.flightsql_addr(1).unwrap().to_string();
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    // The node keeps 64 of them; every other one it closes at once.
    let outcomes = futures::future::join_all(idle.iter_mut().map(|socket| async move {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(3), socket.read(&mut byte)).await;
        matches!(read, Ok(Ok(0)) | Ok(Err(_)))
    }))
    .await;
    let closed = outcomes.iter().filter(|closed| **closed).count();
    assert!(
        (1000 - 64..1000).contains(&closed),
        "{closed} of 1000 idle connections were closed; 936 were over the bound"
    );
    let held = open_fds();
    assert!(
        held < baseline + 64 + 32,
        "node 1 holds {held} file descriptors (it held {baseline} before the flood)"
    );
    // Its other ports serve on.
    let status = ClusterClient::new(cluster.addr(1)).status().await.unwrap();
    assert!(status.leader.is_some());

    drop(idle);
    let uri = format!("grpc://{addr}");
    common::wait_until(
        "Flight SQL to serve once the idle clients left",
        Duration::from_secs(30),
        || async { python_ok(&["-c", ADBC_SELECT_42, &uri]).await.ok() },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_flight_sql_calls_get_errors_that_name_them() {
    use arrow_flight::flight_service_client::FlightServiceClient;
    use arrow_flight::{Action, FlightDescriptor, Ticket};
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 1, 8, 1);
    cluster.start_all();
    wait_formed(&cluster, 1, 1).await;
    let uri = format!("http://{}", cluster.flightsql_addr(1).unwrap());
    let channel = tonic::transport::Endpoint::from_shared(uri)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightServiceClient::new(channel);

    let junk_ticket = client
        .do_get(Ticket::new(vec![0xde, 0xad, 0xbe, 0xef]))
        .await
        .expect_err("a junk ticket");
    let junk_command = client
        .get_flight_info(FlightDescriptor::new_cmd(vec![1, 2, 3, 4, 5]))
        .await
        .expect_err("a junk command");
    let unknown_action = client
        .do_action(Action::new("FormatDisk", "now"))
        .await
        .expect_err("an unknown action");
    for (what, status) in [
        ("junk ticket", junk_ticket),
        ("junk command", junk_command),
        ("unknown action", unknown_action),
    ] {
        eprintln!("{what}: {status:?}");
        assert!(
            matches!(
                status.code(),
                tonic::Code::InvalidArgument | tonic::Code::Unimplemented
            ),
            "{what}: {status:?}"
        );
        assert!(!status.message().is_empty(), "{what} says why");
        if what.starts_with("junk") {
            assert!(
                status.message().contains("not a Flight SQL message"),
                "{what}: {status:?}"
            );
        }
    }
    // Ending a transaction that is not open names it.
    use arrow_flight::sql::{ActionEndTransactionRequest, Any, EndTransaction};
    use prost::Message;
    let end = ActionEndTransactionRequest {
        transaction_id: vec![0xab; 16].into(),
        action: EndTransaction::Commit as i32,
    };
    let unknown_transaction = client
        .do_action(Action::new(
            "EndTransaction",
            Any::pack(&end).unwrap().encode_to_vec(),
        ))
        .await
        .expect_err("an unknown transaction");
    assert_eq!(unknown_transaction.code(), tonic::Code::NotFound);
    assert!(
        unknown_transaction
            .message()
            .contains("transaction abababababababababababababababab is not open on this node"),
        "{unknown_transaction:?}"
    );
    // The node serves on.
    let uri = format!("grpc://{}", cluster.flightsql_addr(1).unwrap());
    python_ok(&["-c", ADBC_SELECT_42, &uri]).await.unwrap();
}

/// The Arrow Flight SQL JDBC driver (`tests/clients/FlightSqlJdbcSmoke.java`; the jar comes
/// from Maven Central through `.ci/run`): DDL and an INSERT as updates, `getTables`, a
/// query, and a prepared query bound to a parameter three times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flight_sql_jdbc_driver_lists_tables_and_binds_parameters() {
    let jar = common::maven_jar("org.apache.arrow", "flight-sql-jdbc-driver", "18.3.0");
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let addr = cluster.flightsql_addr(3).unwrap().to_string();
    let (host, port) = addr.rsplit_once(':').unwrap();
    // Arrow's Java memory needs these on JDK 17.
    let opens = ["--add-opens=java.base/java.nio=ALL-UNNAMED"];
    common::java_ok(&jar, "FlightSqlJdbcSmoke.java", &opens, &[host, port])
        .await
        .unwrap_or_else(|failed| panic!("the Flight SQL JDBC smoke test failed:\n{failed}"));
}
