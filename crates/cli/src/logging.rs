//! The process's log, on stderr: filtered by `TESSERA_LOG` (default `warn,openraft=error`),
//! coloured only on a terminal, and without openraft's repeats. With `TESSERA_LOG_SPANS=1`
//! every span the filter lets through is logged when it closes, with the time it was busy
//! and idle: where a query's channels spent their time, in the order they ended (a
//! channel's span carries its query, stage and channel).
//!
//! openraft logs every failed try of an RPC: a leader whose follower stays down retries it
//! five times a second, and each try writes the same ERROR line ("RPCError ... Unreachable
//! node"), so a node down for an hour buried every other line of its peers' logs. A warning
//! or error from openraft that repeats one written less than [`REPEAT_WINDOW`] ago, from
//! the same place with the same fields, is dropped: the first is written at once, and then
//! one every window while the condition lasts. Tessera's own lines are never dropped.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// How long an identical openraft warning or error stays quiet after it was written.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(30);

/// Installs the process's log (see the module documentation).
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
        .unwrap_or_else(|_| "warn,openraft=error".into());
    tracing_subscriber::registry()
        .with(filter)
        .with(RepeatedLines::new(REPEAT_WINDOW))
        .with(
            tracing_subscriber::fmt::layer()
                .with_span_events(span_events())
                .with_writer(std::io::stderr)
                // Colours only on a terminal: a node's log is usually a file (`tessera up`,
                // a service manager), read with grep and pagers.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .init();
}

/// The span events the log writes: closes (with their busy and idle times) under
/// `TESSERA_LOG_SPANS=1`, none otherwise.
fn span_events() -> tracing_subscriber::fmt::format::FmtSpan {
    use tracing_subscriber::fmt::format::FmtSpan;
    match std::env::var("TESSERA_LOG_SPANS").as_deref() {
        Ok("1") | Ok("true") | Ok("close") => FmtSpan::CLOSE,
        _ => FmtSpan::NONE,
    }
}

/// Drops a warning or error of openraft's that repeats one written less than `window` ago.
pub struct RepeatedLines {
    window: Duration,
    /// When each line (its place and fields, hashed) was last written.
    written: Mutex<HashMap<u64, Instant>>,
}

/// Lines remembered before the ones older than the window are forgotten.
const REMEMBERED_LINES: usize = 1024;

impl RepeatedLines {
    pub fn new(window: Duration) -> RepeatedLines {
        RepeatedLines {
            window,
            written: Mutex::new(HashMap::new()),
        }
    }

    fn thinned(event: &Event<'_>) -> bool {
        let metadata = event.metadata();
        metadata.target().starts_with("openraft") && *metadata.level() <= Level::WARN
    }
}

impl<S: Subscriber> Layer<S> for RepeatedLines {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        if !Self::thinned(event) {
            return true;
        }
        let mut line = LineKey(std::collections::hash_map::DefaultHasher::new());
        event.metadata().callsite().hash(&mut line.0);
        event.record(&mut line);
        let key = line.0.finish();
        let now = Instant::now();
        let mut written = self.written.lock().expect("repeated lines lock");
        if written
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < self.window)
        {
            return false;
        }
        if written.len() >= REMEMBERED_LINES {
            written.retain(|_, at| now.duration_since(*at) < self.window);
        }
        written.insert(key, now);
        true
    }
}

/// Hashes an event's field names and values.
struct LineKey(std::collections::hash_map::DefaultHasher);

impl Visit for LineKey {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        field.name().hash(&mut self.0);
        format!("{value:?}").hash(&mut self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Counts the events that reach it.
    struct Count(Arc<AtomicUsize>);

    impl<S: Subscriber> Layer<S> for Count {
        fn on_event(&self, _event: &Event<'_>, _ctx: Context<'_, S>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn written(window: Duration, log: impl FnOnce()) -> usize {
        let count = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry()
            .with(RepeatedLines::new(window))
            .with(Count(count.clone()));
        tracing::subscriber::with_default(subscriber, log);
        count.load(Ordering::SeqCst)
    }

    fn unreachable(node: u64) {
        tracing::error!(target: "openraft::replication", err = %format!("Unreachable node: node {node}"), "RPCError");
    }

    #[test]
    fn an_openraft_error_repeated_within_the_window_is_written_once() {
        let lines = written(Duration::from_secs(60), || {
            for _ in 0..50 {
                unreachable(2);
            }
        });
        assert_eq!(lines, 1);
    }

    #[test]
    fn the_same_openraft_error_about_another_node_is_written_too() {
        let lines = written(Duration::from_secs(60), || {
            for _ in 0..10 {
                unreachable(2);
                unreachable(3);
            }
        });
        assert_eq!(lines, 2);
    }

    #[test]
    fn a_repeat_is_written_again_once_the_window_has_passed() {
        let lines = written(Duration::from_millis(50), || {
            unreachable(2);
            unreachable(2);
            std::thread::sleep(Duration::from_millis(80));
            unreachable(2);
        });
        assert_eq!(lines, 2);
    }

    #[test]
    fn tessera_lines_and_openraft_info_are_never_dropped() {
        let lines = written(Duration::from_secs(60), || {
            for _ in 0..5 {
                tracing::error!(target: "tessera_meta", node = 2, "a node was declared failed");
                tracing::info!(target: "openraft::core", "became leader");
            }
        });
        assert_eq!(lines, 10);
    }
}
