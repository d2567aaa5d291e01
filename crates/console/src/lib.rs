//! The node's HTTP port (`http_listen`): the web console at `/`, its JSON at `/api/status`
//! and `/api/sql`, and Prometheus metrics at `/metrics`. The node supplies what the pages
//! show through [`NodeView`], so this crate knows HTTP and nothing of Raft or replication.
//! The page is one file compiled into the binary (`console.html`): no build step, nothing
//! fetched from the internet.

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::sync::Arc;
use tessera_common::auth::{basic_credentials, ScramSecret, VerifiedPasswords};
use tessera_common::tls::TlsAcceptor;
use tokio::net::TcpListener;

/// The largest SQL text the console's SQL box may send.
const MAX_SQL_BODY: usize = 1 << 20;

/// What a node tells its HTTP port.
#[async_trait::async_trait]
pub trait NodeView: Send + Sync + 'static {
    /// Sets the gauges that describe the node's state (Raft, epochs, replicas) just before
    /// a scrape; counters and histograms move by themselves as work happens.
    fn refresh_metrics(&self);

    /// The cluster as this node sees it, and the statements it runs and ran, as JSON.
    fn status(&self) -> serde_json::Value;

    /// Runs `sql` for the console's SQL box, as `user` (who logged in; `None` on a cluster
    /// without users): each statement's rows or tag, as JSON, or the error, said once.
    async fn sql(&self, sql: String, user: Option<String>) -> Result<serde_json::Value, String>;

    /// Whether the cluster has users, so that the console asks for a login.
    fn login_required(&self) -> bool;

    /// The SCRAM secret of user `name`, if it exists.
    fn user_secret(&self, name: &str) -> Option<ScramSecret>;
}

/// The routes, over `node`. Once the cluster has users, the console and its JSON ask for
/// one (HTTP basic authentication, which a browser prompts for); `/metrics` does not, as
/// Prometheus scrapes it and it holds counts, not data.
pub fn router(node: Arc<dyn NodeView>) -> Router {
    let console = Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/sql", post(sql))
        .layer(DefaultBodyLimit::max(MAX_SQL_BODY))
        .route_layer(middleware::from_fn_with_state(node.clone(), require_login));
    Router::new()
        .route("/metrics", get(metrics))
        .merge(console)
        .with_state(node)
}

/// Lets a request through if the cluster has no users or it carries a user's password.
/// The user a console request logged in as.
#[derive(Clone)]
struct LoggedIn(String);

async fn require_login(
    State(node): State<Arc<dyn NodeView>>,
    mut request: Request,
    next: Next,
) -> Response {
    if !node.login_required() {
        return next.run(request).await;
    }
    let credentials = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(basic_credentials);
    if let Some((user, password)) = credentials {
        static VERIFIED: std::sync::LazyLock<VerifiedPasswords> =
            std::sync::LazyLock::new(VerifiedPasswords::new);
        if VERIFIED.check(node.user_secret(&user).as_ref(), &user, &password) {
            request.extensions_mut().insert(LoggedIn(user));
            return next.run(request).await;
        }
    }
    (
        StatusCode::UNAUTHORIZED,
        [(
            header::WWW_AUTHENTICATE,
            "Basic realm=\"Tessera\", charset=\"UTF-8\"",
        )],
        "log in with a Tessera user and password\n",
    )
        .into_response()
}

/// Serves HTTP on `listener` until the task is dropped; HTTPS only, with `tls` (the
/// node's certificate, as on its PostgreSQL and Flight SQL ports), so the basic-auth
/// passwords the console asks for never cross the network in the clear.
pub async fn serve(listener: TcpListener, node: Arc<dyn NodeView>, tls: Option<TlsAcceptor>) {
    let served = match tls {
        None => axum::serve(listener, router(node)).await,
        Some(acceptor) => {
            axum::serve(
                TlsListener {
                    tcp: listener,
                    acceptor,
                },
                router(node),
            )
            .await
        }
    };
    if let Err(error) = served {
        tracing::error!(%error, "the HTTP port stopped");
    }
}

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Accepts TCP connections and completes their TLS handshakes; a connection whose
/// handshake fails (plain HTTP on the HTTPS port, a client that rejects the certificate)
/// is closed and logged, and the port goes on.
struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, peer) = match self.tcp.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!(%error, "accepting an HTTPS connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(stream)).await {
                Ok(Ok(tls)) => return (tls, peer),
                Ok(Err(error)) => tracing::debug!(%peer, %error, "a TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "a TLS handshake timed out"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

async fn page() -> Html<&'static str> {
    Html(include_str!("console.html"))
}

async fn status(State(node): State<Arc<dyn NodeView>>) -> Json<serde_json::Value> {
    Json(node.status())
}

/// The SQL box: the body is the SQL text.
async fn sql(
    State(node): State<Arc<dyn NodeView>>,
    user: Option<axum::Extension<LoggedIn>>,
    body: String,
) -> Response {
    let user = user.map(|axum::Extension(LoggedIn(name))| name);
    match node.sql(body, user).await {
        Ok(results) => Json(results).into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({ "error": error })),
        )
            .into_response(),
    }
}

/// The node's registry in the OpenMetrics text format, which Prometheus scrapes.
async fn metrics(State(node): State<Arc<dyn NodeView>>) -> impl IntoResponse {
    node.refresh_metrics();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        tessera_common::metrics::metrics().encode(),
    )
}
