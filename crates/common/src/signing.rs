//! Participants' signing keys (ed25519): what makes an epoch's record provably the
//! publisher's (Pond's signed updates).
//!
//! A participant's secret key lives only with that participant: a file of 64 hex digits
//! (the 32-byte seed) in the `keys` directory of each node it runs, named
//! `<participant>.ed25519`. Its public key is registered in the metadata; anyone can then
//! check a record against it, and nobody without the file can make one that checks.

use crate::hex::{from_hex, to_hex};
use ed25519_dalek::Signer;
use std::path::{Path, PathBuf};

/// The file name extension of a secret key in a node's `keys` directory.
pub const KEY_FILE_EXTENSION: &str = "ed25519";

/// A participant's secret signing key.
pub struct SigningKey(ed25519_dalek::SigningKey);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        write!(f, "SigningKey(public {})", self.public_hex())
    }
}

impl SigningKey {
    /// A new key from the operating system's random source.
    pub fn generate() -> SigningKey {
        let mut seed = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut seed)
            .expect("the system's random source works");
        SigningKey(ed25519_dalek::SigningKey::from_bytes(&seed))
    }

    /// The key a key file holds; an error naming the file and what is wrong with it.
    pub fn read(path: &Path) -> Result<SigningKey, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read signing key {}: {e}", path.display()))?;
        let seed: [u8; 32] = from_hex(text.trim())
            .and_then(|bytes| bytes.try_into().ok())
            .ok_or_else(|| {
                format!(
                    "signing key {} is not 64 hex digits (an ed25519 seed)",
                    path.display()
                )
            })?;
        Ok(SigningKey(ed25519_dalek::SigningKey::from_bytes(&seed)))
    }

    /// Writes the key to `path`, readable by its owner only; refuses to overwrite a key.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        use std::io::Write;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(path).map_err(|e| {
            format!(
                "cannot create signing key {}: {e} (a key is never overwritten)",
                path.display()
            )
        })?;
        file.write_all(to_hex(&self.0.to_bytes()).as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|e| format!("cannot write signing key {}: {e}", path.display()))
    }

    /// The public key, as registered with the participant: 64 hex digits.
    pub fn public_hex(&self) -> String {
        to_hex(self.0.verifying_key().as_bytes())
    }

    /// The signature of `message`: 128 hex digits.
    pub fn sign_hex(&self, message: &[u8]) -> String {
        to_hex(&self.0.sign(message).to_bytes())
    }
}

/// Where a node keeps `participant`'s secret key, under its `keys` directory.
pub fn key_path(keys_dir: &Path, participant: &str) -> PathBuf {
    keys_dir.join(format!("{participant}.{KEY_FILE_EXTENSION}"))
}

/// Checks that `public_hex` is a well-formed ed25519 public key; the error names what is not.
pub fn check_public_key(public_hex: &str) -> Result<(), String> {
    parse_public(public_hex).map(|_| ())
}

fn parse_public(public_hex: &str) -> Result<ed25519_dalek::VerifyingKey, String> {
    let bytes: [u8; 32] = from_hex(public_hex)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format!("public key {public_hex:?} is not 64 hex digits"))?;
    ed25519_dalek::VerifyingKey::from_bytes(&bytes)
        .map_err(|e| format!("public key {public_hex:?} is not an ed25519 key: {e}"))
}

/// Checks `signature_hex` over `message` against `public_hex`; the error says why not.
pub fn verify(public_hex: &str, message: &[u8], signature_hex: &str) -> Result<(), String> {
    let key = parse_public(public_hex)?;
    let bytes: [u8; 64] = from_hex(signature_hex)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| "the signature is not 128 hex digits".to_string())?;
    key.verify_strict(message, &ed25519_dalek::Signature::from_bytes(&bytes))
        .map_err(|_| "the signature does not match the record and key".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_checks_only_for_its_message_and_key() {
        let key = SigningKey::generate();
        let other = SigningKey::generate();
        let signature = key.sign_hex(b"epoch 7");
        assert_eq!(verify(&key.public_hex(), b"epoch 7", &signature), Ok(()));
        assert!(verify(&key.public_hex(), b"epoch 8", &signature).is_err());
        assert!(verify(&other.public_hex(), b"epoch 7", &signature).is_err());
        assert!(verify(&key.public_hex(), b"epoch 7", "00").is_err());
        assert!(check_public_key("abc").is_err());
    }

    #[test]
    fn a_key_file_round_trips_and_is_never_overwritten() {
        let dir = std::env::temp_dir().join(format!("tessera-key-{}", std::process::id()));
        let path = key_path(&dir, "lab");
        let _ = std::fs::remove_file(&path);
        let key = SigningKey::generate();
        key.write(&path).unwrap();
        assert_eq!(
            SigningKey::read(&path).unwrap().public_hex(),
            key.public_hex()
        );
        assert!(SigningKey::generate().write(&path).is_err());
        std::fs::write(&path, "not a key").unwrap();
        let error = SigningKey::read(&path).unwrap_err();
        assert!(error.contains("64 hex digits"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
