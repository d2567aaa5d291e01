//! `tessera status`: what this node stores.

use anyhow::Result;
use std::sync::Arc;
use tessera_storage::Store;

pub fn run(store: Arc<Store>) -> Result<()> {
    println!("data directory: {}", store.dir().display());
    println!("visible epoch:  {}", store.visible_epoch());
    println!("partitions:     {}", store.ring().partition_count());
    println!();
    println!(
        "{:<20} {:>12} {:>12} {:>11} {:>11}",
        "table", "stored rows", "memory rows", "components", "partitions"
    );
    for table in store.table_stats() {
        println!(
            "{:<20} {:>12} {:>12} {:>11} {:>11}",
            table.name,
            table.component_rows,
            table.memtable_rows,
            table.components,
            table.partitions_with_data
        );
    }
    Ok(())
}
