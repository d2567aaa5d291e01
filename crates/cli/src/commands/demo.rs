//! `tessera demo`: a local store with TPC-H loaded, queries with timings, and time travel.

use crate::commands::load;
use crate::output::print_output;
use crate::Format;
use anyhow::Result;
use std::sync::Arc;
use std::time::Instant;
use tessera_sql::{Engine, StatementOutput};
use tessera_storage::Store;

const DEMO_QUERIES: [usize; 8] = [1, 3, 5, 6, 10, 12, 14, 19];

pub async fn run(store: Arc<Store>, sf: f64) -> Result<()> {
    println!("Tessera demo: data in {}", store.dir().display());
    if store.table_def("lineitem").is_none() {
        load::tpch(&super::target::Target::local(store.clone()), sf, &[], true).await?;
    } else {
        println!(
            "TPC-H already loaded (visible epoch {}); reusing it",
            store.visible_epoch()
        );
    }
    let engine = Engine::new(store.clone());
    let mut stdout = std::io::stdout();

    println!("\nTPC-H Q1 (pricing summary):");
    for output in engine.execute(tessera_tpch::query(1)).await? {
        print_output(&output, Format::Table, &mut stdout)?;
    }
    println!("\n{:>5} {:>8} {:>10}", "query", "rows", "time (ms)");
    for q in DEMO_QUERIES {
        let started = Instant::now();
        let batches = engine.query(tessera_tpch::query(q)).await?;
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        println!(
            "{:>5} {:>8} {:>10.1}",
            format!("Q{q}"),
            rows,
            started.elapsed().as_secs_f64() * 1e3
        );
    }

    println!("\nTime travel: every write is a new epoch; older epochs stay readable.");
    let before = store.visible_epoch();
    let tag = format!("changed by the demo at epoch {}", before.next());
    let outputs = engine
        .execute(&format!(
            "UPDATE nation SET n_comment = '{tag}' WHERE n_nationkey = 0"
        ))
        .await?;
    if let Some(StatementOutput::Done {
        epoch: Some(epoch), ..
    }) = outputs.first()
    {
        println!("UPDATE nation ... committed as epoch {epoch}");
    }
    for sql in [
        format!("SELECT n_name, n_comment FROM nation AS OF EPOCH {before} WHERE n_nationkey = 0"),
        "SELECT n_name, n_comment FROM nation WHERE n_nationkey = 0".to_string(),
    ] {
        println!("\n{sql}");
        for output in engine.execute(&sql).await? {
            print_output(&output, Format::Table, &mut stdout)?;
        }
    }
    println!("\nNext: `tessera sql` for a prompt, `tessera status` for what is stored.");
    Ok(())
}
