//! `tessera sql`: run statements from -c, or an interactive prompt reading `;`-terminated
//! statements from standard input.

use super::export::split_exports;
use super::target::Target;
use crate::Format;
use anyhow::{bail, Result};
use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

pub async fn run(engine: Target, command: Option<&str>, format: Format) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    if let Some(sql) = command {
        return run_text(&engine, sql, format, &mut stdout).await;
    }
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        writeln!(stdout, "Tessera SQL. End statements with ';'. \\q quits.")?;
    }
    let mut pending = String::new();
    let mut failures = 0;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            write!(
                stdout,
                "{}",
                if pending.is_empty() {
                    "tessera> "
                } else {
                    "     ... "
                }
            )?;
            stdout.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        if pending.is_empty() && matches!(line.trim(), "\\q" | "quit" | "exit") {
            break;
        }
        pending.push_str(&line);
        pending.push('\n');
        if !line.trim_end().ends_with(';') {
            continue;
        }
        let started = Instant::now();
        match run_text(&engine, &pending, format, &mut stdout).await {
            Ok(()) => {
                if interactive {
                    writeln!(stdout, "Time: {:.3} s", started.elapsed().as_secs_f64())?;
                }
            }
            Err(error) => {
                failures += 1;
                writeln!(std::io::stderr(), "error: {error}")?;
            }
        }
        pending.clear();
    }
    if !pending.trim().is_empty() {
        bail!(
            "input ended inside a statement (missing ';'): {}",
            pending.trim()
        );
    }
    if failures > 0 && !interactive {
        bail!("{failures} statement(s) failed");
    }
    Ok(())
}

/// Runs the statements of `sql` and prints what they return; a `COPY ... TO 'file'` among
/// them writes its rows to a file here (see [`super::export`]).
async fn run_text(target: &Target, sql: &str, format: Format, out: &mut impl Write) -> Result<()> {
    let Some(parts) = split_exports(sql)? else {
        return target.print(sql, format, out).await;
    };
    for part in parts {
        match part {
            Ok(export) => {
                let rows = super::export::export(target, &export).await?;
                writeln!(out, "COPY {rows} (to {})", export.path.display())?;
            }
            Err(statement) => target.print(&statement, format, out).await?,
        }
    }
    Ok(())
}
