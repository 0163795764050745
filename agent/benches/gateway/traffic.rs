//! Traffic: 64-byte UDP frames from an AF_PACKET sender pinned to one core, and rates.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use peerwall_netns::NetNs;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

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

/// A 64-byte Ethernet/IPv4/UDP frame (UDP checksum 0: allowed for IPv4).
pub(crate) fn frame(
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
pub(crate) fn blast(
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

pub(crate) fn frames_for(lab: &Lab, dsts: &[(Ipv4Addr, u16)], seed: u64) -> Arc<Vec<Vec<u8>>> {
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

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}
