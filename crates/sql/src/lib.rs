//! SQL over Tessera's catalog (DESIGN.md sections 1 and 5).
//!
//! DataFusion parses, plans and executes; this crate supplies the catalog (one
//! `TableProvider` per table, or per table *at an epoch* for time travel), the scan that
//! reads a table snapshot, and the statements DataFusion cannot run by itself against a
//! versioned store: CREATE/DROP TABLE, INSERT, UPDATE and DELETE, each write becoming one
//! published epoch.

pub mod access;
pub mod activity;
pub mod alter;
pub mod answer;
pub mod backend;
pub mod changes;
pub mod decoded;
pub mod engine;
pub mod error;
pub mod key_bounds;
pub mod options;
pub mod own_writes;
pub mod params;
pub mod provider;
pub mod retention;
pub mod scan;
pub mod semi_join_pushdown;
pub mod snapshot_scan;
pub mod statements;
pub mod system;
pub mod tags;
pub mod time_travel;
pub mod transaction;
pub mod users;

pub use backend::{Backend, LocalBackend};
pub use engine::{Engine, StatementOutput, LOCAL_COLLECT_JOIN_BYTES};
pub use error::SqlError;
pub use provider::ScanLayout;

/// The `ExecutionPlan` methods every leaf operator writes alike: its name, its cached
/// properties (a field `properties`), no children, and `with_new_children` as the
/// identity. With `no_expressions`, also an `apply_expressions` that visits nothing.
#[macro_export]
macro_rules! leaf_plan_methods {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn properties(&self) -> &::std::sync::Arc<::datafusion::physical_plan::PlanProperties> {
            &self.properties
        }

        fn children(
            &self,
        ) -> Vec<&::std::sync::Arc<dyn ::datafusion::physical_plan::ExecutionPlan>> {
            vec![]
        }

        fn with_new_children(
            self: ::std::sync::Arc<Self>,
            _children: Vec<::std::sync::Arc<dyn ::datafusion::physical_plan::ExecutionPlan>>,
        ) -> ::datafusion::common::Result<
            ::std::sync::Arc<dyn ::datafusion::physical_plan::ExecutionPlan>,
        > {
            Ok(self)
        }
    };
    ($name:literal, no_expressions) => {
        $crate::leaf_plan_methods!($name);

        fn apply_expressions(
            &self,
            _f: &mut dyn FnMut(
                &::std::sync::Arc<dyn ::datafusion::physical_expr::PhysicalExpr>,
            ) -> ::datafusion::common::Result<
                ::datafusion::common::tree_node::TreeNodeRecursion,
            >,
        ) -> ::datafusion::common::Result<::datafusion::common::tree_node::TreeNodeRecursion> {
            Ok(::datafusion::common::tree_node::TreeNodeRecursion::Continue)
        }
    };
}

/// Where a client front end (PostgreSQL, Flight SQL) gets its engines.
pub trait Sessions: Send + Sync + 'static {
    /// A fresh engine for one connection or request; dropped (with any open transaction,
    /// unpublished) when it ends.
    fn open(&self) -> Engine;

    /// Whether a connection must log in: once the cluster has users. A cluster without
    /// any is open to whoever reaches its endpoints, as a fresh PostgreSQL with `trust`.
    fn login_required(&self) -> bool {
        false
    }

    /// The SCRAM secret of user `name`, or `None` if there is no such user.
    fn user_secret(&self, _name: &str) -> Option<tessera_common::auth::ScramSecret> {
        None
    }
}
