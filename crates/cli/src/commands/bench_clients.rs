//! `tessera bench clients`: the TPC-H queries through each client path a team uses, on
//! one 3-node local cluster in one run: Tessera's internal client (the baseline), Arrow
//! Flight SQL (what ADBC speaks: `GetFlightInfo`, then `DoGet` of Arrow) and the
//! PostgreSQL wire protocol (the simple query protocol `psql` speaks, rows as text).
//! Each query runs once untimed per client (warming caches and checking that every client
//! got as many rows as the baseline), then `runs` times per client in turn; medians are
//! reported, with each client's ratio to the internal client and their geometric means.

use super::bench::{chosen_queries, median};
use super::local_cluster::{free_base_port, LocalCluster};
use super::timing::timed;
use super::up::UpOptions;
use anyhow::{bail, Context, Result};
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::sql::client::FlightSqlServiceClient;
use futures::TryStreamExt;
use std::path::Path;
use std::time::Duration;
use tessera_server::{ClusterClient, NodeConfig};

const NODES: u64 = 3;

/// The three ways into the cluster, all through node 1.
struct Clients {
    internal: ClusterClient,
    flight_sql: FlightSqlServiceClient<tonic::transport::Channel>,
    pg: tokio_postgres::Client,
}

impl Clients {
    async fn connect(cluster: &LocalCluster, pg_port: u16, flightsql_port: u16) -> Result<Clients> {
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{flightsql_port}"))?
                .connect()
                .await
                .context("connecting to Flight SQL")?;
        let (pg, connection) = tokio_postgres::connect(
            &format!("host=127.0.0.1 port={pg_port} user=tessera dbname=tessera"),
            tokio_postgres::NoTls,
        )
        .await
        .context("connecting to the PostgreSQL port")?;
        tokio::spawn(connection);
        Ok(Clients {
            internal: cluster.client(0),
            flight_sql: FlightSqlServiceClient::new_from_inner(
                FlightServiceClient::new(channel).max_decoding_message_size(256 << 20),
            ),
            pg,
        })
    }

    /// Rows of `sql` through the internal client.
    async fn internal(&self, sql: &str) -> Result<usize> {
        let batches = self.internal.query(sql).await?;
        Ok(batches.iter().map(|b| b.num_rows()).sum())
    }

    /// Rows of `sql` through Flight SQL: its FlightInfo, then every endpoint's Arrow.
    async fn flight_sql(&mut self, sql: &str) -> Result<usize> {
        let info = self.flight_sql.execute(sql.to_string(), None).await?;
        let mut rows = 0;
        for endpoint in info.endpoint {
            let ticket = endpoint
                .ticket
                .context("a Flight SQL endpoint without a ticket")?;
            let batches: Vec<_> = self.flight_sql.do_get(ticket).await?.try_collect().await?;
            rows += batches.iter().map(|b| b.num_rows()).sum::<usize>();
        }
        Ok(rows)
    }

    /// Rows of `sql` through the PostgreSQL simple query protocol, as text.
    async fn pg(&self, sql: &str) -> Result<usize> {
        let messages = self.pg.simple_query(sql).await?;
        Ok(messages
            .iter()
            .filter(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
            .count())
    }
}

pub async fn run(
    data_dir: &Path,
    partitions: u32,
    sf: f64,
    queries: &[usize],
    runs: usize,
) -> Result<()> {
    let queries = chosen_queries(queries, runs)?;
    let root = data_dir.join(format!("bench-clients-sf{sf}"));
    let mut options = UpOptions::new(NODES, partitions, 3);
    options.pg_base_port = Some(free_base_port(NODES)?);
    options.flightsql_base_port = Some(free_base_port(NODES)?);
    let mut cluster = LocalCluster::start_on_free_ports(&root, options)?;
    // A cluster kept from an earlier run keeps its configuration's ports.
    let first = NodeConfig::load(&root.join("node-1").join("node.toml"))?;
    let (Some(pg), Some(flightsql)) = (first.pg_listen, first.flightsql_listen) else {
        bail!(
            "{} holds a cluster without client ports; remove it and run again",
            root.display()
        );
    };
    let (pg_port, flightsql_port) = (pg.port(), flightsql.port());
    cluster.wait_formed(Duration::from_secs(60)).await?;
    super::bench_distributed::ensure_tpch(&cluster, sf, &format!("{NODES}-node cluster"), &root)
        .await?;
    let mut clients = Clients::connect(&cluster, pg_port, flightsql_port).await?;

    println!();
    println!(
        "TPC-H SF {sf} through each client, {NODES} nodes on this machine's {} cores: median of {runs} run(s)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>5} {:>14} {:>16} {:>12} {:>12} {:>10}",
        "query", "internal (ms)", "Flight SQL (ms)", "pgwire (ms)", "flight/int", "pg/int"
    );
    let (mut log_flight, mut log_pg) = (0.0f64, 0.0f64);
    for &q in &queries {
        let sql = tessera_tpch::query(q);
        let expected = clients.internal(sql).await?;
        let through_flight = clients.flight_sql(sql).await?;
        let through_pg = clients.pg(sql).await?;
        if through_flight != expected || through_pg != expected {
            bail!(
                "Q{q}: {expected} rows through the internal client, {through_flight} through Flight SQL, {through_pg} through pgwire"
            );
        }
        let (mut internal, mut flight, mut pg) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            internal.push(timed(|| clients.internal(sql)).await?.0);
            flight.push(timed(|| clients.flight_sql(sql)).await?.0);
            pg.push(timed(|| clients.pg(sql)).await?.0);
        }
        let ms = |times: &mut Vec<Duration>| median(times).as_secs_f64() * 1e3;
        let (internal, flight, pg) = (ms(&mut internal), ms(&mut flight), ms(&mut pg));
        let (flight_ratio, pg_ratio) = (flight / internal, pg / internal);
        log_flight += flight_ratio.ln();
        log_pg += pg_ratio.ln();
        println!(
            "{:>5} {internal:>14.1} {flight:>16.1} {pg:>12.1} {flight_ratio:>11.2}x {pg_ratio:>9.2}x",
            format!("Q{q}")
        );
    }
    let n = queries.len() as f64;
    println!();
    println!(
        "geomean: Flight SQL {:.3}x the internal client (goal <= 1.05x), pgwire {:.3}x (goal <= 1.3x)",
        (log_flight / n).exp(),
        (log_pg / n).exp()
    );
    Ok(())
}
