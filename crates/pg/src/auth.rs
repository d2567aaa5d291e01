//! Start-up and login: SCRAM-SHA-256 against the users in the cluster's metadata, as
//! PostgreSQL 14+ does by default, so the password never crosses the wire. A cluster with
//! no users yet takes every connection (see [`tessera_sql::Sessions::login_required`]).
//!
//! An unknown user goes through the same exchange as a known one (with a decoy secret) and
//! fails with the same message, so a client cannot probe which users exist.

use async_trait::async_trait;
use futures::{Sink, SinkExt};
use pgwire::api::auth::{
    finish_authentication, protocol_negotiation, save_startup_parameters_to_metadata,
    DefaultServerParameterProvider, StartupHandler,
};
use pgwire::api::{
    ClientInfo, ConnectionHandle, ConnectionManager, PgWireConnectionState, PidSecretKeyGenerator,
    RandomPidSecretKeyGenerator, METADATA_USER,
};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::startup::Authentication;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use tessera_common::auth::{AuthError, ScramPending, ScramSecret, ScramServer};
use tessera_sql::Sessions;

const SCRAM_SHA_256: &str = "SCRAM-SHA-256";

/// One connection's start-up: protocol negotiation, the SCRAM exchange when the cluster
/// has users, then registration with the endpoint's connections (for cancel requests).
pub struct Startup {
    pub connections: Arc<ConnectionManager>,
    pub sessions: Arc<dyn Sessions>,
    /// The endpoint's process ids and cancel keys: one counter for all its connections.
    pub pids: Arc<RandomPidSecretKeyGenerator>,
    pub state: Mutex<Login>,
    /// The connection's engine: once the client has logged in, it acts as that user.
    pub engine: Arc<tessera_sql::Engine>,
}

/// Where a connection's login stands.
#[derive(Default)]
pub enum Login {
    #[default]
    Started,
    /// The server's first SCRAM message is sent; the client's proof is next.
    Challenged(Box<ScramPending>),
}

impl Startup {
    fn lock(&self) -> std::sync::MutexGuard<'_, Login> {
        self.state.lock().expect("login lock")
    }

    /// The exchange for `user`: its secret, or a decoy that no password matches.
    fn scram_server(&self, user: &str) -> ScramServer {
        match self.sessions.user_secret(user) {
            Some(secret) => ScramServer {
                user: user.to_string(),
                secret,
                known: true,
            },
            None => ScramServer {
                user: user.to_string(),
                secret: ScramSecret::decoy(user),
                known: false,
            },
        }
    }

    /// Answers the client's next SCRAM message: the server's first message to its first,
    /// the server's signature (`SASLFinal`) once its proof checks out.
    fn scram_step(&self, user: &str, message: &[u8]) -> PgWireResult<Authentication> {
        let text = std::str::from_utf8(message)
            .map_err(|_| login_error(user, AuthError::Malformed("not UTF-8".into())))?;
        let mut state = self.lock();
        match std::mem::take(&mut *state) {
            Login::Started => {
                let (server_first, pending) = self
                    .scram_server(user)
                    .server_first(text)
                    .map_err(|e| login_error(user, e))?;
                *state = Login::Challenged(Box::new(pending));
                Ok(Authentication::SASLContinue(
                    server_first.into_bytes().into(),
                ))
            }
            Login::Challenged(pending) => {
                let server_final = pending
                    .client_final(text)
                    .map_err(|e| login_error(user, e))?;
                Ok(Authentication::SASLFinal(server_final.into_bytes().into()))
            }
        }
    }
}

/// A failed login as PostgreSQL reports it: 28P01 for a wrong password or unknown user,
/// 08P01 for a broken exchange.
fn login_error(user: &str, error: AuthError) -> PgWireError {
    let code = match error {
        AuthError::Failed(_) => "28P01",
        AuthError::Malformed(_) | AuthError::ChannelBinding => "08P01",
    };
    // PostgreSQL's own wording (pgwire's differs), which clients and people search for.
    let message = match error {
        AuthError::Failed(_) => AuthError::Failed(user.to_string()).to_string(),
        other => other.to_string(),
    };
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "FATAL".into(),
        code.into(),
        message,
    )))
}

/// The connection is in: its cancel key, its registration, and the start-up parameters.
async fn admit<C>(
    client: &mut C,
    connections: &Arc<ConnectionManager>,
    pids: &RandomPidSecretKeyGenerator,
) -> PgWireResult<()>
where
    C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send,
    C::Error: Debug,
    PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
{
    let (pid, secret_key) = pids.generate(&*client);
    client.set_pid_and_secret_key(pid, secret_key.clone());
    let (handle, guard) = connections.register(pid, secret_key);
    client
        .session_extensions()
        .insert::<Arc<ConnectionHandle>>(handle);
    client.session_extensions().insert(guard);
    finish_authentication(client, &DefaultServerParameterProvider::default()).await
}

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        match message {
            PgWireFrontendMessage::Startup(startup) => {
                protocol_negotiation(client, &startup).await?;
                save_startup_parameters_to_metadata(client, &startup);
                if !self.sessions.login_required() {
                    return admit(client, &self.connections, &self.pids).await;
                }
                if !client.metadata().contains_key(METADATA_USER) {
                    return Err(PgWireError::UserNameRequired);
                }
                client.set_state(PgWireConnectionState::AuthenticationInProgress);
                let mechanisms = vec![SCRAM_SHA_256.to_string()];
                client
                    .send(PgWireBackendMessage::Authentication(Authentication::SASL(
                        mechanisms,
                    )))
                    .await?;
            }
            PgWireFrontendMessage::PasswordMessageFamily(message) => {
                let user = client
                    .metadata()
                    .get(METADATA_USER)
                    .cloned()
                    .ok_or(PgWireError::UserNameRequired)?;
                let first = matches!(*self.lock(), Login::Started);
                let data = if first {
                    let initial = message.into_sasl_initial_response()?;
                    if initial.auth_method != SCRAM_SHA_256 {
                        return Err(PgWireError::UnsupportedSASLAuthMethod(initial.auth_method));
                    }
                    initial.data.unwrap_or_default()
                } else {
                    message.into_sasl_response()?.data
                };
                let reply = self.scram_step(&user, &data)?;
                let finished = matches!(reply, Authentication::SASLFinal(_));
                client
                    .send(PgWireBackendMessage::Authentication(reply))
                    .await?;
                if finished {
                    self.engine.act_as(Some(user));
                    admit(client, &self.connections, &self.pids).await?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}
