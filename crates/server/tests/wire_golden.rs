//! The node-to-node wire format, pinned: one sample of every request (action bodies,
//! `do_get` tickets, `do_put` descriptors), every reply and every metadata command, encoded
//! exactly as it travels, compared byte for byte with `tests/golden/wire.txt`.
//!
//! A refactoring that moves these types between modules or crates must leave this file
//! unchanged; a deliberate change of the protocol bumps `PROTOCOL_VERSION` and regenerates
//! it with `TESSERA_BLESS=1 cargo test -p tessera-server --test wire_golden`.

use arrow::datatypes::{DataType, Field, Schema};
use openraft::{CommittedLeaderId, EntryPayload, LogId, Membership, Vote};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use tessera_common::{ChannelId, ComponentHash, Epoch, Lsn, NodeId, PartitionId, QueryId, StageId};
use tessera_exec::run::{RunRequest, StageTask, StagesEvent};
use tessera_exec::ChannelReport;
use tessera_server::meta::retention::Retention;
use tessera_server::meta::{
    LineageEntry, MetaCommand, MetaResponse, MetaState, TableChangeCount, TypeConfig,
};
use tessera_server::rpc::*;
use tessera_server::server::{NodeStatus, TableCount};
use tessera_storage::evolution::AlterColumn;
use tessera_storage::{ComponentMeta, TableDef};

const CLUSTER: &str = "golden";

#[path = "wire_golden/meta_commands.rs"]
mod meta_commands;
use meta_commands::meta_commands;

/// Every sample, named, in a fixed order.
struct Samples(Vec<(String, String)>);

impl Samples {
    /// A request body as it travels inside its envelope.
    fn request<T: Serialize>(&mut self, name: &str, body: T) {
        let bytes = encode_envelope(CLUSTER, PROTOCOL_VERSION, body);
        self.0
            .push((name.to_string(), String::from_utf8(bytes).unwrap()));
    }

    /// A `do_get` ticket or `do_put` descriptor: the request tagged with its kind.
    fn tagged<R: WireRequest>(&mut self, name: &str, request: R) {
        let bytes = tessera_net::encode_request(CLUSTER, PROTOCOL_VERSION, &request);
        self.0
            .push((name.to_string(), String::from_utf8(bytes).unwrap()));
    }

    /// A reply or a stored value, as plain JSON.
    fn value<T: Serialize>(&mut self, name: &str, value: &T) {
        self.0
            .push((name.to_string(), serde_json::to_string(value).unwrap()));
    }

    fn text(&self) -> String {
        self.0
            .iter()
            .map(|(name, json)| format!("{name}: {json}\n"))
            .collect()
    }
}

fn kv_def() -> TableDef {
    let schema = Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Utf8, true),
    ]);
    let mut def = TableDef::new("kv", schema, vec!["k".into()], None).unwrap();
    def.generation = 7;
    def
}

fn component() -> ComponentMeta {
    ComponentMeta {
        hash: ComponentHash::of_bytes(b"a component"),
        rows: 10,
        bytes: 2048,
        min_lsn: Lsn(1),
        max_lsn: Lsn(9),
        min_epoch: Epoch(2),
        max_epoch: Epoch(3),
        unique_keys: true,
        tombstones: 1,
        layout: 0,
        superseded_at: Epoch::ZERO,
    }
}

fn sample_archived_component() -> tessera_meta::archive::ArchivedComponent {
    tessera_meta::archive::ArchivedComponent {
        partition: PartitionId(3),
        component: ComponentMeta {
            hash: ComponentHash::of_bytes(b"an archived component"),
            rows: 1000,
            bytes: 40_000,
            min_lsn: Lsn(0),
            max_lsn: Lsn(0),
            min_epoch: Epoch(2),
            max_epoch: Epoch(9),
            unique_keys: true,
            tombstones: 0,
            layout: 0,
            superseded_at: Epoch::ZERO,
        },
        data_fragments: 4,
        parity_fragments: 2,
        fragments: (0..6)
            .map(|i| tessera_meta::archive::ArchivedFragment {
                index: i,
                node: NodeId(i as u64 + 1),
                hash: ComponentHash::of_bytes(&[i as u8]),
            })
            .collect(),
    }
}

fn sample_archived_epoch() -> tessera_meta::archive::ArchivedEpoch {
    tessera_meta::archive::ArchivedEpoch {
        table: "kv".into(),
        generation: 7,
        epoch: Epoch(9),
        components: vec![sample_archived_component()],
        next_change: None,
    }
}

fn log_id(index: u64) -> LogId<NodeId> {
    LogId::new(CommittedLeaderId::new(3, NodeId(1)), index)
}

fn samples() -> Samples {
    let mut s = Samples(Vec::new());

    // Actions.
    s.request(ACTION_HELLO, ());
    let entries: Vec<openraft::Entry<TypeConfig>> = vec![
        openraft::Entry {
            log_id: log_id(5),
            payload: EntryPayload::Normal(MetaCommand::LineageEnd { query: QueryId(9) }),
        },
        openraft::Entry {
            log_id: log_id(6),
            payload: EntryPayload::Membership(Membership::new(
                vec![BTreeSet::from([NodeId(1), NodeId(2), NodeId(3)])],
                None,
            )),
        },
        openraft::Entry {
            log_id: log_id(7),
            payload: EntryPayload::Blank,
        },
    ];
    s.request(
        ACTION_RAFT_APPEND,
        openraft::raft::AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(3, NodeId(1)),
            prev_log_id: Some(log_id(4)),
            entries,
            leader_commit: Some(log_id(4)),
        },
    );
    s.request(
        ACTION_RAFT_VOTE,
        openraft::raft::VoteRequest::<NodeId> {
            vote: Vote::new(4, NodeId(2)),
            last_log_id: Some(log_id(7)),
        },
    );
    s.request(
        ACTION_RAFT_SNAPSHOT,
        openraft::raft::InstallSnapshotRequest::<TypeConfig> {
            vote: Vote::new_committed(3, NodeId(1)),
            meta: openraft::SnapshotMeta {
                last_log_id: Some(log_id(7)),
                last_membership: openraft::StoredMembership::new(
                    Some(log_id(6)),
                    Membership::new(
                        vec![BTreeSet::from([NodeId(1), NodeId(2), NodeId(3)])],
                        None,
                    ),
                ),
                snapshot_id: "3-1-7".into(),
            },
            offset: 0,
            data: b"{}".to_vec(),
            done: true,
        },
    );
    for (name, command) in meta_commands() {
        s.request(&format!("{ACTION_META_WRITE} {name}"), command);
    }
    s.request(
        ACTION_HEARTBEAT,
        (
            Heartbeat {
                node_id: NodeId(2),
                working_on: vec![],
                allocating: vec![],
                applied_index: 0,
            },
            vec![3u64],
        ),
    );
    s.request(
        &format!("{ACTION_HEARTBEAT} working"),
        (
            Heartbeat {
                node_id: NodeId(2),
                working_on: vec![Epoch(4)],
                allocating: vec![],
                applied_index: 0,
            },
            Vec::<u64>::new(),
        ),
    );
    s.request(
        &format!("{ACTION_HEARTBEAT} allocating"),
        (
            Heartbeat {
                node_id: NodeId(2),
                working_on: vec![Epoch(4)],
                allocating: vec![0xa110c],
                applied_index: 57,
            },
            Vec::<u64>::new(),
        ),
    );
    s.request(ACTION_STATUS, ());
    s.request(ACTION_CURRENT_METADATA, ());
    s.request(ACTION_READ_INDEX, ());
    s.request(ACTION_QUERY_END, 0xfeedu64);
    s.request(ACTION_DECOMMISSION, 3u64);
    s.request(ACTION_FLUSH, ());
    s.request(ACTION_SETTLE, ());
    s.request(
        ACTION_SHIPPED_MANIFEST,
        ("kv".to_string(), 7u64, PartitionId(3)),
    );
    s.request(
        tessera_server::verify::ACTION_PARTITION_DIGESTS,
        tessera_server::verify::DigestsRequest {
            table: "kv".into(),
            partitions: vec![PartitionId(3)],
            through: Epoch(9),
            formats: BTreeMap::new(),
        },
    );
    s.request(
        &format!(
            "{} formats",
            tessera_server::verify::ACTION_PARTITION_DIGESTS
        ),
        tessera_server::verify::DigestsRequest {
            table: "kv".into(),
            partitions: vec![PartitionId(3)],
            through: Epoch(9),
            formats: BTreeMap::from([(Epoch(8), tessera_storage::digest::DigestFormat::Columns)]),
        },
    );
    s.request(
        tessera_server::scrub::ACTION_SCRUB,
        tessera_server::scrub::ScrubRequest { everywhere: true },
    );
    s.request(
        tessera_exec::remote_snapshot::ACTION_SNAPSHOT_MANIFEST,
        tessera_exec::remote_snapshot::ManifestRequest {
            table: "kv".into(),
            generation: 7,
            epoch: Epoch(9),
            partitions: vec![PartitionId(0), PartitionId(3)],
        },
    );
    s.request(tessera_server::node::ACTION_REPLACE_NODE, NodeId(3));
    s.request(
        tessera_replication::archive::ACTION_ARCHIVE_PARTITION,
        tessera_replication::archive::ArchivePartitionRequest {
            table: "kv".into(),
            generation: 7,
            epoch: Epoch(9),
            partition: PartitionId(3),
            data_fragments: 4,
            parity_fragments: 2,
            nodes: (1..=6).map(NodeId).collect(),
        },
    );
    s.request(
        tessera_replication::archive::ACTION_REBUILD_FRAGMENT,
        tessera_replication::archive::RebuildFragmentRequest {
            component: sample_archived_component(),
            index: 2,
        },
    );
    s.request(
        tessera_server::table_statistics::ACTION_TABLE_STATISTICS,
        tessera_server::table_statistics::StatisticsRequest {
            table: "kv".into(),
            generation: 7,
            epoch: Epoch(9),
        },
    );
    s.request(
        tessera_server::verify::ACTION_VERIFY,
        tessera_server::verify::VerifyRequest {
            table: Some("kv".into()),
            epoch: Some(Epoch(4)),
            repair: true,
        },
    );
    s.request(
        ACTION_COMPONENTS_READY,
        ComponentsRequest {
            partitions: vec![("kv".into(), 7, PartitionId(3))],
        },
    );
    s.request(
        ACTION_COPY_PARTITIONS,
        CopyRequest {
            moves: vec![
                PartitionMove {
                    partition: PartitionId(1),
                    source: NodeId(2),
                    since: Epoch(0),
                },
                PartitionMove {
                    partition: PartitionId(2),
                    source: NodeId(1),
                    since: Epoch(5),
                },
            ],
            tables: vec![("kv".into(), 7)],
            epoch: Some(Epoch(9)),
        },
    );
    s.request(
        ACTION_PREFETCH_COMPONENTS,
        CopyRequest {
            moves: vec![PartitionMove {
                partition: PartitionId(1),
                source: NodeId(2),
                since: Epoch(0),
            }],
            tables: vec![("kv".into(), 7)],
            epoch: None,
        },
    );

    // `do_get` tickets.
    s.tagged(
        "get scan",
        ScanRequest {
            table: "kv".into(),
            generation: 7,
            epoch: Epoch(4),
            partitions: vec![PartitionId(0), PartitionId(2)],
            columns: vec![0, 1],
            changes_since: None,
            order: Default::default(),
        },
    );
    s.tagged(
        "get versions",
        VersionsRequest {
            table: "kv".into(),
            generation: 7,
            partition: PartitionId(1),
            since: Epoch(3),
        },
    );
    s.tagged(
        "get sql",
        SqlRequest {
            sql: "SELECT 1".into(),
        },
    );
    s.tagged(
        "get export",
        ExportRequest {
            table: "kv".into(),
            generation: 7,
            partition: PartitionId(1),
        },
    );
    s.tagged(
        "get component",
        ComponentRequest {
            hash: ComponentHash::of_bytes(b"a component"),
        },
    );
    s.tagged(
        "get fragment",
        tessera_replication::archive::FragmentRequest {
            hash: ComponentHash::of_bytes(b"a fragment"),
        },
    );
    s.tagged(
        "put fragment",
        tessera_replication::archive::StoreFragmentRequest {
            hash: ComponentHash::of_bytes(b"a fragment"),
        },
    );
    s.tagged(
        "get run-stages",
        RunRequest {
            query: QueryId(0xfeed),
            initiator: NodeId(1),
            stages: vec![StageTask {
                stage: StageId(2),
                fragment: "0a0b".into(),
                channels: vec![ChannelId(0), ChannelId(3)],
            }],
            lineage: true,
            memory_limit: None,
            execution: Default::default(),
        },
    );
    s.tagged(
        "get spool",
        SpoolRequest {
            query: QueryId(0xfeed),
            exchange: StageId(2),
            channel: ChannelId(1),
            bucket: 4,
        },
    );

    // `do_put` descriptors.
    s.tagged(
        "put prepare",
        PrepareRequest {
            epoch: Epoch(4),
            table: "kv".into(),
            deletes: false,
            before_images: false,
            forward: vec![Forward {
                node: NodeId(2),
                partitions: vec![PartitionId(1)],
                last_copy: false,
            }],
            as_logged: false,
        },
    );
    s.tagged(
        "put publish",
        PublishRequest {
            table: "kv".into(),
            deletes: true,
        },
    );
    s.tagged(
        "put exchange",
        ExchangeHeader {
            query: QueryId(0xfeed),
            exchange: StageId(2),
            sender: ChannelId(1),
            senders_per_bucket: 4,
            buckets: vec![0, 2],
            lineage: true,
        },
    );
    s.value(
        "exchange batch tag",
        &tessera_exec::exchange::BatchTag { bucket: 2, seq: 17 },
    );

    // Replies.
    s.value(
        "identity",
        &Identity {
            node_id: NodeId(2),
            cluster_id: CLUSTER.into(),
            protocol: PROTOCOL_VERSION,
        },
    );
    s.value(
        "prepare reply",
        &PrepareReply {
            unreachable: vec![NodeId(3)],
        },
    );
    for refusal in [
        Refusal::WrongCluster {
            node_id: NodeId(2),
            cluster_id: "other".into(),
        },
        Refusal::VersionMismatch {
            node_id: NodeId(2),
            protocol: 9,
        },
        Refusal::NotLeader {
            leader: Some(NodeId(1)),
        },
        Refusal::Aborted {
            epoch: Epoch(7),
            detail: "epoch 7 aborted: a replica refused".into(),
        },
        Refusal::Failed("no such table".into()),
    ] {
        s.value("refusal", &refusal);
        s.value("refused reply", &Err::<(), Refusal>(refusal));
    }
    s.value("empty reply", &Ok::<(), Refusal>(()));
    s.value("read-index reply", &Ok::<u64, Refusal>(12));
    s.value(
        "snapshot manifest reply",
        &Ok::<_, Refusal>(vec![tessera_exec::remote_snapshot::PartitionManifest {
            partition: PartitionId(3),
            components: vec![component()],
            memtable_ipc_hex: Some("ffffffff".into()),
        }]),
    );
    s.value(
        "table statistics reply",
        &Ok::<_, Refusal>(tessera_server::table_statistics::StatisticsReply {
            rows: Some(6001215),
            columns: Some(vec![10, 2, 8, 1]),
        }),
    );
    for response in [
        MetaResponse::Done,
        MetaResponse::Epoch(Epoch(4)),
        MetaResponse::Refused("why".into()),
        MetaResponse::TableBusy("kv".into()),
        MetaResponse::Fenced("failed".into()),
    ] {
        s.value("meta response", &Ok::<_, Refusal>(response));
    }
    for output in [
        SqlMark::Done {
            tag: "INSERT 0 3".into(),
            epoch: Some(Epoch(4)),
        },
        SqlMark::Notice {
            message: "a notice".into(),
            recovery: None,
        },
        SqlMark::Notice {
            message: "node 2 died".into(),
            recovery: Some(tessera_exec::RecoveryOutcome::Rebuilt {
                dead: NodeId(2),
                query: QueryId(0xfeed),
                channels: 3,
                replayed_batches: 12,
                placed: vec!["stage 2 channel(s) [1] on node 3".into()],
                replan_ms: 40,
            }),
        },
        SqlMark::Notice {
            message: "node 2 died".into(),
            recovery: Some(tessera_exec::RecoveryOutcome::Restarted {
                dead: NodeId(2),
                query: QueryId(0xfeed),
                restart: 1,
                lineage_gave_up: Some("why".into()),
            }),
        },
    ] {
        s.value("sql mark", &output);
    }
    s.value(
        "shipped manifest",
        &ShippedManifest {
            components: vec![component()],
            covered: Epoch(3),
        },
    );
    s.value("export components", &vec![component()]);
    s.value(
        "stages event report",
        &StagesEvent::Report(ChannelReport {
            stage: StageId(1),
            channel: ChannelId(2),
            node: NodeId(3),
            rows: 100,
            batches: 2,
            bytes_sent: 4096,
            started_us: 10,
            first_input_us: Some(20),
            finished_us: 30,
            error: None,
            sqlstate: None,
            spilled_bytes: 0,
            scanned: Default::default(),
        }),
    );
    s.value("stages event done", &StagesEvent::AllDone);
    s.value("publish reply", &Epoch(4));

    // The metadata state every node builds (also its Raft snapshot) and `tessera status`.
    let mut state = MetaState::default();
    for (index, (_, command)) in meta_commands().into_iter().enumerate() {
        if matches!(command, MetaCommand::DropTable { .. }) {
            continue;
        }
        state.apply(index as u64 + 1, command);
    }
    s.value("meta state", &state);
    s.value(
        "node status",
        &NodeStatus {
            node_id: NodeId(1),
            listen: "127.0.0.1:7001".into(),
            leader: Some(NodeId(1)),
            term: 3,
            applied_index: 12,
            meta: MetaState::default(),
            history: tessera_server::server::HistorySizes {
                epochs: 40,
                aborted: 2,
                audited: 7,
            },
            tables: vec![TableCount {
                name: "kv".into(),
                rows: 10,
                logged_rows: 2,
                partitions_with_data: 3,
            }],
            checkpoints_written: 0,
            transfers: tessera_server::rebalance::TransferCounts {
                whole_copies: 1,
                whole_rows: 100,
                delta_copies: 2,
                delta_versions: 30,
                leased_delta_versions: 5,
                prefetched_components: 4,
                leased_components: 1,
            },
            insecure: true,
            decoded: Some(tessera_sql::decoded::DecodedUsage {
                components: 22,
                columns: 44,
                bytes: 9 << 20,
                budget_bytes: 2 << 30,
            }),
            last_scrub: Some(tessera_server::scrub::ScrubReport {
                node: NodeId(1),
                started_at_ms: 1_763_632_800_250,
                elapsed_ms: 25,
                components: 128,
                fragments: 12,
                collected_fragments: 2,
                bytes: 4 << 20,
                damaged: vec!["orders p35: component ... is corrupt".into()],
                repaired: vec!["component ... replaced by another replica's copy".into()],
                unrepaired: vec![],
            }),
            cache: Some(tessera_exec::cache::CacheStatus {
                bytes: 1 << 20,
                files: 3,
                budget: 1 << 30,
                hit_bytes: 3 << 20,
                miss_bytes: 1 << 20,
            }),
            voters: vec![NodeId(1), NodeId(2), NodeId(3)],
            membership_joint: false,
            archive_waiting: vec!["table \"kv\" at epoch 9: k = 4, m = 2 needs 6 live storage nodes to place fragments on; 4 are live".into()],
        },
    );
    // Added after the rest, so the samples above keep their lines.
    s.tagged(
        "put prepare before images",
        PrepareRequest {
            epoch: Epoch(4),
            table: "kv".into(),
            deletes: false,
            before_images: true,
            forward: vec![],
            as_logged: false,
        },
    );
    s.request(
        tessera_recovery::held::ACTION_LOG_LINEAGE,
        (
            NodeId(2),
            vec![LineageEntry {
                query: QueryId(0xfeed),
                initiator: NodeId(1),
                exchange: StageId(3),
                bucket: 1,
                from: 12,
                runs: vec![(0, 4), (2, 1)],
            }],
        ),
    );
    s.tagged(
        "put prepare as logged",
        PrepareRequest {
            epoch: Epoch(4),
            table: "kv".into(),
            deletes: false,
            before_images: false,
            forward: vec![],
            as_logged: true,
        },
    );
    s.request(
        tessera_recovery::held::ACTION_LOG_OUTPUT,
        (NodeId(2), (QueryId(0xfeed), StageId(3), ChannelId(1))),
    );
    s
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/wire.txt")
}

#[test]
fn every_request_and_reply_encodes_as_pinned() {
    let actual = samples().text();
    let path = golden_path();
    if std::env::var_os("TESSERA_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (TESSERA_BLESS=1 writes it from the current encodings)",
            path.display()
        )
    });
    let mut expected_lines = expected.lines();
    for line in actual.lines() {
        let pinned = expected_lines.next().unwrap_or("<missing>");
        assert_eq!(
            line, pinned,
            "an encoding changed (first line is now, second was pinned)"
        );
    }
    assert_eq!(
        expected_lines.next(),
        None,
        "the golden file pins more samples than the test produces"
    );
}

/// Every action the server dispatches has a sample above.
#[test]
fn every_action_has_a_sample() {
    let samples = samples();
    let names: BTreeMap<&str, ()> = samples
        .0
        .iter()
        .map(|(name, _)| (name.split(' ').next().unwrap(), ()))
        .collect();
    for action in [
        ACTION_HELLO,
        ACTION_RAFT_APPEND,
        ACTION_RAFT_VOTE,
        ACTION_RAFT_SNAPSHOT,
        ACTION_META_WRITE,
        ACTION_HEARTBEAT,
        ACTION_STATUS,
        ACTION_CURRENT_METADATA,
        ACTION_READ_INDEX,
        ACTION_QUERY_END,
        ACTION_DECOMMISSION,
        ACTION_FLUSH,
        ACTION_SETTLE,
        ACTION_SHIPPED_MANIFEST,
        ACTION_COMPONENTS_READY,
        ACTION_COPY_PARTITIONS,
        ACTION_PREFETCH_COMPONENTS,
        tessera_server::verify::ACTION_PARTITION_DIGESTS,
        tessera_server::verify::ACTION_VERIFY,
        tessera_server::scrub::ACTION_SCRUB,
        tessera_server::table_statistics::ACTION_TABLE_STATISTICS,
        tessera_exec::remote_snapshot::ACTION_SNAPSHOT_MANIFEST,
        tessera_replication::archive::ACTION_ARCHIVE_PARTITION,
        tessera_replication::archive::ACTION_REBUILD_FRAGMENT,
        tessera_server::node::ACTION_REPLACE_NODE,
        tessera_recovery::held::ACTION_LOG_LINEAGE,
        tessera_recovery::held::ACTION_LOG_OUTPUT,
    ] {
        assert!(names.contains_key(action), "no sample of action {action}");
    }
}
