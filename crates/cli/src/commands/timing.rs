//! Timing and polling helpers shared by the commands that drive a cluster and report how
//! long things took (the demo, the benchmarks).

use anyhow::Result;
use std::future::Future;
use std::time::{Duration, Instant};

/// The lower quartile, the median and the upper quartile of `values` (not empty).
pub fn quartiles<T: PartialOrd + Copy>(mut values: Vec<T>) -> (T, T, T) {
    values.sort_by(|a, b| a.partial_cmp(b).expect("comparable values"));
    let n = values.len();
    (values[n / 4], values[n / 2], values[(3 * n) / 4])
}

/// The median of `values` (not empty; of an even count, the upper of the middle two).
pub fn median_of<T: PartialOrd + Copy>(values: &[T]) -> T {
    quartiles(values.to_vec()).1
}

/// Runs `work`, returning how long it took with its value.
pub async fn timed<F, Fut, T, E>(work: F) -> Result<(Duration, T)>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = std::result::Result<T, E>>,
    E: Into<anyhow::Error>,
{
    let started = Instant::now();
    let value = work().await.map_err(Into::into)?;
    Ok((started.elapsed(), value))
}

/// Polls `check` every 5 ms until it holds; the moment it first held, or an error naming
/// `what` at `timeout`.
pub async fn poll_until<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<Instant>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Instant::now())
}

/// CPU time (user + system) the processes `pids` have used so far, from `/proc/<pid>/stat`;
/// a process that has gone counts nothing.
fn cpu_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // The command name (field 2) is parenthesised and may hold spaces: the fields
            // counted from the last ')' are fixed. utime and stime are fields 14 and 15.
            let after_name = &stat[stat.rfind(')')? + 1..];
            let fields: Vec<&str> = after_name.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            Some(utime + stime)
        })
        .sum()
}

/// CPU seconds (user + system) the processes `pids` have used so far.
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    cpu_ticks(pids) as f64 / ticks_per_second()
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions; it reads a constant of the running kernel.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// Waits until the processes `pids` are quiet (together under a tenth of one core over
/// half a second), so that the background work one measurement leaves behind (checkpoints,
/// flushes, merges) is not charged to the next. Gives up at `timeout` and says whether
/// they went quiet: a benchmark goes on either way, and prints how often they did not.
pub async fn wait_quiet(pids: &[u32], timeout: Duration) -> bool {
    const WINDOW: Duration = Duration::from_millis(500);
    let quiet_ticks = ticks_per_second() * WINDOW.as_secs_f64() * 0.1;
    let deadline = Instant::now() + timeout;
    let mut before = cpu_ticks(pids);
    while Instant::now() < deadline {
        tokio::time::sleep(WINDOW).await;
        let now = cpu_ticks(pids);
        if (now.saturating_sub(before) as f64) <= quiet_ticks {
            return true;
        }
        before = now;
    }
    false
}
