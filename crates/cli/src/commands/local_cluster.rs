//! The node processes of a local cluster that one command started (`tessera up`,
//! `tessera demo`, the cluster benchmarks): spawned from this binary with the
//! configurations [`local_configs`] writes, and stopped by pid when the command ends,
//! whichever way it ends (a dropped cluster SIGKILLs what is left; the kernel sends the
//! nodes SIGTERM should the command itself be killed).

use super::up::{local_configs, UpOptions};
use anyhow::{bail, Context, Result};
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tessera_common::tls::MutualTls;
use tessera_server::{ClusterClient, NodeConfig, NodeId};

/// Where the nodes' own output (their logs) goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeOutput {
    /// This terminal's: `tessera up`, where the logs are what a user watches.
    Inherit,
    /// Appended to `node.log` beside each node's configuration: the demo, which tells a
    /// story on the terminal but leaves the logs to look at, and the benchmarks, whose
    /// figures must stay readable.
    LogFile,
}

pub struct LocalCluster {
    children: Vec<(u64, Child)>,
    configs: Vec<PathBuf>,
    pub addrs: Vec<String>,
    output: NodeOutput,
    /// The administrator's certificate when the internal port is under mutual TLS.
    tls: Option<MutualTls>,
}

impl LocalCluster {
    /// Writes or reuses the configurations under `root` and starts every node.
    pub fn start(root: &Path, options: &UpOptions, output: NodeOutput) -> Result<LocalCluster> {
        let configs = local_configs(root, options)?;
        let tls = match NodeConfig::load(&configs[0])?.mtls {
            Some(mtls) => {
                let dir = mtls.ca.parent().unwrap_or(Path::new("."));
                Some(MutualTls::from_dir(dir, super::certs::ADMIN).map_err(anyhow::Error::msg)?)
            }
            None => None,
        };
        // This process's own clients (`ClusterClient::new`) speak to this cluster with its
        // administrator's certificate.
        if tls.is_some() {
            tessera_server::client::set_default_tls(tls.clone());
        }
        let mut cluster = LocalCluster {
            children: Vec::new(),
            addrs: Vec::new(),
            configs: configs.clone(),
            output,
            tls,
        };
        for (i, config) in configs.iter().enumerate() {
            cluster
                .addrs
                .push(NodeConfig::load(config)?.listen.to_string());
            cluster.spawn(i as u64 + 1)?;
        }
        Ok(cluster)
    }

    /// Starts a cluster as `options` say, on the first free run of ports (a benchmark's,
    /// whose nodes log to `node.log` beside their configurations: a run that fails or is
    /// slow leaves them to look at).
    pub fn start_on_free_ports(root: &Path, mut options: UpOptions) -> Result<LocalCluster> {
        options.base_port = free_base_port(options.all_nodes())?;
        Self::start(root, &options, NodeOutput::LogFile)
    }

    /// A client of the node at `addrs[index]`, with this cluster's certificate if any.
    pub fn client(&self, index: usize) -> ClusterClient {
        ClusterClient::with_tls(&self.addrs[index], self.tls.as_ref())
    }

    pub fn configs(&self) -> &[PathBuf] {
        &self.configs
    }

    /// Starts node `id` (again).
    pub fn spawn(&mut self, id: u64) -> Result<()> {
        self.spawn_with(id, &[])
    }

    /// Starts node `id` (again) with `args` added to its command line (`--replace`).
    pub fn spawn_with(&mut self, id: u64, args: &[&str]) -> Result<()> {
        let config = &self.configs[id as usize - 1];
        let mut command = Command::new(std::env::current_exe()?);
        command.args(["node", "--config"]).arg(config).args(args);
        match self.output {
            NodeOutput::Inherit => {}
            NodeOutput::LogFile => {
                let path = self.log_path(id);
                let log = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| format!("opening {}", path.display()))?;
                command.stdout(log.try_clone()?).stderr(log);
            }
        }
        // A node outlives no command that started it: should this process die without
        // stopping its nodes (SIGKILL), the kernel asks them to stop.
        // SAFETY: prctl(2) is async-signal-safe, as code between fork and exec must be.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting node {id} with {}", config.display()))?;
        self.children.push((id, child));
        Ok(())
    }

    /// Node `id`'s data directory.
    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.configs[id as usize - 1].with_file_name("data")
    }

    /// Where node `id` writes its log under [`NodeOutput::LogFile`].
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.configs[id as usize - 1].with_file_name("node.log")
    }

    /// The process id of node `id`, while this cluster runs it.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.children
            .iter()
            .find(|(n, _)| *n == id)
            .map(|(_, child)| child.id())
    }

    /// The process ids of the nodes this cluster runs.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|(_, child)| child.id()).collect()
    }

    /// Stops node `id` at once, as a crash would: SIGKILL, no shutdown of any kind.
    pub fn kill9(&mut self, id: u64) {
        if let Some(pos) = self.children.iter().position(|(n, _)| *n == id) {
            let (_, mut child) = self.children.remove(pos);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Fails naming the first node that has exited since it was started.
    pub fn check_running(&mut self) -> Result<()> {
        for (id, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                bail!("node {id} exited ({status})");
            }
        }
        Ok(())
    }

    /// Waits until every node answers, knows the leader and sees them all alive; fails
    /// at once if a node exits. Returns the leader the first node knew then (a later
    /// status may name none for a moment, during an election).
    pub async fn wait_formed(&mut self, timeout: Duration) -> Result<NodeId> {
        let clients: Vec<ClusterClient> = (0..self.addrs.len()).map(|i| self.client(i)).collect();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(leader) = formed(&clients).await {
                return Ok(leader);
            }
            self.check_running()?;
            if Instant::now() > deadline {
                bail!("the cluster did not form within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops every node with SIGTERM, then SIGKILL after a grace period.
    pub fn stop(&mut self) {
        for (_, child) in &self.children {
            // SAFETY: kill(2) on the pid of a child we own and have not reaped.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for (_, mut child) in self.children.drain(..) {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// True when every node answers, knows a leader, and sees all of them alive.
pub async fn formed(clients: &[ClusterClient]) -> Option<NodeId> {
    let mut first_leader = None;
    for client in clients {
        match client.status().await {
            Ok(status) if status.meta.live_nodes().count() == clients.len() => {
                let leader = status.leader?;
                first_leader.get_or_insert(leader);
            }
            _ => return None,
        }
    }
    first_leader
}

/// The first of `n` consecutive free ports on 127.0.0.1.
pub fn free_base_port(n: u64) -> Result<u16> {
    for _ in 0..100 {
        let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
        let base = probe.local_addr()?.port();
        drop(probe);
        if base as u64 + n >= u16::MAX as u64 {
            continue;
        }
        let all_free =
            (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i as u16)).is_ok());
        if all_free {
            return Ok(base);
        }
    }
    bail!("found no run of {n} free ports")
}
