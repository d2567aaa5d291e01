//! The smallest and largest primary key a component holds, whole keys compared as tuples:
//! what proves that two components whose first key column touches (an order whose lines
//! were split between two loads) still share no key, so they are read as written.
//!
//! Column statistics only know each column's range on its own: two loads of lineitem that
//! split order 42's lines between them both have 42 as an end of their order key range,
//! and nothing there says whether they share a line. The bounds of whole keys do.

use crate::error::SqlError;
use crate::provider::ComponentFiles;
use arrow::row::{OwnedRow, RowConverter, SortField};
use datafusion::common::Result;
use std::cmp::Ordering;
use tessera_common::ComponentHash;
use tessera_storage::component::read_component;
use tessera_storage::versions::KeyProjection;
use tessera_storage::TableDef;

/// A component's smallest and largest key, in the table's key order, as Arrow rows (which
/// compare as the tuples of key values do). Only comparable with bounds computed for the
/// same table definition's key.
#[derive(Debug)]
pub struct KeyBounds {
    min: OwnedRow,
    max: OwnedRow,
}

impl KeyBounds {
    /// Reads the key columns of the component `hash` of `def` (checking its bytes first) and
    /// finds its smallest and largest key; `None` for a table without a key or an empty
    /// component.
    pub fn read(
        store: &dyn ComponentFiles,
        hash: &ComponentHash,
        def: &TableDef,
    ) -> Result<Option<KeyBounds>> {
        let key = def.primary_key_indices();
        if key.is_empty() {
            return Ok(None);
        }
        store.verify(hash).map_err(SqlError::to_datafusion)?;
        // Read in file (ascending) order, then taken in key order.
        let KeyProjection {
            file_order,
            in_projected: positions,
        } = KeyProjection::of(&key);
        let batches = read_component(store.dir(), def, hash, Some(&file_order))
            .map_err(SqlError::to_datafusion)?;
        let Some(first) = batches.first() else {
            return Ok(None);
        };
        let fields = positions
            .iter()
            .map(|&p| SortField::new(first.schema().field(p).data_type().clone()))
            .collect();
        let converter = RowConverter::new(fields)?;
        let mut bounds: Option<KeyBounds> = None;
        for batch in &batches {
            let columns: Vec<_> = positions.iter().map(|&p| batch.column(p).clone()).collect();
            let rows = converter.convert_columns(&columns)?;
            let (Some(min), Some(max)) = (rows.iter().min(), rows.iter().max()) else {
                continue;
            };
            bounds = Some(match bounds {
                None => KeyBounds {
                    min: min.owned(),
                    max: max.owned(),
                },
                Some(b) => KeyBounds {
                    min: if min < b.min.row() {
                        min.owned()
                    } else {
                        b.min
                    },
                    max: if max > b.max.row() {
                        max.owned()
                    } else {
                        b.max
                    },
                },
            });
        }
        Ok(bounds)
    }

    /// Whether every key of `self` is smaller than every key of `next`.
    pub fn all_before(&self, next: &KeyBounds) -> bool {
        self.max.row().cmp(&next.min.row()) == Ordering::Less
    }
}
