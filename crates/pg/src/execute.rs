//! Running a statement and sending its response, for both protocols, through
//! [`send_response`] (which sends the notices a streamed answer raised after its rows).
//!
//! The extended protocol's Execute, streamed: pgwire's own handling of an Execute that asks
//! for every row (`max_rows` 0) reads the whole answer into its portal before it sends the
//! first row, so a driver (psycopg, JDBC, tokio-postgres: they all use the extended
//! protocol) would make the node hold every row of the answer, encoded. This sends each
//! row as the answer produces it, as the simple protocol does. An Execute with a row
//! limit (a cursor's fetch), or of a portal already suspended, goes to pgwire's own.

use crate::respond::{send_response, Protocol};
use crate::session::{PgSession, PgStatement};
use futures::future::{select, Either};
use futures::Sink;
use pgwire::api::portal::PortalExecutionState;
use pgwire::api::query::{send_ready_for_query, ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::store::{Entry, PortalStore};
use pgwire::api::{
    ClientInfo, ClientPortalStore, ConnectionHandle, PgWireConnectionState, DEFAULT_NAME,
};
use pgwire::error::{PgWireError, PgWireResult};
use pgwire::messages::extendedquery::Execute;
use pgwire::messages::response::TransactionStatus;
use pgwire::messages::simplequery::Query;
use pgwire::messages::PgWireBackendMessage;
use std::fmt::Debug;
use std::sync::Arc;

pub(crate) async fn on_execute<C>(
    session: &PgSession,
    client: &mut C,
    message: Execute,
) -> PgWireResult<()>
where
    C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
    C::PortalStore: PortalStore<Statement = PgStatement>,
    C::Error: Debug,
    PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
{
    let portal_name = message.name.as_deref().unwrap_or(DEFAULT_NAME);
    let portal = match client.portal_store().get_portal(portal_name) {
        Some(Entry::Value(portal)) => portal,
        _ => return session._on_execute(client, message).await,
    };
    let fresh = matches!(*portal.state().lock().await, PortalExecutionState::Initial);
    if message.max_rows != 0
        || !fresh
        || !matches!(client.state(), PgWireConnectionState::ReadyForQuery)
    {
        return session._on_execute(client, message).await;
    }
    let mut transaction_status = client.transaction_status();
    client.set_state(PgWireConnectionState::QueryInProgress);
    // As pgwire does: a cancel request stops the statement while it runs. A streaming
    // answer listens again while its rows go out (see `results::cancellable`).
    let cancel = cancel_listener(client).await;
    let run = ExtendedQueryHandler::do_query(session, client, portal.as_ref(), 0);
    let response = until_cancelled(cancel, run).await;
    let response = response.inspect_err(|_| idle_after_failed_commit(session, client))?;
    send_response(
        session,
        client,
        response,
        Protocol::Extended,
        &mut transaction_status,
    )
    .await?;
    // Every row went out: executing the portal again answers nothing, as in PostgreSQL.
    *portal.state().lock().await = PortalExecutionState::Finished;
    if !matches!(client.state(), PgWireConnectionState::CopyInProgress(_)) {
        client.set_state(PgWireConnectionState::ReadyForQuery);
        client.set_transaction_status(transaction_status);
    }
    Ok(())
}

/// The simple protocol's Query, as pgwire's own (`_on_query`) but for how each response is
/// sent. Its statements ran in `do_query`, each answer but the last read whole.
pub(crate) async fn on_query<C>(
    session: &PgSession,
    client: &mut C,
    query: Query,
) -> PgWireResult<()>
where
    C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
    C::PortalStore: PortalStore,
    C::Error: Debug,
    PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
{
    if !matches!(client.state(), PgWireConnectionState::ReadyForQuery) {
        return Err(PgWireError::NotReadyForQuery);
    }
    let mut transaction_status = client.transaction_status();
    client.set_state(PgWireConnectionState::QueryInProgress);
    let cancel = cancel_listener(client).await;
    let run = SimpleQueryHandler::do_query(session, client, &query.query);
    let responses = until_cancelled(cancel, run).await;
    let responses = responses.inspect_err(|_| idle_after_failed_commit(session, client))?;
    for response in responses {
        send_response(
            session,
            client,
            response,
            Protocol::Simple,
            &mut transaction_status,
        )
        .await?;
    }
    // A COPY FROM STDIN goes on; its end (`on_copy_done`, `on_copy_fail`) says ready.
    if !matches!(client.state(), PgWireConnectionState::CopyInProgress(_)) {
        client.set_state(PgWireConnectionState::ReadyForQuery);
        client.set_transaction_status(transaction_status);
        send_ready_for_query(client, transaction_status).await?;
    }
    Ok(())
}

/// A listener for the connection's cancel request, while a statement runs.
async fn cancel_listener<C: ClientInfo>(
    client: &C,
) -> Option<futures::channel::oneshot::Receiver<()>> {
    let handle = client
        .session_extensions()
        .get::<Arc<ConnectionHandle>>()
        .map(|handle| Arc::clone(&*handle))?;
    Some(handle.start_query().await)
}

/// `run`, or [`PgWireError::QueryCanceled`] once `cancel` fires first.
async fn until_cancelled<T>(
    cancel: Option<futures::channel::oneshot::Receiver<()>>,
    run: impl std::future::Future<Output = PgWireResult<T>>,
) -> PgWireResult<T> {
    let Some(cancel) = cancel else {
        return run.await;
    };
    futures::pin_mut!(run);
    match select(run, cancel).await {
        Either::Left((done, _)) => done,
        Either::Right(_) => Err(PgWireError::QueryCanceled),
    }
}

/// Before a statement's error is sent: a failed COMMIT (a write conflict) ended its
/// transaction, publishing nothing, so the connection is idle after it, as PostgreSQL's
/// is, not in a failed transaction waiting for a ROLLBACK. (pgwire derives the status it
/// reports with the error from the one held here.)
fn idle_after_failed_commit<C: ClientInfo>(session: &PgSession, client: &mut C) {
    if !session.engine.in_transaction() {
        client.set_transaction_status(TransactionStatus::Idle);
    }
}
