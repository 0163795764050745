//! Traffic: 64-byte UDP frames from an AF_PACKET sender pinned to one core, and rates.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use peerwall_netns::NetNs;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// The sources of the generated traffic unless a policy names its own: the peer's pod CIDR in
/// the gateway configuration's source check (Liqo's `Configuration`).
pub(crate) const SOURCES: &str = "172.16.0.0/16";

pub(crate) fn checksum(b: &[u8]) -> u16 {
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

/// Ethernet and IPv4 headers (no options, DF, TTL 64, checksum 0 until [`fix_checksums`]) of
/// a packet of `proto` whose layer 4 is `l4_len` bytes.
fn eth_ipv4(
    macs: ([u8; 6], [u8; 6]),
    addrs: (Ipv4Addr, Ipv4Addr),
    proto: u8,
    l4_len: u16,
) -> Vec<u8> {
    let (src_mac, dst_mac) = macs;
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
    ip[2..4].copy_from_slice(&(20 + l4_len).to_be_bytes());
    ip.extend_from_slice(&addrs.0.octets());
    ip.extend_from_slice(&addrs.1.octets());
    f.extend_from_slice(&ip);
    f
}

/// A 64-byte Ethernet/IPv4/UDP frame (UDP checksum 0: allowed for IPv4).
pub(crate) fn frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
) -> Vec<u8> {
    let udp_len = (64 - 14 - 20) as u16;
    let mut f = eth_ipv4((src_mac, dst_mac), (src, dst), 17, udp_len);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&udp_len.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.resize(64, 0);
    fix_checksums(&mut f);
    f
}

/// How a sender varies its frames from one packet to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vary {
    /// As built: the frames' flows, each known after the first pass.
    Fixed,
    /// Every packet a new flow: source port and the source address's low 16 bits from a
    /// counter (about 3.9e9 tuples before one repeats), which goes on from one sender to the
    /// next ([`FRESH_NEXT`]): a window after another (`program_ns`'s after the measured one)
    /// sends flows no table holds yet, not the same flows again.
    Fresh,
    /// `n` flows, cycled: the counter modulo `n`.
    Cycle(u32),
}

/// The flow number the next [`Vary::Fresh`] sender starts from: where the last one stopped.
static FRESH_NEXT: AtomicU32 = AtomicU32::new(0);

/// A 64-byte Ethernet/IPv4/TCP SYN frame (checksums computed).
pub(crate) fn syn_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
) -> Vec<u8> {
    let mut f = eth_ipv4((src_mac, dst_mac), (src, dst), 6, 20);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&0x1234_5678u32.to_be_bytes()); // seq
    f.extend_from_slice(&[0, 0, 0, 0]); // ack
    f.extend_from_slice(&[0x50, 0x02]); // data offset 5, SYN
    f.extend_from_slice(&64240u16.to_be_bytes()); // window
    f.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
    f.resize(64, 0);
    fix_checksums(&mut f);
    f
}

/// The IPv4 header checksum and, for TCP, the TCP checksum (pseudo header + 20-byte header,
/// no payload) of a frame built here. UDP frames carry checksum 0 (allowed for IPv4).
fn fix_checksums(f: &mut [u8]) {
    f[24..26].copy_from_slice(&[0, 0]);
    let c = checksum(&f[14..34]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    if f[23] == 6 {
        f[50..52].copy_from_slice(&[0, 0]);
        let mut pseudo = [0u8; 32];
        pseudo[..8].copy_from_slice(&f[26..34]);
        pseudo[9] = 6;
        pseudo[11] = 20;
        pseudo[12..32].copy_from_slice(&f[34..54]);
        let c = checksum(&pseudo);
        f[50..52].copy_from_slice(&c.to_be_bytes());
    }
}

/// Give frame `f` the flow numbered `n`: source port and the source address's low 16 bits.
fn restamp(f: &mut [u8], n: u32) {
    let sport = 1024 + (n % 60_000) as u16;
    let host = 1 + ((n / 60_000) % 0xfffe) as u16;
    f[28..30].copy_from_slice(&host.to_be_bytes());
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    fix_checksums(f);
}

/// Send `frames` round-robin from `ns`/eth0 until `stop`; pinned to one CPU.
pub(crate) fn blast(
    ns: &NetNs,
    frames: Arc<Vec<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    pace: Option<Duration>,
    sent: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    blast_with(ns, frames, stop, pace, sent, Vary::Fixed, SENDER_CPU)
}

/// [`blast`] varying the frames as `vary` says, pinned to `cpu`. The sender restamps every
/// frame before it goes whatever the datapath, so every row of a traffic kind pays the same.
pub(crate) fn blast_with(
    ns: &NetNs,
    frames: Arc<Vec<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    pace: Option<Duration>,
    sent: Arc<AtomicU64>,
    vary: Vary,
    cpu: usize,
) -> std::thread::JoinHandle<()> {
    let path = format!("/run/netns/{}", ns.name());
    std::thread::spawn(move || {
        let mut frames: Vec<Vec<u8>> = frames.as_ref().clone();
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
            libc::CPU_SET(cpu, &mut set);
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
            .iter_mut()
            .map(|f| libc::iovec {
                iov_base: f.as_mut_ptr().cast::<libc::c_void>(),
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
        let fresh = vary == Vary::Fresh;
        let mut flow = if fresh {
            FRESH_NEXT.load(Ordering::Relaxed)
        } else {
            0u32
        };
        while !stop.load(Ordering::Relaxed) {
            let batch = if pace.is_some() { 1 } else { BATCH.min(n - i) };
            if vary != Vary::Fixed {
                for m in &msgs[i..i + batch] {
                    // SAFETY: each iovec points at one frame of `frames`, alive and not
                    // otherwise borrowed while this thread sends.
                    let f = unsafe {
                        let v = &*m.msg_hdr.msg_iov;
                        std::slice::from_raw_parts_mut(v.iov_base.cast::<u8>(), v.iov_len)
                    };
                    restamp(f, flow);
                    flow = match vary {
                        Vary::Cycle(c) => (flow + 1) % c.max(1),
                        _ => flow.wrapping_add(1),
                    };
                }
            }
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
        if fresh {
            FRESH_NEXT.store(flow, Ordering::Relaxed);
        }
    })
}

/// One measured window: returns (forwarded pps, taken-in pps).
pub(crate) fn measure(
    lab: &Lab,
    frames: &Arc<Vec<Vec<u8>>>,
    warmup: Duration,
    window: Duration,
) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let h = blast(&lab.snd, frames.clone(), stop.clone(), None, sent);
    std::thread::sleep(warmup);
    let rates = rates_over(lab, window);
    stop.store(true, Ordering::Relaxed);
    let _ = h.join();
    rates
}

/// What the gateway did over `window` of a running stream: (packets it forwarded per second,
/// packets it took in per second: the sender's transmissions minus what was dropped for lack
/// of CPU before the gateway, veth `tx_dropped` and softnet `dropped`).
pub(crate) fn rates_over(lab: &Lab, window: Duration) -> (f64, f64) {
    let (_, s_tx0, s_drop0) = link_stats(&lab.snd, "eth0");
    let (_, g_tx0, _) = link_stats(&lab.gw, GENEVE);
    let sn0 = softnet_dropped();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let (_, s_tx1, s_drop1) = link_stats(&lab.snd, "eth0");
    let (_, g_tx1, _) = link_stats(&lab.gw, GENEVE);
    let sn1 = softnet_dropped();
    let secs = t0.elapsed().as_secs_f64();
    let taken = (s_tx1 - s_tx0).saturating_sub((s_drop1 - s_drop0) + (sn1 - sn0));
    ((g_tx1 - g_tx0) as f64 / secs, taken as f64 / secs)
}

pub(crate) fn frames_for(
    lab: &Lab,
    dsts: &[(Ipv4Addr, u16)],
    srcs: Option<&[Ipv4Addr]>,
    seed: u64,
) -> Arc<Vec<Vec<u8>>> {
    let mut rng = StdRng::seed_from_u64(seed);
    Arc::new(
        dsts.iter()
            .enumerate()
            .map(|(i, &(d, port))| {
                let src = match srcs {
                    Some(s) => s[i % s.len()],
                    // In SOURCES.
                    None => Ipv4Addr::from(0xac10_0000 | rng.random_range(1..0xfffeu32)),
                };
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

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

/// Install in the receiver's prerouting a table `table` counting packets that match `matches`.
pub(crate) fn rcv_counter_install(lab: &Lab, table: &str, matches: &str) {
    let file = lab.dir.join(format!("{table}.nft"));
    let text = format!(
        "table ip {table} {{\n chain pre {{\n  type filter hook prerouting priority 0; policy accept;\n  {matches} counter\n }}\n}}\n"
    );
    std::fs::write(&file, text).expect("write");
    in_ns(&lab.rcv, "nft", &["-f", &file.to_string_lossy()]);
}

/// The packets counted so far by the receiver's table `table`.
pub(crate) fn rcv_counted(lab: &Lab, table: &str) -> u64 {
    let out = in_ns(&lab.rcv, "nft", &["-j", "list", "table", "ip", table]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("nft -j");
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["rule"]["expr"].as_array())
        .flatten()
        .find_map(|e| e["counter"]["packets"].as_u64())
        .unwrap_or(0)
}

/// The exact check that a filtering datapath forwards no denied packet: every IPv4 packet that
/// reaches the receiver is counted (`pwguard` in its prerouting) but the floods' flow beside
/// (allowed, from `except`), installed only around denied windows, where nothing else should
/// reach it (the rule would otherwise cost the receiver a little per allowed packet). Removed
/// on drop.
pub(crate) struct DeniedGuard<'a> {
    lab: &'a Lab,
}

impl<'a> DeniedGuard<'a> {
    pub(crate) fn install(lab: &'a Lab, except: Ipv4Addr) -> Self {
        rcv_counter_install(lab, "pwguard", &format!("ip saddr != {except}"));
        DeniedGuard { lab }
    }

    /// Denied packets the receiver got since the guard was installed.
    pub(crate) fn leaked(&self) -> u64 {
        rcv_counted(self.lab, "pwguard")
    }
}

impl Drop for DeniedGuard<'_> {
    fn drop(&mut self) {
        in_ns(&self.lab.rcv, "nft", &["delete", "table", "ip", "pwguard"]);
    }
}
