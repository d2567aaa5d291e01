//! Routing a publish at its coordinator: the checks a single store would make (schema,
//! keys, duplicates, append-only, before images only with a read epoch), then each table's
//! rows gathered by partition, as the prepare streams carry them.

use crate::error::{ReplicationError, Result};
use crate::wire::PreparedRows;
use arrow::array::RecordBatch;
use std::collections::{BTreeMap, BTreeSet};
use tessera_common::{PartitionId, PartitionRing, ReadEpochs};
use tessera_meta::{MetaError, MetaState, TableChangeCount};
use tessera_storage::routing::{gather_by_partition, RowsOf};
use tessera_storage::{versions, StorageError, TableChanges, TableDef};

/// One table's rows routed to partitions: upserts (table columns), deletes (key columns)
/// and before images (table columns). Each partition's rows come as a few batches of about
/// a Flight message, not one piece per batch the client sent: the prepare streams, the
/// replicas' logs and their memtables pay their per-batch costs a few times.
#[derive(Default)]
pub(crate) struct Routed {
    pub(crate) upserts: BTreeMap<PartitionId, Vec<RecordBatch>>,
    pub(crate) deletes: BTreeMap<PartitionId, Vec<RecordBatch>>,
    pub(crate) before_images: BTreeMap<PartitionId, Vec<RecordBatch>>,
}

impl Routed {
    /// Each kind of rows, with its rows per partition.
    pub(crate) fn by_kind(&self) -> [(PreparedRows, &BTreeMap<PartitionId, Vec<RecordBatch>>); 3] {
        [
            (PreparedRows::Upserts, &self.upserts),
            (PreparedRows::Deletes, &self.deletes),
            (PreparedRows::BeforeImages, &self.before_images),
        ]
    }

    /// Refuses a key given twice (upserted twice, or upserted and deleted). The partition
    /// key is a prefix of the primary key, so a repeated key repeats within one partition:
    /// each partition is checked on its own.
    fn reject_duplicate_keys(&self, def: &TableDef) -> Result<()> {
        if def.append_only {
            return Ok(());
        }
        let key = def.primary_key_indices();
        let partitions: BTreeSet<PartitionId> = self
            .upserts
            .keys()
            .chain(self.deletes.keys())
            .copied()
            .collect();
        for partition in partitions {
            let mut keys = Vec::new();
            for batch in self.upserts.get(&partition).into_iter().flatten() {
                keys.push(batch.project(&key)?);
            }
            keys.extend(self.deletes.get(&partition).into_iter().flatten().cloned());
            versions::reject_duplicate_key_columns(def, &keys)?;
        }
        Ok(())
    }
}

/// Rows written per table, for the epoch log.
pub(crate) fn change_counts(routed: &BTreeMap<String, Routed>) -> Vec<TableChangeCount> {
    let rows = |by_partition: &BTreeMap<PartitionId, Vec<RecordBatch>>| {
        by_partition
            .values()
            .flatten()
            .map(|b| b.num_rows() as u64)
            .sum()
    };
    routed
        .iter()
        .map(|(table, routed)| TableChangeCount {
            table: table.clone(),
            upserts: rows(&routed.upserts),
            deletes: rows(&routed.deletes),
        })
        .collect()
}

/// One table's rows as given (checked and conformed to its schema), before routing.
#[derive(Default)]
struct Given {
    upserts: Vec<RecordBatch>,
    /// Key columns only.
    deletes: Vec<RecordBatch>,
    before_images: Vec<RecordBatch>,
}

/// Checks a publish the way a single store would (schema, keys, duplicates, append-only,
/// before images only with a read epoch) and routes each row to its partition.
pub(crate) fn route(
    state: &MetaState,
    changes: Vec<TableChanges>,
    read_at: &ReadEpochs,
) -> Result<BTreeMap<String, Routed>> {
    if !state.is_bootstrapped() {
        // A node that just started and has not yet caught up with the metadata group.
        return Err(ReplicationError::Meta(MetaError::NoLeader));
    }
    let ring = PartitionRing::new(state.partition_count);
    let mut given: BTreeMap<String, (&TableDef, Given)> = BTreeMap::new();
    for mut change in changes {
        let def = state
            .tables
            .get(&change.table)
            .ok_or_else(|| StorageError::UnknownTable(change.table.clone()))?;
        if def.append_only && change.deletes.iter().any(|b| b.num_rows() > 0) {
            return Err(StorageError::delete_from_append_only(&def.name).into());
        }
        change.refuse_unchecked_before_images(read_at)?;
        let rows = &mut given
            .entry(def.name.clone())
            .or_insert_with(|| (def, Given::default()))
            .1;
        // Conforming keeps a column as given unless it must be cast, and each batch given
        // is let go as it is conformed: the rows are held once until they are gathered.
        for batch in std::mem::take(&mut change.upserts) {
            if batch.num_rows() > 0 {
                rows.upserts.push(versions::conform_to_schema(def, &batch)?);
            }
        }
        let key = def.primary_key_indices();
        for batch in change.deletes.iter().filter(|b| b.num_rows() > 0) {
            rows.deletes
                .push(versions::tombstone_rows(def, batch)?.project(&key)?);
        }
        if !def.append_only {
            // An append-only table's rows are all inserts: a diff needs no image.
            for batch in change.before_images.iter().filter(|b| b.num_rows() > 0) {
                rows.before_images
                    .push(versions::conform_to_schema(def, batch)?);
            }
        }
    }
    let mut routed = BTreeMap::new();
    for (table, (def, rows)) in given {
        let table_rows = Routed {
            upserts: gather_by_partition(def, &ring, rows.upserts, RowsOf::TableColumns)?,
            deletes: gather_by_partition(def, &ring, rows.deletes, RowsOf::KeyColumns)?,
            before_images: gather_by_partition(
                def,
                &ring,
                rows.before_images,
                RowsOf::TableColumns,
            )?,
        };
        table_rows.reject_duplicate_keys(def)?;
        routed.insert(table, table_rows);
    }
    Ok(routed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rebalance::tests::three_nodes_one_table;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    use tessera_storage::routing::split_by_partition;

    // Nodes allocate with jemalloc (`tessera_common::allocator`); so does this test
    // binary, so that `route_timing` measures routing as a node does it (with glibc's
    // malloc, fresh pages for each publish's routed rows took a quarter of its time).
    tessera_common::allocate_with_jemalloc!();

    /// Rows of table `t` (one BIGINT key column `k`).
    fn keys(values: &[i64]) -> RecordBatch {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, false)]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![Arc::new(Int64Array::from(values.to_vec()))],
        )
        .unwrap()
    }

    fn duplicate_key_of(result: Result<BTreeMap<String, Routed>>) -> String {
        match result {
            Err(ReplicationError::Storage(StorageError::DuplicateKey { table, key })) => {
                assert_eq!(table, "t");
                key
            }
            Err(other) => panic!("expected a duplicate key, got {other}"),
            Ok(_) => panic!("expected a duplicate key, the publish was routed"),
        }
    }

    #[test]
    fn a_key_given_twice_in_one_publish_is_refused_whichever_batches_hold_it() {
        let state = three_nodes_one_table(8);
        let read = ReadEpochs::new();
        let across_batches = TableChanges::upserts("t", vec![keys(&[1, 2, 3]), keys(&[4, 2])]);
        assert_eq!(
            duplicate_key_of(route(&state, vec![across_batches], &read)),
            "(2)"
        );
        let upserted_and_deleted = TableChanges {
            deletes: vec![keys(&[9])],
            ..TableChanges::upserts("t", vec![keys(&[8, 9])])
        };
        assert_eq!(
            duplicate_key_of(route(&state, vec![upserted_and_deleted], &read)),
            "(9)"
        );
        let in_two_changes = vec![
            TableChanges::upserts("t", vec![keys(&[5])]),
            TableChanges::deletes("t", vec![keys(&[5])]),
        ];
        assert_eq!(
            duplicate_key_of(route(&state, in_two_changes, &read)),
            "(5)"
        );
    }

    #[test]
    fn every_row_is_routed_once_to_its_partition() {
        let state = three_nodes_one_table(8);
        let ring = PartitionRing::new(8);
        let def = state.tables.get("t").unwrap().clone();
        let changes = TableChanges {
            deletes: vec![keys(&[100, 101])],
            ..TableChanges::upserts("t", vec![keys(&[1, 2, 3, 4]), keys(&[5, 6, 7])])
        };
        let routed = route(&state, vec![changes], &ReadEpochs::new()).unwrap();
        let routed = &routed["t"];
        let mut seen = Vec::new();
        for by_partition in [&routed.upserts, &routed.deletes] {
            for (&partition, batches) in by_partition {
                assert_eq!(batches.len(), 1, "a partition's rows in one batch");
                for batch in batches {
                    for (p, rows) in split_by_partition(&def, &ring, batch).unwrap() {
                        assert_eq!(p, partition, "rows routed to another partition");
                        let k = rows
                            .column(0)
                            .as_any()
                            .downcast_ref::<Int64Array>()
                            .unwrap();
                        seen.extend(k.values().iter().copied());
                    }
                }
            }
        }
        seen.sort();
        assert_eq!(seen, vec![1, 2, 3, 4, 5, 6, 7, 100, 101]);
    }

    /// Lineitem-like rows (TPC-H's widest table, what `bench replication` publishes): two
    /// key columns, four decimals, three dates, six short strings and a comment, as string
    /// views, the way tpchgen and Flight clients send them.
    fn lineitem_like(rows: std::ops::Range<i64>) -> RecordBatch {
        use arrow::array::{ArrayRef, Date32Array, Decimal128Array, Int32Array, StringViewArray};
        let n = rows.end - rows.start;
        let decimal = |scale: i64| -> ArrayRef {
            Arc::new(
                Decimal128Array::from_iter_values(
                    rows.clone().map(|i| (i * scale % 1_000_000) as i128),
                )
                .with_precision_and_scale(15, 2)
                .unwrap(),
            )
        };
        let date = |offset: i32| -> ArrayRef {
            Arc::new(Date32Array::from_iter_values(
                rows.clone().map(|i| 8000 + (i as i32 % 2500) + offset),
            ))
        };
        let short = |values: &'static [&'static str]| -> ArrayRef {
            Arc::new(StringViewArray::from_iter_values(
                rows.clone().map(|i| values[i as usize % values.len()]),
            ))
        };
        let columns: Vec<ArrayRef> = vec![
            Arc::new(arrow::array::Int64Array::from_iter_values(
                rows.clone().map(|i| i / 4),
            )),
            Arc::new(Int32Array::from_iter_values(
                rows.clone().map(|i| (i % 4) as i32 + 1),
            )),
            decimal(17),
            decimal(31),
            decimal(7),
            decimal(3),
            short(&["A", "N", "R"]),
            short(&["F", "O"]),
            date(0),
            date(30),
            date(60),
            short(&[
                "DELIVER IN PERSON",
                "COLLECT COD",
                "NONE",
                "TAKE BACK RETURN",
            ]),
            short(&["TRUCK", "MAIL", "REG AIR", "AIR", "FOB", "SHIP", "RAIL"]),
            Arc::new(StringViewArray::from_iter_values(
                rows.clone()
                    .map(|i| format!("carefully final deposits {i} nag slyly")),
            )),
        ];
        assert_eq!(columns[0].len() as i64, n);
        RecordBatch::try_new(Arc::new(lineitem_like_schema()), columns).unwrap()
    }

    fn lineitem_like_schema() -> Schema {
        let decimal = DataType::Decimal128(15, 2);
        Schema::new(vec![
            Field::new("orderkey", DataType::Int64, false),
            Field::new("linenumber", DataType::Int32, false),
            Field::new("quantity", decimal.clone(), false),
            Field::new("extendedprice", decimal.clone(), false),
            Field::new("discount", decimal.clone(), false),
            Field::new("tax", decimal, false),
            Field::new("returnflag", DataType::Utf8View, false),
            Field::new("linestatus", DataType::Utf8View, false),
            Field::new("shipdate", DataType::Date32, false),
            Field::new("commitdate", DataType::Date32, false),
            Field::new("receiptdate", DataType::Date32, false),
            Field::new("shipinstruct", DataType::Utf8View, false),
            Field::new("shipmode", DataType::Utf8View, false),
            Field::new("comment", DataType::Utf8View, false),
        ])
    }

    /// How long routing a publish the size of `bench security`'s takes (120,515 lineitem
    /// rows over 64 partitions, in batches of 8,192 rows, about a Flight message each):
    /// `cargo test --release -p tessera-replication --lib route_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn route_timing() {
        let mut state = three_nodes_one_table(64);
        let def = TableDef::new(
            "lineitem",
            lineitem_like_schema(),
            vec!["orderkey".into(), "linenumber".into()],
            Some(vec!["orderkey".into()]),
        )
        .unwrap();
        state.apply(3, tessera_meta::MetaCommand::CreateTable { def });
        // `ROUTE_TIMING_ROWS=600572 ROUTE_TIMING_BATCH_ROWS=65536`: `bench replication`'s
        // publish at SF 0.1, in the batches it sends.
        let setting = |name: &str, default: i64| -> i64 {
            std::env::var(name).map_or(default, |rows| rows.parse().expect("a number of rows"))
        };
        let rows = setting("ROUTE_TIMING_ROWS", 120_515);
        let batch_rows = setting("ROUTE_TIMING_BATCH_ROWS", 8192);
        let batches: Vec<RecordBatch> = (0..rows)
            .step_by(batch_rows as usize)
            .map(|start| lineitem_like(start..(start + batch_rows).min(rows)))
            .collect();
        let bytes: usize = batches.iter().map(versions::rows_bytes).sum();
        let mut times = Vec::new();
        for _ in 0..7 {
            let changes = vec![TableChanges::upserts("lineitem", batches.clone())];
            let started = std::time::Instant::now();
            let routed = route(&state, changes, &ReadEpochs::new()).unwrap();
            times.push(started.elapsed().as_secs_f64() * 1e3);
            let counts = change_counts(&routed);
            assert_eq!(counts[0].upserts, rows as u64);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "routed {rows} rows ({:.1} MB) over 64 partitions: median {:.1} ms (min {:.1}, max {:.1})",
            bytes as f64 / 1e6,
            times[times.len() / 2],
            times[0],
            times[times.len() - 1]
        );
    }
}
