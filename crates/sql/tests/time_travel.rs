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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_epoch_answers_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        partitions: 8,
        merge_threshold: 2,
        ..StoreConfig::default()
    };
    let store = Store::open(dir.path(), config.clone()).unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE accounts (id BIGINT, balance BIGINT NOT NULL, PRIMARY KEY (id))")
        .await
        .unwrap();

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
