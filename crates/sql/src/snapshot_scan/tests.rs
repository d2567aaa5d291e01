use super::*;
use crate::decoded::tests::{components_held, rows_in_order, rows_of};
use crate::Engine;
use datafusion::physical_plan::{collect, displayable};
use datafusion::prelude::SessionContext;
use tessera_storage::{Store, StoreConfig};

/// A store of 8 partitions whose table `t` (`ddl`) was loaded in one publish per range of
/// `loads` (`v = 10 k`), each checkpointed into components of its own (kept apart: no
/// tiered merges).
async fn loaded(ddl: &str, loads: &[(i64, i64)]) -> (tempfile::TempDir, Arc<Store>, Engine) {
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
    engine.execute(ddl).await.unwrap();
    for (from, to) in loads {
        engine
            .execute(&format!(
                "INSERT INTO t SELECT value, value * 10 FROM generate_series({from}, {to})"
            ))
            .await
            .unwrap();
        store.checkpoint().unwrap();
    }
    (dir, store, engine)
}

/// Plans a scan of `t` (v, k) at its newest epoch, one output partition per storage
/// partition, and runs it: the plan as shown, its output partitions and the rows by key.
async fn scan(store: &Arc<Store>) -> (String, usize, Vec<(i64, i64)>) {
    let ctx = SessionContext::new();
    let snapshot = store.snapshot("t", None).unwrap();
    let plan = plan_snapshot_scan(SnapshotScan {
        store: store.as_ref(),
        snapshot: &snapshot,
        partitions: None,
        projection: vec![1, 0],
        predicate: None,
        limit: None,
        grouping: FileGrouping::PerStoragePartition,
        statistics: &ComponentStatistics::default(),
        decoded: None,
        runtime: &ctx.runtime_env(),
        parquet: Default::default(),
        order: Default::default(),
    })
    .unwrap();
    let shown = displayable(plan.as_ref()).indent(false).to_string();
    let outputs = plan.properties().output_partitioning().partition_count();
    let batches = collect(plan, ctx.task_ctx()).await.unwrap();
    (shown, outputs, rows_of(&batches))
}

fn components_per_partition(store: &Store) -> Vec<usize> {
    let snapshot = store.snapshot("t", None).unwrap();
    snapshot
        .partitions
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| p.components.len())
        .collect()
}

const KEYED: &str = "CREATE TABLE t (k BIGINT PRIMARY KEY, v BIGINT)";

#[tokio::test]
async fn loads_of_disjoint_keys_are_read_as_written() {
    let (_dir, store, _) = loaded(KEYED, &[(1, 1000), (1001, 2000), (2001, 3000)]).await;
    let held = components_per_partition(&store);
    assert!(
        held.iter().all(|&c| c == 3),
        "three components each: {held:?}"
    );

    let (shown, outputs, rows) = scan(&store).await;
    assert!(!shown.contains("VersionedScanExec"), "{shown}");
    assert!(shown.contains("DataSourceExec"), "{shown}");
    assert_eq!(
        outputs,
        held.len(),
        "one output partition per storage partition"
    );
    let expected: Vec<(i64, i64)> = (1..=3000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows, expected);
}

#[tokio::test]
async fn loads_apart_in_any_order_are_read_as_written_until_a_key_repeats() {
    let (_dir, store, engine) = loaded(KEYED, &[(1, 1000), (2001, 3000), (1001, 2000)]).await;
    let (shown, _, rows) = scan(&store).await;
    assert!(!shown.contains("VersionedScanExec"), "{shown}");
    assert_eq!(rows.len(), 3000);

    // An update writes keys the first load holds: resolved as versions, each key once.
    engine
        .execute("UPDATE t SET v = v + 1 WHERE k % 100 = 0")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let (shown, outputs, rows) = scan(&store).await;
    assert!(shown.contains("VersionedScanExec"), "{shown}");
    assert_eq!(outputs, components_per_partition(&store).len());
    let expected: Vec<(i64, i64)> = (1..=3000)
        .map(|k| (k * 10 + i64::from(k % 100 == 0), k))
        .collect();
    assert_eq!(rows, expected, "every key once, at its newest version");
}

#[tokio::test]
async fn loads_whose_key_ranges_overlap_are_resolved_as_versions() {
    // Keys 500..=600 are written again (the same values): their ranges overlap, and so
    // do their keys.
    let (_dir, store, engine) = loaded(KEYED, &[(1, 2000)]).await;
    engine
        .execute("UPDATE t SET v = k * 10 WHERE k BETWEEN 500 AND 600")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let (shown, _, rows) = scan(&store).await;
    assert!(shown.contains("VersionedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (1..=2000).map(|k| (k * 10, k)).collect();
    assert_eq!(rows, expected, "a key written twice is read once");

    // Odd keys after even ones: no key repeats, but the ranges interleave, so nothing
    // proves it; resolved as versions, the same rows.
    let (_dir, store, engine) = loaded(KEYED, &[]).await;
    for parity in [0, 1] {
        engine
            .execute(&format!(
                "INSERT INTO t SELECT value * 2 + {parity}, (value * 2 + {parity}) * 10 FROM generate_series(1, 1000)"
            ))
            .await
            .unwrap();
        store.checkpoint().unwrap();
    }
    let (shown, _, rows) = scan(&store).await;
    assert!(shown.contains("VersionedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (2..=2001).map(|k| (k * 10, k)).collect();
    assert_eq!(rows, expected);
}

#[tokio::test]
async fn an_append_only_table_reads_every_load_as_written() {
    let (_dir, store, _) = loaded(
        "CREATE TABLE t (k BIGINT, v BIGINT)",
        &[(1, 1000), (1, 1000)],
    )
    .await;
    let held = components_per_partition(&store);
    assert!(held.iter().all(|&c| c == 2), "{held:?}");
    let (shown, _, rows) = scan(&store).await;
    assert!(!shown.contains("VersionedScanExec"), "{shown}");
    let expected: Vec<(i64, i64)> = (1..=1000)
        .flat_map(|k| [(k * 10, k), (k * 10, k)])
        .collect();
    assert_eq!(rows, expected, "both loads' rows, duplicates and all");
}

const LINES: &str =
    "CREATE TABLE t (o BIGINT, l BIGINT, v BIGINT, PRIMARY KEY (o, l)) PARTITION BY (o)";

/// Order lines `(o, l, v = 10 o + l)`, as a query: orders `orders` with lines 1..=4 each,
/// and the lines `split_lines` of order `split`.
fn lines(orders: (i64, i64), split: i64, split_lines: (i64, i64)) -> String {
    format!(
        "INSERT INTO t SELECT o, l, o * 10 + l \
         FROM (SELECT value AS o FROM generate_series({}, {})) \
         CROSS JOIN (SELECT value AS l FROM generate_series(1, 4)) \
         UNION ALL SELECT {split}, value, {split} * 10 + value FROM generate_series({}, {})",
        orders.0, orders.1, split_lines.0, split_lines.1
    )
}

/// Loads `publishes` into a store of 8 partitions partitioned by the order, each
/// checkpointed into components of its own.
async fn loaded_lines(publishes: &[String]) -> (tempfile::TempDir, Arc<Store>, Engine) {
    let (dir, store, engine) = loaded(LINES, &[]).await;
    for publish in publishes {
        engine.execute(publish).await.unwrap();
        store.checkpoint().unwrap();
    }
    (dir, store, engine)
}

/// The partition snapshot holding order `o`'s lines.
fn partition_of(store: &Store, o: i64) -> PartitionSnapshot {
    let snapshot = store.snapshot("t", None).unwrap();
    let partition = tessera_common::partition_key_hashes(&[(
        "o",
        &(Arc::new(arrow::array::Int64Array::from(vec![o])) as arrow::array::ArrayRef),
    )])
    .map(|hashes| store.ring().partition_of(hashes[0]))
    .unwrap();
    snapshot
        .partitions
        .iter()
        .find(|p| p.partition == partition)
        .expect("the order's partition")
        .clone()
}

#[tokio::test]
async fn an_order_split_between_two_loads_is_read_as_written_unless_a_line_repeats() {
    // Order 101's lines 1-2 in the first load and 3-4 in the second: its partition's two
    // components both have 101 as an end of their order range, yet share no key.
    let (_dir, store, engine) =
        loaded_lines(&[lines((1, 100), 101, (1, 2)), lines((102, 200), 101, (3, 4))]).await;
    let split = partition_of(&store, 101);
    assert_eq!(split.components.len(), 2, "one component per load");
    let def = store.table_def("t").unwrap();
    let statistics = ComponentStatistics::default();
    let epoch = store.visible_epoch();
    assert!(
        read_as_written(&split, epoch, &def, store.as_ref(), &statistics)
            .unwrap()
            .is_some(),
        "the split order's lines are apart as whole keys"
    );
    let answer = engine
        .query("SELECT count(*), sum(v) FROM t")
        .await
        .unwrap();
    let expected_sum: i64 = (1..=200)
        .flat_map(|o| (1..=4).map(move |l| o * 10 + l))
        .sum();
    assert_eq!(
        crate::decoded::tests::rows_of(&answer),
        vec![(800, expected_sum)]
    );

    // An update writes line 4 of order 101 again, so its component's keys touch the
    // second load's at (101, 4) itself: resolved as versions, the line read once.
    engine
        .execute("UPDATE t SET v = -1 WHERE o = 101 AND l = 4")
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let split = partition_of(&store, 101);
    assert_eq!(split.components.len(), 3);
    assert!(
        read_as_written(
            &split,
            store.visible_epoch(),
            &def,
            store.as_ref(),
            &statistics
        )
        .unwrap()
        .is_none(),
        "a repeated key must be resolved as versions"
    );
    let answer = engine
        .query("SELECT count(*), sum(v) FROM t")
        .await
        .unwrap();
    assert_eq!(
        crate::decoded::tests::rows_of(&answer),
        vec![(800, expected_sum - 1014 - 1)]
    );
}

/// Runs `plan`'s output partitions in `order`, the rows as (v, k) in the order read.
async fn run_in_order(plan: &Arc<dyn ExecutionPlan>, order: &[usize]) -> Vec<(i64, i64)> {
    let ctx = SessionContext::new();
    let mut batches = Vec::new();
    for &i in order {
        let stream = plan.execute(i, ctx.task_ctx()).unwrap();
        batches.extend(
            futures::TryStreamExt::try_collect::<Vec<_>>(stream)
                .await
                .unwrap(),
        );
    }
    rows_in_order(&batches)
}

#[tokio::test]
async fn reading_in_id_order_gives_storage_partitions_by_id_whichever_reader_takes_them() {
    let (_dir, store, engine) = loaded(KEYED, &[(1, 1000)]).await;
    let ctx = SessionContext::new();
    let planned = |partitions: Option<&[PartitionId]>| {
        let snapshot = store.snapshot("t", None).unwrap();
        plan_in_id_order(SnapshotScan {
            store: store.as_ref(),
            snapshot: &snapshot,
            partitions,
            projection: vec![1, 0],
            predicate: None,
            limit: None,
            grouping: FileGrouping::Packed(1),
            statistics: &ComponentStatistics::default(),
            decoded: None,
            runtime: &ctx.runtime_env(),
            parquet: Default::default(),
            order: Default::default(),
        })
        .unwrap()
    };
    // A new version of one key in memory: its partition needs version resolution, the
    // others are read as written. Pick a key whose partition is neither the first nor the
    // last.
    let held: Vec<PartitionId> = store
        .snapshot("t", None)
        .unwrap()
        .partitions
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| p.partition)
        .collect();
    assert_eq!(held.len(), 8, "every partition holds rows");
    let mut versioned = None;
    for k in 1..=1000 {
        engine
            .execute(&format!("UPDATE t SET v = v + 1 WHERE k = {k}"))
            .await
            .unwrap();
        let snapshot = store.snapshot("t", None).unwrap();
        let in_memory = snapshot.partitions.iter().find(|p| !p.memtable.is_empty());
        versioned = in_memory
            .map(|p| p.partition)
            .filter(|&p| p != held[0] && p != held[7]);
        if versioned.is_some() {
            break;
        }
        store.checkpoint().unwrap();
    }
    let versioned = versioned.expect("a key outside the last partition");
    let InIdOrder {
        plan,
        reading_order,
        layout,
    } = planned(None);
    let components = components_held(&store, "t");
    assert_eq!(
        layout,
        ReadLayout {
            parquet: 7,
            decoded: 0,
            versioned: 1,
            files: components,
        },
        "each partition counted once, by the reader that takes it"
    );
    // Each storage partition alone, by id: the order a replica of any layout reads in.
    let mut by_id = Vec::new();
    for p in (0..8).map(PartitionId) {
        let alone = planned(Some(&[p]));
        by_id.extend(run_in_order(&alone.plan, &alone.reading_order).await);
    }
    assert_eq!(run_in_order(&plan, &reading_order).await, by_id);
    // The plain partitions before the versioned one are one group, those after it another.
    assert_eq!(
        plan.properties().output_partitioning().partition_count(),
        3,
        "runs of plain partitions read as one group each"
    );
    let as_listed: Vec<usize> = (0..reading_order.len()).collect();
    assert_ne!(
        reading_order, as_listed,
        "partition {versioned} (versioned) is listed after the plain ones, out of id order"
    );
}

/// Both plain readers skip what the scan's predicate excludes: the Parquet reader the row
/// groups whose footer statistics rule it out, the decoded reader the kept batches whose
/// bounds do; each returns the rows the predicate wants, and fewer than all.
#[tokio::test]
async fn both_plain_readers_skip_what_the_predicate_excludes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        dir.path(),
        StoreConfig {
            partitions: 1,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let engine = Engine::new(store.clone());
    engine.execute(KEYED).await.unwrap();
    // In key order, so each row group (and each decoded batch) holds one range of keys.
    engine
        .execute(
            "INSERT INTO t SELECT value, value * 10 FROM generate_series(1, 300000) \
             ORDER BY value",
        )
        .await
        .unwrap();
    store.checkpoint().unwrap();
    let snapshot = store.snapshot("t", None).unwrap();
    let stored = stored_schema(&snapshot.def);
    let predicate: Arc<dyn PhysicalExpr> =
        Arc::new(datafusion::physical_expr::expressions::BinaryExpr::new(
            datafusion::physical_expr::expressions::col("k", &stored).unwrap(),
            datafusion::logical_expr::Operator::Gt,
            datafusion::physical_expr::expressions::lit(290_000i64),
        ));
    let cache = Arc::new(DecodedComponents::default());
    let ctx = SessionContext::new();
    for (reader, decoded, metric) in [
        ("parquet", None, "row_groups_pruned_statistics="),
        ("decoded", Some(&cache), "batches_pruned_statistics="),
        ("decoded, kept", Some(&cache), "batches_pruned_statistics="),
    ] {
        let plan = plan_snapshot_scan(SnapshotScan {
            store: store.as_ref(),
            snapshot: &snapshot,
            partitions: None,
            projection: vec![1, 0],
            predicate: Some(predicate.clone()),
            limit: None,
            grouping: FileGrouping::Packed(1),
            statistics: &ComponentStatistics::default(),
            decoded,
            runtime: &ctx.runtime_env(),
            parquet: Default::default(),
            order: Default::default(),
        })
        .unwrap();
        let rows = rows_of(&collect(plan.clone(), ctx.task_ctx()).await.unwrap());
        let wanted = rows.iter().filter(|&&(_, k)| k > 290_000).count();
        assert_eq!(wanted, 10_000, "{reader}: every row the predicate wants");
        assert!(
            rows.len() < 150_000,
            "{reader}: most rows skipped, {} read",
            rows.len()
        );
        let shown = datafusion::physical_plan::display::DisplayableExecutionPlan::with_metrics(
            plan.as_ref(),
        )
        .indent(false)
        .to_string();
        let counts = shown
            .split(metric)
            .nth(1)
            .unwrap_or_else(|| panic!("{reader}: no {metric} in {shown}"));
        assert!(
            !counts.starts_with("0 total"),
            "{reader}: pruned by statistics: {counts:.60}"
        );
    }
}
