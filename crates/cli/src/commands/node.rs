//! `tessera node --config node.toml [--set section.key=value]... [--replace]`: run one node
//! of a cluster until stopped (`--replace`: its data is gone, it rejoins empty).

use anyhow::{Context, Result};
use std::path::Path;
use tessera_server::{Node, NodeConfig};

pub async fn run(config_path: &Path, overrides: &[String], replace: bool) -> Result<()> {
    let mut config = NodeConfig::load_with(config_path, overrides)?;
    config.replace = replace;
    // Relative paths are relative to the configuration file, so a config works from any
    // directory.
    let base = config_path.parent().unwrap_or(Path::new("."));
    let resolve = |path: &mut std::path::PathBuf| {
        if path.is_relative() {
            *path = base.join(&*path);
        }
    };
    resolve(&mut config.data_dir);
    if let Some(mtls) = &mut config.mtls {
        resolve(&mut mtls.ca);
        resolve(&mut mtls.cert);
        resolve(&mut mtls.key);
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
    tokio::select! {
        _ = wait_for_shutdown() => {}
        failure = disk_failure(&node) => {
            // Not a clean stop: the disk may have dropped what it was given, so nothing
            // more is acknowledged from it. A restart recovers from what is durable.
            eprintln!(
                "node {} stopping at once: its disk failed ({failure}); restart it to recover from what is durable",
                node.id()
            );
            std::process::exit(DISK_FAILURE_EXIT);
        }
    }
    println!("node {} stopping", node.id());
    node.shutdown().await;
    Ok(())
}

/// The exit status of a node stopped by a disk failure (EX_IOERR).
pub const DISK_FAILURE_EXIT: i32 = 74;

/// How often the disk watcher looks.
const DISK_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// A gap between the watcher's looks longer than this means the whole process was frozen
/// (SIGSTOP, a paused VM), not that the disk was slow.
const FROZEN_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Resolves with the reason once the node's disk has failed.
async fn disk_failure(node: &Node) -> String {
    let mut ticker = tokio::time::interval(DISK_CHECK_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_look = std::time::Instant::now();
    loop {
        ticker.tick().await;
        let gap = last_look.elapsed();
        last_look = std::time::Instant::now();
        if gap > FROZEN_AFTER {
            // Fsyncs were seen running across the freeze; only what follows counts.
            tracing::warn!(
                frozen_ms = gap.as_millis() as u64,
                "this process was frozen; fsyncs in flight are timed again from now"
            );
            tessera_common::disk::credit_frozen_time();
            tessera_common::metrics::metrics().process_freezes.inc();
            continue;
        }
        if let Some(reason) = node.disk_failure() {
            return reason;
        }
    }
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
