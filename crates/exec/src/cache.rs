//! A compute node's content-addressed cache of other nodes' components (Pond's whole-block
//! caching): a component is named by the BLAKE3 hash of its bytes, so a copy fetched from
//! any replica is the component, and a cached file never goes stale. Files are checked
//! against their names when they enter and before they are first read; a damaged one is
//! dropped and fetched again. The cache holds at most `budget` bytes, evicting the least
//! recently used files that no running scan has pinned.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tessera_common::ComponentHash;
use tessera_sql::provider::ComponentFiles;
use tessera_storage::component::{component_path, replace_component, verify_component};

#[derive(Debug)]
struct Entry {
    bytes: u64,
    /// A tick of [`Cached::clock`] at the last use: the smallest is evicted first.
    last_used: u64,
    /// Scans reading the file now: it is not evicted while any does.
    pins: usize,
}

#[derive(Debug, Default)]
struct Cached {
    entries: HashMap<ComponentHash, Entry>,
    /// Files checked against their names since they were written or found at start.
    verified: HashSet<ComponentHash>,
    bytes: u64,
    clock: u64,
}

/// A compute node's cache as `tessera status` shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CacheStatus {
    pub bytes: u64,
    pub files: usize,
    pub budget: u64,
    /// Component bytes scans found cached, and fetched into the cache, since the start.
    pub hit_bytes: u64,
    pub miss_bytes: u64,
}

impl CacheStatus {
    /// The share of component bytes read that were cached, if any were read.
    pub fn hit_rate(&self) -> Option<f64> {
        let read = self.hit_bytes + self.miss_bytes;
        (read > 0).then(|| self.hit_bytes as f64 / read as f64)
    }
}

#[derive(Debug)]
pub struct ComponentCache {
    dir: PathBuf,
    budget: u64,
    cached: Mutex<Cached>,
}

/// What a scan holds of the cache while it reads: its files stay until it is dropped.
#[derive(Debug)]
pub struct Pins {
    cache: Arc<ComponentCache>,
    hashes: Vec<ComponentHash>,
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut cached = self.cache.cached.lock().expect("cache lock");
        for hash in &self.hashes {
            if let Some(entry) = cached.entries.get_mut(hash) {
                entry.pins -= 1;
            }
        }
        drop(cached);
        self.cache.evict();
    }
}

impl ComponentCache {
    /// The cache under `dir`, taking in the files a previous process left there (checked
    /// before their first read, like any other).
    pub fn open(dir: &Path, budget: u64) -> std::io::Result<Arc<ComponentCache>> {
        std::fs::create_dir_all(dir)?;
        let mut cached = Cached::default();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            match name
                .strip_suffix(".parquet")
                .and_then(ComponentHash::from_hex)
            {
                Some(hash) => {
                    let bytes = entry.metadata()?.len();
                    cached.bytes += bytes;
                    cached.entries.insert(
                        hash,
                        Entry {
                            bytes,
                            last_used: 0,
                            pins: 0,
                        },
                    );
                }
                // A write a crash cut short.
                None => std::fs::remove_file(entry.path())?,
            }
        }
        let cache = Arc::new(ComponentCache {
            dir: dir.to_path_buf(),
            budget,
            cached: Mutex::new(cached),
        });
        cache.evict();
        Ok(cache)
    }

    /// Pins the cached files among `hashes` and returns the others, which the caller
    /// fetches and [`ComponentCache::insert`]s under the same pins.
    pub fn pin(self: &Arc<Self>, hashes: &[ComponentHash]) -> (Pins, Vec<ComponentHash>) {
        let mut cached = self.cached.lock().expect("cache lock");
        cached.clock += 1;
        let now = cached.clock;
        let mut pinned = Vec::new();
        let mut missing = Vec::new();
        let mut hit_bytes = 0;
        for hash in hashes {
            match cached.entries.get_mut(hash) {
                Some(entry) => {
                    entry.pins += 1;
                    entry.last_used = now;
                    hit_bytes += entry.bytes;
                    pinned.push(*hash);
                }
                None => missing.push(*hash),
            }
        }
        drop(cached);
        tessera_common::metrics::metrics()
            .component_cache_hit_bytes
            .inc_by(hit_bytes);
        let pins = Pins {
            cache: self.clone(),
            hashes: pinned,
        };
        (pins, missing)
    }

    /// Writes a fetched component (refused unless its bytes hash to `hash`) and pins it
    /// under `pins`. Blocking: it writes the file.
    pub fn insert(
        &self,
        pins: &mut Pins,
        hash: ComponentHash,
        bytes: &[u8],
    ) -> Result<(), tessera_storage::StorageError> {
        replace_component(&self.dir, &hash, bytes)?;
        let mut cached = self.cached.lock().expect("cache lock");
        cached.clock += 1;
        let now = cached.clock;
        let size = bytes.len() as u64;
        match cached.entries.get_mut(&hash) {
            // Another scan fetched it meanwhile: the same bytes, written over.
            Some(entry) => {
                entry.pins += 1;
                entry.last_used = now;
            }
            None => {
                cached.bytes += size;
                cached.entries.insert(
                    hash,
                    Entry {
                        bytes: size,
                        last_used: now,
                        pins: 1,
                    },
                );
            }
        }
        cached.verified.insert(hash);
        drop(cached);
        pins.hashes.push(hash);
        tessera_common::metrics::metrics()
            .component_cache_miss_bytes
            .inc_by(size);
        self.evict();
        Ok(())
    }

    /// [`ComponentCache::insert`] off the async threads (it writes the file); the pins
    /// come back with the new file among them.
    pub async fn insert_blocking(
        self: &Arc<Self>,
        mut pins: Pins,
        hash: ComponentHash,
        bytes: Vec<u8>,
    ) -> Result<Pins, String> {
        let cache = self.clone();
        tokio::task::spawn_blocking(move || cache.insert(&mut pins, hash, &bytes).map(|()| pins))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }

    /// Drops the least recently used unpinned files until the cache fits its budget.
    fn evict(&self) {
        let mut cached = self.cached.lock().expect("cache lock");
        while cached.bytes > self.budget {
            let Some((&hash, _)) = cached
                .entries
                .iter()
                .filter(|(_, e)| e.pins == 0)
                .min_by_key(|(_, e)| e.last_used)
            else {
                // Every file is being read: the cache runs over until scans end.
                break;
            };
            self.forget(&mut cached, &hash);
        }
    }

    /// Removes one file and its entry.
    fn forget(&self, cached: &mut Cached, hash: &ComponentHash) {
        if let Some(entry) = cached.entries.remove(hash) {
            cached.bytes -= entry.bytes;
        }
        cached.verified.remove(hash);
        let path = component_path(&self.dir, hash);
        if let Err(error) = std::fs::remove_file(&path) {
            if error.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(%hash, %error, "could not remove a cached component");
            }
        }
    }

    /// Bytes and files held now.
    pub fn usage(&self) -> (u64, usize) {
        let cached = self.cached.lock().expect("cache lock");
        (cached.bytes, cached.entries.len())
    }

    /// What the cache holds and has served since this process started.
    pub fn status(&self) -> CacheStatus {
        let (bytes, files) = self.usage();
        let metrics = tessera_common::metrics::metrics();
        CacheStatus {
            bytes,
            files,
            budget: self.budget,
            hit_bytes: metrics.component_cache_hit_bytes.get(),
            miss_bytes: metrics.component_cache_miss_bytes.get(),
        }
    }
}

impl ComponentFiles for ComponentCache {
    fn dir(&self) -> &Path {
        &self.dir
    }

    /// Checks a cached file against its name before its first read; a damaged one is
    /// removed (the scan fails over to another way of reading, and the next fetches it).
    fn verify(&self, hash: &ComponentHash) -> Result<(), tessera_storage::StorageError> {
        if self
            .cached
            .lock()
            .expect("cache lock")
            .verified
            .contains(hash)
        {
            return Ok(());
        }
        match verify_component(&self.dir, hash) {
            Ok(()) => {
                self.cached
                    .lock()
                    .expect("cache lock")
                    .verified
                    .insert(*hash);
                Ok(())
            }
            Err(error) => {
                tracing::warn!(%hash, %error, "a cached component is damaged; dropped");
                let mut cached = self.cached.lock().expect("cache lock");
                self.forget(&mut cached, hash);
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of(bytes: &[u8]) -> ComponentHash {
        ComponentHash::of_bytes(bytes)
    }

    #[test]
    fn files_enter_checked_and_leave_least_recently_used_first_unless_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ComponentCache::open(dir.path(), 25).unwrap();
        let (a, b, c) = (
            b"aaaaaaaaaa".as_slice(),
            b"bbbbbbbbbb".as_slice(),
            b"cccccccccc".as_slice(),
        );
        let (mut pins, missing) = cache.pin(&[hash_of(a), hash_of(b)]);
        assert_eq!(missing, vec![hash_of(a), hash_of(b)]);
        // Bytes that do not hash to the name are refused.
        assert!(cache.insert(&mut pins, hash_of(a), b).is_err());
        cache.insert(&mut pins, hash_of(a), a).unwrap();
        cache.insert(&mut pins, hash_of(b), b).unwrap();
        drop(pins);
        // a is used again: b is now the least recently used.
        let (pins_a, missing) = cache.pin(&[hash_of(a)]);
        assert!(missing.is_empty());
        let (mut pins_c, _) = cache.pin(&[hash_of(c)]);
        cache.insert(&mut pins_c, hash_of(c), c).unwrap();
        assert_eq!(cache.usage(), (20, 2), "b went, a (pinned) and c stay");
        assert!(!component_path(dir.path(), &hash_of(b)).exists());
        drop((pins_a, pins_c));

        // A file damaged on disk is found before it is read, and dropped.
        std::fs::write(component_path(dir.path(), &hash_of(c)), b"cccccccccX").unwrap();
        let reopened = ComponentCache::open(dir.path(), 25).unwrap();
        assert_eq!(
            reopened.usage(),
            (20, 2),
            "files left by an earlier process"
        );
        assert!(reopened.verify(&hash_of(a)).is_ok());
        assert!(reopened.verify(&hash_of(c)).is_err());
        assert_eq!(reopened.usage(), (10, 1));
        let (_pins, missing) = reopened.pin(&[hash_of(a), hash_of(c)]);
        assert_eq!(missing, vec![hash_of(c)], "fetched again next time");
    }
}
