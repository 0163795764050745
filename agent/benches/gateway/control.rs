//! The control plane at scale: full sync and one more pod, timed by probe streams.

use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use peerwall::protection::{self, Options, PeerSets};

use super::*;

/// A probe stream: one packet to `dst` every 200 µs from the sender, until dropped.
pub(crate) struct Probe {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) thread: Option<std::thread::JoinHandle<()>>,
}

impl Probe {
    pub(crate) fn start(lab: &Lab, dst: Ipv4Addr) -> Self {
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
    pub(crate) fn forwarded(lab: &Lab) -> u64 {
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
pub(crate) fn time_to_first_packet(lab: &Lab, dst: Ipv4Addr, action: impl FnOnce()) -> Duration {
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
pub(crate) fn time_until_enforced(lab: &Lab, dst: Ipv4Addr, action: impl FnOnce()) -> Duration {
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

pub(crate) struct Agent {
    pub(crate) child: Child,
    /// Its warnings and errors (`PEERWALL_LOG=warn`), removed on drop.
    log: std::path::PathBuf,
}

impl Agent {
    /// `peerwall agent --source dir:DIR` in the gateway, its warnings and errors kept in a file
    /// ([`Agent::log_tail`]) for a failure's message. It gets SIGTERM
    /// when the benchmark's thread that started it ends, however it ends (a benchmark stopped
    /// with a signal skips every `Drop`), so that no agent outlives its run and takes CPU from
    /// the next one.
    pub(crate) fn spawn(
        lab: &Lab,
        dir: &std::path::Path,
        backend: &str,
        metrics: &str,
        extra: &[&str],
    ) -> Self {
        use std::os::unix::process::CommandExt as _;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", lab.gw.name()))
            .arg(peerwall_bin())
            .args(["agent", "--source", &format!("dir:{}", dir.display())])
            .args(["--backend", backend, "--pin-dir", &lab.pins()])
            .args(["--interfaces", TUNNEL, "--metrics-addr", metrics])
            .args(extra)
            .env("PEERWALL_LOG", "warn")
            .stdout(Stdio::null());
        let log = std::env::temp_dir().join(format!(
            "peerwall-bench-agent-{}-{}.log",
            std::process::id(),
            AGENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        match std::fs::File::create(&log) {
            Ok(f) => cmd.stderr(f),
            Err(_) => cmd.stderr(Stdio::null()),
        };
        // SAFETY: prctl(2) is async-signal-safe and only sets the child's parent-death signal,
        // which nsenter's exec of the agent keeps.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("agent");
        Agent { child, log }
    }

    /// The last lines the agent logged (warnings and errors).
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    pub(crate) fn peak_rss_kib(&self) -> u64 {
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
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Agents started by this process (their log files' names).
static AGENTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

pub(crate) struct ControlRow {
    pub(crate) dp: Datapath,
    pub(crate) full_load: Duration,
    pub(crate) one_pod: Duration,
    pub(crate) rss_kib: Option<u64>,
}

/// Control plane at `n` pods for one datapath: full sync, then one more pod, each timed by a
/// probe stream. Long on purpose: every datapath has its own install and incremental command,
/// and the two timings share the running agent or tool.
pub(crate) fn control_plane(lab: &Lab, dp: Datapath, n: usize, seed: u64) -> ControlRow {
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
            let backend = if dp == Datapath::PeerwallNft {
                "nftables"
            } else {
                "bpf"
            };
            let mut agent = None;
            let full_load = time_until_enforced(lab, Ipv4Addr::new(10, 64, 0, 9), || {
                agent = Some(Agent::spawn(
                    lab,
                    &pdir,
                    backend,
                    "127.0.0.1:0",
                    &["--interval-ms", "20"],
                ));
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
                    &[crate::traffic::SOURCES.parse().expect("CIDR")],
                    &sets,
                    &Options {
                        tunnel: TUNNEL.into(),
                        block_leaf_to_leaf: false,
                        audit: false,
                        liqo_ping_port: protection::LIQO_PING_PORT,
                        own_namespace_only: false,
                        inline_budget: peerwall_protection::spill::INLINE_BUDGET,
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
