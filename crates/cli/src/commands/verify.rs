//! `tessera verify`: checks the cluster's data against its signed, chained version ids.

use anyhow::{bail, Result};
use tessera_common::Epoch;
use tessera_server::verify::{VerifyReport, VerifyRequest};

/// Runs the check through the node at `addr` and prints what it found; an error (and so
/// a failing exit status) if anything did not match.
pub async fn run(
    addr: &str,
    table: Option<String>,
    epoch: Option<u64>,
    repair: bool,
) -> Result<()> {
    let request = VerifyRequest {
        table,
        epoch: epoch.map(Epoch),
        repair,
    };
    let report = tessera_server::ClusterClient::new(addr)
        .verify(request)
        .await?;
    print!("{}", render(&report));
    if !report.problems.is_empty() {
        bail!(
            "verification failed: {} problem(s); the first: {}",
            report.problems.len(),
            report.problems[0]
        );
    }
    Ok(())
}

/// The report as the terminal shows it.
pub fn render(report: &VerifyReport) -> String {
    let mut out = format!(
        "verified through epoch {}: version chains, signatures, and every up-to-date replica's rows\n",
        report.visible
    );
    let width = report
        .tables
        .iter()
        .map(|t| t.table.len())
        .max()
        .unwrap_or(5)
        .max(5);
    out += &format!(
        "  {:width$}  {:>6}  {:>6}  {:>7}  {:>8}  {:>7}  head\n",
        "table", "epochs", "signed", "checked", "replicas", "horizon"
    );
    for t in &report.tables {
        out += &format!(
            "  {:width$}  {:>6}  {:>6}  {:>7}  {:>8}  {:>7}  {}\n",
            t.table,
            t.epochs,
            t.signed,
            t.data_checked,
            t.replicas,
            t.horizon.0,
            &t.head.to_hex()[..16]
        );
    }
    for skipped in &report.skipped {
        out += &format!("  not checked: {skipped}\n");
    }
    if report.problems.is_empty() {
        out += "OK: every replica reproduces the signed version ids\n";
    } else {
        out += &format!("PROBLEMS ({}), the first first:\n", report.problems.len());
        for problem in &report.problems {
            out += &format!("  {problem}\n");
        }
    }
    for repair in &report.repairs {
        out += &format!("  repairing: {repair}\n");
    }
    out
}
