//! The gateway the agent enforces in, and probe streams through it: a sender namespace behind
//! the gateway's `liqo-tunnel`, a receiver namespace behind its `liqo.bench00` that answers for
//! every pod address (a local route), UDP packets that carry their destination, and the first
//! and last time each destination was reached (one clock with the API events).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use peerwall_netns::NetNs;

pub use crate::topology::SENDER_CIDR;
const PORT: u16 = 9999;

/// First and last arrival per destination.
pub type Arrivals = Arc<Mutex<HashMap<Ipv4Addr, (Instant, Instant)>>>;

pub struct Gateway {
    /// Kept for their lifetime (deleted on drop).
    _snd: NetNs,
    pub gw: NetNs,
    _rcv: NetNs,
    /// Destinations the sender cycles through.
    pub targets: Arc<Mutex<Vec<Ipv4Addr>>>,
    pub arrivals: Arrivals,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Run `f` on a new thread inside `ns` (sockets it opens live there).
fn spawn_in(ns: &NetNs, f: impl FnOnce() + Send + 'static) -> std::thread::JoinHandle<()> {
    let file = std::fs::File::open(format!("/run/netns/{}", ns.name())).expect("netns");
    std::thread::spawn(move || {
        // SAFETY: setns on a valid namespace fd affects only this new thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        f();
    })
}

impl Gateway {
    pub fn new() -> Self {
        let crate::topology::Topology { snd, gw, rcv } =
            crate::topology::Topology::new("pwctl", "liqo.bench00");
        let stop = Arc::new(AtomicBool::new(false));
        let targets = Arc::new(Mutex::new(Vec::<Ipv4Addr>::new()));
        let arrivals: Arrivals = Arc::default();
        let receiver = {
            let (stop, arrivals) = (stop.clone(), arrivals.clone());
            spawn_in(&rcv, move || {
                let s = UdpSocket::bind(("0.0.0.0", PORT)).expect("bind");
                s.set_read_timeout(Some(Duration::from_millis(50))).ok();
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, _)) = s.recv_from(&mut buf) {
                        if n >= 4 {
                            let dst = Ipv4Addr::new(buf[0], buf[1], buf[2], buf[3]);
                            let now = Instant::now();
                            if let Ok(mut a) = arrivals.lock() {
                                a.entry(dst).and_modify(|e| e.1 = now).or_insert((now, now));
                            }
                        }
                    }
                }
            })
        };
        let sender = {
            let (stop, targets) = (stop.clone(), targets.clone());
            spawn_in(&snd, move || {
                let s = UdpSocket::bind(("0.0.0.0", 0)).expect("bind");
                while !stop.load(Ordering::Relaxed) {
                    let now: Vec<Ipv4Addr> = targets.lock().map(|t| t.clone()).unwrap_or_default();
                    for dst in now {
                        let _ = s.send_to(&dst.octets(), SocketAddrV4::new(dst, PORT));
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        Gateway {
            _snd: snd,
            gw,
            _rcv: rcv,
            targets,
            arrivals,
            stop,
            threads: vec![receiver, sender],
        }
    }

    /// Probe these destinations (replacing the previous ones) and forget their arrivals.
    pub fn probe(&self, dsts: &[Ipv4Addr]) {
        if let Ok(mut a) = self.arrivals.lock() {
            for d in dsts {
                a.remove(d);
            }
        }
        if let Ok(mut t) = self.targets.lock() {
            *t = dsts.to_vec();
        }
    }

    pub fn arrival(&self, dst: Ipv4Addr) -> Option<(Instant, Instant)> {
        self.arrivals.lock().ok()?.get(&dst).copied()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
