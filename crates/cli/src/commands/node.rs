//! `tessera node --config node.toml [--set section.key=value]...`: run one node of a
//! cluster until stopped.

use anyhow::{Context, Result};
use std::path::Path;
use tessera_server::{Node, NodeConfig};

pub async fn run(config_path: &Path, overrides: &[String]) -> Result<()> {
    let mut config = NodeConfig::load_with(config_path, overrides)?;
    if config.data_dir.is_relative() {
        // Relative to the configuration file, so a config works from any directory.
        let base = config_path.parent().unwrap_or(Path::new("."));
        config.data_dir = base.join(&config.data_dir);
    }
    let protocol = std::env::var("TESSERA_PROTOCOL_VERSION_FOR_TESTS")
        .ok()
        .map(|v| v.parse::<u32>())
        .transpose()
        .context("TESSERA_PROTOCOL_VERSION_FOR_TESTS")?
        .unwrap_or(tessera_server::rpc::PROTOCOL_VERSION);
    let node = Node::start_with_protocol(config, protocol).await?;
    println!(
        "node {} of cluster {:?} listening on {}",
        node.id(),
        node.config.cluster_id,
        node.config.listen
    );
    wait_for_shutdown().await;
    println!("node {} stopping", node.id());
    node.shutdown().await;
    Ok(())
}

/// Waits for Ctrl-C or SIGTERM.
pub async fn wait_for_shutdown() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}
