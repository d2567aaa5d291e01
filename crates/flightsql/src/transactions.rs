//! Flight SQL transactions (`BeginTransaction` / `EndTransaction`): the one state the
//! Flight SQL port keeps between requests. A transaction is an engine session inside
//! `BEGIN`, as a PostgreSQL connection's is: its writes are buffered and published as one
//! epoch at commit; its reads see its start epoch plus its own writes. It lives on the node
//! that began it, and ends at `EndTransaction` or after [`IDLE_LIMIT`] without a request
//! (rolled back: it holds no lease, so nothing waits on it meanwhile).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_sql::Engine;
use tonic::Status;

/// A transaction no request has used for this long is rolled back.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_secs(600);
/// Transactions open at once on one node; one more is refused.
const MAX_OPEN: usize = 1024;

struct Open {
    engine: Arc<Engine>,
    last_used: Instant,
}

#[derive(Default)]
pub(crate) struct Transactions {
    open: Mutex<HashMap<Vec<u8>, Open>>,
}

impl Transactions {
    /// Keeps `engine` (already inside `BEGIN`) under a fresh id.
    pub(crate) fn begin(&self, engine: Engine) -> Result<Vec<u8>, Status> {
        let id = tessera_common::auth::random_key()[..16].to_vec();
        let mut open = self.open.lock().expect("transactions lock");
        open.retain(|_, t| t.last_used.elapsed() < IDLE_LIMIT);
        if open.len() >= MAX_OPEN {
            return Err(Status::resource_exhausted(format!(
                "{MAX_OPEN} Flight SQL transactions are open on this node; end one first"
            )));
        }
        open.insert(
            id.clone(),
            Open {
                engine: Arc::new(engine),
                last_used: Instant::now(),
            },
        );
        Ok(id)
    }

    /// The session of open transaction `id`.
    pub(crate) fn get(&self, id: &[u8]) -> Result<Arc<Engine>, Status> {
        let mut open = self.open.lock().expect("transactions lock");
        match open.get_mut(id) {
            Some(t) if t.last_used.elapsed() < IDLE_LIMIT => {
                t.last_used = Instant::now();
                Ok(t.engine.clone())
            }
            _ => {
                open.remove(id);
                Err(Self::unknown(id))
            }
        }
    }

    /// Ends transaction `id` here: the caller commits or rolls back the session.
    pub(crate) fn end(&self, id: &[u8]) -> Result<Arc<Engine>, Status> {
        let open = self.open.lock().expect("transactions lock").remove(id);
        match open {
            Some(t) if t.last_used.elapsed() < IDLE_LIMIT => Ok(t.engine),
            _ => Err(Self::unknown(id)),
        }
    }

    fn unknown(id: &[u8]) -> Status {
        Status::not_found(format!(
            "transaction {} is not open on this node: it ended, was idle for over {} s and was rolled back, or began on another node",
            tessera_common::hex::to_hex(id),
            IDLE_LIMIT.as_secs()
        ))
    }
}
