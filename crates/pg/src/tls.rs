//! TLS on the PostgreSQL port: the node's certificate chain and key (PEM), offered to every
//! client that asks (`sslmode=require`, `verify-full`); a client that does not ask is
//! served in the clear, as PostgreSQL does without `hostssl`. The acceptor is the one the
//! console uses too: [`tessera_common::tls::tls_acceptor`].

pub use tessera_common::tls::tls_acceptor;
