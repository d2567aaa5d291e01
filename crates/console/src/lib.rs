//! The node's HTTP port (`http_listen`): the web console at `/`, its JSON at `/api/status`
//! and `/api/sql`, and Prometheus metrics at `/metrics`. The node supplies what the pages
//! show through [`NodeView`], so this crate knows HTTP and nothing of Raft or replication.
//! The page is one file compiled into the binary (`console.html`): no build step, nothing
//! fetched from the internet.

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::sync::Arc;
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

    /// Runs `sql` for the console's SQL box: each statement's rows or tag, as JSON, or
    /// the error, said once.
    async fn sql(&self, sql: String) -> Result<serde_json::Value, String>;
}

/// The routes, over `node`.
pub fn router(node: Arc<dyn NodeView>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/sql", post(sql))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_SQL_BODY))
        .with_state(node)
}

/// Serves HTTP on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, node: Arc<dyn NodeView>) {
    if let Err(error) = axum::serve(listener, router(node)).await {
        tracing::error!(%error, "the HTTP port stopped");
    }
}

async fn page() -> Html<&'static str> {
    Html(include_str!("console.html"))
}

async fn status(State(node): State<Arc<dyn NodeView>>) -> Json<serde_json::Value> {
    Json(node.status())
}

/// The SQL box: the body is the SQL text.
async fn sql(State(node): State<Arc<dyn NodeView>>, body: String) -> Response {
    match node.sql(body).await {
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
