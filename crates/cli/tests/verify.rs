//! Signed, verifiable epochs on a real 3-node cluster under mutual TLS (r = 3). TPC-H is
//! loaded by the operator; participant lab_a registers a signing key, held by nodes 1 and
//! 2 only, and its user publishes many signed epochs. Then:
//! - `tessera verify` passes, and `tessera_epochs` shows the signatures valid;
//! - a publish through node 3 (no key) is refused naming the key it lacks;
//! - a byte flipped in a component on node 2 is named by `tessera verify`, the replica is
//!   refused and copied again, and the next verify passes;
//! - a manifest edited on node 3 (a component dropped from it, the node restarted) is named
//!   with the partition and epoch it no longer reproduces, and repaired the same way;
//! - a compromised node forging lab_a's epoch record (a commit signed with another key, or
//!   with lab_a's signature of another epoch) is refused by the metadata, naming the
//!   signature, and leaves no epoch.

mod common;

use common::{flush_everywhere, load_tpch, wait_formed, wait_until};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tessera_common::signing::SigningKey;
use tessera_common::tls::MutualTls;
use tessera_common::Epoch;
use tessera_server::meta::{EpochSeal, EpochSignature, MetaCommand, MetaResponse, TableVersion};
use tessera_server::rpc::{Clients, Refusal, ACTION_META_WRITE, PROTOCOL_VERSION};
use tessera_server::ClusterClient;
use tessera_testkit::{make_certs, tessera_certs, LocalCluster};

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

/// `tessera verify` through node 1: its exit status and its output (stdout and stderr).
fn verify(cluster: &LocalCluster, certs: &Path) -> (bool, String) {
    let args = [
        OsStr::new("--certs"),
        certs.as_os_str(),
        OsStr::new("verify"),
    ];
    common::tessera_at_node_1(BINARY, cluster, args)
}

/// Waits until `tessera verify` passes again (the refused replicas copied whole).
async fn wait_verified(cluster: &LocalCluster, certs: &Path, after: &str) -> String {
    wait_until(after, Duration::from_secs(120), || async {
        let (ok, text) = verify(cluster, certs);
        ok.then_some(text)
    })
    .await
}

fn node_dir(root: &Path, id: u64) -> PathBuf {
    root.join(format!("node-{id}")).join("data")
}

/// Sends a metadata write as `node`'s certificate would (a compromised node): to every
/// node until the leader answers.
async fn write_as_node(
    cluster: &LocalCluster,
    clients: &Clients,
    command: MetaCommand,
) -> Result<MetaResponse, String> {
    for id in cluster.node_ids() {
        let reply: Result<Result<MetaResponse, Refusal>, _> = clients
            .action(
                cluster.addr(id),
                ACTION_META_WRITE,
                command.clone(),
                Duration::from_secs(10),
            )
            .await;
        match reply {
            Ok(Err(Refusal::NotLeader { .. })) => continue,
            Ok(Ok(response)) => return Ok(response),
            Ok(Err(refusal)) => return Err(format!("{refusal:?}")),
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("no leader answered".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_corrupt_replicas_and_forged_records_and_the_cluster_repairs_them() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(Path::new(BINARY), &certs, &[1, 2, 3]);
    tessera_certs(Path::new(BINARY), &certs, &["client", "--name", "ada"]);
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.use_mtls(&certs);
    cluster.log_to_files();
    cluster.start_all();
    tessera_server::client::set_default_tls(Some(MutualTls::from_dir(&certs, "admin").unwrap()));
    wait_formed(&cluster, 1, 3).await;
    let admin = ClusterClient::new(cluster.addr(1));
    load_tpch(&cluster, 0.01).await;

    // lab_a, its user, and its key: made on node 1, copied to node 2, registered.
    for sql in [
        "CREATE PARTICIPANT lab_a",
        "CREATE USER ada WITH PASSWORD 'pw' IN PARTICIPANT lab_a",
        "GRANT admin TO ada",
        "GRANT writer TO ada",
    ] {
        admin
            .sql(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let keys = node_dir(root.path(), 1).join("keys");
    let made = Command::new(BINARY)
        .args(["keys", "new", "--participant", "lab_a", "--dir"])
        .arg(&keys)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let public = SigningKey::read(&keys.join("lab_a.ed25519"))
        .unwrap()
        .public_hex();
    std::fs::create_dir_all(node_dir(root.path(), 2).join("keys")).unwrap();
    std::fs::copy(
        keys.join("lab_a.ed25519"),
        node_dir(root.path(), 2).join("keys/lab_a.ed25519"),
    )
    .unwrap();
    let ada_tls = MutualTls::from_dir(&certs, "ada").unwrap();
    let ada = ClusterClient::with_tls(cluster.addr(1), Some(&ada_tls));
    ada.sql("CREATE TABLE readings (id BIGINT PRIMARY KEY, value DOUBLE)")
        .await
        .unwrap();
    ada.sql(&format!("ALTER PARTICIPANT lab_a ADD KEY '{public}'"))
        .await
        .unwrap();
    for i in 0..20 {
        let sql = match i % 4 {
            3 => format!("DELETE FROM readings WHERE id = {}", i - 2),
            2 => format!("UPDATE readings SET value = value * 2 WHERE id = {}", i - 1),
            _ => format!(
                "INSERT INTO readings VALUES ({i}, {i}.5), ({}, 0.25)",
                i + 1000
            ),
        };
        ada.sql(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    // Node 3 does not hold lab_a's key: it cannot publish for lab_a.
    let error = ClusterClient::with_tls(cluster.addr(3), Some(&ada_tls))
        .sql("INSERT INTO readings VALUES (99, 1.0)")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("node 3 does not hold its key") && error.contains("lab_a.ed25519"),
        "{error}"
    );
    flush_everywhere(&cluster).await;

    let (ok, text) = verify(&cluster, &certs);
    assert!(ok, "a healthy cluster verifies: {text}");
    assert!(text.contains("OK: every replica reproduces"), "{text}");
    let signatures = admin
        .query("SELECT signature, count(*) AS n FROM tessera_epochs WHERE tables = 'readings' AND kind = 'publish' GROUP BY signature")
        .await
        .unwrap();
    let shown = arrow::util::pretty::pretty_format_batches(&signatures)
        .unwrap()
        .to_string();
    assert!(
        shown.contains("valid (lab_a)") && shown.contains("| 20"),
        "{shown}"
    );
    assert!(!shown.contains("INVALID"), "{shown}");

    // A flipped byte in one of node 2's components.
    let components = node_dir(root.path(), 2).join("store/components");
    let victim = std::fs::read_dir(&components)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("node 2 holds components");
    let mut bytes = std::fs::read(&victim).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&victim, bytes).unwrap();
    let (ok, text) = verify(&cluster, &certs);
    assert!(!ok, "a flipped byte fails verification: {text}");
    let name = victim.file_stem().unwrap().to_string_lossy().to_string();
    assert!(
        text.contains("node 2's replica of partition")
            && text.contains(&name)
            && text.contains("do not match its name"),
        "names the node, the component and the damage: {text}"
    );
    assert!(text.contains("repairing: node 2's replica"), "{text}");
    wait_verified(&cluster, &certs, "the flipped byte repaired").await;

    // A component dropped from a manifest on node 3, found after its restart.
    cluster.kill9(3);
    let checkpoint = node_dir(root.path(), 3).join("store/checkpoint.json");
    let mut saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&checkpoint).unwrap()).unwrap();
    let tables = saved["tables"].as_array_mut().unwrap();
    let lineitem = tables
        .iter_mut()
        .find(|t| t["def"]["name"] == "lineitem")
        .unwrap();
    let (dropped_partition, _) = lineitem["manifests"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
        .find_map(|(p, partition)| {
            let components = partition["components"].as_array_mut()?;
            (!components.is_empty()).then(|| (p, components.remove(0)))
        })
        .expect("node 3 holds a lineitem component");
    std::fs::write(&checkpoint, serde_json::to_vec_pretty(&saved).unwrap()).unwrap();
    cluster.start(3);
    wait_formed(&cluster, 1, 3).await;
    let (ok, text) = verify(&cluster, &certs);
    assert!(!ok, "an edited manifest fails verification: {text}");
    assert!(
        text.contains(&format!(
            "table lineitem: node 3's replica of partition p{dropped_partition} does not reproduce epoch"
        )) && text.contains("are missing"),
        "names the table, node, partition and epoch: {text}"
    );
    wait_verified(&cluster, &certs, "the edited manifest repaired").await;

    // A compromised node forges lab_a's records: the metadata refuses them.
    let node_tls = MutualTls::from_dir(&certs, "node-1").unwrap();
    let clients = Clients::new(cluster.cluster_id(), PROTOCOL_VERSION).with_tls(Some(&node_tls));
    let state = admin.current_metadata().await.unwrap();
    let (signed_epoch, signed_record) = state
        .epoch_log
        .iter()
        .rev()
        .find(|(_, r)| r.tables == ["readings"] && r.seal.is_some())
        .map(|(e, r)| (*e, r.clone()))
        .unwrap();
    let incarnation = state
        .nodes
        .values()
        .find(|n| n.id.0 == 1)
        .unwrap()
        .incarnation;
    let head = state.table_head("readings");
    let allocate = |request: u64| MetaCommand::As {
        user: "ada".into(),
        command: Box::new(MetaCommand::AllocateEpoch {
            coordinator: tessera_common::NodeId(1),
            incarnation,
            tables: vec!["readings".into()],
            request,
            read_at: Default::default(),
        }),
    };
    // Node 1 does not know of the epochs allocated here in its name, so its next heartbeat
    // says it gave them up and the leader aborts them. Each forgery gets its own epoch, and
    // one aborted before its forged commit arrived is allocated again (with a deadline).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let stranger = SigningKey::generate();
    let replayed = signed_record.seal.unwrap().signature.unwrap();
    let mut forged_epochs = Vec::new();
    for (how, signature) in [
        (
            "signed with another key",
            EpochSignature {
                key: stranger.public_hex(),
                signature: stranger.sign_hex(b"anything"),
            },
        ),
        ("lab_a's signature of another epoch", replayed),
    ] {
        let reason = loop {
            // The repair just verified may still hold the table's lease for a moment (its
            // copy is an open epoch): wait for it to end.
            let allocated = loop {
                match write_as_node(
                    &cluster,
                    &clients,
                    allocate(77 + forged_epochs.len() as u64),
                )
                .await
                .unwrap()
                {
                    MetaResponse::TableBusy(why) if std::time::Instant::now() < deadline => {
                        println!("readings busy ({why}); trying again");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    response => break response,
                }
            };
            let MetaResponse::Epoch(forged_epoch) = allocated else {
                panic!("expected an epoch, got {allocated:?}");
            };
            forged_epochs.push(forged_epoch);
            let forged = MetaCommand::CommitEpoch {
                epoch: forged_epoch,
                missed: vec![],
                changes: Some(vec![]),
                seal: Some(EpochSeal {
                    versions: vec![TableVersion {
                        table: "readings".into(),
                        previous: head,
                        version: tessera_common::ComponentHash([7; 32]),
                    }],
                    signature: Some(signature.clone()),
                    digest_format: tessera_storage::digest::DigestFormat::CURRENT,
                }),
                min_copies: None,
            };
            match write_as_node(&cluster, &clients, forged).await.unwrap() {
                MetaResponse::Refused(reason) => break reason,
                MetaResponse::Fenced(why)
                    if why.contains("no longer working on it")
                        && std::time::Instant::now() < deadline =>
                {
                    println!("{how}: epoch {forged_epoch} was given up first ({why}); again");
                }
                response => panic!("{how}: the forged record was not refused: {response:?}"),
            }
        };
        assert!(reason.contains("signature is refused"), "{how}: {reason}");
        // Ended here, so the next forgery's allocation finds the table free.
        let forged_epoch = *forged_epochs.last().unwrap();
        let aborted = write_as_node(
            &cluster,
            &clients,
            MetaCommand::AbortEpoch {
                epoch: forged_epoch,
                reason: "forged".into(),
            },
        )
        .await
        .unwrap();
        assert!(
            matches!(&aborted, MetaResponse::Done)
                || matches!(&aborted, MetaResponse::Fenced(why) if why.contains("no longer working on it")),
            "{aborted:?}"
        );
    }
    let state = admin.current_metadata().await.unwrap();
    for forged_epoch in forged_epochs {
        assert!(!state.epoch_log.contains_key(&forged_epoch));
        assert!(signed_epoch < forged_epoch && forged_epoch > Epoch::ZERO);
    }
    assert_eq!(state.table_head("readings"), head, "the chain did not move");
    let (ok, text) = verify(&cluster, &certs);
    assert!(ok, "{text}");
    assert!(
        cluster.panics_logged().is_empty(),
        "{:?}",
        cluster.panics_logged()
    );
}
