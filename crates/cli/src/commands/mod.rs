//! One module per `tessera` subcommand.

pub mod bench;
pub mod bench_clients;
pub mod bench_cluster;
pub mod bench_compute;
pub mod bench_diff;
pub mod bench_distributed;
pub mod bench_recovery;
pub mod bench_replication;
pub mod bench_security;
pub mod certs;
pub mod cluster_status;
pub mod demo;
pub mod export;
pub mod keys;
pub mod load;
pub mod local_cluster;
pub mod node;
pub mod publish;
pub mod publish_loop;
pub mod scrub;
pub mod sql;
pub mod status;
pub mod target;
pub mod timing;
pub mod up;
pub mod verify;
