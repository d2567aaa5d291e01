//! Bad input gets a clear error naming the problem, loses nothing, and leaves the store usable.

use tessera_sql::{Engine, SqlError};
use tessera_storage::{Store, StoreConfig};

fn small_store(dir: &std::path::Path) -> std::sync::Arc<Store> {
    Store::open(
        dir,
        StoreConfig {
            partitions: 4,
            ..StoreConfig::default()
        },
    )
    .unwrap()
}

async fn create_people(engine: &Engine) {
    engine
        .execute("CREATE TABLE people (id BIGINT, name VARCHAR NOT NULL, PRIMARY KEY (id))")
        .await
        .unwrap();
}

async fn contents(engine: &Engine) -> String {
    let batches = engine
        .query("SELECT id, name FROM people ORDER BY id")
        .await
        .unwrap();
    arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string()
}

async fn expect_error(engine: &Engine, sql: &str, needle: &str) -> SqlError {
    let err = engine.execute(sql).await.expect_err(sql);
    assert!(
        err.to_string()
            .to_lowercase()
            .contains(&needle.to_lowercase()),
        "`{sql}` gave `{err}`, which does not mention `{needle}`"
    );
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_statements_are_refused_and_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(dir.path());
    let engine = Engine::new(store.clone());
    create_people(&engine).await;
    engine
        .execute("INSERT INTO people VALUES (1, 'ada'), (2, 'grace')")
        .await
        .unwrap();
    let before = contents(&engine).await;
    let epoch = store.visible_epoch();

    expect_error(&engine, "SELEC * FROM people", "SELEC").await;
    expect_error(&engine, "SELECT * FROM nobody", "nobody").await;
    expect_error(&engine, "INSERT INTO people VALUES ('three', 'x')", "three").await;
    expect_error(
        &engine,
        "INSERT INTO people VALUES (3, 'x'), (3, 'y')",
        "duplicate primary key (3)",
    )
    .await;
    expect_error(
        &engine,
        "INSERT INTO people VALUES (2, 'again')",
        "duplicate key (2)",
    )
    .await;
    expect_error(&engine, "INSERT INTO people VALUES (NULL, 'nobody')", "id").await;
    expect_error(&engine, "INSERT INTO people VALUES (4, NULL)", "name").await;
    expect_error(
        &engine,
        "UPDATE people SET id = 9 WHERE id = 1",
        "primary key",
    )
    .await;
    expect_error(
        &engine,
        "CREATE TABLE people (id BIGINT PRIMARY KEY)",
        "already exists",
    )
    .await;
    expect_error(
        &engine,
        "CREATE TABLE t2 (id BIGINT, x DOUBLE, PRIMARY KEY (id)) PARTITION BY (x)",
        "prefix",
    )
    .await;
    expect_error(
        &engine,
        "CREATE TABLE t3 (f DOUBLE, PRIMARY KEY (f))",
        "cannot be a key",
    )
    .await;
    expect_error(
        &engine,
        "SELECT * FROM people AS OF EPOCH banana",
        "epoch number",
    )
    .await;
    let huge = format!(
        "SELECT '{}'",
        "x".repeat(tessera_sql::engine::MAX_SQL_BYTES)
    );
    expect_error(&engine, &huge, "exceeds the limit").await;

    assert_eq!(
        contents(&engine).await,
        before,
        "failed statements changed nothing"
    );
    assert_eq!(
        store.visible_epoch(),
        epoch,
        "failed statements published no epoch"
    );
    engine
        .execute("INSERT INTO people VALUES (3, 'edsger')")
        .await
        .unwrap();
    assert!(
        contents(&engine).await.contains("edsger"),
        "the store stays usable"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_only_tables_keep_every_row_and_refuse_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(dir.path());
    let engine = Engine::new(store);
    engine
        .execute("CREATE TABLE events (kind VARCHAR, amount DOUBLE)")
        .await
        .unwrap();
    engine
        .execute("INSERT INTO events VALUES ('a', 1.5), ('a', 1.5), ('b', NULL)")
        .await
        .unwrap();
    engine
        .execute("INSERT INTO events VALUES ('a', 1.5)")
        .await
        .unwrap();
    let batches = engine
        .query("SELECT count(*) AS n FROM events WHERE kind = 'a'")
        .await
        .unwrap();
    assert_eq!(
        arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
            .matches("| 3 ")
            .count(),
        1
    );
    expect_error(
        &engine,
        "DELETE FROM events WHERE kind = 'a'",
        "append-only",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_publishes_are_refused_with_the_limit_named() {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        partitions: 4,
        max_publish_bytes: 64 << 10,
        ..StoreConfig::default()
    };
    let store = Store::open(dir.path(), config).unwrap();
    let engine = Engine::new(store.clone());
    create_people(&engine).await;
    engine
        .execute("INSERT INTO people VALUES (1, 'ada')")
        .await
        .unwrap();
    let epoch = store.visible_epoch();
    let err = expect_error(
        &engine,
        "INSERT INTO people SELECT value, 'x' FROM generate_series(2, 100000)",
        "max_publish_bytes",
    )
    .await;
    assert!(err.to_string().contains("65536"), "{err}");
    assert_eq!(store.visible_epoch(), epoch);
    assert!(contents(&engine).await.contains("ada"));
}

/// Flight SQL asks for a statement's columns before it runs it: a user statement is a
/// command (no columns), not a syntax error, and a malformed one is named.
#[tokio::test]
async fn a_user_statement_is_described_as_a_command() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::new(small_store(dir.path()));
    let described = engine
        .describe("CREATE USER ada WITH PASSWORD 'pencil'")
        .await
        .unwrap();
    assert!(described.is_none(), "{described:?}");
    let malformed = engine.describe("CREATE USER ada").await.unwrap_err();
    assert!(
        malformed.to_string().contains("WITH PASSWORD"),
        "{malformed}"
    );
}
