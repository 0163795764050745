//! When each gateway's bpf datapath came into force, seen from outside the agent: the moment
//! its tunnel's link appears in the gateway's pin directory (`<pins>/gateways/<gateway>/links/`,
//! pinned as the program is attached). Whether nftables enforced the policy before that (a
//! bridged start) or the boot policy did, this is when the datapath itself filters.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the pin directories are looked at.
const POLL: Duration = Duration::from_millis(5);

/// A thread watching the gateways' pin directories from `since` until dropped.
pub struct Attached {
    seen: Arc<Mutex<BTreeMap<String, Duration>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Whether the gateway directory `dir` holds a pinned link of its tunnel.
fn tunnel_linked(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir.join("links")).is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_string_lossy().contains("liqo-tunnel"))
    })
}

impl Attached {
    pub fn watch(pins: PathBuf, since: Instant) -> Self {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                let gateways = pins.join("gateways");
                while !stop.load(Ordering::Relaxed) {
                    for e in std::fs::read_dir(&gateways).into_iter().flatten().flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let mut s = seen.lock().expect("the watch");
                        if !s.contains_key(&name) && tunnel_linked(&e.path()) {
                            s.insert(name, since.elapsed());
                        }
                    }
                    std::thread::sleep(POLL);
                }
            })
        };
        Self {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// From `since` to each gateway's datapath in force, sorted (those seen so far).
    pub fn times(&self) -> Vec<Duration> {
        let mut v: Vec<Duration> = self.named().into_iter().map(|(_, t)| t).collect();
        v.sort();
        v
    }

    /// Each gateway's pin directory and when its datapath came into force, from `since`.
    pub fn named(&self) -> Vec<(String, Duration)> {
        let s = self.seen.lock().expect("the watch");
        s.iter().map(|(n, t)| (n.clone(), *t)).collect()
    }

    /// Wait until `n` gateways' datapaths are in force, at most `patience`; their times.
    pub fn wait(&self, n: usize, patience: Duration) -> Vec<Duration> {
        let deadline = Instant::now() + patience;
        while self.times().len() < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.times()
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Remove the node's pin directory `pins` (every gateway's and spare's pins under it) and the
/// metadata the datapaths keep beside it under `/run/peerwall` (`meta.rs`): what the run's
/// agent left.
pub fn remove_pin_root(pins: &std::path::Path) {
    let _ = std::fs::remove_dir_all(pins);
    if let Some(meta) = peerwall_backend_bpf::meta::meta_path(pins, 0).parent() {
        let _ = std::fs::remove_dir_all(meta);
    }
}
