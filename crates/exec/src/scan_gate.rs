//! A test hook that holds scans between planning and reading, so a test can move a
//! query's partitions under it, as a slow node or a long queue would in production.
//!
//! With `TESSERA_TEST_SCAN_GATE=<path>` in a node's environment, every scan channel on
//! that node waits, before it reads anything, until the file at `<path>` exists (at most
//! [`GATE_PATIENCE`], then it goes on and says so). A scan that finds the gate closed
//! first creates `<path>.waiting`, so the test knows a query was planned and is held.
//! Without the variable nothing waits.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable naming the gate file.
pub const GATE_VAR: &str = "TESSERA_TEST_SCAN_GATE";

/// The longest a scan waits at the gate: a test that forgets to open it still ends.
pub const GATE_PATIENCE: Duration = Duration::from_secs(120);

fn gate() -> Option<&'static PathBuf> {
    static GATE: OnceLock<Option<PathBuf>> = OnceLock::new();
    GATE.get_or_init(|| std::env::var_os(GATE_VAR).map(PathBuf::from))
        .as_ref()
}

/// Waits until the gate file exists, if this process has a gate.
pub async fn pass() {
    let Some(path) = gate() else { return };
    let deadline = tokio::time::Instant::now() + GATE_PATIENCE;
    if !path.exists() {
        let mut waiting = path.clone().into_os_string();
        waiting.push(".waiting");
        if let Err(e) = std::fs::write(&waiting, b"") {
            tracing::warn!(marker = ?waiting, %e, "a scan at its test gate could not say it waits");
        }
    }
    while !path.exists() {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(gate = %path.display(), "a scan went on after waiting {GATE_PATIENCE:?} at its test gate");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
