//! The components this node has checked against their names (BLAKE3 of their bytes), so a
//! reader hashes each one once, not on every read.
//!
//! The check is remembered across a restart of the process, not of the machine. Each check
//! is journaled (`verified` in the store's directory) with the file's identity at the time:
//! device, inode, size, and modification and change times. A process that starts again on
//! the same boot trusts a component whose file still has that identity. Nothing that writes
//! through the filesystem can change a file's bytes and leave its change time alone, so
//! such a file holds the bytes that were checked. What the filesystem does not see (bit rot
//! beneath it) is the scrubber's to find, for a process that keeps running as for one that
//! restarted.
//!
//! A new boot trusts nothing: a power loss or a kernel crash is when a disk tears writes,
//! so every component is hashed again on its first read. A restarted process otherwise
//! hashed every component its first queries touched, on their path: gigabytes on a large
//! node, and in `bench recovery` a third of the first query's time after a rejoin.
//!
//! The journal is never synced: a line lost with the machine is a check made again. A
//! damaged or foreign line is skipped. Distrust is journaled too (a component the scrubber
//! found damaged, or one deleted), so it survives the restart as well.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tessera_common::ComponentHash;

/// The journal's name in the store's directory.
pub const JOURNAL_FILE: &str = "verified";

/// The journal's first line, before the boot it belongs to.
const HEADER: &str = "tessera verified components v1 boot";

/// Where the kernel names the current boot.
const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The identity of a component's file when it was checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    modified_ns: i128,
    changed_ns: i128,
}

impl FileStamp {
    pub fn of(path: &Path) -> Option<FileStamp> {
        let meta = std::fs::metadata(path).ok()?;
        let ns = |secs: i64, nanos: i64| secs as i128 * 1_000_000_000 + nanos as i128;
        Some(FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            modified_ns: ns(meta.mtime(), meta.mtime_nsec()),
            changed_ns: ns(meta.ctime(), meta.ctime_nsec()),
        })
    }

    fn to_line(self, hash: &ComponentHash) -> String {
        format!(
            "+ {} {} {} {} {} {}\n",
            hash.to_hex(),
            self.dev,
            self.ino,
            self.size,
            self.modified_ns,
            self.changed_ns
        )
    }
}

/// One line of the journal.
enum Entry {
    Checked(ComponentHash, FileStamp),
    Distrusted(ComponentHash),
}

fn parse_line(line: &str) -> Option<Entry> {
    let mut fields = line.split(' ');
    let kind = fields.next()?;
    let hash = ComponentHash::from_hex(fields.next()?)?;
    let entry = match kind {
        "+" => {
            let mut number = || fields.next()?.parse::<i128>().ok();
            let (dev, ino, size) = (number()?, number()?, number()?);
            let (modified_ns, changed_ns) = (number()?, number()?);
            Entry::Checked(
                hash,
                FileStamp {
                    dev: u64::try_from(dev).ok()?,
                    ino: u64::try_from(ino).ok()?,
                    size: u64::try_from(size).ok()?,
                    modified_ns,
                    changed_ns,
                },
            )
        }
        "-" => Entry::Distrusted(hash),
        _ => return None,
    };
    fields.next().is_none().then_some(entry)
}

/// This boot's id, if the kernel says (Linux); without one nothing is journaled.
pub fn current_boot_id() -> Option<String> {
    let id = std::fs::read_to_string(BOOT_ID_PATH).ok()?;
    let id = id.trim();
    (!id.is_empty() && !id.contains(char::is_whitespace)).then(|| id.to_string())
}

struct Journal {
    path: PathBuf,
    file: File,
    header: String,
    /// Lines appended since the journal was last rewritten.
    lines: usize,
}

#[derive(Default)]
struct Inner {
    /// Checked components, with their file's identity when it is known.
    checked: HashMap<ComponentHash, Option<FileStamp>>,
    journal: Option<Journal>,
}

/// The set of components checked against their names, journaled across restarts.
#[derive(Default)]
pub struct VerifiedComponents {
    inner: Mutex<Inner>,
}

impl VerifiedComponents {
    /// The checks an earlier process of boot `boot` journaled in `store_dir` whose files in
    /// `components_dir` are unchanged since; journals this process's checks from here on.
    /// Never fails: a journal that cannot be read or written costs only checks made again.
    pub fn open(store_dir: &Path, components_dir: &Path, boot: Option<String>) -> Self {
        let Some(boot) = boot else {
            return VerifiedComponents::default();
        };
        let path = store_dir.join(JOURNAL_FILE);
        let header = format!("{HEADER} {boot}\n");
        let mut checked: HashMap<ComponentHash, Option<FileStamp>> = HashMap::new();
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Some(body) = text.strip_prefix(header.as_str()) {
                let mut journaled: HashMap<ComponentHash, FileStamp> = HashMap::new();
                for entry in body.lines().filter_map(parse_line) {
                    match entry {
                        Entry::Checked(hash, stamp) => journaled.insert(hash, stamp),
                        Entry::Distrusted(hash) => journaled.remove(&hash),
                    };
                }
                let path_of =
                    |hash: &ComponentHash| crate::component::component_path(components_dir, hash);
                checked = journaled
                    .into_iter()
                    .filter(|(hash, stamp)| FileStamp::of(&path_of(hash)) == Some(*stamp))
                    .map(|(hash, stamp)| (hash, Some(stamp)))
                    .collect();
            }
        }
        let mut inner = Inner {
            checked,
            journal: None,
        };
        match rewrite(&path, &header, &inner.checked) {
            Ok(file) => {
                inner.journal = Some(Journal {
                    path,
                    file,
                    header,
                    lines: 0,
                })
            }
            Err(error) => tracing::warn!(
                path = %path.display(),
                %error,
                "components checked now will be hashed again after a restart: their journal cannot be written"
            ),
        }
        VerifiedComponents {
            inner: Mutex::new(inner),
        }
    }

    pub fn contains(&self, hash: &ComponentHash) -> bool {
        self.lock().checked.contains_key(hash)
    }

    /// Records that `hash`'s file, with identity `stamp` (taken before its bytes were read,
    /// so a change since shows), matches its name.
    pub fn insert(&self, hash: ComponentHash, stamp: Option<FileStamp>) {
        let mut inner = self.lock();
        let journaled_before = matches!(inner.checked.insert(hash, stamp), Some(Some(_)));
        match stamp {
            Some(stamp) => inner.append(&stamp.to_line(&hash)),
            // Its file's identity is unknown now: an earlier line must not vouch for it.
            None if journaled_before => inner.append(&format!("- {}\n", hash.to_hex())),
            None => {}
        }
    }

    /// Forgets the check of `hash` (found damaged, or deleted), here and after a restart.
    pub fn remove(&self, hash: &ComponentHash) {
        let mut inner = self.lock();
        if let Some(Some(_)) = inner.checked.remove(hash) {
            inner.append(&format!("- {}\n", hash.to_hex()));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("verified components lock")
    }
}

impl Inner {
    /// Appends `line`; rewrites the journal from what is trusted now once the lines
    /// appended outnumber it (deleted components leave lines behind).
    fn append(&mut self, line: &str) {
        let Some(journal) = &mut self.journal else {
            return;
        };
        let written = journal.file.write_all(line.as_bytes());
        journal.lines += 1;
        let result = match written {
            Ok(()) if journal.lines <= 2 * self.checked.len() + 1024 => return,
            Ok(()) => rewrite(&journal.path, &journal.header, &self.checked).map(|file| {
                journal.file = file;
                journal.lines = 0;
            }),
            Err(error) => Err(error),
        };
        if let Err(error) = result {
            tracing::warn!(
                path = %journal.path.display(),
                %error,
                "components checked now will be hashed again after a restart: their journal cannot be written"
            );
            self.journal = None;
        }
    }
}

/// Writes a journal of `checked` in place of the one at `path` (a new file renamed over
/// it), open for appending.
fn rewrite(
    path: &Path,
    header: &str,
    checked: &HashMap<ComponentHash, Option<FileStamp>>,
) -> std::io::Result<File> {
    let fresh = path.with_extension("new");
    let mut text = String::from(header);
    for (hash, stamp) in checked {
        if let Some(stamp) = stamp {
            text.push_str(&stamp.to_line(hash));
        }
    }
    std::fs::write(&fresh, text)?;
    std::fs::rename(&fresh, path)?;
    OpenOptions::new().append(true).open(path)
}

#[cfg(test)]
mod tests;
