//! `tessera_changes('table', from, to)`: a table's diff between two points of its history,
//! one row per key that changed (see [`tessera_storage::changes`] for its columns).
//!
//! `from` and `to` are epoch numbers, tag names or timestamps (`'release_1'`,
//! `'2026-11-20 10:00'`); `to` defaults to the visible epoch. The diff is read like any
//! table: a backend plans its scan (on a cluster, distributed over the replicas, each
//! reading only the components that hold versions in the range).

use crate::backend::Backend;
use crate::error::{Result as SqlResult, SqlError};
use crate::time_travel::{parse_timestamp_ms, AsOf};
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::TableFunctionArgs;
use datafusion::catalog::{Session, TableFunctionImpl, TableProvider};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::{Expr, TableType};
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;
use tessera_common::Epoch;
use tessera_storage::changes::changes_schema;
use tessera_storage::TableDef;

/// The table function's name.
pub const CHANGES_FUNCTION: &str = "tessera_changes";

/// How a backend reads a diff.
#[async_trait]
pub trait ChangesSource: std::fmt::Debug + Send + Sync + 'static {
    /// Plans a scan of `def`'s changes from `from` to `to`, keeping the diff's columns
    /// `projection`.
    async fn plan_changes(
        &self,
        def: &TableDef,
        from: Epoch,
        to: Epoch,
        projection: Vec<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>>;
}

/// One table's diff between two epochs, as DataFusion sees it.
#[derive(Debug)]
pub struct ChangesTable<S> {
    def: TableDef,
    from: Epoch,
    to: Epoch,
    schema: SchemaRef,
    source: S,
}

impl<S: ChangesSource> ChangesTable<S> {
    pub fn new(def: TableDef, from: Epoch, to: Epoch, source: S) -> Self {
        ChangesTable {
            schema: changes_schema(&def),
            def,
            from,
            to,
            source,
        }
    }
}

#[async_trait]
impl<S: ChangesSource> TableProvider for ChangesTable<S> {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let projection = projection
            .cloned()
            .unwrap_or_else(|| (0..self.schema.fields().len()).collect());
        self.source
            .plan_changes(&self.def, self.from, self.to, projection)
            .await
    }
}

/// The `tessera_changes` table function over one engine's backend.
pub struct ChangesFunction {
    pub backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for ChangesFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(CHANGES_FUNCTION)
    }
}

impl TableFunctionImpl for ChangesFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        self.changes(args.exprs())
            .map_err(SqlError::into_datafusion)
    }
}

impl ChangesFunction {
    fn changes(&self, args: &[Expr]) -> SqlResult<Arc<dyn TableProvider>> {
        let usage = || {
            SqlError::Syntax(format!(
                "{CHANGES_FUNCTION}('table', from, [to]) takes a table name and one or two epochs, tags or timestamps, e.g. {CHANGES_FUNCTION}('orders', 'release_1', 42)"
            ))
        };
        if !(2..=3).contains(&args.len()) {
            return Err(usage());
        }
        let table = match literal(&args[0]) {
            Some(Literal::Text(name)) => name,
            _ => return Err(usage()),
        };
        let def = self.backend.table_def(&table).ok_or_else(|| {
            SqlError::Storage(tessera_storage::StorageError::UnknownTable(table.clone()))
        })?;
        let from = self.point(&args[1]).ok_or_else(usage)??;
        let to = match args.get(2) {
            Some(arg) => self.point(arg).ok_or_else(usage)??,
            None => self.backend.visible_epoch(),
        };
        if from > to {
            return Err(SqlError::Storage(
                tessera_storage::StorageError::BackwardDiff { from, to },
            ));
        }
        self.backend.changes_table(def, from, to)
    }

    /// The epoch an argument names: a number, or text that is a timestamp or a tag.
    fn point(&self, arg: &Expr) -> Option<SqlResult<Epoch>> {
        let point = match literal(arg)? {
            Literal::Number(epoch) => AsOf::Epoch(epoch),
            Literal::Text(text) => match parse_timestamp_ms(&text) {
                Ok(ms) => AsOf::Timestamp(ms),
                Err(_) => match crate::tags::check_tag_name(&text) {
                    Ok(()) => AsOf::Tag(text),
                    Err(_) => {
                        return Some(Err(SqlError::InvalidValue(format!(
                            "{text:?} is neither a timestamp nor a tag name"
                        ))))
                    }
                },
            },
        };
        Some(self.backend.resolve_as_of(&point))
    }
}

enum Literal {
    Number(u64),
    Text(String),
}

fn literal(expr: &Expr) -> Option<Literal> {
    let Expr::Literal(value, _) = expr else {
        return None;
    };
    match value {
        ScalarValue::Utf8(Some(text))
        | ScalarValue::Utf8View(Some(text))
        | ScalarValue::LargeUtf8(Some(text)) => Some(Literal::Text(text.clone())),
        ScalarValue::Int64(Some(n)) if *n >= 0 => Some(Literal::Number(*n as u64)),
        ScalarValue::Int32(Some(n)) if *n >= 0 => Some(Literal::Number(*n as u64)),
        ScalarValue::UInt64(Some(n)) => Some(Literal::Number(*n)),
        _ => None,
    }
}
