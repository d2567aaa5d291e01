//! SQL over Tessera's catalog (DESIGN.md sections 1 and 5).
//!
//! DataFusion parses, plans and executes; this crate supplies the catalog (one
//! `TableProvider` per table, or per table *at an epoch* for time travel), the scan that
//! reads a table snapshot, and the statements DataFusion cannot run by itself against a
//! versioned store: CREATE/DROP TABLE, INSERT, UPDATE and DELETE, each write becoming one
//! published epoch.

pub mod backend;
pub mod engine;
pub mod error;
pub mod provider;
pub mod scan;
pub mod time_travel;

pub use backend::{Backend, LocalBackend};
pub use engine::{Engine, StatementOutput};
pub use error::SqlError;
pub use provider::ScanLayout;
