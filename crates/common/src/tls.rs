//! TLS on the client ports (PostgreSQL, the console): the node's certificate chain and key
//! (PEM) as a rustls acceptor, with the ring provider.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
pub use tokio_rustls::TlsAcceptor;

/// A TLS acceptor over the certificate chain and private key in `cert_pem` and `key_pem`;
/// the error names what is wrong with them.
pub fn tls_acceptor(cert_pem: &[u8], key_pem: &[u8]) -> Result<TlsAcceptor, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("the certificate file is not PEM certificates: {e}"))?;
    if chain.is_empty() {
        return Err("the certificate file holds no certificate".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("the key file holds no PEM private key: {e}"))?;
    let config =
        tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(ring_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| format!("the certificate and key do not make a TLS identity: {e}"))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The name every node certificate carries, which a node or client checks when it connects
/// to a node's internal port (the node's own id is checked by what it asks, not where).
pub const CLUSTER_SERVER_NAME: &str = "tessera";

/// The DNS name that makes a certificate node `id`'s.
pub fn node_dns_name(id: crate::NodeId) -> String {
    format!("node-{}.tessera", id.0)
}

/// The DNS name suffix of a client (an administrator's CLI, a test) certificate:
/// `<name>.client.tessera`.
pub const CLIENT_DNS_SUFFIX: &str = ".client.tessera";

/// The client certificate of the cluster's administrator (`tessera certs init` makes it):
/// it acts as the operator, who may do everything. Any other client certificate acts as
/// the user it names.
pub const ADMIN_CLIENT: &str = "admin";

/// The DNS name that makes a certificate client `name`'s.
pub fn client_dns_name(name: &str) -> String {
    format!("{name}{CLIENT_DNS_SUFFIX}")
}

/// Who a certificate of the cluster's CA speaks for, from its DNS names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertIdentity {
    Node(crate::NodeId),
    Client(String),
    /// A certificate of the cluster's CA that names neither: it may not call anything.
    Unknown(Vec<String>),
}

impl std::fmt::Display for CertIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CertIdentity::Node(id) => write!(f, "node {id}"),
            CertIdentity::Client(name) => write!(f, "client {name:?}"),
            CertIdentity::Unknown(names) if names.is_empty() => write!(f, "no Tessera identity"),
            CertIdentity::Unknown(names) => write!(f, "no Tessera identity (names {names:?})"),
        }
    }
}

/// Who the (already verified) certificate `der` speaks for.
pub fn cert_identity(der: &[u8]) -> Result<CertIdentity, String> {
    identity_of(&parse(der)?)
}

fn parse(der: &[u8]) -> Result<x509_parser::certificate::X509Certificate<'_>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    Ok(cert)
}

fn identity_of(
    cert: &x509_parser::certificate::X509Certificate<'_>,
) -> Result<CertIdentity, String> {
    let names: Vec<String> = cert
        .subject_alternative_name()
        .map_err(|e| format!("the certificate's names do not parse: {e}"))?
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    x509_parser::extensions::GeneralName::DNSName(dns) => Some(dns.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    for name in &names {
        if let Some(id) = name
            .strip_prefix("node-")
            .and_then(|rest| rest.strip_suffix(".tessera"))
            .and_then(|id| id.parse::<u64>().ok())
        {
            return Ok(CertIdentity::Node(crate::NodeId(id)));
        }
        if let Some(client) = name.strip_suffix(CLIENT_DNS_SUFFIX) {
            return Ok(CertIdentity::Client(client.to_string()));
        }
    }
    Ok(CertIdentity::Unknown(names))
}

/// Refuses a certificate outside its validity period, naming it: a node or client would
/// otherwise start and be refused by every peer's handshake, where the reason is easily
/// lost.
fn valid_now(cert: &x509_parser::certificate::X509Certificate<'_>) -> Result<(), String> {
    let validity = cert.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now > validity.not_after {
        return Err(format!(
            "the certificate expired on {} (make a new one with `tessera certs`)",
            validity.not_after
        ));
    }
    if now < validity.not_before {
        return Err(format!(
            "the certificate is not valid before {}",
            validity.not_before
        ));
    }
    Ok(())
}

/// The PEM files of mutual TLS on the internal port: the cluster's CA, and this node's (or
/// client's) certificate and key, read and checked once.
#[derive(Clone)]
pub struct MutualTls {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    /// Who `cert_pem` speaks for.
    pub identity: CertIdentity,
}

impl std::fmt::Debug for MutualTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        write!(f, "MutualTls({})", self.identity)
    }
}

impl MutualTls {
    /// Reads the CA, certificate and key files; the error names the file and what is wrong.
    pub fn load(
        ca: &std::path::Path,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<MutualTls, String> {
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))
        };
        let (ca_pem, cert_pem, key_pem) = (read(ca)?, read(cert)?, read(key)?);
        let first = |pem: &[u8], path: &std::path::Path| {
            CertificateDer::pem_slice_iter(pem)
                .next()
                .ok_or_else(|| format!("{} holds no PEM certificate", path.display()))?
                .map_err(|e| format!("{} is not PEM certificates: {e}", path.display()))
        };
        first(&ca_pem, ca)?;
        let own = first(&cert_pem, cert)?;
        // Parsed once: checked for its validity period, then read for its identity.
        let identity = parse(&own)
            .and_then(|parsed| {
                valid_now(&parsed)?;
                identity_of(&parsed)
            })
            .map_err(|e| format!("{}: {e}", cert.display()))?;
        PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| format!("{} holds no PEM private key: {e}", key.display()))?;
        Ok(MutualTls {
            ca_pem,
            cert_pem,
            key_pem,
            identity,
        })
    }

    /// The files `tessera certs` writes for `name` (`node-3`, `admin`) in `dir`: `ca.pem`,
    /// `<name>.pem`, `<name>.key`.
    pub fn from_dir(dir: &std::path::Path, name: &str) -> Result<MutualTls, String> {
        MutualTls::load(
            &dir.join("ca.pem"),
            &dir.join(format!("{name}.pem")),
            &dir.join(format!("{name}.key")),
        )
    }
}

/// Makes ring rustls's process-wide crypto provider, once, before any TLS configuration is
/// built (a second call does nothing).
pub fn install_ring_provider() {
    let _ = ring_provider().install_default();
}

/// ring's provider, with AES-128-GCM preferred over ring's default first choice, AES-256-GCM:
/// every replicated row crosses several TLS hops, and the 128-bit key takes 10 AES rounds
/// to the other's 14 (both are TLS 1.3 suites, AES-128-GCM the one every TLS 1.3 peer
/// must offer). A peer that offers only the others still gets them.
pub fn ring_provider() -> tokio_rustls::rustls::crypto::CryptoProvider {
    use tokio_rustls::rustls::CipherSuite;
    let mut provider = tokio_rustls::rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|suite| suite.suite() != CipherSuite::TLS13_AES_128_GCM_SHA256);
    provider
}

#[cfg(test)]
mod tests {
    use tokio_rustls::rustls::CipherSuite;

    #[test]
    fn aes_128_gcm_is_preferred_and_every_other_suite_still_offered() {
        let ours: Vec<CipherSuite> = super::ring_provider()
            .cipher_suites
            .iter()
            .map(|s| s.suite())
            .collect();
        let ring: Vec<CipherSuite> = tokio_rustls::rustls::crypto::ring::default_provider()
            .cipher_suites
            .iter()
            .map(|s| s.suite())
            .collect();
        assert_eq!(ours[0], CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert_ne!(ring[0], ours[0], "ring's own first choice is another suite");
        let (mut sorted_ours, mut sorted_ring) = (ours.clone(), ring.clone());
        sorted_ours.sort_by_key(|s| u16::from(*s));
        sorted_ring.sort_by_key(|s| u16::from(*s));
        assert_eq!(sorted_ours, sorted_ring);
    }
}
