//! Correctness oracle: every TPC-H query on Tessera returns DataFusion's answer over the
//! same generated data.

use datafusion::prelude::{SessionConfig, SessionContext};
use tessera_sql::{Engine, ScanLayout};
use tessera_storage::{Store, StoreConfig, TableChanges};

/// Loads TPC-H into `engine`, publishing each table in chunks of `chunk_rows` rows.
async fn load(engine: &Engine, sf: f64, chunk_rows: usize) {
    for table in tessera_tpch::TABLES {
        engine
            .execute(&tessera_tpch::create_table_sql(&table))
            .await
            .unwrap();
        for batch in table.generate(sf, chunk_rows) {
            let changes = TableChanges::upserts(table.name, vec![batch.unwrap()]);
            engine
                .backend()
                .publish(vec![changes], &Default::default())
                .await
                .unwrap();
        }
    }
}

/// Every query's answer from `engine`, reading each table `AS OF EPOCH` `as_of` if given,
/// equals `oracle`'s.
async fn assert_all_queries_match(engine: &Engine, oracle: &SessionContext, as_of: Option<u64>) {
    let mut failures = Vec::new();
    for q in 1..=22 {
        let sql = tessera_tpch::query(q);
        let expected = oracle.sql(sql).await.unwrap().collect().await.unwrap();
        let read = match as_of {
            Some(epoch) => tessera_tpch::read_as_of(sql, epoch),
            None => sql.to_string(),
        };
        let actual = engine
            .query(&read)
            .await
            .unwrap_or_else(|e| panic!("Q{q} failed on Tessera: {e}"));
        let rows: usize = expected.iter().map(|b| b.num_rows()).sum();
        assert!(
            rows > 0 || q == 15 || q == 20 || q == 21,
            "Q{q} returns rows at this scale, so the comparison means something"
        );
        if let Err(diff) = tessera_tpch::compare::same_answer(&expected, &actual, 1e-9) {
            failures.push(format!("Q{q}: {diff}"));
        }
    }
    assert!(
        failures.is_empty(),
        "answers differ from DataFusion:\n{}",
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_22_queries_match_datafusion_at_sf_0_1() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
    let engine = Engine::new(store.clone());
    // One publish per table: the bulk path, one plain component per partition.
    for table in tessera_tpch::TABLES {
        engine
            .execute(&tessera_tpch::create_table_sql(&table))
            .await
            .unwrap();
        let batches: Vec<_> = table
            .generate(0.1, 64 * 1024)
            .collect::<Result<_, _>>()
            .unwrap();
        store
            .publish(vec![TableChanges::upserts(table.name, batches)])
            .unwrap();
    }
    assert_all_queries_match(&engine, &tessera_tpch::oracle::oracle(0.1).unwrap(), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_22_queries_match_through_the_log_memtables_and_merges() {
    let dir = tempfile::tempdir().unwrap();
    // Small publishes through the log; small memtables force checkpoints; a low merge
    // threshold forces merges: every read path is exercised, including reopening.
    let config = StoreConfig {
        memtable_flush_bytes: 2 << 20,
        merge_threshold: 3,
        ..StoreConfig::default()
    };
    let sf = 0.01;
    {
        let store = Store::open(dir.path(), config.clone()).unwrap();
        let engine = Engine::new(store.clone());
        load(&engine, sf, 5_000).await;
        let stats = store.table_stats();
        let lineitem = stats.iter().find(|t| t.name == "lineitem").unwrap();
        assert!(
            lineitem.memtable_rows > 0,
            "some rows are still only in memory and the log"
        );
        assert_all_queries_match(&engine, &tessera_tpch::oracle::oracle(sf).unwrap(), None).await;
    }
    // After a restart, and with one scan partition per storage partition, as distributed
    // execution will read them.
    let store = Store::open(dir.path(), config).unwrap();
    let engine = Engine::with_layout(
        store.clone(),
        SessionConfig::new(),
        ScanLayout::PerStoragePartition,
    );
    let oracle = tessera_tpch::oracle::oracle(sf).unwrap();
    assert_all_queries_match(&engine, &oracle, None).await;
    // Every query again, as of the load, after new versions of half of lineitem and a third
    // of the orders, flushed and checkpointed (merging the partitions that crowd): a read
    // at the load's epoch must skip every newer version, and find older ones in history.
    let loaded = store.visible_epoch();
    for update in [
        "UPDATE lineitem SET l_quantity = l_quantity + 1 WHERE l_orderkey % 2 = 0",
        "UPDATE orders SET o_orderpriority = 'changed' WHERE o_orderkey % 3 = 0",
    ] {
        engine.execute(update).await.unwrap();
    }
    store.flush().unwrap();
    store.checkpoint().unwrap();
    assert_all_queries_match(&engine, &oracle, Some(loaded.0)).await;
}
