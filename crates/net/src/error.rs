//! Why a call to another node failed, and how a node says no.

use crate::NodeId;
use serde::{Deserialize, Serialize};

/// A refusal that the caller can act on, sent as the message of a gRPC error.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Refusal {
    WrongCluster {
        node_id: NodeId,
        cluster_id: String,
    },
    VersionMismatch {
        node_id: NodeId,
        protocol: u32,
    },
    NotLeader {
        leader: Option<NodeId>,
    },
    /// The publish's epoch was aborted: nothing of it is visible, and it may be retried.
    Aborted {
        epoch: tessera_common::Epoch,
        detail: String,
    },
    /// Under mutual TLS: the caller's certificate does not speak for who it claims to be.
    Unauthenticated {
        node_id: NodeId,
        reason: String,
    },
    Failed(String),
}

impl Refusal {
    pub fn into_status(self) -> tonic::Status {
        let code = match self {
            Refusal::Failed(_) => tonic::Code::Internal,
            Refusal::Unauthenticated { .. } => tonic::Code::Unauthenticated,
            _ => tonic::Code::FailedPrecondition,
        };
        tonic::Status::new(
            code,
            serde_json::to_string(&self).expect("refusals serialize"),
        )
    }

    pub fn from_status(status: &tonic::Status) -> Refusal {
        serde_json::from_str(status.message())
            .unwrap_or_else(|_| Refusal::Failed(status.message().to_string()))
    }

    /// A refusal for a failure the caller cannot act on beyond reporting it.
    pub fn failed(error: impl std::fmt::Display) -> Refusal {
        Refusal::Failed(error.to_string())
    }
}

/// Why a call to another node failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The node could not be reached or did not answer: it may be down.
    #[error("{0}")]
    Transport(String),
    /// The node answered and refused.
    #[error("{}", describe(.0))]
    Refused(Refusal),
    /// The address is not one a connection can be made to.
    #[error("bad node address {addr:?}: {reason}")]
    BadAddress { addr: String, reason: String },
    /// The node answered with something this node cannot read.
    #[error("undecodable {what} from {addr}: {reason}")]
    Undecodable {
        what: &'static str,
        addr: String,
        reason: String,
    },
}

/// How tonic begins the message of a status it made from an HTTP/2 error.
const H2_ERROR: &str = "h2 protocol error";
/// How tonic words a response body that ended partway through a message.
const CUT_MID_MESSAGE: &str = "Unexpected EOF decoding stream";

fn describe(refusal: &Refusal) -> String {
    match refusal {
        Refusal::Failed(reason) => reason.clone(),
        Refusal::Unauthenticated { node_id, reason } => {
            format!("node {node_id} refused the call: {reason}")
        }
        other => format!("{other:?}"),
    }
}

impl CallError {
    pub(crate) fn from_flight(error: arrow_flight::error::FlightError) -> CallError {
        match error {
            arrow_flight::error::FlightError::Tonic(status) => CallError::from_status(*status),
            other => CallError::Transport(other.to_string()),
        }
    }

    pub(crate) fn from_status(status: tonic::Status) -> CallError {
        match status.code() {
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Unknown => CallError::Transport(status.to_string()),
            // The peer's connection reset or went away mid-call (its process died): tonic
            // reports the HTTP/2 error as a status, though the peer answered nothing.
            tonic::Code::Internal if status.message().starts_with(H2_ERROR) => {
                CallError::Transport(status.to_string())
            }
            // The response body ended inside a message: the stream was cut, not answered.
            tonic::Code::Internal if status.message().starts_with(CUT_MID_MESSAGE) => {
                CallError::Transport(status.to_string())
            }
            _ => CallError::Refused(Refusal::from_status(&status)),
        }
    }

    /// The node may be down (as opposed to having answered).
    pub fn is_transport(&self) -> bool {
        matches!(self, CallError::Transport(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_reset_by_a_dying_peer_is_a_transport_error_not_a_refusal() {
        // What tonic reports when the peer's process died mid-stream.
        let reset = tonic::Status::internal("h2 protocol error: http2 error");
        assert!(CallError::from_status(reset).is_transport());
        // A peer that answered with an internal error refused.
        // A body that ended inside a message was cut off.
        let cut = tonic::Status::internal("Unexpected EOF decoding stream.");
        assert!(CallError::from_status(cut).is_transport());
        let refused = tonic::Status::internal("epoch 7 was already decided");
        assert!(!CallError::from_status(refused).is_transport());
    }
}
