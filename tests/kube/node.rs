//! A real node: kubelet + containerd + runc + CNI (`xtask/kube/start-node.sh`) running
//! peerwall's images (`cargo xtask image`). `deploy/` is applied unchanged; a Liqo-shaped
//! gateway pod runs wireguard-go (`liqo-tunnel`) and gets a Geneve-named link to the node; a
//! consumer on the far side of the tunnel sends packets through it. The DaemonSet's agent must
//! enforce inside the gateway pod: offloaded pod reachable, non-offloaded dropped, provider →
//! consumer with its replies, for both backends, across gateway recreation and agent restart;
//! then in sidecar mode (`deploy/sidecar/`, `peerwall sidecar-patch`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use peerwall::k8s::gateway_pods::netns::pod_netns;

use peerwall_testkit::node::Node;
use peerwall_testkit::prelude::*;

#[path = "agent_down.rs"]
mod agent_down;
#[path = "churn.rs"]
mod churn;
#[path = "sidecar_node.rs"]
mod sidecar_node;

/// Gateway-pod recreations under a stream, per backend (`PEERWALL_CHURN`; default 5, about
/// 15 s each on the CI machine, which also runs the sidecar phase; `cargo xtask reliability`
/// runs 25, 50 on the node in all).
fn churn_times() -> usize {
    std::env::var("PEERWALL_CHURN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

/// The consumer ("peer") cluster id; unique per run so pin directories never collide.
fn peer_id() -> String {
    format!("consumer-{}", std::process::id())
}

/// The consumer cluster: a namespace beyond the node's "uplink", with wireguard-go.
struct Consumer {
    ns: NetNs,
    tunnel: String,
    key: String,
    listener: Option<Child>,
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if let Some(mut l) = self.listener.take() {
            let _ = l.kill();
            let _ = l.wait();
        }
        // wireguard-go exits when its TUN device goes with the namespace.
        let _ = Command::new("pkill")
            .args(["-f", &format!("wireguard-go {}", self.tunnel)])
            .status();
    }
}

const CONSUMER_POD: &str = "10.71.0.5";
const POD_CIDR: &str = "10.244.0.0/24";

impl Consumer {
    fn new(node: &Node) -> Self {
        let ns = NetNs::new("pwc").unwrap();
        let tunnel = format!("pwc{}", std::process::id() % 100000);
        must(
            "ip",
            &[
                "link",
                "add",
                "cons0",
                "netns",
                ns.name(),
                "type",
                "veth",
                "peer",
                "name",
                "uplink-c",
                "netns",
                &format!("/run/netns/{}", node.ns),
            ],
        );
        ip(&ns, &["addr", "add", "10.251.0.2/30", "dev", "cons0"]);
        ip(&ns, &["link", "set", "cons0", "up"]);
        ip(
            &ns,
            &["addr", "add", &format!("{CONSUMER_POD}/32"), "dev", "lo"],
        );
        node.ip(&["addr", "add", "10.251.0.1/30", "dev", "uplink-c"]);
        node.ip(&["link", "set", "uplink-c", "up"]);
        let out = in_ns(&ns, "wireguard-go", &[&tunnel]);
        assert!(out.status.success(), "wireguard-go: {out:?}");
        let (key, _) = wg_key();
        let listener = Command::new("ip")
            .args(["netns", "exec", ns.name(), "socat"])
            .arg(format!(
                "TCP-LISTEN:8080,bind={CONSUMER_POD},fork,reuseaddr"
            ))
            .arg("EXEC:/bin/true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            ns,
            tunnel,
            key,
            listener: Some(listener),
        }
    }

    fn public_key(&self) -> String {
        wg_pubkey(&self.key)
    }

    /// Point the tunnel at the (new) gateway pod, with a fresh session: the peer is removed
    /// first, so its handshake goes out at once rather than after WireGuard's retry timer
    /// (5 s) that a handshake to the gone gateway started — which would hide the first
    /// seconds of a new gateway from the stream.
    fn connect(&self, gateway_ip: &str, gateway_key: &str) {
        let keyfile = std::env::temp_dir().join(format!("{}.key", self.tunnel));
        std::fs::write(&keyfile, &self.key).unwrap();
        let t = self.tunnel.as_str();
        let _ = in_ns(&self.ns, "wg", &["set", t, "peer", gateway_key, "remove"]);
        let out = in_ns(
            &self.ns,
            "wg",
            &[
                "set",
                t,
                "private-key",
                &keyfile.to_string_lossy(),
                "peer",
                gateway_key,
                "endpoint",
                &format!("{gateway_ip}:51820"),
                "allowed-ips",
                POD_CIDR,
                "persistent-keepalive",
                "1",
            ],
        );
        assert!(out.status.success(), "wg set: {out:?}");
        ip(&self.ns, &["link", "set", t, "up"]);
        let _ = in_ns(&self.ns, "ip", &["route", "del", POD_CIDR]);
        ip(
            &self.ns,
            &[
                "route",
                "replace",
                &format!("{gateway_ip}/32"),
                "via",
                "10.251.0.1",
            ],
        );
        ip(
            &self.ns,
            &["route", "add", POD_CIDR, "dev", t, "src", CONSUMER_POD],
        );
    }
}

/// The outcome of a TCP connection attempt.
#[derive(Debug, PartialEq, Eq)]
enum Reach {
    /// Handshake done.
    Connected,
    /// A RST came back: the packet reached the host.
    Refused,
    /// Nothing came back.
    Dropped,
}

fn tcp(netns: &Path, dst: &str, port: u16) -> Reach {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["timeout", "2", "bash", "-c"])
        .arg(format!("exec 3<>/dev/tcp/{dst}/{port}"))
        .output()
        .unwrap();
    match out.status.code() {
        Some(0) => Reach::Connected,
        Some(124) => Reach::Dropped,
        _ if String::from_utf8_lossy(&out.stderr).contains("refused") => Reach::Refused,
        other => panic!(
            "tcp probe to {dst}:{port}: {other:?} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

const GATEWAY_SCRIPT: &str = r#"set -e
mkdir -p /var/run/wireguard /tmp
echo 1 > /proc/sys/net/ipv4/ip_forward
WG_PROCESS_FOREGROUND=1 wireguard-go liqo-tunnel &
while ! ip link show liqo-tunnel >/dev/null 2>&1; do sleep 0.1; done
printf '%s' "$WG_KEY" > /tmp/key
wg set liqo-tunnel listen-port 51820 private-key /tmp/key peer "$PEER_KEY" allowed-ips 10.71.0.0/16
ip link set liqo-tunnel up
ip route add 10.71.0.0/16 dev liqo-tunnel
wait
"#;

/// A gateway Deployment shaped like Liqo's `WgGatewayServer` template: labels, the
/// `--remote-cluster-id` flag, a privileged wireguard container bringing up `liqo-tunnel`.
fn gateway_yaml(peer: &str, key: &str, consumer_key: &str) -> String {
    let script = serde_json::to_string(GATEWAY_SCRIPT).unwrap();
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: gw, namespace: liqo-tenant-{peer}}}
spec:
  replicas: 1
  strategy: {{type: Recreate}}
  selector: {{matchLabels: {{networking.liqo.io/component: gateway, networking.liqo.io/gateway-name: gw}}}}
  template:
    metadata:
      labels: {{networking.liqo.io/component: gateway, networking.liqo.io/gateway-name: gw, networking.liqo.io/active: "true"}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
        - name: gateway
          image: peerwall.local/lab-gateway:1
          args: ["-c", "exec sleep 2147483647", "gateway", "--mode=server", "--remote-cluster-id={peer}"]
        - name: wireguard
          image: peerwall.local/lab-gateway:1
          securityContext: {{privileged: true}}
          env: [{{name: WG_KEY, value: "{key}"}}, {{name: PEER_KEY, value: "{consumer_key}"}}]
          args: ["-c", {script}]
"#
    )
}

/// The cluster as Liqo leaves it: the peer's tenant namespace with its network
/// `Configuration` (the consumer's pods are 10.71.0.0/16), a namespace it offloaded with one
/// pod, and a private namespace with another.
fn cluster_yaml(peer: &str) -> String {
    let configuration = peerwall_testkit::liqo::configuration(peer, &["10.71.0.0/16"]);
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: liqo-tenant-{peer}
  labels: {{liqo.io/tenant-namespace: "true", liqo.io/remote-cluster-id: {peer}}}
---
{configuration}---
apiVersion: v1
kind: Namespace
metadata:
  name: offloaded
  labels: {{liqo.io/remote-cluster-id: {peer}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: private}}
---
apiVersion: v1
kind: Pod
metadata: {{name: web, namespace: offloaded}}
spec:
  terminationGracePeriodSeconds: 0
  containers: [{{name: c, image: peerwall.local/pause:1.20.2}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: db, namespace: private}}
spec:
  terminationGracePeriodSeconds: 0
  containers: [{{name: c, image: peerwall.local/pause:1.20.2}}]
"#
    )
}

fn wait<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running pod's UID and IP.
fn pod(node: &Node, ns: &str, selector: &str) -> Option<(String, String)> {
    let out = node.kubectl(&[
        "-n", ns, "get", "pods", "-l", selector, "-o",
        "jsonpath={range .items[?(@.status.phase==\"Running\")]}{.metadata.uid} {.status.podIP} {.metadata.deletionTimestamp}{\"\\n\"}{end}",
    ]);
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() == 2).then(|| (f[0].to_string(), f[1].to_string()))
    })
}

fn pod_by_name(node: &Node, ns: &str, name: &str) -> (String, String) {
    wait(&format!("pod {ns}/{name}"), Duration::from_secs(60), || {
        let out = node.kubectl(&[
            "-n",
            ns,
            "get",
            "pod",
            name,
            "-o",
            "jsonpath={.metadata.uid} {.status.podIP} {.status.phase}",
        ]);
        let s = String::from_utf8_lossy(&out.stdout).to_string();
        let f: Vec<&str> = s.split_whitespace().collect();
        (f.len() == 3 && f[2] == "Running").then(|| (f[0].to_string(), f[1].to_string()))
    })
}

/// The gateway pod as Liqo's geneve container and the fabric would wire it: a `liqo.*` link to
/// the node, tunnel traffic routed to the pods through it, replies routed back.
fn plumb_gateway(node: &Node, gw_netns: &Path) -> String {
    let pid = gw_netns
        .parent()
        .and_then(Path::parent)
        .and_then(|p| p.file_name())
        .unwrap()
        .to_string_lossy()
        .to_string();
    let geneve = "liqo.pwtestgnv";
    let _ = Command::new("ip")
        .args(["-n", &node.ns, "link", "del", "gwl0"])
        .output();
    node.ip(&[
        "link", "add", "gwl0", "type", "veth", "peer", "name", geneve,
    ]);
    node.ip(&["link", "set", geneve, "netns", &pid]);
    node.ip(&["addr", "add", "169.254.100.1/30", "dev", "gwl0"]);
    node.ip(&["link", "set", "gwl0", "up"]);
    node.ip(&[
        "route",
        "replace",
        "10.71.0.0/16",
        "via",
        "169.254.100.2",
        "dev",
        "gwl0",
    ]);
    let gw = |args: &[&str]| {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", gw_netns.display()))
            .arg("ip")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "ip {args:?} in the gateway: {out:?}");
    };
    gw(&["addr", "add", "169.254.100.2/30", "dev", geneve]);
    gw(&["link", "set", geneve, "up"]);
    gw(&[
        "rule",
        "add",
        "iif",
        "liqo-tunnel",
        "lookup",
        "100",
        "pref",
        "100",
    ]);
    gw(&[
        "route",
        "add",
        POD_CIDR,
        "via",
        "169.254.100.1",
        "dev",
        geneve,
        "table",
        "100",
    ]);
    pid
}

/// Whether the nftables table `inet <name>` exists inside the gateway pod.
fn nft_table_named(gw_netns: &Path, name: &str) -> bool {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", gw_netns.display()))
        .args(["nft", "list", "tables"])
        .output()
        .unwrap();
    let want = format!("table inet {name}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == want)
}

/// Whether peerwall's table is in force inside the gateway pod (nftables backend).
fn nft_table_in(gw_netns: &Path, peer: &str) -> bool {
    nft_table_named(gw_netns, &peerwall::protection::table_name(peer))
}

/// Whether the gateway's boot table (`peerwall boot`, or the agent holding the boot policy) is
/// in force inside the gateway pod.
fn boot_table_in(gw_netns: &Path, peer: &str) -> bool {
    nft_table_named(gw_netns, &peerwall::protection::boot::boot_table_name(peer))
}

/// Whether the node's CNI chain's boot table (`peerwall-boot`) is in force inside the gateway
/// pod.
fn node_boot_table_in(gw_netns: &Path) -> bool {
    nft_table_named(gw_netns, peerwall::protection::boot::NODE_BOOT_TABLE)
}

/// Whether the bpf datapath is attached inside the gateway pod: the agent pins a tcx link per
/// interface it attached to, under this gateway's pin directory, and the kernel says that
/// link filters a device (a pin outlives its device).
fn bpf_attached_in(peer: &str, uid: &str) -> bool {
    let dir = peerwall::k8s::gateway_pods::pods::GatewayPod {
        uid: uid.to_string(),
        name: String::new(),
        peer: peer.to_string(),
    }
    .pin_name();
    let pin = Path::new("/sys/fs/bpf/peerwall/gateways")
        .join(dir)
        .join("links/tc-liqo-tunnel");
    peerwall_backend_bpf::loader::link_state(&pin).is_ok_and(|s| s.ifindex.is_some())
}

/// Entries of `dir` named for one of `peer`'s gateways (`<peer>_<uid>…`).
fn named_for(dir: &str, peer: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(&format!("{peer}_")))
                .collect()
        })
        .unwrap_or_default()
}

/// The handles (`/run/peerwall/gateways/<peer>_<uid>.json`) the agent keeps for `peer`'s
/// gateways on this node.
fn handles_of(peer: &str) -> Vec<String> {
    let mut h = named_for(peerwall::k8s::gateway_pods::handles::HANDLES, peer);
    h.retain(|n| n.ends_with(".json"));
    h
}

fn pins_of(peer: &str) -> Vec<String> {
    named_for("/sys/fs/bpf/peerwall/gateways", peer)
}

struct Gateway {
    uid: String,
    netns: PathBuf,
}

/// Wait for the gateway pod to run, wire it, point the consumer at it; returns it and the
/// time from its namespace existing to peerwall's enforcement being in place.
fn bring_up_gateway(
    node: &Node,
    consumer: &Consumer,
    peer: &str,
    key: &str,
    backend: &str,
    old: Option<&str>,
) -> (Gateway, Duration) {
    bring_up(node, consumer, peer, key, backend, old, true)
}

/// [`bring_up_gateway`]; without `agent`, no agent runs: return once the consumer is
/// connected (the duration is then 0).
fn bring_up(
    node: &Node,
    consumer: &Consumer,
    peer: &str,
    key: &str,
    backend: &str,
    old: Option<&str>,
    agent: bool,
) -> (Gateway, Duration) {
    let tenant = format!("liqo-tenant-{peer}");
    // The new gateway pods (not `old`) with their sandbox's network namespace. A sandbox can
    // be replaced while the pod starts (new namespace, same UID), so this is asked again on
    // every wait below.
    let current = || -> Vec<(String, PathBuf)> {
        let out = node.kubectl(&[
            "-n",
            &tenant,
            "get",
            "pods",
            "-l",
            "networking.liqo.io/component=gateway",
            "-o",
            "jsonpath={range .items[*]}{.metadata.uid}{\"\\n\"}{end}",
        ]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|u| Some(*u) != old && !u.is_empty())
            .filter_map(|u| pod_netns(Path::new("/proc"), u).map(|ns| (u.to_string(), ns)))
            .collect()
    };
    // The sandbox (and so the namespace) exists before the pod reports Running.
    let t0 = wait(
        "the gateway pod's network namespace",
        Duration::from_secs(90),
        || (!current().is_empty()).then(Instant::now),
    );
    let enforced = |ns: &Path, uid: &str| match backend {
        "nftables" => nft_table_in(ns, peer),
        _ => bpf_attached_in(peer, uid),
    };
    // As a peer does: the consumer connects as soon as the gateway runs with its tunnel,
    // whether peerwall enforces there yet or not (the boot policy must cover that window;
    // the churn's stream counts what reaches the private pod meanwhile).
    // When enforcement was first seen (checked in both waits, so the time is not the
    // tunnel's).
    let first = std::cell::Cell::new(None);
    let seen = |pods: &[(String, PathBuf)]| {
        if first.get().is_none() && pods.iter().any(|(u, ns)| enforced(ns, u)) {
            first.set(Some(t0.elapsed()));
        }
    };
    let (uid, netns, ip) = wait(
        "the gateway pod to run with liqo-tunnel",
        Duration::from_secs(90),
        || {
            let pods = current();
            seen(&pods);
            let (uid, ip) = pod(node, &tenant, "networking.liqo.io/component=gateway")?;
            let (_, ns) = pods.into_iter().find(|(u, _)| *u == uid)?;
            Command::new("nsenter")
                .arg(format!("--net={}", ns.display()))
                .args(["ip", "link", "show", "liqo-tunnel"])
                .output()
                .unwrap()
                .status
                .success()
                .then_some((uid, ns, ip))
        },
    );
    plumb_gateway(node, &netns);
    let gw_pub = wg_pubkey(key);
    consumer.connect(&ip, &gw_pub);
    if !agent {
        return (Gateway { uid, netns }, Duration::ZERO);
    }
    let netns = wait(
        "peerwall to enforce inside the new gateway pod",
        Duration::from_secs(60),
        || {
            let pods = current();
            seen(&pods);
            pods.into_iter()
                .find(|(u, ns)| *u == uid && enforced(ns, u))
                .map(|(_, ns)| ns)
        },
    );
    let took = first.get().unwrap_or_else(|| t0.elapsed());
    if backend == "bpf" {
        // The guard in the pod: its tunnel let through once attached, any other device
        // matching the patterns (the tunnel made again) dropped until then.
        wait(
            "the guard of interfaces not attached yet in the gateway pod",
            Duration::from_secs(10),
            || {
                let out = Command::new("nsenter")
                    .arg(format!("--net={}", netns.display()))
                    .args(["nft", "list", "table", "inet", "peerwall-guard"])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                // The attached interfaces let through first, then each pattern dropped.
                let lines: Vec<&str> = text.lines().map(str::trim).collect();
                let accept = lines.iter().position(|l| {
                    l.starts_with("iif {")
                        && l.contains(r#""liqo-tunnel""#)
                        && l.contains(" accept")
                });
                let drop = lines
                    .iter()
                    .position(|l| l.starts_with(r#"iifname "liqo-tunnel*" counter"#));
                accept.zip(drop).filter(|(a, d)| a < d).map(|_| ())
            },
        );
    }
    (Gateway { uid, netns }, took)
}

fn condition(node: &Node, peer: &str) -> String {
    let out = node.kubectl(&[
        "-n", &format!("liqo-tenant-{peer}"), "get", "pwfc", "-o",
        "jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.host==\"node-1\")].type}{\"\\n\"}{end}",
    ]);
    if !out.status.success() {
        // Discovery cached before the CRD was served: drop it, ask again.
        let _ = std::fs::remove_dir_all(node.dir.join("kubectl-cache"));
    }
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The matrix through the tunnel: offloaded reachable, private dropped, provider → consumer
/// with replies.
fn assert_matrix(consumer: &Consumer, web: &(String, String), db: &(String, String), what: &str) {
    let cons = PathBuf::from(format!("/run/netns/{}", consumer.ns.name()));
    // The tunnel needs a handshake first; the offloaded pod answering proves it is up.
    wait(
        &format!("{what}: the offloaded pod reachable through the tunnel"),
        Duration::from_secs(20),
        || (tcp(&cons, &web.1, 80) == Reach::Refused).then_some(()),
    );
    assert_eq!(
        tcp(&cons, &db.1, 80),
        Reach::Dropped,
        "{what}: the non-offloaded pod must be dropped inside the gateway pod"
    );
    let web_ns = pod_netns(Path::new("/proc"), &web.0).expect("web pod namespace");
    assert_eq!(
        tcp(&web_ns, CONSUMER_POD, 8080),
        Reach::Connected,
        "{what}: provider → consumer and its replies must pass"
    );
}

/// Revocation where the agent runs in a container (`/proc/sys` read-only there): the
/// consumer's pod and the offloaded web pod keep a UDP exchange and a TCP connection going on
/// `port` from both sides; a ProtectionPolicy closes the port (both protocols) to the peer;
/// the agent ends both, and none of the consumer's datagrams or bytes reaches the web pod
/// again for 10 s while both keep sending, with conntrack's UDP timeouts in the gateway
/// shortened to 2 and 3 s (the side nobody filters, the web pod, re-opened the exchange
/// before; the TCP connection's retransmissions meet no pickup mid-stream). The policy is
/// deleted afterwards.
fn a_closing_ends_an_exchange_for_good(
    node: &Node,
    consumer: &Consumer,
    peer: &str,
    web: &(String, String),
    gw: &Gateway,
    port: u16,
    what: &str,
) {
    for (k, v) in [
        ("net.netfilter.nf_conntrack_udp_timeout", "2"),
        ("net.netfilter.nf_conntrack_udp_timeout_stream", "3"),
    ] {
        let o = Command::new("nsenter")
            .arg(format!("--net={}", gw.netns.display()))
            .args(["sysctl", "-q", "-w", &format!("{k}={v}")])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{k}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let web_ns = pod_netns(Path::new("/proc"), &web.0).expect("web pod namespace");
    let rx = |n: &str| {
        node.dir
            .join(format!("{what}-{port}-{n}.rx").replace(' ', "-"))
    };
    // The consumer speaks first: the connection is the peer's.
    let theirs = Chatter::start(
        &format!("/run/netns/{}", consumer.ns.name()),
        (CONSUMER_POD, 5000),
        (&web.1, port),
        rx("consumer"),
    );
    // The web pod answers: it sends only once the consumer's first datagram reached it (had
    // it spoken first, through a tunnel still shaking hands, the exchange would be the web
    // pod's, whose replies the closing rightly leaves alone).
    let ours = Chatter::answer(
        &web_ns.to_string_lossy(),
        (&web.1, port),
        (CONSUMER_POD, 5000),
        rx("web"),
    );
    let ours_tcp = Chatter::start_tcp(
        &web_ns.to_string_lossy(),
        true,
        (&web.1, port),
        (CONSUMER_POD, 5001),
        rx("web-tcp"),
    );
    std::thread::sleep(Duration::from_millis(300));
    let theirs_tcp = Chatter::start_tcp(
        &format!("/run/netns/{}", consumer.ns.name()),
        false,
        (CONSUMER_POD, 5001),
        (&web.1, port),
        rx("consumer-tcp"),
    );
    wait(
        &format!("{what}: the exchange and the connection flowing both ways"),
        Duration::from_secs(20),
        || {
            (ours.received() > 10
                && theirs.received() > 10
                && ours_tcp.received() > 10
                && theirs_tcp.received() > 10)
                .then_some(())
        },
    );
    node.apply(&format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: ProtectionPolicy\nmetadata: {{name: close-{port}}}\nspec: {{peers: [\"{peer}\"], close: [{{name: udp, ports: [{{protocol: UDP, port: {port}}}]}}, {{name: tcp, ports: [{{protocol: TCP, port: {port}}}]}}]}}\n"
    ));
    wait(
        &format!("{what}: the closing to end the exchange and the connection"),
        Duration::from_secs(60),
        || {
            let before = (ours.received(), ours_tcp.received());
            std::thread::sleep(Duration::from_millis(800));
            (before == (ours.received(), ours_tcp.received())).then_some(())
        },
    );
    let ended_at = (ours.received(), ours_tcp.received());
    std::thread::sleep(Duration::from_secs(10));
    assert_eq!(
        (ours.received(), ours_tcp.received()),
        ended_at,
        "{what}: the consumer's datagrams or bytes reach the web pod again while both keep sending"
    );
    node.kubectl_ok(&["delete", "protectionpolicy", &format!("close-{port}")]);
}

#[test]
fn daemonset_enforces_inside_liqo_gateway_pods_on_a_real_node() {
    require_root();
    let node = Node::start();
    let peer = peer_id();
    // deploy/ as shipped (the image it names was imported), and nothing else: the webhook
    // issues its own certificate and writes its CA into its configuration.
    // Liqo is installed: its Configuration CRD is there before peerwall's controller starts.
    node.apply(peerwall_testkit::liqo::CONFIGURATION_CRD);
    node.kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/configurations.networking.liqo.io",
    ]);
    node.kubectl_ok(&["apply", "-k", &repo("deploy").to_string_lossy()]);
    wait("the webhook ready", Duration::from_secs(120), || {
        let o = node.kubectl(&[
            "-n",
            "peerwall-system",
            "get",
            "deployment",
            "peerwall-webhook",
            "-o",
            "jsonpath={.status.readyReplicas}",
        ]);
        (String::from_utf8_lossy(&o.stdout).trim() == "2").then_some(())
    });
    // The API server reaches it through its Service, trusting the CA it wrote: an invalid
    // object is refused with the field path.
    let refusal = wait("the webhook to refuse", Duration::from_secs(60), || {
        let f = node.dir.join("bad.yaml");
        std::fs::write(
            &f,
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: bad, namespace: peerwall-system}\nspec:\n  table:\n    name: bad\n    family: INET\n    chains:\n      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: r, action: drop, match: [{op: eq, ip: {value: 10.20.1.300, position: dst}}]}\n",
        )
        .unwrap();
        let o = node.kubectl(&["create", "-f", &f.to_string_lossy()]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "the invalid object was admitted");
        // Until the API server reaches the webhook: "failed calling webhook".
        eprintln!("not refused by the webhook yet: {err}");
        err.contains("denied the request").then_some(err)
    });
    assert!(
        refusal.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value")
            && refusal.contains("10.20.1.300"),
        "{refusal}"
    );
    node.apply(&cluster_yaml(&peer));
    let web = pod_by_name(&node, "offloaded", "web");
    let db = pod_by_name(&node, "private", "db");

    let consumer = Consumer::new(&node);
    let (gw_key, _) = wg_key();
    let gateway = gateway_yaml(&peer, &gw_key, &consumer.public_key());

    // ---- nftables (deploy/'s default backend)
    node.apply(&gateway);
    let (gw, took) = bring_up_gateway(&node, &consumer, &peer, &gw_key, "nftables", None);
    eprintln!(
        "nftables: enforced {} ms after the gateway pod's namespace appeared",
        took.as_millis()
    );
    assert!(
        !boot_table_in(&gw.netns, &peer),
        "the peer's table replaced the boot table in the same transaction"
    );
    assert_matrix(&consumer, &web, &db, "nftables");
    a_closing_ends_an_exchange_for_good(&node, &consumer, &peer, &web, &gw, 6000, "nftables");
    wait(
        "the agent's Applied condition",
        Duration::from_secs(30),
        || {
            condition(&node, &peer)
                .contains("peerwall-gateway=Applied")
                .then_some(())
        },
    );
    let logs = node.kubectl_ok(&["-n", "peerwall-system", "logs", "ds/peerwall-agent"]);
    assert!(
        logs.contains("enforcing inside gateway pod"),
        "agent logs: {logs}"
    );
    // deploy/monitoring's queries against the real DaemonSet's and controller's /metrics
    // (through the API server's pod proxy), after the matrix made drops.
    let texts = wait(
        "drops in the DaemonSet's metrics",
        Duration::from_secs(30),
        || {
            let scrape = |label: &str, port: u16| {
                let name = node.kubectl_ok(&[
                    "-n",
                    "peerwall-system",
                    "get",
                    "pods",
                    "-l",
                    &format!("app.kubernetes.io/name={label}"),
                    "-o",
                    "jsonpath={.items[0].metadata.name}",
                ]);
                let o = node.kubectl(&[
                    "get",
                    "--raw",
                    &format!(
                        "/api/v1/namespaces/peerwall-system/pods/{}:{port}/proxy/metrics",
                        name.trim()
                    ),
                ]);
                String::from_utf8_lossy(&o.stdout).into_owned()
            };
            let agent = scrape("peerwall-agent", 9977);
            let ctl = scrape("peerwall-controller", 9091);
            (agent.contains("peerwall_drops_total{")
                && agent.contains("gateway=")
                && ctl.contains("peerwall_controller_peers"))
            .then_some(vec![agent, ctl])
        },
    );
    let problems = crate::monitoring::live_problems(&texts, true);
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // docs/runbook.md, the commands an operator runs, exactly: the emergency switch for one
    // gateway from the agent's pod, its counters, `peerwall status` through the API.
    let cons = PathBuf::from(format!("/run/netns/{}", consumer.ns.name()));
    let exec = |args: &[&str]| {
        let mut a = vec![
            "-n",
            "peerwall-system",
            "exec",
            "ds/peerwall-agent",
            "--",
            "peerwall",
        ];
        a.extend_from_slice(args);
        node.kubectl_ok(&a)
    };
    exec(&["allow-all", "on", "--gateway", &peer]);
    assert_eq!(
        tcp(&cons, &db.1, 80),
        Reach::Refused,
        "the emergency switch lets the non-offloaded pod through"
    );
    wait(
        "the switch in the condition",
        Duration::from_secs(30),
        || {
            let o = node.kubectl(&[
                "-n",
                &format!("liqo-tenant-{peer}"),
                "get",
                "firewallconfigurations.peerwall.io",
                "peerwall-gateway",
                "-o",
                "jsonpath={.status.conditions[*].message}",
            ]);
            String::from_utf8_lossy(&o.stdout)
                .contains("emergency switch is on")
                .then_some(())
        },
    );
    let seen = exec(&["observe", "--since", "10m"]);
    assert!(
        seen.lines()
            .any(|l| l.contains(&db.1) && l.contains("drop")),
        "the drops to the non-offloaded pod observed: {seen}"
    );
    // The same drops from every agent of the cluster, through the API server, in time order
    // and with the pods behind the addresses (docs/observe.md), where an operator runs it.
    let observe_all = |args: &[&str]| {
        let o = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", node.ns))
            .arg(peerwall())
            .args(["observe", "--all-agents", "--since", "10m"])
            .args(args)
            .env("KUBECONFIG", &node.kubeconfig)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        text
    };
    let named = observe_all(&["--to-pod", "private/db"]);
    // What docs/observe.md shows.
    eprintln!("peerwall observe --all-agents --since 10m --to-pod private/db\n{named}");
    assert!(
        named
            .lines()
            .any(|l| l.contains(&format!("{}:80 (private/db)", db.1)) && l.contains("drop")),
        "the drops to private/db, named, from every agent: {named}"
    );
    let json = observe_all(&["--to-pod", "private/db", "--output", "json"]);
    let first: serde_json::Value =
        serde_json::from_str(json.lines().next().unwrap_or("{}")).unwrap();
    assert_eq!(first["dst_pod"], "private/db", "{json}");
    assert_eq!(first["protocol"], "tcp", "{json}");
    assert!(
        first["node"].as_str().is_some_and(|n| !n.is_empty()),
        "{json}"
    );
    // The filter by pod holds: every event shown is towards private/db.
    assert!(named.lines().all(|l| l.contains("(private/db)")), "{named}");
    let counted = exec(&["counters", "--gateway", &peer]);
    assert!(
        counted.contains("peerwall-gateway") || counted.contains("packets"),
        "{counted}"
    );
    exec(&["allow-all", "off", "--gateway", &peer]);
    assert_eq!(
        tcp(&cons, &db.1, 80),
        Reach::Dropped,
        "enforced again once the switch is off"
    );
    // `peerwall status` where an operator runs it: with their kubeconfig.
    let o = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.ns))
        .arg(peerwall())
        .arg("status")
        .env("KUBECONFIG", &node.kubeconfig)
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{status}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        status.contains(&peer) && status.contains("(nftables)"),
        "{status}"
    );
    // Its components' part, as deploy/ runs them on this node: each works, each says so.
    for (part, said) in [
        ("agents", "1/1 ready"),
        ("peerwall-controller", "1/1 ready"),
        ("peerwall-webhook", "2/2 ready"),
        ("webhook registration", "caBundle set"),
        ("crd FirewallConfiguration", "v1alpha1 served"),
    ] {
        assert!(
            status
                .lines()
                .any(|l| l.starts_with(part) && l.contains(" ok ") && l.contains(said)),
            "{part}: {said} not in:\n{status}"
        );
    }

    // Agent restarted: what is in force stays in force while it is away. Its last words are
    // followed: a restart is not an uninstall, peerwall-boot stays chained.
    let last_words = agent_down::follow_agent_logs(&node);
    node.kubectl_ok(&[
        "-n",
        "peerwall-system",
        "delete",
        "pod",
        "-l",
        "app.kubernetes.io/name=peerwall-agent",
        "--wait=false",
    ]);
    let cons = PathBuf::from(format!("/run/netns/{}", consumer.ns.name()));
    assert_eq!(
        tcp(&cons, &db.1, 80),
        Reach::Dropped,
        "dropped while the agent restarts"
    );
    assert!(
        nft_table_in(&gw.netns, &peer),
        "the table stays while the agent restarts"
    );
    wait("a new agent pod ready", Duration::from_secs(60), || {
        let out = agent_pods(
            &node,
            "jsonpath={.items[*].status.containerStatuses[0].ready}",
        );
        (String::from_utf8_lossy(&out.stdout).trim() == "true").then_some(())
    });
    assert_matrix(&consumer, &web, &db, "nftables after an agent restart");
    last_words.assert_kept_chained("an agent restart");

    // Gateway pod recreated again and again under a stream: each new namespace enforced, the
    // private pod never reached.
    let gw2 = churn::churn(
        &node,
        &consumer,
        &peer,
        &gw_key,
        "nftables",
        gw,
        &web,
        &db,
        churn_times(),
    );
    assert_matrix(
        &consumer,
        &web,
        &db,
        "nftables after the gateway pod was recreated",
    );
    // A gateway pod born while no agent runs on the node: peerwall-boot guards it.
    let gw2 = agent_down::gateway_born_without_agent(
        &node, &consumer, &peer, &gw_key, "nftables", gw2, &web, &db,
    );
    assert_matrix(
        &consumer,
        &web,
        &db,
        "nftables after a gateway was born without an agent",
    );

    // ---- bpf: the same DaemonSet with --backend=bpf, a fresh gateway.
    delete_gateway(&node, &peer);
    wait(
        "the old gateway namespace to go",
        Duration::from_secs(60),
        || {
            pod_netns(Path::new("/proc"), &gw2.uid)
                .is_none()
                .then_some(())
        },
    );
    let args = node.kubectl_ok(&[
        "-n",
        "peerwall-system",
        "get",
        "ds",
        "peerwall-agent",
        "-o",
        "jsonpath={.spec.template.spec.containers[0].args}",
    ]);
    let args: Vec<String> = serde_json::from_str(&args).unwrap();
    let i = args
        .iter()
        .position(|a| a.starts_with("--backend="))
        .unwrap();
    node.kubectl_ok(&["-n", "peerwall-system", "patch", "ds", "peerwall-agent", "--type=json", "-p", &format!(r#"[{{"op":"replace","path":"/spec/template/spec/containers/0/args/{i}","value":"--backend=bpf"}}]"#)]);
    let rollout = Instant::now();
    wait("the bpf agent", Duration::from_secs(90), || {
        // kubelet 1.20 with containerd sometimes leaves a pod whose containers have all
        // exited in Terminating ("StopPodSandbox ... not found") for minutes; what is under
        // test is the agents, not that: after 20 s such a pod is removed by force.
        if rollout.elapsed() > Duration::from_secs(20) {
            force_delete_exited_agents(&node);
        }
        let out = agent_pods(&node, "jsonpath={.items[*].spec.containers[0].args}");
        let s = String::from_utf8_lossy(&out.stdout).to_string();
        (s.contains("--backend=bpf") && !s.contains("--backend=nftables")).then_some(())
    });
    node.apply(&gateway);
    let (gw3, took) = bring_up_gateway(&node, &consumer, &peer, &gw_key, "bpf", None);
    eprintln!(
        "bpf: enforced {} ms after the gateway pod's namespace appeared",
        took.as_millis()
    );
    let logs = node.kubectl(&["-n", "peerwall-system", "logs", "ds/peerwall-agent"]);
    let bridged =
        String::from_utf8_lossy(&logs.stdout).contains("the datapath took over from nftables");
    eprintln!(
        "bpf: the fresh gateway {}",
        if bridged {
            "started bridged (nftables enforced while its datapath loaded) and handed over"
        } else {
            "took a datapath ready ahead (no bridge)"
        }
    );
    // A fresh gateway's datapath loads from scratch unless the agent's spare was ready; if it
    // did, nftables enforced the policy meanwhile and withdraws its table right after the
    // datapath attached (`enforcement/bridge.rs`): none left once it has.
    wait(
        "no nftables table of the policy in a gateway the datapath enforces",
        Duration::from_secs(10),
        || (!nft_table_in(&gw3.netns, &peer)).then_some(()),
    );
    // The boot policy held the tunnel in nftables until the datapath filtered it: gone once
    // it does.
    wait(
        "the boot table released once bpf filters the tunnel",
        Duration::from_secs(10),
        || (!boot_table_in(&gw3.netns, &peer)).then_some(()),
    );
    assert_matrix(&consumer, &web, &db, "bpf");
    a_closing_ends_an_exchange_for_good(&node, &consumer, &peer, &web, &gw3, 6001, "bpf");
    let pins = pins_of(&peer);
    assert_eq!(pins.len(), 1, "one pin directory per gateway: {pins:?}");
    let gw4 = churn::churn(
        &node,
        &consumer,
        &peer,
        &gw_key,
        "bpf",
        gw3,
        &web,
        &db,
        churn_times(),
    );
    assert_matrix(
        &consumer,
        &web,
        &db,
        "bpf after the gateway pod was recreated",
    );
    let _gw5 = agent_down::gateway_born_without_agent(
        &node, &consumer, &peer, &gw_key, "bpf", gw4, &web, &db,
    );
    assert_matrix(
        &consumer,
        &web,
        &db,
        "bpf after a gateway was born without an agent",
    );
    wait(
        "the deleted gateway's pins removed",
        Duration::from_secs(30),
        || (!pins_of(&peer).contains(&pins[0]) && pins_of(&peer).len() == 1).then_some(()),
    );
    // Leave no pins behind on the host.
    delete_gateway(&node, &peer);
    wait(
        "the last gateway's pins removed",
        Duration::from_secs(30),
        || pins_of(&peer).is_empty().then_some(()),
    );
    // Nor handles: `peerwall inspect --gateway` must not list gateways that are gone (the
    // nftables phase's went while the agent was down, and left no pins to sweep them with).
    wait(
        "no handle of the peer's gateways left",
        Duration::from_secs(30),
        || handles_of(&peer).is_empty().then_some(()),
    );

    // ---- sidecar mode: no DaemonSet, peerwall inside the gateway pod (docs/deploy.md).
    sidecar_node::sidecar_mode(&node, &consumer, &peer, &gw_key, &web, &db);

    // docs/runbook.md's uninstall, as written: the controller first (it would write the
    // objects again), then peerwall's objects (the agents remove what they enforced and
    // release their finalizers), then everything `deploy/` installed; nothing hangs.
    node.kubectl_ok(&[
        "-n",
        "peerwall-system",
        "delete",
        "deployment",
        "peerwall-controller",
        "--timeout=60s",
    ]);
    node.kubectl_ok(&[
        "delete",
        "firewallconfigurations.peerwall.io,addresssets.peerwall.io",
        "--all",
        "--all-namespaces",
        "--timeout=60s",
    ]);
    node.kubectl_ok(&[
        "delete",
        "-k",
        &repo("deploy").to_string_lossy(),
        "--ignore-not-found",
        "--timeout=120s",
    ]);
    // The DaemonSet's deletion took peerwall-boot out of the node's CNI chain (a gateway
    // created after peerwall is gone is not held by a boot policy no agent would release).
    wait(
        "peerwall-boot out of the CNI chain after the uninstall",
        Duration::from_secs(30),
        || (!agent_down::chained() && !Path::new(agent_down::PLUGIN).exists()).then_some(()),
    );
    let left = node.kubectl(&["get", "crd", "-o", "name"]);
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains("peerwall.io"),
        "peerwall's CRDs removed: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}

/// `kubectl get pods` of the agent DaemonSet with a jsonpath.
fn agent_pods(node: &Node, jsonpath: &str) -> Output {
    node.kubectl(&[
        "-n",
        "peerwall-system",
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=peerwall-agent",
        "-o",
        jsonpath,
    ])
}

/// Delete the gateway Deployment and wait for it to go.
fn delete_gateway(node: &Node, peer: &str) {
    node.kubectl_ok(&[
        "-n",
        &format!("liqo-tenant-{peer}"),
        "delete",
        "deployment",
        "gw",
        "--wait=true",
    ]);
}

/// Wait until no agent pod is left on the node. kubelet 1.20 with containerd sometimes
/// leaves a pod whose containers have all exited in Terminating for minutes (its volumes
/// detached, the pod object kept); what is under test is the agents, not that: after 20 s
/// such a pod is removed by force. A pod with a container still running is never forced.
fn wait_agents_gone(node: &Node, what: &str) {
    let since = Instant::now();
    wait(what, Duration::from_secs(90), || {
        if since.elapsed() > Duration::from_secs(20) {
            force_delete_exited_agents(node);
        }
        let out = agent_pods(node, "jsonpath={.items[*].metadata.name}");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .is_empty()
            .then_some(())
    });
}

/// Force-delete agent pods that are being deleted and whose containers have all exited.
fn force_delete_exited_agents(node: &Node) {
    let out = agent_pods(
        node,
        "jsonpath={range .items[?(@.metadata.deletionTimestamp)]}{.metadata.name}={.status.containerStatuses[*].state.running}{\"\\n\"}{end}",
    );
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(name) = line.strip_suffix('=') {
            eprintln!("force-deleting {name}: terminating with no running container");
            let _ = node.kubectl(&[
                "-n",
                "peerwall-system",
                "delete",
                "pod",
                name,
                "--grace-period=0",
                "--force",
            ]);
        }
    }
}
