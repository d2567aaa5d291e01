//! `tessera certs`: the certificates of mutual TLS on the internal port. `init` makes the
//! cluster's CA; `node` a node's certificate (server and client use, named
//! `node-<id>.tessera` and `tessera`, with the node's addresses); `client` an
//! administrator's or tool's (`<name>.client.tessera`, client use only). `tessera up` does
//! all of it by itself under its data directory.

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use tessera_common::tls::{client_dns_name, node_dns_name, CLUSTER_SERVER_NAME};
use tessera_common::NodeId;

/// How long a certificate is valid unless told otherwise.
pub const DEFAULT_VALID_DAYS: i64 = 365;

/// The name `tessera up` and the CLI use for the administrator's client certificate.
pub const ADMIN: &str = tessera_common::tls::ADMIN_CLIENT;

/// When a new certificate stops being valid.
#[derive(Debug, Clone, Copy)]
pub enum Expiry {
    Days(i64),
    /// `YYYY-MM-DD` (a date in the past makes an expired certificate, for tests).
    On(i32, u8, u8),
}

impl Expiry {
    pub fn parse(text: &str) -> Result<Expiry> {
        let parts: Vec<&str> = text.split('-').collect();
        let [year, month, day] = parts.as_slice() else {
            bail!("--not-after {text:?}: expected YYYY-MM-DD")
        };
        let number = |s: &str| {
            s.parse::<i32>()
                .with_context(|| format!("--not-after {text:?}: expected YYYY-MM-DD"))
        };
        let (year, month, day) = (number(year)?, number(month)?, number(day)?);
        if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
            bail!("--not-after {text:?}: no such date");
        }
        Ok(Expiry::On(year, month as u8, day as u8))
    }

    fn apply(self, params: &mut CertificateParams) {
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(2);
        params.not_after = match self {
            Expiry::Days(days) => now + time::Duration::days(days),
            Expiry::On(year, month, day) => rcgen::date_time_ymd(year, month, day),
        };
        if params.not_after <= params.not_before {
            // An already expired certificate: valid for one day, long ago.
            params.not_before = params.not_after - time::Duration::days(1);
        }
    }
}

/// Writes `name.pem` and `name.key` (readable by the owner only) into `dir`.
fn write_pair(dir: &Path, name: &str, cert_pem: &str, key_pem: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, cert_pem).with_context(|| format!("writing {}", cert.display()))?;
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&key)
            .with_context(|| format!("writing {}", key.display()))?;
        file.write_all(key_pem.as_bytes())?;
        file.sync_all()?;
    }
    Ok(cert)
}

/// Makes the cluster's CA in `dir` (`ca.pem`, `ca.key`); refuses to replace one.
pub fn init(dir: &Path, cluster: &str) -> Result<PathBuf> {
    if dir.join("ca.pem").exists() || dir.join("ca.key").exists() {
        bail!(
            "{} already holds a CA (ca.pem, ca.key): every certificate of the cluster comes from it; remove them first to start over",
            dir.display()
        );
    }
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("Tessera cluster CA {cluster}"));
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Expiry::Days(10 * DEFAULT_VALID_DAYS).apply(&mut params);
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    write_pair(dir, "ca", &cert.pem(), &key.serialize_pem())
}

/// The CA of `dir`, to sign with.
fn issuer(dir: &Path) -> Result<Issuer<'static, KeyPair>> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading {} (run `tessera certs init --dir {}` first)",
                path.display(),
                dir.display()
            )
        })
    };
    let key = KeyPair::from_pem(&read("ca.key")?).context("ca.key is not a PEM private key")?;
    Issuer::from_ca_cert_pem(&read("ca.pem")?, key).context("ca.pem is not a PEM certificate")
}

fn issue(
    dir: &Path,
    file_name: &str,
    names: Vec<String>,
    common_name: String,
    usages: Vec<ExtendedKeyUsagePurpose>,
    expiry: Expiry,
) -> Result<PathBuf> {
    let issuer = issuer(dir)?;
    let mut params = CertificateParams::new(names)?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = usages;
    expiry.apply(&mut params);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    write_pair(dir, file_name, &cert.pem(), &key.serialize_pem())
}

/// Issues node `id`'s certificate (`node-<id>.pem`, `.key`) for the hosts or IP
/// addresses in `hosts`.
pub fn node(dir: &Path, id: NodeId, hosts: &[String], expiry: Expiry) -> Result<PathBuf> {
    let mut names = vec![node_dns_name(id), CLUSTER_SERVER_NAME.to_string()];
    names.extend(hosts.iter().cloned());
    issue(
        dir,
        &format!("node-{}", id.0),
        names,
        format!("Tessera node {id}"),
        vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        expiry,
    )
}

/// Issues a client's certificate (`<name>.pem`, `.key`): the CLI of an administrator, a
/// tool.
pub fn client(dir: &Path, name: &str, expiry: Expiry) -> Result<PathBuf> {
    if name.is_empty()
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        || name.starts_with("node-")
        || name == "ca"
    {
        bail!("client name {name:?}: letters, digits and '-' only, not \"ca\" or node-N");
    }
    issue(
        dir,
        name,
        vec![client_dns_name(name)],
        format!("Tessera client {name}"),
        vec![ExtendedKeyUsagePurpose::ClientAuth],
        expiry,
    )
}

/// The CA, every node's certificate and the administrator's under `dir`, made if missing
/// (what `tessera up` uses).
pub fn ensure_local(dir: &Path, cluster: &str, ids: &[NodeId]) -> Result<()> {
    if !dir.join("ca.pem").exists() {
        init(dir, cluster)?;
    }
    for &id in ids {
        if !dir.join(format!("node-{}.pem", id.0)).exists() {
            node(
                dir,
                id,
                &["127.0.0.1".into(), "localhost".into()],
                Expiry::Days(DEFAULT_VALID_DAYS),
            )?;
        }
    }
    if !dir.join(format!("{ADMIN}.pem")).exists() {
        client(dir, ADMIN, Expiry::Days(DEFAULT_VALID_DAYS))?;
    }
    Ok(())
}
