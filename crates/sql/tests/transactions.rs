//! Transactions read their own writes: inside `BEGIN`, every read of a table the
//! transaction wrote sees its start epoch changed by its own statements, and nobody else
//! sees them until COMMIT. Random statements against an in-memory model.

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Int64Type;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use tessera_sql::Engine;
use tessera_storage::{Store, StoreConfig};

type Rows = BTreeMap<i64, i64>;

fn rows(batches: &[RecordBatch]) -> Rows {
    let mut out = Rows::new();
    for b in batches {
        let id = b.column(0).as_primitive::<Int64Type>();
        let balance = b.column(1).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            assert!(
                out.insert(id.value(i), balance.value(i)).is_none(),
                "key {} answered twice",
                id.value(i)
            );
        }
    }
    out
}

async fn read(engine: &Engine, sql: &str) -> Rows {
    rows(&engine.query(sql).await.unwrap())
}

async fn accounts(engine: &Engine) -> Rows {
    read(engine, "SELECT id, balance FROM accounts").await
}

/// One random write, applied to the model as the engine must apply it.
async fn random_write(rng: &mut StdRng, engine: &Engine, model: &mut Rows) {
    let id = rng.random_range(0..20i64);
    match rng.random_range(0..4) {
        0 => {
            let sql = format!("INSERT INTO accounts VALUES ({id}, {})", id * 10);
            let result = engine.execute(&sql).await;
            if model.contains_key(&id) {
                let error = result
                    .expect_err("a duplicate key was inserted")
                    .to_string();
                assert!(error.contains("duplicate key"), "{error}");
            } else {
                result.unwrap();
                model.insert(id, id * 10);
            }
        }
        1 => {
            let sql = format!("UPDATE accounts SET balance = balance + 1 WHERE id <= {id}");
            engine.execute(&sql).await.unwrap();
            model.range_mut(..=id).for_each(|(_, b)| *b += 1);
        }
        2 => {
            let sql = format!("DELETE FROM accounts WHERE id >= {id} AND id < {}", id + 3);
            engine.execute(&sql).await.unwrap();
            model.retain(|k, _| !(id..id + 3).contains(k));
        }
        _ => {
            // A write computed from a read of the table: it must see the earlier writes.
            let sql = format!(
                "INSERT INTO accounts SELECT id + 100, balance FROM accounts WHERE id = {id}"
            );
            let result = engine.execute(&sql).await;
            match model.get(&id).copied() {
                Some(balance) if model.contains_key(&(id + 100)) => {
                    let error = result
                        .expect_err("a duplicate key was inserted")
                        .to_string();
                    assert!(error.contains("duplicate key"), "{error}");
                    let _ = balance;
                }
                Some(balance) => {
                    result.unwrap();
                    model.insert(id + 100, balance);
                }
                None => {
                    result.unwrap();
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_reads_its_own_writes_and_nobody_else_does() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 8,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let writer = Engine::new(store.clone());
    let other = Engine::new(store.clone());
    writer
        .execute("CREATE TABLE accounts (id BIGINT, balance BIGINT NOT NULL, PRIMARY KEY (id))")
        .await
        .unwrap();
    writer
        .execute("INSERT INTO accounts VALUES (1, 10), (2, 20), (3, 30), (4, 40), (5, 50)")
        .await
        .unwrap();
    let mut committed: Rows = (1..=5).map(|i| (i, i * 10)).collect();

    // A key the transaction deleted may be inserted again; one it inserted may not.
    writer.execute("BEGIN").await.unwrap();
    writer
        .execute("DELETE FROM accounts WHERE id = 3")
        .await
        .unwrap();
    writer
        .execute("INSERT INTO accounts VALUES (3, 33)")
        .await
        .unwrap();
    let again = writer.execute("INSERT INTO accounts VALUES (3, 34)").await;
    assert!(again.unwrap_err().to_string().contains("duplicate key"));
    writer.execute("COMMIT").await.unwrap();
    committed.insert(3, 33);
    assert_eq!(accounts(&other).await, committed);

    let mut rng = StdRng::seed_from_u64(17);

    for round in 0..30 {
        writer.execute("BEGIN").await.unwrap();
        let mut inside = committed.clone();
        for _ in 0..rng.random_range(1..8) {
            random_write(&mut rng, &writer, &mut inside).await;
            assert_eq!(accounts(&writer).await, inside, "round {round}: own writes");
            assert_eq!(
                accounts(&other).await,
                committed,
                "round {round}: another session saw uncommitted writes"
            );
        }
        // Filters, aggregates and joins over the overlaid table answer as over the model.
        let low: Rows = inside.range(..10).map(|(k, v)| (*k, *v)).collect();
        assert_eq!(
            read(&writer, "SELECT id, balance FROM accounts WHERE id < 10").await,
            low
        );
        let total: i64 = inside.values().sum();
        let counted = writer
            .query("SELECT count(*), coalesce(sum(balance), 0) FROM accounts")
            .await
            .unwrap();
        assert_eq!(
            counted[0].column(0).as_primitive::<Int64Type>().value(0),
            inside.len() as i64
        );
        assert_eq!(
            counted[0].column(1).as_primitive::<Int64Type>().value(0),
            total
        );
        let pairs: Rows = inside
            .iter()
            .filter(|(k, _)| inside.contains_key(&(*k + 100)))
            .map(|(k, v)| (*k, *v + inside[&(*k + 100)]))
            .collect();
        assert_eq!(
            read(
                &writer,
                "SELECT a.id, a.balance + b.balance FROM accounts a JOIN accounts b ON b.id = a.id + 100"
            )
            .await,
            pairs
        );
        if rng.random_bool(0.6) {
            writer.execute("COMMIT").await.unwrap();
            committed = inside;
        } else {
            writer.execute("ROLLBACK").await.unwrap();
        }
        assert_eq!(
            accounts(&writer).await,
            committed,
            "round {round}: after its end"
        );
        assert_eq!(
            accounts(&other).await,
            committed,
            "round {round}: after its end"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_as_of_an_epoch_inside_a_transaction_see_history_not_its_writes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE accounts (id BIGINT, balance BIGINT NOT NULL, PRIMARY KEY (id))")
        .await
        .unwrap();
    engine
        .execute("INSERT INTO accounts VALUES (1, 10)")
        .await
        .unwrap();
    let epoch = store.visible_epoch();
    engine.execute("BEGIN").await.unwrap();
    engine
        .execute("INSERT INTO accounts VALUES (2, 20)")
        .await
        .unwrap();
    assert_eq!(
        read(
            &engine,
            &format!("SELECT id, balance FROM accounts AS OF EPOCH {}", epoch.0)
        )
        .await,
        Rows::from([(1, 10)])
    );
    assert_eq!(accounts(&engine).await, Rows::from([(1, 10), (2, 20)]));
    engine.execute("COMMIT").await.unwrap();
}
