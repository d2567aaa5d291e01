//! `tessera keys new`: a participant's signing key (see `tessera_common::signing`).

use anyhow::Result;
use std::path::Path;
use tessera_common::signing::{key_path, SigningKey};

/// Makes `participant`'s signing key in `keys_dir` (a node's `<data-dir>/keys`) and prints
/// how to register its public half.
pub fn new_key(keys_dir: &Path, participant: &str) -> Result<()> {
    let path = key_path(keys_dir, participant);
    let key = SigningKey::generate();
    key.write(&path).map_err(anyhow::Error::msg)?;
    println!("wrote {} (secret: copy it only to {participant}'s nodes, into their data directory's keys/)", path.display());
    println!("public key: {}", key.public_hex());
    println!(
        "register it (as the operator or an admin of {participant}):\n  ALTER PARTICIPANT {participant} ADD KEY '{}';",
        key.public_hex()
    );
    Ok(())
}
