//! `tessera debug publish-loop`: the workload of the crash tests.
//!
//! Publish `n` (numbered from 1) upserts `rows_in(n)` rows with keys `n * 1_000_000 + j`
//! and tag `n`, deletes the first half of publish `n - 3`'s keys, and sets the counter row
//! (key -1) to tag `n`, all in one epoch. After any crash the visible state must be exactly
//! the state after publishes `1..=c`, where `c` is the counter's tag, and `c` must be at
//! least the last publish acknowledged with `ACK n epoch` on stdout.

use anyhow::Result;
use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use std::io::Write;
use std::sync::Arc;
use tessera_sql::Engine;
use tessera_storage::{Store, TableChanges};

const KEY_STRIDE: i64 = 1_000_000;

/// Rows upserted by publish `n`: every `bulk_every`-th publish is fifty times larger, so it
/// takes the bulk path when the bulk threshold is set low.
pub fn rows_in(n: i64, rows: i64, bulk_every: i64) -> i64 {
    if bulk_every > 0 && n % bulk_every == 0 {
        rows * 50
    } else {
        rows
    }
}

pub async fn run(store: Arc<Store>, rows: i64, bulk_every: i64) -> Result<()> {
    let engine = Engine::new(store.clone());
    engine.execute("CREATE TABLE IF NOT EXISTS kv (k BIGINT NOT NULL, tag BIGINT NOT NULL, v VARCHAR, PRIMARY KEY (k))").await?;
    let counter = engine.query("SELECT tag FROM kv WHERE k = -1").await?;
    let mut n = super::answers::first_int64(&counter)?.unwrap_or(0) + 1;
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("tag", DataType::Int64, false),
        Field::new("v", DataType::Utf8, true),
    ]));
    let key_schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
    let mut stdout = std::io::stdout();
    loop {
        let count = rows_in(n, rows, bulk_every);
        let mut keys: Vec<i64> = (0..count).map(|j| n * KEY_STRIDE + j).collect();
        keys.push(-1);
        let tags = vec![n; keys.len()];
        let values: Vec<String> = keys.iter().map(|k| format!("value-{k:012}")).collect();
        let upserts = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(Int64Array::from(tags)),
                Arc::new(StringArray::from(values)),
            ],
        )?;
        let mut deletes = vec![];
        if n > 3 {
            let old = n - 3;
            let half = rows_in(old, rows, bulk_every) / 2;
            let keys: Vec<i64> = (0..half).map(|j| old * KEY_STRIDE + j).collect();
            deletes.push(RecordBatch::try_new(
                key_schema.clone(),
                vec![Arc::new(Int64Array::from(keys))],
            )?);
        }
        let changes = vec![TableChanges {
            table: "kv".into(),
            upserts: vec![upserts],
            deletes,
            before_images: vec![],
        }];
        let publisher = store.clone();
        let epoch = tokio::task::spawn_blocking(move || publisher.publish(changes)).await??;
        writeln!(stdout, "ACK {n} {epoch}")?;
        stdout.flush()?;
        n += 1;
    }
}
