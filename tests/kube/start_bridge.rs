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
//!   nftables table of the peer's policy is left in the gateway's namespace.

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
    (FIRST..FIRST + GATEWAYS)
        .filter(|&i| {
            let span = format!("peer={}", peer(i));
            log.lines().any(|l| l.contains(&span) && l.contains(what))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_loading_their_bpf_datapath_enforce_through_nftables_then_hand_over() {
    require_root();
    let server = ApiServer::start_with_crds(peerwall());
    let client = server.client().await;
    let peers = FIRST..FIRST + GATEWAYS;
    futures::stream::iter(peers.clone())
        .map(|i| peering(&client, i, 2))
        .buffer_unordered(4)
        .collect::<Vec<_>>()
        .await;
    let cmetrics = format!("127.0.0.1:{}", free_port());
    let controller = server.peerwall("controller", &["controller", "--metrics-addr", &cmetrics]);
    // The controller keeps running, as in a cluster: a gateway whose configuration is not
    // written yet holds its boot policy until it is.
    eventually(
        "the controller publishing every peer's pods",
        PATIENCE,
        || async {
            (crate::published::offloaded(&client, None).await >= GATEWAYS * 2).then_some(())
        },
    )
    .await;

    let tag = format!("peerwall-bridge-{}", std::process::id());
    let left = Leftovers {
        cgroups: std::path::PathBuf::from("/sys/fs/cgroup/pids").join(&tag),
        pins: std::path::PathBuf::from("/sys/fs/bpf").join(&tag),
    };
    let (cgroups, pins) = (left.cgroups.clone(), left.pins.clone());
    let mut gws: Vec<Gateway> = peers
        .clone()
        .map(|i| Gateway::new(i, pod_ip(i, 0)))
        .collect();
    let probes = Probes::start(&gws);
    for (i, gw) in peers.clone().zip(gws.iter_mut()) {
        gateway_pod(&client, i, NODE, gw, &cgroups).await;
    }
    // Before the agent every gateway forwards both probes: the probes work.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for g in 0..GATEWAYS {
        let s = probes.of(g);
        assert!(
            s.allowed_got > 0 && s.denied_last.is_some(),
            "gateway {g} forwards nothing before the agent: {s:?}"
        );
    }

    let metrics = format!("127.0.0.1:{}", free_port());
    let pins_arg = pins.to_string_lossy().to_string();
    let started = Instant::now();
    let attached = Attached::watch(pins.clone(), started);
    let agent = server.peerwall_logging(
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
            &pins_arg,
        ],
        "info,kube=warn",
    );
    // Until every datapath is in force: when each gateway first enforced (300 ms quiet), how
    // many datagrams to the address no pod has had reached it; none may after.
    let mut denied_at_enforced: Vec<Option<u64>> = vec![None; GATEWAYS];
    let deadline = Instant::now() + PATIENCE;
    loop {
        for (g, seen) in denied_at_enforced.iter_mut().enumerate() {
            let s = probes.of(g);
            if seen.is_none() && s.enforced(Duration::from_millis(300)).is_some() {
                *seen = Some(s.denied_got);
            }
        }
        if attached.times().len() >= GATEWAYS && denied_at_enforced.iter().all(Option::is_some) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every gateway enforced ({denied_at_enforced:?}) or had its datapath in force ({:?}); agent log:\n{}",
            attached.named(),
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Quiet after the last hand-over: what is enforced now is the datapath alone.
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let log = agent.log();
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
    for (g, i) in peers.clone().enumerate() {
        let s = probes.of(g);
        // Enforced: the peer's pod reached after the address no pod has last was, and for
        // 300 ms since (a datagram to that address arriving later resets it: a leak at the
        // hand-over, or after it, fails here).
        let enforced = s.enforced(Duration::from_millis(300)).unwrap_or_else(|| {
            panic!(
                "gateway of {} does not enforce: {s:?}; log:\n{log}",
                peer(i)
            )
        });
        let at = enforced.saturating_duration_since(started);
        assert_eq!(
            Some(s.denied_got),
            denied_at_enforced[g],
            "datagrams to the address no pod has reached {}'s side after its gateway enforced \
             (the hand-over, or after it)",
            peer(i)
        );
        let dir_prefix = format!("{}_", peer(i));
        let datapath = attached
            .named()
            .into_iter()
            .find(|(d, _)| d.starts_with(&dir_prefix))
            .map(|(_, t)| t)
            .unwrap_or_else(|| panic!("no pin directory of {}", peer(i)));
        eprintln!(
            "{}: enforced {at:?}, datapath in force {datapath:?}, bridged {}",
            peer(i),
            bridged.contains(&i)
        );
        if bridged.contains(&i) && at < datapath {
            before_datapath += 1;
        }
        // The datapath alone: no nftables table of the policy left (bpf keeps only its own).
        let tables = nft_tables(&gws[g].gw);
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
    drop((agent, controller, probes, gws, left));
}

/// The run's pin directory and cgroup, removed however the test ends (the gateways' sandboxes
/// go first: declared after this, they drop before it).
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
