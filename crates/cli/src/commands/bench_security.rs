//! `tessera bench security`: what mutual TLS on the internal port and signed epochs cost.
//! Two 3-node clusters (r = 3) on this machine hold the same data. The secure one runs
//! under mutual TLS, and its lineitem table belongs to a participant with a signing key,
//! whose user publishes: each publish computes its version ids and is signed and checked.
//! The other runs in plaintext (`insecure = true`) with version ids off
//! (`replicas.version_ids = false`), the operator publishing. Each publish and each TPC-H
//! query runs on both in turn, in the same run, and the medians are compared.
//!
//! Publishes also run on a third cluster, under mutual TLS but unsealed (the operator
//! publishing, version ids off), so the publish's cost splits into what the transport's
//! encryption costs and what sealing (hashing the rows, signing, checking) adds to it.

use super::bench::{chosen_queries, median};
use super::bench_distributed::ensure_tpch;
use super::local_cluster::LocalCluster;
use super::timing::{cpu_seconds, quartiles, timed, wait_quiet};
use super::up::UpOptions;
use anyhow::{bail, Result};
use arrow::array::RecordBatch;
use std::path::Path;
use std::time::Duration;
use tessera_server::ClusterClient;

const NODES: u64 = 3;

/// Versions of lineitem kept (see [`cluster`]).
const KEPT_VERSIONS: u64 = 2;

/// The participant that owns lineitem on the secure cluster, and its user.
const ORG: &str = "bench_org";
const USER: &str = "bench-user";

/// How a benchmark cluster's nodes talk and seal their publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Security {
    /// Plaintext, no version ids: the baseline.
    Plaintext,
    /// Mutual TLS, no version ids: what the transport alone costs.
    Tls,
    /// Mutual TLS with version ids (and, once [`sign_lineitem`] ran, signed epochs).
    TlsSealed,
}

impl Security {
    fn describe(self) -> &'static str {
        match self {
            Security::Plaintext => "plaintext",
            Security::Tls => "mutual TLS, unsealed",
            Security::TlsSealed => "mutual TLS",
        }
    }
}

/// A 3-node cluster under `root`, secured as `security` says, with TPC-H SF `sf` loaded.
async fn cluster(
    root: &Path,
    security: Security,
    partitions: u32,
    sf: f64,
) -> Result<(LocalCluster, ClusterClient)> {
    let mut options = UpOptions::new(NODES, partitions, 3);
    options.insecure = security == Security::Plaintext;
    options.version_ids = security == Security::TlsSealed;
    let mut cluster = LocalCluster::start_on_free_ports(root, options)?;
    cluster.wait_formed(Duration::from_secs(60)).await?;
    let what = security.describe();
    ensure_tpch(&cluster, sf, &format!("{what} cluster"), root).await?;
    let client = cluster.client(0);
    // The publishes below upsert the same rows run after run: keeping every version would
    // make each run's queries read more history than the last one's.
    client
        .sql(&format!(
            "ALTER TABLE lineitem SET (retain_epochs = {KEPT_VERSIONS})"
        ))
        .await?;
    Ok((cluster, client))
}

pub async fn run(
    data_dir: &Path,
    partitions: u32,
    sf: f64,
    queries: &[usize],
    runs: usize,
    publishes: usize,
) -> Result<()> {
    let queries = chosen_queries(queries, runs)?;
    let root = data_dir.join(format!("bench-security-sf{sf}"));
    let (secure_cluster, secure) =
        cluster(&root.join("mtls"), Security::TlsSealed, partitions, sf).await?;
    let (plain_cluster, plain) =
        cluster(&root.join("insecure"), Security::Plaintext, partitions, sf).await?;
    let signer = sign_lineitem(&secure_cluster, &secure, &root.join("mtls")).await?;

    println!();
    println!(
        "mutual TLS and signed epochs vs plaintext and no version ids: two {NODES}-node clusters (r = 3) on this machine's {} cores, TPC-H SF {sf}, median of {runs} run(s) each, in turn",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>5} {:>10} {:>15} {:>9}  answer",
        "query", "mTLS (ms)", "plaintext (ms)", "mTLS/pt"
    );
    let mut log_ratio = 0.0f64;
    let mut mismatches = Vec::new();
    // A cluster just loaded checkpoints and ships components for a while: its queries then
    // ran 2-3 times slower than the other's (a geomean of 0.38). Each query is timed once
    // both clusters are quiet.
    let query_pids: Vec<u32> = [&secure_cluster, &plain_cluster]
        .iter()
        .flat_map(|cluster| cluster.pids())
        .collect();
    let mut not_quiet = 0;
    for &q in &queries {
        if !wait_quiet(&query_pids, Duration::from_secs(60)).await {
            not_quiet += 1;
        }
        let sql = tessera_tpch::query(q);
        let expected = plain.query(sql).await?;
        let actual = secure.query(sql).await?;
        let answer = match tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
            Ok(()) => "same".to_string(),
            Err(diff) => {
                mismatches.push(q);
                format!("DIFFERENT: {diff}")
            }
        };
        let (mut t_tls, mut t_plain) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            t_tls.push(timed(|| secure.query(sql)).await?.0);
            t_plain.push(timed(|| plain.query(sql)).await?.0);
        }
        let (tls, pt) = (median(&mut t_tls), median(&mut t_plain));
        let ratio = tls.as_secs_f64() / pt.as_secs_f64();
        log_ratio += ratio.ln();
        println!(
            "{:>5} {:>10.1} {:>15.1} {:>8.2}x  {answer}",
            format!("Q{q}"),
            tls.as_secs_f64() * 1e3,
            pt.as_secs_f64() * 1e3,
            ratio
        );
    }
    let geomean = (log_ratio / queries.len() as f64).exp();
    println!("TPC-H geomean, mTLS / plaintext: {geomean:.3}x (goal: at most 1.05x; {not_quiet} queries timed before both clusters were quiet)");
    // Publishes: the same lineitem rows (upserts of existing keys) on both, in turn.
    let lineitem = tessera_tpch::table("lineitem").expect("lineitem");
    let rows: Vec<RecordBatch> = lineitem
        .generate(0.02, 64 * 1024)
        .collect::<Result<_, _>>()?;
    let count: usize = rows.iter().map(|b| b.num_rows()).sum();
    // The transport alone: publishes only, so its queries are not needed.
    let (tls_cluster, tls_only) =
        cluster(&root.join("mtls-unsealed"), Security::Tls, partitions, sf).await?;
    let pids = [&secure_cluster, &plain_cluster, &tls_cluster].map(LocalCluster::pids);
    let publishes =
        timed_publishes([&signer, &plain, &tls_only], &rows, &pids, publishes.max(1)).await?;
    publishes.print(count);
    // The secure cluster's publishes must have been signed, or this measured nothing.
    let signed = secure
        .query(&format!(
            "SELECT count(*) AS n FROM tessera_epochs WHERE signature = 'valid ({ORG})'"
        ))
        .await?;
    let signed = super::answers::first_int64(&signed)?.unwrap_or(0);
    println!("signed epochs with a valid signature on the secure cluster: {signed}");
    if signed == 0 {
        bail!("the secure cluster's publishes were not signed");
    }
    if !mismatches.is_empty() {
        bail!("queries {mismatches:?} answered differently under mutual TLS");
    }
    Ok(())
}

/// Publish times on each cluster (signed, plaintext, TLS only), in the order taken, and the
/// CPU seconds its nodes spent on each (its background work included).
struct Publishes {
    times: [Vec<Duration>; 3],
    cpu_seconds: [Vec<f64>; 3],
    /// Publishes timed before the clusters went quiet (the wait has a deadline).
    not_quiet: usize,
}

/// Publishes `rows` to lineitem `n` times on each cluster (mTLS and signed, plaintext,
/// mTLS unsealed), in turn: the cluster that goes first rotates, so none always follows
/// another's background work. Each publish starts once every node of every cluster is
/// quiet: a publish's checkpoints and flushes are then charged to neither the next publish
/// nor another cluster, and its CPU is counted until its cluster is quiet again.
async fn timed_publishes(
    clients: [&ClusterClient; 3],
    rows: &[RecordBatch],
    cluster_pids: &[Vec<u32>; 3],
    n: usize,
) -> Result<Publishes> {
    const QUIET_PATIENCE: Duration = Duration::from_secs(20);
    let pids: Vec<u32> = cluster_pids.iter().flatten().copied().collect();
    let mut publishes = Publishes {
        times: Default::default(),
        cpu_seconds: Default::default(),
        not_quiet: 0,
    };
    for round in 0..n {
        for turn in 0..clients.len() {
            let which = (round + turn) % clients.len();
            if !wait_quiet(&pids, QUIET_PATIENCE).await {
                publishes.not_quiet += 1;
            }
            let client = clients[which];
            let cpu_before = cpu_seconds(&cluster_pids[which]);
            let (took, _) = timed(|| client.publish("lineitem", rows.to_vec(), false)).await?;
            publishes.times[which].push(took);
            wait_quiet(&cluster_pids[which], QUIET_PATIENCE).await;
            publishes.cpu_seconds[which].push(cpu_seconds(&cluster_pids[which]) - cpu_before);
        }
    }
    Ok(publishes)
}

impl Publishes {
    fn print(self, rows: usize) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let not_quiet = self.not_quiet;
        // Each round's publishes ran one after another under the same load: the ratio of
        // two clusters' times in a round leaves out the machine's drift between rounds.
        let [signed_by_round, plain_by_round, tls_by_round] = &self.times;
        let paired = |a: &[Duration], b: &[Duration]| {
            quartiles(
                a.iter()
                    .zip(b)
                    .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64())
                    .collect(),
            )
        };
        let (signed_low, signed_mid, signed_high) = paired(signed_by_round, plain_by_round);
        let (sealing_low, sealing_mid, sealing_high) = paired(signed_by_round, tls_by_round);
        let n = self.times[0].len();
        let [signed, plain, tls] = &self.times;
        let (s_low, s_mid, s_high) = quartiles(signed.clone());
        let (p_low, p_mid, p_high) = quartiles(plain.clone());
        let (t_low, t_mid, t_high) = quartiles(tls.clone());
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        println!(
            "publish of {rows} lineitem rows, median of {n} on each after every cluster went quiet ({not_quiet} timed before): mTLS + signed {:.1} ms (middle half {:.1}-{:.1}), plaintext unsealed {:.1} ms ({:.1}-{:.1}): {:.3}x ({:.0} vs {:.0} rows/s) (goal: at most 1.05x)",
            ms(s_mid),
            ms(s_low),
            ms(s_high),
            ms(p_mid),
            ms(p_low),
            ms(p_high),
            ratio(s_mid, p_mid),
            rows as f64 / s_mid.as_secs_f64(),
            rows as f64 / p_mid.as_secs_f64()
        );
        println!(
            "  of which the transport: mTLS unsealed {:.1} ms ({:.1}-{:.1}), {:.3}x plaintext; sealing and signing: {:.3}x mTLS unsealed",
            ms(t_mid),
            ms(t_low),
            ms(t_high),
            ratio(t_mid, p_mid),
            ratio(s_mid, t_mid)
        );
        let [signed_cpu, plain_cpu, tls_cpu] = self.cpu_seconds.map(|cpu| quartiles(cpu).1);
        println!(
            "  CPU seconds per publish, all three nodes, background work included (median): mTLS + signed {signed_cpu:.2}, plaintext unsealed {plain_cpu:.2}, mTLS unsealed {tls_cpu:.2}: {:.3}x plaintext, of which sealing and signing {:.3}x mTLS unsealed",
            signed_cpu / plain_cpu,
            signed_cpu / tls_cpu
        );
        println!(
            "  paired by round (each round's publishes back to back): mTLS + signed / plaintext {signed_mid:.3}x (middle half {signed_low:.3}-{signed_high:.3}) (goal: at most 1.05x); sealing and signing / mTLS unsealed {sealing_mid:.3}x ({sealing_low:.3}-{sealing_high:.3})"
        );
    }
}

/// Hands the secure cluster's lineitem to a participant with a signing key (its secret on
/// every node), and returns a client acting as that participant's user: its publishes are
/// sealed and signed. A second run finds all of it done.
async fn sign_lineitem(
    cluster: &LocalCluster,
    admin: &ClusterClient,
    root: &Path,
) -> Result<ClusterClient> {
    let certs = root.join("certs");
    if !certs.join(format!("{USER}.pem")).exists() {
        super::certs::client(&certs, USER, super::certs::Expiry::Days(30))?;
    }
    let first = cluster.configs()[0].parent().expect("a node directory");
    let key_file = tessera_common::signing::key_path(
        &first.join("data").join(tessera_server::node::KEYS_DIR),
        ORG,
    );
    if !key_file.exists() {
        tessera_common::signing::SigningKey::generate()
            .write(&key_file)
            .map_err(anyhow::Error::msg)?;
    }
    for config in &cluster.configs()[1..] {
        let keys = config
            .parent()
            .expect("a node directory")
            .join("data")
            .join(tessera_server::node::KEYS_DIR);
        std::fs::create_dir_all(&keys)?;
        std::fs::copy(&key_file, tessera_common::signing::key_path(&keys, ORG))?;
    }
    let public = tessera_common::signing::SigningKey::read(&key_file)
        .map_err(anyhow::Error::msg)?
        .public_hex();
    let state = admin.current_metadata().await?;
    if !state.participants.contains_key(ORG) {
        for sql in [
            format!("CREATE PARTICIPANT {ORG}"),
            format!("CREATE USER \"{USER}\" WITH PASSWORD 'bench' IN PARTICIPANT {ORG}"),
            format!("GRANT writer TO \"{USER}\""),
            format!("ALTER TABLE lineitem OWNER TO {ORG}"),
            format!("ALTER PARTICIPANT {ORG} ADD KEY '{public}'"),
        ] {
            admin.sql(&sql).await?;
        }
    }
    let tls = tessera_common::tls::MutualTls::from_dir(&certs, USER).map_err(anyhow::Error::msg)?;
    Ok(ClusterClient::with_tls(&cluster.addrs[0], Some(&tls)))
}
