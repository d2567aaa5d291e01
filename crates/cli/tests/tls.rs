//! TLS on the client ports of a real 3-node cluster, with a certificate made by `openssl`
//! for the test: `psql` verifies the node's certificate against the test CA (and refuses
//! it against another CA), ADBC reaches Flight SQL over `grpc+tls` (and not in the
//! clear), and the console answers over HTTPS (and not in the clear).

mod common;

use common::{python_ok, wait_formed};
use std::path::Path;
use std::process::Command;
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl is installed");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A CA named `name` in `dir` (`name.pem`, `name.key`).
fn make_ca(dir: &Path, name: &str) {
    let (pem, key) = (format!("{name}.pem"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
}

/// `node.pem` and `node.key` for 127.0.0.1, signed by CA `ca`.
fn make_node_certificate(dir: &Path, ca: &str) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "node.key",
            "-out",
            "node.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(dir.join("san.cnf"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "node.csr",
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            "node.pem",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
        ],
    );
}

fn psql(cluster: &LocalCluster, id: u64, tls: &str, sql: &str) -> Result<String, String> {
    let addr = cluster.pg_addr(id).unwrap();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let conninfo = format!("host={host} port={port} user=tessera dbname=tessera {tls}");
    let output = Command::new("psql")
        .args(["-X", "-q", "-A", "-t", "-w", "-d", &conninfo, "-c", sql])
        .output()
        .expect("psql is installed");
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).to_string())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_verify_the_nodes_certificate_over_tls() {
    let certs = tempfile::tempdir().unwrap();
    make_ca(certs.path(), "test-ca");
    make_ca(certs.path(), "other-ca");
    make_node_certificate(certs.path(), "test-ca");
    let path = |name: &str| certs.path().join(name).display().to_string();

    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.set_option("tls_cert", &format!("{:?}", path("node.pem")));
    cluster.set_option("tls_key", &format!("{:?}", path("node.key")));
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;

    let verified = format!("sslmode=verify-full sslrootcert={}", path("test-ca.pem"));
    for node in 1..=3 {
        let info = psql(&cluster, node, &verified, "\\conninfo").unwrap();
        assert!(info.contains("SSL connection"), "node {node}: {info}");
        assert_eq!(
            psql(&cluster, node, &verified, "SELECT 40 + 2").unwrap(),
            "42"
        );
    }
    let wrong_ca = format!("sslmode=verify-full sslrootcert={}", path("other-ca.pem"));
    let refused = psql(&cluster, 1, &wrong_ca, "SELECT 1").unwrap_err();
    assert!(refused.contains("certificate verify failed"), "{refused}");

    let script = "import sys, adbc_driver_flightsql.dbapi as f\n\
                  uri, ca = sys.argv[1], open(sys.argv[2]).read()\n\
                  opts = {'adbc.flight.sql.client_option.tls_root_certs': ca}\n\
                  c = f.connect(uri, db_kwargs=opts).cursor(); c.execute('SELECT 41 + 1 AS x')\n\
                  assert c.fetchone() == (42,); print('ok')";
    let addr = cluster.flightsql_addr(2).unwrap().to_string();
    let ca = path("test-ca.pem");
    let adbc = |uri: String| {
        let ca = ca.clone();
        async move { python_ok(&["-c", script, &uri, &ca]).await }
    };
    adbc(format!("grpc+tls://{addr}")).await.unwrap();
    assert!(
        adbc(format!("grpc://{addr}")).await.is_err(),
        "Flight SQL answered in the clear"
    );

    // The console: its page and status over HTTPS, verified against the test CA.
    let script = "import sys, ssl, urllib.request\n\
                  url, ca = sys.argv[1], sys.argv[2]\n\
                  context = ssl.create_default_context(cafile=ca)\n\
                  page = urllib.request.urlopen(url + '/', context=context, timeout=10).read().decode()\n\
                  status = urllib.request.urlopen(url + '/api/status', context=context, timeout=10).read().decode()\n\
                  assert 'Tessera console' in page and 'visible' in status, (page[:200], status[:200])\n\
                  print('ok')";
    let http = cluster.http_addr(3).unwrap().to_string();
    python_ok(&["-c", script, &format!("https://{http}"), &ca])
        .await
        .unwrap_or_else(|failed| panic!("the console over HTTPS: {failed}"));
    assert!(
        python_ok(&["-c", script, &format!("http://{http}"), &ca])
            .await
            .is_err(),
        "the console answered in the clear"
    );
}
