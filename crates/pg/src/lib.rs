//! The PostgreSQL wire protocol in front of Tessera's SQL engine (DESIGN.md section 1:
//! `psql -h localhost -p 5433` on every node).
//!
//! Each connection gets its own [`tessera_sql::Engine`] from a [`Sessions`] source (a
//! node hands out engines over the cluster, so queries run distributed, with time travel
//! and the recovery settings, exactly as through Tessera's own client), which makes
//! `SET`, `SHOW` and transactions per connection. The protocol itself is `pgwire`:
//!
//! - `session.rs`: the simple and extended query protocols (Parse/Bind/Describe/Execute,
//!   typed parameters, portals with row limits), transactions, notices;
//! - `results.rs`: rows and command tags as PostgreSQL sends them;
//! - `copy.rs`: `COPY ... FROM STDIN` (a publish) and `COPY ... TO STDOUT`, in text and
//!   CSV;
//! - `errors.rs`: every error with its SQLSTATE.
//!
//! `psql`'s meta-commands (`\dt`, `\d t`, `\l`) and drivers' start-up queries read
//! `pg_catalog`, which `datafusion-pg-catalog` supplies over the engine's catalog.

mod auth;
mod copy;
mod errors;
mod execute;
mod respond;
mod results;
mod session;
mod tls;

use pgwire::api::cancel::DefaultCancelHandler;
use pgwire::api::{ConnectionManager, PgWireServerHandlers};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub use session::PgSession;
pub use tls::tls_acceptor;

pub use tessera_sql::Sessions;

/// Limits of one PostgreSQL endpoint.
#[derive(Clone)]
pub struct PgLimits {
    /// Connections served at once; one more is told so (SQLSTATE 53300) and closed.
    pub max_connections: usize,
    /// TLS for the clients that ask for it (see [`tls_acceptor`]).
    pub tls: Option<pgwire::tokio::TlsAcceptor>,
}

impl Default for PgLimits {
    fn default() -> Self {
        PgLimits {
            max_connections: 256,
            tls: None,
        }
    }
}

/// Serves PostgreSQL clients on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, sessions: Arc<dyn Sessions>, limits: PgLimits) {
    let connections = Arc::new(ConnectionManager::new());
    let pids = Arc::new(pgwire::api::RandomPidSecretKeyGenerator::default());
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: wait, rather than spin.
                tracing::warn!(%error, "accepting a PostgreSQL connection failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = socket.set_nodelay(true);
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tokio::spawn(errors::refuse_connection(socket, limits.max_connections));
            continue;
        };
        let session = Arc::new(PgSession::new(sessions.open()));
        let handlers = Connection {
            startup: Arc::new(auth::Startup {
                connections: connections.clone(),
                sessions: sessions.clone(),
                pids: pids.clone(),
                state: Default::default(),
                engine: session.engine(),
            }),
            session,
            cancel: Arc::new(DefaultCancelHandler::new(connections.clone())),
        };
        let tls = limits.tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let open = &tessera_common::metrics::metrics().pg_connections;
            open.inc();
            if let Err(error) = pgwire::tokio::process_socket(socket, tls, handlers).await {
                tracing::debug!(%peer, %error, "PostgreSQL connection ended with an error");
            }
            open.dec();
        });
    }
}

/// One connection's handlers: its session (engine, prepared statements), start-up and
/// cancel handling shared with the endpoint.
struct Connection {
    session: Arc<PgSession>,
    startup: Arc<auth::Startup>,
    cancel: Arc<DefaultCancelHandler>,
}

impl PgWireServerHandlers for Connection {
    fn simple_query_handler(&self) -> Arc<impl pgwire::api::query::SimpleQueryHandler> {
        self.session.clone()
    }

    fn extended_query_handler(&self) -> Arc<impl pgwire::api::query::ExtendedQueryHandler> {
        self.session.clone()
    }

    fn copy_handler(&self) -> Arc<impl pgwire::api::copy::CopyHandler> {
        self.session.clone()
    }

    fn startup_handler(&self) -> Arc<impl pgwire::api::auth::StartupHandler> {
        self.startup.clone()
    }

    fn cancel_handler(&self) -> Arc<impl pgwire::api::cancel::CancelHandler> {
        self.cancel.clone()
    }
}
