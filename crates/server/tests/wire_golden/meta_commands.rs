//! Every metadata command, one sample each (and more where a field changed its encoding).

use super::*;

pub(crate) fn meta_commands() -> Vec<(&'static str, MetaCommand)> {
    vec![
        (
            "bootstrap",
            MetaCommand::Bootstrap {
                cluster_id: CLUSTER.into(),
                partition_count: 4,
                replication: 2,
                hot_standby: false,
                nodes: vec![
                    (NodeId(1), "127.0.0.1:7001".into()),
                    (NodeId(2), "127.0.0.1:7002".into()),
                ],
            },
        ),
        (
            "register-node",
            MetaCommand::RegisterNode {
                id: NodeId(3),
                addr: "127.0.0.1:7003".into(),
                compute: false,
            },
        ),
        (
            "register-compute-node",
            MetaCommand::RegisterNode {
                id: NodeId(7),
                addr: "127.0.0.1:7007".into(),
                compute: true,
            },
        ),
        (
            "set-liveness",
            MetaCommand::SetLiveness {
                id: NodeId(2),
                alive: false,
            },
        ),
        ("create-table", MetaCommand::CreateTable { def: kv_def() }),
        (
            "started",
            MetaCommand::Started {
                id: NodeId(1),
                incarnation: 1_700_000_000_000_000,
            },
        ),
        (
            "allocate-epoch",
            MetaCommand::AllocateEpoch {
                coordinator: NodeId(1),
                incarnation: 1_700_000_000_000_000,
                tables: vec!["kv".into()],
                request: 42,
                read_at: Default::default(),
            },
        ),
        (
            "commit-epoch",
            MetaCommand::CommitEpoch {
                epoch: Epoch(1),
                missed: vec![(PartitionId(3), NodeId(2))],
                changes: None,
                seal: None,
                min_copies: None,
            },
        ),
        (
            "abort-epoch",
            MetaCommand::AbortEpoch {
                epoch: Epoch(2),
                reason: "coordinator lost".into(),
            },
        ),
        (
            "set-partition-map",
            MetaCommand::SetPartitionMap {
                map: tessera_server::meta::PartitionMap::uniform(
                    4,
                    2,
                    &[NodeId(1), NodeId(2), NodeId(3)],
                ),
                rebalance: None,
            },
        ),
        ("leave", MetaCommand::Leave { id: NodeId(3) }),
        ("decommission", MetaCommand::Decommission { id: NodeId(3) }),
        (
            "lineage",
            MetaCommand::Lineage {
                node: NodeId(2),
                entries: vec![LineageEntry {
                    query: QueryId(0xfeed),
                    initiator: NodeId(1),
                    exchange: StageId(2),
                    bucket: 5,
                    from: 0,
                    runs: vec![(0, 3), (1, 2)],
                }],
            },
        ),
        (
            "lineage-end",
            MetaCommand::LineageEnd {
                query: QueryId(0xfeed),
            },
        ),
        (
            "commit-epoch-of-a-publish",
            MetaCommand::CommitEpoch {
                epoch: Epoch(1),
                missed: vec![],
                changes: Some(vec![TableChangeCount {
                    table: "kv".into(),
                    upserts: 10,
                    deletes: 2,
                }]),
                seal: Some(tessera_meta::EpochSeal {
                    versions: vec![tessera_meta::TableVersion {
                        table: "kv".into(),
                        previous: tessera_common::ComponentHash([0; 32]),
                        version: tessera_common::ComponentHash([0xab; 32]),
                    }],
                    signature: Some(tessera_meta::EpochSignature {
                        key: "11".repeat(32),
                        signature: "22".repeat(64),
                    }),
                    // Seals made before the format was recorded, as old logs hold them.
                    digest_format: tessera_storage::digest::DigestFormat::Rows,
                }),
                min_copies: None,
            },
        ),
        (
            "commit-epoch-of-a-publish-in-columns",
            MetaCommand::CommitEpoch {
                epoch: Epoch(2),
                missed: vec![],
                changes: Some(vec![TableChangeCount {
                    table: "kv".into(),
                    upserts: 3,
                    deletes: 0,
                }]),
                seal: Some(tessera_meta::EpochSeal {
                    versions: vec![tessera_meta::TableVersion {
                        table: "kv".into(),
                        previous: tessera_common::ComponentHash([0xab; 32]),
                        version: tessera_common::ComponentHash([0xcd; 32]),
                    }],
                    signature: None,
                    digest_format: tessera_storage::digest::DigestFormat::Columns,
                }),
                min_copies: None,
            },
        ),
        (
            "stamped",
            MetaCommand::Stamped {
                at_ms: 1_763_632_800_250,
                command: Box::new(MetaCommand::CreateTag {
                    name: "release_1".into(),
                    epoch: Some(Epoch(1)),
                }),
            },
        ),
        (
            "create-tag",
            MetaCommand::CreateTag {
                name: "nightly".into(),
                epoch: None,
            },
        ),
        (
            "drop-tag",
            MetaCommand::DropTag {
                name: "nightly".into(),
            },
        ),
        (
            "alter-table-add-column",
            MetaCommand::AlterTable {
                table: "kv".into(),
                alter: AlterColumn::Add {
                    field: Field::new("w", DataType::Int32, false),
                    default: Some("7".into()),
                },
            },
        ),
        (
            "alter-table-rename-column",
            MetaCommand::AlterTable {
                table: "kv".into(),
                alter: AlterColumn::Rename {
                    from: "v".into(),
                    to: "value".into(),
                },
            },
        ),
        (
            "alter-table-widen-column",
            MetaCommand::AlterTable {
                table: "kv".into(),
                alter: AlterColumn::Widen {
                    name: "w".into(),
                    to: DataType::Int64,
                },
            },
        ),
        (
            "alter-table-drop-column",
            MetaCommand::AlterTable {
                table: "kv".into(),
                alter: AlterColumn::Drop { name: "w".into() },
            },
        ),
        (
            "set-retention",
            MetaCommand::SetRetention {
                table: "kv".into(),
                retention: Retention {
                    epochs: Some(3),
                    for_ms: Some(7 * 24 * 3600 * 1000),
                    archive: false,
                },
            },
        ),
        (
            "create-participant",
            MetaCommand::CreateParticipant {
                name: "lab_a".into(),
            },
        ),
        (
            "create-user-in-participant",
            MetaCommand::CreateUser {
                name: "ada".into(),
                secret: tessera_common::auth::ScramSecret::from_verifier(
                    "SCRAM-SHA-256$4096:c3Nzc3Nzc3Nzc3Nzc3Nzcw==$a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s=:dnZ2dnZ2dnZ2dnZ2dnZ2dnZ2dnZ2dnZ2dnZ2dnZ2dnY=",
                )
                .expect("a verifier"),
                participant: Some("lab_a".into()),
            },
        ),
        (
            "grant",
            MetaCommand::Grant {
                user: "ada".into(),
                role: tessera_meta::Role::Writer,
            },
        ),
        (
            "revoke",
            MetaCommand::Revoke {
                user: "ada".into(),
                role: tessera_meta::Role::Admin,
            },
        ),
        (
            "set-table-owner",
            MetaCommand::SetTableOwner {
                table: "kv".into(),
                owner: "lab_b".into(),
            },
        ),
        (
            "add-participant-key",
            MetaCommand::AddParticipantKey {
                participant: "lab_a".into(),
                key: "11".repeat(32),
            },
        ),
        (
            "mark-corrupt",
            MetaCommand::MarkCorrupt {
                node: NodeId(2),
                partition: PartitionId(3),
                reason: "component damaged".into(),
            },
        ),
        (
            "as-user",
            MetaCommand::As {
                user: "ada".into(),
                command: Box::new(MetaCommand::AllocateEpoch {
                    coordinator: NodeId(1),
                    incarnation: 1_700_000_000_000_000,
                    tables: vec!["kv".into()],
                    request: 43,
                    read_at: Default::default(),
                }),
            },
        ),
        (
            "drop-participant",
            MetaCommand::DropParticipant {
                name: "lab_a".into(),
            },
        ),
        ("replace-node", MetaCommand::ReplaceNode { id: NodeId(3) }),
        (
            "record-archive",
            MetaCommand::RecordArchive {
                archived: sample_archived_epoch(),
            },
        ),
        (
            "move-fragment",
            MetaCommand::MoveFragment {
                component: ComponentHash::of_bytes(b"an archived component"),
                index: 5,
                to: NodeId(7),
            },
        ),
        (
            // Of a table that does not exist, so the state sample stays as it was.
            "allocate-epoch-read-at",
            MetaCommand::AllocateEpoch {
                coordinator: NodeId(1),
                incarnation: 1_700_000_000_000_000,
                tables: vec!["orders".into()],
                request: 44,
                read_at: [("orders".to_string(), Epoch(7))].into(),
            },
        ),
        ("drop-table", MetaCommand::DropTable { name: "kv".into() }),
    ]
}
