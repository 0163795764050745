//! Networks the integration tests build and the traffic they send: commands inside namespaces,
//! veth plumbing, the consumer → gateway → provider [`Topology`], listeners, sessions and
//! echoes, pings and connects, and fixtures of the policies they enforce.

use std::process::{Command, Output, Stdio};

use crate::proc::Proc;
use crate::{peerwall, require_root, NetNs};

/// Run a command, returning its output whatever the status.
pub fn sh(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

/// Run a command that must succeed.
pub fn must(program: &str, args: &[&str]) -> String {
    let o = sh(program, args);
    assert!(
        o.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Make the kernel of `ns` track IPv4 connections as a Liqo gateway's does: a NAT rule (Liqo's
/// remapping writes such rules into the gateway's FirewallConfiguration, liqotech/liqo
/// `pkg/liqo-controller-manager/networking/external-network/remapping/cidr.go`), here one
/// rewriting an address no packet has. A chain alone does not turn tracking on.
pub fn track_connections(ns: &NetNs) {
    let o = in_ns(
        ns,
        "nft",
        &["add table ip pwxnat; add chain ip pwxnat pre { type nat hook prerouting priority -100; }; add rule ip pwxnat pre ip daddr 192.0.2.1 dnat to 192.0.2.2"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `ip netns exec NS PROGRAM ARGS` (output whatever the status).
pub fn in_ns(ns: &NetNs, program: &str, args: &[&str]) -> Output {
    let mut full = vec!["netns", "exec", ns.name(), program];
    full.extend_from_slice(args);
    sh("ip", &full)
}

/// `peerwall ARGS` inside a namespace.
pub fn peerwall_in(ns: &NetNs, args: &[&str]) -> Output {
    let bin = peerwall();
    let mut full = vec![bin.to_str().unwrap_or_default()];
    full.extend_from_slice(args);
    in_ns(ns, full[0], &full[1..])
}

/// A veth pair between two namespaces with the given names, both up.
pub fn veth(a: &NetNs, a_name: &str, b: &NetNs, b_name: &str) {
    a.veth(a_name, b, b_name)
        .unwrap_or_else(|e| panic!("veth {a_name} - {b_name}: {e}"));
}

/// `ip -n NS ARGS` that must succeed.
pub fn ip(ns: &NetNs, args: &[&str]) {
    let mut full = vec!["-n", ns.name()];
    full.extend_from_slice(args);
    must("ip", &full);
}

/// A `peerwall` command run in the namespace's network with nsenter (which, unlike `ip netns
/// exec`, keeps the host's /sys/fs/bpf visible).
pub fn peerwall_nsenter(ns: &NetNs) -> std::process::Command {
    let mut c = std::process::Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", ns.name()))
        .arg(peerwall());
    c
}

/// `peerwall agent ARGS` in the namespace's network: its stdout discarded, its log (stderr)
/// printed if the test fails.
pub fn spawn_agent(ns: &NetNs, args: &[String]) -> Proc {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = std::env::temp_dir().join(format!(
        "pw-agent-{}-{}-{n}.log",
        ns.name(),
        std::process::id()
    ));
    let file = std::fs::File::create(&log).expect("the agent's log file");
    let child = peerwall_nsenter(ns)
        .arg("agent")
        .args(args)
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("peerwall agent");
    Proc::killed_on_drop_logged(child, log)
}

/// One ping from `src` to `dst` inside `ns`; true when answered.
pub fn ping(ns: &NetNs, src: &str, dst: &str) -> bool {
    in_ns(ns, "ping", &["-c", "1", "-W", "1", "-I", src, dst])
        .status
        .success()
}

/// With examples/thesis-block.yaml in force on the topology's gateway: pod1 (10.10.1.67) cannot
/// reach pod2 (10.20.1.2), every other pair still can.
pub fn assert_thesis_block_enforced(consumer: &NetNs) {
    assert!(
        !ping(consumer, "10.10.1.67", "10.20.1.2"),
        "pod1 → pod2 must be dropped"
    );
    assert!(
        ping(consumer, "10.10.1.68", "10.20.1.2"),
        "other pods still pass"
    );
    assert!(
        ping(consumer, "10.10.1.67", "10.20.1.3"),
        "pod1 reaches other pods"
    );
}

/// With examples/provider-protection.yaml in force (listeners on 10.20.1.2:8080, 10.20.3.1:8080
/// and 10.10.1.67:9090): the offloaded pod answers, the other pod does not, and connections the
/// provider opens get their replies back through the tunnel.
pub fn assert_provider_protection(t: &Topology) {
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", 8080),
        "offloaded pod reachable"
    );
    assert!(
        !tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "other pod denied"
    );
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.3.1"));
    assert!(
        tcp_connects(&t.provider, "10.20.3.1", "10.10.1.67", 9090),
        "replies pass"
    );
}

/// The output of one ping (to inspect ICMP errors).
pub fn ping_output(ns: &NetNs, src: &str, dst: &str) -> String {
    let o = in_ns(ns, "ping", &["-c", "1", "-W", "1", "-I", src, dst]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A TCP listener in `ns` on `addr:port` that accepts connections until dropped.
pub struct Listener {
    child: std::process::Child,
}

impl Listener {
    /// Start `socat` listening (forks per connection): each connection gets "ok", and then
    /// with `echo` every line it sends back.
    pub fn tcp(ns: &NetNs, addr: &str, port: u16) -> Self {
        Self::tcp_serving(ns, addr, port, "echo ok")
    }

    /// As [`Listener::tcp`], and then every line a connection sends comes back (a connection
    /// that lives across a policy change).
    pub fn tcp_echo(ns: &NetNs, addr: &str, port: u16) -> Self {
        Self::tcp_serving(ns, addr, port, "echo ok; cat")
    }

    fn tcp_serving(ns: &NetNs, addr: &str, port: u16, program: &str) -> Self {
        let bind = if addr.contains(':') {
            format!("TCP6-LISTEN:{port},bind=[{addr}],reuseaddr,fork")
        } else {
            format!("TCP4-LISTEN:{port},bind={addr},reuseaddr,fork")
        };
        let child = Command::new("ip")
            .args(["netns", "exec", ns.name(), "socat", &bind])
            .arg(format!("SYSTEM:{program}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("socat");
        // Wait until the port is bound.
        for _ in 0..100 {
            let o = in_ns(ns, "ss", &["-Hltn", &format!("sport = :{port}")]);
            if !String::from_utf8_lossy(&o.stdout).trim().is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Self { child }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP connection held open from inside a namespace (a `socat` client): lines written come
/// back through an echo [`Listener`] while the path lets them.
pub struct Session {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Session {
    /// Connect from `src` to `dst:port` (IPv4) inside `ns`; None when no "ok" greeting came.
    pub fn tcp(ns: &NetNs, src: &str, dst: &str, port: u16) -> Option<Self> {
        let mut s = Self::open(
            ns,
            &format!("TCP4:{dst}:{port},bind={src},connect-timeout=2"),
        )?;
        s.next_line(std::time::Duration::from_secs(3))
            .is_some_and(|l| l == "ok")
            .then_some(s)
    }

    /// A UDP stream from `src:sport` to `dst:port` (IPv4) inside `ns`, towards a UDP echo
    /// ([`udp_echo`]): one flow, every line a datagram.
    pub fn udp(ns: &NetNs, src: &str, sport: u16, dst: &str, port: u16) -> Option<Self> {
        Self::open(ns, &format!("UDP4:{dst}:{port},bind={src}:{sport}"))
    }

    fn open(ns: &NetNs, target: &str) -> Option<Self> {
        use std::io::BufRead;
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns.name(), "socat", "-"])
            .arg(target)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("socat");
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        };
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Some(Self {
            child,
            stdin,
            lines,
        })
    }

    fn next_line(&mut self, within: std::time::Duration) -> Option<String> {
        self.lines.recv_timeout(within).ok()
    }

    /// Whether `line` comes back within `within`.
    pub fn echoes(&mut self, line: &str, within: std::time::Duration) -> bool {
        use std::io::Write;
        if writeln!(self.stdin, "{line}").is_err() || self.stdin.flush().is_err() {
            return false;
        }
        let deadline = std::time::Instant::now() + within;
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.next_line(left) {
                Some(l) if l == line => return true,
                Some(_) => continue,
                None => return false,
            }
        }
        false
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A UDP echo on `addr:port` inside `ns` (every datagram back to its sender), stopped when
/// dropped.
pub fn udp_echo(ns: &NetNs, addr: &str, port: u16) -> Proc {
    let child = Command::new("ip")
        .args(["netns", "exec", ns.name(), "socat"])
        .arg(format!("UDP4-RECVFROM:{port},bind={addr},fork"))
        .arg("EXEC:cat")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("socat");
    Proc::killed_on_drop(child)
}

/// Whether a TCP connection from `src` to `dst:port` inside `ns` completes within a second.
pub fn tcp_connects(ns: &NetNs, src: &str, dst: &str, port: u16) -> bool {
    let target = if dst.contains(':') {
        format!("TCP6:[{dst}]:{port},bind=[{src}],connect-timeout=1")
    } else {
        format!("TCP4:{dst}:{port},bind={src},connect-timeout=1")
    };
    let o = in_ns(ns, "timeout", &["3", "socat", "-T", "1", "-", &target]);
    o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok")
}

/// A small "consumer → gateway → provider" topology:
/// consumer ns (pods 10.10.1.67, 10.10.1.68, fd10::67) —liqo-tunnel— gateway ns —liqo.abcdefghij—
/// provider ns (pods 10.20.1.2, 10.20.1.3, 10.20.3.1, fd20::2); the gateway's default routes
/// lead to the provider.
pub struct Topology {
    pub consumer: NetNs,
    pub gateway: NetNs,
    pub provider: NetNs,
}

pub const TUNNEL: &str = "liqo-tunnel";
pub const GENEVE: &str = "liqo.abcdefghij";

/// The gateway's Geneve-named link to the provider node: 169.254.0.2 on the gateway side,
/// the provider's default route through it, 10.20.0.0/16 routed towards the provider.
pub fn provider_link(gateway: &NetNs, provider: &NetNs) {
    veth(gateway, GENEVE, provider, "eth0");
    ip(gateway, &["addr", "add", "169.254.0.2/32", "dev", GENEVE]);
    ip(provider, &["route", "add", "169.254.0.2", "dev", "eth0"]);
    ip(
        provider,
        &[
            "route",
            "add",
            "default",
            "via",
            "169.254.0.2",
            "dev",
            "eth0",
        ],
    );
    ip(gateway, &["route", "add", "10.20.0.0/16", "dev", GENEVE]);
}

impl Topology {
    pub fn new() -> Self {
        require_root();
        let consumer = NetNs::new("pwt-c").expect("netns");
        let gateway = NetNs::new("pwt-g").expect("netns");
        let provider = NetNs::new("pwt-p").expect("netns");
        for ns in [&consumer, &gateway, &provider] {
            for k in [
                "net.ipv6.conf.all.accept_dad",
                "net.ipv6.conf.default.accept_dad",
            ] {
                ns.sysctl(k, "0").expect("sysctl");
            }
        }
        veth(&consumer, "eth0", &gateway, TUNNEL);
        tunnel_v4(&consumer, &gateway);
        provider_link(&gateway, &provider);
        for a in ["10.20.1.2/32", "10.20.1.3/32", "10.20.3.1/32"] {
            ip(&provider, &["addr", "add", a, "dev", "eth0"]);
        }
        ip(
            &consumer,
            &["addr", "add", "fd10::67/128", "dev", "eth0", "nodad"],
        );
        ip(
            &provider,
            &["addr", "add", "fd20::2/128", "dev", "eth0", "nodad"],
        );
        ip(
            &gateway,
            &["addr", "add", "fd10::1/64", "dev", TUNNEL, "nodad"],
        );
        ip(
            &gateway,
            &["addr", "add", "fd20::1/64", "dev", GENEVE, "nodad"],
        );
        // A gateway pod has default routes (through its pod network): every destination is
        // routable, and the bpf datapath answers new flows' paths from its local-address
        // mirror rather than a FIB lookup.
        ip(&gateway, &["route", "add", "default", "dev", GENEVE]);
        ip(&gateway, &["-6", "route", "add", "default", "dev", GENEVE]);
        ip(&consumer, &["route", "add", "fd10::1", "dev", "eth0"]);
        ip(
            &consumer,
            &["route", "add", "fd20::/64", "via", "fd10::1", "dev", "eth0"],
        );
        ip(&provider, &["route", "add", "fd20::1", "dev", "eth0"]);
        ip(
            &provider,
            &["route", "add", "fd10::/64", "via", "fd20::1", "dev", "eth0"],
        );
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.proxy_arp", "1"),
        ] {
            gateway.sysctl(k, v).expect("sysctl");
        }
        Self {
            consumer,
            gateway,
            provider,
        }
    }
}

impl Topology {
    /// The tunnel made again under its name (Liqo's userspace WireGuard does so each time its
    /// gateway container starts): a new device, a new ifindex, the consumer's IPv4 addresses
    /// and routes as [`Topology::new`] has them.
    pub fn make_tunnel_again(&self) {
        ip(&self.gateway, &["link", "del", TUNNEL]);
        veth(&self.consumer, "eth0", &self.gateway, TUNNEL);
        tunnel_v4(&self.consumer, &self.gateway);
    }
}

/// The tunnel's IPv4 side: the consumer's pods (10.10.1.67, .68) behind it, routed through the
/// gateway's 169.254.0.1, and the gateway's route back.
fn tunnel_v4(consumer: &NetNs, gateway: &NetNs) {
    for a in ["10.10.1.67/32", "10.10.1.68/32"] {
        ip(consumer, &["addr", "add", a, "dev", "eth0"]);
    }
    ip(gateway, &["addr", "add", "169.254.0.1/32", "dev", TUNNEL]);
    ip(consumer, &["route", "add", "169.254.0.1", "dev", "eth0"]);
    ip(
        consumer,
        &[
            "route",
            "add",
            "default",
            "via",
            "169.254.0.1",
            "dev",
            "eth0",
        ],
    );
    ip(gateway, &["route", "add", "10.10.0.0/16", "dev", TUNNEL]);
}

impl Default for Topology {
    fn default() -> Self {
        Self::new()
    }
}

/// The WireGuard public key of a private key (`wg pubkey`).
pub fn wg_pubkey(private: &str) -> String {
    use std::io::Write;
    let mut c = std::process::Command::new("wg")
        .arg("pubkey")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("wg pubkey");
    c.stdin
        .take()
        .unwrap()
        .write_all(private.as_bytes())
        .unwrap();
    String::from_utf8(c.wait_with_output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_string()
}

/// A fresh WireGuard key pair: (private, public).
pub fn wg_key() -> (String, String) {
    let private = must("wg", &["genkey"]).trim().to_string();
    let public = wg_pubkey(&private);
    (private, public)
}

/// A peer `a` with the controller's default options on [`TUNNEL`], and the sets of 3000
/// offloaded pods (10.21.0.0 upwards, every third address: no two adjacent) plus 10.20.1.2,
/// the topology's pod that answers.
pub fn sliced_peer() -> (
    peerwall_protection::Peer,
    peerwall_protection::Options,
    peerwall_protection::PeerSets,
) {
    use peerwall_protection::{Options, Peer, PeerSets};
    let mut offloaded: std::collections::BTreeSet<std::net::IpAddr> = (0..3000u32)
        .map(|i| std::net::IpAddr::V4(std::net::Ipv4Addr::from(0x0a15_0000 + i * 3)))
        .collect();
    offloaded.insert("10.20.1.2".parse().unwrap());
    (
        Peer {
            id: "a".into(),
            tenant_namespace: "liqo-tenant-a".into(),
            // The topology's consumer pods (Liqo's Configuration of peer a).
            sources: vec!["10.10.0.0/16".parse().unwrap()],
        },
        Options {
            tunnel: TUNNEL.into(),
            block_leaf_to_leaf: false,
            audit: false,
            liqo_ping_port: peerwall_protection::LIQO_PING_PORT,
            own_namespace_only: false,
            inline_budget: peerwall_protection::spill::INLINE_BUDGET,
        },
        PeerSets {
            offloaded,
            ..Default::default()
        },
    )
}

/// A forward chain that drops by default, accepts replies (established, related) and lets
/// the consumer, through the tunnel, open flows to 10.20.1.2: replies pass only as established.
pub const STATEFUL: &str = r#"apiVersion: networking.liqo.io/v1beta1
kind: FirewallConfiguration
metadata: {name: faults, namespace: default}
spec:
  table:
    name: faults
    family: INET
    chains:
    - name: stateful
      type: filter
      hook: forward
      priority: 0
      policy: drop
      rules:
        filterRules:
        - name: replies
          action: accept
          match:
          - {op: eq, ctstate: {value: [established, related]}}
        - name: to_offloaded
          action: accept
          match:
          - {op: eq, dev: {value: liqo-tunnel, position: in}}
          - {op: eq, ip: {value: 10.20.1.2, position: dst}}
"#;

/// One end of a UDP exchange or a TCP connection, in the network namespace at `netns` (a path:
/// `/run/netns/<name>`, `/proc/<pid>/ns/net`): it sends to the other end every 50 ms from a
/// fixed port and counts what it receives (in the file `rx`). An answering end
/// ([`Chatter::answer`]) starts sending only once it has heard from the other: the exchange is
/// then tracked in the other end's direction whatever the two processes' start-up times and
/// the tunnel's handshake, which a test of ending the other end's connection relies on.
pub struct Chatter {
    _p: Proc,
    rx: std::path::PathBuf,
}

impl Chatter {
    /// One end, by mode: `udp` (bound to the first address, sending to the second), `answer`
    /// (as `udp`, silent until it has received a datagram), `listen` (TCP: accepts one
    /// connection) or `connect` (TCP: connects, retrying until the other end listens); it
    /// sends a byte every 50 ms and counts the bytes it receives.
    const SCRIPT: &'static str = r#"
import os, socket, sys, threading, time
mode, addr, port, peer, pport, out = sys.argv[1:7]
dst = (peer, int(pport))
udp = mode in ("udp", "answer")
if udp:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, int(port)))
    send = lambda: s.sendto(b"x", dst)
else:
    if mode == "listen":
        l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        l.bind((addr, int(port)))
        l.listen(1)
        s, _ = l.accept()
    else:
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, int(port)))
            try:
                s.connect(dst)
                break
            except OSError:
                s.close()
                time.sleep(0.1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send = lambda: s.send(b"x")
n = 0
def rx():
    global n
    while True:
        try:
            d = s.recv(64)
        except OSError:
            if udp:
                continue
            return
        if not d:
            return
        n += len(d)
        with open(out + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(out + ".tmp", out)
threading.Thread(target=rx, daemon=True).start()
while True:
    if mode != "answer" or n > 0:
        try:
            send()
        except OSError:
            pass
    time.sleep(0.05)
"#;

    pub fn start(netns: &str, from: (&str, u16), to: (&str, u16), rx: std::path::PathBuf) -> Self {
        Self::spawn(netns, "udp", from, to, rx)
    }

    /// A UDP end that stays silent until it has received a datagram from `to`'s side, then
    /// sends as [`Self::start`]'s does: the exchange is the other end's (its first datagram
    /// crossed every hook before any of this end's).
    pub fn answer(netns: &str, from: (&str, u16), to: (&str, u16), rx: std::path::PathBuf) -> Self {
        Self::spawn(netns, "answer", from, to, rx)
    }

    /// [`Self::SCRIPT`] run by python3 in `netns` in `mode`, with both ends and the file it
    /// counts into.
    fn spawn(
        netns: &str,
        mode: &str,
        from: (&str, u16),
        to: (&str, u16),
        rx: std::path::PathBuf,
    ) -> Self {
        let child = std::process::Command::new("nsenter")
            .arg(format!("--net={netns}"))
            .args(["python3", "-c", Self::SCRIPT, mode])
            .args([from.0, &from.1.to_string(), to.0, &to.1.to_string()])
            .arg(&rx)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        Self {
            _p: Proc::killed_on_drop(child),
            rx,
        }
    }

    /// One end of a TCP connection, in the network namespace at `netns`: with `listen`, it
    /// accepts one connection on `from`; otherwise it connects from `from` to `to` (retrying
    /// until the other end listens). Either end then writes a byte every 50 ms (no Nagle
    /// delay) and counts the bytes it receives (in the file `rx`).
    pub fn start_tcp(
        netns: &str,
        listen: bool,
        from: (&str, u16),
        to: (&str, u16),
        rx: std::path::PathBuf,
    ) -> Self {
        let mode = if listen { "listen" } else { "connect" };
        Self::spawn(netns, mode, from, to, rx)
    }

    /// Datagrams (TCP: bytes) received so far.
    pub fn received(&self) -> u64 {
        std::fs::read_to_string(&self.rx)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Pin the calling thread to `cpu` (a gateway's datapath runs a packet on the CPU that sends
/// it through the veth pair, and keeps its per-packet state per CPU).
pub fn on_cpu(cpu: usize) {
    // SAFETY: a zeroed `cpu_set_t` with one bit set, for this thread (0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity({cpu})"
        );
    }
}
