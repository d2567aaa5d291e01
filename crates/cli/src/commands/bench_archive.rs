//! `tessera bench archive`: what the erasure-coded archive costs and saves. A local cluster
//! of `nodes` storage nodes (r = 3; the archive's k and m from `[archive]`, 4 and 2 by
//! default) loads TPC-H; a tag pins the loaded epoch; `lineitem` then keeps one version and
//! changes, so the leader archives the tagged epoch and the horizon passes it. Printed, in
//! one run:
//!
//! - bytes on disk per logical byte: the replicas' component files against the distinct
//!   components (r = 3), and the archive's fragment files against the archived components
//!   (goal ≤ 1.6 for k = 4, m = 2);
//! - the time to read the tagged epoch from the replicas (before archiving) against from the
//!   archive, cold (every component rebuilt from fragments) and warm (from the cache);
//! - with `--compute-sf`, `tessera bench compute`'s TPC-H comparison (3 storage nodes alone
//!   vs with 2 compute nodes) and the compute caches' hit rates.

use super::bench::median;
use super::bench_distributed::ensure_tpch;
use super::local_cluster::LocalCluster;
use super::timing::{poll_until, timed};
use super::up::UpOptions;
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Reads every column the queries below touch, so the whole table is rebuilt.
const QUERY: &str = "SELECT l_returnflag, l_linestatus, count(*) AS n, sum(l_quantity) AS q, sum(l_extendedprice * (1 - l_discount)) AS revenue FROM lineitem AS OF TAG bench_archive GROUP BY l_returnflag, l_linestatus ORDER BY l_returnflag, l_linestatus";

/// Total bytes of the files under every node's `store/<dir>` with extension `ext`, of the
/// distinct files among them (by name: components and fragments are named by hash), and
/// how many distinct files only one node has.
fn bytes_on_disk(root: &Path, nodes: u64, dir: &str, ext: &str) -> Result<(u64, u64, usize)> {
    let (mut total, mut distinct) = (0, BTreeMap::<String, (u64, usize)>::new());
    for id in 1..=nodes {
        let path = root.join(format!("node-{id}/data/store/{dir}"));
        for entry in std::fs::read_dir(&path)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if !name.ends_with(ext) {
                continue;
            }
            let len = entry.metadata()?.len();
            total += len;
            distinct.entry(name).or_insert((len, 0)).1 += 1;
        }
    }
    let single = distinct.values().filter(|(_, copies)| *copies == 1).count();
    Ok((total, distinct.values().map(|(len, _)| len).sum(), single))
}

pub async fn run(
    data_dir: &Path,
    nodes: u64,
    partitions: u32,
    sf: f64,
    runs: usize,
    compute_sf: f64,
) -> Result<()> {
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    let root = data_dir.join(format!("bench-archive-sf{sf}"));
    if root.exists() {
        // Each run archives afresh: the tag and retention would otherwise be there already.
        std::fs::remove_dir_all(&root)?;
    }
    let mut cluster =
        LocalCluster::start_on_free_ports(&root, UpOptions::new(nodes, partitions, 3))?;
    cluster.wait_formed(Duration::from_secs(60)).await?;
    ensure_tpch(&cluster, sf, &format!("{nodes}-node cluster"), &root).await?;
    let client = cluster.client(0);
    client.sql("CREATE TAG bench_archive").await?;
    let expected = client.query(QUERY).await?;
    let mut replicated = Vec::new();
    for _ in 0..runs {
        replicated.push(timed(|| client.query(QUERY)).await?.0);
    }
    // Standbys receive their primaries' components a moment after a flush: measure once no
    // component is on one node only (or after 30 s).
    let mut replicas_on_disk = bytes_on_disk(&root, nodes, "components", ".parquet")?;
    for _ in 0..60 {
        if replicas_on_disk.2 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        replicas_on_disk = bytes_on_disk(&root, nodes, "components", ".parquet")?;
    }
    let (replica_bytes, component_bytes, single) = replicas_on_disk;

    client
        .sql("ALTER TABLE lineitem SET (retain_epochs = 1)")
        .await?;
    client
        .sql("DELETE FROM lineitem WHERE l_orderkey < 100")
        .await?;
    let archiving = std::time::Instant::now();
    poll_until(
        "the leader to archive the tagged epoch",
        Duration::from_secs(1800),
        || async {
            client.status().await.is_ok_and(|s| {
                s.meta.archive.contains_key("lineitem") && s.meta.archive_due().is_empty()
            })
        },
    )
    .await?;
    let archive_time = archiving.elapsed();
    let status = client.status().await?;
    let archived = &status.meta.archive["lineitem"];
    let logical: u64 = archived
        .values()
        .flat_map(|a| a.components.iter())
        .map(|c| c.component.bytes)
        .sum();
    let (fragment_bytes, _, _) = bytes_on_disk(&root, nodes, "fragments", ".fragment")?;
    let (k, m) = archived
        .values()
        .flat_map(|a| a.components.first())
        .map(|c| (c.data_fragments, c.parity_fragments))
        .next()
        .unwrap_or((0, 0));

    let (cold, answer) = timed(|| client.query(QUERY)).await?;
    let mut warm = Vec::new();
    for _ in 0..runs {
        warm.push(timed(|| client.query(QUERY)).await?.0);
    }
    let same = tessera_tpch::compare::same_answer(&expected, &answer, 1e-9);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let replicated_ms = ms(median(&mut replicated));
    let warm_ms = ms(median(&mut warm));
    println!();
    println!(
        "TPC-H SF {sf} on {nodes} storage nodes (r = 3), lineitem's tagged epoch archived with k = {k}, m = {m} in {:.1} s",
        archive_time.as_secs_f64()
    );
    println!(
        "bytes on disk per logical byte: replicas {:.2} ({} of component files for {} of distinct components, {single} of them on one node only), archive {:.2} ({} of fragments for {} of archived components; goal <= 1.6)",
        replica_bytes as f64 / component_bytes.max(1) as f64,
        super::scrub::human_bytes(replica_bytes),
        super::scrub::human_bytes(component_bytes),
        fragment_bytes as f64 / logical.max(1) as f64,
        super::scrub::human_bytes(fragment_bytes),
        super::scrub::human_bytes(logical),
    );
    println!(
        "reading the tagged epoch (median of {runs}): replicas {replicated_ms:.1} ms; archive cold {:.1} ms ({:.2}x, every component rebuilt from fragments), warm {warm_ms:.1} ms ({:.2}x, from the component cache); answer {}",
        ms(cold),
        ms(cold) / replicated_ms,
        warm_ms / replicated_ms,
        match &same {
            Ok(()) => "the same".to_string(),
            Err(diff) => format!("DIFFERENT: {diff}"),
        }
    );
    cluster.stop();
    if same.is_err() {
        bail!("the archived epoch's answer differs from the replicated one's");
    }
    if compute_sf > 0.0 {
        super::bench_compute::run(data_dir, 3, 2, partitions, compute_sf, &[], runs).await?;
    }
    Ok(())
}
