//! Durable file operations: every write that must survive a crash goes through here.

use crate::error::{Result, StorageError};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` so that after a crash the file holds either its old content or
/// all of `bytes`: write a temporary file, fsync it, rename it over, fsync the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut file = File::create(&tmp).map_err(|e| StorageError::io(&tmp, e))?;
        file.write_all(bytes)
            .map_err(|e| StorageError::io(&tmp, e))?;
        file.sync_all().map_err(|e| StorageError::io(&tmp, e))?;
    }
    fs::rename(&tmp, path).map_err(|e| StorageError::io(path, e))?;
    sync_dir(path.parent().expect("a data file lives in a directory"))
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StorageError::io(dir, e))
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
