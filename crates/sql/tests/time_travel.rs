//! Time travel: every epoch stays readable with `AS OF EPOCH`, through updates, deletes,
//! checkpoints, merges and restarts.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::Int64Type;
use std::collections::BTreeMap;
use tessera_common::Epoch;
use tessera_sql::{Engine, StatementOutput};
use tessera_storage::{Store, StoreConfig};

fn pairs(batches: &[RecordBatch]) -> BTreeMap<i64, i64> {
    let mut out = BTreeMap::new();
    for b in batches {
        let k = b.column(0).as_primitive::<Int64Type>();
        let v = b.column(1).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            assert!(!v.is_null(i));
            out.insert(k.value(i), v.value(i));
        }
    }
    out
}

async fn write(engine: &Engine, sql: &str) -> Epoch {
    match engine.execute(sql).await.unwrap().pop().unwrap() {
        StatementOutput::Done {
            epoch: Some(epoch), ..
        } => epoch,
        other => panic!("{sql} published nothing: {other:?}"),
    }
}

/// A store in a new directory whose partitions merge once they hold more than two
/// components, with one table created by `create`.
async fn store_with_table(
    partitions: u32,
    create: &str,
) -> (
    tempfile::TempDir,
    StoreConfig,
    std::sync::Arc<Store>,
    Engine,
) {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        partitions,
        merge_threshold: 2,
        ..StoreConfig::default()
    };
    let store = Store::open(dir.path(), config.clone()).unwrap();
    let engine = Engine::new(store.clone());
    engine.execute(create).await.unwrap();
    (dir, config, store, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_epoch_answers_as_it_was() {
    let (dir, config, store, engine) = store_with_table(
        8,
        "CREATE TABLE accounts (id BIGINT, balance BIGINT NOT NULL, PRIMARY KEY (id))",
    )
    .await;

    // The model: epoch -> expected contents.
    let mut model: BTreeMap<Epoch, BTreeMap<i64, i64>> = BTreeMap::new();
    let mut current: BTreeMap<i64, i64> = BTreeMap::new();
    let before_any = store.visible_epoch();
    model.insert(before_any, current.clone());

    let e = write(
        &engine,
        "INSERT INTO accounts VALUES (1, 100), (2, 200), (3, 300), (4, 400)",
    )
    .await;
    current.extend([(1, 100), (2, 200), (3, 300), (4, 400)]);
    model.insert(e, current.clone());

    let e = write(
        &engine,
        "UPDATE accounts SET balance = balance + 5 WHERE id >= 3",
    )
    .await;
    current.insert(3, 305);
    current.insert(4, 405);
    model.insert(e, current.clone());
    store.checkpoint().unwrap();

    let e = write(&engine, "DELETE FROM accounts WHERE id = 2").await;
    current.remove(&2);
    model.insert(e, current.clone());

    let e = write(&engine, "INSERT INTO accounts VALUES (2, 222), (5, 500)").await;
    current.insert(2, 222);
    current.insert(5, 500);
    model.insert(e, current.clone());
    store.checkpoint().unwrap();

    let e = write(
        &engine,
        "UPDATE accounts SET balance = 0 WHERE balance > 300",
    )
    .await;
    for v in current.values_mut().filter(|v| **v > 300) {
        *v = 0;
    }
    model.insert(e, current.clone());
    // A third checkpoint leaves partitions with more components than the merge threshold.
    store.checkpoint().unwrap();

    let check = |engine: Engine, model: BTreeMap<Epoch, BTreeMap<i64, i64>>| async move {
        for (epoch, expected) in &model {
            let sql = format!("SELECT id, balance FROM accounts AS OF EPOCH {epoch} ORDER BY id");
            assert_eq!(
                &pairs(&engine.query(&sql).await.unwrap()),
                expected,
                "AS OF EPOCH {epoch}"
            );
        }
        let latest = model.values().last().unwrap();
        assert_eq!(
            &pairs(
                &engine
                    .query("SELECT id, balance FROM accounts")
                    .await
                    .unwrap()
            ),
            latest
        );
        // Two epochs in one query, joined on the key.
        let first = model.keys().nth(1).unwrap();
        let sql = format!("SELECT a.id, b.balance - a.balance FROM accounts AS OF EPOCH {first} a JOIN accounts b ON a.id = b.id");
        let diff = pairs(&engine.query(&sql).await.unwrap());
        assert_eq!(diff.get(&1), Some(&0));
        assert_eq!(diff.get(&3), Some(&-300));
    };
    check(Engine::new(store.clone()), model.clone()).await;
    drop(engine);
    drop(store);
    let reopened = Store::open(dir.path(), config).unwrap();
    check(Engine::new(reopened.clone()), model.clone()).await;

    let future = model.keys().last().unwrap().0 + 10;
    let err = Engine::new(reopened)
        .query(&format!("SELECT * FROM accounts AS OF EPOCH {future}"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not visible yet"), "{err}");
}

/// `ms` as `AS OF TIMESTAMP` takes it (UTC, to the millisecond).
fn timestamp(ms: u64) -> String {
    tessera_common::time::format_ms(ms)
        .trim_end_matches(" UTC")
        .to_string()
}

async fn refused(engine: &Engine, sql: &str) -> String {
    match engine.query(sql).await {
        Ok(rows) => panic!("{sql} answered {rows:?}"),
        Err(error) => error.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_its_own_travels_by_time_and_by_tag() {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        partitions: 4,
        ..StoreConfig::default()
    };
    let store = Store::open(dir.path(), config.clone()).unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
        .await
        .unwrap();
    let before_any = tessera_common::time::now_ms();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let first = write(&engine, "INSERT INTO t VALUES (1, 10), (2, 20)").await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let between = tessera_common::time::now_ms();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let second = write(&engine, "UPDATE t SET v = v + 1").await;
    let at_first = BTreeMap::from([(1, 10), (2, 20)]);
    let at_second = BTreeMap::from([(1, 11), (2, 21)]);

    let as_of = |point: String| format!("SELECT k, v FROM t AS OF {point} ORDER BY k");
    let by_time = as_of(format!("TIMESTAMP '{}'", timestamp(between)));
    assert_eq!(pairs(&engine.query(&by_time).await.unwrap()), at_first);
    let now = as_of(format!(
        "TIMESTAMP '{}'",
        timestamp(tessera_common::time::now_ms())
    ));
    assert_eq!(pairs(&engine.query(&now).await.unwrap()), at_second);

    write_tag(&engine, &format!("CREATE TAG release_1 AT EPOCH {first}")).await;
    write_tag(&engine, "CREATE TAG release_2").await;
    assert_eq!(store.tag_epoch("release_2").unwrap(), second);
    let by_tag = as_of("TAG release_1".into());
    assert_eq!(pairs(&engine.query(&by_tag).await.unwrap()), at_first);
    let changes = engine
        .query("SELECT k FROM tessera_changes('t', 'release_1', 'release_2')")
        .await
        .unwrap();
    assert_eq!(changes.iter().map(|b| b.num_rows()).sum::<usize>(), 2);

    // Bad points and tag changes are refused, naming why, and change nothing.
    let early = refused(
        &engine,
        &as_of(format!("TIMESTAMP '{}'", timestamp(before_any))),
    )
    .await;
    assert!(early.contains("before the first epoch"), "{early}");
    let future = refused(&engine, &as_of("TIMESTAMP '2999-01-01 00:00'".into())).await;
    assert!(future.contains("in the future"), "{future}");
    let unknown = refused(&engine, &as_of("TAG nope".into())).await;
    assert!(unknown.contains("tag \"nope\" does not exist"), "{unknown}");
    let taken = engine
        .execute("CREATE TAG release_1 AT EPOCH 1")
        .await
        .unwrap_err();
    assert_eq!(taken.sqlstate(), "42710", "{taken}");
    assert!(taken.to_string().contains("already exists"), "{taken}");
    assert_eq!(store.tag_epoch("release_1").unwrap(), first);
    write_tag(&engine, "CREATE TAG IF NOT EXISTS release_1").await;
    let ahead = engine
        .execute(&format!("CREATE TAG later AT EPOCH {}", second.0 + 5))
        .await
        .unwrap_err();
    assert!(ahead.to_string().contains("not visible yet"), "{ahead}");

    // A tag writes the checkpoint; this epoch's time is only in its commit record.
    let third = write(&engine, "DELETE FROM t WHERE k = 2").await;

    // Both survive a restart: times from the log's commit records, tags from the
    // checkpoint; and again once a checkpoint has replaced the log.
    drop(engine);
    drop(store);
    for checkpointed in [false, true] {
        let store = Store::open(dir.path(), config.clone()).unwrap();
        let engine = Engine::new(store.clone());
        assert_eq!(
            pairs(&engine.query(&by_time).await.unwrap()),
            at_first,
            "after a restart (checkpointed: {checkpointed})"
        );
        assert_eq!(pairs(&engine.query(&by_tag).await.unwrap()), at_first);
        let third_at = store.commit_time(third).expect("the third epoch's time");
        let after_third = as_of(format!("TIMESTAMP '{}'", timestamp(third_at)));
        assert_eq!(
            pairs(&engine.query(&after_third).await.unwrap()),
            BTreeMap::from([(1, 11)])
        );
        // The history as tables: the third epoch's rows were counted from the log.
        let epochs = engine
            .query("SELECT epoch, tables, rows_written, rows_deleted FROM tessera_epochs ORDER BY epoch")
            .await
            .unwrap();
        let epochs = arrow::compute::concat_batches(&epochs[0].schema(), &epochs).unwrap();
        let numbers = |i: usize| -> Vec<i64> {
            epochs
                .column(i)
                .as_primitive::<Int64Type>()
                .values()
                .to_vec()
        };
        assert_eq!(
            numbers(0),
            vec![first.0 as i64, second.0 as i64, third.0 as i64]
        );
        assert_eq!(numbers(2), vec![2, 2, 0], "rows written");
        assert_eq!(numbers(3), vec![0, 0, 1], "rows deleted");
        assert!(epochs
            .column(1)
            .as_string::<i32>()
            .iter()
            .all(|t| t == Some("t")));
        let tags = engine
            .query("SELECT name, epoch FROM tessera_tags ORDER BY name")
            .await
            .unwrap();
        assert_eq!(tags.iter().map(|b| b.num_rows()).sum::<usize>(), 2);
        if !checkpointed {
            store.checkpoint().unwrap();
        }
    }
    let store = Store::open(dir.path(), config).unwrap();
    let engine = Engine::new(store.clone());
    write_tag(&engine, "DROP TAG release_1").await;
    let dropped = refused(&engine, &by_tag).await;
    assert!(dropped.contains("does not exist"), "{dropped}");
}

async fn write_tag(engine: &Engine, sql: &str) {
    engine
        .execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A merge splits each partition into its keys' newest versions and their history: the
/// newest epoch reads one plain component per partition however many versions the table
/// keeps, every older epoch and every diff still answers exactly (also after a restart),
/// and once retention passes the history, it is dropped whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merges_keep_the_newest_versions_apart_from_their_history() {
    let (dir, config, store, engine) = store_with_table(
        4,
        "CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)",
    )
    .await;
    let rows: Vec<String> = (0..200).map(|k| format!("({k}, {k})")).collect();
    let mut current: BTreeMap<i64, i64> = (0..200).map(|k| (k, k)).collect();
    let mut model = BTreeMap::new();
    let first = write(
        &engine,
        &format!("INSERT INTO t VALUES {}", rows.join(", ")),
    )
    .await;
    model.insert(first, current.clone());
    store.checkpoint().unwrap();
    // With a threshold of 2, every second round merges (the last one too), and the third
    // merge's history crowds the older two into one.
    for round in 1..=8 {
        let e = write(
            &engine,
            &format!("UPDATE t SET v = v + 1000 WHERE k % 7 < {round}"),
        )
        .await;
        for (_, v) in current.iter_mut().filter(|(k, _)| *k % 7 < round) {
            *v += 1000;
        }
        model.insert(e, current.clone());
        store.checkpoint().unwrap();
    }
    let newest = *model.keys().last().unwrap();

    let layout = store.table_def("t").unwrap().layout();
    let read = store.snapshot("t", None).unwrap();
    for partition in read.partitions.iter().filter(|p| !p.is_empty()) {
        assert!(
            partition.is_plain_scan(newest, layout),
            "partition {} reads {:?} at the newest epoch",
            partition.partition,
            partition.components
        );
    }
    let versions = store.versions_snapshot("t", None).unwrap();
    let history: Vec<_> = versions
        .partitions
        .iter()
        .flat_map(|p| &p.components)
        .filter(|c| c.is_history())
        .collect();
    assert!(!history.is_empty(), "the merges kept no history");
    assert!(history
        .iter()
        .all(|c| c.superseded_at <= newest && !c.read_at(newest)));

    let check = |engine: Engine, model: BTreeMap<Epoch, BTreeMap<i64, i64>>| async move {
        for (epoch, expected) in &model {
            let sql = format!("SELECT k, v FROM t AS OF EPOCH {epoch}");
            let answer = pairs(&engine.query(&sql).await.unwrap());
            assert_eq!(&answer, expected, "AS OF EPOCH {epoch}");
        }
        // A diff between two old epochs reads the history.
        let (from, to) = (*model.keys().nth(1).unwrap(), *model.keys().nth(3).unwrap());
        let sql = format!("SELECT k, before_v, after_v FROM tessera_changes('t', {from}, {to})");
        let mut changed = BTreeMap::new();
        for batch in engine.query(&sql).await.unwrap() {
            let columns: Vec<_> = (0..3)
                .map(|i| batch.column(i).as_primitive::<Int64Type>().clone())
                .collect();
            for row in 0..batch.num_rows() {
                let [k, before, after] = [0, 1, 2].map(|i| columns[i].value(row));
                changed.insert(k, (before, after));
            }
        }
        let expected: BTreeMap<i64, (i64, i64)> = model[&to]
            .iter()
            .filter(|(k, v)| model[&from][k] != **v)
            .map(|(k, v)| (*k, (model[&from][k], *v)))
            .collect();
        assert_eq!(changed, expected, "changes from {from} to {to}");
    };
    check(Engine::new(store.clone()), model.clone()).await;
    drop(engine);
    drop(read);
    drop(versions);
    drop(store);
    let store = Store::open(dir.path(), config).unwrap();
    let engine = Engine::new(store.clone());
    check(Engine::new(store.clone()), model.clone()).await;

    // Keeping one epoch (a cluster's metadata hands the store its horizon): the next
    // checkpoint drops every history component, unread.
    let last = write(&engine, "UPDATE t SET v = v + 1 WHERE k = 0").await;
    *current.get_mut(&0).unwrap() += 1;
    store.set_retention_horizons(vec![("t".to_string(), last)]);
    store.checkpoint().unwrap();
    let versions = store.versions_snapshot("t", None).unwrap();
    assert!(
        versions
            .partitions
            .iter()
            .flat_map(|p| &p.components)
            .all(|c| !c.is_history()),
        "history outlived the retention horizon"
    );
    let latest = pairs(&engine.query("SELECT k, v FROM t").await.unwrap());
    assert_eq!(latest, current, "at epoch {last}");
    let error = refused(&engine, &format!("SELECT * FROM t AS OF EPOCH {first}")).await;
    assert!(error.contains("retain"), "{error}");
}

/// UPDATE and DELETE write each changed key's row as they read it beside the change (its
/// before image), also inside a transaction, so a diff of epochs they wrote reads those
/// epochs' rows only: here it answers with every older component gone from disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diff_of_updates_and_deletes_reads_only_their_epochs() {
    let (_dir, _config, store, engine) = store_with_table(
        4,
        "CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)",
    )
    .await;
    let rows: Vec<String> = (0..100).map(|k| format!("({k}, {k})")).collect();
    write(
        &engine,
        &format!("INSERT INTO t VALUES {}", rows.join(", ")),
    )
    .await;
    store.checkpoint().unwrap();
    let from = store.visible_epoch();
    let loaded: Vec<std::path::PathBuf> = std::fs::read_dir(store.components_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert!(!loaded.is_empty(), "the load was flushed to components");

    write(&engine, "UPDATE t SET v = v + 1000 WHERE k % 10 = 0").await;
    write(&engine, "DELETE FROM t WHERE k % 10 = 5").await;
    for statement in [
        "BEGIN",
        "UPDATE t SET v = -1 WHERE k = 1",
        "DELETE FROM t WHERE k = 1",
        "UPDATE t SET v = -2 WHERE k = 2",
        "UPDATE t SET v = -3 WHERE k = 2",
        "COMMIT",
    ] {
        engine.execute(statement).await.unwrap();
    }
    let to = store.visible_epoch();
    for path in &loaded {
        std::fs::remove_file(path).unwrap();
    }

    let sql = format!(
        "SELECT change, k, before_v, after_v FROM tessera_changes('t', {from}, {to}) ORDER BY k"
    );
    let mut changes = Vec::new();
    for batch in engine.query(&sql).await.unwrap() {
        let kind = batch.column(0).as_string::<i32>();
        let [k, before, after] = [1, 2, 3].map(|i| batch.column(i).as_primitive::<Int64Type>());
        for row in 0..batch.num_rows() {
            let value = |c: &arrow::array::PrimitiveArray<Int64Type>| {
                (!c.is_null(row)).then(|| c.value(row))
            };
            changes.push((
                kind.value(row).to_string(),
                k.value(row),
                value(before),
                value(after),
            ));
        }
    }
    let mut expected = vec![
        ("delete".to_string(), 1, Some(1), None),
        ("update".to_string(), 2, Some(2), Some(-3)),
    ];
    for k in (0..100).filter(|k| k % 10 == 0) {
        expected.push(("update".into(), k, Some(k), Some(k + 1000)));
    }
    for k in (0..100).filter(|k| k % 10 == 5) {
        expected.push(("delete".into(), k, Some(k), None));
    }
    expected.sort_by_key(|c| c.1);
    assert_eq!(changes, expected);
}
