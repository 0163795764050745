//! peerwall's bpf datapath against the limits of any tc program, in alternating windows of
//! one running stream.
//!
//! Separate installs measure two datapaths seconds apart, and this kind of VM moves between
//! forwarding regimes that last seconds (sampled every 100 ms with nothing installed: runs of
//! ~200 k pps and runs of ~290 k pps), so the ratio of two such windows can be off by a third
//! whatever the datapaths do. Here peerwall's datapath stays installed exactly as its row
//! measured it (under `peerwall agent --backend bpf`), and a limit program is attached with tcx *in
//! front of* it for some windows: the limit passes every allowed packet (`TC_ACT_OK`, tcx's
//! `TCX_PASS`), which ends tcx's walk, so in those windows a packet costs what the limit costs
//! alone. The windows of a cycle are bpf, limit, limit, bpf (the two limits swap places every
//! other cycle); each cycle gives bpf ÷ empty and bpf ÷ one hash lookup with the two bpf
//! windows averaged, so a drift that is linear over the cycle falls on both sides alike.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::*;

/// What runs in front of peerwall's program on the tunnel.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Front {
    /// Nothing: peerwall's datapath classifies.
    Peerwall,
    /// `peerwall_empty`: returns `TC_ACT_OK`.
    Empty,
    /// `peerwall_hash`: one hash lookup on the destination, `TC_ACT_OK` when it is there.
    Hash,
}

/// One cycle's ratios: (bpf ÷ empty tcx, bpf ÷ tcx one hash lookup).
pub(crate) type LimitRatios = (f64, f64);

/// A thread in the gateway's network namespace holding the limit programs (loaded from the
/// same object as the datapath, in their own pin directory so the datapath's pins are never
/// touched) and the one front link in place, if any.
struct Fronts {
    put: mpsc::Sender<Option<Front>>,
    done: mpsc::Receiver<Result<(), String>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pins: PathBuf,
}

impl Fronts {
    fn start(lab: &Lab, allowed: &[Ipv4Addr]) -> Fronts {
        let pins = PathBuf::from(format!("{}-limits", lab.pins()));
        let netns = format!("/run/netns/{}", lab.gw.name());
        let (put, orders) = mpsc::channel::<Option<Front>>();
        let (ack, done) = mpsc::channel::<Result<(), String>>();
        let allowed = allowed.to_vec();
        let dir = pins.clone();
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(&netns).expect("netns");
            // SAFETY: setns on a valid namespace fd, affecting only this thread.
            assert_eq!(
                unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) },
                0,
                "setns"
            );
            let mut b = match peerwall_backend_bpf::loader::Datapath::load_with(
                &dir,
                &peerwall_backend_bpf::loader::LoadOptions::with_baselines(),
            )
            .and_then(|mut b| b.fill_bare_hash(&allowed).map(|()| b))
            {
                Ok(b) => b,
                Err(e) => {
                    let _ = ack.send(Err(format!("loading the limit programs: {e}")));
                    return;
                }
            };
            let _ = ack.send(Ok(()));
            let mut link = None;
            while let Ok(Some(front)) = orders.recv() {
                // Detach the previous front first: at most one limit runs.
                drop(link.take());
                let program = match front {
                    Front::Peerwall => None,
                    Front::Empty => Some("peerwall_empty"),
                    Front::Hash => Some("peerwall_hash"),
                };
                let r = match program {
                    None => Ok(()),
                    Some(p) => b
                        .attach_first(p, TUNNEL)
                        .map(|l| link = Some(l))
                        .map_err(|e| format!("{p}: {e}")),
                };
                let _ = ack.send(r);
            }
        });
        let f = Fronts {
            put,
            done,
            thread: Some(thread),
            pins,
        };
        f.wait();
        f
    }

    fn wait(&self) {
        match self.done.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => panic!("the limits thread ended"),
        }
    }

    fn set(&self, front: Front) {
        self.put.send(Some(front)).expect("limits thread");
        self.wait();
    }
}

impl Drop for Fronts {
    fn drop(&mut self) {
        let _ = self.put.send(None);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

/// Packets peerwall's pinned datapath has counted so far (every rule and chain policy the
/// counter table holds).
fn datapath_packets(lab: &Lab) -> u64 {
    let i = peerwall_backend_bpf::inspect::inspect(std::path::Path::new(&lab.pins()))
        .expect("inspecting the datapath");
    i.chains
        .iter()
        .map(|c| {
            c.policy_packets.unwrap_or(0) + c.rules.iter().filter_map(|r| r.packets).sum::<u64>()
        })
        .sum()
}

/// `cycles` cycles of alternating windows with peerwall's bpf datapath installed on the
/// tunnel (see the module's text). Allowed traffic only: the limits pass it.
pub(crate) fn against_limits(
    lab: &Lab,
    frames: &Arc<Vec<Vec<u8>>>,
    allowed: &[Ipv4Addr],
    cycles: usize,
    window: Duration,
) -> Vec<LimitRatios> {
    let settle = Duration::from_millis(100);
    let fronts = Fronts::start(lab, allowed);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let h = blast(&lab.snd, frames.clone(), stop.clone(), None, sent);
    std::thread::sleep(Duration::from_millis(300));
    let rate = |front: Front| {
        fronts.set(front);
        std::thread::sleep(settle);
        let (_, a, _) = link_stats(&lab.gw, GENEVE);
        let counted = datapath_packets(lab);
        let t0 = Instant::now();
        std::thread::sleep(window);
        let (_, b, _) = link_stats(&lab.gw, GENEVE);
        let secs = t0.elapsed().as_secs_f64();
        // The bypass, asserted: with a limit in front, peerwall's datapath sees no packet
        // (its counters stand still); without, it counts the window's packets.
        let moved = datapath_packets(lab) - counted;
        if front == Front::Peerwall {
            assert!(
                moved > 0,
                "peerwall's datapath counted nothing in its own window"
            );
        } else {
            assert_eq!(
                moved, 0,
                "{front:?} in front: peerwall's datapath still counted {moved} packets"
            );
        }
        (b - a) as f64 / secs
    };
    let mut out = Vec::with_capacity(cycles);
    for c in 0..cycles {
        let (first, second) = if c % 2 == 0 {
            (Front::Empty, Front::Hash)
        } else {
            (Front::Hash, Front::Empty)
        };
        let b1 = rate(Front::Peerwall);
        let l1 = rate(first);
        let l2 = rate(second);
        let b2 = rate(Front::Peerwall);
        let (empty, hash) = if first == Front::Empty {
            (l1, l2)
        } else {
            (l2, l1)
        };
        assert!(
            b1 > 0.0 && b2 > 0.0 && empty > 0.0 && hash > 0.0,
            "alternating windows: allowed traffic not forwarded ({b1:.0}, {empty:.0}, {hash:.0}, {b2:.0} pps)"
        );
        let bpf = (b1 + b2) / 2.0;
        out.push((bpf / empty, bpf / hash));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = h.join();
    drop(fronts);
    out
}
