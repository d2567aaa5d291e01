//! Timing and polling helpers shared by the commands that drive a cluster and report how
//! long things took (the demo, the benchmarks).

use anyhow::Result;
use std::future::Future;
use std::time::{Duration, Instant};

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
