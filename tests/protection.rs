//! Provider protection's tighter defaults through real interfaces, on the policy the controller
//! generates (`peerwall compile --cluster` of a snapshot), on both backends:
//! anti-spoofing drops what comes from a peer's tunnel with a source outside the CIDRs Liqo's
//! `Configuration` gives that peer, and counts it; a pod leaving the `offloaded` set ends the
//! connections to it.

use peerwall_testkit::prelude::*;
use serde_json::{json, Value};

/// The consumer `a` as the provider's API server holds it: its tenant namespace, the namespace
/// it offloaded with one pod (10.20.1.2, a local node here), and Liqo's `Configuration` of the
/// peer (pod CIDR 10.10.0.0/16, not remapped).
fn snapshot() -> Value {
    json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "liqo-tenant-a",
            "labels": {"liqo.io/tenant-namespace": "true", "liqo.io/remote-cluster-id": "a"}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "app-a",
            "labels": {"liqo.io/remote-cluster-id": "a"}}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "worker"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "app-a"},
            "spec": {"nodeName": "worker", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.20.1.2", "podIPs": [{"ip": "10.20.1.2"}]}},
        {"apiVersion": "networking.liqo.io/v1beta1", "kind": "Configuration",
            "metadata": {"name": "a", "namespace": "liqo-tenant-a",
                "labels": {"liqo.io/remote-cluster-id": "a"}},
            "spec": {"remote": {"cidr": {"pod": ["10.10.0.0/16"], "external": ["10.11.0.0/16"]}}}},
    ]})
}

/// What the controller writes for the snapshot that an agent enforces: the gateway
/// configuration and its AddressSet slices (one document each), in `dir/policy`.
fn controller_output(dir: &std::path::Path) -> std::path::PathBuf {
    controller_output_of(dir, &snapshot(), "policy")
}

/// As [`controller_output`], for `snap`, in `dir/sub`.
fn controller_output_of(dir: &std::path::Path, snap: &Value, sub: &str) -> std::path::PathBuf {
    let input = dir.join(format!("{sub}.json"));
    std::fs::write(&input, snap.to_string()).unwrap();
    let o = std::process::Command::new(peerwall())
        .args(["compile", "--cluster"])
        .arg(&input)
        .args(["--output", "json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let list: Value = serde_json::from_slice(&o.stdout).unwrap();
    let out = dir.join(sub);
    std::fs::create_dir_all(&out).unwrap();
    let mut n = 0;
    for item in list["items"].as_array().unwrap() {
        let kind = item["kind"].as_str().unwrap_or("");
        let name = item["metadata"]["name"].as_str().unwrap_or("");
        // The peer's gateway configuration and its slices (the NetworkPolicy tier and the
        // offloaded namespace's NetworkPolicy are not about this).
        if (kind == "FirewallConfiguration" && name == "peerwall-gateway") || kind == "AddressSet" {
            std::fs::write(out.join(format!("{name}.yaml")), item.to_string()).unwrap();
            n += 1;
        }
    }
    assert!(n >= 2, "{list}");
    out
}

/// One backend's datapath in the gateway namespace for the length of a test step: its pin
/// directory, and the host commands run against it.
struct Installed<'a> {
    backend: &'a str,
    netns: &'a str,
    pins: String,
}

impl<'a> Installed<'a> {
    fn new(backend: &'a str, netns: &'a str, tag: &str) -> Self {
        Self {
            backend,
            netns,
            pins: format!("/sys/fs/bpf/pwt-{tag}-{}", std::process::id()),
        }
    }

    /// `peerwall CMD --netns GW [--pin-dir PINS] ARGS` (the pin directory for bpf).
    fn run(&self, cmd: &str, args: &[&str]) -> std::process::Output {
        let mut c = std::process::Command::new(peerwall());
        c.args([cmd, "--netns", self.netns]);
        if self.backend == "bpf" {
            c.args(["--pin-dir", &self.pins]);
        }
        c.args(args).output().unwrap()
    }

    /// `peerwall apply` of the controller's output in `policy`.
    fn apply(&self, policy: &std::path::Path) {
        let p = policy.display().to_string();
        let o = self.run("apply", &["--backend", self.backend, "-f", &p]);
        assert!(
            o.status.success(),
            "{}: {}",
            self.backend,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

impl Drop for Installed<'_> {
    /// Whatever is in force goes (an agent killed leaves its policy), pins included.
    fn drop(&mut self) {
        let _ = self.run("delete", &[]);
        let _ = peerwall_backend_bpf::loader::remove_pins(std::path::Path::new(&self.pins));
    }
}

#[test]
fn spoofed_sources_from_the_tunnel_are_dropped_and_counted_on_both_backends() {
    let t = Topology::new();
    let dir = scratch("gateway");
    let policy = controller_output(&dir);
    let spec = std::fs::read_to_string(policy.join("peerwall-gateway.yaml")).unwrap();
    assert!(spec.contains("spoofed"), "{spec}");
    assert!(
        spec.contains("10.10.0.0/16") && spec.contains("10.11.0.0/16"),
        "{spec}"
    );
    // A source outside the peer's CIDRs, routed back through the tunnel like the real ones.
    ip(
        &t.consumer,
        &["addr", "add", "10.99.0.67/32", "dev", "eth0"],
    );
    ip(&t.gateway, &["route", "add", "10.99.0.0/16", "dev", TUNNEL]);
    let _web = Listener::tcp(&t.provider, "10.20.1.2", 8080);
    // Sensitivity: with nothing enforced both sources reach the offloaded pod.
    for src in ["10.10.1.67", "10.99.0.67"] {
        assert!(
            tcp_connects(&t.consumer, src, "10.20.1.2", 8080),
            "{src} reaches the pod before enforcement"
        );
    }
    for backend in ["nftables", "bpf"] {
        let installed = Installed::new(backend, t.gateway.name(), "protection");
        installed.apply(&policy);
        assert!(
            tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", 8080),
            "{backend}: the peer's own pod reaches its offloaded pod"
        );
        assert!(
            !tcp_connects(&t.consumer, "10.99.0.67", "10.20.1.2", 8080),
            "{backend}: a spoofed source is dropped"
        );
        let o = installed.run("counters", &["--output", "json"]);
        let out = String::from_utf8_lossy(&o.stdout);
        let counters: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{backend}: counters {e}: {out}"));
        let spoofed = counters
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["rule"] == "spoofed")
            .unwrap_or_else(|| panic!("{backend}: no spoofed counter in {out}"));
        assert!(
            spoofed["packets"].as_u64().unwrap_or(0) > 0,
            "{backend}: the drop is counted: {spoofed}"
        );
        let o = installed.run("delete", &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `peerwall agent` on the directory `policy` in the gateway with `backend` (its log in
/// `dir/agent.log`), once in force: a pod nobody offloaded (10.20.3.1) stops answering the peer.
fn dir_agent<'a>(
    t: &'a Topology,
    backend: &'a str,
    dir: &std::path::Path,
    policy: &std::path::Path,
    tag: &str,
) -> (Proc, Installed<'a>) {
    dir_agent_with(t, backend, dir, policy, tag, &[])
}

/// [`dir_agent`] with `extra` flags.
fn dir_agent_with<'a>(
    t: &'a Topology,
    backend: &'a str,
    dir: &std::path::Path,
    policy: &std::path::Path,
    tag: &str,
    extra: &[&str],
) -> (Proc, Installed<'a>) {
    dir_agent_in(t, backend, dir, policy, tag, extra, false)
}

/// As [`dir_agent_with`]; with `read_only_proc_sys`, the agent sees `/proc/sys` read-only, as
/// in the DaemonSet's and the sidecar's containers.
fn dir_agent_in<'a>(
    t: &'a Topology,
    backend: &'a str,
    dir: &std::path::Path,
    policy: &std::path::Path,
    tag: &str,
    extra: &[&str],
    read_only_proc_sys: bool,
) -> (Proc, Installed<'a>) {
    let installed = Installed::new(backend, t.gateway.name(), tag);
    let mut args: Vec<String> = vec![
        "--source".into(),
        format!("dir:{}", policy.display()),
        "--backend".into(),
        backend.into(),
        "--interval-ms".into(),
        "50".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    if backend == "bpf" {
        args.extend(["--pin-dir".into(), installed.pins.clone()]);
    }
    let log = std::fs::File::create(dir.join("agent.log")).unwrap();
    let mut cmd = if read_only_proc_sys {
        let mut c = std::process::Command::new("unshare");
        c.args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(
                "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys /proc/sys \
                 && exec \"$@\"",
            )
            .arg("sh")
            .arg("nsenter")
            .arg(format!("--net=/run/netns/{}", t.gateway.name()))
            .arg(peerwall());
        c
    } else {
        peerwall_nsenter(&t.gateway)
    };
    let agent = Proc::killed_on_drop(
        cmd.arg("agent")
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    assert!(
        poll(20, || !ping(&t.consumer, "10.10.1.67", "10.20.3.1")),
        "{backend}: the agent enforces the gateway configuration"
    );
    (agent, installed)
}

/// A ProtectionPolicy closes `proto` port 6000 to peer a's tunnel (the controller's output for
/// it replaces the agent's directory `policy`); returns what `pod` had received once nothing
/// more arrives.
fn close_6000(
    policy: &std::path::Path,
    dir: &std::path::Path,
    proto: &str,
    pod: &Chatter,
    case: &str,
) -> u64 {
    let mut snap = snapshot();
    snap["items"].as_array_mut().unwrap().push(json!({
        "apiVersion": "peerwall.io/v1alpha1", "kind": "ProtectionPolicy",
        "metadata": {"name": "no-6000"},
        "spec": {"peers": ["a"], "close": [{"name": proto.to_lowercase(), "ports": [{"protocol": proto, "port": 6000}]}]}}));
    replace_with(policy, &controller_output_of(dir, &snap, "closed"));
    assert!(
        poll(20, || {
            let before = pod.received();
            std::thread::sleep(std::time::Duration::from_millis(600));
            pod.received() == before
        }),
        "{case}: the closing ends the exchange"
    );
    pod.received()
}

/// An empty scratch directory of this test process, `pw-protection-<pid>-<tag>`.
fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("pw-protection-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The controller's output in `from` replaces the files of the agent's directory `policy`.
/// Each file is written beside the directory and renamed into it, so the agent never reads one
/// half written (a truncated FirewallConfiguration is a policy without it).
fn replace_with(policy: &std::path::Path, from: &std::path::Path) {
    let staging = policy.with_extension("staging");
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), &staging).unwrap();
        std::fs::rename(&staging, policy.join(e.file_name())).unwrap();
    }
}

/// Revocation in provider protection: a pod leaving the peer's `offloaded` set (its slice
/// rewritten without it, as the controller does when the pod is deleted or relabelled) ends
/// the connection the peer's pod holds open to it, through a running agent, on both backends;
/// a connection to a pod that stays keeps flowing.
#[test]
fn a_pod_leaving_the_offloaded_set_ends_the_connections_to_it_on_both_backends() {
    let t = Topology::new();
    let _a = Listener::tcp_echo(&t.provider, "10.20.1.2", 8080);
    let _b = Listener::tcp_echo(&t.provider, "10.20.1.3", 8080);
    let _b_udp = udp_echo(&t.provider, "10.20.1.3", 9090);
    for backend in ["nftables", "bpf"] {
        let dir = scratch(&format!("revoke-{backend}"));
        // The controller's output for two offloaded pods.
        let mut snap = snapshot();
        let pod = |name: &str, ip: &str| {
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "app-a"},
                "spec": {"nodeName": "worker", "containers": [{"name": "c", "image": "i"}]},
                "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})
        };
        snap["items"]
            .as_array_mut()
            .unwrap()
            .push(pod("db", "10.20.1.3"));
        let policy = controller_output_of(&dir, &snap, "two");
        let (agent, installed) = dir_agent(&t, backend, &dir, &policy, "revoke");
        assert!(
            tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.3", 8080),
            "{backend}: the offloaded pod answers under the agent"
        );
        let mut to_db = Session::tcp(&t.consumer, "10.10.1.67", "10.20.1.3", 8080)
            .unwrap_or_else(|| panic!("{backend}: connects to db"));
        let mut to_web = Session::tcp(&t.consumer, "10.10.1.67", "10.20.1.2", 8080)
            .unwrap_or_else(|| panic!("{backend}: connects to web"));
        // And a UDP stream to db (one flow: the same source port throughout).
        let mut udp_db = Session::udp(&t.consumer, "10.10.1.67", 40999, "10.20.1.3", 9090)
            .unwrap_or_else(|| panic!("{backend}: a UDP stream to db"));
        for s in [&mut to_db, &mut to_web, &mut udp_db] {
            assert!(
                s.echoes("before", std::time::Duration::from_secs(3)),
                "{backend}"
            );
        }
        // db leaves: the slices the controller writes for one pod replace the directory's.
        replace_with(&policy, &controller_output_of(&dir, &snapshot(), "one"));
        assert!(
            poll(20, || !tcp_connects(
                &t.consumer,
                "10.10.1.67",
                "10.20.1.3",
                8080
            )),
            "{backend}: new connections to db are refused"
        );
        assert!(
            !to_db.echoes("after", std::time::Duration::from_secs(3)),
            "{backend}: the connection to the pod that left still carries data; agent: {}\n{}\n{}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default(),
            String::from_utf8_lossy(&in_ns(&t.gateway, "nft", &["list", "ruleset"]).stdout),
            String::from_utf8_lossy(&in_ns(&t.gateway, "conntrack", &["-L"]).stdout),
        );
        assert!(
            !udp_db.echoes("after", std::time::Duration::from_secs(3)),
            "{backend}: the UDP stream to the pod that left still flows"
        );
        assert!(
            to_web.echoes("after", std::time::Duration::from_secs(3)),
            "{backend}: the connection to the pod that stays was ended too"
        );
        // The agent leaves its policy in force when killed: `installed` takes it out.
        drop((to_db, to_web, udp_db, agent, installed));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Revocation by a ProtectionPolicy closing: closings refuse connections in state `new`, so
/// once the agent has ended the connection, its next segment from the tunnel (`invalid`
/// without its conntrack entry) must not reach an accept rule that has no state test
/// (`to_offloaded`): the gateway drops invalid packets from the tunnel first. Before that
/// rule the ended connection kept carrying data and the agent counted it as ended.
#[test]
fn a_closing_ends_the_connections_it_refuses_on_both_backends() {
    let t = Topology::new();
    let _web = Listener::tcp_echo(&t.provider, "10.20.1.2", 8080);
    for backend in ["nftables", "bpf"] {
        let dir = scratch(&format!("close-{backend}"));
        let policy = controller_output(&dir);
        let (agent, installed) = dir_agent(&t, backend, &dir, &policy, "close");
        let mut to_web = Session::tcp(&t.consumer, "10.10.1.67", "10.20.1.2", 8080)
            .unwrap_or_else(|| panic!("{backend}: connects to web"));
        assert!(
            to_web.echoes("before", std::time::Duration::from_secs(3)),
            "{backend}"
        );
        // A ProtectionPolicy closes 8080 to the peer's tunnel.
        let mut snap = snapshot();
        snap["items"].as_array_mut().unwrap().push(json!({
            "apiVersion": "peerwall.io/v1alpha1", "kind": "ProtectionPolicy",
            "metadata": {"name": "no-http"},
            "spec": {"peers": ["a"], "close": [{"name": "http", "ports": [{"protocol": "TCP", "port": 8080}]}]}}));
        replace_with(&policy, &controller_output_of(&dir, &snap, "closed"));
        assert!(
            poll(20, || !tcp_connects(
                &t.consumer,
                "10.10.1.67",
                "10.20.1.2",
                8080
            )),
            "{backend}: new connections to 8080 are refused"
        );
        assert!(
            !to_web.echoes("after", std::time::Duration::from_secs(3)),
            "{backend}: the closed connection still carries data; agent: {}\n{}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default(),
            String::from_utf8_lossy(&in_ns(&t.gateway, "nft", &["list", "ruleset"]).stdout),
        );
        drop((to_web, agent, installed));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Liqo's `gw-notrack` FirewallConfiguration (its chart's
/// `deployments/liqo/templates/liqo-notrack-firewallconfiguration.yaml`, installed with
/// `networking.notrack.enabled`), as Liqo's firewall controller writes it in every gateway:
/// UDP to or from the Geneve port (6091) skips conntrack at raw priority, on any interface, so
/// a peer's datagram through the tunnel to an offloaded pod's port 6091 is `untracked`, never
/// `new`. Before the closings tested `untracked` too, nftables let such datagrams past a
/// ProtectionPolicy closing UDP 6091 (to `to_offloaded`, which accepts without a state test).
/// Here, on both backends: the peer's stream to 6091 echoes before the closing (the path
/// works), stops once the closing is in force, and a stream to a port the closing leaves open
/// keeps echoing; on nftables Liqo's notrack counter shows the closed port's datagrams went
/// untracked (bpf drops them at tc, before netfilter sees them).
#[test]
fn liqos_notrack_on_the_geneve_port_opens_no_closing_on_both_backends() {
    let t = Topology::new();
    let o = in_ns(
        &t.gateway,
        "nft",
        &["add table ip liqo-notrack-geneve; \
           add chain ip liqo-notrack-geneve prerouting { type filter hook prerouting priority -300; policy accept; }; \
           add rule ip liqo-notrack-geneve prerouting udp dport 6091 counter notrack; \
           add rule ip liqo-notrack-geneve prerouting udp sport 6091 counter notrack; \
           add chain ip liqo-notrack-geneve output { type filter hook output priority -300; policy accept; }; \
           add rule ip liqo-notrack-geneve output udp dport 6091 counter notrack; \
           add rule ip liqo-notrack-geneve output udp sport 6091 counter notrack"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Datagrams Liqo's prerouting rule took out of conntrack towards port 6091.
    let untracked = || -> u64 {
        let o = in_ns(
            &t.gateway,
            "nft",
            &["list", "chain", "ip", "liqo-notrack-geneve", "prerouting"],
        );
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let line = text
            .lines()
            .find(|l| l.contains("udp dport 6091"))
            .unwrap_or_else(|| panic!("Liqo's notrack rule: {text}"));
        let mut words = line.split_whitespace();
        words.find(|w| *w == "packets");
        words.next().and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    let _geneve_port = udp_echo(&t.provider, "10.20.1.2", 6091);
    let _other_port = udp_echo(&t.provider, "10.20.1.2", 6092);
    let echoes = |sport: u16, port: u16| {
        Session::udp(&t.consumer, "10.10.1.67", sport, "10.20.1.2", port)
            .is_some_and(|mut s| s.echoes("pwcheck", std::time::Duration::from_secs(2)))
    };
    let mut sport = 7000;
    let mut next = || {
        sport += 1;
        sport
    };
    for backend in ["nftables", "bpf"] {
        let dir = scratch(&format!("notrack-{backend}"));
        let policy = controller_output(&dir);
        let (agent, installed) = dir_agent(&t, backend, &dir, &policy, "notrack");
        assert!(
            poll(5, || echoes(next(), 6091)),
            "{backend}: the peer's pod reaches port 6091 before the closing"
        );
        let mut snap = snapshot();
        snap["items"].as_array_mut().unwrap().push(json!({
            "apiVersion": "peerwall.io/v1alpha1", "kind": "ProtectionPolicy",
            "metadata": {"name": "no-6091"},
            "spec": {"peers": ["a"], "close": [{"name": "geneve-port", "ports": [{"protocol": "UDP", "port": 6091}]}]}}));
        replace_with(&policy, &controller_output_of(&dir, &snap, "closed"));
        assert!(
            poll(20, || !echoes(next(), 6091)),
            "{backend}: the closing of UDP 6091 holds; agent: {}\n{}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default(),
            String::from_utf8_lossy(&in_ns(&t.gateway, "nft", &["list", "ruleset"]).stdout),
        );
        let before = untracked();
        for _ in 0..3 {
            assert!(
                !echoes(next(), 6091),
                "{backend}: a datagram to the closed port came back"
            );
        }
        if backend == "nftables" {
            assert!(
                untracked() > before,
                "{backend}: Liqo's notrack rule saw the datagrams to 6091 (they were untracked)"
            );
        }
        assert!(
            echoes(next(), 6092),
            "{backend}: a port the closing leaves open still echoes"
        );
        drop((agent, installed));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A connection the agent ends stays ended whichever side speaks next, for as long as either
/// keeps sending: a UDP exchange between the peer's pod and an offloaded pod (both sending all
/// along), closed by a ProtectionPolicy; the pod's datagrams keep going out (our side is not
/// filtered) and once created a conntrack entry whose original direction was ours, so that the
/// peer's datagrams passed as its replies (nftables: deleting the entry was all revocation
/// did). Now none of the peer's datagrams reaches the pod again, through more than the ended
/// table's timeout (2 s here) and conntrack's UDP timeouts (shortened to 2 and 3 s), on both
/// backends (bpf with its own tables and reading the kernel's); the closing taken back, the exchange resumes (the agent lets the connection go);
/// on nftables the table holds the connection while they send and lets it go once both are
/// quiet.
#[test]
fn an_ended_connection_stays_ended_whichever_side_sends_on_both_backends() {
    let t = Topology::new();
    for (k, v) in [
        ("net.netfilter.nf_conntrack_udp_timeout", "2"),
        ("net.netfilter.nf_conntrack_udp_timeout_stream", "3"),
    ] {
        let _ = in_ns(&t.gateway, "modprobe", &["nf_conntrack"]);
        t.gateway.sysctl(k, v).expect("conntrack timeout");
    }
    // bpf reading the kernel's connection table (`--bpf-conntrack kernel`) last: the NAT
    // rule that makes the gateway's kernel track (as Liqo's remapping does) stays.
    for case in ["nftables", "bpf", "bpf-kernel"] {
        let backend = if case == "nftables" {
            "nftables"
        } else {
            "bpf"
        };
        let mut extra = vec!["--ended-connection-secs", "2"];
        if case == "bpf-kernel" {
            track_connections(&t.gateway);
            extra.extend(["--bpf-conntrack", "kernel"]);
        }
        let dir = scratch(&format!("ended-{case}"));
        let policy = controller_output(&dir);
        let (agent, installed) = dir_agent_with(&t, backend, &dir, &policy, "ended", &extra);
        // The peer's pod speaks first: the connection is the peer's (what the closing ends).
        let peer = Chatter::start(
            &format!("/run/netns/{}", t.consumer.name()),
            ("10.10.1.67", 5000),
            ("10.20.1.2", 6000),
            dir.join("peer.rx"),
        );
        // The pod answers once the peer's first datagram reached it.
        let pod = Chatter::answer(
            &format!("/run/netns/{}", t.provider.name()),
            ("10.20.1.2", 6000),
            ("10.10.1.67", 5000),
            dir.join("pod.rx"),
        );
        assert!(
            poll(10, || pod.received() > 10 && peer.received() > 10),
            "{case}: the exchange flows both ways ({} / {})",
            pod.received(),
            peer.received()
        );
        // A ProtectionPolicy closes UDP 6000 to the peer's tunnel.
        let ended_at = close_6000(&policy, &dir, "UDP", &pod, case);
        let sent_before = peer.received();
        let dropped = || {
            let o = in_ns(
                &t.gateway,
                "nft",
                &["-j", "list", "table", "inet", "peerwall-ended"],
            );
            let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            v["nftables"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|i| i["rule"]["comment"] == "ended4")
                .flat_map(|i| i["rule"]["expr"].as_array().cloned().unwrap_or_default())
                .filter_map(|e| e["counter"]["packets"].as_u64())
                .sum::<u64>()
        };
        let dropped_before = dropped();
        // Both keep sending, through every timeout involved.
        std::thread::sleep(std::time::Duration::from_secs(8));
        if backend == "bpf" {
            // Our side is not filtered: the pod's datagrams still reach the peer, and still
            // do not bring the connection back.
            assert!(
                peer.received() > sent_before,
                "{case}: the pod keeps sending"
            );
        } else {
            // Both sides' datagrams meet the ended table (20 a second each way for 8 s).
            let n = dropped() - dropped_before;
            assert!(n > 200, "{case}: the ended table dropped {n} datagrams");
        }
        let nft_ended = || {
            String::from_utf8_lossy(
                &in_ns(
                    &t.gateway,
                    "nft",
                    &["list", "set", "inet", "peerwall-ended", "ended4"],
                )
                .stdout,
            )
            .into_owned()
        };
        assert_eq!(
            pod.received(),
            ended_at,
            "{case}: the peer's datagrams reach the pod again once the pod spoke; agent: {}\nended: {}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default(),
            nft_ended(),
        );
        let mut peer = peer;
        if backend == "nftables" {
            let held = nft_ended();
            assert!(
                held.contains("10.20.1.2 . 10.10.1.67 . 6000 . 5000 . udp")
                    && held.contains("10.10.1.67 . 10.20.1.2 . 5000 . 6000 . udp"),
                "both orientations held while both send: {held}"
            );
            let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
            assert!(
                !log.contains("refused over netlink"),
                "the ended connection went in over netlink: {log}"
            );
            // The peer falls quiet: its orientation expires after the timeout, the pod's
            // stays while the pod sends.
            drop(peer);
            assert!(
                poll(10, || !nft_ended()
                    .contains("10.20.1.2 . 10.10.1.67 . 6000 . 5000 . udp")),
                "the quiet side's element expires: {}",
                nft_ended()
            );
            assert!(
                nft_ended().contains("10.10.1.67 . 10.20.1.2 . 5000 . 6000 . udp"),
                "the sending side's element is kept: {}",
                nft_ended()
            );
            peer = Chatter::start(
                &format!("/run/netns/{}", t.consumer.name()),
                ("10.10.1.67", 5000),
                ("10.20.1.2", 6000),
                dir.join("peer2.rx"),
            );
            std::thread::sleep(std::time::Duration::from_secs(2));
            assert_eq!(
                pod.received(),
                ended_at,
                "{case}: the peer speaking again after its element expired is still refused"
            );
        }
        // The closing taken back: the policy allows the exchange again and the agent lets
        // the ended connection go (both sides still sending, it would stay ended otherwise).
        replace_with(&policy, &controller_output_of(&dir, &snapshot(), "open"));
        assert!(
            poll(20, || pod.received() > ended_at + 10),
            "{case}: the exchange resumes once the policy allows it again; agent: {}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default(),
        );
        if backend == "nftables" {
            assert!(
                !nft_ended().contains("10.10.1.67"),
                "released: {}",
                nft_ended()
            );
        }
        drop((pod, peer));
        drop((agent, installed));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A TCP connection a closing ends stays ended after its mark lapses: both sides keep
/// writing, their retransmissions back off past `--ended-connection-secs 1`, and the next
/// segment of either side, which no conntrack entry or mark covers any more, opens nothing
/// (no pickup mid-stream): the peer's data never reaches the pod again. On nftables where the
/// agent can switch conntrack's pickup off, with `/proc/sys` read-only as in a container
/// (the ended table's `mid_stream` rule), and on bpf.
#[test]
fn a_tcp_connection_ended_stays_ended_after_its_mark_lapses() {
    let t = Topology::new();
    let _ = in_ns(&t.gateway, "modprobe", &["nf_conntrack"]);
    for (i, (backend, read_only)) in [("nftables", false), ("nftables", true), ("bpf", false)]
        .into_iter()
        .enumerate()
    {
        // A port of its own per case: nothing of the last case's connection is met again.
        let port = 5000 + i as u16;
        let case = format!(
            "{backend}{}",
            if read_only {
                " (read-only /proc/sys)"
            } else {
                ""
            }
        );
        // Pickup on, as the kernel starts: only the agent may switch it off.
        t.gateway
            .sysctl("net.netfilter.nf_conntrack_tcp_loose", "1")
            .expect("tcp_loose");
        let dir = scratch(&format!("tcp-{backend}-{read_only}"));
        let policy = controller_output(&dir);
        let (agent, installed) = dir_agent_in(
            &t,
            backend,
            &dir,
            &policy,
            "tcp",
            &["--ended-connection-secs", "1"],
            read_only,
        );
        let pod = Chatter::start_tcp(
            &format!("/run/netns/{}", t.provider.name()),
            true,
            ("10.20.1.2", 6000),
            ("10.10.1.67", port),
            dir.join("pod.rx"),
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
        let peer = Chatter::start_tcp(
            &format!("/run/netns/{}", t.consumer.name()),
            false,
            ("10.10.1.67", port),
            ("10.20.1.2", 6000),
            dir.join("peer.rx"),
        );
        assert!(
            poll(10, || pod.received() > 10 && peer.received() > 10),
            "{case}: the connection carries data both ways ({} / {})",
            pod.received(),
            peer.received()
        );
        let ended_at = close_6000(&policy, &dir, "TCP", &pod, &case);
        // Retransmissions back off (0.2, 0.4, 0.8, 1.6, 3.2 s, …): the mark lapses in the
        // gaps, and the segments after them find nothing.
        std::thread::sleep(std::time::Duration::from_secs(12));
        let log = || std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
        assert_eq!(
            pod.received(),
            ended_at,
            "{case}: the peer's data reaches the pod again after a gap; agent: {}\nconntrack: {}",
            log(),
            String::from_utf8_lossy(&in_ns(&t.gateway, "conntrack", &["-L", "-p", "tcp"]).stdout),
        );
        if read_only {
            let table = String::from_utf8_lossy(
                &in_ns(
                    &t.gateway,
                    "nft",
                    &["list", "table", "inet", "peerwall-ended"],
                )
                .stdout,
            )
            .into_owned();
            assert!(
                table.contains("mid_stream"),
                "{case}: the ended table holds the mid-stream rule: {table}"
            );
            assert!(
                log().contains("mid-stream pickup stays on"),
                "{case}: the agent could not switch pickup off: {}",
                log()
            );
        }
        drop((pod, peer));
        drop((agent, installed));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The gateway itself: from the peer's tunnel it answers Liqo's tunnel check (UDP 12345) and
/// nothing else (a TCP service on the gateway's tunnel address is refused once the
/// controller's configuration is in force, and reachable before), on both backends.
#[test]
fn the_gateway_takes_only_liqos_tunnel_check_from_the_tunnel_on_both_backends() {
    let t = Topology::new();
    let dir = scratch("input");
    let policy = controller_output_of(&dir, &snapshot(), "policy");
    // A TCP service and Liqo's tunnel check (UDP echo on 12345) on the gateway's tunnel address.
    let _svc = Listener::tcp(&t.gateway, "169.254.0.1", 2222);
    let udp = std::process::Command::new("ip")
        .args(["netns", "exec", t.gateway.name(), "socat"])
        .args(["UDP4-RECVFROM:12345,bind=169.254.0.1,fork", "EXEC:cat"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _udp = Proc::killed_on_drop(udp);
    let udp_answers = || {
        let mut c = std::process::Command::new("ip");
        c.args([
            "netns",
            "exec",
            t.consumer.name(),
            "timeout",
            "3",
            "socat",
            "-T",
            "1",
            "-",
        ])
        .arg("UDP4:169.254.0.1:12345,bind=10.10.1.67")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        {
            use std::io::Write;
            let _ = child.stdin.take().unwrap().write_all(b"pwcheck\n");
        }
        let o = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&o.stdout).contains("pwcheck")
    };
    assert!(
        poll(5, || tcp_connects(
            &t.consumer,
            "10.10.1.67",
            "169.254.0.1",
            2222
        )),
        "the gateway's TCP service answers before enforcement"
    );
    assert!(
        poll(5, udp_answers),
        "the tunnel check answers before enforcement"
    );
    for backend in ["nftables", "bpf"] {
        let installed = Installed::new(backend, t.gateway.name(), "input");
        installed.apply(&policy);
        assert!(udp_answers(), "{backend}: Liqo's tunnel check passes");
        assert!(
            !tcp_connects(&t.consumer, "10.10.1.67", "169.254.0.1", 2222),
            "{backend}: the gateway's other services are refused from the tunnel"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ping -i 0.01` from the peer's pod to `dst` in the background: every echo that crosses
/// the gateway gets its reply, so the replies count what the gateway let through.
struct Flood(std::process::Child);

impl Flood {
    fn start(t: &Topology, dst: &str) -> Self {
        Self(
            std::process::Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    t.consumer.name(),
                    "ping",
                    "-n",
                    "-i",
                    "0.01",
                    "-W",
                    "1",
                ])
                .args(["-I", "10.10.1.67", dst])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    /// Stop it: (echoes sent, replies received).
    fn stop(mut self) -> (u64, u64) {
        let _ = std::process::Command::new("kill")
            .args(["-INT", &self.0.id().to_string()])
            .status();
        let mut text = String::new();
        if let Some(mut o) = self.0.stdout.take() {
            use std::io::Read;
            o.read_to_string(&mut text).unwrap();
        }
        let _ = self.0.wait();
        let line = text
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .unwrap_or_else(|| panic!("no ping summary: {text}"));
        let num = |word: &str| -> u64 {
            let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
            let at = words.iter().position(|w| w.starts_with(word)).unwrap();
            words[at - 1].parse().unwrap()
        };
        (num("packets"), num("received"))
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nft_tables(t: &Topology) -> String {
    String::from_utf8_lossy(&in_ns(&t.gateway, "nft", &["list", "tables"]).stdout).into_owned()
}

/// No unguarded window: the boot policy (`peerwall boot --peer a`, the sidecar's init
/// container) is in force before anything else; the agent (`--boot-peer a`) keeps it while
/// it has nothing to enforce, and lets it go only when the controller's configuration is in
/// force. A flood towards a pod the peer did not offload crosses the gateway 0 times from boot
/// on (it crosses before boot: the window is real), on both backends; the offloaded pod
/// becomes reachable with the configuration. Without `--boot-peer`, the agent's first apply
/// would have removed the boot table (checked on nftables: the pod answers again).
#[test]
fn a_gateway_is_filtered_from_boot_until_its_configuration_is_in_force_on_both_backends() {
    let t = Topology::new();
    let dir = scratch("boot");
    let published = controller_output(&dir);
    // What the agent has before the controller's configuration reaches it: a user's object
    // for this gateway that decides nothing about the peer (with the kube source, possibly
    // nothing at all: an empty policy).
    let unrelated = r#"
apiVersion: peerwall.io/v1alpha1
kind: FirewallConfiguration
metadata: {name: user-notes, namespace: liqo-tenant-a}
spec:
  table:
    name: user_notes
    family: INET
    chains:
      - name: forward
        hook: forward
        policy: accept
        priority: 50
        type: filter
        rules:
          filterRules:
            - name: count_ssh
              counter: true
              action: accept
              match:
                - proto: {value: tcp}
                  op: eq
                - port: {value: "22", position: dst}
                  op: eq
"#;
    let source_dir = |name: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("user-notes.yaml"), unrelated).unwrap();
        d
    };
    let boot = || {
        let o = std::process::Command::new(peerwall())
            .args(["boot", "--peer", "a", "--netns", t.gateway.name()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let agent = |backend: &str, source: &std::path::Path, pins: &str, boot_peer: bool| {
        let mut args: Vec<String> = vec![
            "--source".into(),
            format!("dir:{}", source.display()),
            "--backend".into(),
            backend.into(),
            "--interval-ms".into(),
            "50".into(),
            "--pin-dir".into(),
            pins.into(),
        ];
        if boot_peer {
            args.extend(["--boot-peer".into(), "a".into()]);
        }
        let log =
            std::fs::File::create(dir.join(format!("agent-{backend}-{boot_peer}.log"))).unwrap();
        Proc::killed_on_drop(
            peerwall_nsenter(&t.gateway)
                .arg("agent")
                .args(&args)
                .env("PEERWALL_LOG", "info")
                .stdout(std::process::Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        )
    };
    let log_of = |backend: &str, boot_peer: bool| {
        std::fs::read_to_string(dir.join(format!("agent-{backend}-{boot_peer}.log")))
            .unwrap_or_default()
    };
    // The control: the agent without --boot-peer, nothing to enforce yet, removes the boot
    // table with its first apply.
    {
        let installed = Installed::new("nftables", t.gateway.name(), "boot0");
        let empty = source_dir("control");
        boot();
        assert!(
            nft_tables(&t).contains("peerwall_boot_a"),
            "{}",
            nft_tables(&t)
        );
        assert!(!ping(&t.consumer, "10.10.1.67", "10.20.3.1"));
        let _a = agent("nftables", &empty, &installed.pins, false);
        assert!(
            poll(20, || ping(&t.consumer, "10.10.1.67", "10.20.3.1")),
            "without --boot-peer the boot table stays: the control shows nothing"
        );
    }
    for backend in ["nftables", "bpf"] {
        let installed = Installed::new(backend, t.gateway.name(), "boot");
        let source = source_dir(&format!("source-{backend}"));
        // Before boot the window is open: the pod the peer did not offload answers.
        assert!(
            poll(10, || ping(&t.consumer, "10.10.1.67", "10.20.3.1")),
            "{backend}: nothing in force yet, yet the peer does not reach 10.20.3.1"
        );
        boot();
        let flood = Flood::start(&t, "10.20.3.1");
        // Even the offloaded pod waits for the configuration.
        assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "{backend}");
        let a = agent(backend, &source, &installed.pins, true);
        assert!(
            poll(20, || log_of(backend, true).contains("policy applied")),
            "{backend}: the agent applies: {}",
            log_of(backend, true)
        );
        assert!(
            !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
            "{backend}: boot policy kept"
        );
        assert!(nft_tables(&t).contains("peerwall_boot_a") || backend == "bpf");
        // The controller's configuration arrives.
        for e in std::fs::read_dir(&published).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), source.join(e.file_name())).unwrap();
        }
        assert!(
            poll(20, || ping(&t.consumer, "10.10.1.67", "10.20.1.2")),
            "{backend}: the offloaded pod answers once the configuration is in force: {}",
            log_of(backend, true)
        );
        assert!(
            poll(20, || !nft_tables(&t).contains("peerwall_boot_a")),
            "{backend}: the boot table is released: {}\n{}",
            nft_tables(&t),
            log_of(backend, true)
        );
        assert!(
            log_of(backend, true).contains("boot policy released"),
            "{backend}"
        );
        let (sent, through) = flood.stop();
        assert!(sent >= 100, "{backend}: the flood flowed ({sent} echoes)");
        assert_eq!(
            through, 0,
            "{backend}: {through} of {sent} echoes to a pod the peer did not offload crossed the gateway"
        );
        println!("{backend}: boot window: {through} of {sent} echoes through");
        drop((a, installed));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
