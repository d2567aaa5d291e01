//! TPC-H for tests and benchmarks: the eight tables generated in-process (tpchgen), their
//! keys as Tessera declares them, the 22 queries, and a comparator that decides whether two
//! answers are the same.
//!
//! The query texts follow the TPC-H specification with its validation parameters. Where
//! the specification's ORDER BY leaves ties (Q3, Q10, Q11, Q18), a final key column is
//! added so that every engine must return one exact answer.

pub mod compare;
pub mod oracle;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, PartSuppGeneratorIterator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

/// One TPC-H table as Tessera stores it.
#[derive(Debug, Clone, Copy)]
pub struct TpchTable {
    pub name: &'static str,
    pub primary_key: &'static [&'static str],
    /// A prefix of the primary key; orders and lineitem share the order key so they co-locate.
    pub partition_key: &'static [&'static str],
    /// Rows at scale factor 1, for progress bars.
    pub rows_at_sf1: u64,
}

pub const TABLES: [TpchTable; 8] = [
    TpchTable {
        name: "region",
        primary_key: &["r_regionkey"],
        partition_key: &["r_regionkey"],
        rows_at_sf1: 5,
    },
    TpchTable {
        name: "nation",
        primary_key: &["n_nationkey"],
        partition_key: &["n_nationkey"],
        rows_at_sf1: 25,
    },
    TpchTable {
        name: "supplier",
        primary_key: &["s_suppkey"],
        partition_key: &["s_suppkey"],
        rows_at_sf1: 10_000,
    },
    TpchTable {
        name: "customer",
        primary_key: &["c_custkey"],
        partition_key: &["c_custkey"],
        rows_at_sf1: 150_000,
    },
    TpchTable {
        name: "part",
        primary_key: &["p_partkey"],
        partition_key: &["p_partkey"],
        rows_at_sf1: 200_000,
    },
    TpchTable {
        name: "partsupp",
        primary_key: &["ps_partkey", "ps_suppkey"],
        partition_key: &["ps_partkey"],
        rows_at_sf1: 800_000,
    },
    TpchTable {
        name: "orders",
        primary_key: &["o_orderkey"],
        partition_key: &["o_orderkey"],
        rows_at_sf1: 1_500_000,
    },
    TpchTable {
        name: "lineitem",
        primary_key: &["l_orderkey", "l_linenumber"],
        partition_key: &["l_orderkey"],
        rows_at_sf1: 6_001_215,
    },
];

impl TpchTable {
    pub fn schema(&self) -> SchemaRef {
        match self.name {
            "region" => RegionArrow::schema_ref(),
            "nation" => NationArrow::schema_ref(),
            "supplier" => SupplierArrow::schema_ref(),
            "customer" => CustomerArrow::schema_ref(),
            "part" => PartArrow::schema_ref(),
            "partsupp" => PartSuppArrow::schema_ref(),
            "orders" => OrderArrow::schema_ref(),
            "lineitem" => LineItemArrow::schema_ref(),
            other => unreachable!("TABLES lists no table {other}"),
        }
    }

    /// Approximate row count at `sf` (exact for the scaled tables).
    pub fn estimated_rows(&self, sf: f64) -> u64 {
        match self.name {
            "region" | "nation" => self.rows_at_sf1,
            _ => ((self.rows_at_sf1 as f64) * sf).ceil() as u64,
        }
    }

    /// The table's rows at scale factor `sf`, in batches of `batch_rows`.
    pub fn generate(
        &self,
        sf: f64,
        batch_rows: usize,
    ) -> Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send> {
        match self.name {
            "region" => Box::new(
                RegionArrow::new(RegionGenerator::new(sf, 1, 1)).with_batch_size(batch_rows),
            ),
            "nation" => Box::new(
                NationArrow::new(NationGenerator::new(sf, 1, 1)).with_batch_size(batch_rows),
            ),
            "supplier" => Box::new(
                SupplierArrow::new(SupplierGenerator::new(sf, 1, 1)).with_batch_size(batch_rows),
            ),
            "customer" => Box::new(
                CustomerArrow::new(CustomerGenerator::new(sf, 1, 1)).with_batch_size(batch_rows),
            ),
            "part" => {
                Box::new(PartArrow::new(PartGenerator::new(sf, 1, 1)).with_batch_size(batch_rows))
            }
            "partsupp" => Box::new(
                PartSuppArrow::new(PartSuppGenerator::new(sf, 1, 1)).with_batch_size(batch_rows),
            ),
            "orders" => {
                Box::new(OrderArrow::new(OrderGenerator::new(sf, 1, 1)).with_batch_size(batch_rows))
            }
            "lineitem" => Box::new(
                LineItemArrow::new(LineItemGenerator::new(sf, 1, 1)).with_batch_size(batch_rows),
            ),
            other => unreachable!("TABLES lists no table {other}"),
        }
    }
}

/// The first part whose partsupp rows name one supplier twice at scale factor `sf`, if
/// any: partsupp then repeats its primary key, and a load of it is refused.
///
/// TPC-H picks part `p`'s four suppliers as `p + i·step mod s` (`i` = 0 to 3, `s`
/// suppliers, `step = s/4 + (p − 1)/s`). Two of them coincide only when `k·step` is a
/// multiple of `s` for some `k` from 1 to 3. With at most 20·`s` parts, `step` is at most
/// `s/4 + 19`, so `k·step` stays between 0 and `s` once `s` exceeds 240 (scale factors from
/// 0.025 up): no repeat is possible there. Below, whether one happens depends on the scale
/// factor (0.001 repeats, 0.01 does not), and this checks every part.
pub fn partsupp_key_repeat(sf: f64) -> Option<i64> {
    const SUPPLIERS_ALWAYS_DISTINCT: i64 = 240;
    let suppliers = SupplierGenerator::calculate_row_count(sf, 1, 1);
    if suppliers > SUPPLIERS_ALWAYS_DISTINCT {
        return None;
    }
    (1..=PartGenerator::calculate_row_count(sf, 1, 1)).find(|&part| {
        let mut chosen: Vec<i64> = (0..4)
            .map(|i| PartSuppGeneratorIterator::select_part_supplier(part, i, sf))
            .collect();
        chosen.sort_unstable();
        chosen.dedup();
        chosen.len() < 4
    })
}

pub fn table(name: &str) -> Option<TpchTable> {
    TABLES.iter().copied().find(|t| t.name == name)
}

/// `CREATE TABLE` for a TPC-H table, with its primary and partition keys.
pub fn create_table_sql(table: &TpchTable) -> String {
    let columns: Vec<String> = table
        .schema()
        .fields()
        .iter()
        .map(|f| {
            format!(
                "{} {}{}",
                f.name(),
                sql_type(f.data_type()),
                if f.is_nullable() { "" } else { " NOT NULL" }
            )
        })
        .collect();
    format!(
        "CREATE TABLE {} ({}, PRIMARY KEY ({})) PARTITION BY ({})",
        table.name,
        columns.join(", "),
        table.primary_key.join(", "),
        table.partition_key.join(", ")
    )
}

fn sql_type(data_type: &arrow::datatypes::DataType) -> String {
    use arrow::datatypes::DataType::*;
    match data_type {
        Int32 => "INT".into(),
        Int64 => "BIGINT".into(),
        Decimal128(p, s) => format!("DECIMAL({p}, {s})"),
        Date32 => "DATE".into(),
        Utf8 | Utf8View | LargeUtf8 => "VARCHAR".into(),
        other => unreachable!("TPC-H has no column of type {other}"),
    }
}

const QUERIES: [&str; 22] = [
    include_str!("../queries/q1.sql"),
    include_str!("../queries/q2.sql"),
    include_str!("../queries/q3.sql"),
    include_str!("../queries/q4.sql"),
    include_str!("../queries/q5.sql"),
    include_str!("../queries/q6.sql"),
    include_str!("../queries/q7.sql"),
    include_str!("../queries/q8.sql"),
    include_str!("../queries/q9.sql"),
    include_str!("../queries/q10.sql"),
    include_str!("../queries/q11.sql"),
    include_str!("../queries/q12.sql"),
    include_str!("../queries/q13.sql"),
    include_str!("../queries/q14.sql"),
    include_str!("../queries/q15.sql"),
    include_str!("../queries/q16.sql"),
    include_str!("../queries/q17.sql"),
    include_str!("../queries/q18.sql"),
    include_str!("../queries/q19.sql"),
    include_str!("../queries/q20.sql"),
    include_str!("../queries/q21.sql"),
    include_str!("../queries/q22.sql"),
];

/// The text of TPC-H query `n` (1 to 22).
pub fn query(n: usize) -> &'static str {
    assert!((1..=22).contains(&n), "TPC-H has queries 1 to 22, not {n}");
    QUERIES[n - 1]
}

/// `sql` (a TPC-H query) reading every TPC-H table it names `AS OF EPOCH epoch`: each
/// table name that follows `FROM`, `JOIN` or a comma (a table list; not a column alias such
/// as Q9's `n_name AS nation`, nor part of a column name such as `c_orders`) is followed by
/// the time-travel point, before any alias.
pub fn read_as_of(sql: &str, epoch: u64) -> String {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(sql.len() + 128);
    let mut rest = sql;
    // The word or punctuation before the current word, lowercase.
    let mut before = String::new();
    while let Some(start) = rest.find(is_word) {
        let between = &rest[..start];
        out.push_str(between);
        if let Some(mark) = between.trim().chars().last() {
            before = mark.to_string();
        }
        let word_len = rest[start..]
            .find(|c| !is_word(c))
            .unwrap_or(rest.len() - start);
        let word = &rest[start..start + word_len];
        out.push_str(word);
        let in_table_list = matches!(before.as_str(), "from" | "join" | ",");
        if in_table_list && TABLES.iter().any(|t| t.name.eq_ignore_ascii_case(word)) {
            out.push_str(&format!(" AS OF EPOCH {epoch}"));
        }
        before = word.to_ascii_lowercase();
        rest = &rest[start + word_len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Int64Array};
    use std::collections::HashSet;

    #[test]
    fn queries_read_as_of_name_the_epoch_after_each_table() {
        assert_eq!(
            read_as_of("select c_orders from customer, lineitem l1 where x", 7),
            "select c_orders from customer AS OF EPOCH 7, lineitem AS OF EPOCH 7 l1 where x"
        );
        // Q21 reads lineitem three times under aliases, supplier, orders and nation once.
        let q21 = read_as_of(query(21), 3);
        assert_eq!(q21.matches(" AS OF EPOCH 3").count(), 6, "{q21}");
        // Q9 names its six tables once each, and calls a column `nation` too.
        let q9 = read_as_of(query(9), 3);
        assert_eq!(q9.matches(" AS OF EPOCH 3").count(), 6, "{q9}");
        assert!(q9.contains("n_name as nation,"), "{q9}");
    }

    /// Whether generating partsupp at `sf` really yields a key twice.
    fn generated_partsupp_repeats_a_key(sf: f64) -> bool {
        let mut keys = HashSet::new();
        let partsupp = table("partsupp").expect("partsupp");
        for batch in partsupp.generate(sf, 8192) {
            let batch = batch.expect("rows");
            let column = |name: &str| {
                let index = batch.schema().index_of(name).expect("column");
                batch
                    .column(index)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .expect("BIGINT")
                    .clone()
            };
            let (parts, suppliers) = (column("ps_partkey"), column("ps_suppkey"));
            for row in 0..parts.len() {
                if !keys.insert((parts.value(row), suppliers.value(row))) {
                    return true;
                }
            }
        }
        false
    }

    #[test]
    fn the_partsupp_key_check_agrees_with_the_generator() {
        assert!(
            partsupp_key_repeat(0.001).is_some(),
            "SF 0.001 repeats keys"
        );
        for sf in [0.001, 0.005, 0.01, 0.02, 0.0232, 0.03, 0.1] {
            assert_eq!(
                partsupp_key_repeat(sf).is_some(),
                generated_partsupp_repeats_a_key(sf),
                "at scale factor {sf}"
            );
        }
    }
}
