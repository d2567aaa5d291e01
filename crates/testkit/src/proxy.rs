//! A user-space TCP proxy that degrades one directed link between two nodes: this kernel has
//! no `tc netem`, so delay, jitter, stalls (what a lost segment costs TCP: a retransmission
//! timeout), bandwidth limits and connection resets are made here, on the bytes.
//!
//! A proxy forwards everything it accepts to one target, from a chosen source address (the
//! sending node's alias in a [`crate::netlab::NetLab`], so partition rules still apply to
//! proxied traffic). Each direction of each connection is a reader that stamps every chunk
//! with the time it is due and a writer that sends it then, so a delay adds latency without
//! capping throughput, and chunks never overtake each other.

use rand::{Rng, SeedableRng};
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How a link misbehaves; the default is a healthy link.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinkFaults {
    /// Added to every chunk's delivery.
    pub delay: Duration,
    /// A further uniformly random `0..jitter` per chunk (order is still kept).
    pub jitter: Duration,
    /// Chance per chunk that it is held back by `stall`, as a lost segment is by TCP's
    /// retransmission timeout.
    pub stall_probability: f64,
    pub stall: Duration,
    /// Bytes per second each direction may carry; `None` for no limit.
    pub bytes_per_second: Option<u64>,
}

impl LinkFaults {
    pub fn is_healthy(&self) -> bool {
        *self == LinkFaults::default()
    }
}

struct Shared {
    faults: Mutex<LinkFaults>,
    rng: Mutex<rand::rngs::StdRng>,
    /// Both ends of every open connection, so [`LinkProxy::reset`] can abort them.
    open: Mutex<Vec<TcpStream>>,
    stop: AtomicBool,
}

/// One directed link's proxy; stops accepting and aborts its connections on drop.
pub struct LinkProxy {
    listen: SocketAddr,
    shared: Arc<Shared>,
}

impl LinkProxy {
    /// Listens on `listen` and forwards each connection to `target`, connecting from
    /// `source` (port chosen by the kernel). `seed` makes the jitter and stalls repeatable.
    pub fn start(listen: SocketAddr, source: IpAddr, target: SocketAddr, seed: u64) -> LinkProxy {
        let listener = TcpListener::bind(listen)
            .unwrap_or_else(|e| panic!("proxy cannot listen on {listen}: {e}"));
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let shared = Arc::new(Shared {
            faults: Mutex::new(LinkFaults::default()),
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            open: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let accepting = shared.clone();
        thread::spawn(move || accept_loop(listener, source, target, accepting));
        LinkProxy { listen, shared }
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// Applies `faults` to every chunk from now on, on open and new connections.
    pub fn set(&self, faults: LinkFaults) {
        *self.shared.faults.lock().unwrap() = faults;
    }

    pub fn faults(&self) -> LinkFaults {
        self.shared.faults.lock().unwrap().clone()
    }

    /// Aborts every open connection: both ends see it end mid-stream (a reset, or an end of
    /// stream the protocol did not expect); new connections are accepted as before.
    pub fn reset(&self) {
        for stream in self.shared.open.lock().unwrap().drain(..) {
            abort(&stream);
        }
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.reset();
    }
}

fn abort(stream: &TcpStream) {
    // Linger 0 makes close send RST instead of FIN.
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
    let _ = stream.shutdown(Shutdown::Both);
}

fn accept_loop(listener: TcpListener, source: IpAddr, target: SocketAddr, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((inbound, _)) => {
                let _ = inbound.set_nonblocking(false);
                match connect_from(source, target) {
                    Ok(outbound) => splice(inbound, outbound, &shared),
                    Err(_) => abort(&inbound),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(20));
            }
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn connect_from(source: IpAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(target),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.bind(&SocketAddr::new(source, 0).into())?;
    socket.connect_timeout(&target.into(), Duration::from_secs(5))?;
    socket.set_tcp_nodelay(true)?;
    Ok(socket.into())
}

fn splice(inbound: TcpStream, outbound: TcpStream, shared: &Arc<Shared>) {
    let _ = inbound.set_nodelay(true);
    {
        let mut open = shared.open.lock().unwrap();
        open.retain(|s| s.peer_addr().is_ok());
        for stream in [&inbound, &outbound] {
            if let Ok(clone) = stream.try_clone() {
                open.push(clone);
            }
        }
    }
    for (from, to) in [(&inbound, &outbound), (&outbound, &inbound)] {
        let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) else {
            abort(&inbound);
            abort(&outbound);
            return;
        };
        let shared = shared.clone();
        let (due_tx, due_rx) = mpsc::channel::<(Instant, Vec<u8>)>();
        let reader_shared = shared.clone();
        thread::spawn(move || read_direction(from, due_tx, reader_shared));
        thread::spawn(move || write_direction(to, due_rx, shared));
    }
}

/// Reads chunks and stamps each with when it is due; a stamp is never earlier than the one
/// before it, so delivery keeps the byte order.
fn read_direction(mut from: TcpStream, due: mpsc::Sender<(Instant, Vec<u8>)>, shared: Arc<Shared>) {
    let mut buffer = vec![0u8; 16 * 1024];
    let mut last_due = Instant::now();
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let faults = shared.faults.lock().unwrap().clone();
        let mut hold = faults.delay;
        {
            let mut rng = shared.rng.lock().unwrap();
            if !faults.jitter.is_zero() {
                hold += faults.jitter.mul_f64(rng.random::<f64>());
            }
            if faults.stall_probability > 0.0 && rng.random::<f64>() < faults.stall_probability {
                hold += faults.stall;
            }
        }
        last_due = last_due.max(Instant::now() + hold);
        if due.send((last_due, buffer[..n].to_vec())).is_err() {
            break;
        }
    }
    // Dropping `due` tells the writer the stream ended.
}

fn write_direction(
    mut to: TcpStream,
    due: mpsc::Receiver<(Instant, Vec<u8>)>,
    shared: Arc<Shared>,
) {
    for (at, chunk) in due {
        let now = Instant::now();
        if at > now {
            thread::sleep(at - now);
        }
        let limit = shared.faults.lock().unwrap().bytes_per_second;
        if let Some(rate) = limit.filter(|&r| r > 0) {
            thread::sleep(Duration::from_secs_f64(chunk.len() as f64 / rate as f64));
        }
        if to.write_all(&chunk).is_err() {
            return;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                thread::spawn(move || {
                    let mut reader = stream.try_clone().unwrap();
                    let mut writer = stream;
                    let _ = std::io::copy(&mut reader, &mut writer);
                });
            }
        });
        addr
    }

    fn proxy_to(target: SocketAddr) -> LinkProxy {
        let port = crate::free_ports(1)[0];
        LinkProxy::start(
            format!("127.0.0.1:{port}").parse().unwrap(),
            "127.0.0.1".parse().unwrap(),
            target,
            7,
        )
    }

    fn round_trip(proxy: &LinkProxy, payload: &[u8]) -> (Vec<u8>, Duration) {
        let started = Instant::now();
        let mut stream = TcpStream::connect(proxy.listen_addr()).unwrap();
        stream.write_all(payload).unwrap();
        stream.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        stream.read_to_end(&mut back).unwrap();
        (back, started.elapsed())
    }

    #[test]
    fn a_healthy_link_forwards_every_byte_in_order() {
        let proxy = proxy_to(echo_server());
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (back, _) = round_trip(&proxy, &payload);
        assert_eq!(back, payload);
    }

    #[test]
    fn a_delayed_link_adds_its_delay_each_way_and_keeps_the_bytes() {
        let proxy = proxy_to(echo_server());
        proxy.set(LinkFaults {
            delay: Duration::from_millis(300),
            jitter: Duration::from_millis(50),
            ..LinkFaults::default()
        });
        let payload: Vec<u8> = (0..50_000u32).map(|i| (i % 13) as u8).collect();
        let (back, took) = round_trip(&proxy, &payload);
        assert_eq!(back, payload);
        assert!(took >= Duration::from_millis(600), "took only {took:?}");
    }

    #[test]
    fn a_reset_aborts_open_connections_and_new_ones_still_pass() {
        let proxy = proxy_to(echo_server());
        let mut open = TcpStream::connect(proxy.listen_addr()).unwrap();
        open.write_all(b"ping").unwrap();
        let mut echoed = [0u8; 4];
        open.read_exact(&mut echoed).unwrap();
        proxy.reset();
        open.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        let ended = open.read_to_end(&mut rest);
        assert!(
            matches!(&ended, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
                || matches!(ended, Ok(0)),
            "the open connection should be aborted, got {ended:?}"
        );
        let (back, _) = round_trip(&proxy, b"again");
        assert_eq!(back, b"again");
    }

    #[test]
    fn a_bandwidth_limit_slows_a_transfer() {
        let proxy = proxy_to(echo_server());
        proxy.set(LinkFaults {
            bytes_per_second: Some(200_000),
            ..LinkFaults::default()
        });
        let payload = vec![1u8; 100_000];
        let (back, took) = round_trip(&proxy, &payload);
        assert_eq!(back.len(), payload.len());
        // 100 kB each way at 200 kB/s: at least half a second each way, pipelined.
        assert!(took >= Duration::from_millis(500), "took only {took:?}");
    }
}
