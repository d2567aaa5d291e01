//! Where a row lives: the stable partition hash and the ring of partitions.
//!
//! The hash of a row is the first 8 bytes (little endian) of the BLAKE3 hash of the
//! *canonical encoding* of its partition-key values, concatenated in key order:
//!
//! | Arrow type                          | encoding                                         |
//! |-------------------------------------|--------------------------------------------------|
//! | Int8, Int16, Int32, Int64           | `0x01` then the value as i64, big endian          |
//! | UInt8, UInt16, UInt32, UInt64       | `0x02` then the value as u64, big endian          |
//! | Utf8, LargeUtf8, Utf8View           | `0x03`, byte length as u32 big endian, UTF-8 bytes |
//! | Date32                              | `0x04` then days as i32, big endian               |
//! | Date64                              | `0x05` then milliseconds as i64, big endian       |
//! | Decimal128(p, s)                    | `0x06`, scale as i8, unscaled value as i128 BE    |
//! | Boolean                             | `0x07` then 0 or 1                                |
//! | Binary, LargeBinary, BinaryView     | `0x08`, byte length as u32 big endian, the bytes  |
//!
//! | NULL (any type)                     | `0x00`                                           |
//!
//! Integers of different widths encode alike, so widening a key column's type moves no data.
//! Primary-key values may not be NULL (the store rejects them); NULL encodes only for the
//! partition key of append-only tables, which hashes whole rows. The encoding and hash never change between versions of
//! Tessera: they decide where data lives on disk.
//!
//! The 64-bit ring is cut into `P` equal contiguous ranges; partition `i` holds hashes in
//! `[i * 2^64 / P, (i + 1) * 2^64 / P)`.

use crate::ids::PartitionId;
use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, BinaryViewArray, BooleanArray, LargeBinaryArray,
    LargeStringArray, StringArray, StringViewArray,
};
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, Int16Type, Int32Type, Int64Type, Int8Type,
    UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum PartitioningError {
    #[error("partition key column {column:?} has type {data_type}, which cannot be a key (supported: integers, strings, dates, decimals, booleans, binary)")]
    UnsupportedKeyType { column: String, data_type: DataType },
}

/// The ring of `P` partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionRing {
    partition_count: u32,
}

impl PartitionRing {
    pub fn new(partition_count: u32) -> PartitionRing {
        assert!(partition_count > 0, "a ring needs at least one partition");
        PartitionRing { partition_count }
    }

    pub fn partition_count(&self) -> u32 {
        self.partition_count
    }

    /// The partition whose contiguous range of the ring contains `hash`.
    pub fn partition_of(&self, hash: u64) -> PartitionId {
        let index = ((hash as u128 * self.partition_count as u128) >> 64) as u32;
        debug_assert!(index < self.partition_count);
        PartitionId(index)
    }

    pub fn partitions(&self) -> impl Iterator<Item = PartitionId> {
        (0..self.partition_count).map(PartitionId)
    }
}

/// True if values of this type can be part of a partition or primary key.
pub fn is_key_type(data_type: &DataType) -> bool {
    check_key_type("", data_type).is_ok()
}

/// Partitions of the ring when a cluster or store is created without saying (DESIGN §3).
pub const DEFAULT_PARTITIONS: u32 = 64;

/// The stable 64-bit partition hash of every row, given the key columns in key order.
pub fn partition_key_hashes(
    key_columns: &[(&str, &ArrayRef)],
) -> Result<Vec<u64>, PartitioningError> {
    let rows = key_columns.first().map(|(_, a)| a.len()).unwrap_or(0);
    for (name, column) in key_columns {
        check_key_type(name, column.data_type())?;
    }
    let mut encoding = Vec::with_capacity(64);
    let mut hashes = Vec::with_capacity(rows);
    for row in 0..rows {
        encoding.clear();
        for (_, column) in key_columns {
            encode_value(column, row, &mut encoding);
        }
        let digest = blake3::hash(&encoding);
        let first8: [u8; 8] = digest.as_bytes()[..8]
            .try_into()
            .expect("BLAKE3 has 32 bytes");
        hashes.push(u64::from_le_bytes(first8));
    }
    Ok(hashes)
}

fn check_key_type(column: &str, data_type: &DataType) -> Result<(), PartitioningError> {
    use DataType::*;
    match data_type {
        Int8
        | Int16
        | Int32
        | Int64
        | UInt8
        | UInt16
        | UInt32
        | UInt64
        | Utf8
        | LargeUtf8
        | Utf8View
        | Date32
        | Date64
        | Decimal128(_, _)
        | Boolean
        | Binary
        | LargeBinary
        | BinaryView => Ok(()),
        other => Err(PartitioningError::UnsupportedKeyType {
            column: column.to_string(),
            data_type: other.clone(),
        }),
    }
}

fn encode_bytes(tag: u8, bytes: &[u8], out: &mut Vec<u8>) {
    out.push(tag);
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn encode_value(column: &ArrayRef, row: usize, out: &mut Vec<u8>) {
    use DataType::*;
    if column.is_null(row) {
        out.push(0x00);
        return;
    }
    let signed = |value: i64, out: &mut Vec<u8>| {
        out.push(0x01);
        out.extend_from_slice(&value.to_be_bytes());
    };
    let unsigned = |value: u64, out: &mut Vec<u8>| {
        out.push(0x02);
        out.extend_from_slice(&value.to_be_bytes());
    };
    match column.data_type() {
        Int8 => signed(column.as_primitive::<Int8Type>().value(row) as i64, out),
        Int16 => signed(column.as_primitive::<Int16Type>().value(row) as i64, out),
        Int32 => signed(column.as_primitive::<Int32Type>().value(row) as i64, out),
        Int64 => signed(column.as_primitive::<Int64Type>().value(row), out),
        UInt8 => unsigned(column.as_primitive::<UInt8Type>().value(row) as u64, out),
        UInt16 => unsigned(column.as_primitive::<UInt16Type>().value(row) as u64, out),
        UInt32 => unsigned(column.as_primitive::<UInt32Type>().value(row) as u64, out),
        UInt64 => unsigned(column.as_primitive::<UInt64Type>().value(row), out),
        Utf8 => encode_bytes(
            0x03,
            column
                .as_any()
                .downcast_ref::<StringArray>()
                .expect("Utf8")
                .value(row)
                .as_bytes(),
            out,
        ),
        LargeUtf8 => encode_bytes(
            0x03,
            column
                .as_any()
                .downcast_ref::<LargeStringArray>()
                .expect("LargeUtf8")
                .value(row)
                .as_bytes(),
            out,
        ),
        Utf8View => encode_bytes(
            0x03,
            column
                .as_any()
                .downcast_ref::<StringViewArray>()
                .expect("Utf8View")
                .value(row)
                .as_bytes(),
            out,
        ),
        Date32 => {
            out.push(0x04);
            out.extend_from_slice(&column.as_primitive::<Date32Type>().value(row).to_be_bytes());
        }
        Date64 => {
            out.push(0x05);
            out.extend_from_slice(&column.as_primitive::<Date64Type>().value(row).to_be_bytes());
        }
        Decimal128(_, scale) => {
            out.push(0x06);
            out.push(*scale as u8);
            out.extend_from_slice(
                &column
                    .as_primitive::<Decimal128Type>()
                    .value(row)
                    .to_be_bytes(),
            );
        }
        Boolean => {
            out.push(0x07);
            let array = column
                .as_any()
                .downcast_ref::<BooleanArray>()
                .expect("Boolean");
            out.push(array.value(row) as u8);
        }
        Binary => encode_bytes(
            0x08,
            column
                .as_any()
                .downcast_ref::<BinaryArray>()
                .expect("Binary")
                .value(row),
            out,
        ),
        LargeBinary => encode_bytes(
            0x08,
            column
                .as_any()
                .downcast_ref::<LargeBinaryArray>()
                .expect("LargeBinary")
                .value(row),
            out,
        ),
        BinaryView => encode_bytes(
            0x08,
            column
                .as_any()
                .downcast_ref::<BinaryViewArray>()
                .expect("BinaryView")
                .value(row),
            out,
        ),
        other => unreachable!("key type {other} was checked before encoding"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, Int64Array};
    use proptest::prelude::*;
    use std::sync::Arc;

    fn hash_one(column: ArrayRef) -> u64 {
        partition_key_hashes(&[("k", &column)]).unwrap()[0]
    }

    #[test]
    fn hash_is_pinned_to_known_vectors() {
        // These values are part of the on-disk contract: if this test fails, data would move.
        let int_key = hash_one(Arc::new(Int64Array::from(vec![42])));
        let mut expected = vec![0x01];
        expected.extend_from_slice(&42i64.to_be_bytes());
        let digest = blake3::hash(&expected);
        assert_eq!(
            int_key,
            u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap())
        );
        let str_key = hash_one(Arc::new(StringArray::from(vec!["tessera"])));
        let mut expected = vec![0x03, 0, 0, 0, 7];
        expected.extend_from_slice(b"tessera");
        let digest = blake3::hash(&expected);
        assert_eq!(
            str_key,
            u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap())
        );
    }

    #[test]
    fn integer_widths_and_string_layouts_hash_alike() {
        assert_eq!(
            hash_one(Arc::new(Int32Array::from(vec![-7]))),
            hash_one(Arc::new(Int64Array::from(vec![-7])))
        );
        assert_eq!(
            hash_one(Arc::new(StringArray::from(vec!["abc"]))),
            hash_one(Arc::new(StringViewArray::from(vec!["abc"])))
        );
    }

    #[test]
    fn nulls_hash_apart_and_unsupported_types_are_errors() {
        let nulls: ArrayRef = Arc::new(Int64Array::from(vec![Some(0), None]));
        let hashes = partition_key_hashes(&[("id", &nulls)]).unwrap();
        assert_ne!(hashes[0], hashes[1]);
        let floats: ArrayRef = Arc::new(arrow::array::Float64Array::from(vec![1.0]));
        assert!(matches!(
            partition_key_hashes(&[("f", &floats)]),
            Err(PartitioningError::UnsupportedKeyType { .. })
        ));
    }

    #[test]
    fn ring_ranges_are_contiguous_and_equal() {
        let ring = PartitionRing::new(64);
        assert_eq!(ring.partition_of(0), PartitionId(0));
        assert_eq!(ring.partition_of(u64::MAX), PartitionId(63));
        assert_eq!(ring.partition_of(1u64 << 58), PartitionId(1));
        assert_eq!(ring.partition_of((1u64 << 58) - 1), PartitionId(0));
    }

    proptest! {
        #[test]
        fn partition_of_is_monotone_in_hash(a: u64, b: u64, p in 1u32..512) {
            let ring = PartitionRing::new(p);
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(ring.partition_of(lo) <= ring.partition_of(hi));
            prop_assert!(ring.partition_of(hi).0 < p);
        }

        #[test]
        fn composite_keys_depend_on_every_column(a: i64, b: i64, c: i64) {
            prop_assume!(b != c);
            let first: ArrayRef = Arc::new(Int64Array::from(vec![a, a]));
            let second: ArrayRef = Arc::new(Int64Array::from(vec![b, c]));
            let hashes = partition_key_hashes(&[("a", &first), ("b", &second)]).unwrap();
            prop_assert_ne!(hashes[0], hashes[1]);
        }
    }
}
