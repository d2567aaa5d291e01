use super::*;
use crate::provider::{plan_snapshot_scan, ComponentStatistics, FileGrouping, SnapshotScan};
use crate::Engine;
use arrow::array::Int64Array;
use datafusion::physical_plan::{collect, displayable};
use datafusion::prelude::SessionContext;
use tessera_storage::{Store, StoreConfig};

/// A store of 8 partitions whose table `t (k, v = 10 k)` holds keys 1..=rows, checkpointed
/// into one plain component per partition (later checkpoints' components are kept apart:
/// no tiered merges).
async fn store_with_rows(rows: i64) -> (tempfile::TempDir, Arc<Store>) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 8,
            tiered_merges: false,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let engine = Engine::new(store.clone());
    engine
        .execute("CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT)")
        .await
        .unwrap();
    engine
        .execute(&format!(
            "INSERT INTO t SELECT value, value * 10 FROM generate_series(1, {rows})"
        ))
        .await
        .unwrap();
    store.checkpoint().unwrap();
    (dir, store)
}

/// Plans a scan of every column of `t` through `cache` and runs it.
async fn scan(
    store: &Arc<Store>,
    cache: &Arc<DecodedComponents>,
    limit: Option<usize>,
    groups: usize,
) -> (String, Vec<RecordBatch>) {
    scan_columns(store, cache, vec![1, 0], limit, groups).await
}

/// Plans a scan of `projection` of `t` through `cache` and runs it.
async fn scan_columns(
    store: &Arc<Store>,
    cache: &Arc<DecodedComponents>,
    projection: Vec<usize>,
    limit: Option<usize>,
    groups: usize,
) -> (String, Vec<RecordBatch>) {
    let ctx = SessionContext::new();
    let snapshot = store.snapshot("t", None).unwrap();
    let plan = plan_snapshot_scan(SnapshotScan {
        store: store.as_ref(),
        snapshot: &snapshot,
        partitions: None,
        projection,
        predicate: None,
        limit,
        grouping: FileGrouping::Packed(groups),
        statistics: &ComponentStatistics::default(),
        decoded: Some(cache),
        runtime: &ctx.runtime_env(),
        parquet: Default::default(),
        order: Default::default(),
    })
    .unwrap();
    let shown = displayable(plan.as_ref()).indent(false).to_string();
    let batches = collect(plan, ctx.task_ctx()).await.unwrap();
    (shown, batches)
}

/// Every (v, k) row of the batches, sorted by k.
/// How many components the partitions of `table` hold now, all told.
pub(crate) fn components_held(store: &Store, table: &str) -> usize {
    store
        .snapshot(table, None)
        .unwrap()
        .partitions
        .iter()
        .map(|p| p.components.len())
        .sum()
}

pub(crate) fn rows_of(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    let mut rows = rows_in_order(batches);
    rows.sort_by_key(|&(_, k)| k);
    rows
}

/// The (v, k) rows of `batches`, in the order read.
pub(crate) fn rows_in_order(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    let column = |b: &RecordBatch, i: usize| {
        b.column(i)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("BIGINT column")
            .clone()
    };
    batches
        .iter()
        .flat_map(|b| {
            let (v, k) = (column(b, 0), column(b, 1));
            (0..b.num_rows())
                .map(|i| (v.value(i), k.value(i)))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[tokio::test]
async fn small_components_are_read_decoded_kept_and_exact() {
    let (_dir, store) = store_with_rows(1000).await;
    let cache = Arc::new(DecodedComponents::default());
    let components = store.snapshot("t", None).unwrap().partitions.len();
    assert!(components > 1, "the rows span several partitions");

    let (shown, batches) = scan(&store, &cache, None, 2).await;
    assert!(shown.contains("DecodedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (1..=1000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows_of(&batches), expected);
    assert!(
        batches.len() <= 2,
        "small components' rows are gathered into batches, one group each: {} batches",
        batches.len()
    );
    let usage = cache.usage();
    assert_eq!(usage.components, components);
    assert!(usage.bytes > 0);

    // A second read is served from memory, the same rows.
    let (_, again) = scan(&store, &cache, None, 2).await;
    assert_eq!(rows_of(&again), expected);
    assert_eq!(cache.usage(), usage, "nothing decoded twice");
}

/// A scan keeps the columns it reads and no others; a later scan of more columns reads
/// only the missing ones and puts them beside the kept ones, row for row. Were whole
/// components kept, the first scan would hold both columns.
#[tokio::test]
async fn the_cache_keeps_the_columns_a_scan_reads() {
    let (_dir, store) = store_with_rows(1000).await;
    let cache = Arc::new(DecodedComponents::default());
    let components = store.snapshot("t", None).unwrap().partitions.len();

    let (_, batches) = scan_columns(&store, &cache, vec![1], None, 2).await;
    assert_eq!(batches.iter().map(|b| b.num_columns()).max(), Some(1));
    let usage = cache.usage();
    assert_eq!(usage.components, components);
    assert_eq!(usage.columns, components, "only v is kept");

    let (_, both) = scan(&store, &cache, None, 2).await;
    let expected: Vec<(i64, i64)> = (1..=1000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows_of(&both), expected, "kept v and newly read k line up");
    let usage = cache.usage();
    assert_eq!(usage.components, components);
    assert_eq!(usage.columns, 2 * components, "k is kept beside v");
}

#[tokio::test]
async fn a_scan_of_no_columns_counts_the_rows() {
    let (_dir, store) = store_with_rows(1000).await;
    let cache = Arc::new(DecodedComponents::default());
    let (shown, batches) = scan_columns(&store, &cache, vec![], None, 2).await;
    assert!(shown.contains("DecodedScanExec"), "{shown}");
    assert!(batches.iter().all(|b| b.num_columns() == 0));
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1000);
}

#[tokio::test]
async fn a_limit_stops_each_group_early() {
    let (_dir, store) = store_with_rows(1000).await;
    let cache = Arc::new(DecodedComponents::default());
    let (_, batches) = scan(&store, &cache, Some(3), 1).await;
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 3);
}

#[tokio::test]
async fn components_over_the_size_limit_are_read_from_parquet() {
    let (_dir, store) = store_with_rows(1000).await;
    let smallest = store.snapshot("t", None).unwrap().partitions[0].components[0].bytes;
    let cache = Arc::new(DecodedComponents::new(DecodedLimits {
        budget_bytes: 1 << 30,
        max_component_bytes: smallest / 2,
        max_scan_bytes: 0,
    }));
    let (shown, batches) = scan(&store, &cache, None, 2).await;
    assert!(shown.contains("DataSourceExec"), "{shown}");
    assert!(!shown.contains("DecodedScanExec"), "{shown}");
    assert_eq!(rows_of(&batches).len(), 1000);
    assert_eq!(cache.usage().components, 0);
}

/// Components too large on disk for the cache are read through it all the same when the
/// columns a scan reads take little memory decoded; a scan of more columns than that
/// bound allows reads Parquet and keeps nothing.
#[tokio::test]
async fn a_scan_of_few_small_columns_is_kept_whatever_its_files_sizes() {
    let (_dir, store) = store_with_rows(1000).await;
    let components = store.snapshot("t", None).unwrap().partitions.len();
    // `v` alone is 8 bytes a row decoded, 8000 over the table; `v, k` twice that.
    let cache = Arc::new(DecodedComponents::new(DecodedLimits {
        budget_bytes: 1 << 30,
        max_component_bytes: 0,
        max_scan_bytes: 12_000,
    }));
    let (shown, batches) = scan_columns(&store, &cache, vec![1], None, 2).await;
    assert!(shown.contains("DecodedScanExec"), "{shown}");
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1000);
    assert_eq!(
        cache.usage().columns,
        components,
        "v of every component kept"
    );

    let (shown, both) = scan(&store, &cache, None, 2).await;
    assert!(shown.contains("DataSourceExec"), "{shown}");
    assert!(!shown.contains("DecodedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (1..=1000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows_of(&both), expected);
    assert_eq!(cache.usage().columns, components, "nothing more kept");
}

#[tokio::test]
async fn the_budget_evicts_the_least_recently_read() {
    let (_dir, store) = store_with_rows(1000).await;
    let snapshot = store.snapshot("t", None).unwrap();
    let components: Vec<ComponentMeta> = snapshot
        .partitions
        .iter()
        .flat_map(|p| p.components.clone())
        .collect();
    let def = &snapshot.def;
    let dir = store.components_dir();
    let measure = DecodedComponents::default();
    let sizes: Vec<u64> = components
        .iter()
        .map(|c| {
            let rows = measure.rows(dir, def, c).unwrap();
            rows.iter().map(|b| b.get_array_memory_size() as u64).sum()
        })
        .collect();
    let largest = *sizes.iter().max().unwrap();
    // Room for two of the largest, never three.
    let cache = DecodedComponents::new(DecodedLimits {
        budget_bytes: 2 * largest + largest / 2,
        max_component_bytes: u64::MAX,
        max_scan_bytes: u64::MAX,
    });
    let first = &components[0];
    cache.rows(dir, def, first).unwrap();
    for component in &components[1..] {
        // The first is read again before each new one, so it is never the oldest.
        cache.rows(dir, def, first).unwrap();
        cache.rows(dir, def, component).unwrap();
        let usage = cache.usage();
        assert!(usage.bytes <= 2 * largest + largest / 2, "{usage:?}");
    }
    assert!(
        cache.usage().components < components.len(),
        "some were evicted"
    );
    let state = cache.state.lock().unwrap();
    let every_column_kept = |component: &ComponentMeta| {
        (0..stored_schema(def).fields().len()).all(|column| {
            state
                .entries
                .contains_key(&(component.hash, def.layout(), column))
        })
    };
    assert!(every_column_kept(first), "the most recently read stays");
    assert!(
        every_column_kept(components.last().unwrap()),
        "the newest stays"
    );
}

/// Partitions whose versions are resolved read their small components through the cache
/// too: after an update, each updated partition's base and change components are kept,
/// and a second scan answers the same from memory.
#[tokio::test]
async fn a_versioned_scan_reads_its_small_components_decoded() {
    let (_dir, store) = store_with_rows(1000).await;
    let engine = Engine::new(store.clone());
    engine
        .execute("UPDATE t SET v = v + 1 WHERE k % 3 = 0")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let held = components_held(&store, "t");
    let cache = Arc::new(DecodedComponents::default());
    let expected: Vec<(i64, i64)> = (1..=1000)
        .map(|k| (k * 10 + i64::from(k % 3 == 0), k))
        .collect();
    for _ in 0..2 {
        let (shown, batches) = scan(&store, &cache, None, 2).await;
        assert!(shown.contains("VersionedScanExec"), "{shown}");
        assert_eq!(rows_of(&batches), expected);
        assert_eq!(cache.usage().components, held, "every component kept");
    }
}

/// A component of several kept batches is read out batch by batch, each as it is kept
/// (sharing its memory), never copied together into one batch of the whole component:
/// that copy made a 60 M-row scan through the cache slower than decoding its Parquet.
#[tokio::test]
async fn a_large_components_kept_batches_go_out_as_kept() {
    // 20,000 rows a partition: each component is read (and kept) in 8192-row batches.
    let (_dir, store) = store_with_rows(160_000).await;
    let cache = Arc::new(DecodedComponents::default());
    let expected: Vec<(i64, i64)> = (1..=160_000).map(|k| (k * 10, k)).collect();
    let (shown, first) = scan(&store, &cache, None, 2).await;
    assert!(shown.contains("DecodedScanExec"), "{shown}");
    assert_eq!(rows_of(&first), expected);
    let (_, again) = scan(&store, &cache, None, 2).await;
    assert_eq!(rows_of(&again), expected);

    let batch_rows = SessionContext::new().state().config().batch_size();
    for batch in first.iter().chain(&again) {
        assert!(
            batch.num_rows() <= batch_rows,
            "a batch of {} rows: a component's batches were gathered into one",
            batch.num_rows()
        );
    }
    let kept_values: HashSet<*const u8> = {
        let state = cache.state.lock().unwrap();
        state
            .entries
            .values()
            .flat_map(|entry| entry.column.arrays.iter())
            .map(|array| array.to_data().buffers()[0].as_ptr())
            .collect()
    };
    let shared = again
        .iter()
        .filter(|b| kept_values.contains(&b.column(0).to_data().buffers()[0].as_ptr()))
        .count();
    assert_eq!(
        shared,
        again.len(),
        "every batch of a second scan is a kept batch, not a copy of kept ones"
    );
}
