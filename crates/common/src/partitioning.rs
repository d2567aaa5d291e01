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
use crate::short_hash::{self, ShortInputs};
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
    let columns = key_columns
        .iter()
        .map(|(name, column)| KeyColumn::of(name, column))
        .collect::<Result<Vec<_>, _>>()?;
    let mut hashes = Vec::with_capacity(rows);
    if let [column] = columns.as_slice() {
        if hash_integer_key(column, rows, &mut hashes) {
            return Ok(hashes);
        }
    }
    let mut encoding = Vec::with_capacity(64);
    // Encodings of one block are hashed 16 at a time; a longer one (a long string key)
    // alone, once the short ones before it are hashed, so the hashes stay in row order.
    let mut short = ShortInputs::default();
    for row in 0..rows {
        encoding.clear();
        for column in &columns {
            column.encode(row, &mut encoding);
        }
        if encoding.len() <= short_hash::MAX_LEN {
            short.push(&encoding);
            if short.is_full() {
                short.hash_into(&mut hashes);
            }
        } else {
            short.hash_into(&mut hashes);
            let digest = blake3::hash(&encoding);
            let first8: [u8; 8] = digest.as_bytes()[..8]
                .try_into()
                .expect("BLAKE3 has 32 bytes");
            hashes.push(u64::from_le_bytes(first8));
        }
    }
    short.hash_into(&mut hashes);
    debug_assert_eq!(hashes.len(), rows);
    Ok(hashes)
}

/// The hashes of a one-column integer key, its encodings put straight into the hashing
/// lanes; false (nothing done) for any other key.
fn hash_integer_key(column: &KeyColumn<'_>, rows: usize, hashes: &mut Vec<u64>) -> bool {
    let (tag, value): (u8, Box<dyn Fn(usize) -> [u8; 8] + '_>) = match column {
        KeyColumn::Signed(value, _) => (0x01, Box::new(|row| value(row).to_be_bytes())),
        KeyColumn::Unsigned(value, _) => (0x02, Box::new(|row| value(row).to_be_bytes())),
        _ => return false,
    };
    let nulls = column.array().logical_nulls();
    let mut short = ShortInputs::default();
    for row in 0..rows {
        if nulls.as_ref().is_some_and(|nulls| nulls.is_null(row)) {
            short.push(&[0x00]);
        } else {
            short.push_tagged(tag, value(row));
        }
        if short.is_full() {
            short.hash_into(hashes);
        }
    }
    short.hash_into(hashes);
    true
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

/// A key column, its type looked at once rather than for every row.
enum KeyColumn<'a> {
    Signed(Box<dyn Fn(usize) -> i64 + 'a>, &'a dyn Array),
    Unsigned(Box<dyn Fn(usize) -> u64 + 'a>, &'a dyn Array),
    Bytes(u8, Box<dyn Fn(usize) -> &'a [u8] + 'a>, &'a dyn Array),
    Date32(&'a arrow::array::Date32Array),
    Date64(&'a arrow::array::Date64Array),
    Decimal128(i8, &'a arrow::array::Decimal128Array),
    Boolean(&'a BooleanArray),
}

impl<'a> KeyColumn<'a> {
    fn of(name: &str, column: &'a ArrayRef) -> Result<KeyColumn<'a>, PartitioningError> {
        use DataType::*;
        check_key_type(name, column.data_type())?;
        let array: &'a dyn Array = column.as_ref();
        fn signed<'a, T: arrow::datatypes::ArrowPrimitiveType>(
            array: &'a dyn Array,
        ) -> Box<dyn Fn(usize) -> i64 + 'a>
        where
            T::Native: Into<i64>,
        {
            let values = array.as_primitive::<T>().values();
            Box::new(move |row| values[row].into())
        }
        fn unsigned<'a, T: arrow::datatypes::ArrowPrimitiveType>(
            array: &'a dyn Array,
        ) -> Box<dyn Fn(usize) -> u64 + 'a>
        where
            T::Native: Into<u64>,
        {
            let values = array.as_primitive::<T>().values();
            Box::new(move |row| values[row].into())
        }
        fn bytes<'a, A: Array + 'static>(
            array: &'a dyn Array,
            value: fn(&'a A, usize) -> &'a [u8],
        ) -> Box<dyn Fn(usize) -> &'a [u8] + 'a> {
            let typed = array.as_any().downcast_ref::<A>().expect("checked type");
            Box::new(move |row| value(typed, row))
        }
        Ok(match column.data_type() {
            Int8 => KeyColumn::Signed(signed::<Int8Type>(array), array),
            Int16 => KeyColumn::Signed(signed::<Int16Type>(array), array),
            Int32 => KeyColumn::Signed(signed::<Int32Type>(array), array),
            Int64 => KeyColumn::Signed(signed::<Int64Type>(array), array),
            UInt8 => KeyColumn::Unsigned(unsigned::<UInt8Type>(array), array),
            UInt16 => KeyColumn::Unsigned(unsigned::<UInt16Type>(array), array),
            UInt32 => KeyColumn::Unsigned(unsigned::<UInt32Type>(array), array),
            UInt64 => KeyColumn::Unsigned(unsigned::<UInt64Type>(array), array),
            Utf8 => KeyColumn::Bytes(
                0x03,
                bytes::<StringArray>(array, |a, row| a.value(row).as_bytes()),
                array,
            ),
            LargeUtf8 => KeyColumn::Bytes(
                0x03,
                bytes::<LargeStringArray>(array, |a, row| a.value(row).as_bytes()),
                array,
            ),
            Utf8View => KeyColumn::Bytes(
                0x03,
                bytes::<StringViewArray>(array, |a, row| a.value(row).as_bytes()),
                array,
            ),
            Binary => KeyColumn::Bytes(
                0x08,
                bytes::<BinaryArray>(array, |a, row| a.value(row)),
                array,
            ),
            LargeBinary => KeyColumn::Bytes(
                0x08,
                bytes::<LargeBinaryArray>(array, |a, row| a.value(row)),
                array,
            ),
            BinaryView => KeyColumn::Bytes(
                0x08,
                bytes::<BinaryViewArray>(array, |a, row| a.value(row)),
                array,
            ),
            Date32 => KeyColumn::Date32(column.as_primitive::<Date32Type>()),
            Date64 => KeyColumn::Date64(column.as_primitive::<Date64Type>()),
            Decimal128(_, scale) => {
                KeyColumn::Decimal128(*scale, column.as_primitive::<Decimal128Type>())
            }
            Boolean => KeyColumn::Boolean(
                column
                    .as_any()
                    .downcast_ref::<BooleanArray>()
                    .expect("Boolean"),
            ),
            other => unreachable!("key type {other} was checked"),
        })
    }

    fn array(&self) -> &dyn Array {
        match self {
            KeyColumn::Signed(_, array)
            | KeyColumn::Unsigned(_, array)
            | KeyColumn::Bytes(_, _, array) => *array,
            KeyColumn::Date32(array) => *array,
            KeyColumn::Date64(array) => *array,
            KeyColumn::Decimal128(_, array) => *array,
            KeyColumn::Boolean(array) => *array,
        }
    }

    /// Appends the canonical encoding of this column's value in `row` (module docs).
    fn encode(&self, row: usize, out: &mut Vec<u8>) {
        if self.array().is_null(row) {
            out.push(0x00);
            return;
        }
        match self {
            KeyColumn::Signed(value, _) => {
                out.push(0x01);
                out.extend_from_slice(&value(row).to_be_bytes());
            }
            KeyColumn::Unsigned(value, _) => {
                out.push(0x02);
                out.extend_from_slice(&value(row).to_be_bytes());
            }
            KeyColumn::Bytes(tag, value, _) => {
                let bytes = value(row);
                out.push(*tag);
                out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
                out.extend_from_slice(bytes);
            }
            KeyColumn::Date32(array) => {
                out.push(0x04);
                out.extend_from_slice(&array.value(row).to_be_bytes());
            }
            KeyColumn::Date64(array) => {
                out.push(0x05);
                out.extend_from_slice(&array.value(row).to_be_bytes());
            }
            KeyColumn::Decimal128(scale, array) => {
                out.push(0x06);
                out.push(*scale as u8);
                out.extend_from_slice(&array.value(row).to_be_bytes());
            }
            KeyColumn::Boolean(array) => {
                out.push(0x07);
                out.push(array.value(row) as u8);
            }
        }
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
        fn batched_hashes_equal_one_blake3_per_row(
            keys in proptest::collection::vec((any::<i64>(), "[a-z]{0,80}", any::<bool>()), 0..60)
        ) {
            // Encodings of up to 64 bytes are hashed 16 at a time, longer ones alone, in
            // any order: each row's hash is still BLAKE3 of its own encoding.
            let ints: ArrayRef = Arc::new(Int64Array::from(
                keys.iter().map(|(i, _, null)| (!null).then_some(*i)).collect::<Vec<_>>(),
            ));
            let strings: ArrayRef = Arc::new(StringArray::from(
                keys.iter().map(|(_, s, _)| s.as_str()).collect::<Vec<_>>(),
            ));
            let hashes = partition_key_hashes(&[("i", &ints), ("s", &strings)]).unwrap();
            prop_assert_eq!(hashes.len(), keys.len());
            for ((i, s, null), hash) in keys.iter().zip(hashes) {
                let mut encoding = Vec::new();
                if *null {
                    encoding.push(0x00);
                } else {
                    encoding.push(0x01);
                    encoding.extend_from_slice(&i.to_be_bytes());
                }
                encoding.push(0x03);
                encoding.extend_from_slice(&(s.len() as u32).to_be_bytes());
                encoding.extend_from_slice(s.as_bytes());
                let digest = blake3::hash(&encoding);
                prop_assert_eq!(hash, u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap()));
            }
        }

        #[test]
        fn a_one_column_integer_key_hashes_as_its_encoding(
            keys in proptest::collection::vec(proptest::option::of(any::<i64>()), 0..60),
            unsigned: bool,
        ) {
            let column: ArrayRef = if unsigned {
                Arc::new(arrow::array::UInt64Array::from(
                    keys.iter().map(|k| k.map(|v| v as u64)).collect::<Vec<_>>(),
                ))
            } else {
                Arc::new(Int64Array::from(keys.clone()))
            };
            let hashes = partition_key_hashes(&[("k", &column)]).unwrap();
            prop_assert_eq!(hashes.len(), keys.len());
            for (key, hash) in keys.iter().zip(hashes) {
                let encoding = match key {
                    None => vec![0x00],
                    Some(v) if unsigned => [&[0x02][..], &(*v as u64).to_be_bytes()].concat(),
                    Some(v) => [&[0x01][..], &v.to_be_bytes()].concat(),
                };
                let digest = blake3::hash(&encoding);
                prop_assert_eq!(hash, u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap()));
            }
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
