//! `tessera scrub`: every live node hashes its components again now and repairs the
//! damaged ones (see `tessera_server::scrub`).

use anyhow::{bail, Result};
use tessera_server::scrub::ScrubReport;

pub async fn run(addr: &str) -> Result<()> {
    let reports = tessera_server::ClusterClient::new(addr).scrub().await?;
    for report in &reports {
        print!("{}", render(report));
    }
    let unrepaired: usize = reports.iter().map(|r| r.unrepaired.len()).sum();
    if unrepaired > 0 {
        bail!("{unrepaired} damaged component(s) or fragment(s) could not be repaired");
    }
    Ok(())
}

/// One node's pass, as the terminal shows it.
pub fn render(report: &ScrubReport) -> String {
    let mut out = format!(
        "node {}: checked {} components and {} archive fragments ({}) in {} ms: {} damaged, {} repaired\n",
        report.node,
        report.components,
        report.fragments,
        human_bytes(report.bytes),
        report.elapsed_ms,
        report.damaged.len(),
        report.repaired.len()
    );
    if report.collected_fragments > 0 {
        out += &format!(
            "  deleted {} archive fragments no archived epoch names any more\n",
            report.collected_fragments
        );
    }
    for line in &report.damaged {
        out += &format!("  damaged:    {line}\n");
    }
    for line in &report.repaired {
        out += &format!("  repaired:   {line}\n");
    }
    for line in &report.unrepaired {
        out += &format!("  UNREPAIRED: {line}\n");
    }
    out
}

pub(crate) fn human_bytes(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
