//! One module per `tessera` subcommand.

pub mod bench;
pub mod demo;
pub mod load;
pub mod publish;
pub mod publish_loop;
pub mod sql;
pub mod status;
