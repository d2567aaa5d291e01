//! Skipping kept batches a filter cannot match, as the Parquet reader skips row groups.
//!
//! A component read from Parquet is pruned by its row groups' footer statistics. Read from
//! the cache it has no row groups, only the batches it was decoded in; so each kept column
//! works out, once, the least and greatest value and the nulls of each of its batches, and
//! the scan's predicate is checked against those bounds with DataFusion's own
//! [`PruningPredicate`]. A batch the predicate cannot match is never copied out of the
//! cache. (The filter above the scan still checks every row: pruning only skips.)

use arrow::array::{ArrayRef, UInt64Array};
use arrow::datatypes::Schema;
use datafusion::common::{Column, ScalarValue};
use datafusion::physical_optimizer::pruning::{PruningPredicate, PruningStatistics};
use datafusion_functions_aggregate_common::min_max::{max_batch, min_batch};
use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

/// One column of a component, as kept: its values in the batches it was read in (every
/// column of a component is read in the same batches: the reader cuts them by rows,
/// whatever it projects), and their bounds once a predicate has needed them (two values
/// per batch of thousands of rows: not counted against the cache's budget).
#[derive(Debug)]
pub(crate) struct KeptColumn {
    pub(crate) arrays: Arc<[ArrayRef]>,
    bounds: OnceLock<Option<BatchBounds>>,
}

/// Per batch of a kept column: its least and greatest value and its nulls.
#[derive(Debug)]
struct BatchBounds {
    min: ArrayRef,
    max: ArrayRef,
    nulls: ArrayRef,
}

impl KeptColumn {
    pub(crate) fn new(arrays: Arc<[ArrayRef]>) -> Self {
        KeptColumn {
            arrays,
            bounds: OnceLock::new(),
        }
    }

    /// The column's bounds per batch, worked out on first use; none for a type whose
    /// order DataFusion's `min`/`max` do not know (nothing is then pruned by it).
    fn bounds(&self) -> Option<&BatchBounds> {
        self.bounds
            .get_or_init(|| {
                let min = self.arrays.iter().map(min_batch);
                let max = self.arrays.iter().map(max_batch);
                let min =
                    ScalarValue::iter_to_array(min.collect::<Result<Vec<_>, _>>().ok()?).ok()?;
                let max =
                    ScalarValue::iter_to_array(max.collect::<Result<Vec<_>, _>>().ok()?).ok()?;
                let nulls: UInt64Array =
                    self.arrays.iter().map(|a| a.null_count() as u64).collect();
                Some(BatchBounds {
                    min,
                    max,
                    nulls: Arc::new(nulls),
                })
            })
            .as_ref()
    }
}

/// The batches of one component, as the containers a [`PruningPredicate`] is checked
/// against: `kept[i]` is stored column `columns[i]`, named as in `stored`.
pub(crate) struct KeptBatches<'a> {
    pub(crate) stored: &'a Schema,
    pub(crate) columns: &'a [usize],
    pub(crate) kept: &'a [Arc<KeptColumn>],
}

impl KeptBatches<'_> {
    /// Per batch, whether `predicate` may match a row of it (all true where nothing can be
    /// told: no column kept, or the predicate's columns not among them).
    pub(crate) fn matching(&self, predicate: &PruningPredicate) -> Vec<bool> {
        let batches = self.num_containers();
        if self.kept.is_empty() {
            return vec![true; batches];
        }
        predicate
            .prune(self)
            .ok()
            .filter(|matched| matched.len() == batches)
            .unwrap_or_else(|| vec![true; batches])
    }

    fn bounds_of(&self, column: &Column) -> Option<&BatchBounds> {
        let index = self.stored.index_of(&column.name).ok()?;
        let position = self.columns.iter().position(|&c| c == index)?;
        self.kept[position].bounds()
    }
}

impl PruningStatistics for KeptBatches<'_> {
    fn min_values(&self, column: &Column) -> Option<ArrayRef> {
        self.bounds_of(column).map(|b| b.min.clone())
    }

    fn max_values(&self, column: &Column) -> Option<ArrayRef> {
        self.bounds_of(column).map(|b| b.max.clone())
    }

    fn num_containers(&self) -> usize {
        self.kept.first().map_or(1, |k| k.arrays.len())
    }

    fn null_counts(&self, column: &Column) -> Option<ArrayRef> {
        self.bounds_of(column).map(|b| b.nulls.clone())
    }

    fn row_counts(&self) -> Option<ArrayRef> {
        let first = self.kept.first()?;
        let rows: UInt64Array = first.arrays.iter().map(|a| a.len() as u64).collect();
        Some(Arc::new(rows))
    }

    fn contained(
        &self,
        _column: &Column,
        _values: &HashSet<ScalarValue>,
    ) -> Option<arrow::array::BooleanArray> {
        None
    }
}
