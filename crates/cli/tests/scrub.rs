//! The scrubber on a real 3-node cluster (r = 3): nodes 1 and 2 scrub in the background
//! every 500 ms; node 3 only on demand. A byte flipped in one of node 2's components is
//! found and repaired by its background scrubber; a flipped byte and a deleted file on
//! node 3 are both found by `tessera scrub`, which names them and repairs them; the next
//! `tessera scrub` finds nothing, and queries answer as before.

mod common;

use common::{flush_everywhere, load_tpch_tables, wait_formed, wait_until};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_server::ClusterClient;
use tessera_testkit::LocalCluster;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");

fn scrub(cluster: &LocalCluster) -> (bool, String) {
    common::tessera_at_node_1(BINARY, cluster, ["scrub"])
}

/// Node `id`'s component files, largest first.
fn components(root: &Path, id: u64) -> Vec<PathBuf> {
    let dir = root.join(format!("node-{id}/data/store/components"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    files.sort_by_key(|p| std::cmp::Reverse(std::fs::metadata(p).unwrap().len()));
    files
}

fn stem(path: &Path) -> String {
    path.file_stem().unwrap().to_string_lossy().to_string()
}

const QUERY: &str = "SELECT l_returnflag, count(*) AS n, sum(l_quantity) AS q FROM lineitem GROUP BY l_returnflag ORDER BY l_returnflag";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrubber_finds_every_damaged_component_and_repairs_it() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::configure(Path::new(BINARY), root.path(), 3, 8, 3);
    cluster.set_option("scrub.every_ms", "500");
    // Node 3 scrubs only when asked.
    let config = cluster.config_path(3);
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            "data_dir = \"data\"\n",
            "data_dir = \"data\"\nscrub.bytes_per_sec = 0\n",
        ),
    )
    .unwrap();
    cluster.log_to_files();
    cluster.start_all();
    wait_formed(&cluster, 1, 3).await;
    let client = ClusterClient::new(cluster.addr(1));
    load_tpch_tables(&cluster, 0.01, &["orders", "lineitem"]).await;
    flush_everywhere(&cluster).await;
    let before = arrow::util::pretty::pretty_format_batches(&client.query(QUERY).await.unwrap())
        .unwrap()
        .to_string();

    // Node 2's background scrubber finds a flipped byte and repairs it.
    let on_two = components(root.path(), 2)[0].clone();
    common::flip_a_byte(&on_two);
    let log = cluster.log_path(2);
    wait_until(
        "node 2's scrubber repairs its damaged component",
        Duration::from_secs(60),
        || async {
            let logged = std::fs::read_to_string(&log).unwrap_or_default();
            (logged.contains("scrub found damaged components") && logged.contains(&stem(&on_two)))
                .then_some(())
        },
    )
    .await;

    // Node 3 does not scrub by itself: `tessera scrub` finds both of its damaged files.
    let on_three = components(root.path(), 3);
    common::flip_a_byte(&on_three[0]);
    std::fs::remove_file(&on_three[1]).unwrap();
    let (ok, text) = scrub(&cluster);
    eprintln!("tessera scrub:\n{text}");
    assert!(ok, "every damaged component was repaired: {text}");
    let node_three = text
        .lines()
        .skip_while(|l| !l.starts_with("node 3:"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(node_three.contains("2 damaged, 2 repaired"), "{text}");
    for damaged in &on_three[..2] {
        assert!(
            node_three.contains(&stem(damaged)),
            "names {}: {text}",
            stem(damaged)
        );
    }
    assert!(
        node_three.contains("does not match its name") || node_three.contains("hashes to"),
        "{text}"
    );

    // Repaired for good: a second pass finds nothing anywhere, and queries answer as before.
    wait_until(
        "a clean scrub everywhere",
        Duration::from_secs(60),
        || async {
            let (ok, text) = scrub(&cluster);
            (ok && text.matches(" 0 damaged").count() == 3).then_some(())
        },
    )
    .await;
    let after = arrow::util::pretty::pretty_format_batches(&client.query(QUERY).await.unwrap())
        .unwrap()
        .to_string();
    assert_eq!(before, after);
    let status = client.status().await.unwrap();
    assert!(status.last_scrub.is_some(), "status shows the last scrub");
    assert!(
        cluster.panics_logged().is_empty(),
        "{:?}",
        cluster.panics_logged()
    );
}
