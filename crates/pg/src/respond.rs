//! Sending a statement's response as pgwire does, with one addition: the notices that a
//! streamed answer raised while its rows went out (lineage recovery after its first row)
//! follow its last row, ahead of its CommandComplete. Notices raised before the first row
//! go ahead of the response (`PgSession::run`).

use crate::session::PgSession;
use futures::{Sink, SinkExt, StreamExt};
use pgwire::api::query::send_execution_response;
use pgwire::api::results::{QueryResponse, Response, Tag};
use pgwire::api::store::PortalStore;
use pgwire::api::{copy, ClientInfo, ClientPortalStore, PgWireConnectionState, DEFAULT_NAME};
use pgwire::error::{PgWireError, PgWireResult};
use pgwire::messages::data::RowDescription;
use pgwire::messages::response::{EmptyQueryResponse, TransactionStatus};
use pgwire::messages::PgWireBackendMessage;
use std::fmt::Debug;

/// Which protocol a response answers: the simple one describes its rows itself; the
/// extended one did at Describe, and ends its unnamed portal with the transaction.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Simple,
    Extended,
}

/// Sends `response`, updating `status` as a transaction command or an error changes it.
pub(crate) async fn send_response<C>(
    session: &PgSession,
    client: &mut C,
    response: Response,
    protocol: Protocol,
    status: &mut TransactionStatus,
) -> PgWireResult<()>
where
    C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
    C::PortalStore: PortalStore,
    C::Error: Debug,
    PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
{
    let extended = protocol == Protocol::Extended;
    match response {
        Response::Query(rows) => send_rows(session, client, rows, !extended).await?,
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
            *status = status.to_in_transaction_state();
        }
        Response::TransactionEnd(tag) => {
            send_execution_response(client, tag).await?;
            *status = status.to_idle_state();
            if extended {
                client.portal_store().rm_portal(DEFAULT_NAME);
            }
        }
        Response::Error(error) => {
            client
                .feed(PgWireBackendMessage::ErrorResponse((*error).into()))
                .await?;
            // An error inside a transaction leaves it failed until ROLLBACK; a failed
            // COMMIT (a write conflict) ended it, publishing nothing, as in PostgreSQL.
            *status = if session.engine.in_transaction() {
                status.to_error_state()
            } else {
                status.to_idle_state()
            };
        }
        Response::CopyIn(copy_in) => {
            client.set_state(PgWireConnectionState::CopyInProgress(extended));
            copy::send_copy_in_response(client, copy_in).await?;
        }
        Response::CopyOut(copy_out) => copy::send_copy_out_response(client, copy_out).await?,
        Response::CopyBoth(copy_both) => {
            client.set_state(PgWireConnectionState::CopyInProgress(extended));
            copy::send_copy_both_response(client, copy_both).await?;
        }
    }
    Ok(())
}

/// An answer's rows, then the notices raised while they went out, then its end. An error
/// mid-answer ends it there (the caller reports it, as PostgreSQL does mid-scan).
async fn send_rows<C>(
    session: &PgSession,
    client: &mut C,
    rows: QueryResponse,
    describe: bool,
) -> PgWireResult<()>
where
    C: Sink<PgWireBackendMessage> + Unpin + Send,
    C::Error: Debug,
    PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
{
    let QueryResponse {
        command_tag,
        row_schema,
        mut data_rows,
        ..
    } = rows;
    if describe {
        let description = RowDescription::new(row_schema.iter().map(Into::into).collect());
        client
            .feed(PgWireBackendMessage::RowDescription(description))
            .await?;
    }
    let mut sent = 0;
    while let Some(row) = data_rows.next().await {
        client.feed(PgWireBackendMessage::DataRow(row?)).await?;
        sent += 1;
    }
    session.send_notices(client).await?;
    let done = Tag::new(&command_tag).with_rows(sent);
    client
        .feed(PgWireBackendMessage::CommandComplete(done.into()))
        .await?;
    Ok(())
}
