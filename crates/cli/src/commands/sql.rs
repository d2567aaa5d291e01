//! `tessera sql`: run statements from -c, or an interactive prompt reading `;`-terminated
//! statements from standard input.

use super::target::Target;
use crate::output::print_output;
use crate::Format;
use anyhow::{bail, Result};
use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

pub async fn run(engine: Target, command: Option<&str>, format: Format) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    if let Some(sql) = command {
        for output in engine.execute(sql).await? {
            print_output(&output, format, &mut stdout)?;
        }
        return Ok(());
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
        match engine.execute(&pending).await {
            Ok(outputs) => {
                for output in outputs {
                    print_output(&output, format, &mut stdout)?;
                }
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
