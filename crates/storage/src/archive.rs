//! The erasure-coded archive's storage side (Pond's archival storage, seed 004): an epoch of
//! a table that has left the replicated window but is still wanted (a tag pins it) is kept
//! as one component per partition, each cut into `k` data and `m` parity fragments that
//! live on `k + m` distinct nodes; any `k` of them give the component back.
//!
//! A fragment is named by the BLAKE3 hash of its bytes, like a component, so whoever holds
//! or receives one checks it against its name; the component rebuilt from fragments is
//! checked against its own hash. Encoding is deterministic: the same component always
//! gives the same fragments, so an unchanged partition archived at two epochs shares them.

use crate::error::{Result, StorageError};
use crate::fsio;
use std::path::{Path, PathBuf};
use tessera_common::ComponentHash;

/// How components are cut: `data` fragments carry the bytes, `parity` fragments let any
/// `data` of the `data + parity` rebuild them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErasureCode {
    pub data: usize,
    pub parity: usize,
}

impl ErasureCode {
    /// A code of `data + parity` fragments; refuses one the Reed-Solomon engine cannot do.
    pub fn new(data: usize, parity: usize) -> Result<ErasureCode> {
        if data == 0 || parity == 0 {
            return Err(archive_error(format!(
                "an erasure code needs at least one data and one parity fragment (given k = {data}, m = {parity})"
            )));
        }
        if !reed_solomon_simd::ReedSolomonEncoder::supports(data, parity) {
            return Err(archive_error(format!(
                "k = {data}, m = {parity} is not a supported erasure code"
            )));
        }
        Ok(ErasureCode { data, parity })
    }

    pub fn fragments(&self) -> usize {
        self.data + self.parity
    }

    /// The length of every fragment of a component of `len` bytes: a `data`th of it,
    /// rounded up to an even number of bytes (the engine works on 16-bit symbols).
    pub fn fragment_len(&self, len: u64) -> usize {
        let share = (len as usize).div_ceil(self.data).max(2);
        share + share % 2
    }

    /// The `data + parity` fragments of `bytes`, in index order (data first).
    pub fn encode(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let share = self.fragment_len(bytes.len() as u64);
        let mut fragments: Vec<Vec<u8>> = (0..self.data)
            .map(|i| {
                let start = (i * share).min(bytes.len());
                let end = ((i + 1) * share).min(bytes.len());
                let mut fragment = bytes[start..end].to_vec();
                fragment.resize(share, 0);
                fragment
            })
            .collect();
        let parity = reed_solomon_simd::encode(self.data, self.parity, &fragments)
            .map_err(|e| archive_error(format!("encoding: {e}")))?;
        fragments.extend(parity);
        Ok(fragments)
    }

    /// The component of `len` bytes that `fragments` (index, bytes) came from; needs any
    /// `data` of them, each of the code's fragment length.
    pub fn decode(&self, len: u64, fragments: &[(usize, Vec<u8>)]) -> Result<Vec<u8>> {
        let share = self.fragment_len(len);
        if fragments.len() < self.data {
            return Err(archive_error(format!(
                "{} fragments of a component are readable, and {} are needed to rebuild it",
                fragments.len(),
                self.data
            )));
        }
        for (index, fragment) in fragments {
            if *index >= self.fragments() || fragment.len() != share {
                return Err(archive_error(format!(
                    "fragment {index} has {} bytes; this code's fragments are numbered below {} and have {share}",
                    fragment.len(),
                    self.fragments()
                )));
            }
        }
        let mut data: Vec<Option<&[u8]>> = vec![None; self.data];
        for (index, fragment) in fragments.iter().filter(|(i, _)| *i < self.data) {
            data[*index] = Some(fragment);
        }
        let restored = if data.iter().all(Option::is_some) {
            Default::default()
        } else {
            let originals = fragments
                .iter()
                .filter(|(i, _)| *i < self.data)
                .map(|(i, f)| (*i, f));
            let recovery = fragments
                .iter()
                .filter(|(i, _)| *i >= self.data)
                .map(|(i, f)| (*i - self.data, f));
            reed_solomon_simd::decode(self.data, self.parity, originals, recovery)
                .map_err(|e| archive_error(format!("decoding: {e}")))?
        };
        let mut bytes = Vec::with_capacity(share * self.data);
        for (index, fragment) in data.iter().enumerate() {
            match fragment {
                Some(fragment) => bytes.extend_from_slice(fragment),
                None => bytes.extend_from_slice(restored.get(&index).ok_or_else(|| {
                    archive_error(format!("decoding did not restore fragment {index}"))
                })?),
            }
        }
        bytes.truncate(len as usize);
        Ok(bytes)
    }
}

fn archive_error(reason: String) -> StorageError {
    StorageError::Archive(reason)
}

/// The fragments a node holds: files named by their hash under `<store>/fragments`.
#[derive(Debug)]
pub struct FragmentStore {
    dir: PathBuf,
}

impl FragmentStore {
    pub fn open(dir: &Path) -> Result<FragmentStore> {
        fsio::create_dir_all(dir)?;
        Ok(FragmentStore {
            dir: dir.to_path_buf(),
        })
    }

    pub fn path(&self, hash: &ComponentHash) -> PathBuf {
        self.dir.join(format!("{}.fragment", hash.to_hex()))
    }

    /// Writes a fragment durably under its hash, after checking `bytes` against it
    /// (replacing whatever is there: a damaged copy).
    pub fn write(&self, hash: &ComponentHash, bytes: &[u8]) -> Result<()> {
        let path = self.path(hash);
        let actual = ComponentHash::of_bytes(bytes);
        if actual != *hash {
            return Err(StorageError::CorruptFragment {
                hash: *hash,
                path,
                actual,
            });
        }
        fsio::write_atomically(&path, bytes)
    }

    /// A fragment's bytes, checked against its name.
    pub fn read_verified(&self, hash: &ComponentHash) -> Result<Vec<u8>> {
        crate::component::read_named(
            self.path(hash),
            hash,
            |hash, path| StorageError::MissingFragment { hash, path },
            |hash, path, actual| StorageError::CorruptFragment { hash, path, actual },
        )
    }

    /// Every fragment file here (by name, unchecked), its size and how long ago it was
    /// last written.
    pub fn held(&self) -> Result<Vec<(ComponentHash, u64, std::time::Duration)>> {
        let mut held = Vec::new();
        let entries = std::fs::read_dir(&self.dir).map_err(|e| StorageError::io(&self.dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| StorageError::io(&self.dir, e))?;
            let name = entry.file_name();
            let Some(hash) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".fragment"))
                .and_then(ComponentHash::from_hex)
            else {
                continue;
            };
            let metadata = entry
                .metadata()
                .map_err(|e| StorageError::io(&entry.path(), e))?;
            let age = metadata
                .modified()
                .ok()
                .and_then(|at| at.elapsed().ok())
                .unwrap_or_default();
            held.push((hash, metadata.len(), age));
        }
        Ok(held)
    }

    /// Deletes a fragment no archived epoch names any more.
    pub fn remove(&self, hash: &ComponentHash) -> Result<()> {
        let path = self.path(hash);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StorageError::io(&path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn any_k_fragments_rebuild_the_component() {
        let code = ErasureCode::new(4, 2).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for len in [1usize, 2, 7, 8, 1000, 65_537] {
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            let fragments = code.encode(&bytes).unwrap();
            assert_eq!(fragments.len(), 6);
            assert!(fragments
                .iter()
                .all(|f| f.len() == code.fragment_len(len as u64)));
            // Every choice of 4 of the 6 fragments.
            for lost_a in 0..6 {
                for lost_b in lost_a + 1..6 {
                    let kept: Vec<(usize, Vec<u8>)> = fragments
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != lost_a && *i != lost_b)
                        .map(|(i, f)| (i, f.clone()))
                        .collect();
                    assert_eq!(
                        code.decode(len as u64, &kept).unwrap(),
                        bytes,
                        "len {len}, lost {lost_a} and {lost_b}"
                    );
                }
            }
            let three: Vec<(usize, Vec<u8>)> =
                fragments.iter().take(3).cloned().enumerate().collect();
            let refused = code.decode(len as u64, &three).unwrap_err().to_string();
            assert!(
                refused.contains("3 fragments") && refused.contains("4 are needed"),
                "{refused}"
            );
        }
    }

    #[test]
    fn encoding_is_deterministic_and_the_overhead_is_m_over_k() {
        let code = ErasureCode::new(4, 2).unwrap();
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(code.encode(&bytes).unwrap(), code.encode(&bytes).unwrap());
        let stored: usize = code.encode(&bytes).unwrap().iter().map(Vec::len).sum();
        assert_eq!(stored, 150_000);
        assert!(ErasureCode::new(0, 2).is_err());
    }

    #[test]
    fn a_fragment_is_checked_against_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let store = FragmentStore::open(dir.path()).unwrap();
        let hash = ComponentHash::of_bytes(b"fragment");
        assert!(store.write(&hash, b"other").is_err());
        store.write(&hash, b"fragment").unwrap();
        assert_eq!(store.read_verified(&hash).unwrap(), b"fragment");
        std::fs::write(store.path(&hash), b"fragmenT").unwrap();
        let damaged = store.read_verified(&hash).unwrap_err().to_string();
        assert!(damaged.contains("corrupt"), "{damaged}");
        store.remove(&hash).unwrap();
        let missing = store.read_verified(&hash).unwrap_err().to_string();
        assert!(missing.contains("missing"), "{missing}");
        assert!(store.held().unwrap().is_empty());
    }
}
