//! The node's HTTP port (`http_listen`): Prometheus metrics at `/metrics` and the web
//! console. The node supplies what the pages show through [`NodeView`], so this crate
//! knows HTTP and nothing of Raft or replication.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::sync::Arc;
use tokio::net::TcpListener;

/// What a node tells its HTTP port.
pub trait NodeView: Send + Sync + 'static {
    /// Sets the gauges that describe the node's state (Raft, epochs, replicas) just before
    /// a scrape; counters and histograms move by themselves as work happens.
    fn refresh_metrics(&self);
}

/// The routes, over `node`.
pub fn router(node: Arc<dyn NodeView>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(node)
}

/// Serves HTTP on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, node: Arc<dyn NodeView>) {
    if let Err(error) = axum::serve(listener, router(node)).await {
        tracing::error!(%error, "the HTTP port stopped");
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
