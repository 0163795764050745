//! Gateway benchmark (`cargo xtask bench-gateway`, as root): the datapaths a platform engineer
//! would choose between, enforcing the same provider-protection policy in a gateway network
//! namespace between a sender and a receiver namespace over veth, measured side by side in one
//! run. Writes the `gateway` section of docs/bench.md and docs/bench-gateway.svg.
//!
//! Topology: `snd` (eth0) —veth— (`liqo-tunnel`) `gw` (`liqo.benchgw000`) —veth— (eth0) `rcv`.
//! The gateway forwards 10.0.0.0/8 towards `rcv` (one permanent next hop: no neighbour per
//! destination); `rcv` has forwarding off and drops them after a route lookup (no ICMP back).
//!
//! Traffic: 64-byte UDP frames from 172.16.0.0/16 written by an AF_PACKET socket
//! (PACKET_QDISC_BYPASS, sendmmsg batches of 64) on one core. On veth the whole path (send,
//! gateway, filter, forward) runs on that core, so the achieved rate is the inverse of the
//! per-packet CPU cost; the filter's cost per packet is `1/pps − 1/pps_baseline`.
//! - allowed: destinations drawn uniformly from the N offloaded pod IPs; figure = packets the
//!   gateway forwarded per second (tx of its receiver-side veth);
//! - denied: destinations outside the set; figure = packets the gateway took in and dropped per
//!   second (sender tx minus drops for lack of CPU: veth `tx_dropped`, softnet `dropped`); a
//!   run in which the gateway forwarded a denied packet, or forwarded less than 99 % of the
//!   allowed packets it took in, aborts the benchmark.
//!
//! Both are shown as ratios to the no-filter baseline forwarding the same frames.
//!
//! Datapaths: none; peerwall nftables; peerwall bpf (tcx); peerwall bpf + XDP early drop;
//! Liqo's rendering (one nftables rule per IP); iptables-legacy with one rule per IP; iptables +
//! ipset. Policies: the controller's gateway policy (`protection::gateway_spec`: default deny on
//! the tunnel, allow the consumer's offloaded pods) at 10 / 1k / 10k / 100k pod IPs, and a
//! mixed policy of 64 rules (CIDRs, ranges, port ranges; rule-per-IP renderings keep one rule
//! per FirewallConfiguration rule; ipset has nothing to offer there).
//!
//! Control plane at 100k pods: full load per datapath; one pod added → first packet through
//! (a probe stream to the new IP; for peerwall the agent watching a policy directory); agent
//! peak RSS. Settings: PEERWALL_BENCH_REPEATS (5), PEERWALL_BENCH_WINDOW_MS (1000),
//! PEERWALL_BENCH_SIZES (10,1000,10000,100000), PEERWALL_SEED (1).

mod doc;

use std::collections::{BTreeSet, HashSet};
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use peerwall::protection::{self, Options, PeerSets};
use peerwall_backend::netns::NetNs;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TUNNEL: &str = "liqo-tunnel";
const GENEVE: &str = "liqo.benchgw000";
const SENDER_CPU: usize = 1;
const BATCH: usize = 64;

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn peerwall_bin() -> &'static str {
    env!("CARGO_BIN_EXE_peerwall")
}

fn run(program: &str, args: &[&str]) -> String {
    let o = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        o.status.success(),
        "{program} {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn in_ns(ns: &NetNs, program: &str, args: &[&str]) -> String {
    let mut full = vec!["netns", "exec", ns.name(), program];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// `nsenter --net` keeps the host's /sys/fs/bpf visible (`ip netns exec` remounts /sys).
fn nsenter(ns: &NetNs, program: &str, args: &[&str]) -> String {
    let net = format!("--net=/run/netns/{}", ns.name());
    let mut full = vec![net.as_str(), program];
    full.extend_from_slice(args);
    run("nsenter", &full)
}

struct Lab {
    snd: NetNs,
    gw: NetNs,
    rcv: NetNs,
    gw_mac: [u8; 6],
    snd_mac: [u8; 6],
    dir: PathBuf,
}

fn mac_of(ns: &NetNs, dev: &str) -> [u8; 6] {
    let out = in_ns(ns, "cat", &[&format!("/sys/class/net/{dev}/address")]);
    let mut m = [0u8; 6];
    for (i, p) in out.trim().split(':').enumerate().take(6) {
        m[i] = u8::from_str_radix(p, 16).unwrap_or(0);
    }
    m
}

impl Lab {
    fn new() -> Self {
        let snd = NetNs::new("pwb-snd").expect("netns");
        let gw = NetNs::new("pwb-gw").expect("netns");
        let rcv = NetNs::new("pwb-rcv").expect("netns");
        let link = |a: &NetNs, an: &str, b: &NetNs, bn: &str| {
            run(
                "ip",
                &[
                    "link",
                    "add",
                    "pwbtmp0",
                    "netns",
                    a.name(),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "pwbtmp1",
                    "netns",
                    b.name(),
                ],
            );
            a.ip(&["link", "set", "pwbtmp0", "name", an])
                .expect("rename");
            b.ip(&["link", "set", "pwbtmp1", "name", bn])
                .expect("rename");
            a.ip(&["link", "set", an, "up"]).expect("up");
            b.ip(&["link", "set", bn, "up"]).expect("up");
        };
        link(&snd, "eth0", &gw, TUNNEL);
        link(&gw, GENEVE, &rcv, "eth0");
        let ip = |ns: &NetNs, args: &[&str]| {
            ns.ip(args).unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
        };
        ip(&snd, &["addr", "add", "172.30.0.2/30", "dev", "eth0"]);
        ip(&gw, &["addr", "add", "172.30.0.1/30", "dev", TUNNEL]);
        ip(&gw, &["addr", "add", "172.31.0.1/30", "dev", GENEVE]);
        ip(&rcv, &["addr", "add", "172.31.0.2/30", "dev", "eth0"]);
        let rcv_mac = mac_of(&rcv, "eth0");
        let snd_mac = mac_of(&snd, "eth0");
        let fmt = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        ip(
            &gw,
            &[
                "neigh",
                "replace",
                "172.31.0.2",
                "lladdr",
                &fmt(rcv_mac),
                "dev",
                GENEVE,
                "nud",
                "permanent",
            ],
        );
        ip(
            &gw,
            &[
                "neigh",
                "replace",
                "172.30.0.2",
                "lladdr",
                &fmt(snd_mac),
                "dev",
                TUNNEL,
                "nud",
                "permanent",
            ],
        );
        ip(&gw, &["route", "add", "10.0.0.0/8", "via", "172.31.0.2"]);
        ip(&gw, &["route", "add", "172.16.0.0/12", "via", "172.30.0.2"]);
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            gw.sysctl(k, v).expect("sysctl");
        }
        // `rcv` does not forward: it drops the packets after one route lookup, silently (no
        // ICMP is sent when forwarding is off).
        rcv.sysctl("net.ipv4.ip_forward", "0").expect("sysctl");
        let gw_mac = mac_of(&gw, TUNNEL);
        peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs");
        let dir = std::env::temp_dir().join(format!("peerwall-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("tmp dir");
        Lab {
            snd,
            gw,
            rcv,
            gw_mac,
            snd_mac,
            dir,
        }
    }

    fn pins(&self) -> String {
        format!("/sys/fs/bpf/peerwall-bench-{}", std::process::id())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let pins = self.pins();
        let _ = Command::new("nsenter")
            .args([
                &format!("--net=/run/netns/{}", self.gw.name()),
                peerwall_bin(),
                "delete",
                "--backend",
                "bpf",
                "--pin-dir",
                &pins,
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.rcv;
    }
}

/// Interface counters read with `ip -s -j`.
fn link_stats(ns: &NetNs, dev: &str) -> (u64, u64, u64) {
    let out = in_ns(ns, "ip", &["-s", "-j", "link", "show", "dev", dev]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j");
    let s = &v[0]["stats64"];
    let g = |p: &str| s.pointer(p).and_then(|x| x.as_u64()).unwrap_or(0);
    (g("/rx/packets"), g("/tx/packets"), g("/tx/dropped"))
}

/// Sum of the `dropped` column of /proc/net/softnet_stat (backlog overflows, all CPUs).
fn softnet_dropped() -> u64 {
    std::fs::read_to_string("/proc/net/softnet_stat")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|h| u64::from_str_radix(h, 16).ok())
        .sum()
}

fn checksum(b: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in b.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from(c[0]) << 8
        };
        sum += u32::from(w);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A 64-byte Ethernet/IPv4/UDP frame (UDP checksum 0: allowed for IPv4).
fn frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
) -> Vec<u8> {
    let payload = 64 - 14 - 20 - 8;
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let total = (20 + 8 + payload) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&((8 + payload) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.resize(64, 0);
    f
}

/// Send `frames` round-robin from `ns`/eth0 until `stop`; pinned to one CPU.
fn blast(
    ns: &NetNs,
    frames: Arc<Vec<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    pace: Option<Duration>,
    sent: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    let path = format!("/run/netns/{}", ns.name());
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("netns");
        // SAFETY: setns on a valid namespace fd, affecting only this thread.
        assert_eq!(
            unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) },
            0,
            "setns"
        );
        // SAFETY: cpu_set_t is plain data; sched_setaffinity(0) affects this thread only.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(SENDER_CPU, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
        // SAFETY: socket(2); the descriptor is owned at once.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        assert!(
            raw >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // /sys shows the host's interfaces after setns; the ioctl asks this namespace.
        let name = std::ffi::CString::new("eth0").unwrap_or_default();
        // SAFETY: valid NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = ifindex;
        sll.sll_halen = 6;
        // SAFETY: pointer/length describe `sll`.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with a c_int option value.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                std::ptr::addr_of!(one).cast(),
                4,
            );
        }
        let mut iov: Vec<libc::iovec> = frames
            .iter()
            .map(|f| libc::iovec {
                iov_base: f.as_ptr() as *mut libc::c_void,
                iov_len: f.len(),
            })
            .collect();
        // SAFETY: mmsghdr is plain data; each points at one iovec that outlives the sends.
        let mut msgs: Vec<libc::mmsghdr> = iov
            .iter_mut()
            .map(|v| {
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_iov = v;
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        let n = msgs.len();
        let mut i = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let batch = if pace.is_some() { 1 } else { BATCH.min(n - i) };
            // SAFETY: `msgs[i..i+batch]` are valid mmsghdrs.
            let r =
                unsafe { libc::sendmmsg(fd.as_raw_fd(), msgs[i..].as_mut_ptr(), batch as u32, 0) };
            if r > 0 {
                sent.fetch_add(r as u64, Ordering::Relaxed);
            }
            i = (i + batch) % n;
            if let Some(p) = pace {
                std::thread::sleep(p);
            }
        }
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Datapath {
    None,
    PeerwallNft,
    PeerwallBpf,
    PeerwallXdp,
    LiqoNft,
    IptablesRules,
    IptablesIpset,
}

impl Datapath {
    const ALL: [Datapath; 7] = [
        Datapath::None,
        Datapath::PeerwallNft,
        Datapath::PeerwallBpf,
        Datapath::PeerwallXdp,
        Datapath::LiqoNft,
        Datapath::IptablesRules,
        Datapath::IptablesIpset,
    ];
    fn label(self) -> &'static str {
        match self {
            Datapath::None => "no filter (baseline)",
            Datapath::PeerwallNft => "peerwall nftables",
            Datapath::PeerwallBpf => "peerwall bpf (tcx)",
            Datapath::PeerwallXdp => "peerwall bpf + XDP",
            Datapath::LiqoNft => "Liqo style: nft rule per IP",
            Datapath::IptablesRules => "iptables rule per IP",
            Datapath::IptablesIpset => "iptables + ipset",
        }
    }
}

/// A policy under test: peerwall's FirewallConfiguration plus the other renderings.
struct Policy {
    name: String,
    allowed: Vec<(Ipv4Addr, u16)>,
    denied: Vec<(Ipv4Addr, u16)>,
    fwc: serde_json::Value,
    /// Liqo / iptables rule-per-IP renderings, one line per rule (without the chain prefix).
    nft_rules: Vec<String>,
    ipt_rules: Vec<String>,
    /// ipset members (None: not expressible).
    ipset: Option<Vec<Ipv4Addr>>,
}

fn fwc_doc(spec: impl serde::Serialize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "peerwall.io/v1alpha1",
        "kind": "FirewallConfiguration",
        "metadata": {"name": "bench", "namespace": "liqo-tenant-bench", "labels": {"peerwall.io/target": "gateway"}},
        "spec": spec,
    })
}

fn unique_hosts(rng: &mut StdRng, n: usize, base: u32, bits: u32) -> Vec<Ipv4Addr> {
    let mut seen = HashSet::with_capacity(n);
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let a = base | rng.random_range(1..(1u32 << bits) - 1);
        if seen.insert(a) {
            v.push(Ipv4Addr::from(a));
        }
    }
    v
}

/// Provider protection for N offloaded pods (10.32.0.0/11); denied traffic goes to 10.64.0.0/11.
fn protection_policy(n: usize, seed: u64) -> Policy {
    let mut rng = StdRng::seed_from_u64(seed ^ n as u64);
    let pods = unique_hosts(&mut rng, n, 0x0a20_0000, 21);
    let sets = PeerSets {
        offloaded: pods.iter().map(|&a| a.into()).collect::<BTreeSet<_>>(),
        ..Default::default()
    };
    let spec = protection::gateway_spec(
        "bench",
        &sets,
        &Options {
            tunnel: TUNNEL.into(),
            block_leaf_to_leaf: false,
        },
    );
    let pick = |rng: &mut StdRng, v: &[Ipv4Addr]| v[rng.random_range(0..v.len())];
    let allowed = (0..1024).map(|_| (pick(&mut rng, &pods), 8080)).collect();
    let denied = (0..1024)
        .map(|_| {
            (
                Ipv4Addr::from(0x0a40_0000 | rng.random_range(1..(1u32 << 21) - 1)),
                8080,
            )
        })
        .collect();
    Policy {
        name: match n {
            n if n >= 1000 => format!("{}k pods", n / 1000),
            n => format!("{n} pods"),
        },
        allowed,
        denied,
        fwc: fwc_doc(spec),
        nft_rules: pods
            .iter()
            .map(|p| format!("iifname \"{TUNNEL}\" ip daddr {p} accept"))
            .chain([format!("iifname \"{TUNNEL}\" drop")])
            .collect(),
        ipt_rules: pods
            .iter()
            .map(|p| format!("-i {TUNNEL} -d {p} -j ACCEPT"))
            .chain([format!("-i {TUNNEL} -j DROP")])
            .collect(),
        ipset: Some(pods),
    }
}

/// 63 allow rules over CIDRs and address ranges with UDP port ranges, then default deny.
fn mixed_policy(seed: u64) -> Policy {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6464);
    let mut rules = vec![];
    let (mut nft, mut ipt) = (vec![], vec![]);
    let mut allowed = vec![];
    for i in 0..63u32 {
        let net = Ipv4Addr::new(10, 100 + i as u8, 0, 0);
        let (lo, hi) = (1000 + i as u16 * 10, 1005 + i as u16 * 10);
        let (value, nft_addr, ipt_addr) = if i % 2 == 0 {
            (
                format!("{net}/16"),
                format!("ip daddr {net}/16"),
                format!("-d {net}/16"),
            )
        } else {
            let end = Ipv4Addr::new(10, 100 + i as u8, 127, 255);
            (
                format!("{net}-{end}"),
                format!("ip daddr {net}-{end}"),
                format!("-m iprange --dst-range {net}-{end}"),
            )
        };
        rules.push(
            serde_json::json!({"name": format!("r{i}"), "action": "accept", "match": [
                {"op": "eq", "dev": {"value": TUNNEL, "position": "in"}},
                {"op": "eq", "ip": {"value": value, "position": "dst"}},
                {"op": "eq", "proto": {"value": "udp"}},
                {"op": "eq", "port": {"value": format!("{lo}-{hi}"), "position": "dst"}},
            ]}),
        );
        nft.push(format!(
            "iifname \"{TUNNEL}\" {nft_addr} udp dport {lo}-{hi} accept"
        ));
        ipt.push(format!(
            "-i {TUNNEL} {ipt_addr} -p udp --dport {lo}:{hi} -j ACCEPT"
        ));
        for _ in 0..16 {
            let a = Ipv4Addr::new(
                10,
                100 + i as u8,
                rng.random_range(0..128),
                rng.random_range(1..255),
            );
            allowed.push((a, rng.random_range(lo..=hi)));
        }
    }
    rules.push(serde_json::json!({"name": "default_deny", "action": "drop", "match": [{"op": "eq", "dev": {"value": TUNNEL, "position": "in"}}]}));
    nft.push(format!("iifname \"{TUNNEL}\" drop"));
    ipt.push(format!("-i {TUNNEL} -j DROP"));
    let denied = (0..1024)
        .map(|_| {
            (
                Ipv4Addr::new(10, 99, rng.random_range(0..255), rng.random_range(1..255)),
                1000,
            )
        })
        .collect();
    let spec = serde_json::json!({"table": {"name": "peerwall_mixed", "family": "INET", "chains": [{
        "name": "from_peer", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
        "rules": {"filterRules": rules}}]}});
    Policy {
        name: "mixed 64 rules".into(),
        allowed,
        denied,
        fwc: fwc_doc(spec),
        nft_rules: nft,
        ipt_rules: ipt,
        ipset: None,
    }
}

/// Install a datapath with a policy in the gateway; returns the load time.
fn install(lab: &Lab, dp: Datapath, p: &Policy) -> Option<Duration> {
    let file = lab.dir.join("policy.yaml");
    let started = Instant::now();
    match dp {
        Datapath::None => {}
        Datapath::PeerwallNft => {
            std::fs::write(&file, serde_yaml::to_string(&p.fwc).expect("yaml")).expect("write");
            in_ns(
                &lab.gw,
                peerwall_bin(),
                &["apply", "-f", &file.to_string_lossy()],
            );
        }
        Datapath::PeerwallBpf | Datapath::PeerwallXdp => {
            std::fs::write(&file, serde_yaml::to_string(&p.fwc).expect("yaml")).expect("write");
            let pins = lab.pins();
            let mut args = vec![
                "apply",
                "--backend",
                "bpf",
                "--pin-dir",
                &pins,
                "--interfaces",
                TUNNEL,
            ];
            if dp == Datapath::PeerwallXdp {
                args.push("--xdp");
            }
            let f = file.to_string_lossy().into_owned();
            args.extend(["-f", &f]);
            nsenter(&lab.gw, peerwall_bin(), &args);
        }
        Datapath::LiqoNft => {
            let mut s = String::from("table inet liqo_bench {\n chain liqo_fwd {\n  type filter hook forward priority 0; policy accept;\n");
            for r in &p.nft_rules {
                s.push_str("  ");
                s.push_str(r);
                s.push('\n');
            }
            s.push_str(" }\n}\n");
            std::fs::write(&file, s).expect("write");
            in_ns(&lab.gw, "nft", &["-f", &file.to_string_lossy()]);
        }
        Datapath::IptablesRules | Datapath::IptablesIpset => {
            let mut s = String::from("*filter\n:FORWARD ACCEPT [0:0]\n");
            if dp == Datapath::IptablesIpset {
                let members = p.ipset.as_ref()?;
                let mut set = format!(
                    "create offloaded hash:ip maxelem {}\n",
                    (members.len() * 2).max(1024)
                );
                for m in members {
                    set.push_str(&format!("add offloaded {m}\n"));
                }
                let sf = lab.dir.join("ipset.txt");
                std::fs::write(&sf, set).expect("write");
                let o = Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        lab.gw.name(),
                        "ipset",
                        "restore",
                        "-file",
                        &sf.to_string_lossy(),
                    ])
                    .output()
                    .expect("ipset");
                assert!(
                    o.status.success(),
                    "ipset restore: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                s.push_str(&format!("-A FORWARD -i {TUNNEL} -m set --match-set offloaded dst -j ACCEPT\n-A FORWARD -i {TUNNEL} -j DROP\n"));
            } else {
                for r in &p.ipt_rules {
                    s.push_str("-A FORWARD ");
                    s.push_str(r);
                    s.push('\n');
                }
            }
            s.push_str("COMMIT\n");
            let mut c = Command::new("ip")
                .args(["netns", "exec", lab.gw.name(), "iptables-legacy-restore"])
                .stdin(Stdio::piped())
                .spawn()
                .expect("iptables-legacy-restore");
            c.stdin
                .take()
                .expect("stdin")
                .write_all(s.as_bytes())
                .expect("write");
            assert!(
                c.wait().expect("wait").success(),
                "iptables-legacy-restore failed"
            );
        }
    }
    Some(started.elapsed())
}

fn uninstall(lab: &Lab, dp: Datapath) {
    match dp {
        Datapath::None => {}
        Datapath::PeerwallNft => {
            in_ns(&lab.gw, peerwall_bin(), &["delete"]);
        }
        Datapath::PeerwallBpf | Datapath::PeerwallXdp => {
            nsenter(
                &lab.gw,
                peerwall_bin(),
                &["delete", "--backend", "bpf", "--pin-dir", &lab.pins()],
            );
        }
        Datapath::LiqoNft => {
            in_ns(&lab.gw, "nft", &["delete", "table", "inet", "liqo_bench"]);
        }
        Datapath::IptablesRules | Datapath::IptablesIpset => {
            in_ns(&lab.gw, "iptables-legacy", &["-F", "FORWARD"]);
            if dp == Datapath::IptablesIpset {
                in_ns(&lab.gw, "ipset", &["destroy", "offloaded"]);
            }
        }
    }
}

/// One measured window: returns (forwarded pps, taken-in pps).
fn measure(
    lab: &Lab,
    frames: &Arc<Vec<Vec<u8>>>,
    warmup: Duration,
    window: Duration,
) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let h = blast(&lab.snd, frames.clone(), stop.clone(), None, sent);
    std::thread::sleep(warmup);
    let (_, s_tx0, s_drop0) = link_stats(&lab.snd, "eth0");
    let (_, g_tx0, _) = link_stats(&lab.gw, GENEVE);
    let sn0 = softnet_dropped();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let (_, s_tx1, s_drop1) = link_stats(&lab.snd, "eth0");
    let (_, g_tx1, _) = link_stats(&lab.gw, GENEVE);
    let sn1 = softnet_dropped();
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = h.join();
    let taken = (s_tx1 - s_tx0).saturating_sub((s_drop1 - s_drop0) + (sn1 - sn0));
    ((g_tx1 - g_tx0) as f64 / secs, taken as f64 / secs)
}

fn frames_for(lab: &Lab, dsts: &[(Ipv4Addr, u16)], seed: u64) -> Arc<Vec<Vec<u8>>> {
    let mut rng = StdRng::seed_from_u64(seed);
    Arc::new(
        dsts.iter()
            .map(|&(d, port)| {
                let src = Ipv4Addr::from(0xac10_0000 | rng.random_range(1..0xfffeu32));
                frame(
                    lab.snd_mac,
                    lab.gw_mac,
                    src,
                    d,
                    rng.random_range(1024..60000),
                    port,
                )
            })
            .collect(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

#[derive(Clone, Debug)]
struct Row {
    policy: String,
    dp: Datapath,
    allowed: Vec<f64>,
    denied: Vec<f64>,
    load: Option<Duration>,
}

/// A probe stream: one packet to `dst` every 200 µs from the sender, until dropped.
struct Probe {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Probe {
    fn start(lab: &Lab, dst: Ipv4Addr) -> Self {
        let frames = Arc::new(vec![frame(
            lab.snd_mac,
            lab.gw_mac,
            Ipv4Addr::new(172, 16, 9, 9),
            dst,
            40000,
            8080,
        )]);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = blast(
            &lab.snd,
            frames,
            stop.clone(),
            Some(Duration::from_micros(200)),
            Arc::new(AtomicU64::new(0)),
        );
        std::thread::sleep(Duration::from_millis(100));
        Probe {
            stop,
            thread: Some(thread),
        }
    }

    /// Packets the gateway forwarded so far (its receiver-side veth), polled gently: polling
    /// spawns `ip`, and the agent under test must keep a core.
    fn forwarded(lab: &Lab) -> u64 {
        std::thread::sleep(Duration::from_millis(2));
        link_stats(&lab.gw, GENEVE).1
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Time from `action` until a probe stream to `dst` starts coming through the gateway.
fn time_to_first_packet(lab: &Lab, dst: Ipv4Addr, action: impl FnOnce()) -> Duration {
    let _probe = Probe::start(lab, dst);
    let before = Probe::forwarded(lab);
    let started = Instant::now();
    action();
    while Probe::forwarded(lab) == before {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the new pod never became reachable"
        );
    }
    started.elapsed()
}

/// Time from `action` until a probe stream to the (soon denied) `dst` stops passing: the
/// moment the whole policy is in force. The stream must pass before `action`.
fn time_until_enforced(lab: &Lab, dst: Ipv4Addr, action: impl FnOnce()) -> Duration {
    let _probe = Probe::start(lab, dst);
    let mut last = Probe::forwarded(lab);
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        Probe::forwarded(lab) > last,
        "the probe does not pass before the policy"
    );
    let started = Instant::now();
    action();
    // A synchronous loader has the policy in force when it returns.
    let returned = started.elapsed();
    let mut last_change = started;
    while last_change.elapsed() < Duration::from_millis(200)
        && started.elapsed() < Duration::from_secs(600)
    {
        let now = Probe::forwarded(lab);
        if now != last {
            last = now;
            last_change = Instant::now();
        }
    }
    last_change.duration_since(started).max(returned)
}

struct Agent {
    child: Child,
}

impl Agent {
    fn peak_rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
            .unwrap_or(0)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

struct ControlRow {
    dp: Datapath,
    full_load: Duration,
    one_pod: Duration,
    rss_kib: Option<u64>,
}

/// Control plane at `n` pods for one datapath.
fn control_plane(lab: &Lab, dp: Datapath, n: usize, seed: u64) -> ControlRow {
    let base = protection_policy(n, seed);
    let pods = base.ipset.clone().unwrap_or_default();
    let new_pod = Ipv4Addr::new(10, 33, 255, 254);
    assert!(!pods.contains(&new_pod));
    match dp {
        Datapath::PeerwallNft | Datapath::PeerwallBpf => {
            let pdir = lab.dir.join("agent-policies");
            let _ = std::fs::remove_dir_all(&pdir);
            std::fs::create_dir_all(&pdir).expect("dir");
            let write = |p: &Policy| {
                let tmp = lab.dir.join("next.yaml");
                std::fs::write(&tmp, serde_yaml::to_string(&p.fwc).expect("yaml")).expect("write");
                std::fs::rename(&tmp, pdir.join("gateway.yaml")).expect("rename");
            };
            write(&base);
            let pins = lab.pins();
            let backend = if dp == Datapath::PeerwallNft {
                "nftables"
            } else {
                "bpf"
            };
            let mut agent = None;
            let full_load = time_until_enforced(lab, Ipv4Addr::new(10, 64, 0, 9), || {
                let child = Command::new("nsenter")
                    .args([
                        &format!("--net=/run/netns/{}", lab.gw.name()),
                        peerwall_bin(),
                        "agent",
                        "--source",
                        &format!("dir:{}", pdir.display()),
                        "--backend",
                        backend,
                        "--pin-dir",
                        &pins,
                        "--interfaces",
                        TUNNEL,
                        "--interval-ms",
                        "20",
                        "--metrics-addr",
                        "127.0.0.1:0",
                    ])
                    .env("PEERWALL_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("agent");
                agent = Some(Agent { child });
            });
            let mut grown = base.ipset.clone().unwrap_or_default();
            grown.push(new_pod);
            let sets = PeerSets {
                offloaded: grown.iter().map(|&a| a.into()).collect(),
                ..Default::default()
            };
            let next = Policy {
                fwc: fwc_doc(protection::gateway_spec(
                    "bench",
                    &sets,
                    &Options {
                        tunnel: TUNNEL.into(),
                        block_leaf_to_leaf: false,
                    },
                )),
                ..base
            };
            let one_pod = time_to_first_packet(lab, new_pod, || write(&next));
            let rss = agent.as_ref().map(Agent::peak_rss_kib);
            drop(agent);
            uninstall(lab, dp);
            ControlRow {
                dp,
                full_load,
                one_pod,
                rss_kib: rss,
            }
        }
        _ => {
            let full_load = time_until_enforced(lab, Ipv4Addr::new(10, 64, 0, 9), || {
                install(lab, dp, &base);
            });
            let one_pod = time_to_first_packet(lab, new_pod, || match dp {
                Datapath::LiqoNft => {
                    in_ns(
                        &lab.gw,
                        "nft",
                        &[
                            "insert",
                            "rule",
                            "inet",
                            "liqo_bench",
                            "liqo_fwd",
                            "iifname",
                            TUNNEL,
                            "ip",
                            "daddr",
                            &new_pod.to_string(),
                            "accept",
                        ],
                    );
                }
                Datapath::IptablesRules => {
                    in_ns(
                        &lab.gw,
                        "iptables-legacy",
                        &[
                            "-I",
                            "FORWARD",
                            "1",
                            "-i",
                            TUNNEL,
                            "-d",
                            &new_pod.to_string(),
                            "-j",
                            "ACCEPT",
                        ],
                    );
                }
                Datapath::IptablesIpset => {
                    in_ns(
                        &lab.gw,
                        "ipset",
                        &["add", "offloaded", &new_pod.to_string()],
                    );
                }
                _ => {}
            });
            uninstall(lab, dp);
            ControlRow {
                dp,
                full_load,
                one_pod,
                rss_kib: None,
            }
        }
    }
}

fn fmt_ratio(v: f64) -> String {
    if v >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn fmt_pps(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.0} k", v / 1e3)
    }
}

/// Grouped bars on a log scale, one panel per traffic kind.
fn svg(rows: &[Row], policies: &[String], base: &dyn Fn(&str, bool) -> f64) -> String {
    let dps: Vec<Datapath> = Datapath::ALL
        .iter()
        .copied()
        .filter(|d| *d != Datapath::None)
        .collect();
    let colors = [
        "#1f77b4", "#2ca02c", "#17becf", "#d62728", "#ff7f0e", "#9467bd",
    ];
    let (w, ph, top, left) = (900.0, 260.0, 40.0, 60.0);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n", 2.0 * (ph + top + 40.0) + 50.0);
    let y_of = |r: f64, y0: f64| {
        // log10 scale from 0.001 to 2.
        let l = r.clamp(0.001, 2.0).log10();
        y0 + ph - (l + 3.0) / (2f64.log10() + 3.0) * ph
    };
    for (panel, allowed) in [(0, true), (1, false)] {
        let y0 = top + panel as f64 * (ph + top + 40.0);
        s.push_str(&format!("<text x=\"{left}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{} traffic: packets per second as a ratio to no filter (log scale)</text>\n", y0 - 12.0, if allowed { "Allowed" } else { "Denied" }));
        for t in [0.001, 0.01, 0.1, 1.0] {
            let y = y_of(t, y0);
            s.push_str(&format!("<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{t}</text>\n", w - 20.0, left - 5.0, y + 4.0));
        }
        let gw = (w - left - 20.0) / policies.len() as f64;
        let bw = gw * 0.8 / dps.len() as f64;
        for (gi, p) in policies.iter().enumerate() {
            let gx = left + gi as f64 * gw + gw * 0.1;
            s.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{p}</text>\n",
                gx + gw * 0.4,
                y0 + ph + 15.0
            ));
            for (di, dp) in dps.iter().enumerate() {
                let Some(r) = rows.iter().find(|r| &r.policy == p && r.dp == *dp) else {
                    continue;
                };
                let v = median(if allowed {
                    r.allowed.clone()
                } else {
                    r.denied.clone()
                });
                let b = base(p, allowed);
                if b <= 0.0 || v <= 0.0 {
                    continue;
                }
                let ratio = v / b;
                let y = y_of(ratio, y0);
                s.push_str(&format!("<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"><title>{}: {}</title></rect>\n", gx + di as f64 * bw, bw * 0.9, y0 + ph - y, colors[di % colors.len()], dp.label(), fmt_ratio(ratio)));
            }
        }
    }
    let ly = 2.0 * (ph + top + 40.0) + 10.0;
    for (di, dp) in dps.iter().enumerate() {
        let x = left + (di % 3) as f64 * 260.0;
        let y = ly + (di / 3) as f64 * 16.0;
        s.push_str(&format!("<rect x=\"{x}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{:.1}\">{}</text>\n", y - 9.0, colors[di % colors.len()], x + 14.0, y, dp.label()));
    }
    s.push_str("</svg>\n");
    s
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the gateway benchmark needs root (network namespaces, nftables, bpf)");
        std::process::exit(1);
    }
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        // `cargo test --benches` probes harness-less benches: nothing to list or test here.
        return;
    }
    let repeats: usize = env_or("PEERWALL_BENCH_REPEATS", 5);
    let window = Duration::from_millis(env_or("PEERWALL_BENCH_WINDOW_MS", 1000));
    let warmup = Duration::from_millis(300);
    let seed: u64 = env_or("PEERWALL_SEED", 1);
    let sizes: Vec<usize> = std::env::var("PEERWALL_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10, 1000, 10_000, 100_000]);
    let lab = Lab::new();
    let mut policies: Vec<Policy> = sizes.iter().map(|&n| protection_policy(n, seed)).collect();
    policies.push(mixed_policy(seed));
    let mut rows: Vec<Row> = Vec::new();
    let started = Instant::now();
    for p in &policies {
        let fa = frames_for(&lab, &p.allowed, seed);
        let fd = frames_for(&lab, &p.denied, seed + 1);
        for dp in Datapath::ALL {
            let Some(load) = install(&lab, dp, p) else {
                continue;
            };
            let mut row = Row {
                policy: p.name.clone(),
                dp,
                allowed: vec![],
                denied: vec![],
                load: (dp != Datapath::None).then_some(load),
            };
            for _ in 0..repeats {
                let (fwd, taken) = measure(&lab, &fa, warmup, window);
                assert!(
                    fwd >= 0.9 * taken && fwd > 0.0,
                    "{}: {}: allowed traffic not forwarded ({fwd:.0} of {taken:.0} pps)",
                    p.name,
                    dp.label()
                );
                row.allowed.push(fwd);
                let (fwd_d, taken_d) = measure(&lab, &fd, warmup, window);
                if dp == Datapath::None {
                    row.denied.push(fwd_d);
                } else {
                    assert!(
                        fwd_d < 0.001 * taken_d + 100.0,
                        "{}: {}: denied traffic forwarded ({fwd_d:.0} pps)",
                        p.name,
                        dp.label()
                    );
                    row.denied.push(taken_d);
                }
            }
            uninstall(&lab, dp);
            eprintln!(
                "{:>15} | {:<28} | allowed {:>9} pps | denied {:>9} pps | load {:?}",
                p.name,
                dp.label(),
                fmt_pps(median(row.allowed.clone())),
                fmt_pps(median(row.denied.clone())),
                load
            );
            rows.push(row);
        }
    }
    let data_secs = started.elapsed().as_secs();
    let cp_n = *sizes.iter().max().unwrap_or(&100_000);
    let cp: Vec<ControlRow> = Datapath::ALL
        .iter()
        .filter(|d| !matches!(d, Datapath::None | Datapath::PeerwallXdp))
        .map(|&dp| {
            let r = control_plane(&lab, dp, cp_n, seed);
            eprintln!(
                "control plane {:<28} full {:?} one pod {:?}",
                dp.label(),
                r.full_load,
                r.one_pod
            );
            r
        })
        .collect();

    // Report.
    let base = |policy: &str, allowed: bool| {
        rows.iter()
            .find(|r| r.policy == policy && r.dp == Datapath::None)
            .map(|r| {
                median(if allowed {
                    r.allowed.clone()
                } else {
                    r.denied.clone()
                })
            })
            .unwrap_or(0.0)
    };
    let date = run("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let uname = run("uname", &["-r"]);
    let names: Vec<String> = policies.iter().map(|p| p.name.clone()).collect();
    let mut md = String::new();
    md.push_str("## Gateway benchmark against the alternatives (`cargo xtask bench-gateway`)\n\n");
    md.push_str(&format!(
        "Generated on {} (kernel {}, {} cores); data plane {data_secs} s, {repeats} runs of {} ms after {} ms warm-up per cell, seed {seed}.\n\n",
        date.trim(), uname.trim(), std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1), window.as_millis(), warmup.as_millis()
    ));
    md.push_str("Sender → gateway → receiver network namespaces over veth; 64-byte UDP from one AF_PACKET sender on one core (the whole path runs on that core, so rate = 1 / CPU cost per packet). Every datapath enforces the same policy: the controller's provider-protection configuration (default deny on `liqo-tunnel`, allow the consumer's N offloaded pods) or a mixed policy of 64 rules. *Allowed*: destinations drawn from the N pods, figure = packets forwarded per second. *Denied*: destinations outside them, figure = packets taken in and dropped per second. Ratios are to the no-filter gateway forwarding the same frames in this run (median of the runs; spread = min–max ratio). *Filter ns/pkt* = 1/pps − 1/pps(no filter), the CPU the filter adds to each allowed packet.\n\n");
    md.push_str("![gateway benchmark](bench-gateway.svg)\n\n");
    md.push_str("| policy | datapath | allowed: ratio (spread) | allowed pps | filter ns/pkt | denied: ratio (spread) | denied pps | load |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        let (ba, bd) = (base(&r.policy, true), base(&r.policy, false));
        let spread = |v: &[f64], b: f64| {
            let lo = v.iter().cloned().fold(f64::INFINITY, f64::min) / b;
            let hi = v.iter().cloned().fold(0.0, f64::max) / b;
            format!("{}–{}", fmt_ratio(lo), fmt_ratio(hi))
        };
        let ma = median(r.allowed.clone());
        let md_ = median(r.denied.clone());
        let cost = if r.dp == Datapath::None {
            "–".to_string()
        } else {
            format!("{:.0}", (1e9 / ma - 1e9 / ba).max(0.0))
        };
        md.push_str(&format!(
            "| {} | {} | {} ({}) | {} | {} | {} ({}) | {} | {} |\n",
            r.policy,
            r.dp.label(),
            fmt_ratio(ma / ba),
            spread(&r.allowed, ba),
            fmt_pps(ma),
            cost,
            fmt_ratio(md_ / bd),
            spread(&r.denied, bd),
            fmt_pps(md_),
            r.load
                .map(|d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_else(|| "–".into())
        ));
    }
    md.push_str(&format!("\nControl plane at {cp_n} offloaded pods, measured with probe streams through the gateway (one packet every 200 µs). *Full sync*: from starting the agent (peerwall) or the loading command (others) until a stream to a denied address stops passing, i.e. the whole policy is in force. *One more pod*: from the change until a stream to the new pod's address passes; peerwall through `peerwall agent --source dir:` polling every 20 ms (re-parse, validate and compile all {cp_n} addresses, then the backend's incremental update: one set element or one map entry), the others through their own incremental command (`nft insert rule`, `iptables -I`, `ipset add`).\n\n| datapath | full sync | one more pod | agent peak RSS |\n|---|---:|---:|---:|\n"));
    for c in &cp {
        md.push_str(&format!(
            "| {} | {:.0} ms | {:.1} ms | {} |\n",
            c.dp.label(),
            c.full_load.as_secs_f64() * 1e3,
            c.one_pod.as_secs_f64() * 1e3,
            c.rss_kib
                .map(|k| format!("{:.0} MiB", k as f64 / 1024.0))
                .unwrap_or_else(|| "–".into())
        ));
    }
    doc::write_section("gateway", md.trim_end()).expect("write docs/bench.md");
    std::fs::write(
        doc::docs_dir().join("bench-gateway.svg"),
        svg(&rows, &names, &base),
    )
    .expect("write svg");
    print!("{md}");
}
