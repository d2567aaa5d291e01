//! What this node's engines are running and have just run, for the console: every
//! statement registers when it starts and moves to the recent list when it ends (finished,
//! failed, or dropped by a cancelled client). A node is a process, so the list is the
//! process's.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Statements kept after they end.
const RECENT_KEPT: usize = 50;
/// SQL text kept per statement.
const SQL_KEPT: usize = 2000;

/// One statement, running or ended.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StatementActivity {
    pub id: u64,
    pub sql: String,
    /// Milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// How long it ran (so far, while running).
    pub elapsed_ms: u64,
    /// `running`, `ok`, `failed` or `cancelled`.
    pub state: String,
    /// Why it failed, once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// How it survived the loss of a node, one line per recovery (what a PostgreSQL client
    /// receives as a NOTICE).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recoveries: Vec<String>,
}

struct Running {
    sql: String,
    started_ms: u64,
    started: Instant,
    recoveries: Vec<String>,
}

#[derive(Default)]
struct Activity {
    running: BTreeMap<u64, Running>,
    recent: VecDeque<StatementActivity>,
}

static ACTIVITY: LazyLock<Mutex<Activity>> = LazyLock::new(Mutex::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Running statements (oldest first) and recent ones (newest first).
pub fn snapshot() -> (Vec<StatementActivity>, Vec<StatementActivity>) {
    let activity = ACTIVITY.lock().expect("activity lock");
    let running = activity
        .running
        .iter()
        .map(|(&id, r)| StatementActivity {
            id,
            sql: r.sql.clone(),
            started_ms: r.started_ms,
            elapsed_ms: r.started.elapsed().as_millis() as u64,
            state: "running".into(),
            error: None,
            recoveries: r.recoveries.clone(),
        })
        .collect();
    (running, activity.recent.iter().cloned().collect())
}

/// A statement under way; dropping it without [`Tracked::end`] records it cancelled.
pub(crate) struct Tracked {
    id: u64,
    ended: bool,
}

impl Tracked {
    pub(crate) fn start(sql: String) -> Tracked {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut sql = sql;
        if sql.len() > SQL_KEPT {
            let cut = (0..=SQL_KEPT)
                .rev()
                .find(|&i| sql.is_char_boundary(i))
                .unwrap_or(0);
            sql.truncate(cut);
            sql.push('…');
        }
        let started_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        ACTIVITY.lock().expect("activity lock").running.insert(
            id,
            Running {
                sql,
                started_ms,
                started: Instant::now(),
                recoveries: Vec::new(),
            },
        );
        Tracked { id, ended: false }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn end(mut self, error: Option<String>) {
        self.ended = true;
        let state = if error.is_some() { "failed" } else { "ok" };
        finish(self.id, state, error);
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if !self.ended {
            finish(self.id, "cancelled", None);
        }
    }
}

fn finish(id: u64, state: &str, error: Option<String>) {
    let mut activity = ACTIVITY.lock().expect("activity lock");
    let Some(running) = activity.running.remove(&id) else {
        return;
    };
    activity.recent.push_front(StatementActivity {
        id,
        sql: running.sql,
        started_ms: running.started_ms,
        elapsed_ms: running.started.elapsed().as_millis() as u64,
        state: state.into(),
        error,
        recoveries: running.recoveries,
    });
    activity.recent.truncate(RECENT_KEPT);
}

/// Records that the statement the current task works for (see
/// [`tessera_common::statement`]) survived the loss of a node, as `recoveries` say.
pub fn note_recoveries(recoveries: impl IntoIterator<Item = String>) {
    if let Some(id) = tessera_common::statement::current() {
        note_recoveries_of(id, recoveries);
    }
}

/// Records that statement `id` survived the loss of a node, as `recoveries` say.
pub fn note_recoveries_of(id: u64, recoveries: impl IntoIterator<Item = String>) {
    if let Some(running) = ACTIVITY.lock().expect("activity lock").running.get_mut(&id) {
        running.recoveries.extend(recoveries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_move_from_running_to_recent_however_they_end() {
        let ok = Tracked::start("SELECT 1 -- activity test ok".into());
        let failed = Tracked::start("SELECT 2 -- activity test failed".into());
        let dropped = Tracked::start("SELECT 3 -- activity test dropped".into());
        let (running, _) = snapshot();
        assert!(running.iter().any(|s| s.sql.contains("activity test ok")));
        let recovered = |id| async move {
            tessera_common::statement::within(id, async {
                note_recoveries(["node 3 died; rebuilt".to_string()])
            })
            .await
        };
        futures::executor::block_on(recovered(ok.id()));
        ok.end(None);
        failed.end(Some("no".into()));
        drop(dropped);
        let (running, recent) = snapshot();
        assert!(!running.iter().any(|s| s.sql.contains("activity test")));
        let state = |tag: &str| {
            recent
                .iter()
                .find(|s| s.sql.contains(tag))
                .map(|s| s.state.clone())
        };
        assert_eq!(state("activity test ok").as_deref(), Some("ok"));
        let ok = recent
            .iter()
            .find(|s| s.sql.contains("activity test ok"))
            .unwrap();
        assert_eq!(
            ok.recoveries,
            ["node 3 died; rebuilt"],
            "its recovery stays with it"
        );
        assert_eq!(state("activity test failed").as_deref(), Some("failed"));
        assert_eq!(state("activity test dropped").as_deref(), Some("cancelled"));
    }
}
