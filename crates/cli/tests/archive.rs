//! The erasure-coded archive on a real 7-node cluster (r = 3, k = 4, m = 2: each component's
//! fragments on 6 of the 7 nodes; five Raft voters), against a model of the table's history:
//!
//! - random publishes (inserts, updates, deletes), tags, retention changes and flushes
//!   with merges; the leader archives every tagged epoch retention has passed, and the
//!   horizon then passes it. Every epoch the model wrote is either answered exactly (from
//!   the replicas or the archive) or refused naming the horizon; every tag answers exactly.
//! - a table with `archive = true, retain_epochs = 1`: every version but the last is
//!   archived, and every epoch from its first version on answers exactly.
//! - a deleted fragment, a fragment with a flipped byte and a component with a flipped byte:
//!   `tessera scrub` finds all three and repairs them (the files hash right again), and a
//!   second scrub finds nothing.
//! - two random nodes other than the one asked are SIGKILLed: every tag still answers
//!   exactly, its components rebuilt from the four or five fragments left. Once they have
//!   been gone `rereplicate_after_ms`, the fragments they held are rebuilt on the node that
//!   holds none of their component, so every component has 5 live fragments again (status
//!   shows it), and a scrub of the live nodes finds them all sound.
//! - with every tag dropped and the whole-table archive reset, the next scrub deletes
//!   every fragment.

mod common;

use arrow::array::{Array, Int64Array};
use common::{flush_everywhere, wait_formed, wait_until};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_common::ComponentHash;
use tessera_server::ClusterClient;
use tessera_sql::StatementOutput;
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

type Rows = BTreeMap<i64, i64>;

async fn rows_of(client: &ClusterClient, sql: &str) -> Result<Rows, String> {
    let batches = client.query(sql).await.map_err(|e| e.to_string())?;
    let mut rows = Rows::new();
    for batch in &batches {
        let k = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let v = batch
            .column(1)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        for i in 0..batch.num_rows() {
            rows.insert(k.value(i), v.value(i));
        }
    }
    Ok(rows)
}

async fn write(client: &ClusterClient, sql: &str) -> Option<u64> {
    let outputs = client
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    match outputs.last() {
        Some(StatementOutput::Done { epoch, .. }) => epoch.map(|e| e.0),
        other => panic!("{sql}: {other:?}"),
    }
}

/// Node `id`'s files under `dir` of its store with extension `ext`.
fn files(root: &Path, id: u64, dir: &str, ext: &str) -> Vec<PathBuf> {
    let dir = root.join(format!("node-{id}/data/store/{dir}"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

fn hashes_right(path: &Path) -> bool {
    let name = path.file_stem().unwrap().to_string_lossy().to_string();
    std::fs::read(path).is_ok_and(|bytes| ComponentHash::of_bytes(&bytes).to_hex() == name)
}

/// Every tag answers as the model says.
async fn check_tags(client: &ClusterClient, tags: &BTreeMap<String, (u64, Rows)>, when: &str) {
    for (name, (epoch, rows)) in tags {
        let answer = rows_of(client, &format!("SELECT k, v FROM kv AS OF TAG \"{name}\""))
            .await
            .unwrap_or_else(|e| panic!("{when}: AS OF TAG {name} (epoch {epoch}): {e}"));
        assert_eq!(&answer, rows, "{when}: AS OF TAG {name} (epoch {epoch})");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archived_epochs_answer_exactly_with_two_nodes_dead_and_the_scrubber_repairs_fragments() {
    let seed: u64 = std::env::var("TESSERA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("seed {seed} (TESSERA_TEST_SEED={seed} repeats this run)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 7, 8, 3);
    cluster.set_voters(&[1, 2, 3, 4, 5]);
    for (key, value) in [
        ("store.merge_threshold", "2"),
        ("scrub.bytes_per_sec", "0"),
        ("failure.timeout_ms", "1500"),
        ("failure.rereplicate_after_ms", "4000"),
        ("archive.collect_after_ms", "1000"),
    ] {
        cluster.set_option(key, value);
    }
    cluster.log_to_files();
    cluster.start_all();
    wait_formed(&cluster, 1, 7).await;
    let client = ClusterClient::new(cluster.addr(1));
    write(&client, "CREATE TABLE kv (k BIGINT PRIMARY KEY, v BIGINT)").await;

    // Random history: publishes, tags, retention changes, flushes (merges under the horizon).
    let (mut rows, mut next_key) = (Rows::new(), 0i64);
    let mut versions: Vec<(u64, Rows)> = Vec::new();
    let mut tags: BTreeMap<String, (u64, Rows)> = BTreeMap::new();
    for step in 0..24 {
        let sql = common::random_kv_change(&mut rng, 20..80, &mut next_key, &mut rows);
        if let Some(epoch) = write(&client, &sql).await {
            versions.push((epoch, rows.clone()));
        }
        match rng.random_range(0..8) {
            0 | 1 => {
                let name = format!("t{step}");
                write(&client, &format!("CREATE TAG {name}")).await;
                let epoch = versions.last().map_or(0, |v| v.0);
                tags.insert(name, (epoch, rows.clone()));
            }
            2 => {
                let keep = rng.random_range(1..4);
                write(
                    &client,
                    &format!("ALTER TABLE kv SET (retain_epochs = {keep})"),
                )
                .await;
            }
            3 => flush_everywhere(&cluster).await,
            _ => {}
        }
    }
    if tags.is_empty() {
        let epoch = versions.last().unwrap().0;
        write(&client, "CREATE TAG last").await;
        tags.insert("last".into(), (epoch, rows.clone()));
    }
    // The oldest tag is then certainly below what retention keeps.
    write(&client, "ALTER TABLE kv SET (retain_epochs = 1)").await;
    for _ in 0..2 {
        let sql = common::random_kv_change(&mut rng, 20..80, &mut next_key, &mut rows);
        if let Some(epoch) = write(&client, &sql).await {
            versions.push((epoch, rows.clone()));
        }
    }
    // A table archived whole: every version retention lets go moves to the archive.
    write(
        &client,
        "CREATE TABLE whole (k BIGINT PRIMARY KEY, v BIGINT)",
    )
    .await;
    write(
        &client,
        "ALTER TABLE whole SET (archive = true, retain_epochs = 1)",
    )
    .await;
    let (mut whole_rows, mut whole_key) = (Rows::new(), 0i64);
    let mut whole: Vec<(u64, Rows)> = Vec::new();
    while whole.len() < 5 {
        let sql = common::random_kv_change(&mut rng, 20..80, &mut whole_key, &mut whole_rows)
            .replace(" kv ", " whole ");
        if let Some(epoch) = write(&client, &sql).await {
            whole.push((epoch, whole_rows.clone()));
        }
    }
    let status = wait_until(
        "the leader archives every tagged epoch retention passed",
        Duration::from_secs(120),
        || async {
            let status = client.status().await.ok()?;
            status.meta.archive_due().is_empty().then_some(status)
        },
    )
    .await;
    flush_everywhere(&cluster).await;
    let horizon = status.meta.retention_horizon("kv");
    let archived: Vec<u64> = status.meta.archive["kv"].keys().map(|e| e.0).collect();
    let oldest_tag = tags.values().map(|(e, _)| *e).min().unwrap();
    assert!(
        horizon.0 > oldest_tag,
        "the horizon ({horizon}) passed the oldest tag ({oldest_tag})"
    );
    assert!(
        archived.contains(&oldest_tag),
        "tagged epoch {oldest_tag} archived: {archived:?}"
    );
    let health = status.meta.archive_health();
    assert_eq!(
        health.fewest_live,
        Some((6, 2)),
        "every fragment on a live node: {health:?}"
    );
    println!(
        "horizon {horizon}, archived epochs {archived:?}, {} components",
        health.components
    );
    let whole_horizon = status.meta.retention_horizon("whole");
    assert_eq!(
        whole_horizon.0,
        whole.last().unwrap().0,
        "retain_epochs = 1 keeps the last version"
    );
    let whole_archived: Vec<u64> = status.meta.archive["whole"].keys().map(|e| e.0).collect();
    for (epoch, _) in &whole[..whole.len() - 1] {
        assert!(
            whole_archived.contains(epoch),
            "version {epoch} of whole archived: {whole_archived:?}"
        );
    }

    // Damage: a deleted fragment, a flipped fragment, a flipped component, on three nodes.
    let deleted = files(root.path(), 2, "fragments", "fragment")[0].clone();
    std::fs::remove_file(&deleted).unwrap();
    let flipped = files(root.path(), 3, "fragments", "fragment")[0].clone();
    common::flip_a_byte(&flipped);
    let component = files(root.path(), 4, "components", "parquet")[0].clone();
    common::flip_a_byte(&component);
    let (ok, out) = common::tessera_at_node_1(BINARY, &cluster, ["scrub"]);
    assert!(ok, "{out}");
    let damaged = out.matches("  damaged:").count();
    let repaired = out.matches("  repaired:").count();
    assert_eq!((damaged, repaired), (3, 3), "{out}");
    for path in [&deleted, &flipped, &component] {
        assert!(hashes_right(path), "{} repaired: {out}", path.display());
    }
    let (ok, again) = common::tessera_at_node_1(BINARY, &cluster, ["scrub"]);
    assert!(ok && !again.contains("  damaged:"), "{again}");
    // Two nodes die; the tags (archived or not) still answer: the first reads of archived
    // components, so every one is rebuilt from the four fragments left.
    let mut victims: Vec<u64> = (2..=7).collect();
    let first = victims.remove(rng.random_range(0..victims.len()));
    let second = victims.remove(rng.random_range(0..victims.len()));
    println!("killing nodes {first} and {second}");
    cluster.kill9(first);
    cluster.kill9(second);
    wait_until("both declared failed", Duration::from_secs(60), || async {
        let status = client.status().await.ok()?;
        (status.meta.live_nodes().count() == 5).then_some(())
    })
    .await;
    check_tags(&client, &tags, "two nodes dead").await;
    // Every epoch the model wrote: exact, or refused naming the horizon.
    let mut refused = 0;
    for (epoch, expected) in &versions {
        match rows_of(&client, &format!("SELECT k, v FROM kv AS OF EPOCH {epoch}")).await {
            Ok(answer) => assert_eq!(&answer, expected, "AS OF EPOCH {epoch}"),
            Err(error) => {
                assert!(
                    *epoch < horizon.0,
                    "epoch {epoch} at or above the horizon {horizon} refused: {error}"
                );
                assert!(
                    error.contains("no longer retained") && error.contains(&horizon.to_string()),
                    "{error}"
                );
                refused += 1;
            }
        }
    }
    println!(
        "{refused} of {} epochs below the horizon and not archived",
        versions.len()
    );
    // Every version of the table archived whole answers exactly, and so does every epoch
    // between two of them.
    for (i, (epoch, expected)) in whole.iter().enumerate() {
        let until = whole.get(i + 1).map_or(*epoch + 1, |(next, _)| *next);
        for at in *epoch..until {
            let answer = rows_of(&client, &format!("SELECT k, v FROM whole AS OF EPOCH {at}"))
                .await
                .unwrap_or_else(|e| panic!("whole AS OF EPOCH {at}: {e}"));
            assert_eq!(
                &answer, expected,
                "whole AS OF EPOCH {at} (version of epoch {epoch})"
            );
        }
    }

    // Re-replication: the dead nodes' fragments are rebuilt where none of their
    // component's are.
    wait_until(
        "the lost fragments rebuilt on live nodes",
        Duration::from_secs(120),
        || async {
            let status = client.status().await.ok()?;
            (status.meta.archive_health().fewest_live == Some((5, 2))).then_some(())
        },
    )
    .await;
    let (_, status_out) = common::tessera_at_node_1(BINARY, &cluster, ["status"]);
    assert!(
        status_out.contains("fewest live fragments of one component: 5 of 6"),
        "{status_out}"
    );
    let (ok, scrubbed) = common::tessera_at_node_1(BINARY, &cluster, ["scrub"]);
    assert!(ok && !scrubbed.contains("  damaged:"), "{scrubbed}");
    check_tags(&client, &tags, "after re-replication").await;

    // Dropping every tag and the whole-table archive lets every archived epoch go; the
    // next scrub deletes every fragment on the live nodes.
    for name in tags.keys() {
        write(&client, &format!("DROP TAG \"{name}\"")).await;
    }
    write(&client, "ALTER TABLE whole RESET (archive)").await;
    assert!(client.status().await.unwrap().meta.archive.is_empty());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (ok, collected) = common::tessera_at_node_1(BINARY, &cluster, ["scrub"]);
    assert!(
        ok && collected.contains("archive fragments no archived epoch names any more"),
        "{collected}"
    );
    for id in (1..=7).filter(|id| *id != first && *id != second) {
        let left = files(root.path(), id, "fragments", "fragment");
        assert!(
            left.is_empty(),
            "node {id} still holds fragments {left:?}: {collected}"
        );
    }
    assert_eq!(
        rows_of(&client, "SELECT k, v FROM kv").await.unwrap(),
        rows,
        "the current rows"
    );
}
