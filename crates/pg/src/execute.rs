//! The extended protocol's Execute, streamed. pgwire's own handling of an Execute that asks
//! for every row (`max_rows` 0) reads the whole answer into its portal before it sends the
//! first row, so a driver (psycopg, JDBC, tokio-postgres: they all use the extended
//! protocol) would make the node hold every row of the answer, encoded. This sends each
//! row as the answer produces it, as the simple protocol does. An Execute with a row
//! limit (a cursor's fetch), or of a portal already suspended, goes to pgwire's own.

use crate::session::{PgSession, PgStatement};
use futures::future::{select, Either};
use futures::{Sink, SinkExt};
use pgwire::api::portal::PortalExecutionState;
use pgwire::api::query::{send_execution_response, send_query_response, ExtendedQueryHandler};
use pgwire::api::results::Response;
use pgwire::api::store::{Entry, PortalStore};
use pgwire::api::{
    copy, ClientInfo, ClientPortalStore, ConnectionHandle, PgWireConnectionState, DEFAULT_NAME,
};
use pgwire::error::{PgWireError, PgWireResult};
use pgwire::messages::extendedquery::Execute;
use pgwire::messages::response::EmptyQueryResponse;
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
    let handle = client
        .session_extensions()
        .get::<Arc<ConnectionHandle>>()
        .map(|handle| Arc::clone(&*handle));
    let response = match handle {
        Some(handle) => {
            let cancel = handle.start_query().await;
            match select(session.do_query(client, portal.as_ref(), 0), cancel).await {
                Either::Left((response, _)) => response,
                Either::Right(_) => Err(PgWireError::QueryCanceled),
            }
        }
        None => session.do_query(client, portal.as_ref(), 0).await,
    }?;
    match response {
        Response::Query(rows) => send_query_response(client, rows, false).await?,
        Response::EmptyQuery => {
            client
                .feed(PgWireBackendMessage::EmptyQueryResponse(
                    EmptyQueryResponse::new(),
                ))
                .await?;
        }
        Response::Execution(tag) => send_execution_response(client, tag).await?,
        Response::TransactionStart(tag) => {
            send_execution_response(client, tag).await?;
            transaction_status = transaction_status.to_in_transaction_state();
        }
        Response::TransactionEnd(tag) => {
            send_execution_response(client, tag).await?;
            transaction_status = transaction_status.to_idle_state();
            client.portal_store().rm_portal(DEFAULT_NAME);
        }
        Response::Error(error) => {
            client
                .send(PgWireBackendMessage::ErrorResponse((*error).into()))
                .await?;
            transaction_status = transaction_status.to_error_state();
        }
        Response::CopyIn(copy_in) => {
            client.set_state(PgWireConnectionState::CopyInProgress(true));
            copy::send_copy_in_response(client, copy_in).await?;
        }
        Response::CopyOut(copy_out) => copy::send_copy_out_response(client, copy_out).await?,
        Response::CopyBoth(copy_both) => {
            client.set_state(PgWireConnectionState::CopyInProgress(true));
            copy::send_copy_both_response(client, copy_both).await?;
        }
    }
    // Every row went out: executing the portal again answers nothing, as in PostgreSQL.
    *portal.state().lock().await = PortalExecutionState::Finished;
    if !matches!(client.state(), PgWireConnectionState::CopyInProgress(_)) {
        client.set_state(PgWireConnectionState::ReadyForQuery);
        client.set_transaction_status(transaction_status);
    }
    Ok(())
}
