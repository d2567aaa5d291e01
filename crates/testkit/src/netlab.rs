//! A network of Linux network namespaces for fault tests: each node runs in its own
//! namespace, joined to the others by a bridge on the host, so a test can cut links with
//! iptables (real dropped packets: connections hang rather than fail fast) and send links
//! through user-space proxies that delay, slow, stall or reset them ([`crate::proxy`]).
//!
//! Addresses in lab `k` (subnet `10.213.k.0/24`):
//! - the host (test clients) is `10.213.k.1` on the bridge `tsbr<k>`;
//! - node `i` is `10.213.k.(10+i)`, namespace `ts<k>n<i>`, listening on [`NODE_PORT`];
//! - node `i`'s *alias* `10.213.k.(100+i)` is a host address the link proxies use: a
//!   proxied connection from `i` to `j` leaves the proxy from `i`'s alias and is sent to `j`'s
//!   alias in `i`'s namespace, so a partition rule that names both of a node's addresses
//!   cuts its direct and its proxied traffic alike.
//!
//! Needs root, `ip` (iproute2) and `iptables`; [`NetLab::check_available`] says which is
//! missing. Everything created is deleted on drop (and a lab left over by a killed test is
//! reclaimed by the next one that picks its number).

use std::net::Ipv4Addr;
use std::process::Command;

/// The port every node listens on inside its own namespace.
pub const NODE_PORT: u16 = 7000;

/// Labs that may exist at once on one machine (one `/24` each).
const MAX_LABS: u8 = 200;

/// Bridge, namespaces and veth pairs of one test's nodes; all deleted on drop.
pub struct NetLab {
    index: u8,
    nodes: usize,
}

impl NetLab {
    /// Says why a lab cannot be built here, if it cannot.
    pub fn check_available() -> Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("network fault tests need root (network namespaces, iptables)".into());
        }
        for (tool, package) in [("ip", "iproute2"), ("iptables", "iptables")] {
            let found = Command::new(tool).arg("--version").output().is_ok();
            if !found {
                return Err(format!(
                    "network fault tests need `{tool}` (apt install {package})"
                ));
            }
        }
        Ok(())
    }

    /// Creates a bridge and one namespace per node (ids `1..=nodes`), all reachable from the
    /// host. Panics, naming the failing command, if the lab cannot be built.
    pub fn create(nodes: usize) -> NetLab {
        if let Err(why) = Self::check_available() {
            panic!("{why}");
        }
        assert!((1..90).contains(&nodes), "a lab holds 1 to 89 nodes");
        let index = claim_lab_index();
        let lab = NetLab { index, nodes };
        let bridge = lab.bridge();
        ip(&[
            "addr",
            "add",
            &format!("{}/24", lab.host_addr()),
            "dev",
            &bridge,
        ]);
        ip(&["link", "set", &bridge, "up"]);
        for id in 1..=nodes as u64 {
            lab.add_namespace(id);
        }
        lab
    }

    fn add_namespace(&self, id: u64) {
        let ns = self.namespace(id);
        let host_end = self.host_end(id);
        // A namespace or link of the same name left by a killed test is replaced.
        let _ = Command::new("ip").args(["link", "del", &host_end]).output();
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["link", "set", &host_end, "master", &self.bridge(), "up"]);
        self.in_namespace(
            id,
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/24", self.node_ip(id)),
                "dev",
                "eth0",
            ],
        );
        self.in_namespace(id, "ip", &["link", "set", "eth0", "up"]);
        self.in_namespace(id, "ip", &["link", "set", "lo", "up"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", self.alias_ip(id)),
            "dev",
            &self.bridge(),
        ]);
    }

    /// Adds a namespace for one more node (id `nodes + 1`) and returns its id.
    pub fn add_node(&mut self) -> u64 {
        self.nodes += 1;
        let id = self.nodes as u64;
        self.add_namespace(id);
        id
    }

    pub fn node_ids(&self) -> Vec<u64> {
        (1..=self.nodes as u64).collect()
    }

    /// The host's end of node `id`'s veth pair.
    fn host_end(&self, id: u64) -> String {
        format!("tsv{}n{id}", self.index)
    }

    fn bridge(&self) -> String {
        format!("tsbr{}", self.index)
    }

    /// The namespace node `id` runs in.
    pub fn namespace(&self, id: u64) -> String {
        format!("ts{}n{id}", self.index)
    }

    /// The host's address on the bridge: where test clients and proxies live.
    pub fn host_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.index, 1)
    }

    /// Node `id`'s own address.
    pub fn node_ip(&self, id: u64) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.index, 10 + id as u8)
    }

    /// Node `id`'s alias on the host, from which proxied traffic of `id` arrives.
    pub fn alias_ip(&self, id: u64) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.index, 100 + id as u8)
    }

    /// `ip:port` node `id` listens on.
    pub fn node_addr(&self, id: u64) -> String {
        format!("{}:{NODE_PORT}", self.node_ip(id))
    }

    /// Runs `program args...` inside node `id`'s namespace; panics if it fails.
    pub fn in_namespace(&self, id: u64, program: &str, args: &[&str]) {
        let namespace = self.namespace(id);
        let mut full = vec!["netns", "exec", &namespace, program];
        full.extend_from_slice(args);
        ip(&full);
    }

    /// A command that runs `program` inside node `id`'s namespace. `ip netns exec` execs the
    /// program, so the child's pid is the program's own (signals reach it directly).
    pub fn command(&self, id: u64, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.namespace(id)])
            .arg(program);
        command
    }

    /// Runs iptables in node `id`'s namespace, waiting for the tables' lock (tests in
    /// other namespaces change theirs at the same time).
    fn iptables(&self, id: u64, args: &[&str]) {
        let mut full = vec!["-w"];
        full.extend_from_slice(args);
        self.in_namespace(id, "iptables", &full);
    }

    /// Drops every packet between `a` and `b`, both ways (direct and proxied).
    pub fn cut(&self, a: u64, b: u64) {
        self.drop_from(a, b);
        self.drop_from(b, a);
    }

    /// Drops what `from` sends to `to` (and so every connection between them stalls, since
    /// TCP needs both ways), while `to`'s own packets still reach `from`.
    pub fn drop_from(&self, from: u64, to: u64) {
        for source in [self.node_ip(from), self.alias_ip(from)] {
            let source = source.to_string();
            self.iptables(to, &["-A", "INPUT", "-s", &source, "-j", "DROP"]);
        }
        for target in [self.node_ip(to), self.alias_ip(to)] {
            let target = target.to_string();
            self.iptables(from, &["-A", "OUTPUT", "-d", &target, "-j", "DROP"]);
        }
    }

    /// Cuts `id` from every other node; the host (test clients) still reaches it.
    pub fn isolate(&self, id: u64) {
        for other in self.node_ids().into_iter().filter(|&o| o != id) {
            self.cut(id, other);
        }
    }

    /// Cuts every link between the two sides.
    pub fn split(&self, side_a: &[u64], side_b: &[u64]) {
        for &a in side_a {
            for &b in side_b {
                self.cut(a, b);
            }
        }
    }

    /// Removes every cut.
    pub fn heal(&self) {
        for id in self.node_ids() {
            self.iptables(id, &["-F"]);
        }
    }

    /// Sends node `from`'s new connections to `to` through `via` (a proxy listening on the
    /// host at `via`), by rewriting their destination in `from`'s namespace.
    pub fn route_through(&self, from: u64, to: u64, via: std::net::SocketAddr) {
        let target = self.node_ip(to).to_string();
        let port = NODE_PORT.to_string();
        self.iptables(
            from,
            &[
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-p",
                "tcp",
                "-d",
                &target,
                "--dport",
                &port,
                "-j",
                "DNAT",
                "--to-destination",
                &via.to_string(),
            ],
        );
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for id in self.node_ids() {
            // Deleting the link at once (a namespace's own links go later, asynchronously)
            // frees its name for the next lab.
            let _ = Command::new("ip")
                .args(["link", "del", &self.host_end(id)])
                .output();
            let _ = Command::new("ip")
                .args(["netns", "del", &self.namespace(id)])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge()])
            .output();
    }
}

/// Claims the lowest lab number whose bridge does not exist yet: creating the bridge is the
/// claim, so two tests never share a lab.
fn claim_lab_index() -> u8 {
    for index in 0..MAX_LABS {
        let created = Command::new("ip")
            .args(["link", "add", &format!("tsbr{index}"), "type", "bridge"])
            .output()
            .expect("run ip");
        if created.status.success() {
            return index;
        }
    }
    panic!("all {MAX_LABS} network labs are in use (leftover bridges tsbr*? `ip link del` them)");
}

fn ip(args: &[&str]) {
    let output = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        output.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
}
