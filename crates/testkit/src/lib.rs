//! Test harness: run the real `tessera` binary as child processes, kill them with SIGKILL,
//! and always stop what was started (by pid, also when a test panics).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

/// A running `tessera` process, killed by pid when dropped.
pub struct TesseraProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl TesseraProcess {
    /// Starts `binary` with `--data-dir data_dir` and `args`, capturing stdout line by line.
    pub fn spawn(binary: &Path, data_dir: &Path, args: &[&str]) -> TesseraProcess {
        let mut child = Command::new(binary)
            .arg("--data-dir")
            .arg(data_dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {}: {e}", binary.display()));
        let stdout: ChildStdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        TesseraProcess { child, lines }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the next line of output; `None` on timeout or exit.
    pub fn next_line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// Every line printed so far and not yet read.
    pub fn drain_lines(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill9(&mut self) {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

impl Drop for TesseraProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill9();
        }
    }
}

/// Runs `tessera --data-dir data_dir args...` to completion.
pub fn run(binary: &Path, data_dir: &Path, args: &[&str]) -> Output {
    Command::new(binary)
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", binary.display()))
}

/// Runs SQL through `tessera sql -c ... --format csv` and returns the CSV rows without the
/// header; panics with stderr if the command fails.
pub fn sql_csv(binary: &Path, data_dir: &Path, extra: &[&str], sql: &str) -> Vec<Vec<String>> {
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["sql", "--format", "csv", "-c", sql]);
    let output = run(binary, data_dir, &args);
    assert!(
        output.status.success(),
        "`{sql}` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_string).collect())
        .collect()
}

/// A fresh temporary directory for one test's data.
pub fn temp_data_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let data = dir.path().join("data");
    (dir, data)
}
