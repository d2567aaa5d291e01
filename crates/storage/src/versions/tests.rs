use super::*;
use crate::routing::split_by_partition;
use arrow::array::Int64Array;
use proptest::prelude::*;
use tessera_common::PartitionRing;

fn def() -> TableDef {
    let schema = Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Int64, true),
    ]);
    TableDef::new("t", schema, vec!["k".into()], None).unwrap()
}

fn versions(rows: &[(i64, i64, u64, RowOp)]) -> RecordBatch {
    let def = def();
    let batch = RecordBatch::try_new(
        def.schema_ref(),
        vec![
            Arc::new(Int64Array::from(
                rows.iter().map(|r| r.0).collect::<Vec<_>>(),
            )),
            Arc::new(Int64Array::from(
                rows.iter().map(|r| r.1).collect::<Vec<_>>(),
            )),
        ],
    )
    .unwrap();
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::new(UInt64Array::from(
        rows.iter().map(|r| r.2).collect::<Vec<_>>(),
    )));
    columns.push(Arc::new(UInt8Array::from(
        rows.iter().map(|r| r.3 as u8).collect::<Vec<_>>(),
    )));
    RecordBatch::try_new(stored_schema(&def), columns).unwrap()
}

/// The (key, value) pairs of `batch`, in its order.
fn in_order(batch: &RecordBatch) -> Vec<(i64, i64)> {
    let k = batch
        .column(0)
        .as_primitive::<arrow::datatypes::Int64Type>();
    let v = batch
        .column(1)
        .as_primitive::<arrow::datatypes::Int64Type>();
    (0..batch.num_rows())
        .map(|i| (k.value(i), v.value(i)))
        .collect()
}

/// The (key, value) pairs of `batch`, sorted.
fn pairs(batch: &RecordBatch) -> Vec<(i64, i64)> {
    let mut out = in_order(batch);
    out.sort();
    out
}

#[test]
fn rows_of_one_partition_are_kept_as_they_are_and_others_are_split() {
    let ring = PartitionRing::new(4);
    let all = versions(
        &(0..64)
            .map(|k| (k, k, 1, RowOp::Upsert))
            .collect::<Vec<_>>(),
    );
    let parts = split_by_partition(&def(), &ring, &all).unwrap();
    assert!(parts.len() > 1, "64 keys over 4 partitions");
    assert_eq!(parts.iter().map(|(_, b)| b.num_rows()).sum::<usize>(), 64);
    // One partition's rows, split again (what a replica does with a prepare stream's
    // batch): the same batch comes back, its buffers not copied.
    let (partition, one) = &parts[0];
    let again = split_by_partition(&def(), &ring, one).unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].0, *partition);
    assert_eq!(
        again[0].1.column(1).to_data().buffers()[0].as_ptr(),
        one.column(1).to_data().buffers()[0].as_ptr(),
        "a batch already of one partition is not copied"
    );
}

/// The reference model: replay versions in epoch order into a map.
fn model(rows: &[(i64, i64, u64, RowOp)], epoch: u64) -> Vec<(i64, i64)> {
    let mut sorted = rows.to_vec();
    sorted.sort_by_key(|r| r.2);
    let mut state = std::collections::BTreeMap::new();
    for (k, v, _, op) in sorted.into_iter().filter(|r| r.2 <= epoch) {
        match op {
            RowOp::Upsert => state.insert(k, v),
            RowOp::Delete => state.remove(&k),
            // Not a version.
            RowOp::Before => None,
        };
    }
    state.into_iter().collect()
}

fn history() -> impl Strategy<Value = Vec<(i64, i64, u64, RowOp)>> {
    // Unique (key, epoch) pairs, as publishes guarantee; some versions come with a
    // before image of their key, stamped with their epoch, as an UPDATE's or DELETE's.
    let version = (
        any::<i64>(),
        any::<bool>(),
        proptest::option::of(any::<i64>()),
    );
    proptest::collection::btree_map((0i64..8, 1u64..10), version, 0..40).prop_map(|m| {
        m.into_iter()
            .flat_map(|((k, e), (v, del, image))| {
                let op = if del { RowOp::Delete } else { RowOp::Upsert };
                std::iter::once((k, v, e, op))
                    .chain(image.map(|before| (k, before, e, RowOp::Before)))
            })
            .collect()
    })
}

fn images_above(batch: &RecordBatch, above: u64) -> Vec<(i64, i64, u64)> {
    let (k, v) = (
        batch
            .column(0)
            .as_primitive::<arrow::datatypes::Int64Type>(),
        batch
            .column(1)
            .as_primitive::<arrow::datatypes::Int64Type>(),
    );
    let mut out: Vec<_> = (0..batch.num_rows())
        .filter(|&i| ops(batch).value(i) == RowOp::Before as u8)
        .map(|i| (k.value(i), v.value(i), epochs(batch).value(i)))
        .filter(|image| image.2 > above)
        .collect();
    out.sort();
    out
}

proptest! {
    #[test]
    fn visible_rows_match_a_replayed_map(rows in history(), epoch in 0u64..11) {
        let got = visible_rows(&[versions(&rows)], &[0], Epoch(epoch), false).unwrap();
        prop_assert_eq!(got.map(|b| pairs(&b)).unwrap_or_default(), model(&rows, epoch));
    }

    #[test]
    fn merging_keeps_every_retained_epoch_exact(rows in history(), retain_from in 0u64..11) {
        prop_assume!(!rows.is_empty());
        let merged = merge_versions(&[versions(&rows)], &[0], Epoch(retain_from), false).unwrap();
        prop_assert_eq!(
            images_above(&merged, 0),
            images_above(&versions(&rows), retain_from),
            "a merge keeps the before images above the horizon, and only those"
        );
        for epoch in retain_from..11 {
            let got = visible_rows(&[merged.clone()], &[0], Epoch(epoch), false).unwrap();
            prop_assert_eq!(got.map(|b| pairs(&b)).unwrap_or_default(), model(&rows, epoch));
        }
        prop_assert!(merged.num_rows() <= rows.len());
    }

    #[test]
    fn the_current_split_alone_answers_from_the_newest_merged_epoch(
        rows in history(),
        retain_from in 0u64..11,
    ) {
        prop_assume!(!rows.is_empty());
        let newest = rows.iter().map(|r| r.2).max().unwrap();
        let split = merge_and_split_versions(&[versions(&rows)], &[0], Epoch(retain_from), false, true).unwrap();
        for epoch in retain_from..11 {
            let both = [split.current.clone(), split.history.clone()];
            // What a read needs: history only below the epoch that superseded it.
            let read: &[RecordBatch] = if epoch >= newest { &both[..1] } else { &both };
            let got = visible_rows(read, &[0], Epoch(epoch), false).unwrap();
            prop_assert_eq!(got.map(|b| pairs(&b)).unwrap_or_default(), model(&rows, epoch));
        }
        // Current holds one version per key, each its newest.
        prop_assert!(find_duplicate_key(&split.current, &[0]).unwrap().is_none());
        let merged = merge_versions(&[versions(&rows)], &[0], Epoch(retain_from), false).unwrap();
        prop_assert_eq!(split.current.num_rows() + split.history.num_rows(), merged.num_rows());
    }
}

proptest! {
    #[test]
    fn a_base_and_the_versions_since_read_as_all_versions_do(
        rows in history(),
        merged_at in 0u64..11,
    ) {
        let (before, after): (Vec<_>, Vec<_>) = rows.iter().copied().partition(|r| r.2 <= merged_at);
        // The base: what a merge of the versions up to `merged_at` keeps current.
        let base = match before.is_empty() {
            true => versions(&[]),
            false => merge_and_split_versions(&[versions(&before)], &[0], Epoch(0), false, true).unwrap().current,
        };
        let layout = [base, versions(&after)];
        for epoch in merged_at..11 {
            let got = visible_rows_over_base(&layout, 1, &[0], Epoch(epoch), false).unwrap();
            prop_assert_eq!(got.map(|b| pairs(&b)).unwrap_or_default(), model(&rows, epoch));
            // In key order too: the model's map gives its rows by key.
            let by_key = visible_rows_in_batches(&layout, 1, &[0], Epoch(epoch), false, 3, RowOrder::ByKey).unwrap();
            prop_assert_eq!(by_key.iter().flat_map(in_order).collect::<Vec<_>>(), model(&rows, epoch));
        }
    }

    #[test]
    fn visible_rows_in_batches_are_the_same_rows_cut_to_size(
        rows in history(),
        batch_rows in 1usize..5,
        epoch in 0u64..11,
    ) {
        let got = visible_rows_in_batches(&[versions(&rows)], 0, &[0], Epoch(epoch), false, batch_rows, RowOrder::Logged).unwrap();
        prop_assert!(got.iter().all(|b| b.num_rows() <= batch_rows));
        let whole: Vec<_> = got.iter().flat_map(pairs).collect();
        prop_assert_eq!(whole, model(&rows, epoch));
    }
}

#[test]
fn merge_drops_versions_no_retained_epoch_sees() {
    let rows = [
        (1, 10, 1, RowOp::Upsert),
        (1, 11, 2, RowOp::Upsert),
        (1, 12, 5, RowOp::Upsert),
        (2, 20, 1, RowOp::Upsert),
        (2, 0, 3, RowOp::Delete),
    ];
    let merged = merge_versions(&[versions(&rows)], &[0], Epoch(4), false).unwrap();
    assert_eq!(pairs(&merged), vec![(1, 11), (1, 12)]);
}

#[test]
fn a_merge_keeps_the_order_its_versions_were_read_in() {
    // Keys arrive out of key order; key 3 gets a newer version later, key 9 a tombstone.
    let rows = [
        (5, 50, 1, RowOp::Upsert),
        (3, 30, 1, RowOp::Upsert),
        (9, 90, 1, RowOp::Upsert),
        (1, 10, 1, RowOp::Upsert),
        (3, 31, 2, RowOp::Upsert),
        (9, 0, 2, RowOp::Delete),
        (7, 70, 2, RowOp::Upsert),
    ];
    let split = merge_and_split_versions(&[versions(&rows)], &[0], Epoch(0), false, true).unwrap();
    // Every version is retained (horizon 0), so key 9's tombstone stays current.
    assert_eq!(
        in_order(&split.current),
        [(5, 50), (1, 10), (3, 31), (9, 0), (7, 70)]
    );
    assert_eq!(in_order(&split.history), [(3, 30), (9, 90)]);
    // A read gives the same rows, in the same order, from the merged current component
    // as from the unmerged versions.
    let read = |batch: RecordBatch| {
        let seen = visible_rows(&[batch], &[0], Epoch(2), false).unwrap();
        in_order(&seen.unwrap())
    };
    assert_eq!(read(split.current), read(versions(&rows)));
    assert_eq!(read(versions(&rows)), [(5, 50), (1, 10), (3, 31), (7, 70)]);
}

/// Reads `batches` at `epoch` in `order`, cut into batches of 2 rows, as (key, value) pairs.
fn read_in(batches: &[RecordBatch], epoch: u64, order: RowOrder) -> Vec<(i64, i64)> {
    visible_rows_in_batches(batches, 0, &[0], Epoch(epoch), false, 2, order)
        .unwrap()
        .iter()
        .flat_map(in_order)
        .collect()
}

#[test]
fn below_a_merge_only_key_order_is_the_same_as_before_it() {
    let logged = versions(&[
        (5, 50, 1, RowOp::Upsert),
        (3, 30, 1, RowOp::Upsert),
        (9, 90, 1, RowOp::Upsert),
        (3, 31, 2, RowOp::Upsert),
        (7, 70, 2, RowOp::Upsert),
    ]);
    let split = merge_and_split_versions(&[logged.clone()], &[0], Epoch(0), false, true).unwrap();
    // As a partition's manifest lists them: history first.
    let merged = [split.history, split.current];
    assert_eq!(
        read_in(&[logged.clone()], 1, RowOrder::Logged),
        [(5, 50), (3, 30), (9, 90)]
    );
    assert_eq!(
        read_in(&merged, 1, RowOrder::Logged),
        [(3, 30), (5, 50), (9, 90)],
        "key 3's version of epoch 1 is history now, read before the current versions"
    );
    for layout in [&[logged][..], &merged[..]] {
        assert_eq!(
            read_in(layout, 1, RowOrder::ByKey),
            [(3, 30), (5, 50), (9, 90)]
        );
        assert_eq!(
            read_in(layout, 2, RowOrder::ByKey),
            [(3, 31), (5, 50), (7, 70), (9, 90)]
        );
    }
}

proptest! {
    #[test]
    fn key_order_reads_the_same_rows_in_the_same_order_from_any_layout(
        rows in history(),
        epoch in 0u64..11,
        retain_from in 0u64..11,
    ) {
        prop_assume!(!rows.is_empty() && epoch >= retain_from);
        // As a log holds them: epoch by epoch.
        let mut logged = rows.clone();
        logged.sort_by_key(|r| r.2);
        let logged = versions(&logged);
        let split = merge_and_split_versions(&[logged.clone()], &[0], Epoch(retain_from), false, true).unwrap();
        let expected = model(&rows, epoch);
        prop_assert_eq!(read_in(&[logged], epoch, RowOrder::ByKey), expected.clone());
        prop_assert_eq!(read_in(&[split.history, split.current], epoch, RowOrder::ByKey), expected);
    }
}

#[test]
fn duplicate_keys_are_named() {
    let batch = versions(&[
        (1, 1, 1, RowOp::Upsert),
        (7, 2, 1, RowOp::Upsert),
        (7, 3, 1, RowOp::Upsert),
    ]);
    assert_eq!(
        find_duplicate_key(&batch, &[0]).unwrap(),
        Some("(7)".to_string())
    );
}
