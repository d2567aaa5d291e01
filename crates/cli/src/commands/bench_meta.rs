//! `tessera bench meta`: what one publish costs the metadata state machine as the cluster's
//! history grows. Every node applies each Raft entry and then publishes a fresh view of the
//! state to its readers (`state_machine::publish_view`), so an entry's cost includes a
//! clone of the state; a history kept in plain maps makes that cost grow with every epoch
//! ever committed. The baseline is the same publishes measured on a young cluster, in the
//! same run.

use anyhow::{ensure, Result};
use std::time::{Duration, Instant};
use tessera_common::{ComponentHash, Epoch, NodeId};
use tessera_server::meta::state::{MetaCommand, MetaResponse, MetaState};
use tessera_server::meta::{EpochSeal, TableChangeCount, TableVersion};

/// Publishes timed at each measuring point.
const WINDOW: u64 = 1_000;

pub fn run(epochs: u64) -> Result<()> {
    ensure!(
        epochs >= 2 * WINDOW,
        "--epochs must be at least {}",
        2 * WINDOW
    );
    let mut cluster = History::new()?;
    println!("metadata cost per publish (2 Raft entries, each applied and its view published):");
    println!("{:>12} {:>14} {:>12}", "history", "µs/publish", "vs young");
    let young = cluster.time_window()?;
    println!("{:>12} {:>14.1} {:>12}", WINDOW, micros(young), "1.00x");
    let mut next_report = 10 * WINDOW;
    while cluster.epochs + WINDOW < epochs {
        let to = next_report.min(epochs - WINDOW);
        cluster.publish_untimed(to - cluster.epochs)?;
        let window = cluster.time_window()?;
        println!(
            "{:>12} {:>14.1} {:>11.2}x",
            cluster.epochs,
            micros(window),
            window.as_secs_f64() / young.as_secs_f64()
        );
        next_report *= 10;
    }
    let snapshot = serde_json::to_vec(&cluster.state)?.len();
    println!(
        "state after {} epochs: {:.1} MiB as JSON (a Raft snapshot, and `tessera status`'s metadata), {} records in the epoch log",
        cluster.epochs,
        snapshot as f64 / (1 << 20) as f64,
        cluster.state.epoch_log.len()
    );
    // The same history with the table's retention bounded: the epoch log is compacted
    // below every table's horizon, so the state stops growing.
    let mut bounded = History::new()?;
    bounded.apply(MetaCommand::SetRetention {
        table: "t".into(),
        retention: tessera_server::meta::Retention {
            epochs: Some(RETAINED_EPOCHS),
            for_ms: None,
            archive: false,
        },
    })?;
    let started = Instant::now();
    bounded.publish_untimed(cluster.epochs)?;
    let elapsed = started.elapsed();
    let snapshot = serde_json::to_vec(&bounded.state)?.len();
    println!(
        "with retain_epochs = {RETAINED_EPOCHS}: {:.2} MiB as JSON, {} records in the epoch log (compacted below epoch {}); {:.1} µs/publish over the whole run",
        snapshot as f64 / (1 << 20) as f64,
        bounded.state.epoch_log.len(),
        bounded.state.history_compacted_below,
        elapsed.as_secs_f64() * 1e6 / bounded.epochs as f64
    );
    Ok(())
}

/// The retention of the bounded run: the table's last versions kept.
const RETAINED_EPOCHS: u64 = 10;

fn micros(window: Duration) -> f64 {
    window.as_secs_f64() * 1e6 / WINDOW as f64
}

/// A one-table cluster's metadata, published to as a coordinator would.
struct History {
    state: MetaState,
    index: u64,
    epochs: u64,
    head: ComponentHash,
    clock_ms: u64,
}

impl History {
    fn new() -> Result<History> {
        let mut history = History {
            state: MetaState::default(),
            index: 0,
            epochs: 0,
            head: ComponentHash([0; 32]),
            clock_ms: 1_800_000_000_000,
        };
        history.apply(MetaCommand::Bootstrap {
            cluster_id: "bench".into(),
            partition_count: 64,
            replication: 3,
            hot_standby: false,
            nodes: (1..=3)
                .map(|id| (NodeId(id), format!("127.0.0.1:{id}")))
                .collect(),
        })?;
        let schema = arrow::datatypes::Schema::new(vec![arrow::datatypes::Field::new(
            "k",
            arrow::datatypes::DataType::Int64,
            false,
        )]);
        history.apply(MetaCommand::CreateTable {
            def: tessera_storage::TableDef::new("t", schema, vec!["k".into()], None)?,
        })?;
        Ok(history)
    }

    /// Applies `command` as the state machine does: the leader's stamp, then a fresh view.
    fn apply(&mut self, command: MetaCommand) -> Result<MetaResponse> {
        self.index += 1;
        self.clock_ms += 1;
        let stamped = MetaCommand::Stamped {
            at_ms: self.clock_ms,
            command: Box::new(command),
        };
        let (response, _) = self.state.apply(self.index, stamped);
        let view = std::hint::black_box(self.state.clone());
        drop(view);
        Ok(response)
    }

    fn publish(&mut self) -> Result<()> {
        let MetaResponse::Epoch(epoch) = self.apply(MetaCommand::AllocateEpoch {
            coordinator: NodeId(1),
            incarnation: 0,
            tables: vec!["t".into()],
            request: self.epochs + 1,
            read_at: Default::default(),
        })?
        else {
            anyhow::bail!("the metadata did not allocate an epoch");
        };
        let version = ComponentHash::of_bytes(&epoch.0.to_le_bytes());
        let committed = self.apply(MetaCommand::CommitEpoch {
            epoch,
            missed: vec![],
            changes: Some(vec![TableChangeCount {
                table: "t".into(),
                upserts: 1_000,
                deletes: 0,
            }]),
            seal: Some(EpochSeal {
                versions: vec![TableVersion {
                    table: "t".into(),
                    previous: self.head,
                    version,
                }],
                signature: None,
                digest_format: tessera_storage::digest::DigestFormat::CURRENT,
            }),
            min_copies: Some(2),
        })?;
        ensure!(
            committed == MetaResponse::Epoch(epoch),
            "epoch {epoch} did not commit: {committed:?}"
        );
        self.head = version;
        self.epochs += 1;
        debug_assert_eq!(self.state.visible, Epoch(epoch.0));
        Ok(())
    }

    fn publish_untimed(&mut self, count: u64) -> Result<()> {
        for _ in 0..count {
            self.publish()?;
        }
        Ok(())
    }

    fn time_window(&mut self) -> Result<Duration> {
        let started = Instant::now();
        self.publish_untimed(WINDOW)?;
        Ok(started.elapsed())
    }
}
