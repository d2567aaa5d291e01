//! Schema evolution on a local store: ADD COLUMN (with a default), DROP COLUMN, RENAME
//! COLUMN and widening type changes take effect at once, files written earlier are read
//! without rewriting (before and after merges and a restart), and a read `AS OF` an earlier
//! epoch sees the columns as they were then.

use arrow::array::RecordBatch;
use tessera_common::Epoch;
use tessera_sql::{Engine, StatementOutput};
use tessera_storage::{Store, StoreConfig};

fn config() -> StoreConfig {
    StoreConfig {
        partitions: 4,
        merge_threshold: 2,
        ..StoreConfig::default()
    }
}

fn text(batches: &[RecordBatch]) -> String {
    arrow::util::pretty::pretty_format_batches(batches)
        .unwrap()
        .to_string()
}

async fn epoch_of(engine: &Engine, sql: &str) -> Epoch {
    match engine.execute(sql).await.unwrap().pop().unwrap() {
        StatementOutput::Done {
            epoch: Some(epoch), ..
        } => epoch,
        other => panic!("{sql} published nothing: {other:?}"),
    }
}

async fn answer(engine: &Engine, sql: &str) -> String {
    text(&engine.query(sql).await.unwrap())
}

async fn error(engine: &Engine, sql: &str) -> String {
    engine.execute(sql).await.unwrap_err().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_change_without_rewriting_and_history_keeps_its_schema() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), config()).unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE t (id BIGINT, score INT, note VARCHAR, PRIMARY KEY (id))")
        .await
        .unwrap();
    let e1 = epoch_of(&engine, "INSERT INTO t VALUES (1, 10, 'a'), (2, 20, 'b')").await;
    store.checkpoint().unwrap();

    engine
        .execute("ALTER TABLE t ADD COLUMN tier VARCHAR NOT NULL DEFAULT 'basic'")
        .await
        .unwrap();
    // Rows written before the column existed read its default.
    assert_eq!(
        answer(&engine, "SELECT id, tier FROM t ORDER BY id").await,
        answer(
            &engine,
            "SELECT * FROM (VALUES (1, 'basic'), (2, 'basic')) AS v(id, tier)"
        )
        .await
        .replace("column1", "id")
        .replace("column2", "tier")
    );
    let e2 = epoch_of(
        &engine,
        "INSERT INTO t (id, score, note) VALUES (3, 30, 'c')",
    )
    .await;
    let e3 = epoch_of(&engine, "INSERT INTO t VALUES (4, 40, 'd', 'gold')").await;

    engine
        .execute("ALTER TABLE t RENAME COLUMN note TO remark")
        .await
        .unwrap();
    engine
        .execute("ALTER TABLE t ALTER COLUMN score TYPE BIGINT")
        .await
        .unwrap();
    engine
        .execute("ALTER TABLE t DROP COLUMN tier")
        .await
        .unwrap();
    let e4 = epoch_of(&engine, "UPDATE t SET score = 5000000000 WHERE id = 2").await;

    let now = "+----+------------+--------+\n\
| id | score      | remark |\n\
+----+------------+--------+\n\
| 1  | 10         | a      |\n\
| 2  | 5000000000 | b      |\n\
| 3  | 30         | c      |\n\
| 4  | 40         | d      |\n\
+----+------------+--------+";
    let as_of_e3 = "+----+-------+------+-------+\n\
| id | score | note | tier  |\n\
+----+-------+------+-------+\n\
| 1  | 10    | a    | basic |\n\
| 2  | 20    | b    | basic |\n\
| 3  | 30    | c    | basic |\n\
| 4  | 40    | d    | gold  |\n\
+----+-------+------+-------+";
    let as_of_e1 = "+----+-------+------+\n\
| id | score | note |\n\
+----+-------+------+\n\
| 1  | 10    | a    |\n\
| 2  | 20    | b    |\n\
+----+-------+------+";
    let check = |engine: Engine| async move {
        assert_eq!(answer(&engine, "SELECT * FROM t ORDER BY id").await, now);
        assert_eq!(
            answer(
                &engine,
                &format!("SELECT * FROM t AS OF EPOCH {} ORDER BY id", e3.0)
            )
            .await,
            as_of_e3
        );
        assert_eq!(
            answer(
                &engine,
                &format!("SELECT * FROM t AS OF EPOCH {} ORDER BY id", e1.0)
            )
            .await,
            as_of_e1
        );
        // Types as they were: score was INT until the widening.
        let old = engine
            .query(&format!("SELECT score FROM t AS OF EPOCH {}", e2.0))
            .await
            .unwrap();
        assert_eq!(
            old[0].schema().field(0).data_type(),
            &arrow::datatypes::DataType::Int32
        );
        engine
    };
    let engine = check(engine).await;
    assert!(e4 > e3);

    // Bad changes are refused, naming why, and change nothing.
    for (sql, why) in [
        ("ALTER TABLE t ALTER COLUMN score TYPE INT", "only widening"),
        (
            "ALTER TABLE t ALTER COLUMN remark TYPE BIGINT",
            "only widening",
        ),
        ("ALTER TABLE t DROP COLUMN id", "primary or partition key"),
        ("ALTER TABLE t DROP COLUMN nosuch", "does not exist"),
        ("ALTER TABLE t ADD COLUMN remark INT", "already exists"),
        ("ALTER TABLE t ADD COLUMN must INT NOT NULL", "no DEFAULT"),
        (
            "ALTER TABLE t ADD COLUMN n INT DEFAULT 'x'",
            "not a value of type",
        ),
        (
            "ALTER TABLE t RENAME COLUMN remark TO score",
            "already exists",
        ),
        ("ALTER TABLE nosuch ADD COLUMN x INT", "nosuch"),
    ] {
        let refused = error(&engine, sql).await;
        assert!(refused.contains(why), "{sql}: {refused}");
    }
    assert_eq!(answer(&engine, "SELECT * FROM t ORDER BY id").await, now);

    // A dropped column's name may be used again, for a new column.
    engine
        .execute("ALTER TABLE t ADD COLUMN tier INT DEFAULT 7")
        .await
        .unwrap();
    assert_eq!(
        answer(&engine, "SELECT sum(tier) AS s FROM t").await,
        "+----+\n| s  |\n+----+\n| 28 |\n+----+"
    );
    engine
        .execute("ALTER TABLE t DROP COLUMN tier")
        .await
        .unwrap();

    // Merges rewrite the old files under today's definition; a restart reads them all.
    for i in 0..4 {
        epoch_of(
            &engine,
            &format!(
                "INSERT INTO t (id, score, remark) VALUES ({}, 1, 'x')",
                100 + i
            ),
        )
        .await;
        store.checkpoint().unwrap();
    }
    epoch_of(&engine, "DELETE FROM t WHERE id >= 100").await;
    store.checkpoint().unwrap();
    drop(engine);
    drop(store);
    let store = Store::open(dir.path(), config()).unwrap();
    check(Engine::new(store)).await;
}
