//! The correctness oracle: plain DataFusion over the same generated data, held in memory.

use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion::prelude::SessionContext;
use std::sync::Arc;

/// A DataFusion session with all eight TPC-H tables at scale factor `sf` in memory.
pub fn oracle(sf: f64) -> Result<SessionContext> {
    let ctx = SessionContext::new();
    for table in crate::TABLES {
        let batches: Vec<_> = table.generate(sf, 64 * 1024).collect::<Result<_, _>>()?;
        let mem = MemTable::try_new(table.schema(), vec![batches])?;
        ctx.register_table(table.name, Arc::new(mem))?;
    }
    Ok(ctx)
}
