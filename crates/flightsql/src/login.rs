//! Logging in to Flight SQL: a handshake with HTTP basic credentials (what ADBC and the
//! Flight SQL JDBC driver send for a user and password) checked against the user's SCRAM
//! secret, answered with a bearer token that every later call carries in its
//! `authorization` header. While the cluster has no users, every call is let through.
//!
//! The check sits in front of the whole gRPC service ([`RequireLogin`]), so no Flight SQL
//! method can be reached without it. On the way back it also names the undecodable
//! ticket or command behind arrow-flight's bare `DecodeError` answers.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tessera_common::auth::{basic_credentials, password_matches};
use tessera_sql::Sessions;
use tonic::Status;

/// How long a token stays good after its handshake.
const TOKEN_LIFETIME: Duration = Duration::from_secs(12 * 3600);

/// Tokens kept at most: past it, a handshake is refused until some expire (a client that
/// logs in over and over without end would otherwise grow the table without bound).
const MAX_TOKENS: usize = 100_000;

/// The handshake's gRPC path, the one call that needs no token.
const HANDSHAKE_PATH: &str = "/arrow.flight.protocol.FlightService/Handshake";

struct Token {
    user: String,
    expires: Instant,
}

/// The tokens this endpoint handed out.
pub struct Logins {
    sessions: Arc<dyn Sessions>,
    tokens: Mutex<HashMap<String, Token>>,
}

impl Logins {
    pub fn new(sessions: Arc<dyn Sessions>) -> Logins {
        Logins {
            sessions,
            tokens: Mutex::default(),
        }
    }

    /// Checks a handshake's `authorization` header; the bearer token for the session, or
    /// `None` where the cluster has no users (nothing to carry).
    pub fn handshake(&self, authorization: Option<&str>) -> Result<Option<String>, Status> {
        if !self.sessions.login_required() {
            return Ok(None);
        }
        let (user, password) = authorization.and_then(basic_credentials).ok_or_else(|| {
            Status::unauthenticated(
                "this cluster requires a login: connect with a user name and password",
            )
        })?;
        let secret = self.sessions.user_secret(&user);
        if !password_matches(secret.as_ref(), &user, &password) {
            return Err(Status::unauthenticated(format!(
                "password authentication failed for user \"{user}\""
            )));
        }
        let token = tessera_common::hex::to_hex(&tessera_common::auth::random_key());
        let mut tokens = self.tokens.lock().expect("tokens lock");
        let now = Instant::now();
        tokens.retain(|_, t| t.expires > now);
        if tokens.len() >= MAX_TOKENS {
            return Err(Status::resource_exhausted(format!(
                "{MAX_TOKENS} Flight SQL sessions are open on this node; reuse a token or wait for some to expire"
            )));
        }
        tokens.insert(
            token.clone(),
            Token {
                user,
                expires: now + TOKEN_LIFETIME,
            },
        );
        Ok(Some(token))
    }

    /// Whether a call to `path` with this `authorization` header may go on, and for which
    /// user (`None`: the cluster has no users yet, or the call is the handshake).
    fn admit(&self, path: &str, authorization: Option<&str>) -> Result<Option<String>, Status> {
        if path == HANDSHAKE_PATH || !self.sessions.login_required() {
            return Ok(None);
        }
        let token = authorization
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or_else(|| {
                Status::unauthenticated(
                    "log in first: the Flight SQL handshake with a user name and password gives the bearer token every call must carry",
                )
            })?;
        let tokens = self.tokens.lock().expect("tokens lock");
        match tokens.get(token.trim()) {
            // A dropped user's tokens end with it.
            Some(t)
                if t.expires > Instant::now() && self.sessions.user_secret(&t.user).is_some() =>
            {
                Ok(Some(t.user.clone()))
            }
            _ => Err(Status::unauthenticated(
                "the bearer token is unknown or expired: log in again",
            )),
        }
    }
}

/// The gRPC service behind a login check: a call without a good token is answered
/// `UNAUTHENTICATED` before it reaches any Flight SQL method.
/// arrow-flight answers a ticket or command it cannot decode with prost's bare
/// `DecodeError { .. }`: say what was wrong, and in which call.
fn name_decode_errors(
    method: &str,
    response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let message = response
        .headers()
        .get("grpc-message")
        .and_then(|value| value.to_str().ok())
        .map(percent_decode)
        .filter(|message| message.starts_with("DecodeError"));
    match message {
        Some(message) => Status::invalid_argument(format!(
            "{method}: the request is not a Flight SQL message (its ticket or command does not decode: {message})"
        ))
        .into_http(),
        None => response,
    }
}

/// A `grpc-message` header's text (percent-encoded on the wire).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

tokio::task_local! {
    /// The user the call being handled logged in as (its bearer token's), for the whole
    /// of its handler: the Flight SQL methods' signatures leave no room to pass it.
    static LOGGED_IN: Option<String>;
}

/// The user the current call logged in as; `None` on a cluster without users.
pub(crate) fn logged_in() -> Option<String> {
    LOGGED_IN.try_with(Clone::clone).ok().flatten()
}

#[derive(Clone)]
pub struct RequireLogin<S> {
    pub inner: S,
    pub logins: Arc<Logins>,
}

impl<S, B> tower::Service<http::Request<B>> for RequireLogin<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let authorization = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok());
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        match self.logins.admit(request.uri().path(), authorization) {
            Ok(user) => {
                let call = self.inner.call(request);
                Box::pin(LOGGED_IN.scope(user, async move {
                    call.await
                        .map(|response| name_decode_errors(&method, response))
                }))
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}
