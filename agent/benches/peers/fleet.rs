//! The node's gateways: per peer a gateway network namespace (`liqo-tunnel` in from the
//! peer's side, `liqo.peerNN` out to the pods, a NAT rule as Liqo's remapping makes the kernel
//! track connections), a sender behind the tunnel and a receiver that answers for every pod
//! address; the gateway pod's sandbox, a process in the gateway namespace placed in the
//! cgroup the kubelet would make for the pod (`pod<uid>`), which is how the agent finds the
//! namespace (`agent/kube/src/gateway_pods/netns.rs`; no kubelet runs here); and one probe thread
//! each way for all gateways: to an allowed pod and to an address no pod has, every 2 ms.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use peerwall_netns::NetNs;

pub use crate::topology::SENDER_CIDR;
/// No pod has it: every gateway's policy drops it from the tunnel.
pub const DENIED: Ipv4Addr = Ipv4Addr::new(10, 63, 255, 254);
const PORT: u16 = 9999;
/// How often each gateway's probes are sent.
pub const PERIOD: Duration = Duration::from_millis(2);

/// What the receivers saw of one gateway's probes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    /// The last datagram to [`DENIED`] that got through.
    pub denied_last: Option<Instant>,
    /// The first datagram to the allowed pod since the last denied one got through, or since
    /// allowed ones were dropped (a gap in their sequence numbers).
    pub allowed_since: Option<Instant>,
    /// Datagrams sent to the allowed pod, and those that reached it (since the last reset).
    pub allowed_sent: u64,
    pub allowed_got: u64,
    /// Datagrams to [`DENIED`] that got through.
    pub denied_got: u64,
    /// The sequence number of the last datagram sent to the allowed pod, and of the last one
    /// that reached it (each datagram carries its own).
    sent_seq: u64,
    got_seq: u64,
}

/// Datagrams to the allowed pod that may be on their way: more sent since the last one that
/// arrived means they are being dropped, or the receiver has not read them yet.
const IN_FLIGHT: u64 = 2;

impl Seen {
    /// Datagrams to the allowed pod that did not reach it (one may still be on its way).
    pub fn allowed_lost(&self) -> u64 {
        self.allowed_sent.saturating_sub(self.allowed_got)
    }

    /// Enforced at: the allowed pod reached after the denied address last was and after the
    /// last allowed datagrams were dropped, once the allowed pod has been reached for `quiet`
    /// with the denied address unreached meanwhile (a denied datagram resets `allowed_since`)
    /// and the datagrams to it have arrived up to the last few sent (a boot policy dropping
    /// both leaves nothing to arrive; a receiver behind on a busy node only delays this).
    /// Not sooner: the two datagrams of one round arrive one after the other, and between
    /// them the allowed one alone would look like a policy in force.
    pub fn enforced(&self, quiet: Duration) -> Option<Instant> {
        let at = self.allowed_since?;
        (at.elapsed() >= quiet
            && self.denied_last.is_none_or(|d| d.elapsed() >= quiet)
            && self.sent_seq <= self.got_seq + IN_FLIGHT)
            .then_some(at)
    }
}

/// One gateway: its three namespaces and its pod's sandbox.
pub struct Gateway {
    pub snd: NetNs,
    pub gw: NetNs,
    pub rcv: NetNs,
    /// The pod's sandbox process, once [`Gateway::sandbox`] made it.
    sandbox: Option<(Child, PathBuf)>,
    /// The pod this gateway forwards to (one of its peer's offloaded pods).
    pub allowed: Ipv4Addr,
}

impl Gateway {
    pub fn new(i: usize, allowed: Ipv4Addr) -> Self {
        let crate::topology::Topology { snd, gw, rcv } =
            crate::topology::Topology::new(&format!("pwpeer{i}"), &format!("liqo.peer{i:02}"));
        // Liqo's remapping: a NAT rule, so the gateway's kernel tracks connections.
        let nat = "table ip liqo-remap { chain pre { type nat hook prerouting priority dstnat; ip daddr 10.99.0.0/16 dnat to 10.32.0.1; }; }";
        gw.exec("nft", &[nat]).expect("Liqo's NAT");
        Gateway {
            snd,
            gw,
            rcv,
            sandbox: None,
            allowed,
        }
    }

    /// Start the gateway pod's sandbox: a process in the gateway namespace, in the cgroup
    /// `pod<uid>` under `cgroups` (cgroup v1 `pids`), as the kubelet would place it.
    pub fn sandbox(&mut self, cgroups: &Path, uid: &str) {
        let dir = cgroups.join(format!("pod{uid}"));
        std::fs::create_dir_all(&dir).expect("the pod's cgroup");
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.gw.name()))
            .args(["sleep", "100000"])
            .stdin(Stdio::null())
            .spawn()
            .expect("the sandbox");
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string())
            .expect("the sandbox into the pod's cgroup");
        self.sandbox = Some((child, dir));
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some((mut c, dir)) = self.sandbox.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A UDP socket on `port` in the namespace `ns`: the calling thread enters it (the probe
/// threads, which own themselves, make one socket per gateway this way; a socket stays in
/// the namespace it was made in).
fn socket_in(ns: &str, port: u16) -> UdpSocket {
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("netns");
    // SAFETY: setns on a valid namespace fd affects only the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    UdpSocket::bind(("0.0.0.0", port)).expect("bind")
}

/// The probes of every gateway: one sender thread, one receiver thread.
pub struct Probes {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Probes {
    pub fn start(gws: &[Gateway]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(vec![Seen::default(); gws.len()]));
        let rcv: Vec<String> = gws.iter().map(|g| g.rcv.name().to_string()).collect();
        let snd: Vec<(String, Ipv4Addr)> = gws
            .iter()
            .map(|g| (g.snd.name().to_string(), g.allowed))
            .collect();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let receiver = {
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let socks: Vec<UdpSocket> = rcv
                    .iter()
                    .map(|n| {
                        let s = socket_in(n, PORT);
                        s.set_nonblocking(true).expect("nonblocking");
                        s
                    })
                    .collect();
                let _ = ready_tx.send(());
                let mut buf = [0u8; 64];
                // Blocked in poll(2) until a probe arrives (a harness that polled each socket
                // in a loop would keep a core of the node it measures busy).
                let mut fds: Vec<libc::pollfd> = socks
                    .iter()
                    .map(|s| libc::pollfd {
                        fd: std::os::fd::AsRawFd::as_raw_fd(s),
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: `fds` holds valid descriptors of sockets that outlive the call.
                    let ready =
                        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 50) };
                    if ready <= 0 {
                        continue;
                    }
                    for (i, s) in socks.iter().enumerate() {
                        if fds[i].revents == 0 {
                            continue;
                        }
                        fds[i].revents = 0;
                        while let Ok((n, _)) = s.recv_from(&mut buf) {
                            if n < 4 {
                                continue;
                            }
                            let dst = Ipv4Addr::new(buf[0], buf[1], buf[2], buf[3]);
                            let seq = buf
                                .get(4..12)
                                .and_then(|b| b.try_into().ok())
                                .map_or(0, u64::from_le_bytes);
                            let now = Instant::now();
                            if let Ok(mut v) = seen.lock() {
                                let e = &mut v[i];
                                if dst == DENIED {
                                    e.denied_got += 1;
                                    e.denied_last = Some(now);
                                    e.allowed_since = None;
                                } else {
                                    // A run of arrivals starts here when nothing arrived
                                    // since a denied one, or when datagrams before this one
                                    // were dropped (the boot policy drops both probes, and
                                    // without counting the pod's the last one before it
                                    // looked enforced from then on).
                                    e.allowed_got += 1;
                                    let gap = e.got_seq != 0 && seq > e.got_seq + 1;
                                    if e.allowed_since.is_none() || gap {
                                        e.allowed_since = Some(now);
                                    }
                                    e.got_seq = e.got_seq.max(seq);
                                }
                            }
                        }
                    }
                }
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the receivers bound");
        let sender = {
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let socks: Vec<(UdpSocket, Ipv4Addr)> =
                    snd.iter().map(|(n, a)| (socket_in(n, 0), *a)).collect();
                // Each datagram to a pod carries its number (after the 4 address bytes).
                let mut seqs = vec![1u64; socks.len()];
                while !stop.load(Ordering::Relaxed) {
                    for (i, (s, allowed)) in socks.iter().enumerate() {
                        for dst in [*allowed, DENIED] {
                            let mut msg = [0u8; 12];
                            msg[..4].copy_from_slice(&dst.octets());
                            msg[4..].copy_from_slice(&seqs[i].to_le_bytes());
                            let sent = s.send_to(&msg, SocketAddrV4::new(dst, PORT));
                            if sent.is_ok() && dst != DENIED {
                                if let Ok(mut v) = seen.lock() {
                                    v[i].allowed_sent += 1;
                                    v[i].sent_seq = seqs[i];
                                }
                                seqs[i] += 1;
                            }
                        }
                    }
                    std::thread::sleep(PERIOD);
                }
            })
        };
        Probes {
            seen,
            stop,
            threads: vec![receiver, sender],
        }
    }

    /// Forget what was seen of gateway `i` (a measurement starts).
    pub fn reset(&self, i: usize) {
        if let Ok(mut v) = self.seen.lock() {
            v[i] = Seen::default();
        }
    }

    pub fn of(&self, i: usize) -> Seen {
        self.seen.lock().map(|v| v[i]).unwrap_or_default()
    }
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
