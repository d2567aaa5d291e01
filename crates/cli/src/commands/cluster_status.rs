//! `tessera --node ADDR status`: the cluster as one node sees it.

use anyhow::Result;
use std::collections::BTreeMap;
use tessera_server::ClusterClient;

pub async fn run(addr: &str) -> Result<()> {
    let status = ClusterClient::new(addr).status().await?;
    let meta = &status.meta;
    println!("cluster:        {}", meta.cluster_id);
    println!("asked node:     {} ({})", status.node_id, status.listen);
    if status.insecure {
        // Red: nothing keeps a stranger out of this cluster.
        println!(
            "\x1b[1;31minternal port:  INSECURE (plaintext, insecure = true): any process that reaches it can join, write metadata and read data\x1b[0m"
        );
    } else {
        println!("internal port:  mutual TLS (certificates of the cluster's CA)");
    }
    match status.leader {
        Some(leader) => println!("metadata leader: node {leader} (term {})", status.term),
        None => println!("metadata leader: none (election running)"),
    }
    print_archive(&status);
    match &status.last_scrub {
        Some(scrub) => println!(
            "last scrub:     {} on this node: {} components checked, {} damaged, {} repaired{}",
            tessera_common::time::format_ms(scrub.started_at_ms),
            scrub.components,
            scrub.damaged.len(),
            scrub.repaired.len(),
            match scrub.unrepaired.len() {
                0 => String::new(),
                n => format!(", \x1b[1;31m{n} NOT REPAIRED\x1b[0m"),
            }
        ),
        None => println!("last scrub:     none yet on this node"),
    }
    if let Some(cache) = &status.cache {
        println!(
            "component cache: {} in {} files of {} allowed; {} read from it, {} fetched into it{}",
            super::scrub::human_bytes(cache.bytes),
            cache.files,
            super::scrub::human_bytes(cache.budget),
            super::scrub::human_bytes(cache.hit_bytes),
            super::scrub::human_bytes(cache.miss_bytes),
            cache.hit_rate().map_or(String::new(), |rate| format!(
                " (hit rate {:.0}%)",
                rate * 100.0
            ))
        );
    }
    if let Some(decoded) = &status.decoded {
        println!(
            "decoded cache:  {} of {} allowed: {} columns of {} components",
            super::scrub::human_bytes(decoded.bytes),
            super::scrub::human_bytes(decoded.budget_bytes),
            decoded.columns,
            decoded.components
        );
    }
    println!("visible epoch:  {}", meta.visible);
    println!("next epoch:     {}", meta.next_epoch);
    if !meta.open.is_empty() {
        for (epoch, open) in &meta.open {
            println!(
                "open epoch {epoch}: coordinator node {}, tables {:?}",
                open.coordinator, open.tables
            );
        }
    }
    if status.membership_joint {
        println!(
            "metadata voters: changing (both the old and the new voters must agree until the change is finished)"
        );
    }
    println!();
    println!(
        "{:<6} {:<22} {:<8} {:<8} {:>9} {:>9}  metadata",
        "node", "address", "role", "state", "primary", "replica"
    );
    for node in meta.nodes.values() {
        let primary = meta
            .map
            .partitions
            .iter()
            .filter(|p| p.primary == Some(node.id))
            .count();
        let replica = meta
            .map
            .partitions
            .iter()
            .filter(|p| p.replicas.contains(&node.id))
            .count();
        let state = if node.decommissioned {
            "removed"
        } else if node.alive {
            "alive"
        } else {
            "failed"
        };
        let metadata = if status.voters.contains(&node.id) {
            "voter"
        } else {
            "learner"
        };
        println!(
            "{:<6} {:<22} {:<8} {:<8} {:>9} {:>9}  {metadata}",
            node.id.to_string(),
            node.addr,
            node.role(),
            state,
            primary,
            replica
        );
    }
    println!();
    println!(
        "partition map version {} ({} partitions, replication {}):",
        meta.map.version, meta.partition_count, meta.replication
    );
    // Runs of partitions with the same placement, to keep the listing short.
    let mut runs: BTreeMap<usize, (usize, String)> = BTreeMap::new();
    let mut start = 0;
    for (i, placement) in meta.map.partitions.iter().enumerate() {
        let describe = format!(
            "primary {} replicas {:?}{}",
            placement
                .primary
                .map_or("none".to_string(), |p| p.to_string()),
            placement.replicas,
            if placement.stale.is_empty() {
                String::new()
            } else {
                format!(" stale (node: first missed epoch) {:?}", placement.stale)
            }
        );
        match runs.get_mut(&start) {
            Some((end, text)) if *text == describe => *end = i,
            _ => {
                start = i;
                runs.insert(i, (i, describe));
            }
        }
    }
    for (first, (last, text)) in runs {
        println!("  partitions {first:>4}..={last:<4} {text}");
    }
    println!();
    println!("tables:");
    for def in meta.tables.values() {
        let local = status.tables.iter().find(|t| t.name == def.name);
        println!(
            "  {:<20} key {:?}, created at epoch {}; rows on this node: {} ({} in the log only, as a cold standby)",
            def.name,
            def.primary_key,
            def.created_at,
            local.map_or(0, |t| t.rows),
            local.map_or(0, |t| t.logged_rows)
        );
        if let Some(retention) = meta.retention.get(&def.name) {
            println!(
                "  {:<20} history: {}; oldest readable epoch {}",
                "",
                retention.setting.describe(),
                meta.retention_horizon(&def.name)
            );
        }
        if let Some(archived) = meta.archive.get(&def.name) {
            let epochs: Vec<String> = archived.keys().map(|e| e.to_string()).collect();
            println!(
                "  {:<20} archived epochs: {} ({} components)",
                "",
                epochs.join(", "),
                archived.values().map(|a| a.components.len()).sum::<usize>()
            );
        }
    }
    if !meta.history_compacted_below.is_zero() {
        println!(
            "epoch log:      {} committed epochs kept, from epoch {} (no table retains its history below it)",
            status.history.epochs, meta.history_compacted_below
        );
    }
    Ok(())
}

/// The archive's size and health: how many fragments the worst-off component has on live
/// nodes, against how many it may lose.
fn print_archive(status: &tessera_server::server::NodeStatus) {
    let health = status.meta.archive_health();
    if let Some((live, parity)) = health.fewest_live {
        let total = health.fragments / health.components.max(1);
        let line = format!(
            "archive:        {} epoch{}, {} components in {} fragments; fewest live fragments of one component: {live} of {total} (any {} rebuild it; it can lose {} more)",
            health.epochs,
            if health.epochs == 1 { "" } else { "s" },
            health.components,
            health.fragments,
            total - parity,
            live.saturating_sub(total - parity)
        );
        if live < total - parity {
            println!("\x1b[1;31m{line}: UNREADABLE until nodes return\x1b[0m");
        } else if live < total {
            println!("\x1b[1;33m{line}: degraded\x1b[0m");
        } else {
            println!("{line}");
        }
    }
    for waiting in &status.archive_waiting {
        println!("\x1b[1;33marchive waiting: {waiting}\x1b[0m");
    }
}
