//! What every request travels in, and how a node opens it.

use crate::error::Refusal;
use crate::NodeId;
use serde::de::{DeserializeOwned, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use tessera_common::tls::CertIdentity;

/// Bumped whenever a request or reply changes shape.
///
/// 2: a prepare stream may carry before images (`PrepareRequest::before_images`), which a
/// node of version 1 would not know from upserts and would log as versions.
/// 3: nodes log their queries' lineage with the query's initiator (`log-lineage`), where
/// a node of version 2 wrote it to the metadata store, which an initiator of version 3
/// no longer reads.
/// 4: a client's SQL streams its answers back as a `do_get` reply (`SqlRequest`) in place
/// of the `sql` action, whose one JSON reply held the whole answer (and failed beyond the
/// 256 MiB message limit).
/// 5: a producer channel records with its query's initiator that its output starts
/// (`log-output`) before any of it leaves; an initiator of version 5 splits the rebuild
/// of a channel it holds no such record for, which a node of version 4 never sends.
pub const PROTOCOL_VERSION: u32 = 5;

/// The cluster id a client may send when it does not know it (SQL, publish, status).
pub const ANY_CLUSTER: &str = "*";

/// Every request's wrapper: who it is for.
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope<T> {
    pub cluster_id: String,
    pub protocol: u32,
    /// The node sending it, when a node sends it; under mutual TLS its certificate must
    /// name this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<NodeId>,
    pub body: T,
}

/// The bytes of one request as it travels: the action body, the `do_get` ticket or the
/// `do_put` descriptor command.
pub fn encode_envelope<T: Serialize>(cluster_id: &str, protocol: u32, body: T) -> Vec<u8> {
    encode_envelope_from(cluster_id, protocol, None, body)
}

/// [`encode_envelope`], sent by node `from` (if a node sends it).
pub fn encode_envelope_from<T: Serialize>(
    cluster_id: &str,
    protocol: u32,
    from: Option<NodeId>,
    body: T,
) -> Vec<u8> {
    serde_json::to_vec(&Envelope {
        cluster_id: cluster_id.to_string(),
        protocol,
        from,
        body,
    })
    .expect("requests serialize")
}

/// Who sent a request, as its connection shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// On a plaintext (`insecure = true`) port: nobody is verified.
    Plaintext,
    /// Under mutual TLS: the identity its certificate (of the cluster's CA) names.
    Certified(CertIdentity),
    /// Under mutual TLS, but no certificate reached the handler (should not happen: the
    /// handshake requires one).
    Uncertified,
}

/// The bytes of a `do_get` ticket or `do_put` descriptor: the request tagged with its kind,
/// in its envelope.
pub fn encode_request<R: WireRequest>(cluster_id: &str, protocol: u32, request: &R) -> Vec<u8> {
    encode_envelope(cluster_id, protocol, Tagged(request))
}

/// A `do_get` or `do_put` request, owned by the layer that serves it. It travels as
/// `{"<KIND>": <the request>}`, so a server can route it by kind before decoding it.
pub trait WireRequest: Serialize {
    /// The tag naming this kind of request on the wire; unique across all layers.
    const KIND: &'static str;
}

/// A request with its kind, as it travels.
pub(crate) struct Tagged<'a, R>(pub &'a R);

impl<R: WireRequest> Serialize for Tagged<'_, R> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(1))?;
        map.serialize_entry(R::KIND, self.0)?;
        map.end()
    }
}

/// A received `do_get` or `do_put` request: its kind, and its body still undecoded.
#[derive(Debug)]
pub struct TaggedRequest {
    pub kind: String,
    body: Box<RawValue>,
}

impl TaggedRequest {
    /// Decodes the body as the request type of this kind.
    pub fn decode<R: WireRequest + DeserializeOwned>(&self) -> Result<R, Refusal> {
        debug_assert_eq!(self.kind, R::KIND, "a request decoded as another kind");
        serde_json::from_str(self.body.get())
            .map_err(|e| Refusal::Failed(format!("malformed {} request: {e}", self.kind)))
    }
}

impl<'de> Deserialize<'de> for TaggedRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OneEntry;
        impl<'de> Visitor<'de> for OneEntry {
            type Value = TaggedRequest;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a request: an object with one entry, its kind")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TaggedRequest, A::Error> {
                let (kind, body): (String, Box<RawValue>) = map
                    .next_entry()?
                    .ok_or_else(|| serde::de::Error::custom("a request names its kind"))?;
                if map.next_key::<String>()?.is_some() {
                    return Err(serde::de::Error::custom("a request has one kind"));
                }
                Ok(TaggedRequest { kind, body })
            }
        }
        deserializer.deserialize_map(OneEntry)
    }
}

/// A node's check of the requests it receives: right cluster, right protocol version.
#[derive(Debug, Clone)]
pub struct Gate {
    pub node_id: NodeId,
    pub cluster_id: String,
    pub protocol: u32,
}

impl Gate {
    /// Opens a node-to-node request, refusing one for another cluster or protocol version,
    /// or from a caller whose certificate does not name the node it claims to be.
    pub fn open<T: DeserializeOwned>(&self, caller: &Caller, bytes: &[u8]) -> Result<T, Refusal> {
        let envelope = self.open_envelope(bytes)?;
        self.check_caller(caller, envelope.from)?;
        self.check_cluster(&envelope.cluster_id, false)?;
        Ok(envelope.body)
    }

    /// Opens a client request: clients may leave the cluster id open (`*`).
    pub fn open_from_client<T: DeserializeOwned>(
        &self,
        caller: &Caller,
        bytes: &[u8],
    ) -> Result<T, Refusal> {
        let envelope = self.open_envelope(bytes)?;
        self.check_caller(caller, envelope.from)?;
        self.check_cluster(&envelope.cluster_id, true)?;
        Ok(envelope.body)
    }

    /// Refuses a caller whose certificate does not speak for the node it claims to be (or
    /// that claims a node with a client's certificate, or names no one).
    pub fn check_caller(&self, caller: &Caller, claimed: Option<NodeId>) -> Result<(), Refusal> {
        let refuse = |reason: String| {
            Err(Refusal::Unauthenticated {
                node_id: self.node_id,
                reason,
            })
        };
        match (caller, claimed) {
            (Caller::Plaintext, _) => Ok(()),
            (Caller::Uncertified, _) => refuse("the caller presented no certificate".into()),
            (Caller::Certified(CertIdentity::Node(id)), Some(claimed)) if *id != claimed => {
                refuse(format!(
                    "the caller's certificate is node {id}'s, but it claims to be node {claimed}"
                ))
            }
            (Caller::Certified(CertIdentity::Node(_)), _) => Ok(()),
            (Caller::Certified(CertIdentity::Client(name)), Some(claimed)) => refuse(format!(
                "the caller's certificate is client {name:?}'s, but it claims to be node {claimed}"
            )),
            (Caller::Certified(CertIdentity::Client(_)), None) => Ok(()),
            (Caller::Certified(unknown @ CertIdentity::Unknown(_)), _) => refuse(format!(
                "the caller's certificate is of this cluster's CA but names {unknown}: not a node (node-N.tessera) or a client (NAME.client.tessera)"
            )),
        }
    }

    /// Opens an envelope, checking only its protocol version (the caller checks the
    /// cluster with [`Gate::check_cluster`] once it knows who may send the request).
    pub fn open_envelope<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<Envelope<T>, Refusal> {
        let envelope: Envelope<T> = serde_json::from_slice(bytes)
            .map_err(|e| Refusal::Failed(format!("malformed request: {e}")))?;
        if envelope.protocol != self.protocol {
            return Err(Refusal::VersionMismatch {
                node_id: self.node_id,
                protocol: self.protocol,
            });
        }
        Ok(envelope)
    }

    pub fn check_cluster(&self, cluster_id: &str, any_allowed: bool) -> Result<(), Refusal> {
        if cluster_id == self.cluster_id || (any_allowed && cluster_id == ANY_CLUSTER) {
            return Ok(());
        }
        Err(Refusal::WrongCluster {
            node_id: self.node_id,
            cluster_id: self.cluster_id.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct Versions {
        table: String,
        since: u64,
    }
    impl WireRequest for Versions {
        const KIND: &'static str = "Versions";
    }

    /// The enum the tagged form replaced: its encoding is the tagged form's.
    #[derive(Serialize)]
    enum Old {
        Versions { table: String, since: u64 },
    }

    #[test]
    fn a_tagged_request_encodes_as_an_enum_variant_did() {
        let new = serde_json::to_string(&Tagged(&Versions {
            table: "t".into(),
            since: 3,
        }))
        .unwrap();
        let old = serde_json::to_string(&Old::Versions {
            table: "t".into(),
            since: 3,
        })
        .unwrap();
        assert_eq!(new, old);
        let received: TaggedRequest = serde_json::from_str(&new).unwrap();
        assert_eq!(received.kind, "Versions");
        assert_eq!(
            received.decode::<Versions>().unwrap(),
            Versions {
                table: "t".into(),
                since: 3
            }
        );
    }

    #[test]
    fn malformed_requests_are_refused_by_name() {
        assert!(serde_json::from_str::<TaggedRequest>("{}").is_err());
        assert!(serde_json::from_str::<TaggedRequest>(r#"{"A":1,"B":2}"#).is_err());
        let wrong: TaggedRequest = serde_json::from_str(r#"{"Versions":{"table":1}}"#).unwrap();
        let refusal = wrong.decode::<Versions>().unwrap_err();
        assert!(format!("{refusal:?}").contains("malformed Versions request"));
    }

    #[test]
    fn the_gate_refuses_other_clusters_and_versions() {
        let gate = Gate {
            node_id: NodeId(1),
            cluster_id: "c".into(),
            protocol: PROTOCOL_VERSION,
        };
        let ours = encode_envelope("c", PROTOCOL_VERSION, 5u64);
        assert_eq!(gate.open::<u64>(&Caller::Plaintext, &ours).unwrap(), 5);
        let any = encode_envelope(ANY_CLUSTER, PROTOCOL_VERSION, 5u64);
        assert!(matches!(
            gate.open::<u64>(&Caller::Plaintext, &any),
            Err(Refusal::WrongCluster { .. })
        ));
        assert_eq!(
            gate.open_from_client::<u64>(&Caller::Plaintext, &any)
                .unwrap(),
            5
        );
        let old = encode_envelope("c", PROTOCOL_VERSION + 1, 5u64);
        assert!(matches!(
            gate.open::<u64>(&Caller::Plaintext, &old),
            Err(Refusal::VersionMismatch { .. })
        ));
    }

    #[test]
    fn the_gate_checks_that_a_certificate_speaks_for_the_node_it_claims() {
        let gate = Gate {
            node_id: NodeId(1),
            cluster_id: "c".into(),
            protocol: PROTOCOL_VERSION,
        };
        let from =
            |n: Option<u64>| encode_envelope_from("c", PROTOCOL_VERSION, n.map(NodeId), 5u64);
        let node2 = Caller::Certified(CertIdentity::Node(NodeId(2)));
        assert_eq!(gate.open::<u64>(&node2, &from(Some(2))).unwrap(), 5);
        assert_eq!(gate.open::<u64>(&node2, &from(None)).unwrap(), 5);
        let impostor = gate.open::<u64>(&node2, &from(Some(3))).unwrap_err();
        assert!(
            format!("{impostor:?}").contains("certificate is node 2's, but it claims to be node 3"),
            "{impostor:?}"
        );
        let admin = Caller::Certified(CertIdentity::Client("admin".into()));
        assert_eq!(
            gate.open_from_client::<u64>(&admin, &from(None)).unwrap(),
            5
        );
        assert!(gate.open::<u64>(&admin, &from(Some(1))).is_err());
        let nobody = Caller::Certified(CertIdentity::Unknown(vec!["example.com".into()]));
        assert!(gate.open::<u64>(&nobody, &from(None)).is_err());
        assert!(gate.open::<u64>(&Caller::Uncertified, &from(None)).is_err());
        assert_eq!(
            gate.open::<u64>(&Caller::Plaintext, &from(Some(3)))
                .unwrap(),
            5
        );
    }
}
