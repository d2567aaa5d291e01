//! Passwords as SCRAM-SHA-256 secrets (RFC 5802, RFC 7677), the way PostgreSQL keeps them:
//! a salt, an iteration count and two keys derived from the password. The cluster stores
//! only the secret; neither key lets a reader log in (the client must prove it knows the
//! `ClientKey`, which the `StoredKey` only hashes) or recover the password.
//!
//! - [`ScramSecret`]: what is stored per user, and a direct password check for endpoints
//!   that receive the password itself over TLS (Flight SQL's basic-auth handshake).
//! - [`ScramServer`] / [`ScramPending`]: the server's side of the SCRAM exchange, which
//!   the PostgreSQL endpoint speaks, so the password never crosses the wire.

use ring::{digest, hmac, pbkdf2, rand::SecureRandom};
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;

/// PostgreSQL's default iteration count.
pub const SCRAM_ITERATIONS: u32 = 4096;

const KEY_LEN: usize = 32;

/// Why a login failed. The message a client sees is the same for an unknown user and a
/// wrong password, so it cannot tell which users exist.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("password authentication failed for user \"{0}\"")]
    Failed(String),
    #[error("malformed SCRAM message: {0}")]
    Malformed(String),
    #[error("SCRAM channel binding is not supported; connect without it (channel_binding=disable or prefer)")]
    ChannelBinding,
}

/// A user's stored password: salt, iterations, `StoredKey = H(ClientKey)` and `ServerKey`,
/// where `ClientKey` and `ServerKey` are HMACs of the salted password.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ScramSecret {
    pub iterations: u32,
    /// Base64, as SCRAM sends it.
    pub salt: String,
    /// Base64.
    pub stored_key: String,
    /// Base64.
    pub server_key: String,
}

impl ScramSecret {
    /// The secret of `password` with a fresh random salt.
    pub fn new(password: &str) -> ScramSecret {
        let mut salt = [0u8; 16];
        ring::rand::SystemRandom::new()
            .fill(&mut salt)
            .expect("the system's random source works");
        ScramSecret::with_salt(password, &salt, SCRAM_ITERATIONS)
    }

    pub fn with_salt(password: &str, salt: &[u8], iterations: u32) -> ScramSecret {
        let salted = salted_password(password, salt, iterations);
        let client_key = hmac_sha256(&salted, b"Client Key");
        ScramSecret {
            iterations,
            salt: b64(salt),
            stored_key: b64(digest::digest(&digest::SHA256, &client_key).as_ref()),
            server_key: b64(&hmac_sha256(&salted, b"Server Key")),
        }
    }

    /// PostgreSQL's text form, `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`
    /// (what `psql`'s `\password` computes and sends instead of the password).
    pub fn to_verifier(&self) -> String {
        format!(
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations, self.salt, self.stored_key, self.server_key
        )
    }

    /// The secret in a verifier, or `None` if `text` is not one (it is then a password).
    pub fn from_verifier(text: &str) -> Option<ScramSecret> {
        let rest = text.strip_prefix("SCRAM-SHA-256$")?;
        let (iterations_salt, keys) = rest.split_once('$')?;
        let (iterations, salt) = iterations_salt.split_once(':')?;
        let (stored_key, server_key) = keys.split_once(':')?;
        let decodes_to_key = |key: &str| unb64(key).is_ok_and(|k| k.len() == KEY_LEN);
        if !decodes_to_key(stored_key) || !decodes_to_key(server_key) || unb64(salt).is_err() {
            return None;
        }
        Some(ScramSecret {
            iterations: iterations.parse().ok().filter(|&i: &u32| i > 0)?,
            salt: salt.to_string(),
            stored_key: stored_key.to_string(),
            server_key: server_key.to_string(),
        })
    }

    /// A secret no password matches, the same for every call for `user` in this process:
    /// what a server answers with for an unknown user, so the exchange looks like a real
    /// one (asking twice shows the same salt, as for a real user).
    pub fn decoy(user: &str) -> ScramSecret {
        static DECOY_SEED: std::sync::LazyLock<[u8; 32]> = std::sync::LazyLock::new(random_key);
        ScramSecret::decoy_seeded(user, DECOY_SEED.as_ref())
    }

    fn decoy_seeded(user: &str, seed: &[u8]) -> ScramSecret {
        let salt = &hmac_sha256(seed, user.as_bytes())[..16];
        ScramSecret {
            iterations: SCRAM_ITERATIONS,
            salt: b64(salt),
            stored_key: b64(&[0u8; KEY_LEN]),
            server_key: b64(&[0u8; KEY_LEN]),
        }
    }

    /// Whether `password` is this secret's (for an endpoint handed the password itself).
    pub fn verify_password(&self, password: &str) -> bool {
        let Ok(salt) = unb64(&self.salt) else {
            return false;
        };
        let candidate = ScramSecret::with_salt(password, &salt, self.iterations);
        constant_time_eq(candidate.stored_key.as_bytes(), self.stored_key.as_bytes())
    }
}

/// The server's side of one SCRAM-SHA-256 exchange, before the client's first message.
pub struct ScramServer {
    pub user: String,
    pub secret: ScramSecret,
    /// Whether `secret` is a decoy (the user does not exist): the exchange then fails.
    pub known: bool,
}

/// After the server's first message: what checking the client's proof needs.
#[derive(Debug)]
pub struct ScramPending {
    user: String,
    secret: ScramSecret,
    known: bool,
    gs2_header: String,
    nonce: String,
    client_first_bare: String,
    server_first: String,
}

impl ScramServer {
    /// Answers the client's first message (`n,,n=user,r=nonce`) with the server's
    /// (`r=nonce+server nonce,s=salt,i=iterations`).
    pub fn server_first(self, client_first: &str) -> Result<(String, ScramPending), AuthError> {
        self.server_first_with_nonce(client_first, &random_nonce())
    }

    fn server_first_with_nonce(
        self,
        client_first: &str,
        server_nonce: &str,
    ) -> Result<(String, ScramPending), AuthError> {
        let (gs2_header, bare) = split_gs2_header(client_first)?;
        let client_nonce = attribute(bare, 'r')?;
        let nonce = format!("{client_nonce}{server_nonce}");
        let server_first = format!(
            "r={nonce},s={},i={}",
            self.secret.salt, self.secret.iterations
        );
        let pending = ScramPending {
            user: self.user,
            secret: self.secret,
            known: self.known,
            gs2_header: gs2_header.to_string(),
            nonce,
            client_first_bare: bare.to_string(),
            server_first: server_first.clone(),
        };
        Ok((server_first, pending))
    }
}

impl ScramPending {
    /// Checks the client's proof (`c=...,r=...,p=proof`); on success, the server's final
    /// message (`v=signature`), which proves to the client that the server knew its secret.
    pub fn client_final(self, client_final: &str) -> Result<String, AuthError> {
        let (without_proof, proof) = client_final.rsplit_once(",p=").ok_or_else(|| {
            AuthError::Malformed("the client's final message has no proof".into())
        })?;
        let binding = attribute(without_proof, 'c')?;
        if unb64(binding)? != self.gs2_header.as_bytes() {
            return Err(AuthError::Malformed(
                "the channel binding differs from the first message's".into(),
            ));
        }
        if attribute(without_proof, 'r')? != self.nonce {
            return Err(AuthError::Malformed("the nonce does not match".into()));
        }
        let auth_message = format!(
            "{},{},{without_proof}",
            self.client_first_bare, self.server_first
        );
        let stored_key = unb64(&self.secret.stored_key)?;
        let server_key = unb64(&self.secret.server_key)?;
        let proof = unb64(proof)?;
        let signature = hmac_sha256(&stored_key, auth_message.as_bytes());
        if proof.len() != signature.len() {
            return Err(AuthError::Failed(self.user));
        }
        let client_key: Vec<u8> = proof.iter().zip(&signature).map(|(p, s)| p ^ s).collect();
        let hashed = digest::digest(&digest::SHA256, &client_key);
        if !self.known || !constant_time_eq(hashed.as_ref(), &stored_key) {
            return Err(AuthError::Failed(self.user));
        }
        let verifier = hmac_sha256(&server_key, auth_message.as_bytes());
        Ok(format!("v={}", b64(&verifier)))
    }
}

/// Splits `n,,n=user,r=nonce` into its GS2 header (`n,,`) and the bare message. Channel
/// binding (`p=...`) is refused; `y,,` (the client could bind but thinks we cannot) is fine.
fn split_gs2_header(message: &str) -> Result<(&str, &str), AuthError> {
    let mut parts = message.splitn(3, ',');
    let flag = parts.next().unwrap_or_default();
    let authzid = parts
        .next()
        .ok_or_else(|| AuthError::Malformed("no GS2 header".into()))?;
    let bare = parts
        .next()
        .ok_or_else(|| AuthError::Malformed("no client-first message".into()))?;
    match flag {
        "n" | "y" => {}
        flag if flag.starts_with("p=") => return Err(AuthError::ChannelBinding),
        flag => {
            return Err(AuthError::Malformed(format!(
                "unknown channel binding flag {flag:?}"
            )))
        }
    }
    let header_len = flag.len() + authzid.len() + 2;
    Ok((&message[..header_len], bare))
}

/// The value of attribute `name` (`name=value`) in a comma-separated SCRAM message.
fn attribute(message: &str, name: char) -> Result<&str, AuthError> {
    message
        .split(',')
        .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
        .ok_or_else(|| AuthError::Malformed(format!("attribute {name} is missing")))
}

fn salted_password(password: &str, salt: &[u8], iterations: u32) -> [u8; KEY_LEN] {
    // SASLprep, as PostgreSQL does; a password it cannot normalize is used as it is.
    let normalized = stringprep::saslprep(password)
        .map(|p| p.into_owned())
        .unwrap_or_else(|_| password.to_string());
    let mut out = [0u8; KEY_LEN];
    pbkdf2::derive(
        pbkdf2::PBKDF2_HMAC_SHA256,
        NonZeroU32::new(iterations.max(1)).expect("at least one iteration"),
        salt,
        normalized.as_bytes(),
        &mut out,
    );
    out
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    hmac::sign(&key, message).as_ref().to_vec()
}

/// Whether `password` is `user`'s, given the user's secret if it exists. An unknown user's
/// password is checked against a decoy all the same, so the answer takes as long either
/// way and tells nothing of which users exist.
pub fn password_matches(secret: Option<&ScramSecret>, user: &str, password: &str) -> bool {
    match secret {
        Some(secret) => secret.verify_password(password),
        None => {
            let _ = ScramSecret::decoy(user).verify_password(password);
            false
        }
    }
}

/// The user and password of an HTTP `Authorization: Basic base64(user:password)` header.
pub fn basic_credentials(header: &str) -> Option<(String, String)> {
    use base64::engine::{general_purpose, DecodePaddingMode, GeneralPurpose};
    use base64::Engine;
    // Padding optional: Go's Flight client (under ADBC) encodes without it.
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        general_purpose::PAD.with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let encoded = header.strip_prefix("Basic ")?;
    let decoded = LENIENT.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

/// Passwords recently checked against their users' secrets, so a client that sends its
/// password with every request (HTTP basic authentication: the console polls once a
/// second) pays the deliberately slow PBKDF2 once, not per request. Per user, it keeps a
/// keyed hash of the last password that matched and the secret it matched: another
/// password, or a changed secret (`ALTER USER`), is checked in full again. The hash key is
/// random per process, so the hashes are of no use outside it.
pub struct VerifiedPasswords {
    key: [u8; 32],
    matched: std::sync::Mutex<std::collections::HashMap<String, (blake3::Hash, ScramSecret)>>,
    full_checks: std::sync::atomic::AtomicU64,
}

impl VerifiedPasswords {
    /// Users remembered at most; past it the list starts afresh.
    const USERS_KEPT: usize = 1024;

    pub fn new() -> VerifiedPasswords {
        VerifiedPasswords {
            key: random_key(),
            matched: Default::default(),
            full_checks: Default::default(),
        }
    }

    /// [`password_matches`], remembering a match.
    pub fn check(&self, secret: Option<&ScramSecret>, user: &str, password: &str) -> bool {
        let Some(secret) = secret else {
            return password_matches(None, user, password);
        };
        let digest = blake3::keyed_hash(&self.key, password.as_bytes());
        let matched = self.matched.lock().expect("verified passwords lock");
        // blake3::Hash compares in constant time.
        if matched
            .get(user)
            .is_some_and(|(known, for_secret)| *known == digest && for_secret == secret)
        {
            return true;
        }
        drop(matched);
        self.full_checks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ok = secret.verify_password(password);
        if ok {
            let mut matched = self.matched.lock().expect("verified passwords lock");
            if matched.len() >= Self::USERS_KEPT {
                matched.clear();
            }
            matched.insert(user.to_string(), (digest, secret.clone()));
        }
        ok
    }

    /// How many checks ran PBKDF2.
    pub fn full_checks(&self) -> u64 {
        self.full_checks.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Default for VerifiedPasswords {
    fn default() -> Self {
        Self::new()
    }
}

/// 32 bytes from the system's random source: a key or a seed.
pub fn random_key() -> [u8; 32] {
    let mut key = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut key)
        .expect("the system's random source works");
    key
}

fn random_nonce() -> String {
    let mut bytes = [0u8; 18];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system's random source works");
    b64(&bytes)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(text: &str) -> Result<Vec<u8>, AuthError> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| AuthError::Malformed(format!("bad base64: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7677, section 3: user "user", password "pencil".
    const CLIENT_FIRST: &str = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
    const SERVER_NONCE: &str = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
    const SALT: &str = "W22ZaJ0SNY7soEsUEjb6gQ==";
    const SERVER_FIRST: &str =
        "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
    const CLIENT_FINAL: &str = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=";
    const SERVER_FINAL: &str = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=";

    fn rfc_secret(password: &str) -> ScramSecret {
        ScramSecret::with_salt(password, &unb64(SALT).unwrap(), 4096)
    }

    fn exchange(secret: ScramSecret, known: bool, client_final: &str) -> Result<String, AuthError> {
        let server = ScramServer {
            user: "user".into(),
            secret,
            known,
        };
        let (first, pending) = server
            .server_first_with_nonce(CLIENT_FIRST, SERVER_NONCE)
            .unwrap();
        assert_eq!(first, SERVER_FIRST);
        pending.client_final(client_final)
    }

    #[test]
    fn the_rfc_7677_exchange_succeeds_with_its_server_signature() {
        assert_eq!(
            exchange(rfc_secret("pencil"), true, CLIENT_FINAL).unwrap(),
            SERVER_FINAL
        );
    }

    #[test]
    fn a_wrong_password_or_an_unknown_user_fails_alike() {
        let wrong = exchange(rfc_secret("pencil2"), true, CLIENT_FINAL).unwrap_err();
        assert_eq!(wrong, AuthError::Failed("user".into()));
        let unknown = exchange(rfc_secret("pencil"), false, CLIENT_FINAL).unwrap_err();
        assert_eq!(unknown.to_string(), wrong.to_string());
        let decoy = ScramServer {
            user: "user".into(),
            secret: ScramSecret::decoy_seeded("user", b"seed"),
            known: false,
        };
        let (first, pending) = decoy
            .server_first_with_nonce(CLIENT_FIRST, SERVER_NONCE)
            .unwrap();
        assert!(
            first.contains(",i=4096"),
            "a decoy looks like a real secret: {first}"
        );
        assert_eq!(pending.client_final(CLIENT_FINAL).unwrap_err(), wrong);
    }

    #[test]
    fn a_tampered_proof_or_nonce_is_refused() {
        let proof = CLIENT_FINAL.replace("p=dHzb", "p=dHzc");
        assert!(exchange(rfc_secret("pencil"), true, &proof).is_err());
        let nonce = CLIENT_FINAL.replace("r=rOpr", "r=xOpr");
        assert!(matches!(
            exchange(rfc_secret("pencil"), true, &nonce),
            Err(AuthError::Malformed(_))
        ));
        let no_proof = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
        assert!(exchange(rfc_secret("pencil"), true, no_proof).is_err());
    }

    #[test]
    fn channel_binding_is_refused_by_name() {
        let server = ScramServer {
            user: "user".into(),
            secret: rfc_secret("pencil"),
            known: true,
        };
        let bound = server.server_first("p=tls-server-end-point,,n=,r=abc");
        assert_eq!(bound.unwrap_err(), AuthError::ChannelBinding);
    }

    #[test]
    fn a_password_checks_against_its_secret_only() {
        let secret = ScramSecret::new("correct horse");
        assert!(secret.verify_password("correct horse"));
        assert!(!secret.verify_password("correct horse "));
        assert_ne!(
            ScramSecret::new("correct horse"),
            secret,
            "salts are random"
        );
        assert!(!ScramSecret::decoy("x").verify_password(""));
    }

    #[test]
    fn basic_credentials_are_read_and_anything_else_is_not() {
        let header = format!("Basic {}", b64(b"ada:pen:cil"));
        assert_eq!(
            basic_credentials(&header),
            Some(("ada".into(), "pen:cil".into()))
        );
        let unpadded = format!("Basic {}", b64(b"ada:pencil").trim_end_matches('='));
        assert_eq!(
            basic_credentials(&unpadded),
            Some(("ada".into(), "pencil".into()))
        );
        assert_eq!(basic_credentials("Bearer abc"), None);
        assert_eq!(basic_credentials("Basic !!!"), None);
    }

    #[test]
    fn an_unknown_user_never_matches() {
        let secret = ScramSecret::new("pencil");
        assert!(password_matches(Some(&secret), "ada", "pencil"));
        assert!(!password_matches(Some(&secret), "ada", "pen"));
        assert!(!password_matches(None, "bob", "pencil"));
    }

    #[test]
    fn a_verifier_round_trips_and_anything_else_is_a_password() {
        let secret = ScramSecret::new("pencil");
        assert_eq!(
            ScramSecret::from_verifier(&secret.to_verifier()),
            Some(secret)
        );
        for text in [
            "pencil",
            "SCRAM-SHA-256$4096:abc",
            "SCRAM-SHA-256$x:AAAA$AAAA:AAAA",
        ] {
            assert_eq!(ScramSecret::from_verifier(text), None, "{text}");
        }
    }

    #[test]
    fn a_matched_password_is_checked_in_full_once_until_the_secret_changes() {
        let passwords = VerifiedPasswords::new();
        let secret = ScramSecret::new("right");
        for _ in 0..3 {
            assert!(passwords.check(Some(&secret), "ann", "right"));
        }
        assert_eq!(
            passwords.full_checks(),
            1,
            "PBKDF2 ran once for three requests"
        );
        for _ in 0..2 {
            assert!(!passwords.check(Some(&secret), "ann", "wrong"));
        }
        assert_eq!(
            passwords.full_checks(),
            3,
            "a wrong password is never remembered"
        );
        assert!(!passwords.check(None, "bob", "right"), "an unknown user");
        let changed = ScramSecret::new("new");
        assert!(
            !passwords.check(Some(&changed), "ann", "right"),
            "the old password after ALTER USER"
        );
        assert!(passwords.check(Some(&changed), "ann", "new"));
        assert_eq!(passwords.full_checks(), 5);
    }
}
