//! The storage exchange's routing and the co-location invariant, on hand-built plans.

use super::*;
use arrow::array::{Int32Array, Int64Array, StringArray};
use arrow::datatypes::{Field, Schema, SchemaRef};
use datafusion::common::{JoinType, NullEquality};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::empty::EmptyExec;

/// A ring of 8 partitions read in two groups, interleaved so that a group is not a range.
fn layout() -> StorageLayout {
    StorageLayout {
        ring: 8,
        groups: vec![
            [0, 2, 4, 6].map(PartitionId).to_vec(),
            [1, 3, 5, 7].map(PartitionId).to_vec(),
        ],
    }
}

fn schema(name: &str) -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new(name, DataType::Int64, false)]))
}

fn column(name: &str) -> Arc<dyn PhysicalExpr> {
    Arc::new(Column::new(name, 0))
}

fn leaf(name: &str) -> Arc<dyn ExecutionPlan> {
    Arc::new(EmptyExec::new(schema(name)))
}

fn storage_side(name: &str) -> Arc<dyn ExecutionPlan> {
    Arc::new(StorageRepartitionExec::try_new(leaf(name), vec![column(name)], layout()).unwrap())
}

fn datafusion_side(name: &str, buckets: usize) -> Arc<dyn ExecutionPlan> {
    Arc::new(
        RepartitionExec::try_new(leaf(name), Partitioning::Hash(vec![column(name)], buckets))
            .unwrap(),
    )
}

fn join(left: Arc<dyn ExecutionPlan>, right: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    Arc::new(
        HashJoinExec::try_new(
            left,
            right,
            vec![(column("a"), column("b"))],
            None,
            &JoinType::Inner,
            None,
            PartitionMode::Partitioned,
            NullEquality::NullEqualsNothing,
            false,
        )
        .unwrap(),
    )
}

#[test]
fn the_storage_exchange_puts_a_row_where_the_storage_puts_it() {
    let keys: Vec<i64> = (0..500).map(|k| k * 7919 % 100_003).collect();
    let batch =
        RecordBatch::try_new(schema("a"), vec![Arc::new(Int64Array::from(keys.clone()))]).unwrap();
    let layout = layout();
    let router = StorageRouter::new(vec![column("a")], layout.bucket_of_partition(), 2);
    let routed = router.route(&batch).unwrap();
    assert_eq!(routed.len(), 2, "500 keys fall in both groups");
    let ring = PartitionRing::new(8);
    let mut seen = 0;
    for (bucket, part) in routed {
        let values = part
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let array: ArrayRef = Arc::new(values.clone());
        let hashes = partition_key_hashes(&[("a", &array)]).unwrap();
        for hash in hashes {
            let partition = ring.partition_of(hash);
            assert!(
                layout.groups[bucket].contains(&partition),
                "a row of partition {partition:?} went to bucket {bucket}"
            );
        }
        seen += part.num_rows();
    }
    assert_eq!(seen, keys.len(), "every row is routed once");
}

#[test]
fn keys_of_narrower_integer_types_route_alike() {
    let wide: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3, 400, 5000]));
    let narrow: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3, 400, 5000]));
    let router = StorageRouter::new(vec![column("k")], layout().bucket_of_partition(), 2);
    let route = |array: ArrayRef| {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "k",
            array.data_type().clone(),
            false,
        )]));
        let batch = RecordBatch::try_new(schema, vec![array]).unwrap();
        router
            .route(&batch)
            .unwrap()
            .into_iter()
            .map(|(bucket, part)| (bucket, part.num_rows()))
            .collect::<Vec<_>>()
    };
    assert_eq!(route(wide), route(narrow));
}

#[test]
fn a_key_the_storage_cannot_hash_is_refused_when_planned() {
    let schema = Arc::new(Schema::new(vec![Field::new("f", DataType::Float64, false)]));
    let error = StorageRepartitionExec::try_new(
        Arc::new(EmptyExec::new(schema)),
        vec![Arc::new(Column::new("f", 0))],
        layout(),
    )
    .unwrap_err();
    assert!(error.to_string().contains("Float64"), "{error}");
    // Strings hash as the storage hashes them.
    let strings = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, false)]));
    let batch =
        RecordBatch::try_new(strings, vec![Arc::new(StringArray::from(vec!["x", "y"]))]).unwrap();
    let router = StorageRouter::new(
        vec![Arc::new(Column::new("s", 0))],
        layout().bucket_of_partition(),
        2,
    );
    assert_eq!(
        router
            .route(&batch)
            .unwrap()
            .iter()
            .map(|(_, b)| b.num_rows())
            .sum::<usize>(),
        2
    );
}

#[test]
fn a_join_pairing_storage_and_datafusion_partitions_is_refused() {
    let mixed = join(storage_side("a"), datafusion_side("b", 2));
    let error = check(&mixed).unwrap_err().to_string();
    assert!(
        error.contains("HashJoinExec pairs the partitions"),
        "{error}"
    );
    assert!(
        error.contains("the storage's hash") && error.contains("DataFusion's"),
        "{error}"
    );
    // Alike on both sides, by either hash, passes.
    check(&join(storage_side("a"), storage_side("b"))).unwrap();
    check(&join(datafusion_side("a", 2), datafusion_side("b", 2))).unwrap();
}

#[test]
fn colocating_hashes_the_other_side_as_the_storage_does() {
    let fixed = colocate(join(storage_side("a"), datafusion_side("b", 2))).unwrap();
    check(&fixed).unwrap();
    let right = fixed.children()[1].clone();
    let storage = right
        .downcast_ref::<StorageRepartitionExec>()
        .expect("the DataFusion repartition became a storage one");
    assert_eq!(storage.layout, layout());
    assert!(
        storage.input().is::<EmptyExec>(),
        "no repartition is left under it"
    );
    // Two DataFusion sides stay as they are.
    let plain = join(datafusion_side("a", 2), datafusion_side("b", 2));
    let same = colocate(plain.clone()).unwrap();
    assert!(same.children()[0].is::<RepartitionExec>());
    assert!(same.children()[1].is::<RepartitionExec>());
}

#[test]
fn repartitions_over_two_alike_storage_inputs_are_removed() {
    let over = |name: &str| -> Arc<dyn ExecutionPlan> {
        Arc::new(
            RepartitionExec::try_new(
                storage_side(name),
                Partitioning::Hash(vec![column(name)], 2),
            )
            .unwrap(),
        )
    };
    let fixed = colocate(join(over("a"), over("b"))).unwrap();
    check(&fixed).unwrap();
    for child in fixed.children() {
        assert!(child.is::<StorageRepartitionExec>(), "{}", child.name());
    }
}

fn collect_left_join(
    left: Arc<dyn ExecutionPlan>,
    right: Arc<dyn ExecutionPlan>,
    join_type: JoinType,
    null_aware: bool,
) -> Arc<dyn ExecutionPlan> {
    Arc::new(
        HashJoinExec::try_new(
            Arc::new(CoalescePartitionsExec::new(left)),
            right,
            vec![(column("a"), column("b"))],
            None,
            &join_type,
            None,
            PartitionMode::CollectLeft,
            NullEquality::NullEqualsNothing,
            null_aware,
        )
        .unwrap(),
    )
}

#[test]
fn a_collected_build_side_partitioned_like_the_probe_side_is_joined_in_place() {
    let fixed = colocate(collect_left_join(
        storage_side("a"),
        storage_side("b"),
        JoinType::Inner,
        false,
    ))
    .unwrap();
    check(&fixed).unwrap();
    let join = fixed.downcast_ref::<HashJoinExec>().unwrap();
    assert_eq!(join.mode, PartitionMode::Partitioned);
    for child in fixed.children() {
        assert!(child.is::<StorageRepartitionExec>(), "{}", child.name());
    }
    // A probe side partitioned otherwise, or a NOT IN join (which must see its build side
    // whole), still collects.
    let unchanged = [
        collect_left_join(
            storage_side("a"),
            datafusion_side("b", 2),
            JoinType::Inner,
            false,
        ),
        collect_left_join(
            storage_side("a"),
            storage_side("b"),
            JoinType::LeftAnti,
            true,
        ),
    ];
    for plan in unchanged {
        let same = colocate(plan).unwrap();
        let join = same.downcast_ref::<HashJoinExec>().unwrap();
        assert_eq!(join.mode, PartitionMode::CollectLeft);
        assert!(same.children()[0].is::<CoalescePartitionsExec>());
    }
}

fn sorted(input: Arc<dyn ExecutionPlan>, name: &str) -> Arc<dyn ExecutionPlan> {
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    let ordering = LexOrdering::new(vec![PhysicalSortExpr::new_default(column(name))]).unwrap();
    Arc::new(SortExec::new(ordering, input).with_preserve_partitioning(true))
}

/// A sort-merge join of `left` and `right` (each sorted on its key: `a`, `b`).
fn sort_merge_join(
    left: Arc<dyn ExecutionPlan>,
    right: Arc<dyn ExecutionPlan>,
) -> Arc<dyn ExecutionPlan> {
    Arc::new(
        SortMergeJoinExec::try_new(
            left,
            right,
            vec![(column("a"), column("b"))],
            None,
            JoinType::Inner,
            vec![arrow::compute::SortOptions::default()],
            NullEquality::NullEqualsNothing,
        )
        .unwrap(),
    )
}

/// A sort-merge join (what a query runs again with when a hash join's build side does
/// not fit) is co-located too: the DataFusion repartition under the other side's sort
/// hashes as the storage does, and the sorts stay.
#[test]
fn a_sort_merge_join_is_colocated_under_its_sorts() {
    let mixed = sort_merge_join(
        sorted(storage_side("a"), "a"),
        sorted(datafusion_side("b", 2), "b"),
    );
    let error = check(&mixed).unwrap_err().to_string();
    assert!(
        error.contains("SortMergeJoinExec pairs the partitions"),
        "{error}"
    );
    let fixed = colocate(mixed).unwrap();
    check(&fixed).unwrap();
    let [left, right] = [0, 1].map(|i| fixed.children()[i].clone());
    for side in [&left, &right] {
        assert!(side.is::<SortExec>(), "{}", side.name());
    }
    assert!(left.children()[0].is::<StorageRepartitionExec>());
    let storage = right.children()[0]
        .downcast_ref::<StorageRepartitionExec>()
        .expect("the DataFusion repartition under the sort became a storage one");
    assert_eq!(storage.layout, layout());
    assert!(storage.input().is::<EmptyExec>());
    // A sort under a projection: the storage exchange goes above it, and that side is
    // sorted again above the exchange (whose producers' rows interleave).
    use datafusion::physical_plan::projection::ProjectionExec;
    let projected: Arc<dyn ExecutionPlan> = Arc::new(
        ProjectionExec::try_new(
            vec![(column("b"), "b".to_string())],
            sorted(datafusion_side("b", 2), "b"),
        )
        .unwrap(),
    );
    let under_projection = sort_merge_join(sorted(storage_side("a"), "a"), projected);
    let fixed = colocate(under_projection).unwrap();
    check(&fixed).unwrap();
    check_orderings(&fixed).unwrap();
    let right = fixed.children()[1].clone();
    assert!(right.is::<SortExec>(), "{}", right.name());
    assert!(right.children()[0].is::<StorageRepartitionExec>());
    // Without that sort, the ordering invariant refuses the plan.
    let unsorted = replace_children_if_necessary(
        fixed.clone(),
        vec![fixed.children()[0].clone(), right.children()[0].clone()],
    )
    .unwrap();
    let error = check_orderings(&unsorted).unwrap_err().to_string();
    assert!(
        error.contains("SortMergeJoinExec needs its input ordered by [b@0 ASC")
            && error.contains("StorageRepartitionExec is not"),
        "{error}"
    );
    // Two DataFusion sides stay as they are.
    let plain = colocate(sort_merge_join(
        sorted(datafusion_side("a", 2), "a"),
        sorted(datafusion_side("b", 2), "b"),
    ))
    .unwrap();
    for side in plain.children() {
        assert!(side.children()[0].is::<RepartitionExec>());
    }
}
