//! Schema changes mixed into a table's history, against a model, on a 3-node cluster
//! (r = 3) that merges eagerly: random inserts (some leaving defaulted columns out),
//! updates and deletes interleaved with ADD COLUMN (with and without DEFAULT, reusing
//! dropped names), DROP COLUMN, RENAME COLUMN and widening INT to BIGINT. A node is down
//! for part of the history. Every `AS OF EPOCH` answer (its column names, types and rows),
//! the current table and diffs between versions must equal the model's, before and after
//! every node is SIGKILLed and restarted.

use arrow::array::{Array, Int64Array, StringArray};
use arrow::datatypes::DataType;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use tessera_server::ClusterClient;
use tessera_sql::StatementOutput;

mod common;

const BINARY: &str = env!("CARGO_BIN_EXE_tessera");
const PARTITIONS: u32 = 8;

/// A stored (non-key) column, known by its position.
#[derive(Clone, Debug)]
struct Column {
    name: String,
    /// BIGINT, or INT until widened.
    wide: bool,
    nullable: bool,
    /// What rows written before the column was added read in it.
    default: Option<i64>,
    dropped: bool,
}

impl Column {
    fn data_type(&self) -> DataType {
        if self.wide {
            DataType::Int64
        } else {
            DataType::Int32
        }
    }
}

/// A row's values by stored position; rows written before a column was added are shorter.
type Row = Vec<Option<i64>>;

/// The table at one moment: its stored columns and rows.
#[derive(Clone, Default)]
struct Table {
    columns: Vec<Column>,
    rows: BTreeMap<i64, Row>,
    /// Names of dropped columns, which ADD COLUMN may use again.
    freed: Vec<String>,
}

impl Table {
    fn visible(&self) -> Vec<usize> {
        (0..self.columns.len())
            .filter(|&i| !self.columns[i].dropped)
            .collect()
    }

    /// What `SELECT *` shows: `k`, then the visible columns with their types.
    fn header(&self) -> Vec<(String, DataType)> {
        let mut header = vec![("k".to_string(), DataType::Int64)];
        header.extend(
            self.visible()
                .into_iter()
                .map(|i| (self.columns[i].name.clone(), self.columns[i].data_type())),
        );
        header
    }

    /// `row` read through this table's visible columns: positions it predates read the
    /// column's default.
    fn read(&self, row: &Row) -> Vec<Option<i64>> {
        self.visible()
            .into_iter()
            .map(|i| match row.get(i) {
                Some(value) => *value,
                None => self.columns[i].default,
            })
            .collect()
    }

    fn answer(&self) -> BTreeMap<i64, Vec<Option<i64>>> {
        self.rows
            .iter()
            .map(|(k, row)| (*k, self.read(row)))
            .collect()
    }
}

/// One acknowledged publish and the table right after it.
struct Version {
    epoch: u64,
    table: Table,
}

/// The statement a random step runs, and whether it publishes an epoch.
struct Step {
    sql: String,
    publishes: bool,
}

/// A random change to `table` (applied to it), as SQL.
fn random_step(rng: &mut rand::rngs::StdRng, table: &mut Table, next_key: &mut i64) -> Step {
    let visible = table.visible();
    let roll = rng.random_range(0..12);
    let publish = |sql: String| Step {
        sql,
        publishes: true,
    };
    let alter = |sql: String| Step {
        sql,
        publishes: false,
    };
    match roll {
        0..=3 => {
            // Columns with a default (or nullable ones) are sometimes left out.
            let named: Vec<usize> = visible
                .iter()
                .copied()
                .filter(|&i| {
                    let c = &table.columns[i];
                    !(c.default.is_some() || c.nullable) || rng.random_bool(0.7)
                })
                .collect();
            let mut values = Vec::new();
            for _ in 0..rng.random_range(1..15) {
                let key = *next_key;
                *next_key += 1;
                let mut row: Row = table.columns.iter().map(|c| c.default).collect();
                for (i, column) in table.columns.iter().enumerate() {
                    if column.dropped {
                        row[i] = None;
                    }
                }
                let mut literals = vec![key.to_string()];
                for &i in &named {
                    let value = (!table.columns[i].nullable || rng.random_bool(0.8))
                        .then(|| rng.random_range(-1000..1000));
                    row[i] = value;
                    literals.push(value.map_or("NULL".into(), |v| v.to_string()));
                }
                table.rows.insert(key, row);
                values.push(format!("({})", literals.join(", ")));
            }
            let mut names = vec!["k".to_string()];
            names.extend(named.iter().map(|&i| table.columns[i].name.clone()));
            publish(format!(
                "INSERT INTO t ({}) VALUES {}",
                names.join(", "),
                values.join(", ")
            ))
        }
        4..=5 if !visible.is_empty() => {
            let i = visible[rng.random_range(0..visible.len())];
            let (m, r, d) = (
                rng.random_range(2..5),
                rng.random_range(0..2),
                rng.random_range(1..50),
            );
            let defaults: Vec<Option<i64>> = table.columns.iter().map(|c| c.default).collect();
            for (k, row) in table.rows.iter_mut() {
                if k % m == r {
                    // A row written before columns were added is rewritten with them, as
                    // it reads.
                    let written = row.len();
                    row.extend_from_slice(&defaults[written..]);
                    row[i] = row[i].map(|v| v + d);
                }
            }
            publish(format!(
                "UPDATE t SET {name} = {name} + {d} WHERE k % {m} = {r}",
                name = table.columns[i].name
            ))
        }
        6 => {
            let (m, r) = (rng.random_range(3..7), rng.random_range(0..3));
            table.rows.retain(|k, _| k % m != r);
            publish(format!("DELETE FROM t WHERE k % {m} = {r}"))
        }
        7 if visible.len() > 1 => {
            let i = visible[rng.random_range(0..visible.len())];
            table.columns[i].dropped = true;
            // Its name is free again.
            let name = std::mem::replace(&mut table.columns[i].name, format!("__dropped_{i}"));
            table.freed.push(name.clone());
            alter(format!("ALTER TABLE t DROP COLUMN {name}"))
        }
        8 if !visible.is_empty() => {
            let i = visible[rng.random_range(0..visible.len())];
            let to = format!("r{}", table.columns.len() * 10 + rng.random_range(0..10));
            if table.columns.iter().any(|c| c.name == to) {
                return random_step(rng, table, next_key);
            }
            let from = std::mem::replace(&mut table.columns[i].name, to.clone());
            alter(format!("ALTER TABLE t RENAME COLUMN {from} TO {to}"))
        }
        9 if visible.iter().any(|&i| !table.columns[i].wide) => {
            let narrow: Vec<usize> = visible
                .into_iter()
                .filter(|&i| !table.columns[i].wide)
                .collect();
            let i = narrow[rng.random_range(0..narrow.len())];
            table.columns[i].wide = true;
            alter(format!(
                "ALTER TABLE t ALTER COLUMN {} TYPE BIGINT",
                table.columns[i].name
            ))
        }
        _ => {
            // A dropped column's name is reused now and then.
            let reused = table
                .freed
                .iter()
                .find(|name| table.columns.iter().all(|c| &&c.name != name))
                .cloned();
            let name = match reused {
                Some(name) if rng.random_bool(0.5) => name,
                _ => format!("c{}", table.columns.len()),
            };
            let wide = rng.random_bool(0.5);
            let (default, nullable, clause) = match rng.random_range(0..3) {
                0 => (None, true, String::new()),
                1 => {
                    let d = rng.random_range(-50..50);
                    (Some(d), true, format!(" DEFAULT {d}"))
                }
                _ => {
                    let d = rng.random_range(-50..50);
                    (Some(d), false, format!(" NOT NULL DEFAULT {d}"))
                }
            };
            let sql = format!(
                "ALTER TABLE t ADD COLUMN {name} {}{clause}",
                if wide { "BIGINT" } else { "INT" }
            );
            table.columns.push(Column {
                name,
                wide,
                nullable,
                default,
                dropped: false,
            });
            alter(sql)
        }
    }
}

fn as_i64(array: &dyn Array, row: usize) -> Option<i64> {
    let array = arrow::compute::cast(&array.slice(row, 1), &DataType::Int64).unwrap();
    let array = array.as_any().downcast_ref::<Int64Array>().unwrap();
    (!array.is_null(0)).then(|| array.value(0))
}

/// `SELECT * ...`'s header and rows by key.
type Answer = (Vec<(String, DataType)>, BTreeMap<i64, Vec<Option<i64>>>);

async fn select(client: &ClusterClient, sql: &str) -> Answer {
    let batches = client
        .query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let header = batches.first().map_or_else(Vec::new, |b| {
        b.schema()
            .fields()
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect()
    });
    let mut rows = BTreeMap::new();
    for batch in &batches {
        for i in 0..batch.num_rows() {
            let key = as_i64(batch.column(0).as_ref(), i).expect("a key");
            let values = (1..batch.num_columns())
                .map(|c| as_i64(batch.column(c).as_ref(), i))
                .collect();
            rows.insert(key, values);
        }
    }
    (header, rows)
}

/// A diff row: kind, key, the values before and after (current visible columns).
type Change = (String, i64, Vec<Option<i64>>, Vec<Option<i64>>);

fn model_diff(current: &Table, before: &Table, after: &Table) -> BTreeSet<Change> {
    let keys: BTreeSet<i64> = before
        .rows
        .keys()
        .chain(after.rows.keys())
        .copied()
        .collect();
    let width = current.visible().len();
    let mut changes = BTreeSet::new();
    for key in keys {
        let old = before.rows.get(&key).map(|r| current.read(r));
        let new = after.rows.get(&key).map(|r| current.read(r));
        let kind = match (&old, &new) {
            (None, Some(_)) => "insert",
            (Some(_), None) => "delete",
            (Some(o), Some(n)) if o != n => "update",
            _ => continue,
        };
        changes.insert((
            kind.to_string(),
            key,
            old.unwrap_or_else(|| vec![None; width]),
            new.unwrap_or_else(|| vec![None; width]),
        ));
    }
    changes
}

async fn diff_of(client: &ClusterClient, from: u64, to: u64) -> BTreeSet<Change> {
    let sql = format!("SELECT * FROM tessera_changes('t', {from}, {to})");
    let batches = client
        .query(&sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let mut changes = BTreeSet::new();
    for batch in &batches {
        let kinds = batch
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        let width = (batch.num_columns() - 2) / 2;
        for i in 0..batch.num_rows() {
            let side = |start: usize| -> Vec<Option<i64>> {
                (start..start + width)
                    .map(|c| as_i64(batch.column(c).as_ref(), i))
                    .collect()
            };
            changes.insert((
                kinds.value(i).to_string(),
                as_i64(batch.column(1).as_ref(), i).unwrap(),
                side(2),
                side(2 + width),
            ));
        }
    }
    changes
}

/// Checks every version, the current table and diffs between versions against the model.
async fn check_history(client: &ClusterClient, versions: &[Version], current: &Table, when: &str) {
    for version in versions {
        let (header, rows) = select(
            client,
            &format!("SELECT * FROM t AS OF EPOCH {} ORDER BY k", version.epoch),
        )
        .await;
        if !rows.is_empty() {
            assert_eq!(
                header,
                version.table.header(),
                "{when}: the columns AS OF EPOCH {}",
                version.epoch
            );
        }
        assert_eq!(
            rows,
            version.table.answer(),
            "{when}: the rows AS OF EPOCH {}",
            version.epoch
        );
    }
    let (header, rows) = select(client, "SELECT * FROM t ORDER BY k").await;
    if !rows.is_empty() {
        assert_eq!(header, current.header(), "{when}: the current columns");
    }
    assert_eq!(rows, current.answer(), "{when}: the current rows");

    // Diffs are in the current columns, whatever the columns were at either end.
    let mut pairs: Vec<(usize, usize)> = (1..versions.len()).map(|i| (i - 1, i)).collect();
    pairs.push((0, versions.len() - 1));
    pairs.push((versions.len() / 3, 2 * versions.len() / 3));
    for (a, b) in pairs {
        let (from, to) = (&versions[a], &versions[b]);
        assert_eq!(
            diff_of(client, from.epoch, to.epoch).await,
            model_diff(current, &from.table, &to.table),
            "{when}: tessera_changes from epoch {} to {}",
            from.epoch,
            to.epoch
        );
    }
}

async fn run(client: &ClusterClient, sql: &str) -> Option<u64> {
    let outputs = client
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    match outputs.last() {
        Some(StatementOutput::Done { epoch, .. }) => epoch.map(|e| e.0),
        other => panic!("{sql}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_as_of_answer_and_diff_equals_the_model_across_schema_changes() {
    let root = tempfile::tempdir().unwrap();
    let options = [
        ("store.memtable_flush_bytes", "2048"),
        ("store.checkpoint_log_bytes", "4096"),
        ("store.merge_threshold", "2"),
    ];
    let cluster = tessera_testkit::LocalCluster::configure(
        std::path::Path::new(BINARY),
        root.path(),
        3,
        PARTITIONS,
        3,
    );
    let mut cluster = cluster;
    for (key, value) in options {
        cluster.set_option(key, value);
    }
    cluster.start_all();
    common::wait_formed(&cluster, 1, 3).await;
    let client = ClusterClient::new(cluster.addr(1));
    run(&client, "CREATE TABLE t (k BIGINT PRIMARY KEY, c0 INT)").await;

    let seed: u64 = std::env::var("TESSERA_SCHEMA_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(23);
    println!("seed {seed} (TESSERA_SCHEMA_SEED reruns it)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut table = Table {
        columns: vec![Column {
            name: "c0".into(),
            wide: false,
            nullable: true,
            default: None,
            dropped: false,
        }],
        rows: BTreeMap::new(),
        freed: Vec::new(),
    };
    let mut versions: Vec<Version> = Vec::new();
    let mut next_key = 0;
    let mut alters = 0;
    for step in 0..60 {
        // Node 3 is down for a stretch of the history: it returns to rows and columns it
        // never saw.
        if step == 20 {
            common::kill_node(&mut cluster, &client, 3).await;
        }
        if step == 35 {
            common::restart_node(&mut cluster, &client, 3).await;
        }
        let mut next = table.clone();
        let Step { sql, publishes } = random_step(&mut rng, &mut next, &mut next_key);
        let epoch = run(&client, &sql).await;
        table = next;
        if publishes {
            if let Some(epoch) = epoch {
                versions.push(Version {
                    epoch,
                    table: table.clone(),
                });
            }
        } else {
            alters += 1;
        }
    }
    assert!(
        alters >= 10 && versions.len() >= 25,
        "{alters} schema changes and {} publishes: too few to test",
        versions.len()
    );
    check_history(&client, &versions, &table, "before restarts").await;
    let node3 = ClusterClient::new(cluster.addr(3));
    check_history(
        &node3,
        &versions,
        &table,
        "through node 3, back from its absence",
    )
    .await;

    for id in cluster.node_ids() {
        cluster.kill9(id);
    }
    for id in cluster.node_ids() {
        cluster.start(id);
    }
    common::wait_formed(&cluster, 1, 3).await;
    for via in [2, 3] {
        let other = ClusterClient::new(cluster.addr(via));
        check_history(
            &other,
            &versions,
            &table,
            &format!("after restart, through node {via}"),
        )
        .await;
    }
    drop(cluster);
}

/// The planner keeps each component's column statistics; a component written before
/// columns were added has fewer of them, and must still plan (its statistics conformed as
/// its rows are, nothing known of the new columns).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statistics_read_before_columns_were_added_still_plan() {
    let root = tempfile::tempdir().unwrap();
    let mut cluster = tessera_testkit::LocalCluster::configure(
        std::path::Path::new(BINARY),
        root.path(),
        3,
        PARTITIONS,
        3,
    );
    cluster.start_all();
    common::wait_formed(&cluster, 1, 3).await;
    let client = ClusterClient::new(cluster.addr(1));
    run(&client, "CREATE TABLE t (k BIGINT PRIMARY KEY, a INT)").await;
    // One row: one component, whose statistics are the table's as they are.
    run(&client, "INSERT INTO t VALUES (7, 7)").await;
    common::flush_everywhere(&cluster).await;
    let count = "SELECT count(*) FROM t WHERE a >= 0";
    let (_, rows) = select(&client, count).await;
    assert_eq!(rows.keys().next(), Some(&1));

    for (column, default) in [("b", 1), ("c", 2), ("d", 3)] {
        run(
            &client,
            &format!("ALTER TABLE t ADD COLUMN {column} BIGINT DEFAULT {default}"),
        )
        .await;
    }
    run(&client, "ALTER TABLE t ALTER COLUMN a TYPE BIGINT").await;
    let sums = "SELECT sum(a), sum(b), sum(c), sum(d) FROM t WHERE a >= 0";
    let (_, rows) = select(&client, sums).await;
    assert_eq!(
        rows.into_iter().next(),
        Some((7, vec![Some(1), Some(2), Some(3)])),
        "{sums}"
    );
    drop(cluster);
}
