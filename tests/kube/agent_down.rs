//! A gateway pod created while no agent runs on the node (the agent OOM-killed, crash-looping,
//! being upgraded): `--cni-boot`'s `peerwall-boot` puts the boot policy in force in the pod's
//! sandbox before its containers run, so the peer reaches nothing through the new gateway,
//! offloaded or not, until an agent is back; then the offloaded pod is reached again and the
//! node's boot table is gone. The stream and counting are the churn's (`churn::Stream`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::churn::{delete_gateway_pod, Stream};
use super::*;

/// The node's CNI configuration (xtask/kube/start-node.sh) and the plugin's binary.
pub(super) const CONFLIST: &str = "/etc/cni/net.d/10-pods.conflist";
pub(super) const PLUGIN: &str = "/opt/cni/bin/peerwall-boot";

/// Whether the node's CNI chain holds `peerwall-boot`, with its binary.
pub(super) fn chained() -> bool {
    std::fs::read_to_string(CONFLIST).is_ok_and(|t| t.contains("\"peerwall-boot\""))
        && Path::new(PLUGIN).exists()
}

/// A pod's log, followed from now until [`Followed::finish`] (a pod being deleted takes its
/// log with it).
pub(super) struct Followed {
    child: std::process::Child,
    path: PathBuf,
}

/// Follow the log of the agent pod now on the node.
pub(super) fn follow_agent_logs(node: &Node) -> Followed {
    let agent = agent_pods(node, "jsonpath={.items[0].metadata.name}");
    let pod = String::from_utf8_lossy(&agent.stdout).trim().to_string();
    let path = node.dir.join(format!("{pod}.log"));
    let out = std::fs::File::create(&path).expect("log file");
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.ns))
        .arg(peerwall_testkit::kube::kube_bin_dir().join("kubectl"))
        .arg(format!("--kubeconfig={}", node.kubeconfig.display()))
        .args(["-n", "peerwall-system", "logs", "-f", &pod])
        .stdout(out)
        .spawn()
        .expect("kubectl logs -f");
    Followed { child, path }
}

impl Followed {
    /// What was logged, once the pod's log ended (or 30 s).
    pub(super) fn finish(mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    /// The ending agent said it keeps peerwall-boot chained, and it is chained (`what`: the
    /// occasion); otherwise its own words on the matter.
    pub(super) fn assert_kept_chained(self, what: &str) {
        let said = self.finish();
        assert!(
            said.contains("peerwall-boot stays in the CNI chain") && chained(),
            "{what} keeps peerwall-boot chained; the ending agent said: {}",
            said.lines()
                .filter(|l| l.contains("peerwall-boot") || l.contains("uninstall"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Packets `liqo-tunnel` received in the gateway's namespace (`/proc/net/dev` follows the
/// reader's network namespace; `/sys/class/net` would not).
fn tunnel_rx(gw_netns: &Path) -> u64 {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", gw_netns.display()))
        .args(["cat", "/proc/net/dev"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            let (name, stats) = l.split_once(':')?;
            (name.trim() == "liqo-tunnel")
                .then(|| stats.split_whitespace().nth(1)?.parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}

/// Patch the agent DaemonSet (`kubectl patch --type=TYPE`).
fn patch_agents(node: &Node, kind: &str, patch: &str) {
    node.kubectl_ok(&[
        "-n",
        "peerwall-system",
        "patch",
        "ds",
        "peerwall-agent",
        &format!("--type={kind}"),
        "-p",
        patch,
    ]);
}

/// Take the agent off the node (a nodeSelector no node has: its pod is deleted gracefully, as
/// in a rolling update), recreate the gateway pod under the stream, check nothing crosses it,
/// bring the agent back; returns the new gateway.
#[allow(clippy::too_many_arguments)]
pub(super) fn gateway_born_without_agent(
    node: &Node,
    consumer: &Consumer,
    peer: &str,
    key: &str,
    backend: &str,
    gw: Gateway,
    web: &(String, String),
    db: &(String, String),
) -> Gateway {
    assert!(chained(), "{backend}: the DaemonSet chained peerwall-boot");
    let cons = PathBuf::from(format!("/run/netns/{}", consumer.ns.name()));
    let web_ns = pod_netns(Path::new("/proc"), &web.0).expect("web pod namespace");
    let db_ns = pod_netns(Path::new("/proc"), &db.0).expect("db pod namespace");
    let stream = Stream::start(&cons, (&web_ns, &web.1), (&db_ns, &db.1));
    // The stream flows through the enforced gateway first: the sensitivity of the counts.
    wait(
        &format!("{backend}: the stream through the enforced gateway"),
        Duration::from_secs(30),
        || (stream.web.load(Ordering::Relaxed) > 20).then_some(()),
    );
    let last_words = follow_agent_logs(node);
    patch_agents(
        node,
        "merge",
        r#"{"spec":{"template":{"spec":{"nodeSelector":{"peerwall.io/no-such-node":"true"}}}}}"#,
    );
    wait_agents_gone(node, "the agent off the node");
    last_words.assert_kept_chained(&format!(
        "{backend}: an agent leaving the node (DaemonSet kept)"
    ));
    delete_gateway_pod(node, peer);
    let (next, _) = bring_up(node, consumer, peer, key, backend, Some(&gw.uid), false);
    assert!(
        node_boot_table_in(&next.netns),
        "{backend}: the new gateway's sandbox got the node boot table"
    );
    // The old gateway's last datagrams arrive; then the new one carries the stream alone,
    // once the consumer's WireGuard session with it is up: 400 packets through its tunnel
    // (2 s of the stream).
    std::thread::sleep(Duration::from_millis(500));
    let (web0, rx0) = (stream.web.load(Ordering::Relaxed), tunnel_rx(&next.netns));
    let rx1 = wait(
        &format!("{backend}: the stream through the new gateway's tunnel"),
        Duration::from_secs(30),
        || {
            let rx = tunnel_rx(&next.netns);
            (rx > rx0 + 400).then_some(rx)
        },
    );
    let web1 = stream.web.load(Ordering::Relaxed);
    assert_eq!(
        (web1 - web0, stream.db.load(Ordering::Relaxed)),
        (0, 0),
        "{backend}: with no agent on the node, nothing new crosses a gateway born then (offloaded, private)"
    );
    // The agent back: it enforces in the new gateway and lets the node boot table go.
    patch_agents(
        node,
        "json",
        r#"[{"op":"remove","path":"/spec/template/spec/nodeSelector/peerwall.io~1no-such-node"}]"#,
    );
    wait(
        &format!("{backend}: the agent back, enforcing in the gateway born without it"),
        Duration::from_secs(90),
        || match backend {
            "nftables" => nft_table_in(&next.netns, peer).then_some(()),
            _ => bpf_attached_in(peer, &next.uid).then_some(()),
        },
    );
    wait(
        &format!("{backend}: the node boot table released"),
        Duration::from_secs(30),
        || (!node_boot_table_in(&next.netns)).then_some(()),
    );
    let before = stream.web.load(Ordering::Relaxed);
    wait(
        &format!("{backend}: the stream to the offloaded pod through the gateway again"),
        Duration::from_secs(30),
        || (stream.web.load(Ordering::Relaxed) > before + 20).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        stream.db.load(Ordering::Relaxed),
        0,
        "{backend}: the private pod was never reached"
    );
    eprintln!(
        "{backend}: gateway born without an agent: tunnel received {} packets, offloaded +0, private 0; agent back, offloaded reached",
        rx1 - rx0
    );
    drop(stream);
    next
}
