//! Test harness: run the real `tessera` binary as child processes, kill them with SIGKILL,
//! and always stop what was started (by pid, also when a test panics).

pub mod netlab;
pub mod proxy;

pub use netlab::NetLab;
pub use proxy::{LinkFaults, LinkProxy};

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

/// A running `tessera` process, killed by pid when dropped.
pub struct TesseraProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl TesseraProcess {
    /// Starts `binary` with `--data-dir data_dir` and `args`, capturing stdout line by line.
    pub fn spawn(binary: &Path, data_dir: &Path, args: &[&str]) -> TesseraProcess {
        Self::spawn_command(Command::new(binary), data_dir, args)
    }

    /// As [`TesseraProcess::spawn`], for a command already naming the binary (run inside a
    /// network namespace, say); its stderr goes where the command says (inherited unless set).
    pub fn spawn_command(mut command: Command, data_dir: &Path, args: &[&str]) -> TesseraProcess {
        let mut child = command
            .arg("--data-dir")
            .arg(data_dir)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {command:?}: {e}"));
        let stdout: ChildStdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        TesseraProcess { child, lines }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended, if it has (reaping it).
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `timeout` for the next line of output; `None` on timeout or exit.
    pub fn next_line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// Every line printed so far and not yet read.
    pub fn drain_lines(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    /// Sends SIGKILL and reaps the process (unless it has already ended).
    pub fn kill9(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return; // Reaped: its pid may belong to another process by now.
        }
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }

    /// Sends `signal` (SIGSTOP to pause, SIGCONT to resume) to the process.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, signal);
        }
    }
}

impl Drop for TesseraProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill9();
        }
    }
}

/// Runs `tessera --data-dir data_dir args...` to completion.
pub fn run(binary: &Path, data_dir: &Path, args: &[&str]) -> Output {
    Command::new(binary)
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", binary.display()))
}

/// Runs SQL through `tessera sql -c ... --format csv` and returns the CSV rows without the
/// header; panics with stderr if the command fails.
pub fn sql_csv(binary: &Path, data_dir: &Path, extra: &[&str], sql: &str) -> Vec<Vec<String>> {
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["sql", "--format", "csv", "-c", sql]);
    let output = run(binary, data_dir, &args);
    assert!(
        output.status.success(),
        "`{sql}` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_string).collect())
        .collect()
}

/// A fresh temporary directory for one test's data.
pub fn temp_data_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let data = dir.path().join("data");
    (dir, data)
}

/// `n` distinct TCP ports on 127.0.0.1 that were free a moment ago, chosen below the
/// kernel's ephemeral range where there is room: a port given to a node that has not
/// bound it yet (not started, or being restarted) is otherwise free for the kernel to hand
/// to any outgoing connection, and the node then cannot listen ("address already in use").
///
/// No port is given out twice by one process ([`GIVEN_PORTS`]): the tests of one binary
/// run at once, each starting its own cluster, and a port one cluster was given stays
/// free until its node binds it (and again while the node restarts), so another test's
/// cluster could otherwise be given it too. One of the two nodes then failed to start
/// (`query_chaos`: "cannot listen on 127.0.0.1:20749 (pg_listen): Address already in
/// use", and the test failed loading its data).
pub fn free_ports(n: usize) -> Vec<u16> {
    let mut given = GIVEN_PORTS.lock().expect("given ports lock");
    let mut listeners: Vec<std::net::TcpListener> = Vec::with_capacity(n);
    let mut take = |listener: std::net::TcpListener, listeners: &mut Vec<_>| {
        let port = listener.local_addr().expect("local address").port();
        if given.insert(port) {
            listeners.push(listener);
        }
    };
    if let Some((low, high)) = below_ephemeral_range() {
        let mut rng = rand::rng();
        for _ in 0..n * 100 {
            if listeners.len() == n {
                break;
            }
            let port = rand::Rng::random_range(&mut rng, low..high);
            if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                take(listener, &mut listeners);
            }
        }
    }
    for _ in 0..n * 100 {
        if listeners.len() == n {
            break;
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        take(listener, &mut listeners);
    }
    assert_eq!(
        listeners.len(),
        n,
        "{n} ports this process has not given out yet"
    );
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local address").port())
        .collect()
}

/// Every port [`free_ports`] gave out in this process.
static GIVEN_PORTS: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());

#[cfg(test)]
mod free_ports_tests {
    /// Ports are released between calls, so without the registry a few hundred picks from
    /// the same range would give some port out twice.
    #[test]
    fn no_port_is_given_out_twice_in_one_process() {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..100 {
            for port in super::free_ports(20) {
                assert!(seen.insert(port), "port {port} given out twice");
            }
        }
    }
}

/// Ports for test nodes: from 10000 up to the start of the ephemeral range (Linux's
/// `ip_local_port_range`), if at least 4096 ports lie there.
fn below_ephemeral_range() -> Option<(u16, u16)> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let ephemeral_low: u16 = range.split_whitespace().next()?.parse().ok()?;
    (ephemeral_low >= 10_000 + 4096).then_some((10_000, ephemeral_low))
}

/// Node processes of one cluster on loopback, each configured by its own `node.toml` under
/// `root/node-<id>`. Nodes are started, killed and restarted by id; all are killed on drop.
pub struct LocalCluster {
    binary: PathBuf,
    root: PathBuf,
    cluster_id: String,
    partitions: u32,
    replication: u32,
    /// Address of node `id` at index `id - 1`.
    addrs: Vec<String>,
    /// Where node `id` serves PostgreSQL clients, at index `id - 1` (loopback clusters).
    pg_addrs: Vec<String>,
    /// Where node `id` serves HTTP (metrics, console), at index `id - 1` (loopback clusters).
    http_addrs: Vec<String>,
    /// Where node `id` serves Flight SQL, at index `id - 1` (loopback clusters).
    flightsql_addrs: Vec<String>,
    /// The founding members, listed as peers in every configuration.
    founders: usize,
    /// The Raft voters, if not the default (the three lowest ids).
    voters: Option<Vec<u64>>,
    /// More `key = value` lines for every configuration.
    extra: String,
    /// More `key = value` lines for one node's configuration, after those for every one.
    node_extra: BTreeMap<u64, String>,
    /// Where the certificates of mutual TLS on the internal port are (`ca.pem`,
    /// `node-<id>.pem`, `node-<id>.key`); plaintext (`insecure = true`) when `None`.
    mtls: Option<PathBuf>,
    // Dropped in this order: the processes die before their links and namespaces go.
    processes: Vec<Option<TesseraProcess>>,
    /// The proxy of every directed link `(from, to)`, when links are proxied.
    links: BTreeMap<(u64, u64), LinkProxy>,
    /// Seed for the link proxies' randomness, when links are proxied.
    link_seed: Option<u64>,
    /// The namespaces the nodes run in, for network fault tests; loopback when `None`.
    lab: Option<NetLab>,
    /// Nodes write their logs (stderr) to [`LocalCluster::log_path`] instead of the test's.
    log_to_files: bool,
    /// Environment variables for a node's next starts (disk faults, say).
    env: BTreeMap<u64, Vec<(String, String)>>,
    /// Nodes configured as compute-only (`role = "compute"`).
    compute: BTreeSet<u64>,
}

/// How the nodes of a networked cluster reach each other.
#[derive(Clone, Copy, Debug)]
pub enum Links {
    /// Straight across the lab's bridge: partitions only.
    Direct,
    /// Every directed link through its own [`LinkProxy`] (seeded), so links can also be
    /// delayed, slowed, stalled and reset.
    Proxied { seed: u64 },
}

impl LocalCluster {
    /// Writes the configurations of a `nodes`-node cluster; starts nothing.
    pub fn configure(
        binary: &Path,
        root: &Path,
        nodes: usize,
        partitions: u32,
        replication: u32,
    ) -> LocalCluster {
        let mut addrs: Vec<String> = free_ports(4 * nodes)
            .into_iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let flightsql_addrs = addrs.split_off(3 * nodes);
        let http_addrs = addrs.split_off(2 * nodes);
        let pg_addrs = addrs.split_off(nodes);
        let mut cluster =
            Self::configure_at(binary, root, addrs, partitions, replication, None, None);
        cluster.pg_addrs = pg_addrs;
        cluster.http_addrs = http_addrs;
        cluster.flightsql_addrs = flightsql_addrs;
        for id in cluster.node_ids() {
            cluster.write_config(id, &cluster.cluster_id);
        }
        cluster
    }

    /// Where node `id` serves Flight SQL (`flightsql_listen`); loopback clusters only.
    pub fn flightsql_addr(&self, id: u64) -> Option<&str> {
        self.flightsql_addrs
            .get(id as usize - 1)
            .map(String::as_str)
    }

    /// Where node `id` serves HTTP (`http_listen`: metrics, console); loopback clusters only.
    pub fn http_addr(&self, id: u64) -> Option<&str> {
        self.http_addrs.get(id as usize - 1).map(String::as_str)
    }

    /// Where node `id` serves PostgreSQL clients (`pg_listen`); loopback clusters only.
    pub fn pg_addr(&self, id: u64) -> Option<&str> {
        self.pg_addrs.get(id as usize - 1).map(String::as_str)
    }

    /// As [`LocalCluster::configure`], each node in its own network namespace of a new
    /// [`NetLab`] (needs root and iptables), its links to the others as `links` says.
    pub fn configure_networked(
        binary: &Path,
        root: &Path,
        nodes: usize,
        partitions: u32,
        replication: u32,
        links: Links,
    ) -> LocalCluster {
        let lab = NetLab::create(nodes);
        let addrs = lab.node_ids().iter().map(|&id| lab.node_addr(id)).collect();
        let seed = match links {
            Links::Direct => None,
            Links::Proxied { seed } => Some(seed),
        };
        let mut cluster = Self::configure_at(
            binary,
            root,
            addrs,
            partitions,
            replication,
            Some(lab),
            seed,
        );
        for id in cluster.node_ids() {
            cluster.wire_links(id);
        }
        cluster
    }

    fn configure_at(
        binary: &Path,
        root: &Path,
        addrs: Vec<String>,
        partitions: u32,
        replication: u32,
        lab: Option<NetLab>,
        link_seed: Option<u64>,
    ) -> LocalCluster {
        let nodes = addrs.len();
        let cluster = LocalCluster {
            binary: binary.to_path_buf(),
            root: root.to_path_buf(),
            cluster_id: format!("test-{}", std::process::id()),
            partitions,
            replication,
            addrs,
            pg_addrs: Vec::new(),
            http_addrs: Vec::new(),
            flightsql_addrs: Vec::new(),
            founders: nodes,
            voters: None,
            extra: String::new(),
            node_extra: BTreeMap::new(),
            mtls: None,
            processes: (0..nodes).map(|_| None).collect(),
            links: BTreeMap::new(),
            link_seed,
            lab,
            log_to_files: false,
            env: BTreeMap::new(),
            compute: BTreeSet::new(),
        };
        for id in 1..=nodes as u64 {
            cluster.write_config(id, &cluster.cluster_id.clone());
        }
        cluster
    }

    /// Puts a proxy on every link to and from node `id` not proxied yet (if links are
    /// proxied): node `from`'s connections to `to` are rewritten to `to`'s alias on the host,
    /// port `17000 + from`, and leave the proxy from `from`'s alias.
    fn wire_links(&mut self, id: u64) {
        let (Some(lab), Some(seed)) = (&self.lab, self.link_seed) else {
            return;
        };
        for other in lab.node_ids().into_iter().filter(|&o| o != id) {
            for (from, to) in [(id, other), (other, id)] {
                if self.links.contains_key(&(from, to)) {
                    continue;
                }
                let listen =
                    std::net::SocketAddr::new(lab.alias_ip(to).into(), 17000 + from as u16);
                let target = lab.node_addr(to).parse().expect("node address");
                let proxy = LinkProxy::start(
                    listen,
                    lab.alias_ip(from).into(),
                    target,
                    seed ^ (from << 32 | to),
                );
                lab.route_through(from, to, listen);
                self.links.insert((from, to), proxy);
            }
        }
    }

    /// The namespaces of a networked cluster, to partition it; panics for a loopback one.
    pub fn net(&self) -> &NetLab {
        self.lab
            .as_ref()
            .expect("a network fault needs LocalCluster::configure_networked")
    }

    /// The proxy of the link from `from` to `to`; panics if links are not proxied.
    pub fn link(&self, from: u64, to: u64) -> &LinkProxy {
        self.links
            .get(&(from, to))
            .expect("a link fault needs Links::Proxied")
    }

    /// Every directed link's proxy (empty unless links are proxied).
    pub fn links(&self) -> impl Iterator<Item = (&(u64, u64), &LinkProxy)> {
        self.links.iter()
    }

    /// Makes `voters` the Raft voters (rewrites every configuration; call before starting).
    pub fn set_voters(&mut self, voters: &[u64]) {
        self.voters = Some(voters.to_vec());
        for id in self.node_ids() {
            self.write_config(id, &self.cluster_id.clone());
        }
    }

    /// Runs the internal port under mutual TLS with the certificates in `certs` (as
    /// [`make_certs`] writes them), rewriting every configuration (call before starting).
    pub fn use_mtls(&mut self, certs: &Path) {
        self.mtls = Some(certs.to_path_buf());
        for id in self.node_ids() {
            self.write_config(id, &self.cluster_id.clone());
        }
    }

    /// Adds `key = value` to every configuration (call before starting).
    pub fn set_option(&mut self, key: &str, value: &str) {
        self.extra.push_str(&format!("{key} = {value}\n"));
        for id in self.node_ids() {
            self.write_config(id, &self.cluster_id.clone());
        }
    }

    /// Adds `key = value` to node `id`'s configuration only (call before starting it):
    /// nodes that differ, such as one that flushes more often than the others.
    pub fn set_node_option(&mut self, id: u64, key: &str, value: &str) {
        self.node_extra
            .entry(id)
            .or_default()
            .push_str(&format!("{key} = {value}\n"));
        self.write_config(id, &self.cluster_id.clone());
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The configuration text of node `id` in cluster `cluster_id`.
    pub fn config_text(&self, id: u64, cluster_id: &str) -> String {
        let mut peers = String::new();
        let listed: Vec<u64> = (1..=self.founders as u64)
            .chain((id > self.founders as u64).then_some(id))
            .collect();
        for peer in listed {
            peers.push_str(&format!(
                "\n[[peers]]\nid = {peer}\naddr = \"{}\"\n",
                self.addr(peer)
            ));
        }
        let voters = self
            .voters
            .as_ref()
            .map(|v| format!("voters = {v:?}\n"))
            .unwrap_or_default();
        let pg_listen = self
            .pg_addr(id)
            .map(|addr| format!("pg_listen = \"{addr}\"\n"))
            .unwrap_or_default()
            + &self
                .http_addr(id)
                .map(|addr| format!("http_listen = \"{addr}\"\n"))
                .unwrap_or_default()
            + &self
                .flightsql_addr(id)
                .map(|addr| format!("flightsql_listen = \"{addr}\"\n"))
                .unwrap_or_default();
        let security = match &self.mtls {
            None => "insecure = true\n".to_string(),
            Some(certs) => format!(
                "mtls.ca = {:?}\nmtls.cert = {:?}\nmtls.key = {:?}\n",
                certs.join("ca.pem"),
                certs.join(format!("node-{id}.pem")),
                certs.join(format!("node-{id}.key"))
            ),
        };
        let role = if self.compute.contains(&id) {
            "role = \"compute\"\n"
        } else {
            ""
        };
        format!(
            "cluster_id = \"{cluster_id}\"\nnode_id = {id}\nlisten = \"{}\"\n{role}{pg_listen}data_dir = \"data\"\npartitions = {}\nreplication = {}\n{voters}{security}{}{}{peers}",
            self.addr(id),
            self.partitions,
            self.replication,
            self.extra,
            self.node_extra.get(&id).map_or("", String::as_str)
        )
    }

    fn write_config(&self, id: u64, cluster_id: &str) -> PathBuf {
        let dir = self.root.join(format!("node-{id}"));
        std::fs::create_dir_all(&dir).expect("node directory");
        let path = dir.join("node.toml");
        std::fs::write(&path, self.config_text(id, cluster_id)).expect("write node.toml");
        path
    }

    pub fn config_path(&self, id: u64) -> PathBuf {
        self.root.join(format!("node-{id}")).join("node.toml")
    }

    pub fn addr(&self, id: u64) -> &str {
        &self.addrs[id as usize - 1]
    }

    /// Every node's address, by id order.
    pub fn addrs(&self) -> Vec<String> {
        self.addrs.clone()
    }

    pub fn node_ids(&self) -> Vec<u64> {
        (1..=self.addrs.len() as u64).collect()
    }

    /// Configures one more node, which will join the running cluster when started.
    pub fn add_node(&mut self) -> u64 {
        let addr = match &mut self.lab {
            Some(lab) => {
                let id = lab.add_node();
                lab.node_addr(id)
            }
            None => format!("127.0.0.1:{}", self.unassigned_port()),
        };
        self.addrs.push(addr);
        self.processes.push(None);
        let id = self.addrs.len() as u64;
        self.write_config(id, &self.cluster_id.clone());
        self.wire_links(id);
        id
    }

    /// A free loopback port that no node of this cluster has been given yet: the ports
    /// given to nodes not yet started are free too, and the kernel may hand one out again.
    fn unassigned_port(&self) -> u16 {
        let assigned: BTreeSet<&str> = self
            .addrs
            .iter()
            .chain(&self.pg_addrs)
            .chain(&self.http_addrs)
            .chain(&self.flightsql_addrs)
            .map(String::as_str)
            .collect();
        (0..100)
            .map(|_| free_ports(1)[0])
            .find(|port| !assigned.contains(format!("127.0.0.1:{port}").as_str()))
            .expect("a free port no node was given, in 100 tries")
    }

    /// Configures one more node as compute-only (`role = "compute"`): it will join the
    /// running cluster when started, and be given no partitions.
    pub fn add_compute_node(&mut self) -> u64 {
        let id = self.add_node();
        self.compute.insert(id);
        self.write_config(id, &self.cluster_id.clone());
        id
    }

    /// Sends every node's log to its own file from the next start on (appending across
    /// restarts), for runs too long to read mixed together, and to search them afterwards.
    pub fn log_to_files(&mut self) {
        self.log_to_files = true;
    }

    /// Where node `id` writes its log under [`LocalCluster::log_to_files`].
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.root.join(format!("node-{id}")).join("node.log")
    }

    /// The lines of every node's log file that report a panic, each prefixed by its node.
    pub fn panics_logged(&self) -> Vec<String> {
        let mut panics = Vec::new();
        for id in self.node_ids() {
            let text = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
            panics.extend(
                text.lines()
                    .filter(|line| line.contains("panicked at"))
                    .map(|line| format!("node {id}: {line}")),
            );
        }
        panics
    }

    /// Sets an environment variable for node `id`'s next starts.
    pub fn set_node_env(&mut self, id: u64, key: &str, value: &str) {
        self.env
            .entry(id)
            .or_default()
            .push((key.to_string(), value.to_string()));
    }

    /// Forgets the variables set for node `id`.
    pub fn clear_node_env(&mut self, id: u64) {
        self.env.remove(&id);
    }

    /// How node `id`'s process ended, if it has ended by itself.
    pub fn exit_status(&mut self, id: u64) -> Option<std::process::ExitStatus> {
        self.processes[id as usize - 1].as_mut()?.exit_status()
    }

    pub fn start(&mut self, id: u64) {
        self.start_with_args(id, &[]);
    }

    /// Starts node `id` with `extra` arguments after `node --config ...` (e.g. `--replace`).
    pub fn start_with_args(&mut self, id: u64, extra: &[&str]) {
        let config = self.config_path(id);
        let mut command = match &self.lab {
            Some(lab) => lab.command(id, &self.binary),
            None => Command::new(&self.binary),
        };
        for (key, value) in self.env.get(&id).into_iter().flatten() {
            command.env(key, value);
        }
        if self.log_to_files {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log_path(id))
                .expect("open the node's log file");
            command.stderr(log);
        }
        let mut args = vec!["node", "--config", config.to_str().expect("UTF-8 path")];
        args.extend_from_slice(extra);
        let process = TesseraProcess::spawn_command(command, &self.root, &args);
        self.processes[id as usize - 1] = Some(process);
    }

    pub fn start_all(&mut self) {
        for id in self.node_ids() {
            self.start(id);
        }
    }

    /// SIGKILLs node `id`.
    pub fn kill9(&mut self, id: u64) {
        if let Some(mut process) = self.processes[id as usize - 1].take() {
            process.kill9();
        }
    }

    /// Pauses node `id` (SIGSTOP): it keeps its sockets but answers nothing, like a node in
    /// a long GC pause or a stopped VM. SIGKILL on drop still ends it.
    pub fn pause(&self, id: u64) {
        if let Some(process) = &self.processes[id as usize - 1] {
            process.signal(libc::SIGSTOP);
        }
    }

    /// Resumes a paused node (SIGCONT).
    pub fn resume(&self, id: u64) {
        if let Some(process) = &self.processes[id as usize - 1] {
            process.signal(libc::SIGCONT);
        }
    }

    /// The process id of node `id`, while it runs.
    pub fn node_pid(&self, id: u64) -> Option<u32> {
        self.processes[id as usize - 1].as_ref().map(|p| p.pid())
    }

    pub fn is_running(&self, id: u64) -> bool {
        self.processes[id as usize - 1].is_some()
    }
}

/// Rows `from..to` of the test table `kv (k BIGINT PRIMARY KEY, v BIGINT NOT NULL)`, with
/// `v = 10 k`, so any reader can check every value it gets back.
pub fn kv_batch(from: i64, to: i64) -> arrow::array::RecordBatch {
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    let schema = std::sync::Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
    ]));
    arrow::array::RecordBatch::try_new(
        schema,
        vec![
            std::sync::Arc::new(Int64Array::from_iter_values(from..to)),
            std::sync::Arc::new(Int64Array::from_iter_values((from..to).map(|k| k * 10))),
        ],
    )
    .expect("kv columns match the schema")
}

/// Runs `binary certs ARGS --dir DIR` (`tessera certs`), panicking with its error if it
/// fails.
pub fn tessera_certs(binary: &Path, dir: &Path, args: &[&str]) {
    let output = Command::new(binary)
        .args(["certs"])
        .args(args)
        .arg("--dir")
        .arg(dir)
        .output()
        .expect("run tessera certs");
    assert!(
        output.status.success(),
        "tessera certs {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Makes, with `binary`'s `tessera certs`, a CA in `dir`, node certificates for `nodes`
/// (for 127.0.0.1) and the administrator's client certificate (`admin`).
pub fn make_certs(binary: &Path, dir: &Path, nodes: &[u64]) {
    tessera_certs(binary, dir, &["init"]);
    for id in nodes {
        tessera_certs(
            binary,
            dir,
            &["node", "--id", &id.to_string(), "--addr", "127.0.0.1"],
        );
    }
    tessera_certs(binary, dir, &["client", "--name", "admin"]);
}
