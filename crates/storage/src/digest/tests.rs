use super::*;
use crate::versions::{stamp, tombstone_rows};
use arrow::array::{
    BooleanArray, Float64Array, Int32Array, Int64Array, StringArray, StringViewArray,
};
use arrow::datatypes::{DataType, Field, Schema};
use std::sync::Arc;
use tessera_common::RowOp;

const FORMATS: [DigestFormat; 2] = [DigestFormat::Rows, DigestFormat::Columns];

fn def() -> TableDef {
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
    ]);
    TableDef::new("t", schema, vec!["id".into()], None).unwrap()
}

fn rows(def: &TableDef, ids: &[i64], names: &[Option<&str>]) -> RecordBatch {
    RecordBatch::try_new(
        def.schema_ref(),
        vec![
            Arc::new(Int64Array::from(ids.to_vec())),
            Arc::new(StringArray::from(names.to_vec())),
        ],
    )
    .unwrap()
}

fn upserts(def: &TableDef, e: Epoch, ids: &[i64], names: &[&str]) -> RecordBatch {
    let names: Vec<Option<&str>> = names.iter().map(|n| Some(*n)).collect();
    stamp(def, &rows(def, ids, &names), e, RowOp::Upsert).unwrap()
}

#[test]
fn a_digest_ignores_batching_and_order_but_not_content() {
    let def = def();
    let e = Epoch(3);
    for format in FORMATS {
        let digest_of =
            |versions: &[RecordBatch]| change_digest(&def, e, format, versions).unwrap();
        let digest = digest_of(&[upserts(&def, e, &[1, 2, 3], &["a", "b", "c"])]);
        let split = [
            upserts(&def, e, &[3], &["c"]),
            upserts(&def, e, &[2, 1], &["b", "a"]),
        ];
        assert_eq!(digest_of(&split), digest, "{format:?}");
        assert_ne!(
            digest_of(&[upserts(&def, e, &[1, 2, 3], &["a", "b", "C"])]),
            digest,
            "{format:?}"
        );
        // Values moved from one row to another are another content.
        assert_ne!(
            digest_of(&[upserts(&def, e, &[1, 2, 3], &["b", "a", "c"])]),
            digest,
            "{format:?}"
        );
        // A delete of a key is not an upsert of it.
        let keys = rows(&def, &[1], &[Some("a")]).project(&[0]).unwrap();
        let tombstone = tombstone_rows(&def, &keys).unwrap();
        assert_ne!(
            digest_of(&[stamp(&def, &tombstone, e, RowOp::Delete).unwrap()]),
            digest_of(&[stamp(&def, &tombstone, e, RowOp::Upsert).unwrap()]),
            "{format:?}"
        );
    }
}

/// A null is neither an empty string nor a zero, and where one value ends and the next
/// begins is part of what is hashed.
#[test]
fn nulls_empties_and_value_boundaries_are_told_apart() {
    let def = def();
    let e = Epoch(4);
    for format in FORMATS {
        let digest_of = |ids: &[i64], names: &[Option<&str>]| {
            let batch = stamp(&def, &rows(&def, ids, names), e, RowOp::Upsert).unwrap();
            change_digest(&def, e, format, &[batch]).unwrap()
        };
        let null = digest_of(&[1, 2], &[None, Some("x")]);
        assert_ne!(
            null,
            digest_of(&[1, 2], &[Some(""), Some("x")]),
            "{format:?}"
        );
        assert_ne!(
            digest_of(&[1, 2], &[Some("ab"), Some("c")]),
            digest_of(&[1, 2], &[Some("a"), Some("bc")]),
            "{format:?}"
        );
    }
    let numbers = TableDef::new(
        "n",
        Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("v", DataType::Int32, true),
            Field::new("f", DataType::Boolean, true),
        ]),
        vec!["id".into()],
        None,
    )
    .unwrap();
    let digest_of = |v: Option<i32>, f: Option<bool>| {
        let batch = RecordBatch::try_new(
            numbers.schema_ref(),
            vec![
                Arc::new(Int64Array::from(vec![1])),
                Arc::new(Int32Array::from(vec![v])),
                Arc::new(BooleanArray::from(vec![f])),
            ],
        )
        .unwrap();
        let batch = stamp(&numbers, &batch, e, RowOp::Upsert).unwrap();
        change_digest(&numbers, e, DigestFormat::Columns, &[batch]).unwrap()
    };
    let zero = digest_of(Some(0), Some(false));
    assert_ne!(zero, digest_of(None, Some(false)));
    assert_ne!(zero, digest_of(Some(0), None));
    assert_ne!(zero, digest_of(Some(1), Some(false)));
    assert_ne!(zero, digest_of(Some(0), Some(true)));
}

/// The two formats hash different bytes under different domains: an epoch's digest
/// checks only in the format its seal names.
#[test]
fn the_formats_give_different_digests() {
    let def = def();
    let e = Epoch(3);
    let versions = [upserts(&def, e, &[1, 2], &["a", "b"])];
    assert_ne!(
        change_digest(&def, e, DigestFormat::Rows, &versions).unwrap(),
        change_digest(&def, e, DigestFormat::Columns, &versions).unwrap()
    );
    assert_eq!(DigestFormat::try_from(2u8), Ok(DigestFormat::Columns));
    let unknown = DigestFormat::try_from(9u8).unwrap_err();
    assert!(
        unknown.contains("unknown change digest format 9"),
        "{unknown}"
    );
}

/// A digester fed unstamped rows with their operation, partition after partition,
/// gives each partition the digest of its stamped versions on their own.
#[test]
fn a_digester_reused_across_partitions_digests_each_as_its_stamped_rows() {
    let def = def();
    let e = Epoch(5);
    for format in FORMATS {
        let first = rows(&def, &[1, 2, 3], &[Some("a"), Some("b"), Some("c")]);
        let second = rows(&def, &[9, 8], &[Some("i"), Some("h")]);
        let deleted =
            tombstone_rows(&def, &rows(&def, &[4], &[Some("d")]).project(&[0]).unwrap()).unwrap();
        let mut digester = ChangeDigester::new(&def, e, format).unwrap();
        digester.add(&first, RowOp::Upsert).unwrap();
        digester.add(&deleted, RowOp::Delete).unwrap();
        let first_digest = digester.finish();
        digester.add(&second, RowOp::Upsert).unwrap();
        let second_digest = digester.finish();
        let stamped = |batch: &RecordBatch, op| stamp(&def, batch, e, op).unwrap();
        let digest_of =
            |versions: &[RecordBatch]| change_digest(&def, e, format, versions).unwrap();
        assert_eq!(
            first_digest,
            digest_of(&[
                stamped(&first, RowOp::Upsert),
                stamped(&deleted, RowOp::Delete)
            ])
        );
        assert_eq!(second_digest, digest_of(&[stamped(&second, RowOp::Upsert)]));
        assert_ne!(first_digest, second_digest);
        // Finished and fed nothing: the digest of no rows, not of the last partition's.
        assert_eq!(digester.finish(), digest_of(&[]));
    }
}

/// Rows whose first 16 encoded bytes agree are ordered by their whole encoding: the
/// digest still does not depend on the order they came in.
#[test]
fn rows_sharing_a_long_prefix_still_digest_the_same_in_any_order() {
    let schema = Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("id", DataType::Int64, false),
    ]);
    let def = TableDef::new("t", schema, vec!["name".into()], None).unwrap();
    let names: Vec<String> = (0..2000)
        .map(|i| format!("a long shared prefix, then {}", (i * 7919) % 2000))
        .collect();
    let batch = |order: &[usize]| {
        let rows = RecordBatch::try_new(
            def.schema_ref(),
            vec![
                Arc::new(StringArray::from_iter_values(
                    order.iter().map(|&i| names[i].as_str()),
                )),
                Arc::new(Int64Array::from_iter_values(
                    order.iter().map(|&i| i as i64),
                )),
            ],
        )
        .unwrap();
        stamp(&def, &rows, Epoch(2), RowOp::Upsert).unwrap()
    };
    let forward: Vec<usize> = (0..2000).collect();
    let backward: Vec<usize> = (0..2000).rev().collect();
    let shuffled: Vec<usize> = (0..2000).map(|i| (i * 1237) % 2000).collect();
    let (a, b) = shuffled.split_at(700);
    for format in FORMATS {
        let digest_of =
            |versions: &[RecordBatch]| change_digest(&def, Epoch(2), format, versions).unwrap();
        let digest = digest_of(&[batch(&forward)]);
        assert_eq!(digest_of(&[batch(&backward)]), digest, "{format:?}");
        assert_eq!(digest_of(&[batch(b), batch(a)]), digest, "{format:?}");
    }
}

/// Rows without a primary key (an append-only table), repeated ones among them, are
/// ordered by all their columns.
#[test]
fn append_only_rows_digest_the_same_in_any_order() {
    let schema = Schema::new(vec![
        Field::new("at", DataType::Int64, false),
        Field::new("what", DataType::Utf8, true),
    ]);
    let def = TableDef::new("events", schema, vec![], None).unwrap();
    let e = Epoch(6);
    let batch = |at: &[i64], what: &[Option<&str>]| {
        let rows = RecordBatch::try_new(
            def.schema_ref(),
            vec![
                Arc::new(Int64Array::from(at.to_vec())),
                Arc::new(StringArray::from(what.to_vec())),
            ],
        )
        .unwrap();
        stamp(&def, &rows, e, RowOp::Upsert).unwrap()
    };
    let digest_of =
        |versions: &[RecordBatch]| change_digest(&def, e, DigestFormat::Columns, versions).unwrap();
    let digest = digest_of(&[batch(
        &[1, 1, 2, 1],
        &[Some("b"), Some("a"), None, Some("a")],
    )]);
    assert_eq!(
        digest_of(&[
            batch(&[2, 1], &[None, Some("a")]),
            batch(&[1, 1], &[Some("a"), Some("b")])
        ]),
        digest
    );
    // One repeated row fewer is another content.
    assert_ne!(
        digest_of(&[batch(&[1, 1, 2], &[Some("b"), Some("a"), None])]),
        digest
    );
}

/// Damaged data may repeat a key (a publish never does): the rows are then also ordered by
/// their other columns, so two replicas holding the same damage agree on it.
#[test]
fn a_repeated_key_is_ordered_by_the_whole_row() {
    let def = def();
    let e = Epoch(8);
    let digest_of =
        |versions: &[RecordBatch]| change_digest(&def, e, DigestFormat::Columns, versions).unwrap();
    let digest = digest_of(&[upserts(&def, e, &[5, 5, 1], &["y", "x", "z"])]);
    assert_eq!(
        digest_of(&[
            upserts(&def, e, &[5], &["x"]),
            upserts(&def, e, &[1, 5], &["z", "y"])
        ]),
        digest
    );
    assert_ne!(
        digest_of(&[upserts(&def, e, &[5, 5, 1], &["y", "w", "z"])]),
        digest
    );
}

/// Every column type digests the same however batches cut the rows and in whatever order
/// they come (one batch in key order is hashed as it is; anything else is gathered into
/// key order first): nulls, booleans, offsets and views, fixed-size binaries, and nested
/// types (hashed as their row encoding).
#[test]
fn every_column_type_digests_alike_however_the_rows_are_batched() {
    use arrow::array::{BinaryArray, FixedSizeBinaryArray, LargeStringArray, ListArray};
    use arrow::datatypes::Int32Type;
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("n", DataType::Int32, true),
        Field::new("flag", DataType::Boolean, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("ls", DataType::LargeUtf8, true),
        Field::new("sv", DataType::Utf8View, true),
        Field::new("b", DataType::Binary, true),
        Field::new("fb", DataType::FixedSizeBinary(3), true),
        Field::new(
            "list",
            DataType::List(Arc::new(Field::new_list_field(DataType::Int32, true))),
            true,
        ),
    ]);
    let def = TableDef::new("every", schema, vec!["id".into()], None).unwrap();
    let e = Epoch(5);
    let n = 400usize;
    let null = |i: usize| i % 7 == 3;
    let text = |i: usize| format!("value {i} {}", "x".repeat(i % 20));
    let strings: Vec<Option<String>> = (0..n).map(|i| (!null(i)).then(|| text(i))).collect();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(0..n as i64)),
        Arc::new(Int32Array::from_iter(
            (0..n).map(|i| (!null(i)).then_some(i as i32)),
        )),
        Arc::new(BooleanArray::from_iter(
            (0..n).map(|i| (!null(i)).then_some(i % 2 == 0)),
        )),
        Arc::new(StringArray::from_iter(strings.iter())),
        Arc::new(LargeStringArray::from_iter(strings.iter())),
        Arc::new(StringViewArray::from_iter(strings.iter())),
        Arc::new(BinaryArray::from_iter(
            strings.iter().map(|s| s.as_ref().map(|s| s.as_bytes())),
        )),
        Arc::new(
            FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                (0..n).map(|i| (!null(i)).then(|| [i as u8, 1, 2])),
                3,
            )
            .unwrap(),
        ),
        Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
            (0..n).map(|i| {
                (!null(i)).then(|| (0..i % 4).map(|v| Some(v as i32)).collect::<Vec<_>>())
            }),
        )),
    ];
    let whole = stamp(
        &def,
        &RecordBatch::try_new(def.schema_ref(), columns).unwrap(),
        e,
        RowOp::Upsert,
    )
    .unwrap();
    let digest_of =
        |batches: &[RecordBatch]| change_digest(&def, e, DigestFormat::Columns, batches).unwrap();
    let in_one = digest_of(std::slice::from_ref(&whole));
    // In key order, cut into eight batches of 50 rows.
    let cut: Vec<RecordBatch> = (0..n).step_by(50).map(|at| whole.slice(at, 50)).collect();
    assert_eq!(digest_of(&cut), in_one, "cut into batches in key order");
    // The batches in reverse order.
    let reversed: Vec<RecordBatch> = cut.iter().rev().cloned().collect();
    assert_eq!(digest_of(&reversed), in_one, "batches in reverse order");
    // Every row on its own, shuffled.
    let mut single: Vec<RecordBatch> = (0..n).map(|i| whole.slice(i, 1)).collect();
    single.reverse();
    single.swap(3, 300);
    assert_eq!(digest_of(&single), in_one, "rows shuffled one by one");
    // And a row left out still shows.
    let mut changed = cut.clone();
    changed[5] = whole.slice(250, 49);
    assert_ne!(digest_of(&changed), in_one, "row 299 left out");
}

/// Each canonical form is fixed (a changed one is a new [`DigestFormat`]): these digests
/// were computed when the forms were defined, and signed chains on disk depend on them.
#[test]
fn the_canonical_forms_are_pinned() {
    let def = def();
    let e = Epoch(7);
    let ids: Vec<i64> = (0..5000).rev().collect();
    let names: Vec<String> = ids.iter().map(|i| format!("name-{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let upserted = upserts(&def, e, &ids, &names);
    let keys = rows(&def, &[9001], &[Some("x")]).project(&[0]).unwrap();
    let delete = stamp(
        &def,
        &tombstone_rows(&def, &keys).unwrap(),
        e,
        RowOp::Delete,
    )
    .unwrap();
    let versions = [upserted, delete];
    assert_eq!(
        change_digest(&def, e, DigestFormat::Rows, &versions)
            .unwrap()
            .to_hex(),
        "141077b9530a30b19536e92bb04aab7c0a3228debbfc4961a50234daaa3be49e"
    );
    assert_eq!(
        change_digest(&def, e, DigestFormat::Columns, &versions)
            .unwrap()
            .to_hex(),
        "c19b782ec080afbbea31cde2525bcbc03508da5cc88f3e750c9fa7e9a5e18071"
    );
}

#[test]
fn digests_by_epoch_match_each_epoch_on_its_own_in_its_format() {
    let def = def();
    let first = upserts(&def, Epoch(1), &[1, 2], &["a", "b"]);
    let second = upserts(&def, Epoch(2), &[2], &["B"]);
    let mixed = concat_batches(&first.schema(), [&second, &first]).unwrap();
    let format_of = |e: Epoch| {
        if e == Epoch(1) {
            DigestFormat::Rows
        } else {
            DigestFormat::Columns
        }
    };
    let digests = digests_by_epoch(&def, &[mixed], format_of).unwrap();
    assert_eq!(digests.len(), 2);
    assert_eq!(
        digests[&Epoch(1)],
        change_digest(&def, Epoch(1), DigestFormat::Rows, &[first]).unwrap()
    );
    assert_eq!(
        digests[&Epoch(2)],
        change_digest(&def, Epoch(2), DigestFormat::Columns, &[second]).unwrap()
    );
}

#[test]
fn a_version_id_chains_its_predecessor() {
    let digests = BTreeMap::from([(PartitionId(4), ComponentHash([7; 32]))]);
    let one = table_version_id("t", Epoch(1), &GENESIS, &digests);
    let two = table_version_id("t", Epoch(2), &one, &digests);
    assert_ne!(one, two);
    assert_ne!(two, table_version_id("t", Epoch(2), &GENESIS, &digests));
    assert_ne!(one, table_version_id("u", Epoch(1), &GENESIS, &digests));
}

/// `cargo test --release -p tessera-storage --lib digest_timing -- --ignored --nocapture`
#[test]
#[ignore]
fn digest_timing() {
    let schema = Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("line", DataType::Int64, false),
        Field::new("qty", DataType::Float64, false),
        Field::new("price", DataType::Float64, false),
        Field::new("comment", DataType::Utf8, false),
        // Short strings as views, as tpchgen, psql and Flight clients send them.
        Field::new("flag", DataType::Utf8View, false),
        Field::new("mode", DataType::Utf8View, false),
    ]);
    let def = TableDef::new("t", schema, vec!["k".into(), "line".into()], None).unwrap();
    let n = 1_000_000i64;
    let mut x: u64 = 12345;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut keys: Vec<i64> = (0..n).map(|_| (next() % 10_000_000) as i64).collect();
    // Publishes often come in key order; `DIGEST_TIMING_SHUFFLED` times rows that do not.
    if std::env::var_os("DIGEST_TIMING_SHUFFLED").is_none() {
        keys.sort_unstable();
    }
    let batch = RecordBatch::try_new(
        def.schema_ref(),
        vec![
            Arc::new(Int64Array::from(keys.clone())),
            Arc::new(Int64Array::from((0..n).map(|i| i % 7).collect::<Vec<_>>())),
            Arc::new(Float64Array::from(
                (0..n).map(|i| i as f64).collect::<Vec<_>>(),
            )),
            Arc::new(Float64Array::from(
                (0..n).map(|i| i as f64 * 1.5).collect::<Vec<_>>(),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("a comment of some length, row {i}")),
            )),
            Arc::new(StringViewArray::from_iter_values(
                (0..n).map(|i| ["A", "N", "R"][i as usize % 3]),
            )),
            Arc::new(StringViewArray::from_iter_values(
                (0..n).map(|i| ["TRUCK", "MAIL", "REG AIR"][i as usize % 3]),
            )),
        ],
    )
    .unwrap();
    let e = Epoch(3);
    let stamped = stamp(&def, &batch, e, RowOp::Upsert).unwrap();
    // 64 partitions' worth of rows through one digester, as a publish routes them.
    let parts: Vec<RecordBatch> = (0..64)
        .map(|i| {
            let len = n as usize / 64;
            stamped.slice(i * len, len)
        })
        .collect();
    // A publish's partition gets one batch of rows per batch the client sent: here each
    // partition's rows in 4 batches, in key order one after another.
    let chunked: Vec<Vec<RecordBatch>> = parts
        .iter()
        .map(|part| {
            let len = part.num_rows() / 4;
            (0..4).map(|i| part.slice(i * len, len)).collect()
        })
        .collect();
    for _ in 0..3 {
        for format in FORMATS {
            let started = std::time::Instant::now();
            let mut digester = ChangeDigester::new(&def, e, format).unwrap();
            for part in &parts {
                digester.add_versions(part).unwrap();
                digester.finish();
            }
            println!(
                "{format:?}: 64 change digests of {n} rows in all: {:?}",
                started.elapsed()
            );
        }
        let started = std::time::Instant::now();
        let mut digester = ChangeDigester::new(&def, e, DigestFormat::Columns).unwrap();
        for batches in &chunked {
            for batch in batches {
                digester.add_versions(batch).unwrap();
            }
            digester.finish();
        }
        println!(
            "Columns, 4 batches per partition: 64 change digests of {n} rows in all: {:?}",
            started.elapsed()
        );
    }
}
