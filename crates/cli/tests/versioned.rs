//! Versioned data against a model: random publishes (inserts, updates, deletes) and tags on
//! a 3-node cluster (r=3), each recorded in an in-memory model of the table's history.
//! Every `AS OF EPOCH`, `AS OF TIMESTAMP` and `AS OF TAG` answer must equal the model's,
//! before and after every node is SIGKILLed and restarted; the epoch log and the tags are
//! readable as system tables; bad time-travel input is refused by name and changes nothing.

use arrow::array::{Array, Int64Array, RecordBatch, StringArray};
use rand::SeedableRng;
use std::collections::BTreeMap;
use std::time::Duration;
use tessera_server::ClusterClient;
use tessera_sql::StatementOutput;

mod common;
use common::wait_formed;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const PARTITIONS: u32 = 8;

type Rows = BTreeMap<i64, i64>;

/// One acknowledged publish and the table as it was right after it.
struct Version {
    epoch: u64,
    /// Client wall-clock times just before the statement was sent and just after it was
    /// acknowledged (the nodes share this machine's clock).
    sent_ms: u64,
    acked_ms: u64,
    rows: Rows,
}

/// The table's history as the test wrote it.
#[derive(Default)]
struct Model {
    versions: Vec<Version>,
    /// Tag name → the rows it pins.
    tags: BTreeMap<String, (u64, Rows)>,
}

impl Model {
    fn current(&self) -> Rows {
        self.versions
            .last()
            .map(|v| v.rows.clone())
            .unwrap_or_default()
    }

    fn at_epoch(&self, epoch: u64) -> Rows {
        self.versions
            .iter()
            .take_while(|v| v.epoch <= epoch)
            .last()
            .map(|v| v.rows.clone())
            .unwrap_or_default()
    }
}

fn int64(batch: &RecordBatch, column: usize) -> &Int64Array {
    batch
        .column(column)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap_or_else(|| panic!("column {column} is {:?}", batch.column(column).data_type()))
}

async fn rows_of(client: &ClusterClient, sql: &str) -> Rows {
    let batches = client
        .query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let mut rows = Rows::new();
    for batch in &batches {
        let (k, v) = (int64(batch, 0), int64(batch, 1));
        for i in 0..batch.num_rows() {
            rows.insert(k.value(i), v.value(i));
        }
    }
    rows
}

/// Runs one statement and returns the epoch that made it visible (`None` if it changed
/// nothing).
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

async fn error_of(client: &ClusterClient, sql: &str) -> String {
    match client.sql(sql).await {
        Ok(outputs) => panic!("{sql} was accepted: {outputs:?}"),
        Err(error) => error.to_string(),
    }
}

/// `ms` as a timestamp literal, UTC.
fn timestamp(ms: u64) -> String {
    tessera_common::time::format_ms(ms)
        .trim_end_matches(" UTC")
        .to_string()
}

/// Checks every version by epoch and by time, and every tag, against the model.
async fn check_history(client: &ClusterClient, model: &Model, when: &str) {
    for (i, version) in model.versions.iter().enumerate() {
        let by_epoch = rows_of(
            client,
            &format!(
                "SELECT k, v FROM kv AS OF EPOCH {} ORDER BY k",
                version.epoch
            ),
        )
        .await;
        assert_eq!(
            by_epoch, version.rows,
            "{when}: AS OF EPOCH {}",
            version.epoch
        );
        // A time after this publish was acknowledged and before the next was sent sees
        // exactly this version.
        let until = model
            .versions
            .get(i + 1)
            .map_or(version.acked_ms + 20, |next| next.sent_ms);
        let at = version.acked_ms + (until - version.acked_ms) / 2;
        let by_time = rows_of(
            client,
            &format!(
                "SELECT k, v FROM kv AS OF TIMESTAMP '{}' ORDER BY k",
                timestamp(at)
            ),
        )
        .await;
        assert_eq!(
            by_time,
            version.rows,
            "{when}: AS OF TIMESTAMP {} (epoch {} was acknowledged at {})",
            timestamp(at),
            version.epoch,
            timestamp(version.acked_ms)
        );
    }
    check_diffs(client, model, when).await;
    for (name, (epoch, rows)) in &model.tags {
        let by_tag = rows_of(client, &format!("SELECT k, v FROM kv AS OF TAG \"{name}\"")).await;
        assert_eq!(&by_tag, rows, "{when}: AS OF TAG {name} (epoch {epoch})");
    }
    // The system tables list every publish and every tag.
    let epochs = client
        .query("SELECT epoch, kind, tables, rows_written FROM tessera_epochs WHERE kind = 'publish' ORDER BY epoch")
        .await
        .unwrap();
    let listed: Vec<i64> = epochs
        .iter()
        .flat_map(|b| int64(b, 0).values().to_vec())
        .collect();
    let written: Vec<u64> = model.versions.iter().map(|v| v.epoch).collect();
    assert_eq!(
        listed,
        written.iter().map(|&e| e as i64).collect::<Vec<_>>(),
        "{when}: tessera_epochs lists every publish"
    );
    for batch in &epochs {
        let tables = batch
            .column(2)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        assert!((0..batch.num_rows()).all(|i| tables.value(i) == "kv"));
    }
    let tags = client
        .query("SELECT name, epoch FROM tessera_tags ORDER BY name")
        .await
        .unwrap();
    let mut listed_tags = BTreeMap::new();
    for batch in &tags {
        let names = batch
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        for i in 0..batch.num_rows() {
            listed_tags.insert(names.value(i).to_string(), int64(batch, 1).value(i) as u64);
        }
    }
    let expected: BTreeMap<String, u64> = model
        .tags
        .iter()
        .map(|(n, (e, _))| (n.clone(), *e))
        .collect();
    assert_eq!(listed_tags, expected, "{when}: tessera_tags");
}

/// A 3-node cluster (r = 3) with table `kv` whose nodes keep small memtables, checkpoint
/// after every publish or two and merge eagerly.
async fn merging_cluster(root: &std::path::Path) -> (tessera_testkit::LocalCluster, ClusterClient) {
    let options = [
        ("store.memtable_flush_bytes", "2048"),
        ("store.checkpoint_log_bytes", "4096"),
        ("store.merge_threshold", "2"),
    ];
    common::kv_cluster_with(BINARY, root, PARTITIONS, 3, &options).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_as_of_answer_equals_the_model_before_and_after_restarts() {
    let root = tempfile::tempdir().unwrap();
    // The history spreads over many components, merged while it grows (under retention, at
    // the end), so diffs and time travel read versions from components of every age.
    let (mut cluster, client) = merging_cluster(root.path()).await;
    let seed: u64 = std::env::var("TESSERA_VERSIONED_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(17);
    println!("seed {seed} (TESSERA_VERSIONED_SEED reruns it)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut model = Model::default();
    let mut next_key = 0;
    for step in 0..30 {
        let mut rows = model.current();
        let sql = common::random_kv_change(&mut rng, 1..20, &mut next_key, &mut rows);
        // The gap keeps each version's time window wide enough to name.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let sent_ms = tessera_common::time::now_ms();
        let epoch = write(&client, &sql).await;
        let acked_ms = tessera_common::time::now_ms();
        if let Some(epoch) = epoch {
            model.versions.push(Version {
                epoch,
                sent_ms,
                acked_ms,
                rows,
            });
        } else {
            assert_eq!(
                rows,
                model.current(),
                "{sql} changed nothing, so the model must not"
            );
        }
        if step % 7 == 3 && !model.versions.is_empty() {
            let name = format!("step_{step}");
            let epoch = write(&client, &format!("CREATE TAG {name}")).await;
            let epoch = epoch.expect("CREATE TAG answers with the epoch it pins");
            assert_eq!(
                epoch,
                model.versions.last().unwrap().epoch,
                "a tag pins the newest epoch"
            );
            model.tags.insert(name, (epoch, model.current()));
        }
    }
    // A tag at an earlier epoch, named by number.
    let old = model.versions[model.versions.len() / 3].epoch;
    write(
        &client,
        &format!("CREATE TAG \"release-1.0\" AT EPOCH {old}"),
    )
    .await;
    model
        .tags
        .insert("release-1.0".into(), (old, model.at_epoch(old)));

    let components = count_files(root.path(), "parquet");
    assert!(
        components > 20,
        "only {components} components: the history never left the memtables"
    );
    check_history(&client, &model, "before restarts").await;
    check_bad_input(&client, &model).await;
    check_exports(cluster.addr(2), &model, root.path());

    // Every node is killed at once and restarted: the epoch log, the times and the tags
    // are in the Raft log and snapshots, not in memory.
    for id in cluster.node_ids() {
        cluster.kill9(id);
    }
    for id in cluster.node_ids() {
        cluster.start(id);
    }
    wait_formed(&cluster, 1, 3).await;
    for via in [2, 3] {
        let other = ClusterClient::new(cluster.addr(via));
        check_history(
            &other,
            &model,
            &format!("after restart, through node {via}"),
        )
        .await;
    }
    // A dropped tag is gone; the data it pinned is not.
    write(&client, "DROP TAG step_3").await;
    let error = error_of(&client, "SELECT * FROM kv AS OF TAG step_3").await;
    assert!(error.contains("tag \"step_3\" does not exist"), "{error}");
    model.tags.remove("step_3");
    check_history(&client, &model, "after DROP TAG").await;
    assert_eq!(
        rows_of(&client, "SELECT k, v FROM kv").await,
        model.current()
    );
    check_retention(&mut cluster, &client, &mut model, &mut rng, &mut next_key).await;
    drop(cluster);
}

/// The table's oldest readable epoch and retain_epochs, as `tessera_tables` lists them.
async fn listed_retention(client: &ClusterClient) -> (u64, Option<i64>) {
    let batches = client
        .query("SELECT oldest_readable_epoch, retain_epochs FROM tessera_tables WHERE name = 'kv'")
        .await
        .unwrap();
    let retain = int64(&batches[0], 1);
    (
        int64(&batches[0], 0).value(0) as u64,
        (!retain.is_null(0)).then(|| retain.value(0)),
    )
}

/// Retention: a setting that would drop a tagged epoch is refused and changes nothing;
/// once taken, merges run under it while publishes go on, every epoch at or above the
/// horizon (the 5th newest version) still reads exactly, before and after a restart of
/// every node, and every read or diff below it is refused naming the horizon.
async fn check_retention(
    cluster: &mut tessera_testkit::LocalCluster,
    client: &ClusterClient,
    model: &mut Model,
    rng: &mut rand::rngs::StdRng,
    next_key: &mut i64,
) {
    const KEEP: usize = 5;
    assert_eq!(
        listed_retention(client).await,
        (0, None),
        "every epoch kept"
    );
    // Retention is taken, but the tags pin the horizon: three nodes cannot hold a k = 4,
    // m = 2 archive, and the metadata leader says why it waits.
    write(
        client,
        &format!("ALTER TABLE kv SET (retain_epochs = {KEEP})"),
    )
    .await;
    let oldest_tag = model.tags.values().map(|(epoch, _)| *epoch).min().unwrap();
    assert_eq!(
        listed_retention(client).await,
        (oldest_tag, Some(KEEP as i64)),
        "the oldest tag pins the horizon"
    );
    let leader = client.status().await.unwrap().leader.unwrap();
    let leader = ClusterClient::new(cluster.addr(leader.0));
    common::wait_until(
        "the leader to say why it cannot archive",
        Duration::from_secs(30),
        || async {
            let waiting = leader.status().await.ok()?.archive_waiting;
            waiting
                .iter()
                .any(|w| w.contains("needs 6 live storage nodes"))
                .then_some(())
        },
    )
    .await;
    for name in std::mem::take(&mut model.tags).into_keys() {
        write(client, &format!("DROP TAG \"{name}\"")).await;
    }
    write(
        client,
        &format!("ALTER TABLE kv SET (retain_epochs = {KEEP})"),
    )
    .await;
    let horizon = |model: &Model| model.versions[model.versions.len() - KEEP].epoch;
    assert_eq!(
        listed_retention(client).await,
        (horizon(model), Some(KEEP as i64))
    );
    // More versions, merged under the moving horizon (eager merges, small memtables).
    for _ in 0..8 {
        let mut rows = model.current();
        let sql = common::random_kv_change(rng, 1..20, next_key, &mut rows);
        let sent_ms = tessera_common::time::now_ms();
        if let Some(epoch) = write(client, &sql).await {
            model.versions.push(Version {
                epoch,
                sent_ms,
                acked_ms: tessera_common::time::now_ms(),
                rows,
            });
        }
    }
    let check = |via: ClusterClient, model: &Model, when: &'static str| {
        let horizon = horizon(model);
        let versions: Vec<(u64, Rows)> = model
            .versions
            .iter()
            .map(|v| (v.epoch, v.rows.clone()))
            .collect();
        let current = model.current();
        async move {
            assert_eq!(listed_retention(&via).await.0, horizon, "{when}");
            for (epoch, rows) in &versions {
                let sql = format!("SELECT k, v FROM kv AS OF EPOCH {epoch} ORDER BY k");
                if *epoch >= horizon {
                    assert_eq!(&rows_of(&via, &sql).await, rows, "{when}: {sql}");
                } else {
                    let error = error_of(&via, &sql).await;
                    assert!(
                        error.contains("no longer retained")
                            && error.contains(&format!("oldest readable epoch is {horizon}")),
                        "{when}: {sql}: {error}"
                    );
                }
            }
            let at_horizon = &versions.iter().find(|(e, _)| *e == horizon).unwrap().1;
            let newest = versions.last().unwrap().0.to_string();
            let diff = diff_of(&via, &horizon.to_string(), &newest).await;
            assert_eq!(
                diff,
                model_diff(at_horizon, &current),
                "{when}: diff from the horizon"
            );
            let below = versions[0].0;
            let error = error_of(
                &via,
                &format!("SELECT * FROM tessera_changes('kv', {below}, {horizon})"),
            )
            .await;
            assert!(error.contains("no longer retained"), "{when}: {error}");
        }
    };
    check(
        ClusterClient::new(cluster.addr(1)),
        model,
        "under retention",
    )
    .await;
    for id in cluster.node_ids() {
        cluster.kill9(id);
    }
    for id in cluster.node_ids() {
        cluster.start(id);
    }
    wait_formed(cluster, 1, 3).await;
    check(
        ClusterClient::new(cluster.addr(3)),
        model,
        "under retention, after a restart",
    )
    .await;
}

/// (change, key, before, after), as the model says a diff must be.
type Change = (String, i64, Option<i64>, Option<i64>);

fn model_diff(before: &Rows, after: &Rows) -> Vec<Change> {
    let mut keys: Vec<i64> = before.keys().chain(after.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| match (before.get(&k), after.get(&k)) {
            (None, Some(&a)) => Some(("insert".into(), k, None, Some(a))),
            (Some(&b), None) => Some(("delete".into(), k, Some(b), None)),
            (Some(&b), Some(&a)) if a != b => Some(("update".into(), k, Some(b), Some(a))),
            _ => None,
        })
        .collect()
}

async fn diff_of(client: &ClusterClient, from: &str, to: &str) -> Vec<Change> {
    let sql = format!(
        "SELECT change, k, before_v, after_v FROM tessera_changes('kv', {from}, {to}) ORDER BY k"
    );
    let batches = client
        .query(&sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let mut changes = Vec::new();
    for batch in &batches {
        let kind = batch
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        let (k, before, after) = (int64(batch, 1), int64(batch, 2), int64(batch, 3));
        let value = |c: &Int64Array, i: usize| (!c.is_null(i)).then(|| c.value(i));
        for i in 0..batch.num_rows() {
            changes.push((
                kind.value(i).to_string(),
                k.value(i),
                value(before, i),
                value(after, i),
            ));
        }
    }
    changes
}

/// Diffs between versions (by epoch number, and from a tag to now) equal the model's.
async fn check_diffs(client: &ClusterClient, model: &Model, when: &str) {
    let versions = &model.versions;
    let mut pairs: Vec<(usize, usize)> =
        (1..versions.len()).map(|i| (i - 1, i)).step_by(4).collect();
    pairs.extend([(0, versions.len() - 1), (3, 3), (2, versions.len() / 2)]);
    for (from, to) in pairs {
        let (from, to) = (&versions[from], &versions[to]);
        assert_eq!(
            diff_of(client, &from.epoch.to_string(), &to.epoch.to_string()).await,
            model_diff(&from.rows, &to.rows),
            "{when}: tessera_changes from epoch {} to epoch {}",
            from.epoch,
            to.epoch
        );
    }
    for (name, (epoch, rows)) in &model.tags {
        assert_eq!(
            diff_of(
                client,
                &format!("'{name}'"),
                &versions.last().unwrap().epoch.to_string()
            )
            .await,
            model_diff(rows, &model.current()),
            "{when}: tessera_changes from tag {name} (epoch {epoch}) to now"
        );
    }
}

/// Runs the CLI against the node at `addr`; its standard output, or its error.
fn cli(addr: &str, args: &[&str]) -> Result<String, String> {
    let output = std::process::Command::new(BINARY)
        .arg("--node")
        .arg(addr)
        .args(args)
        .output()
        .unwrap();
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).to_string())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).to_string())
    }
}

/// `tessera export` and `COPY ... TO 'file'` write a tagged or older version to a file
/// here, equal to the model's; a bad target names itself and leaves no file behind.
fn check_exports(addr: &str, model: &Model, dir: &std::path::Path) {
    let (tag, (epoch, tagged)) = model.tags.iter().next().expect("a tag");
    let parquet = dir.join("tagged.parquet");
    let said = cli(
        addr,
        &[
            "export",
            "--table",
            "kv",
            "--as-of",
            tag,
            "-o",
            parquet.to_str().unwrap(),
        ],
    )
    .unwrap();
    assert!(
        said.contains(&format!("exported {} rows", tagged.len())),
        "{said}"
    );
    let file = std::fs::File::open(&parquet).unwrap();
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .unwrap()
        .build()
        .unwrap();
    let mut exported = Rows::new();
    for batch in reader {
        let batch = batch.unwrap();
        for i in 0..batch.num_rows() {
            exported.insert(int64(&batch, 0).value(i), int64(&batch, 1).value(i));
        }
    }
    assert_eq!(
        &exported, tagged,
        "tessera export --as-of {tag} (epoch {epoch})"
    );

    let version = &model.versions[model.versions.len() / 2];
    let csv = dir.join("older.csv");
    let copy = format!(
        "COPY (SELECT k, v FROM kv AS OF EPOCH {} ORDER BY k) TO '{}'",
        version.epoch,
        csv.display()
    );
    let said = cli(addr, &["sql", "-c", &copy]).unwrap();
    assert!(
        said.contains(&format!("COPY {}", version.rows.len())),
        "{said}"
    );
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("k,v"));
    let rows: Rows = lines
        .map(|line| {
            let (k, v) = line.split_once(',').unwrap();
            (k.parse().unwrap(), v.parse().unwrap())
        })
        .collect();
    assert_eq!(
        rows, version.rows,
        "COPY ... AS OF EPOCH {} TO csv",
        version.epoch
    );

    let missing = dir.join("no/such/dir/out.csv");
    let error = cli(
        addr,
        &["export", "--table", "kv", "-o", missing.to_str().unwrap()],
    )
    .unwrap_err();
    assert!(error.contains("No such file or directory"), "{error}");
    let error = cli(
        addr,
        &[
            "export",
            "--table",
            "kv",
            "-o",
            dir.join("out.txt").to_str().unwrap(),
        ],
    )
    .unwrap_err();
    assert!(error.contains("--format parquet or csv"), "{error}");
    assert!(!dir.join("out.txt").exists() && !dir.join("out.txt.partial").exists());
}

/// Time-travel mistakes get errors that name them, and change nothing.
async fn check_bad_input(client: &ClusterClient, model: &Model) {
    let first_sent = model.versions[0].sent_ms;
    let cases = [
        (
            format!(
                "SELECT * FROM kv AS OF TIMESTAMP '{}'",
                timestamp(first_sent - 60_000)
            ),
            "before the first epoch",
        ),
        (
            "SELECT * FROM kv AS OF TIMESTAMP '2999-01-01 00:00'".to_string(),
            "is in the future",
        ),
        (
            "SELECT * FROM kv AS OF TIMESTAMP 'last tuesday'".to_string(),
            "needs a date and time",
        ),
        (
            "SELECT * FROM kv AS OF TAG no_such_tag".to_string(),
            "tag \"no_such_tag\" does not exist",
        ),
        ("CREATE TAG step_3".to_string(), "already exists"),
        (
            "SELECT * FROM tessera_changes('kv', 5, 2)".to_string(),
            "not from epoch 5 to epoch 2",
        ),
        (
            "SELECT * FROM tessera_changes('kv', 'no_such_tag')".to_string(),
            "tag \"no_such_tag\" does not exist",
        ),
        (
            "SELECT * FROM tessera_changes('missing', 1, 2)".to_string(),
            "table \"missing\" does not exist",
        ),
        (
            "CREATE TAG later AT EPOCH 999999".to_string(),
            "not visible",
        ),
        ("CREATE TAG \"a@b\"".to_string(), "letters, digits"),
        (
            "CREATE TABLE tessera_epochs (a BIGINT)".to_string(),
            "reserved",
        ),
    ];
    for (sql, expected) in cases {
        let error = error_of(client, &sql).await;
        assert!(error.contains(expected), "{sql}: {error}");
    }
    let tags = client
        .query("SELECT count(*) FROM tessera_tags")
        .await
        .unwrap();
    assert_eq!(
        int64(&tags[0], 0).value(0) as usize,
        model.tags.len(),
        "nothing was tagged"
    );
    // IF NOT EXISTS / IF EXISTS make the same mistakes harmless.
    write(client, "CREATE TAG IF NOT EXISTS step_3").await;
    write(client, "DROP TAG IF EXISTS never_made").await;
}

/// Files named `*.{extension}` under `dir`, recursively.
fn count_files(dir: &std::path::Path, extension: &str) -> usize {
    files_named(dir, extension).len()
}

fn files_named(dir: &std::path::Path, extension: &str) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files = Vec::new();
    for path in entries.flatten().map(|entry| entry.path()) {
        if path.is_dir() {
            files.extend(files_named(&path, extension));
        } else if path.extension().is_some_and(|e| e == extension) {
            files.push(path);
        }
    }
    files
}

/// Before images travel with an UPDATE's and a DELETE's rows to every replica: a diff of
/// the epochs they wrote answers through every node once the components holding the
/// loaded rows are deleted from every node's disk (a diff that needed an older component
/// would fail to open it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_diffs_updates_and_deletes_from_their_own_epochs() {
    let root = tempfile::tempdir().unwrap();
    // Every publish is flushed to components, and none is merged with another.
    let options = [
        ("store.memtable_flush_bytes", "1"),
        ("store.checkpoint_log_bytes", "1"),
        ("store.merge_threshold", "1000"),
        ("store.tiered_merges", "false"),
    ];
    let (cluster, client) =
        common::kv_cluster_with(BINARY, root.path(), PARTITIONS, 3, &options).await;
    let loaded: Rows = (0..200).map(|k| (k, k)).collect();
    let values: Vec<String> = loaded.iter().map(|(k, v)| format!("({k}, {v})")).collect();
    let from = write(
        &client,
        &format!("INSERT INTO kv VALUES {}", values.join(", ")),
    )
    .await
    .expect("the load publishes");
    // Each node holds every partition (r = 3) and flushes the load on its own.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let loaded_files = loop {
        let per_node: Vec<Vec<std::path::PathBuf>> = cluster
            .node_ids()
            .into_iter()
            .map(|id| files_named(&root.path().join(format!("node-{id}")), "parquet"))
            .collect();
        if per_node
            .iter()
            .all(|files| files.len() >= PARTITIONS as usize)
        {
            break per_node.concat();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the load was not flushed on every node: {per_node:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    write(&client, "UPDATE kv SET v = v + 1000 WHERE k % 10 = 0").await;
    write(&client, "DELETE FROM kv WHERE k % 10 = 5").await;
    let to = write(&client, "UPDATE kv SET v = -1 WHERE k = 1")
        .await
        .unwrap();
    let mut current = loaded.clone();
    for (k, v) in current.iter_mut() {
        if k % 10 == 0 {
            *v += 1000;
        }
    }
    current.retain(|k, _| k % 10 != 5);
    current.insert(1, -1);
    for path in &loaded_files {
        std::fs::remove_file(path).unwrap();
    }
    for via in cluster.node_ids() {
        let client = ClusterClient::new(cluster.addr(via));
        assert_eq!(
            diff_of(&client, &from.to_string(), &to.to_string()).await,
            model_diff(&loaded, &current),
            "through node {via}"
        );
    }
    drop(cluster);
}

/// A replica that returns after missing epochs at or below a table's retention horizon
/// cannot be given a delta: merges on the live replicas may have dropped the tombstones of
/// keys deleted while it was away, and a delta would leave those keys alive on it. It is
/// copied whole, and then holds exactly what the others hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_returning_past_the_retention_horizon_is_copied_whole() {
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = merging_cluster(root.path()).await;
    let values: Vec<String> = (0..200).map(|k| format!("({k}, {k})")).collect();
    write(
        &client,
        &format!("INSERT INTO kv VALUES {}", values.join(", ")),
    )
    .await;
    write(&client, "ALTER TABLE kv SET (retain_epochs = 1)").await;

    common::kill_node(&mut cluster, &client, 3).await;
    // Deleted while node 3 is away, then rewritten and merged on the survivors until the
    // horizon (the newest version) is past the deletes: their tombstones are merged away.
    write(&client, "DELETE FROM kv WHERE k < 100").await;
    for round in 0..4 {
        write(&client, &format!("UPDATE kv SET v = v + {round}")).await;
        for id in [1, 2] {
            ClusterClient::new(cluster.addr(id)).flush().await.unwrap();
        }
    }

    let status = common::restart_node(&mut cluster, &client, 3).await;
    let epoch = status.meta.visible;
    for p in 0..PARTITIONS {
        let held = held_by_each_node(&cluster, p, epoch, common::history::keys_of).await;
        assert!(
            held[2].iter().all(|(k, _)| *k >= 100),
            "a key deleted while node 3 was away is alive on it in p{p}"
        );
        assert_eq!(held[2], held[0], "p{p}: node 3 holds what node 1 holds");
        assert_eq!(held[1], held[0], "p{p}: node 2 holds what node 1 holds");
    }
    let returned = ClusterClient::new(cluster.addr(3)).status().await.unwrap();
    assert_eq!(
        returned.transfers.delta_copies, 0,
        "no delta may reach below the horizon: {:?}",
        returned.transfers
    );
    assert!(
        returned.transfers.whole_copies >= PARTITIONS as u64,
        "every partition copied whole: {:?}",
        returned.transfers
    );
    drop(cluster);
}

/// One number a query answers.
/// What each of the three nodes holds of `kv`'s partition `p` at `epoch`, as `view` sees it.
async fn held_by_each_node<T>(
    cluster: &tessera_testkit::LocalCluster,
    p: u32,
    epoch: tessera_common::Epoch,
    view: impl Fn(&[RecordBatch]) -> T,
) -> Vec<T> {
    let partition = tessera_common::PartitionId(p);
    let mut held = Vec::new();
    for id in 1..=3 {
        let batches = ClusterClient::new(cluster.addr(id))
            .read_replica(cluster.cluster_id(), "kv", partition, epoch)
            .await
            .unwrap();
        held.push(view(&batches));
    }
    held
}

async fn number(client: &ClusterClient, sql: &str) -> i64 {
    let batches = client.query(sql).await.unwrap();
    int64(&batches[0], 0).value(0)
}

/// ALTER TABLE on a cluster: every node reads the new columns at once, a node that was
/// down during the changes reads them when it returns (its files and log written before
/// them are conformed, not rewritten), and `AS OF` an earlier epoch sees the old columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_change_across_the_cluster_and_a_returning_node_reads_them() {
    let root = tempfile::tempdir().unwrap();
    let (mut cluster, client) = merging_cluster(root.path()).await;
    let values: Vec<String> = (0..50).map(|k| format!("({k}, {k})")).collect();
    let before = write(
        &client,
        &format!("INSERT INTO kv VALUES {}", values.join(", ")),
    )
    .await
    .unwrap();

    common::kill_node(&mut cluster, &client, 3).await;
    write(
        &client,
        "ALTER TABLE kv ADD COLUMN w BIGINT NOT NULL DEFAULT 7",
    )
    .await;

    write(&client, "INSERT INTO kv VALUES (100, 100, 1)").await;
    write(&client, "ALTER TABLE kv RENAME COLUMN v TO value").await;
    let node2 = ClusterClient::new(cluster.addr(2));
    assert_eq!(number(&node2, "SELECT sum(w) FROM kv").await, 50 * 7 + 1);

    common::restart_node(&mut cluster, &client, 3).await;
    let node3 = ClusterClient::new(cluster.addr(3));
    assert_eq!(number(&node3, "SELECT sum(w) FROM kv").await, 50 * 7 + 1);
    assert_eq!(
        number(&node3, "SELECT value FROM kv WHERE k = 100").await,
        100
    );
    let old = node3
        .query(&format!("SELECT * FROM kv AS OF EPOCH {before}"))
        .await
        .unwrap();
    let names: Vec<&str> = old[0]
        .schema_ref()
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect::<Vec<_>>()
        .leak()
        .to_vec();
    assert_eq!(
        names,
        ["k", "v"],
        "the columns as they were at epoch {before}"
    );
    // Every replica holds the same rows, in the new stored columns. (As a set: a replica's
    // read has no order of its own, and which rows a replica holds in components and which
    // in memtables depends on when each checkpointed.)
    let epoch = client.status().await.unwrap().meta.visible;
    for p in 0..PARTITIONS {
        let held = held_by_each_node(&cluster, p, epoch, |batches| {
            let text = arrow::util::pretty::pretty_format_batches(batches)
                .unwrap()
                .to_string();
            let mut lines: Vec<&str> = text.lines().collect();
            lines.sort_unstable();
            lines.join("\n")
        })
        .await;
        assert_eq!(held[2], held[0], "p{p}: node 3 holds what node 1 holds");
        assert_eq!(held[1], held[0], "p{p}: node 2 holds what node 1 holds");
    }
}
