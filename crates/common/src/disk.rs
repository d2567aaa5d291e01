//! The file layer under the storage engine and the metadata log: every durable write,
//! fsync and data read of the write-ahead log, components, checkpoints and the Raft log goes
//! through here, so that tests can make the disk misbehave the way real disks do.
//!
//! Faults are read once, at the first I/O, from the `TESSERA_DISK_FAULTS` environment
//! variable: rules separated by `;`, each `kind:path-part[:key=value...]`, applying to
//! files whose path contains `path-part`:
//!
//! - `fsync-fails:wal:after=20`: the 21st and later fsyncs of matching files fail with
//!   EIO (the kernel may have dropped the dirty pages: the write is not on disk, and a
//!   retried fsync would lie);
//! - `fsync-stalls:wal:after=20`: the 21st fsync of a matching file never returns (a
//!   disk that stopped answering); see [`stalled_sync`];
//! - `fsync-slow:wal:ms=300`: every fsync of a matching file takes 300 ms more (a slow or
//!   overloaded disk);
//! - `read-eio:components`: reads of matching files fail with EIO;
//! - `crash:wal:after=40`: the 41st write to a matching file writes all but its last byte,
//!   then the process dies (a torn write: the write's last frame is cut);
//! - `crash:wal:after=40:lose-unsynced`: as `crash`, and first every matching file is cut
//!   back to what its last fsync made durable (a power cut loses the page cache).
//!
//! With no rules every call is the plain `std` operation. An fsync failure anywhere is
//! recorded ([`fatal_error`]): after one, nothing written since the last good fsync can be
//! trusted, so the node stops (fsyncgate).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// The environment variable holding the fault rules.
pub const FAULTS_VAR: &str = "TESSERA_DISK_FAULTS";

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    FsyncFails,
    /// The fsync never returns: a disk that stopped answering.
    FsyncStalls,
    /// The fsync takes this much longer: a slow disk.
    FsyncSlow(std::time::Duration),
    ReadEio,
    Crash {
        lose_unsynced: bool,
    },
}

#[derive(Debug)]
struct Rule {
    kind: Kind,
    path_part: String,
    /// The rule fires once this many matching operations have passed.
    after: u64,
    seen: AtomicU64,
}

impl Rule {
    fn matches(&self, path: &Path) -> bool {
        path.to_string_lossy().contains(&self.path_part)
    }

    /// Counts one matching operation; true once the rule fires.
    fn fires(&self) -> bool {
        self.seen.fetch_add(1, Ordering::SeqCst) >= self.after
    }
}

/// Parses fault rules (see the module docs).
fn parse(text: &str) -> Result<Vec<Rule>, String> {
    let mut rules = Vec::new();
    for spec in text.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let mut parts = spec.split(':');
        let kind = parts.next().unwrap_or_default();
        let path_part = parts
            .next()
            .filter(|p| !p.is_empty())
            .ok_or_else(|| format!("disk fault {spec:?} names no path part (kind:path[:after=N])"))?
            .to_string();
        let mut after = 0;
        let mut lose_unsynced = false;
        let mut slow_ms = None;
        for option in parts {
            match option.split_once('=') {
                Some(("after", n)) => {
                    after = n
                        .parse()
                        .map_err(|_| format!("disk fault {spec:?}: after={n} is not a count"))?
                }
                Some(("ms", n)) => {
                    slow_ms = Some(n.parse().map_err(|_| {
                        format!("disk fault {spec:?}: ms={n} is not a number of milliseconds")
                    })?)
                }
                None if option == "lose-unsynced" => lose_unsynced = true,
                _ => return Err(format!("disk fault {spec:?}: unknown option {option:?}")),
            }
        }
        let kind = match kind {
            "fsync-fails" => Kind::FsyncFails,
            "fsync-stalls" => Kind::FsyncStalls,
            "fsync-slow" => Kind::FsyncSlow(std::time::Duration::from_millis(slow_ms.ok_or_else(
                || format!("disk fault {spec:?} says how much slower with ms=N"),
            )?)),
            "read-eio" => Kind::ReadEio,
            "crash" => Kind::Crash { lose_unsynced },
            other => {
                return Err(format!(
                    "unknown disk fault {other:?} (fsync-fails, fsync-stalls, fsync-slow, read-eio or crash)"
                ))
            }
        };
        rules.push(Rule {
            kind,
            path_part,
            after,
            seen: AtomicU64::new(0),
        });
    }
    Ok(rules)
}

struct Faults {
    rules: Vec<Rule>,
    /// Per file written under a `lose-unsynced` rule: its length at its last good fsync.
    synced_len: Mutex<HashMap<PathBuf, u64>>,
    fatal: Mutex<Option<String>>,
}

fn faults() -> &'static Faults {
    static FAULTS: OnceLock<Faults> = OnceLock::new();
    FAULTS.get_or_init(|| {
        let rules = match std::env::var(FAULTS_VAR) {
            Ok(text) => parse(&text).unwrap_or_else(|e| panic!("{FAULTS_VAR}: {e}")),
            Err(_) => Vec::new(),
        };
        if !rules.is_empty() {
            tracing::warn!(?rules, "disk faults injected");
        }
        Faults {
            rules,
            synced_len: Mutex::new(HashMap::new()),
            fatal: Mutex::new(None),
        }
    })
}

fn rule_firing(path: &Path, wanted: impl Fn(&Kind) -> bool) -> Option<&'static Rule> {
    faults()
        .rules
        .iter()
        .find(|rule| wanted(&rule.kind) && rule.matches(path) && rule.fires())
}

fn injected(what: &str, path: &Path) -> io::Error {
    io::Error::other(format!("injected disk fault: {what} of {}", path.display()))
}

/// The first fsync failure this process met, if any: after it the node must not
/// acknowledge anything more (see the module docs).
pub fn fatal_error() -> Option<String> {
    faults().fatal.lock().expect("fatal lock").clone()
}

fn record_fatal(error: &io::Error, path: &Path) {
    faults()
        .fatal
        .lock()
        .expect("fatal lock")
        .get_or_insert_with(|| format!("fsync of {} failed: {error}", path.display()));
}

/// `file.write_all(bytes)`; under a `crash` rule that fires, a torn write and death.
pub fn write_all(file: &mut File, path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_all_parts(file, path, &[bytes])
}

/// [`write_all`] of `parts` one after another, as one write: a `crash` rule tears it once,
/// in its last part.
pub fn write_all_parts<B: AsRef<[u8]>>(
    file: &mut File,
    path: &Path,
    parts: &[B],
) -> io::Result<()> {
    if let Some(rule) = rule_firing(path, |k| matches!(k, Kind::Crash { .. })) {
        if rule.kind
            == (Kind::Crash {
                lose_unsynced: true,
            })
        {
            lose_unsynced(rule);
        }
        // All but the last byte: a write holds whole frames, so its last frame is always
        // torn (half the bytes could end exactly between two frames, tearing nothing).
        let total: usize = parts.iter().map(|p| p.as_ref().len()).sum();
        let mut left = total.saturating_sub(1);
        for part in parts {
            let part = part.as_ref();
            let _ = file.write_all(&part[..part.len().min(left)]);
            left -= part.len().min(left);
        }
        eprintln!(
            "injected disk fault: crash in the middle of a {total}-byte write to {}",
            path.display()
        );
        std::process::abort();
    }
    for part in parts {
        file.write_all(part.as_ref())?;
    }
    Ok(())
}

/// Cuts every file a `lose-unsynced` rule covers back to its last synced length.
fn lose_unsynced(rule: &Rule) {
    let synced = faults().synced_len.lock().expect("synced lock");
    for (path, len) in synced.iter().filter(|(p, _)| rule.matches(p)) {
        if let Ok(file) = std::fs::OpenOptions::new().write(true).open(path) {
            let _ = file.set_len(*len);
        }
    }
}

fn synced(file: &File, path: &Path, result: io::Result<()>) -> io::Result<()> {
    match &result {
        Ok(()) => {
            let tracked = faults().rules.iter().any(|r| {
                r.kind
                    == (Kind::Crash {
                        lose_unsynced: true,
                    })
                    && r.matches(path)
            });
            if tracked {
                if let Ok(metadata) = file.metadata() {
                    faults()
                        .synced_len
                        .lock()
                        .expect("synced lock")
                        .insert(path.to_path_buf(), metadata.len());
                }
            }
        }
        Err(error) => record_fatal(error, path),
    }
    result
}

/// `file.sync_all()`, or an injected EIO or stall.
pub fn sync_all(file: &File, path: &Path) -> io::Result<()> {
    fsync(file, path, File::sync_all)
}

/// `file.sync_data()`, or an injected EIO or stall.
pub fn sync_data(file: &File, path: &Path) -> io::Result<()> {
    fsync(file, path, File::sync_data)
}

fn fsync(file: &File, path: &Path, sync: fn(&File) -> io::Result<()>) -> io::Result<()> {
    let _in_flight = SyncInFlight::start(path);
    if rule_firing(path, |k| *k == Kind::FsyncStalls).is_some() {
        eprintln!("injected disk fault: an fsync of {} stalls", path.display());
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
    if let Some(Rule {
        kind: Kind::FsyncSlow(delay),
        ..
    }) = rule_firing(path, |k| matches!(k, Kind::FsyncSlow(_)))
    {
        // In steps, so that a process frozen in the middle of a slow fsync still has some
        // of it left to wait when it resumes, as with a deep device queue.
        let step = std::time::Duration::from_millis(10);
        for _ in 0..delay.as_millis().div_ceil(step.as_millis()) {
            std::thread::sleep(step);
        }
    }
    let result = match rule_firing(path, |k| *k == Kind::FsyncFails) {
        Some(_) => Err(injected("fsync", path)),
        None => sync(file),
    };
    synced(file, path, result)
}

/// The fsyncs running now, by a sequence number (so the first is the oldest): when each
/// started, and its file.
static SYNCS_IN_FLIGHT: Mutex<std::collections::BTreeMap<u64, (std::time::Instant, PathBuf)>> =
    Mutex::new(std::collections::BTreeMap::new());
static NEXT_SYNC: AtomicU64 = AtomicU64::new(0);

/// One fsync in [`SYNCS_IN_FLIGHT`] while it runs.
struct SyncInFlight(u64);

impl SyncInFlight {
    fn start(path: &Path) -> SyncInFlight {
        let id = NEXT_SYNC.fetch_add(1, Ordering::Relaxed);
        SYNCS_IN_FLIGHT
            .lock()
            .expect("syncs in flight lock")
            .insert(id, (std::time::Instant::now(), path.to_path_buf()));
        SyncInFlight(id)
    }
}

impl Drop for SyncInFlight {
    fn drop(&mut self) {
        SYNCS_IN_FLIGHT
            .lock()
            .expect("syncs in flight lock")
            .remove(&self.0);
    }
}

/// Why the disk counts as stalled, if an fsync has been running longer than `limit`.
///
/// A disk that stops answering does not fail its fsyncs: they hang, and with them every
/// write waiting on the log, while the process still answers heartbeats, so the cluster
/// never fails the node over and every publish it is a replica of waits. A node checks
/// this and stops itself instead (`failure.disk_stall_ms`).
pub fn stalled_sync(limit: std::time::Duration) -> Option<String> {
    let (running, path) = oldest_sync_in_flight()?;
    (running > limit).then(|| {
        format!(
            "an fsync of {} has not returned after {:.1} s (failure.disk_stall_ms = {}): the disk stalled",
            path.display(),
            running.as_secs_f64(),
            limit.as_millis()
        )
    })
}

/// The fsync of this process that has been running longest now, if any: for how long, and
/// its file. A metadata leader steps down when it is long (`tessera_meta::quorum_check`).
pub fn oldest_sync_in_flight() -> Option<(std::time::Duration, PathBuf)> {
    let in_flight = SYNCS_IN_FLIGHT.lock().expect("syncs in flight lock");
    let (_, (started, path)) = in_flight.first_key_value()?;
    Some((started.elapsed(), path.clone()))
}

/// Restarts the clock of every fsync in flight: the process itself was just frozen (a
/// SIGSTOP, a paused VM, a stop-the-world stall) for so long that the time its fsyncs
/// were seen running says nothing of the disk. The watcher that calls [`stalled_sync`]
/// calls this when its own ticks were held back; without it, a node resumed after a pause
/// longer than `failure.disk_stall_ms` took any fsync it was in for a stalled disk and
/// stopped itself.
pub fn credit_frozen_time() {
    let now = std::time::Instant::now();
    for (started, _) in SYNCS_IN_FLIGHT
        .lock()
        .expect("syncs in flight lock")
        .values_mut()
    {
        *started = now;
    }
}

/// Fsyncs a directory (after creating, renaming or removing a file in it).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    let handle = File::open(dir)?;
    sync_all(&handle, dir)
}

/// `std::fs::read`, or an injected EIO.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    check_read(path)?;
    std::fs::read(path)
}

/// `File::open` for reading, or an injected EIO.
pub fn open(path: &Path) -> io::Result<File> {
    check_read(path)?;
    File::open(path)
}

fn check_read(path: &Path) -> io::Result<()> {
    match rule_firing(path, |k| *k == Kind::ReadEio) {
        Some(_) => Err(injected("read", path)),
        None => Ok(()),
    }
}

/// Writes `bytes` to `path` so that after a crash the file holds either its old content or
/// all of `bytes`: write a temporary file, fsync it, rename it over, fsync the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let _turn = writing(path);
    let tmp = path.with_extension("tmp");
    {
        let mut file = File::create(&tmp)?;
        write_all(&mut file, &tmp, bytes)?;
        sync_all(&file, &tmp)?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Takes this process's turn at writing `path` through a temporary file beside it; held
/// until the file is in place. Two writers of one path at once (the same component kept
/// by a rebalance's prefetch and installed by the copy that follows it) would share the
/// temporary file: one truncates what the other wrote, renames a torn file into place,
/// and the other's rename finds nothing (`ENOENT`), which poisoned the store of a node
/// being refilled after a wiped disk. Paths are striped over a few locks, so writers of
/// different files seldom wait on each other.
pub fn writing(path: &Path) -> std::sync::MutexGuard<'static, ()> {
    use std::hash::{Hash, Hasher};
    const STRIPES: usize = 64;
    static TURNS: [Mutex<()>; STRIPES] = [const { Mutex::new(()) }; STRIPES];
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    path.hash(&mut hasher);
    TURNS[(hasher.finish() % STRIPES as u64) as usize]
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_bad_ones_are_named() {
        let rules =
            parse("fsync-fails:wal:after=3; read-eio:components;crash:raft:after=2:lose-unsynced")
                .unwrap();
        assert_eq!(rules.len(), 3);
        assert_eq!(rules[0].kind, Kind::FsyncFails);
        assert_eq!(rules[0].after, 3);
        assert_eq!(rules[1].kind, Kind::ReadEio);
        assert_eq!(
            rules[2].kind,
            Kind::Crash {
                lose_unsynced: true
            }
        );
        for (bad, named) in [
            ("explode:wal", "unknown disk fault \"explode\""),
            ("fsync-fails", "names no path part"),
            ("fsync-fails:wal:after=x", "after=x is not a count"),
            ("crash:wal:sometimes", "unknown option \"sometimes\""),
        ] {
            let error = parse(bad).unwrap_err();
            assert!(error.contains(named), "{bad}: {error}");
        }
    }

    /// The fsyncs in flight are one per process: tests that start or credit them take turns.
    static SYNCS_IN_FLIGHT_TESTS: Mutex<()> = Mutex::new(());

    #[test]
    fn an_fsync_running_past_the_limit_is_a_stalled_disk() {
        let _turn = SYNCS_IN_FLIGHT_TESTS
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let limit = std::time::Duration::from_millis(50);
        assert_eq!(stalled_sync(limit), None);
        let slow = SyncInFlight::start(Path::new("/data/wal/7.wal"));
        assert_eq!(stalled_sync(limit), None, "not yet past the limit");
        std::thread::sleep(limit * 2);
        let stalled = stalled_sync(limit).expect("past the limit");
        assert!(stalled.contains("/data/wal/7.wal"), "{stalled}");
        drop(slow);
        assert_eq!(stalled_sync(limit), None, "it returned");
    }

    #[test]
    fn time_the_process_was_frozen_is_not_counted_against_the_disk() {
        let _turn = SYNCS_IN_FLIGHT_TESTS
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let limit = std::time::Duration::from_millis(50);
        let _slow = SyncInFlight::start(Path::new("/data/wal/8.wal"));
        std::thread::sleep(limit * 2);
        assert!(stalled_sync(limit).is_some(), "past the limit");
        // The watcher noticed it had been frozen meanwhile: the clock starts again.
        credit_frozen_time();
        assert_eq!(stalled_sync(limit), None);
        std::thread::sleep(limit * 2);
        assert!(
            stalled_sync(limit).is_some(),
            "still hanging after the credit"
        );
    }

    #[test]
    fn a_rule_fires_after_its_count_and_only_for_its_paths() {
        let rules = parse("fsync-fails:wal:after=2").unwrap();
        let rule = &rules[0];
        assert!(rule.matches(Path::new("/data/wal/1.wal")));
        assert!(!rule.matches(Path::new("/data/components/x.parquet")));
        assert!(!rule.fires());
        assert!(!rule.fires());
        assert!(rule.fires(), "the third matching operation fails");
        assert!(rule.fires(), "and every later one");
    }
}
