//! Immutable on-disk components: Parquet files named by the BLAKE3 hash of their bytes.
//!
//! A component holds row versions of one (table, partition): the table's columns followed
//! by the version columns. It is written whole in memory, hashed, written to a temporary
//! file, fsynced and renamed to `<hash>.parquet`, so a component either exists complete
//! under its name or not at all.

use crate::catalog::TableDef;
use crate::error::{Result, StorageError};
use crate::evolution::FileColumns;
use crate::fsio;
use arrow::array::RecordBatch;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReaderBuilder, RowSelection};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use tessera_common::{disk, ComponentHash, Epoch, Lsn};

/// Rows per Parquet row group: small enough for statistics to prune, large enough to scan fast.
pub const ROW_GROUP_ROWS: usize = 128 * 1024;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ComponentMeta {
    pub hash: ComponentHash,
    pub rows: u64,
    pub bytes: u64,
    pub min_lsn: Lsn,
    pub max_lsn: Lsn,
    pub min_epoch: Epoch,
    pub max_epoch: Epoch,
    /// No key occurs twice in the component, so it needs no dedup on its own.
    pub unique_keys: bool,
    pub tombstones: u64,
    /// The version of the table's definition the file was written under
    /// ([`TableDef::layout`]); an older file is conformed when read.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub layout: u32,
    /// Set on a merge's history component (see [`crate::store`]'s merges): every version in
    /// it is superseded by a version at or below this epoch, so a read at this epoch or
    /// later never needs it. Zero on every other component.
    #[serde(default, skip_serializing_if = "Epoch::is_zero")]
    pub superseded_at: Epoch,
}

impl ComponentMeta {
    /// Whether this is a merge's history component: versions only reads below
    /// `superseded_at` (and diffs, copies and checks) need.
    pub fn is_history(&self) -> bool {
        !self.superseded_at.is_zero()
    }

    /// Whether a read of the table at `epoch` needs this component's rows.
    pub fn read_at(&self, epoch: Epoch) -> bool {
        self.min_epoch <= epoch && !(self.is_history() && self.superseded_at <= epoch)
    }
}

fn is_zero(layout: &u32) -> bool {
    *layout == 0
}

/// The most bytes of distinct values a component's column chunk keeps in its dictionary;
/// past it, the chunk's remaining pages are written plain. A dictionary pays where a
/// column repeats a few values (dates, flags, discounts: RLE indices into a small table),
/// and costs where nearly every value is new (prices, keys, comments): then the reader
/// pays a gather through a dictionary as large as the data, for little or no saving in
/// size. At the Parquet writer's default of 1 MiB nearly every column of a component
/// (one storage partition, 94K lineitem rows at SF 1) stayed dictionary encoded, where
/// a plain file's larger row groups overflow the dictionary and go plain: reading SF 1
/// lineitem written as 94K-row groups took 1.09 (Q6) and 1.04 (Q1) the time of 128K-row
/// groups, and 0.92 and 0.95 with this limit (plain DataFusion reading both, a run of 9).
pub const DICTIONARY_PAGE_BYTES: usize = 64 * 1024;

/// The writer settings for plain Parquet: the benchmark's baseline files and `tessera
/// export`. LZ4 (raw blocks) rather than Snappy: about the same size, and it decompresses
/// faster, which is most of what a read that needs few rows of a large component costs
/// (a diff's rows before: `tessera bench diff` went from 300–350 to about 240 ms at SF 1).
/// Components written with Snappy before are read as they are.
pub fn writer_properties() -> WriterProperties {
    WriterProperties::builder()
        .set_compression(Compression::LZ4_RAW)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build()
}

/// The writer settings for every component: [`writer_properties`], with dictionaries kept
/// only for columns whose distinct values fit [`DICTIONARY_PAGE_BYTES`]. Components
/// written with larger dictionaries before are read as they are.
pub fn component_writer_properties() -> WriterProperties {
    writer_properties()
        .into_builder()
        .set_dictionary_page_size_limit(DICTIONARY_PAGE_BYTES)
        .build()
}

pub fn component_path(dir: &Path, hash: &ComponentHash) -> PathBuf {
    dir.join(format!("{}.parquet", hash.to_hex()))
}

/// Encodes `batches` as Parquet in memory.
pub fn encode_parquet(batches: &[RecordBatch]) -> Result<Vec<u8>> {
    let schema = batches.first().expect("a component has rows").schema();
    let mut bytes = Vec::new();
    let parquet_err = |source| StorageError::Parquet {
        path: PathBuf::from("<in memory>"),
        source,
    };
    let mut writer = ArrowWriter::try_new(&mut bytes, schema, Some(component_writer_properties()))
        .map_err(parquet_err)?;
    for batch in batches {
        writer.write(batch).map_err(parquet_err)?;
    }
    writer.close().map_err(parquet_err)?;
    Ok(bytes)
}

/// Writes Parquet bytes as a component named by their hash; returns the hash. Writing a
/// component that already exists is a no-op: same name, same bytes.
pub fn write_component(dir: &Path, bytes: &[u8]) -> Result<ComponentHash> {
    write_new_component(dir, bytes).map(|(hash, _)| hash)
}

/// Whether [`write_new_component`] wrote the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// The file holds the bytes just written.
    New,
    /// A file of that name was there already, left as it was: it should hold the same
    /// bytes, unless it was damaged since.
    AlreadyThere,
}

/// [`write_component`], saying whether it wrote the file.
pub(crate) fn write_new_component(dir: &Path, bytes: &[u8]) -> Result<(ComponentHash, Written)> {
    let hash = ComponentHash::of_bytes(bytes);
    let path = component_path(dir, &hash);
    // Writers of the same bytes take turns: they would share the temporary file.
    let _turn = disk::writing(&path);
    if path.exists() {
        return Ok((hash, Written::AlreadyThere));
    }
    let tmp = path.with_extension("parquet.tmp");
    {
        let mut file = File::create(&tmp).map_err(|e| StorageError::io(&tmp, e))?;
        disk::write_all(&mut file, &tmp, bytes).map_err(|e| StorageError::io(&tmp, e))?;
        disk::sync_all(&file, &tmp).map_err(|e| StorageError::io(&tmp, e))?;
    }
    fs::rename(&tmp, &path).map_err(|e| StorageError::io(&path, e))?;
    fsio::sync_dir(dir)?;
    Ok((hash, Written::New))
}

/// Writes `bytes` over the component they hash to, whatever is there now (a damaged or
/// missing copy): the bytes are checked against `hash` first, and the file is replaced
/// atomically.
pub fn replace_component(dir: &Path, hash: &ComponentHash, bytes: &[u8]) -> Result<()> {
    check_named_bytes(dir, hash, bytes)?;
    replace_checked_component(dir, hash, bytes)
}

/// Checks that `bytes` hash to `hash`, the name of a component in `dir`.
pub(crate) fn check_named_bytes(dir: &Path, hash: &ComponentHash, bytes: &[u8]) -> Result<()> {
    let actual = ComponentHash::of_bytes(bytes);
    if actual != *hash {
        return Err(StorageError::CorruptComponent {
            hash: *hash,
            path: component_path(dir, hash),
            actual,
        });
    }
    Ok(())
}

/// [`replace_component`] of bytes the caller has checked against `hash` already: hashing
/// a component costs as much as reading it, and a copied one was hashed on arrival.
pub(crate) fn replace_checked_component(
    dir: &Path,
    hash: &ComponentHash,
    bytes: &[u8],
) -> Result<()> {
    fsio::write_atomically(&component_path(dir, hash), bytes)
}

/// Checks that a component's bytes hash to its name.
pub fn verify_component(dir: &Path, hash: &ComponentHash) -> Result<()> {
    read_verified(dir, hash).map(|_| ())
}

/// A component's bytes, checked against its name.
pub fn read_verified(dir: &Path, hash: &ComponentHash) -> Result<Vec<u8>> {
    read_named(
        component_path(dir, hash),
        hash,
        |hash, path| StorageError::MissingComponent { hash, path },
        |hash, path, actual| StorageError::CorruptComponent { hash, path, actual },
    )
}

/// The bytes of a component already checked against its name (by this process, or an
/// earlier one of this boot: see `store/verified.rs`).
pub(crate) fn read_checked_component(dir: &Path, hash: &ComponentHash) -> Result<Vec<u8>> {
    read_bytes(&component_path(dir, hash), hash, |hash, path| {
        StorageError::MissingComponent { hash, path }
    })
}

fn read_bytes(
    path: &Path,
    hash: &ComponentHash,
    missing: impl FnOnce(ComponentHash, PathBuf) -> StorageError,
) -> Result<Vec<u8>> {
    match disk::read(path) {
        Ok(bytes) => Ok(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(missing(*hash, path.into())),
        Err(e) => Err(StorageError::io(path, e)),
    }
}

/// The bytes of a file named by their hash (a component, an archive fragment), checked
/// against it; `missing` and `corrupt` say what kind of file is wrong.
pub(crate) fn read_named(
    path: PathBuf,
    hash: &ComponentHash,
    missing: impl FnOnce(ComponentHash, PathBuf) -> StorageError,
    corrupt: impl FnOnce(ComponentHash, PathBuf, ComponentHash) -> StorageError,
) -> Result<Vec<u8>> {
    let bytes = read_bytes(&path, hash, missing)?;
    let actual = ComponentHash::of_bytes(&bytes);
    if actual != *hash {
        return Err(corrupt(*hash, path, actual));
    }
    Ok(bytes)
}

/// The rows of a component that `selected` marks (one flag per row, in file order), every
/// column of `def`'s stored schema; the values of unselected rows are skipped rather than
/// decoded into arrays.
pub fn read_component_rows(
    dir: &Path,
    def: &TableDef,
    hash: &ComponentHash,
    selected: &arrow::array::BooleanArray,
) -> Result<Vec<RecordBatch>> {
    read_component_with(dir, def, hash, None, Some(selected))
}

/// Reads a component of `def`, optionally only the given columns of its stored schema
/// (ascending), in `def`'s stored schema whatever version of it the file was written
/// under ([`crate::evolution`]).
pub fn read_component(
    dir: &Path,
    def: &TableDef,
    hash: &ComponentHash,
    columns: Option<&[usize]>,
) -> Result<Vec<RecordBatch>> {
    read_component_with(dir, def, hash, columns, None)
}

fn read_component_with(
    dir: &Path,
    def: &TableDef,
    hash: &ComponentHash,
    columns: Option<&[usize]>,
    selected: Option<&arrow::array::BooleanArray>,
) -> Result<Vec<RecordBatch>> {
    let path = component_path(dir, hash);
    let parquet_err = |source| StorageError::Parquet {
        path: path.clone(),
        source,
    };
    let file = disk::open(&path).map_err(|e| StorageError::io(&path, e))?;
    let mut builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(parquet_err)?;
    let wanted: Vec<usize> = match columns {
        Some(columns) => columns.to_vec(),
        None => (0..def.schema.fields().len() + 2).collect(),
    };
    let layout = FileColumns::plan(def, builder.schema().fields().len(), &wanted)?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), layout.read.iter().copied());
    builder = builder.with_projection(mask);
    if let Some(selected) = selected {
        builder =
            builder.with_row_selection(RowSelection::from_filters(std::slice::from_ref(selected)));
    }
    let reader = builder.with_batch_size(8192).build().map_err(parquet_err)?;
    reader.map(|batch| layout.assemble(def, &batch?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two writers of the same component at once (a prefetch keeping fetched bytes while
    /// a copy installs them, or two flushes of equal rows) both succeed and leave it
    /// whole; they shared one temporary file before, and one of them failed with ENOENT.
    #[test]
    fn concurrent_writers_of_one_component_both_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..(4u32 << 20))
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let hash = ComponentHash::of_bytes(&bytes);
        for _ in 0..20 {
            let _ = fs::remove_file(component_path(dir.path(), &hash));
            std::thread::scope(|scope| {
                let writers: Vec<_> = (0..4)
                    .map(|i| {
                        let (dir, bytes) = (dir.path(), &bytes);
                        scope.spawn(move || match i % 2 {
                            0 => replace_component(dir, &hash, bytes),
                            _ => write_component(dir, bytes).map(|_| ()),
                        })
                    })
                    .collect();
                for writer in writers {
                    writer.join().unwrap().expect("every writer succeeds");
                }
            });
            verify_component(dir.path(), &hash).expect("the component is whole");
        }
    }

    /// A column whose distinct values outgrow [`DICTIONARY_PAGE_BYTES`] goes plain; one
    /// that repeats a few values keeps its dictionary. With the writer's default limit
    /// (1 MiB) both stay dictionary encoded, and the first assertion fails.
    #[test]
    fn only_columns_with_few_distinct_values_keep_a_dictionary() {
        use arrow::array::Int64Array;
        use arrow::datatypes::{DataType, Field, Schema};
        use parquet::basic::Encoding;
        use parquet::file::reader::{FileReader, SerializedFileReader};
        use std::sync::Arc;
        let rows = 100_000i64;
        let schema = Arc::new(Schema::new(vec![
            Field::new("price", DataType::Int64, false),
            Field::new("flag", DataType::Int64, false),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i * 7919))),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 3))),
            ],
        )
        .unwrap();
        let bytes = encode_parquet(&[batch]).unwrap();
        let reader = SerializedFileReader::new(bytes::Bytes::from(bytes)).unwrap();
        let chunk = reader.metadata().row_group(0);
        let data_pages = |column: usize| {
            chunk
                .column(column)
                .page_encoding_stats_mask()
                .expect("the writer records its data pages' encodings")
                .clone()
        };
        assert!(
            data_pages(0).is_set(Encoding::PLAIN),
            "a column of distinct values falls back to plain pages"
        );
        assert!(
            data_pages(1).is_only(Encoding::RLE_DICTIONARY),
            "a column of three values stays dictionary encoded"
        );
    }
}
