//! A node's bpf gateways starting together, fewer turns to load than gateways and no spare
//! datapath ready (the agent makes one only once no load runs): the gateways whose datapath
//! must load have nftables enforce their peer's policy meanwhile, and hand over to their
//! datapath once it is loaded (`agent/enforce/src/enforcement/bridge.rs`).
//!
//! The DaemonSet's gateway-pod mode (`peerwall agent --gateway-pods --backend bpf
//! --load-turns 1`) beside four Liqo gateway pods whose sandboxes are processes in their
//! gateway namespaces (no kubelet: `agent/benches/peers/fleet.rs`, shared with `cargo xtask
//! bench-peers`), each peer's policy published by the real `peerwall controller`. Probes
//! every 2 ms behind every tunnel, to the peer's pod and to an address no pod has, counted
//! where they arrive; each gateway's datapath is in force once its tunnel's link is pinned.
//! What a user would see:
//! - such a gateway forwards its peer's traffic **before** its datapath is in force, and
//!   from then on nothing reaches the address no pod has (not before, not across the
//!   hand-over, not after);
//! - after the hand-over the datapath alone enforces: the tunnel's program is attached and no
//!   nftables table of the peer's policy is left in the gateway's namespace;
//! - a Geneve link plumbed while the datapath takes over is attached too (the real-node test
//!   failed so: the datapath's guard dropped the pods' replies entering it);
//! - an agent stopped while datapaths still load (a rollout) leaves every gateway enforced and
//!   no half-loaded datapath behind.

use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::attached::Attached;
use crate::fleet::{Gateway, Probes};
use crate::pods::{gateway_pod, peer, peering, pod_ip};
use crate::support::*;
use peerwall_testkit::prelude::*;

const NODE: &str = "bridge-node";
/// Gateways: one loads at a time, the others wait for their turn.
const GATEWAYS: usize = 4;
/// Peer indices (their namespaces' names are made unique by `NetNs`).
const FIRST: usize = 90;
const PATIENCE: Duration = Duration::from_secs(120);

/// Peers (by index) whose gateway logged `what`.
fn peers_logging(log: &str, what: &str) -> Vec<usize> {
    peers()
        .filter(|&i| {
            let span = format!("peer={}", peer(i));
            log.lines().any(|l| l.contains(&span) && l.contains(what))
        })
        .collect()
}

/// The node: a real API server and controller, the peers' Liqo objects, the gateways with
/// their probes. Fields drop in this order: the probes, the gateways (sandboxes, namespaces),
/// then the pins and cgroups they used, then the controller and the server.
struct Node {
    probes: Probes,
    gws: Vec<Gateway>,
    left: Leftovers,
    /// Kept running for the test's length (stopped on drop).
    _controller: Proc,
    server: ApiServer,
}

impl Node {
    /// Every peer published by the controller, every gateway pod's sandbox up, both probes
    /// of every gateway forwarded (no agent yet: the probes work).
    async fn start(tag: &str) -> Self {
        require_root();
        let server = ApiServer::start_with_crds(peerwall());
        let client = server.client().await;
        futures::stream::iter(peers())
            .map(|i| peering(&client, i, 2))
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await;
        let cmetrics = format!("127.0.0.1:{}", free_port());
        // The controller keeps running, as in a cluster: a gateway whose configuration is not
        // written yet holds its boot policy until it is.
        let controller =
            server.peerwall("controller", &["controller", "--metrics-addr", &cmetrics]);
        eventually(
            "the controller publishing every peer's pods",
            PATIENCE,
            || async {
                (crate::published::offloaded(&client, None).await >= GATEWAYS * 2).then_some(())
            },
        )
        .await;
        let tag = format!("peerwall-bridge-{tag}-{}", std::process::id());
        let left = Leftovers {
            cgroups: std::path::PathBuf::from("/sys/fs/cgroup/pids").join(&tag),
            pins: std::path::PathBuf::from("/sys/fs/bpf").join(&tag),
        };
        let mut gws: Vec<Gateway> = peers().map(|i| Gateway::new(i, pod_ip(i, 0))).collect();
        let probes = Probes::start(&gws);
        for (i, gw) in peers().zip(gws.iter_mut()) {
            gateway_pod(&client, i, NODE, gw, &left.cgroups).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for g in 0..GATEWAYS {
            let s = probes.of(g);
            assert!(
                s.allowed_got > 0 && s.denied_last.is_some(),
                "gateway {g} forwards nothing before the agent: {s:?}"
            );
        }
        Node {
            probes,
            gws,
            left,
            _controller: controller,
            server,
        }
    }

    /// The DaemonSet's agent on this node, one bpf load at a time.
    fn agent(&self) -> Proc {
        let metrics = format!("127.0.0.1:{}", free_port());
        let pins = self.left.pins.to_string_lossy().to_string();
        self.server.peerwall_logging(
            "agent",
            &[
                "agent",
                "--source",
                "kube",
                "--gateway-pods",
                "--host",
                NODE,
                "--backend",
                "bpf",
                "--load-turns",
                "1",
                "--metrics-addr",
                &metrics,
                "--pin-dir",
                &pins,
            ],
            "info,kube=warn",
        )
    }

    /// For each gateway once it enforces (its peer's pod reached, the address no pod has not,
    /// for 300 ms): how many datagrams to that address had reached it by then. Waits until
    /// `also` holds too.
    async fn enforced(&self, agent: &Proc, also: impl Fn() -> bool) -> Vec<u64> {
        let mut denied: Vec<Option<u64>> = vec![None; GATEWAYS];
        let deadline = Instant::now() + PATIENCE;
        loop {
            for (g, seen) in denied.iter_mut().enumerate() {
                let s = self.probes.of(g);
                if seen.is_none() && s.enforced(Duration::from_millis(300)).is_some() {
                    *seen = Some(s.denied_got);
                }
            }
            if also() && denied.iter().all(Option::is_some) {
                return denied.into_iter().flatten().collect();
            }
            assert!(
                Instant::now() < deadline,
                "not every gateway enforced ({denied:?}); agent log:\n{}",
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Each gateway still enforces, and nothing more reached the address no pod has since
    /// `denied` (from [`Node::enforced`]).
    fn still_enforced(&self, denied: &[u64], when: &str, log: &str) {
        for (g, i) in peers().enumerate() {
            let s = self.probes.of(g);
            assert!(
                s.enforced(Duration::from_millis(300)).is_some(),
                "{} is not enforced {when}: {s:?}; log:\n{log}",
                peer(i)
            );
            assert_eq!(
                s.denied_got,
                denied[g],
                "datagrams to the address no pod has reached {}'s side {when}",
                peer(i)
            );
        }
    }
}

fn peers() -> std::ops::Range<usize> {
    FIRST..FIRST + GATEWAYS
}

/// When the datapath of peer `i`'s gateway came into force, if it did.
fn in_force(attached: &Attached, i: usize) -> Option<Duration> {
    let prefix = format!("{}_", peer(i));
    attached
        .named()
        .into_iter()
        .find(|(d, _)| d.starts_with(&prefix))
        .map(|(_, t)| t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_loading_their_bpf_datapath_enforce_through_nftables_then_hand_over() {
    let node = Node::start("over").await;
    let started = Instant::now();
    let attached = Attached::watch(node.left.pins.clone(), started);
    let late = LateLinks::start(&node);
    let agent = node.agent();
    let denied = node
        .enforced(&agent, || attached.times().len() >= GATEWAYS)
        .await;
    // Quiet after the last hand-over: what is enforced now is the datapath alone.
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let log = agent.log();
    late.attached_everywhere(&node, &log);
    node.still_enforced(
        &denied,
        "after its gateway enforced (the hand-over, or after it)",
        &log,
    );
    let bridged = peers_logging(&log, "the datapath must load");
    let took_over = peers_logging(&log, "the datapath took over from nftables");
    assert!(
        bridged.len() >= GATEWAYS - 1,
        "at the agent's start no spare is ready (one at most, made before a gateway was found): \
         bridged {bridged:?}; log:\n{log}"
    );
    assert_eq!(
        bridged, took_over,
        "every bridged gateway hands over; log:\n{log}"
    );
    let mut before_datapath = 0;
    for (g, i) in peers().enumerate() {
        let s = node.probes.of(g);
        let at = s
            .enforced(Duration::from_millis(300))
            .map(|t| t.saturating_duration_since(started))
            .unwrap_or_default();
        let datapath =
            in_force(&attached, i).unwrap_or_else(|| panic!("no pin directory of {}", peer(i)));
        eprintln!(
            "{}: enforced {at:?}, datapath in force {datapath:?}, bridged {}",
            peer(i),
            bridged.contains(&i)
        );
        if bridged.contains(&i) && at < datapath {
            before_datapath += 1;
        }
        // The datapath alone: no nftables table of the policy left (bpf keeps only its own).
        let tables = nft_tables(&node.gws[g].gw);
        let policy_table = format!("_{}", peer(i).replace('-', "_"));
        assert!(
            !tables.lines().any(|l| l.contains(&policy_table)),
            "the peer's nftables tables are still in {}'s gateway after the hand-over:\n{tables}",
            peer(i)
        );
        // The datapath's own nftables table stays (the withdrawal took only the bridge's).
        assert!(
            tables.contains("peerwall-guard"),
            "the datapath's guard is gone from {}'s gateway:\n{tables}",
            peer(i)
        );
    }
    assert!(
        before_datapath >= 1,
        "no bridged gateway forwarded its peer's traffic before its datapath was in force \
         (bridged {bridged:?}); log:\n{log}"
    );
    drop((agent, node));
}

/// The agent stopped (SIGTERM: a rollout, a node drain) while gateways' datapaths still load:
/// every gateway stays enforced (by its datapath, or by the nftables tables of its start, which
/// stay like any enforcement when the agent goes), and no gateway keeps a half-loaded datapath
/// (maps pinned, nothing attached) that the next agent would find.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_stopped_while_datapaths_load_leaves_each_gateway_enforced_and_nothing_half_loaded(
) {
    let node = Node::start("stop").await;
    let attached = Attached::watch(node.left.pins.clone(), Instant::now());
    let mut agent = node.agent();
    // Every gateway enforced (through nftables while its datapath waits), the first datapath
    // in force: the others load one at a time after it.
    let denied = node.enforced(&agent, || !attached.times().is_empty()).await;
    let loaded_before = attached.times().len();
    let stopping = Instant::now();
    agent.stop();
    let took = stopping.elapsed();
    let log = agent.log();
    assert!(
        took < Duration::from_secs(4),
        "the agent took {took:?} to stop (loads not given up?); log:\n{log}"
    );
    assert!(
        loaded_before < GATEWAYS,
        "every datapath was in force before the agent was stopped: nothing to check"
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    node.still_enforced(&denied, "after the agent stopped", &log);
    let gateways = node.left.pins.join("gateways");
    let mut half = Vec::new();
    for e in std::fs::read_dir(&gateways).into_iter().flatten().flatten() {
        let linked = std::fs::read_dir(e.path().join("links")).is_ok_and(|d| {
            d.flatten()
                .any(|l| l.file_name().to_string_lossy().contains("liqo-tunnel"))
        });
        let pinned = std::fs::read_dir(e.path()).map_or(0, |d| d.count());
        if !linked && pinned > 0 {
            half.push(format!(
                "{} ({pinned} pins)",
                e.file_name().to_string_lossy()
            ));
        }
    }
    assert!(
        half.is_empty(),
        "half-loaded datapaths left behind: {half:?}; log:\n{log}"
    );
    eprintln!(
        "stopped in {took:?} with {loaded_before} of {GATEWAYS} datapaths in force; every gateway still enforced"
    );
    drop((agent, node));
}

/// A Geneve-named link (`liqo.late`) born in each gateway the moment its datapath attached to
/// its tunnel, while the datapath still takes over (as Liqo's geneve container plumbs a
/// gateway while peerwall starts there): the datapath must attach to it too, since the guard
/// drops whatever enters an interface of its patterns that it is not attached to. Reacts
/// within about a millisecond of the tunnel's link pin, well inside the hand-over's apply
/// (its guard, the tc programs verified for patterns nothing matched yet, the kernel's
/// tracking held); an interface list read after that apply took it as seen and never attached
/// to it, which this caught.
struct LateLinks {
    thread: Option<std::thread::JoinHandle<Vec<Option<Duration>>>>,
}

const LATE: &str = "liqo.late";

impl LateLinks {
    fn start(node: &Node) -> Self {
        let gateways = node.left.pins.join("gateways");
        let targets: Vec<(String, String)> = peers()
            .zip(&node.gws)
            .map(|(i, g)| (format!("{}_", peer(i)), g.gw.name().to_string()))
            .collect();
        let thread = std::thread::spawn(move || {
            let mut born = vec![None; targets.len()];
            let start = Instant::now();
            while born.iter().any(Option::is_none) && start.elapsed() < PATIENCE {
                for ((prefix, ns), b) in targets.iter().zip(born.iter_mut()) {
                    if b.is_some() || !tunnel_linked_under(&gateways, prefix) {
                        continue;
                    }
                    let ip = |args: &[&str]| {
                        let out = std::process::Command::new("ip")
                            .args(["-n", ns])
                            .args(args)
                            .output()
                            .expect("ip");
                        assert!(out.status.success(), "ip {args:?} in {ns}: {out:?}");
                    };
                    ip(&[
                        "link", "add", LATE, "type", "veth", "peer", "name", "pwlate",
                    ]);
                    ip(&["link", "set", LATE, "up"]);
                    ip(&["link", "set", "pwlate", "up"]);
                    *b = Some(start.elapsed());
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            born
        });
        LateLinks {
            thread: Some(thread),
        }
    }

    /// Every gateway got its late link, and its datapath attached to it (its link pinned)
    /// within 10 s.
    fn attached_everywhere(mut self, node: &Node, log: &str) {
        let born = self
            .thread
            .take()
            .map(|t| t.join().expect("the late links' thread"));
        let born = born.unwrap_or_default();
        let gateways = node.left.pins.join("gateways");
        for (i, b) in peers().zip(&born) {
            assert!(b.is_some(), "{}'s tunnel was never attached", peer(i));
            let prefix = format!("{}_", peer(i));
            let deadline = Instant::now() + Duration::from_secs(10);
            while !linked_under(&gateways, &prefix, LATE) {
                assert!(
                    Instant::now() < deadline,
                    "{LATE}, born in {}'s gateway as its datapath attached to its tunnel, is \
                     not attached 10 s later (the guard drops what enters it); log:\n{log}",
                    peer(i)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Whether the datapath of the gateway whose directory under `gateways` starts with `prefix`
/// is attached to the interface `name`, as `peerwall inspect` lists it (a pinned link whose
/// device exists).
fn linked_under(gateways: &std::path::Path, prefix: &str, name: &str) -> bool {
    std::fs::read_dir(gateways)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            e.file_name().to_string_lossy().starts_with(prefix)
                && peerwall_backend_bpf::loader::attached_in(&e.path())
                    .iter()
                    .any(|a| a.split_once(':').is_some_and(|(_, i)| i == name))
        })
}

fn tunnel_linked_under(gateways: &std::path::Path, prefix: &str) -> bool {
    linked_under(gateways, prefix, "liqo-tunnel")
}

/// The run's pin directory and cgroup, removed however the test ends.
struct Leftovers {
    cgroups: std::path::PathBuf,
    pins: std::path::PathBuf,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        crate::attached::remove_pin_root(&self.pins);
        let _ = std::fs::remove_dir(&self.cgroups);
    }
}
