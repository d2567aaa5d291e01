//! Durable file operations: every write that must survive a crash goes through here, and
//! through the fault-injecting layer [`tessera_common::disk`] under it.

use crate::error::{Result, StorageError};
use std::fs::{self, File, OpenOptions};
use std::path::Path;
use tessera_common::disk;

/// Writes `bytes` to `path` so that after a crash the file holds either its old content or
/// all of `bytes`: write a temporary file, fsync it, rename it over, fsync the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    disk::write_atomically(path, bytes).map_err(|e| StorageError::io(path, e))
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    disk::sync_dir(dir).map_err(|e| StorageError::io(dir, e))
}

pub fn create_dir_all(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, e))
}

/// An exclusive advisory lock on the data directory, held for the life of the store.
pub struct DirLock {
    _file: File,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        let path = dir.join("LOCK");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| StorageError::io(&path, e))?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor we own; no memory is shared.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Err(StorageError::Locked {
                path: dir.to_path_buf(),
            });
        }
        Ok(DirLock { _file: file })
    }
}
