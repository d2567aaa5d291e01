//! Which SQL statement the current task works for: the engine runs each statement inside
//! [`within`], and the distributed queries it starts (planned and run by lower layers) list
//! themselves under it, so the console can show a statement's live progress.

use std::future::Future;

tokio::task_local! {
    static STATEMENT: u64;
}

/// Runs `work` as part of statement `id` (an id of the node's statement activity list).
pub async fn within<F: Future>(id: u64, work: F) -> F::Output {
    STATEMENT.scope(id, work).await
}

/// The statement the current task works for, if it runs inside [`within`].
pub fn current() -> Option<u64> {
    STATEMENT.try_with(|id| *id).ok()
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn a_statement_is_known_inside_its_scope_only() {
        assert_eq!(super::current(), None);
        let seen = super::within(7, async { super::current() }).await;
        assert_eq!(seen, Some(7));
        assert_eq!(super::current(), None);
    }
}
