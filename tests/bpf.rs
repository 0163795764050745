//! The bpf backend against real kernels: programs attached with tcx (and XDP) to interfaces
//! named like Liqo's, real packets through veth pairs and a real WireGuard tunnel
//! (wireguard-go), maps readable with bpftool, enforcement surviving the agent's exit and a
//! restart, the emergency switch, and the verifier at the largest policy size.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::*;
use peerwall_backend_bpf::loader::{self, Datapath};
use peerwall_backend_bpf::maps::Iface;

/// A private pin directory under bpffs, removed (with its links) on drop.
struct Pins(PathBuf);

impl Pins {
    fn new(tag: &str) -> Self {
        let root = loader::ensure_bpffs().expect("bpffs");
        Pins(root.join(format!("pwt-{tag}-{}", std::process::id())))
    }
    fn arg(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = loader::remove_pins(&self.0);
    }
}

/// `peerwall ARGS` in the namespace's network (nsenter keeps /sys/fs/bpf visible).
fn peerwall_net(ns: &NetNs, args: &[&str]) -> std::process::Output {
    let bin = peerwall();
    let net = format!("--net=/run/netns/{}", ns.name());
    let mut full = vec![net.as_str(), bin.to_str().unwrap_or_default()];
    full.extend_from_slice(args);
    sh("nsenter", &full)
}

/// `peerwall apply --backend bpf --pin-dir PINS [EXTRA...] -f FILE` in the namespace; must succeed.
fn apply_bpf(ns: &NetNs, pins: &Pins, extra: &[&str], file: &std::path::Path) {
    let mut args = vec!["apply", "--backend", "bpf", "--pin-dir", pins.arg()];
    args.extend_from_slice(extra);
    args.extend(["-f", file.to_str().unwrap_or_default()]);
    ok(peerwall_net(ns, &args));
}

fn ok(o: std::process::Output) {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let mut full = vec!["-j"];
    full.extend_from_slice(args);
    let o = sh("bpftool", &full);
    assert!(
        o.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("bpftool json")
}

/// Packets counted at `COUNTERS<slot>[index]`, summed over CPUs, read with bpftool.
fn counted(pins: &Pins, slot: u64, index: u32) -> u64 {
    let map = format!("{}/COUNTERS{slot}", pins.arg());
    let key: Vec<String> = index.to_le_bytes().iter().map(|b| b.to_string()).collect();
    let mut args = vec!["map", "lookup", "pinned", map.as_str(), "key"];
    args.extend(key.iter().map(String::as_str));
    let v = bpftool_json(&args);
    v["values"]
        .as_array()
        .expect("per-cpu values")
        .iter()
        .map(|c| {
            let bytes: Vec<u8> = c["value"]
                .as_array()
                .expect("bytes")
                .iter()
                .take(8)
                .map(|b| {
                    u8::from_str_radix(b.as_str().unwrap_or("0").trim_start_matches("0x"), 16)
                        .unwrap_or(0)
                })
                .collect();
            u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]))
        })
        .sum()
}

/// The live slot: bit 0 of `CONFIG.active` (the rest counts policy changes).
fn active_slot(pins: &Pins) -> u64 {
    let map = format!("{}/CONFIG", pins.arg());
    let v = bpftool_json(&["map", "lookup", "pinned", &map, "key", "0", "0", "0", "0"]);
    let first = v["value"][0].as_str().unwrap_or("0x00");
    u64::from_str_radix(first.trim_start_matches("0x"), 16).unwrap_or(9) & 1
}

#[test]
fn thesis_block_enforced_by_tc_and_maps_readable_with_bpftool() {
    let t = Topology::new();
    let pins = Pins::new("veth");
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "baseline");
    apply_bpf(&t.gateway, &pins, &[], &repo("examples/thesis-block.yaml"));
    // The loader process has exited: pinned links keep the programs attached.
    assert_thesis_block_enforced(&t.consumer);
    // bpftool alone shows the state: links pinned, maps filled, counters moving.
    let links: Vec<String> = std::fs::read_dir(pins.0.join("links"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(links.contains(&"tc-liqo-tunnel".to_string()), "{links:?}");
    assert!(
        links.contains(&"tc-liqo:abcdefghij".to_string()),
        "{links:?}"
    );
    let slot = active_slot(&pins);
    let chains = bpftool_json(&[
        "map",
        "dump",
        "pinned",
        &format!("{}/CHAINS{slot}", pins.arg()),
    ]);
    let used = chains
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["value"][0] != "0x00")
        .count();
    assert_eq!(used, 1, "one chain with rules: {chains}");
    // The one destination is a host: it sits in the exact-match map, the trie stays empty.
    let dump = |m: &str| {
        bpftool_json(&[
            "map",
            "dump",
            "pinned",
            &format!("{}/{m}{slot}", pins.arg()),
        ])
        .as_array()
        .unwrap()
        .len()
    };
    assert_eq!(dump("DSTH"), 1, "one /32 host in DSTH");
    assert_eq!(dump("DST"), 0, "no prefix in the DST trie");
    // Rule 0 of chain 0 (drop_traffic) counted the dropped ping.
    assert!(counted(&pins, slot, 0) >= 1);
    // `peerwall inspect` decodes the same pins, with names.
    let o = peerwall_net(
        &t.gateway,
        &["inspect", "--pin-dir", pins.arg(), "--output", "json"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["chains"][0]["name"], "table_name/filter_chain_name");
    assert_eq!(v["chains"][0]["rules"][0]["name"], "drop_traffic");
    assert!(
        v["chains"][0]["rules"][0]["packets"].as_u64().unwrap() >= 1,
        "{v}"
    );
    assert!(
        v["attached"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "tc:liqo.abcdefghij"),
        "{v}"
    );
    // Emergency switch: everything passes, then enforcement is back.
    ok(peerwall_net(
        &t.gateway,
        &["allow-all", "on", "--pin-dir", pins.arg()],
    ));
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "allow-all");
    ok(peerwall_net(
        &t.gateway,
        &["allow-all", "off", "--pin-dir", pins.arg()],
    ));
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "enforced again"
    );
    // Delete detaches and unpins.
    ok(peerwall_net(
        &t.gateway,
        &["delete", "--backend", "bpf", "--pin-dir", pins.arg()],
    ));
    assert!(!pins.0.exists());
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "detached");
}

/// An upgrade over pins of a peerwall whose cached verdicts had another layout: the load
/// replaces the old caches (the verifier would refuse the new program's reads past their end)
/// and keeps everything else pinned.
#[test]
fn upgrade_replaces_verdict_caches_of_an_older_layout() {
    require_root();
    let pins = Pins::new("upgrade");
    std::fs::create_dir_all(&pins.0).expect("pin dir");
    let old = pins.0.join("VERDICTS4");
    let made = sh(
        "bpftool",
        &[
            "map",
            "create",
            old.to_str().unwrap_or_default(),
            "type",
            "lru_hash",
            "key",
            "16",
            "value",
            "32",
            "entries",
            "1024",
            "name",
            "VERDICTS4",
        ],
    );
    assert!(made.status.success(), "bpftool map create: {made:?}");
    let value_size = |name: &str| {
        bpftool_json(&["map", "show", "pinned", &format!("{}/{name}", pins.arg())])["bytes_value"]
            .as_u64()
    };
    assert_eq!(value_size("VERDICTS4"), Some(32));
    let mut b = Datapath::load(&pins.0).expect("the new object loads over the old pins");
    b.tc_program().expect("and its program verifies");
    assert_eq!(
        value_size("VERDICTS4"),
        Some(std::mem::size_of::<peerwall_common::CachedVerdict>() as u64)
    );
    assert_eq!(
        value_size("VERDICT_GENS"),
        Some(4),
        "the generations are pinned beside the caches"
    );
}

#[test]
fn restarted_agent_adopts_pinned_state_and_switches_policy() {
    let t = Topology::new();
    let pins = Pins::new("restart");
    let _srv = Listener::tcp(&t.provider, "10.20.1.2", 8080);
    let _srv3 = Listener::tcp(&t.provider, "10.20.3.1", 8080);
    let _back = Listener::tcp(&t.consumer, "10.10.1.67", 9090);
    apply_bpf(
        &t.gateway,
        &pins,
        &["--xdp"],
        &repo("examples/provider-protection.yaml"),
    );
    // Replies of provider-initiated connections pass through the bpf conntrack.
    assert_provider_protection(&t);
    assert!(
        pins.0.join("links/xdp-liqo-tunnel").exists(),
        "XDP attached on the veth"
    );
    let slot = active_slot(&pins);
    // A new process (a restarted agent) offloads one more pod: it reuses the pinned maps and
    // links, writes the idle slot and switches.
    let dir = std::env::temp_dir().join(format!("pw-bpf-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("pp.yaml");
    let text = std::fs::read_to_string(repo("examples/provider-protection.yaml")).unwrap();
    std::fs::write(
        &f,
        text.replace(
            "          - key: 10.20.2.10",
            "          - key: 10.20.2.10\n          - key: 10.20.3.1",
        ),
    )
    .unwrap();
    apply_bpf(&t.gateway, &pins, &["--xdp"], &f);
    assert_eq!(active_slot(&pins), slot ^ 1, "switched to the other slot");
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "newly offloaded pod"
    );
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", 8080),
        "still allowed"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.9.9"),
        "default deny holds"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A wireguard-go process serving one interface, killed on drop.
struct WgGo(Child);

impl Drop for WgGo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wireguard_go(ns: &NetNs, dev: &str) -> WgGo {
    let child = Command::new("ip")
        .args(["netns", "exec", ns.name(), "wireguard-go", "-f", dev])
        .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("wireguard-go (apt-get install wireguard-go)");
    for _ in 0..100 {
        if in_ns(ns, "ip", &["link", "show", dev]).status.success() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    WgGo(child)
}

#[test]
fn enforced_on_a_real_wireguard_tunnel() {
    require_root();
    let consumer = NetNs::new("pwt-wc").unwrap();
    let gateway = NetNs::new("pwt-wg").unwrap();
    let provider = NetNs::new("pwt-wp").unwrap();
    // Underlay between the consumer's gateway and ours; the provider node behind a Geneve-named veth.
    veth(&consumer, "under", &gateway, "under");
    ip(
        &consumer,
        &["addr", "add", "192.168.77.1/30", "dev", "under"],
    );
    ip(
        &gateway,
        &["addr", "add", "192.168.77.2/30", "dev", "under"],
    );
    provider_link(&gateway, &provider);
    ip(&provider, &["addr", "add", "10.20.1.2/32", "dev", "eth0"]);
    gateway.sysctl("net.ipv4.ip_forward", "1").unwrap();
    gateway.sysctl("net.ipv4.conf.all.proxy_arp", "1").unwrap();
    let _wc = wireguard_go(&consumer, "wg-consumer");
    let _wg = wireguard_go(&gateway, TUNNEL);
    let (cpriv, cpub) = wg_key();
    let (gpriv, gpub) = wg_key();
    let dir = std::env::temp_dir().join(format!("pw-wg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ck, gk) = (dir.join("c.key"), dir.join("g.key"));
    std::fs::write(&ck, &cpriv).unwrap();
    std::fs::write(&gk, &gpriv).unwrap();
    assert!(in_ns(
        &consumer,
        "wg",
        &[
            "set",
            "wg-consumer",
            "listen-port",
            "51820",
            "private-key",
            ck.to_str().unwrap(),
            "peer",
            &gpub,
            "endpoint",
            "192.168.77.2:51820",
            "allowed-ips",
            "10.20.0.0/16"
        ]
    )
    .status
    .success());
    assert!(in_ns(
        &gateway,
        "wg",
        &[
            "set",
            TUNNEL,
            "listen-port",
            "51820",
            "private-key",
            gk.to_str().unwrap(),
            "peer",
            &cpub,
            "endpoint",
            "192.168.77.1:51820",
            "allowed-ips",
            "10.10.0.0/16"
        ]
    )
    .status
    .success());
    ip(
        &consumer,
        &["addr", "add", "10.10.1.67/32", "dev", "wg-consumer"],
    );
    ip(
        &consumer,
        &["addr", "add", "10.10.1.68/32", "dev", "wg-consumer"],
    );
    ip(&consumer, &["link", "set", "wg-consumer", "up"]);
    ip(&gateway, &["link", "set", TUNNEL, "up"]);
    ip(
        &consumer,
        &["route", "add", "10.20.0.0/16", "dev", "wg-consumer"],
    );
    ip(&gateway, &["route", "add", "10.10.0.0/16", "dev", TUNNEL]);
    let mut up = false;
    for _ in 0..20 {
        if ping(&consumer, "10.10.1.67", "10.20.1.2") {
            up = true;
            break;
        }
    }
    assert!(up, "tunnel carries traffic before any policy");
    let pins = Pins::new("wg");
    apply_bpf(&gateway, &pins, &[], &repo("examples/thesis-block.yaml"));
    // liqo-tunnel is an L3 (no Ethernet header) device: the datapath reads IP at offset 0.
    assert!(
        !ping(&consumer, "10.10.1.67", "10.20.1.2"),
        "dropped inside the tunnel"
    );
    assert!(
        ping(&consumer, "10.10.1.68", "10.20.1.2"),
        "other pod passes"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn verifier_accepts_the_largest_policy() {
    require_root();
    // 16 chains on one hook, each with the maximum of 1023 deciding rules over every dimension.
    let mut rules = String::new();
    for r in 0..1023 {
        rules.push_str(&format!(
            "            - {{name: r{r}, action: {}, match: [{{op: eq, ip: {{value: 10.{}.{}.0/24, position: src}}, port: {{value: '{}', position: dst}}}}, {{op: neq, dev: {{value: liqo.x, position: in}}}}, {{op: eq, ctstate: {{value: [new]}}}}]}}\n",
            if r % 2 == 0 { "accept" } else { "drop" },
            r / 256,
            r % 256,
            1000 + r
        ));
    }
    let mut chains = String::new();
    for c in 0..16 {
        chains.push_str(&format!(
            "      - name: c{c:02}\n        type: filter\n        hook: forward\n        priority: {c}\n        policy: accept\n        rules:\n          filterRules:\n{rules}"
        ));
    }
    let yaml = format!("apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: big}}\nspec:\n  table:\n    name: big\n    family: INET\n    chains:\n{chains}");
    let objs = peerwall_intent::load::parse_documents(&yaml, "big").unwrap();
    let policy = peerwall_policy::compile::compile(&objs).unwrap().policy;
    let pins = Pins::new("big");
    let mut b = Datapath::load(&pins.0).expect("load");
    let ifaces = [Iface {
        name: "liqo.x".into(),
        ifindex: 7,
    }];
    let report = b.apply(&policy, &ifaces).expect("apply");
    assert_eq!(report.prefixes, 16 * 1023);
    b.tc_program().expect("the verifier accepts the tc program");
    b.tc_l3_program()
        .expect("the verifier accepts the tc program of L3 devices");
    // And it decides: the last rule of the last chain.
    let pkt = peerwall_policy::ir::Packet {
        src: "10.3.254.9".parse().unwrap(),
        dst: "10.20.0.1".parse().unwrap(),
        proto: 6,
        sport: 40000,
        dport: 2022,
        iif: Some("liqo.y".into()),
        oif: Some("liqo.x".into()),
        ct_state: peerwall_policy::ir::CtState::New,
    };
    let expected = peerwall_policy::ir::evaluate(&policy, &pkt);
    assert_eq!(expected.rule.as_deref(), Some("r1022"));
    let mut probe = peerwall_probe::bpf::BpfProbe::new(
        &policy,
        &["liqo.x".to_string(), "liqo.y".to_string()],
        pins.0.parent().unwrap(),
    )
    .unwrap();
    assert_eq!(probe.verdict(&pkt).unwrap(), expected);
}

#[test]
fn reject_answers_with_port_unreachable_from_tc() {
    let t = Topology::new();
    let pins = Pins::new("reject");
    let dir = std::env::temp_dir().join(format!("pw-bpf-reject-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("reject.yaml");
    std::fs::write(
        &f,
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: r, namespace: t}\nspec:\n  table:\n    name: rej\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: no-v4, action: reject, match: [{op: eq, ip: {value: 10.20.1.3, position: dst}}]}\n            - {name: no-v6, action: reject, match: [{op: eq, ip: {value: 'fd20::2', position: dst}}]}\n",
    )
    .unwrap();
    apply_bpf(&t.gateway, &pins, &[], &f);
    // The receiving kernel accepts the answers only with correct checksums.
    let out = ping_output(&t.consumer, "10.10.1.67", "10.20.1.3");
    assert!(out.contains("Destination Port Unreachable"), "{out}");
    let out6 = ping_output(&t.consumer, "fd10::67", "fd20::2");
    assert!(
        out6.contains("Destination unreachable: Port unreachable")
            || out6.contains("Port unreachable"),
        "{out6}"
    );
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "others pass");
    std::fs::remove_dir_all(&dir).ok();
}

/// A `peerwall agent --backend bpf` over the YAML files of `dir` in `ns`'s network, polling
/// every `interval_ms`; killed on drop.
fn bpf_agent(ns: &NetNs, pins: &Pins, dir: &std::path::Path, interval_ms: u32) -> Agent {
    let args = [
        "--backend".to_string(),
        "bpf".into(),
        "--interval-ms".into(),
        interval_ms.to_string(),
        "--pin-dir".into(),
        pins.arg().into(),
        "--source".into(),
        format!("dir:{}", dir.display()),
    ];
    spawn_agent(ns, &args)
}

#[test]
fn agent_attaches_to_interfaces_that_appear_later() {
    let t = Topology::new();
    let pins = Pins::new("newif");
    let dir = std::env::temp_dir().join(format!("pw-bpf-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("p.yaml"),
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: n, namespace: t}\nspec:\n  table:\n    name: nodes\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: from-new-nodes, action: drop, match: [{op: eq, dev: {value: 'liqo.', position: in, wildcard: true}, ip: {value: 10.20.9.9, position: src}}]}\n",
    )
    .unwrap();
    let _agent = bpf_agent(&t.gateway, &pins, &dir, 50);
    let attached = |name: &str| pins.0.join("links").join(name).exists();
    for _ in 0..100 {
        if attached("tc-liqo:abcdefghij") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        attached("tc-liqo:abcdefghij"),
        "agent attached to the existing Geneve interface"
    );
    // A new provider node joins: a new Geneve interface on the gateway.
    let extra = NetNs::new("pwt-new").unwrap();
    veth(&t.gateway, "liqo.newnode123", &extra, "eth0");
    ip(&extra, &["addr", "add", "10.20.9.9/32", "dev", "eth0"]);
    ip(&extra, &["addr", "add", "10.20.9.10/32", "dev", "eth0"]);
    ip(
        &t.gateway,
        &["addr", "add", "169.254.9.1/32", "dev", "liqo.newnode123"],
    );
    ip(&extra, &["route", "add", "169.254.9.1", "dev", "eth0"]);
    ip(
        &extra,
        &[
            "route",
            "add",
            "default",
            "via",
            "169.254.9.1",
            "dev",
            "eth0",
        ],
    );
    ip(
        &t.gateway,
        &["route", "add", "10.20.9.0/24", "dev", "liqo.newnode123"],
    );
    for _ in 0..100 {
        if attached("tc-liqo:newnode123") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        attached("tc-liqo:newnode123"),
        "agent attached to the new interface"
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        !ping(&extra, "10.20.9.9", "10.10.1.67"),
        "the wildcard rule applies on the new interface"
    );
    assert!(
        ping(&extra, "10.20.9.10", "10.10.1.67"),
        "other sources pass"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A FirewallConfiguration dropping forwarded packets to `@blocked` (with `extra_rule`, a second
/// rule dropping packets to 10.20.1.2, which changes the chain's rules).
fn blocked_policy(blocked: &[&str], extra_rule: bool) -> String {
    let elements: String = blocked
        .iter()
        .map(|a| format!("          - key: {a}\n"))
        .collect();
    let extra = if extra_rule {
        "            - {name: pod2, action: drop, match: [{op: eq, ip: {value: 10.20.1.2, position: dst}}]}\n"
    } else {
        ""
    };
    format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: c, namespace: t}}\nspec:\n  table:\n    name: cache\n    family: IPV4\n    sets:\n      - name: blocked\n        keyType: ipv4_addr\n        elements:\n{elements}    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {{name: blocked, action: drop, match: [{{op: eq, ip: {{value: '@blocked', position: dst}}}}]}}\n{extra}"
    )
}

/// Wall-clock seconds (what `ping -D` prints).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Echo replies of `ping -D` output, by their timestamps: (before `t`, after `t`).
fn replies_around(out: &str, t: f64) -> (usize, usize) {
    let stamps: Vec<f64> = out
        .lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.parse().ok())
        .collect();
    (
        stamps.iter().filter(|&&s| s <= t).count(),
        stamps.iter().filter(|&&s| s > t).count(),
    )
}

/// `CONFIG.active`: the policy epoch (bit 0 the live slot), read with bpftool.
fn epoch(pins: &Pins) -> u32 {
    let map = format!("{}/CONFIG", pins.arg());
    let v = bpftool_json(&["map", "lookup", "pinned", &map, "key", "0", "0", "0", "0"]);
    let b: Vec<u8> = (0..4)
        .map(|i| {
            let x = v["value"][i].as_str().unwrap_or("0x00");
            u8::from_str_radix(x.trim_start_matches("0x"), 16).unwrap_or(0)
        })
        .collect();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// One UDP flow (one source port) from pod1 to pod2:7777, a datagram every 20 ms until
/// stopped; the receiver keeps each datagram's wall-clock arrival time. IPv4 UDP is what the
/// datapath's known-flow path (`known_flow_v4`, the cache read straight from the packet)
/// serves, where echo requests take the parsed path.
struct UdpFlow {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sender: std::thread::JoinHandle<()>,
    receiver: std::thread::JoinHandle<Vec<f64>>,
}

impl UdpFlow {
    fn start(t: &Topology) -> Self {
        use std::net::UdpSocket;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rx = t
            .provider
            .run_in(|| UdpSocket::bind(("10.20.1.2", 7777)))
            .expect("provider")
            .expect("bind receiver");
        rx.set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .expect("timeout");
        let tx = t
            .consumer
            .run_in(|| UdpSocket::bind(("10.10.1.67", 0)))
            .expect("consumer")
            .expect("bind sender");
        let s = stop.clone();
        let receiver = std::thread::spawn(move || {
            let mut stamps = vec![];
            let mut buf = [0u8; 64];
            let mut quiet_after_stop = 0;
            while quiet_after_stop < 4 {
                match rx.recv(&mut buf) {
                    Ok(_) => stamps.push(unix_now()),
                    Err(_) if s.load(Ordering::Relaxed) => quiet_after_stop += 1,
                    Err(_) => {}
                }
            }
            stamps
        });
        let s = stop.clone();
        let sender = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let _ = tx.send_to(b"peerwall-cache", ("10.20.1.2", 7777));
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        });
        UdpFlow {
            stop,
            sender,
            receiver,
        }
    }

    /// Stop; the arrival times.
    fn finish(self) -> Vec<f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.sender.join();
        self.receiver.join().expect("receiver")
    }
}

/// The serving times (`CachedVerdict::ttl`, jiffies) of the UDP flows' verdicts in the pinned
/// IPv4 verdict cache (key byte 12: the protocol; value bytes 30..32: the time).
fn cached_udp_ttls(pins: &Pins) -> Vec<u16> {
    let cached = bpftool_json(&[
        "map",
        "dump",
        "pinned",
        &format!("{}/VERDICTS4", pins.arg()),
    ]);
    let byte = |v: &serde_json::Value| {
        v.as_str()
            .and_then(|x| u8::from_str_radix(x.trim_start_matches("0x"), 16).ok())
            .unwrap_or(0)
    };
    cached
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| byte(&e["key"][12]) == 17)
                .map(|e| u16::from_le_bytes([byte(&e["value"][30]), byte(&e["value"][31])]))
                .collect()
        })
        .unwrap_or_default()
}

/// The kernel's HZ from its build configuration (`/proc/config.gz`), when it has one.
fn kernel_hz() -> Option<u64> {
    let o = sh("sh", &["-c", "zcat /proc/config.gz 2>/dev/null"]);
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("CONFIG_HZ="))
        .and_then(|v| v.trim().parse().ok())
}

/// One echo flow (one ICMP id) and one UDP flow from pod1 to pod2 across `change`: they get
/// through before it, and nothing of either once the datapath's epoch shows the change in
/// force. Returns the epoch after the change and the UDP flow's cached serving times.
fn live_flow_across(t: &Topology, pins: &Pins, change: impl FnOnce()) -> (u32, Vec<u16>) {
    let udp = UdpFlow::start(t);
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            t.consumer.name(),
            "ping",
            "-n",
            "-D",
            "-i",
            "0.05",
            "-w",
            "4",
            "-I",
            "10.10.1.67",
            "10.20.1.2",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ping");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    // The flows' verdicts are cached: the pinned map shows them.
    let cached = bpftool_json(&[
        "map",
        "dump",
        "pinned",
        &format!("{}/VERDICTS4", pins.arg()),
    ]);
    assert!(
        cached.as_array().is_some_and(|a| !a.is_empty()),
        "verdicts of the live flow cached: {cached}"
    );
    let ttls = cached_udp_ttls(pins);
    assert!(!ttls.is_empty(), "the UDP flow's verdict cached: {cached}");
    // Served for at most one second's worth of jiffies: HZ measured by the datapath (a lower
    // bound, HZ − 1 after a second; 100 jiffies before its first 50 ms).
    if let Some(hz) = kernel_hz() {
        let hi = hz.saturating_sub(1).max(100) as u16;
        assert!(
            ttls.iter().all(|t| (100..=hi).contains(t)),
            "cached verdicts served for at most one second of jiffies at HZ {hz}: {ttls:?}"
        );
    }
    let before = epoch(pins);
    change();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while epoch(pins) == before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let after = epoch(pins);
    assert_ne!(after, before, "the agent applied the change");
    // Packets sent before may still be in flight for one round trip.
    let applied = unix_now() + 0.02;
    let o = child.wait_with_output().expect("ping output");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (answered, late) = replies_around(&out, applied);
    assert!(
        answered >= 10,
        "the flow was live before the change:\n{out}"
    );
    assert_eq!(late, 0, "replies after the change was in force:\n{out}");
    let stamps = udp.finish();
    let on_time = stamps.iter().filter(|&&s| s <= applied).count();
    let late: Vec<f64> = stamps
        .iter()
        .filter(|&&s| s > applied)
        .map(|s| s - applied)
        .collect();
    assert!(
        on_time >= 20,
        "the UDP flow was live before the change: {on_time} datagrams"
    );
    assert!(
        late.is_empty(),
        "UDP datagrams delivered after the change was in force (seconds after): {late:?}"
    );
    (after, ttls)
}

#[test]
fn a_policy_change_reaches_a_live_flow_at_once() {
    let t = Topology::new();
    let pins = Pins::new("cache");
    let dir = std::env::temp_dir().join(format!("pw-bpf-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("c.yaml");
    let write = |blocked: &[&str], extra: bool| {
        // Written whole and renamed: the agent never reads half a file.
        let tmp = dir.join("c.tmp");
        std::fs::write(&tmp, blocked_policy(blocked, extra)).unwrap();
        std::fs::rename(&tmp, &f).unwrap();
    };
    write(&["10.20.9.9"], false);
    let _agent = bpf_agent(&t.gateway, &pins, &dir, 20);
    let mut up = false;
    for _ in 0..100 {
        if pins.0.join("links/tc-liqo-tunnel").exists()
            && ping(&t.consumer, "10.10.1.67", "10.20.1.2")
        {
            up = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(up, "the agent enforces the first policy");
    let slot = active_slot(&pins);
    // In place: one set element added to the live slot.
    let (e, _) = live_flow_across(&t, &pins, || write(&["10.20.9.9", "10.20.1.2"], false));
    assert_eq!(u64::from(e & 1), slot, "a set element is written in place");
    write(&["10.20.9.9"], false);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "allowed again"
    );
    // Through the other slot: a rule added.
    let (e, ttls) = live_flow_across(&t, &pins, || write(&["10.20.9.9"], true));
    assert_eq!(u64::from(e & 1), slot ^ 1, "a new rule switches slots");
    // Seconds after the first cached verdict, the datapath has measured HZ.
    if let Some(hz) = kernel_hz() {
        assert!(
            ttls.iter().any(|t| u64::from(*t) + 2 >= hz),
            "verdicts served for one second of jiffies at HZ {hz}: {ttls:?}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Every entry of a pinned map, as comparable text.
fn entries(pins: &Pins, map: &str) -> std::collections::BTreeSet<String> {
    let path = format!("{}/{map}", pins.arg());
    bpftool_json(&["map", "dump", "pinned", &path])
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|e| e.to_string())
        .collect()
}

/// The controller's configuration with 3000 offloaded pods in AddressSet slices, through an
/// agent on the bpf backend: a pod joining one slice changes exactly one entry of the pinned
/// maps of the live slot (its host entry; nothing else is rewritten, no slot switch), and its
/// packets pass.
#[test]
fn a_slice_change_touches_only_its_entries() {
    use peerwall::protection;
    let t = Topology::new();
    let pins = Pins::new("slices");
    let dir = std::env::temp_dir().join(format!("pw-bpf-slices-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (peer, opts, sets) = sliced_peer();
    let write = |name: &str, v: serde_json::Value| {
        let tmp = dir.join(".tmp");
        std::fs::write(&tmp, v.to_string()).unwrap();
        std::fs::rename(&tmp, dir.join(format!("{name}.yaml"))).unwrap();
    };
    write(
        "gateway",
        protection::gateway_object(&peer, &Default::default(), &opts),
    );
    let slices = protection::peer_slices(&sets, &opts);
    for s in &slices {
        write(&s.name, protection::address_set_object(&peer, s));
    }
    let _agent = bpf_agent(&t.gateway, &pins, &dir, 20);
    let mut up = false;
    for _ in 0..200 {
        if pins.0.join("links/tc-liqo-tunnel").exists()
            && ping(&t.consumer, "10.10.1.67", "10.20.1.2")
        {
            up = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(up, "the agent enforces the sliced policy");
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.3.1"),
        "not offloaded"
    );
    let slot = active_slot(&pins);
    let maps = [
        format!("DSTH{slot}"),
        format!("DST{slot}"),
        format!("SRCH{slot}"),
        format!("SRC{slot}"),
    ];
    let before: Vec<_> = maps.iter().map(|m| entries(&pins, m)).collect();
    assert!(before[0].len() >= 3001, "one host entry per pod");
    let mut next = sets.offloaded.clone();
    next.insert("10.20.3.1".parse().unwrap());
    let changed = protection::layout("offloaded", &slices, &next);
    assert_eq!(changed.len(), 1);
    write(
        &changed[0].name,
        protection::address_set_object(&peer, &changed[0]),
    );
    let mut passed = false;
    for _ in 0..100 {
        if ping(&t.consumer, "10.10.1.67", "10.20.3.1") {
            passed = true;
            break;
        }
    }
    assert!(passed, "the new pod passes");
    assert_eq!(active_slot(&pins), slot, "in place, no slot switch");
    let after: Vec<_> = maps.iter().map(|m| entries(&pins, m)).collect();
    let added: Vec<_> = after[0].difference(&before[0]).collect();
    assert_eq!(added.len(), 1, "one host entry added: {added:?}");
    assert!(before[0].is_subset(&after[0]), "no host entry changed");
    for i in 1..maps.len() {
        assert_eq!(before[i], after[i], "{} untouched", maps[i]);
    }
    std::fs::remove_dir_all(&dir).ok();
}
