//! Mutual TLS on the internal port of a real 3-node cluster, with certificates made by
//! `tessera certs`: the cluster forms and answers a client holding a certificate of its
//! CA; a plaintext client, a client of another CA and one with an expired certificate are
//! refused; a node with a certificate of another CA cannot join, and one with an expired
//! certificate does not start; a
//! caller presenting one node's certificate while claiming to be another node is refused
//! naming both; a node whose certificate is another node's refuses to start. The cluster
//! answers throughout.

mod common;

use std::path::Path;
use std::time::Duration;
use tessera_common::tls::MutualTls;
use tessera_common::NodeId;
use tessera_net::{CallError, Clients, Identity, Refusal, ACTION_HELLO, PROTOCOL_VERSION};
use tessera_server::ClusterClient;
use tessera_testkit::{make_certs, tessera_certs, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

async fn error_of(client: &ClusterClient) -> String {
    match client.status().await {
        Ok(_) => panic!("the call was accepted"),
        Err(error) => error.to_string(),
    }
}

/// Waits until node 4's log names why it was refused (`why`: any of these), checking that
/// it never joins and that the cluster keeps its three members and answers.
async fn check_not_joined(cluster: &mut LocalCluster, admin: &ClusterClient, why: &[&str]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = admin.status().await.unwrap();
        assert!(
            !status.meta.nodes.contains_key(&NodeId(4)),
            "node 4 joined: {:?}",
            status.meta.nodes.keys().collect::<Vec<_>>()
        );
        assert_eq!(status.meta.live_nodes().count(), 3);
        let log = std::fs::read_to_string(cluster.log_path(4)).unwrap_or_default();
        if let Some(line) = log
            .lines()
            .find(|l| why.iter().any(|sign| l.contains(sign)))
        {
            println!("node 4 says: {line}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node 4's log does not say why it was refused ({why:?}):\n{}",
            log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let count = admin.query("SELECT count(*) FROM kv").await.unwrap();
    assert_eq!(count[0].num_rows(), 1);
    cluster.kill9(4);
    std::fs::remove_file(cluster.log_path(4)).ok();
}

/// What a node started with `config` says as it refuses to start.
fn refused_start(config: &Path, dir: &Path) -> String {
    let output = std::process::Command::new(BINARY)
        .args(["node", "--config", config.to_str().unwrap()])
        .current_dir(dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(!output.status.success(), "the node started: {stderr}");
    stderr
}

/// The refusal of action `kind` with `body`, sent through `clients` to `addr`.
async fn refusal_of<B: serde::Serialize>(
    clients: &Clients,
    addr: &str,
    kind: &str,
    body: B,
) -> String {
    let reply: Result<serde_json::Value, CallError> = clients
        .action(addr, kind, body, Duration::from_secs(5))
        .await;
    format!("{reply:?}")
}

/// Points node 4's configuration at the certificates in `dir`.
fn node_4_certificates(cluster: &LocalCluster, from: &Path, to: &Path) {
    let path = cluster.config_path(4);
    let text = std::fs::read_to_string(&path).unwrap();
    let from = format!("{:?}", from.to_str().unwrap());
    let from = from.trim_matches('"');
    let to = format!("{:?}", to.to_str().unwrap());
    std::fs::write(&path, text.replace(from, to.trim_matches('"'))).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_holders_of_the_clusters_certificates_join_or_call() {
    tessera_common::tls::install_ring_provider();
    let root = tempfile::tempdir().unwrap();
    let ours = root.path().join("certs");
    let theirs = root.path().join("other-ca");
    let expired = root.path().join("expired");
    make_certs(Path::new(BINARY), &ours, &[1, 2, 3, 4]);
    make_certs(Path::new(BINARY), &theirs, &[4]);
    // The same CA, but node 4's and a client's certificates expired.
    std::fs::create_dir_all(&expired).unwrap();
    for file in ["ca.pem", "ca.key"] {
        std::fs::copy(ours.join(file), expired.join(file)).unwrap();
    }
    let binary = Path::new(BINARY);
    let node_4 = [
        "node",
        "--id",
        "4",
        "--addr",
        "127.0.0.1",
        "--not-after",
        "2024-01-01",
    ];
    tessera_certs(binary, &expired, &node_4);
    let admin = ["client", "--name", "admin", "--not-after", "2024-01-01"];
    tessera_certs(binary, &expired, &admin);

    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.use_mtls(&ours);
    cluster.log_to_files();
    cluster.start_all();
    let admin_tls = MutualTls::from_dir(&ours, "admin").unwrap();
    tessera_server::client::set_default_tls(Some(admin_tls.clone()));
    common::wait_formed(&cluster, 1, 3).await;
    let admin = ClusterClient::new(cluster.addr(1));
    admin
        .sql("CREATE TABLE kv (k BIGINT PRIMARY KEY, v BIGINT)")
        .await
        .unwrap();
    admin
        .sql("INSERT INTO kv VALUES (1, 10), (2, 20)")
        .await
        .unwrap();
    let rows = admin.query("SELECT sum(v) FROM kv").await.unwrap();
    assert_eq!(rows[0].num_rows(), 1);

    // The CLI with the cluster's certificates, and without.
    let cli_status = |certs: Option<&Path>| {
        let mut command = std::process::Command::new(BINARY);
        command.env_remove("TESSERA_CERTS").current_dir(root.path());
        if let Some(certs) = certs {
            command.arg("--certs").arg(certs);
        }
        command
            .args(["--node", cluster.addr(3), "status"])
            .output()
            .unwrap()
    };
    let with = cli_status(Some(&ours));
    let stdout = String::from_utf8_lossy(&with.stdout);
    assert!(
        with.status.success() && stdout.contains("internal port:  mutual TLS"),
        "{stdout}{}",
        String::from_utf8_lossy(&with.stderr)
    );
    let without = cli_status(None);
    let stderr = String::from_utf8_lossy(&without.stderr);
    assert!(
        !without.status.success() && stderr.contains("tessera --certs DIR"),
        "{stderr}"
    );

    // Clients without a good certificate.
    let plaintext = error_of(&ClusterClient::with_tls(cluster.addr(2), None)).await;
    assert!(plaintext.contains("mutual TLS"), "{plaintext}");
    let stranger = MutualTls::from_dir(&theirs, "admin").unwrap();
    let error = error_of(&ClusterClient::with_tls(cluster.addr(2), Some(&stranger))).await;
    assert!(
        error.contains("unreachable"),
        "another CA's client: {error}"
    );
    // An expired certificate is refused where it is loaded (naming its expiry), and, if
    // presented anyway, by the node's handshake.
    let refused = MutualTls::from_dir(&expired, "admin").unwrap_err();
    assert!(
        refused.contains("admin.pem: the certificate expired on"),
        "{refused}"
    );
    let read = |name: &str| std::fs::read(expired.join(name)).unwrap();
    let stale = MutualTls {
        ca_pem: read("ca.pem"),
        cert_pem: read("admin.pem"),
        key_pem: read("admin.key"),
        identity: tessera_common::tls::CertIdentity::Client("admin".into()),
    };
    let error = error_of(&ClusterClient::with_tls(cluster.addr(2), Some(&stale))).await;
    assert!(error.contains("unreachable"), "an expired client: {error}");

    // A caller with node 3's certificate claiming to be node 2.
    let node3 = MutualTls::from_dir(&ours, "node-3").unwrap();
    let impostor = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION)
        .with_tls(Some(&node3))
        .as_node(NodeId(2));
    let refused: Result<Identity, CallError> = impostor
        .action(cluster.addr(1), ACTION_HELLO, (), Duration::from_secs(5))
        .await;
    match refused {
        Err(CallError::Refused(Refusal::Unauthenticated { node_id, reason })) => {
            assert_eq!(node_id, NodeId(1));
            assert!(
                reason.contains("certificate is node 3's, but it claims to be node 2"),
                "{reason}"
            );
        }
        other => panic!("an impostor's hello: {other:?}"),
    }
    // Or naming itself in the envelope but speaking for node 2 in what it sends: a
    // heartbeat, a registration under node 2's id.
    let forger = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION)
        .with_tls(Some(&node3))
        .as_node(NodeId(3));
    let heartbeat = tessera_server::meta::wire::Heartbeat {
        node_id: NodeId(2),
        working_on: vec![],
        allocating: vec![],
        applied_index: 0,
    };
    let error = refusal_of(
        &forger,
        cluster.addr(1),
        tessera_server::meta::wire::ACTION_HEARTBEAT,
        (heartbeat, Vec::<NodeId>::new()),
    )
    .await;
    assert!(
        error.contains("a heartbeat for node 2 came with the certificate of node 3"),
        "{error}"
    );
    let registration = tessera_server::meta::MetaCommand::RegisterNode {
        id: NodeId(2),
        addr: "127.0.0.1:9".into(),
        compute: false,
    };
    let error = refusal_of(
        &forger,
        cluster.addr(1),
        tessera_server::meta::wire::ACTION_META_WRITE,
        registration,
    )
    .await;
    assert!(
        error.contains("a registration for node 2 came with the certificate of node 3"),
        "{error}"
    );
    // Node 3's certificate speaking as node 3 is welcome.
    let honest = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION)
        .with_tls(Some(&node3))
        .as_node(NodeId(3));
    let identity: Identity = honest
        .action(cluster.addr(1), ACTION_HELLO, (), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(identity.node_id, NodeId(1));

    // Nodes without a good certificate cannot join.
    let id = cluster.add_node();
    assert_eq!(id, 4);
    node_4_certificates(&cluster, &ours, &theirs);
    cluster.start(4);
    check_not_joined(&mut cluster, &admin, &["BadSignature", "UnknownIssuer"]).await;
    // A node whose certificate expired refuses to start, naming the expiry.
    node_4_certificates(&cluster, &theirs, &expired);
    let config = cluster.config_path(4);
    let stderr = refused_start(&config, root.path());
    assert!(
        stderr.contains("node-4.pem: the certificate expired on"),
        "{stderr}"
    );

    // A node given another node's certificate refuses to start, naming both.
    node_4_certificates(&cluster, &expired, &ours);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("node-4.pem", "node-3.pem")
        .replace("node-4.key", "node-3.key");
    std::fs::write(&config, text).unwrap();
    let stderr = refused_start(&config, root.path());
    assert!(
        stderr.contains("is the certificate of node 3, but this is node 4"),
        "{stderr}"
    );

    // The cluster never noticed.
    let status = admin.status().await.unwrap();
    assert_eq!(status.meta.live_nodes().count(), 3);
    assert!(status.leader.is_some());
    drop(cluster);
}

/// `tessera status` says in red when a cluster's internal port is plaintext.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_when_the_internal_port_is_insecure() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.start_all();
    let plaintext = ClusterClient::with_tls(cluster.addr(1), None);
    common::wait_until("the cluster to form", Duration::from_secs(60), || async {
        let status = plaintext.status().await.ok()?;
        (status.leader.is_some() && status.meta.live_nodes().count() == 3).then_some(())
    })
    .await;
    assert!(plaintext.status().await.unwrap().insecure);
    let output = std::process::Command::new(BINARY)
        .env_remove("TESSERA_CERTS")
        .current_dir(root.path())
        .args(["--node", cluster.addr(1), "status"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("\x1b[1;31minternal port:  INSECURE (plaintext, insecure = true)"),
        "{stdout}"
    );
    drop(cluster);
}
