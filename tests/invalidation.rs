//! What invalidates the bpf datapath's caches, with live packets through real interfaces.
//!
//! A known flow's packets are served from the verdict cache (`ebpf/src/cache.rs`) without
//! routing, conntrack or chains. Every input of that verdict must reach live flows:
//! - a policy change in place (a set element) or through the other slot, and an AddressSet
//!   slice update (`update_sets`, the controller's path for one pod): at once (a new epoch);
//! - a route change (the output interface a chain tests) and a flow's conntrack entry going
//!   away (evicted or flushed): within the cached verdict's lifetime, at most one second.
//!
//! New flows' paths (forwarded or delivered to the gateway) come from the agent's mirror of the
//! local routing table (`LOCAL`) rather than a FIB lookup: an address added or removed, or a
//! route that makes the mirror inexact, must reach it within the route watcher's reaction.

use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::time::Duration;

use peerwall_testkit::bpf::*;
use peerwall_testkit::prelude::*;

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
    /// pod1 (10.10.1.67, any port) to pod2 (10.20.1.2:7777).
    fn start(t: &Topology) -> Self {
        let rx = t
            .provider
            .run_in(|| UdpSocket::bind(("10.20.1.2", 7777)))
            .expect("provider")
            .expect("bind receiver");
        let tx = t
            .consumer
            .run_in(|| UdpSocket::bind(("10.10.1.67", 0)))
            .expect("consumer")
            .expect("bind sender");
        Self::over(tx, "10.20.1.2:7777".parse().expect("address"), rx)
    }

    /// A datagram from `tx` to `to` every 20 ms; `rx` keeps their arrival times.
    fn over(tx: UdpSocket, to: std::net::SocketAddr, rx: UdpSocket) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        rx.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
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
                let _ = tx.send_to(b"peerwall-cache", to);
                std::thread::sleep(Duration::from_millis(20));
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

/// The kernel's HZ: from its build configuration (`/proc/config.gz`), or else measured, the
/// jiffies of `/proc/timer_list` over one second rounded to the nearest HZ Linux builds with
/// (100, 250, 300, 1000). The checks that use it never silently vanish.
fn kernel_hz() -> u64 {
    let o = sh("sh", &["-c", "zcat /proc/config.gz 2>/dev/null"]);
    let configured = String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("CONFIG_HZ="))
        .and_then(|v| v.trim().parse().ok());
    if let Some(hz) = configured {
        return hz;
    }
    let jiffies = || -> u64 {
        std::fs::read_to_string("/proc/timer_list")
            .expect("neither /proc/config.gz nor /proc/timer_list: no way to know HZ")
            .lines()
            .find_map(|l| l.strip_prefix("jiffies: "))
            .and_then(|v| v.trim().parse().ok())
            .expect("jiffies in /proc/timer_list")
    };
    let (j0, t0) = (jiffies(), std::time::Instant::now());
    std::thread::sleep(Duration::from_secs(1));
    let per_sec = (jiffies() - j0) as f64 / t0.elapsed().as_secs_f64();
    [100u64, 250, 300, 1000]
        .into_iter()
        .min_by(|a, b| {
            (*a as f64 - per_sec)
                .abs()
                .total_cmp(&(*b as f64 - per_sec).abs())
        })
        .unwrap_or(100)
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
    let hz = kernel_hz();
    let hi = hz.saturating_sub(1).max(100) as u16;
    assert!(
        ttls.iter().all(|t| (100..=hi).contains(t)),
        "cached verdicts served for at most one second of jiffies at HZ {hz}: {ttls:?}"
    );
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
    let hz = kernel_hz();
    assert!(
        ttls.iter().any(|t| u64::from(*t) + 2 >= hz),
        "verdicts served for one second of jiffies at HZ {hz}: {ttls:?}"
    );
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

/// The controller's configuration for one peer with 3000 offloaded pods in AddressSet slices,
/// written into a directory a bpf agent reads, as the controller publishes them.
struct Sliced {
    t: Topology,
    pins: Pins,
    dir: std::path::PathBuf,
    peer: peerwall::protection::Peer,
    sets: peerwall::protection::PeerSets,
    slices: Vec<peerwall::protection::Slice>,
    _agent: Proc,
}

impl Sliced {
    /// Write the gateway object and its slices, start the agent, wait until pod2 answers.
    fn start(tag: &str) -> Self {
        use peerwall::protection;
        let t = Topology::new();
        let pins = Pins::new(tag);
        let dir = std::env::temp_dir().join(format!("pw-bpf-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (peer, opts, sets) = sliced_peer();
        write_object(
            &dir,
            "gateway",
            protection::gateway_object(&peer, &Default::default(), &opts),
        );
        let slices = protection::peer_slices(&sets, &opts);
        for s in &slices {
            write_object(&dir, &s.name, protection::address_set_object(&peer, s));
        }
        let agent = bpf_agent(&t.gateway, &pins, &dir, 20);
        let up = poll(10, || {
            pins.0.join("links/tc-liqo-tunnel").exists()
                && ping(&t.consumer, "10.10.1.67", "10.20.1.2")
        });
        assert!(up, "the agent enforces the sliced policy");
        Sliced {
            t,
            pins,
            dir,
            peer,
            sets,
            slices,
            _agent: agent,
        }
    }

    /// Publish the one slice that changes when the offloaded pods become `next`.
    fn publish(&self, next: &std::collections::BTreeSet<std::net::IpAddr>) {
        use peerwall::protection;
        let changed = protection::layout("offloaded", &self.slices, next);
        assert_eq!(changed.len(), 1, "one slice changes");
        write_object(
            &self.dir,
            &changed[0].name,
            protection::address_set_object(&self.peer, &changed[0]),
        );
    }
}

impl Drop for Sliced {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Write an object whole and rename it into `dir`: the agent never reads half a file.
fn write_object(dir: &std::path::Path, name: &str, v: serde_json::Value) {
    let tmp = dir.join(".tmp");
    std::fs::write(&tmp, v.to_string()).unwrap();
    std::fs::rename(&tmp, dir.join(format!("{name}.yaml"))).unwrap();
}

/// A pod joining one slice changes exactly one entry of the pinned maps of the live slot (its
/// host entry; nothing else is rewritten, no slot switch), and its packets pass.
#[test]
fn a_slice_change_touches_only_its_entries() {
    let g = Sliced::start("slices");
    let (t, pins) = (&g.t, &g.pins);
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.3.1"),
        "not offloaded"
    );
    let slot = active_slot(pins);
    let maps = [
        format!("DSTH{slot}"),
        format!("DST{slot}"),
        format!("SRCH{slot}"),
        format!("SRC{slot}"),
    ];
    let before: Vec<_> = maps.iter().map(|m| entries(pins, m)).collect();
    assert!(before[0].len() >= 3001, "one host entry per pod");
    let mut next = g.sets.offloaded.clone();
    next.insert("10.20.3.1".parse().unwrap());
    g.publish(&next);
    let passed = (0..100).any(|_| ping(&t.consumer, "10.10.1.67", "10.20.3.1"));
    assert!(passed, "the new pod passes");
    assert_eq!(active_slot(pins), slot, "in place, no slot switch");
    let after: Vec<_> = maps.iter().map(|m| entries(pins, m)).collect();
    let added: Vec<_> = after[0].difference(&before[0]).collect();
    assert_eq!(added.len(), 1, "one host entry added: {added:?}");
    assert!(before[0].is_subset(&after[0]), "no host entry changed");
    for i in 1..maps.len() {
        assert_eq!(before[i], after[i], "{} untouched", maps[i]);
    }
}

/// The controller's path for one pod that goes away (`update_sets`: its slice written in place
/// on the live slot) stops a live flow to it at once: the cached verdicts of the flow lapse
/// with the new epoch.
#[test]
fn a_pod_leaving_its_slice_stops_a_live_flow_at_once() {
    let g = Sliced::start("slice-leave");
    let slot = active_slot(&g.pins);
    let mut next = g.sets.offloaded.clone();
    next.remove(&"10.20.1.2".parse().unwrap());
    let (e, _) = live_flow_across(&g.t, &g.pins, || g.publish(&next));
    assert_eq!(u64::from(e & 1), slot, "the slice is written in place");
}

/// Arrival times after `t` (seconds after it).
fn after(stamps: &[f64], t: f64) -> Vec<f64> {
    stamps.iter().filter(|&&s| s > t).map(|s| s - t).collect()
}

/// How late a cached verdict may still serve after what invalidates it: its lifetime (at most
/// one second, `ebpf/src/cache.rs`), plus scheduling slack on this 2-core VM.
const CACHE_LIFETIME: f64 = 1.25;

/// A policy whose verdict depends on the route: forwarded packets to pod2 leaving through
/// `liqo.alt` are dropped. The route to pod2 moves to `liqo.alt` under a live UDP flow: the
/// flow stops within a cached verdict's lifetime, while a flow to pod3 moved to the same
/// interface keeps arriving (the new route delivers; what stops pod2's flow is the rule).
#[test]
fn a_route_change_reaches_a_live_flow_within_a_cached_verdicts_lifetime() {
    let t = Topology::new();
    veth(&t.gateway, "liqo.alt", &t.provider, "eth1");
    // pod2's and pod3's addresses live on the provider's eth0; packets for them now also
    // arrive on eth1.
    for k in [
        "net.ipv4.conf.all.rp_filter",
        "net.ipv4.conf.eth1.rp_filter",
    ] {
        t.provider.sysctl(k, "0").expect("sysctl");
    }
    let pins = Pins::new("route");
    let dir = std::env::temp_dir().join(format!("pw-bpf-route-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("route.yaml"),
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: route, namespace: t}\nspec:\n  table:\n    name: route\n    family: IPV4\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: alt, action: drop, match: [{op: eq, dev: {value: liqo.alt, position: out}}, {op: eq, ip: {value: 10.20.1.2, position: dst}}]}\n",
    )
    .unwrap();
    let _agent = bpf_agent(&t.gateway, &pins, &dir, 20);
    let up = poll(10, || {
        pins.0.join("links/tc-liqo-tunnel").exists() && ping(&t.consumer, "10.10.1.67", "10.20.1.2")
    });
    assert!(up, "the agent enforces the policy");
    let pod2 = UdpFlow::start(&t);
    let pod3 = UdpFlow::over(
        t.consumer
            .run_in(|| UdpSocket::bind(("10.10.1.67", 0)))
            .expect("consumer")
            .expect("bind"),
        "10.20.1.3:7777".parse().expect("address"),
        t.provider
            .run_in(|| UdpSocket::bind(("10.20.1.3", 7777)))
            .expect("provider")
            .expect("bind"),
    );
    std::thread::sleep(Duration::from_millis(1200));
    assert!(
        !cached_udp_ttls(&pins).is_empty(),
        "the flows' verdicts are cached"
    );
    let changed = unix_now();
    for pod in ["10.20.1.2/32", "10.20.1.3/32"] {
        ip(&t.gateway, &["route", "add", pod, "dev", "liqo.alt"]);
    }
    std::thread::sleep(Duration::from_millis(2500));
    let (pod2, pod3) = (pod2.finish(), pod3.finish());
    let before = pod2.iter().filter(|&&s| s <= changed).count();
    assert!(before >= 20, "pod2's flow was live: {before} datagrams");
    let late = after(&pod2, changed + CACHE_LIFETIME);
    assert!(
        late.is_empty(),
        "pod2's datagrams through liqo.alt delivered longer than a cached verdict lives (seconds after the change): {:?}",
        after(&pod2, changed)
    );
    let moved = after(&pod3, changed + CACHE_LIFETIME).len();
    assert!(
        moved >= 20,
        "pod3's flow arrives through liqo.alt after the change: {moved} datagrams"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Delete every entry of a pinned map, as a user would with bpftool; an array (`FLOWS_NEW`,
/// direct-mapped) has no entries to delete: its occupied slots are written with zeros.
fn flush(pins: &Pins, map: &str) {
    let path = format!("{}/{map}", pins.arg());
    let array = bpftool_json(&["map", "show", "pinned", &path])["type"] == "array";
    // A key's or value's bytes as bpftool prints them, in hex without the prefix.
    let bytes = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .expect("bytes")
            .iter()
            .map(|b| {
                b.as_str()
                    .unwrap_or("0")
                    .trim_start_matches("0x")
                    .to_string()
            })
            .collect()
    };
    for e in bpftool_json(&["map", "dump", "pinned", &path])
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        let key = bytes(&e["key"]);
        let value = bytes(&e["value"]);
        let zeros = vec!["0".to_string(); value.len()];
        let mut args = vec![
            "map",
            if array { "update" } else { "delete" },
            "pinned",
            path.as_str(),
            "key",
            "hex",
        ];
        args.extend(key.iter().map(String::as_str));
        if array {
            if value.iter().all(|b| b.trim_start_matches('0').is_empty()) {
                continue;
            }
            args.extend(["value", "hex"]);
            args.extend(zeros.iter().map(String::as_str));
        }
        let o = sh("bpftool", &args);
        assert!(
            o.status.success(),
            "bpftool {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// A stateful policy: replies pass as established, new flows only from the tunnel to pod2.
const STATEFUL: &str = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: ct, namespace: t}\nspec:\n  table:\n    name: ct\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {name: replies, action: accept, match: [{op: eq, ctstate: {value: [established, related]}}]}\n            - {name: to_pod2, action: accept, match: [{op: eq, dev: {value: liqo-tunnel, position: in}}, {op: eq, ip: {value: 10.20.1.2, position: dst}}]}\n";

/// pod2 answers a flow pod1 opened with a stream of datagrams, allowed only as established and
/// served from the verdict cache. When the flow's conntrack entry goes away (an LRU eviction;
/// here the entries are deleted with bpftool), the stream stops within a cached verdict's
/// lifetime: its packets, classified again, are new, and pod2 may not open flows.
#[test]
fn a_cached_verdict_does_not_outlive_its_flows_conntrack_entry() {
    let t = Topology::new();
    let pins = Pins::new("ct");
    let dir = std::env::temp_dir().join(format!("pw-bpf-ct-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ct.yaml"), STATEFUL).unwrap();
    // Replies come back through the Geneve-named interface: attach there too.
    let _agent = agent_on_both_links(&t, &pins, &dir);
    let pod2 = t
        .provider
        .run_in(|| UdpSocket::bind(("10.20.1.2", 7777)))
        .expect("provider")
        .expect("bind");
    let pod1 = t
        .consumer
        .run_in(|| UdpSocket::bind(("10.10.1.67", 5555)))
        .expect("consumer")
        .expect("bind");
    for s in [&pod1, &pod2] {
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
    }
    // pod1 opens the flow and pod2 answers, once the agent enforces.
    let mut buf = [0u8; 64];
    let opened = poll(30, || {
        pins.0.join("links/tc-liqo-tunnel").exists()
            && pod1.send_to(b"hello", ("10.20.1.2", 7777)).is_ok()
            && pod2
                .recv_from(&mut buf)
                .is_ok_and(|(_, from)| pod2.send_to(b"reply", from).is_ok())
            && pod1.recv(&mut buf).is_ok()
    });
    assert!(opened, "pod1's flow never got an answer");
    let stream = UdpFlow::over(pod2, "10.10.1.67:5555".parse().expect("address"), pod1);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !cached_udp_ttls(&pins).is_empty(),
        "the answers' verdict is cached"
    );
    flush(&pins, "FLOWS");
    flush(&pins, "FLOWS_NEW");
    let flushed = unix_now();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        entries(&pins, "FLOWS").is_empty(),
        "nothing re-created the flow: pod2's packets are new and dropped"
    );
    let stamps = stream.finish();
    let before = stamps.iter().filter(|&&s| s <= flushed).count();
    assert!(before >= 20, "pod2's answers arrived: {before} datagrams");
    let late = after(&stamps, flushed + CACHE_LIFETIME);
    assert!(
        late.is_empty(),
        "answers delivered longer than a cached verdict lives after their flow's entry went (seconds after): {:?}",
        after(&stamps, flushed)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Until the agent enforces on the tunnel with IPv4 paths from the mirror (asserted).
fn wait_mirrored(pins: &Pins) {
    let up = poll(10, || {
        pins.0.join("links/tc-liqo-tunnel").exists() && mirrored_families(pins) & 1 != 0
    });
    assert!(up, "the agent enforces, IPv4 paths from the mirror");
}

/// A UDP socket bound to `a` in `ns`.
fn bind_udp(ns: &peerwall_netns::NetNs, a: &'static str) -> UdpSocket {
    ns.run_in(move || UdpSocket::bind(a))
        .expect("namespace")
        .expect("bind")
}

/// A `peerwall agent --backend bpf` over the YAML files of `dir`, polling every 20 ms, attached
/// to the tunnel and to the Geneve-named link (what comes back from the provider).
fn agent_on_both_links(t: &Topology, pins: &Pins, dir: &std::path::Path) -> Proc {
    spawn_agent(
        &t.gateway,
        &[
            "--backend".to_string(),
            "bpf".into(),
            "--interval-ms".into(),
            "20".into(),
            "--pin-dir".into(),
            pins.arg().into(),
            "--source".into(),
            format!("dir:{}", dir.display()),
            "--interfaces".into(),
            TUNNEL.into(),
            "--interfaces".into(),
            "liqo.*".into(),
        ],
    )
}

/// `n` datagrams from pod1 to `to`, each from a socket of its own (a new flow: no cached
/// verdict, no conntrack entry), 10 ms apart, sent from CPU 0 (the datapath's per-CPU caches
/// then see all of them); how many `rx` received.
fn new_flows(t: &Topology, to: std::net::SocketAddr, rx: &UdpSocket, n: usize) -> usize {
    new_flows_from(t, "10.10.1.67", to, rx, n)
}

/// [`new_flows`] from the consumer's pod at `from` (10.10.1.67 or 10.10.1.68).
fn new_flows_from(
    t: &Topology,
    from: &'static str,
    to: std::net::SocketAddr,
    rx: &UdpSocket,
    n: usize,
) -> usize {
    t.consumer
        .run_in(move || -> std::io::Result<()> {
            on_cpu(0);
            for _ in 0..n {
                UdpSocket::bind((from, 0))?.send_to(b"peerwall-mirror", to)?;
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(())
        })
        .expect("consumer")
        .expect("send");
    std::thread::sleep(Duration::from_millis(100));
    rx.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 64];
    let mut got = 0;
    while rx.recv(&mut buf).is_ok() {
        got += 1;
    }
    got
}

/// `ROUTES[0].families` (`peerwall_common::routes`): the families whose path the mirror
/// decides now (a lease that has run out counts as none).
fn mirrored_families(pins: &Pins) -> u32 {
    let map = format!("{}/ROUTES", pins.arg());
    let v = bpftool_json(&["map", "lookup", "pinned", &map, "key", "0", "0", "0", "0"]);
    let b = value_bytes(&v["value"]);
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The `LOCAL` key of an IPv4 host address, as bpftool's byte arguments: prefix length
/// 64 + 32 (LE), chain 0, family 4 (BE), the address (16 bytes).
fn local_key(a: [u8; 4]) -> Vec<String> {
    let mut k = vec![96u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4];
    k.extend_from_slice(&a);
    k.resize(4 + 24, 0);
    k.iter().map(u8::to_string).collect()
}

/// How long the route watcher may take to bring the mirror in step with a routing change (it
/// reacts to rtnetlink's notifications; its resync without one is every 5 s), plus scheduling
/// slack on this 2-core VM.
const MIRROR_REACTION: Duration = Duration::from_millis(300);

/// The local-address mirror (`agent/backend/bpf/src/routing`) answers a new flow's path
/// without a FIB lookup. The datapath reads it (an entry written by hand turns a forwarded
/// destination into a local one), an address the gateway takes as its own moves its new
/// flows from the forward hook's chains to the input hook's at once, and back when it goes;
/// a route that makes the mirror inexact (a blackhole) withdraws it.
#[test]
fn a_routing_change_reaches_the_local_address_mirror_at_once() {
    let t = Topology::new();
    let pins = Pins::new("mirror");
    let dir = std::env::temp_dir().join(format!("pw-bpf-mirror-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("mirror.yaml"),
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: mirror, namespace: t}\nspec:\n  table:\n    name: mirror\n    family: IPV4\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: pod2, action: drop, match: [{op: eq, ip: {value: 10.20.1.2, position: dst}}]}\n      - name: in\n        type: filter\n        hook: input\n        policy: accept\n        rules:\n          filterRules:\n            - {name: local9999, action: drop, match: [{op: eq, proto: {value: udp}}, {op: eq, port: {value: '9999', position: dst}}]}\n",
    )
    .unwrap();
    let _agent = bpf_agent(&t.gateway, &pins, &dir, 20);
    wait_mirrored(&pins);
    let bind = bind_udp;
    let pod2 = bind(&t.provider, "10.20.1.2:7777");
    let pod3 = bind(&t.provider, "10.20.1.3:7777");
    let pod3_9999 = bind(&t.provider, "10.20.1.3:9999");
    let to = |a: &str| a.parse::<std::net::SocketAddr>().expect("address");
    assert_eq!(
        new_flows(&t, to("10.20.1.3:7777"), &pod3, 10),
        10,
        "forwarded"
    );
    assert_eq!(
        new_flows(&t, to("10.20.1.3:9999"), &pod3_9999, 10),
        10,
        "forwarded, input chains not run"
    );
    assert_eq!(
        new_flows(&t, to("10.20.1.2:7777"), &pod2, 10),
        0,
        "the forward chain drops pod2's"
    );

    // The datapath reads the mirror: pod3 written in by hand is local to it, so its input
    // chain drops what the kernel would forward.
    let map = format!("{}/LOCAL", pins.arg());
    let key = local_key([10, 20, 1, 3]);
    let mut args = vec!["map", "update", "pinned", map.as_str(), "key"];
    args.extend(key.iter().map(String::as_str));
    args.extend(["value", "1", "0", "0", "0"]);
    ok(sh("bpftool", &args));
    assert_eq!(
        new_flows(&t, to("10.20.1.3:9999"), &pod3_9999, 10),
        0,
        "pod3 taken as local"
    );
    let mut args = vec!["map", "delete", "pinned", map.as_str(), "key"];
    args.extend(key.iter().map(String::as_str));
    ok(sh("bpftool", &args));
    assert_eq!(
        new_flows(&t, to("10.20.1.3:9999"), &pod3_9999, 10),
        10,
        "pod3 forwarded again"
    );

    // pod2's address becomes the gateway's own: its new flows reach the gateway (input path,
    // accepted), no longer the forward chain's drop.
    ip(&t.gateway, &["addr", "add", "10.20.1.2/32", "dev", "lo"]);
    let local = bind(&t.gateway, "10.20.1.2:7777");
    std::thread::sleep(MIRROR_REACTION);
    assert_eq!(
        new_flows(&t, to("10.20.1.2:7777"), &local, 20),
        20,
        "delivered to the gateway"
    );
    let dump = bpftool_json(&["map", "dump", "pinned", &map]);
    let keys: Vec<Vec<u8>> = dump
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| value_bytes(&e["key"]))
        .collect();
    assert!(
        keys.iter()
            .any(|k| k[12..16] == [10, 20, 1, 2] && k[0] == 96),
        "LOCAL holds the new address: {keys:?}"
    );
    ip(&t.gateway, &["addr", "del", "10.20.1.2/32", "dev", "lo"]);
    drop(local);
    std::thread::sleep(MIRROR_REACTION);
    assert_eq!(
        new_flows(&t, to("10.20.1.2:7777"), &pod2, 20),
        0,
        "forwarded, dropped again"
    );
    assert_eq!(
        new_flows(&t, to("10.20.1.3:7777"), &pod3, 10),
        10,
        "pod3 still forwarded"
    );

    // A one-shot `peerwall apply` on the agent's pins leaves the agent's lease and mirror as
    // they are (its own watcher stands by while the lease holds), also when it exits.
    let owner = |pins: &Pins| {
        let map = format!("{}/ROUTES", pins.arg());
        let v = bpftool_json(&["map", "lookup", "pinned", &map, "key", "0", "0", "0", "0"]);
        value_bytes(&v["value"])[4..8].to_vec()
    };
    let held_by = owner(&pins);
    apply_bpf(&t.gateway, &pins, &[], &dir.join("mirror.yaml"));
    assert_eq!(
        mirrored_families(&pins) & 1,
        1,
        "the lease holds through a one-shot apply"
    );
    assert_eq!(owner(&pins), held_by, "held by the agent");
    assert_eq!(
        new_flows(&t, to("10.20.1.2:7777"), &pod2, 10),
        0,
        "still enforced"
    );

    // A blackhole route: destinations the FIB would call unroutable; the mirror withdraws.
    let paths = |pins: &Pins| {
        let o = peerwall_net(&t.gateway, &["inspect", "--pin-dir", pins.arg()]);
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(
        paths(&pins).contains("paths IPv4 from the local-address mirror"),
        "inspect says where paths come from: {}",
        paths(&pins)
    );
    ip(&t.gateway, &["route", "add", "blackhole", "10.99.0.0/16"]);
    assert!(
        poll(2, || mirrored_families(&pins) & 1 == 0),
        "the mirror is withdrawn under a blackhole route"
    );
    assert!(
        paths(&pins).contains("paths IPv4 from the FIB: the routing does not allow the mirror"),
        "{}",
        paths(&pins)
    );
    ip(&t.gateway, &["route", "del", "blackhole", "10.99.0.0/16"]);
    assert!(
        poll(2, || mirrored_families(&pins) & 1 != 0),
        "and back once it goes"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The pairs whose drop the agent's datapath caches (`PAIR_DROPS`, `ebpf/src/cache/pair.rs`:
/// not pinned, found through the program the tunnel's link runs), read with bpftool:
/// (source, destination, protocol) of every way written.
fn pair_drops(pins: &Pins) -> Vec<([u8; 4], [u8; 4], u8)> {
    let link = pins.0.join("links/tc-liqo-tunnel");
    let l = bpftool_json(&["link", "show", "pinned", link.to_str().expect("UTF-8 path")]);
    let prog = l["prog_id"]
        .as_u64()
        .expect("the link's prog_id")
        .to_string();
    let p = bpftool_json(&["prog", "show", "id", prog.as_str()]);
    let map = p["map_ids"]
        .as_array()
        .expect("the program's maps")
        .iter()
        .map(|m| m.as_u64().expect("map id").to_string())
        .find(|m| bpftool_json(&["map", "show", "id", m.as_str()])["name"] == "PAIR_DROPS")
        .expect("the program has PAIR_DROPS");
    let dump = bpftool_json(&["map", "dump", "id", map.as_str()]);
    let mut ways = Vec::new();
    for e in dump.as_array().expect("entries") {
        let v = value_bytes(&e["value"]);
        for w in v.chunks(32) {
            // `PairDrop`: src, dst, epoch, ifindex, until, counters, proto (byte 28).
            if w.len() == 32 && w[28] != 0 {
                let a = |i: usize| [w[i], w[i + 1], w[i + 2], w[i + 3]];
                ways.push((a(0), a(4), w[28]));
            }
        }
    }
    ways
}

/// A policy dropping, in the forward chain, new flows to pod2 and 10.20.3.1 by their address
/// alone and to pod3 by its address and port 7777 (`with_31` false: without 10.20.3.1's
/// rule); replies accepted.
fn pair_policy(with_31: bool) -> String {
    let r31 = if with_31 {
        "            - {name: pod31, action: drop, match: [{op: eq, ip: {value: 10.20.3.1, position: dst}}]}\n"
    } else {
        ""
    };
    format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: pair, namespace: t}}\nspec:\n  table:\n    name: pair\n    family: IPV4\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {{name: replies, action: accept, match: [{{op: eq, ctstate: {{value: [established, related]}}}}]}}\n            - {{name: pod2, action: drop, match: [{{op: eq, ip: {{value: 10.20.1.2, position: dst}}}}]}}\n{r31}            - {{name: pod3-7777, action: drop, match: [{{op: eq, ip: {{value: 10.20.1.3, position: dst}}}}, {{op: eq, proto: {{value: udp}}}}, {{op: eq, port: {{value: '7777', position: dst}}}}]}}\n"
    )
}

/// A flood of new flows towards an address no rule accepts takes its drop from the pair-drop
/// cache (`ebpf/src/cache/pair.rs`): the drop its pair's earlier flows got, where that drop
/// held for every port. What a user would notice if it served more than that:
/// - pod3's new flows to port 7777 are dropped by a rule that tests the port: nothing is
///   cached for the pair, and its new flows to port 9999 right after pass;
/// - pod2's (and 10.20.3.1's) are dropped by its address alone: cached, and every one of them
///   counted in the rule, served or classified;
/// - pod2's address becomes the gateway's own: its new flows are delivered at once;
/// - pod2 opens a flow to pod1: pod1's answer passes, the pair's drop cached just before it
///   (a flow between the two addresses is live);
/// - the policy without 10.20.3.1's rule: its new flows pass at once.
#[test]
fn a_pair_drop_holds_for_every_port_and_yields_to_a_live_flow() {
    let t = Topology::new();
    let pins = Pins::new("pair");
    let dir = std::env::temp_dir().join(format!("pw-bpf-pair-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("pair.yaml"), pair_policy(true)).unwrap();
    // pod2's flow to pod1 comes through the Geneve-named interface: attach there too.
    let _agent = agent_on_both_links(&t, &pins, &dir);
    wait_mirrored(&pins);
    let bind = bind_udp;
    let pod2 = bind(&t.provider, "10.20.1.2:7777");
    let pod3 = bind(&t.provider, "10.20.1.3:7777");
    let pod3_9999 = bind(&t.provider, "10.20.1.3:9999");
    let to = |a: &str| a.parse::<std::net::SocketAddr>().expect("address");
    let pair = |d: [u8; 4]| ([10, 10, 1, 67], d, 17u8);

    // By the port: dropped, not cached for the pair; another port of it passes.
    assert_eq!(new_flows(&t, to("10.20.1.3:7777"), &pod3, 10), 0);
    assert_eq!(
        new_flows(&t, to("10.20.1.3:9999"), &pod3_9999, 10),
        10,
        "the pair's other port passes"
    );
    assert!(
        !pair_drops(&pins).contains(&pair([10, 20, 1, 3])),
        "a drop by a port is not the pair's: {:?}",
        pair_drops(&pins)
    );

    // By the address: dropped, cached, every packet counted.
    assert_eq!(new_flows(&t, to("10.20.1.2:7777"), &pod2, 30), 0);
    assert!(
        pair_drops(&pins).contains(&pair([10, 20, 1, 2])),
        "pod2's drop is the pair's: {:?}",
        pair_drops(&pins)
    );
    let rule = |name: &str| -> u64 {
        let v = inspect_json(&t.gateway, &pins);
        let rules = v["chains"][0]["rules"].as_array().expect("rules").clone();
        let r = rules
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("rule {name} in {rules:?}"));
        r["packets"].as_u64().expect("counted")
    };
    assert_eq!(rule("pod2"), 30, "every drop counted once");

    // pod2's address becomes the gateway's own: new flows to it are delivered at once (the
    // route watcher's reaction), though the pair's forwarded drop is cached.
    // From the consumer's other pod: its pair's drop is decided now, not served from before.
    let other = "10.10.1.68";
    assert_eq!(new_flows_from(&t, other, to("10.20.1.2:7777"), &pod2, 3), 0);
    assert!(pair_drops(&pins).contains(&([10, 10, 1, 68], [10, 20, 1, 2], 17)));
    ip(&t.gateway, &["addr", "add", "10.20.1.2/32", "dev", "lo"]);
    let local = bind(&t.gateway, "10.20.1.2:7777");
    std::thread::sleep(MIRROR_REACTION);
    assert_eq!(
        new_flows_from(&t, other, to("10.20.1.2:7777"), &local, 10),
        10,
        "delivered to the gateway"
    );
    ip(&t.gateway, &["addr", "del", "10.20.1.2/32", "dev", "lo"]);
    drop(local);
    std::thread::sleep(MIRROR_REACTION);

    // pod2 opens a flow to pod1, then pod1's new flows to pod2 are dropped (the pair's drop
    // cached again, on the CPU pod1 sends from): pod1's answer passes.
    let pod1 = bind(&t.consumer, "10.10.1.67:5555");
    pod1.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    pod2.send_to(b"open", "10.10.1.67:5555").expect("send");
    let mut buf = [0u8; 64];
    let (_, from) = pod1
        .recv_from(&mut buf)
        .expect("pod2's datagram reached pod1");
    assert_eq!(new_flows(&t, to("10.20.1.2:7777"), &pod2, 10), 0);
    assert!(pair_drops(&pins).contains(&pair([10, 20, 1, 2])));
    let pod1 = t
        .consumer
        .run_in(move || {
            on_cpu(0);
            pod1.send_to(b"answer", from).map(|_| pod1)
        })
        .expect("consumer")
        .expect("send");
    pod2.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    assert!(
        pod2.recv_from(&mut buf).is_ok(),
        "pod1's answer passed the pair's cached drop"
    );
    drop(pod1);

    // The policy without 10.20.3.1's rule: its new flows pass at once.
    let pod31 = bind(&t.provider, "10.20.3.1:7777");
    assert_eq!(
        new_flows_from(&t, other, to("10.20.3.1:7777"), &pod31, 3),
        0
    );
    assert!(pair_drops(&pins).contains(&([10, 10, 1, 68], [10, 20, 3, 1], 17)));
    let before = epoch(&pins);
    std::fs::write(dir.join("pair.yaml"), pair_policy(false)).unwrap();
    assert!(poll(5, || epoch(&pins) != before), "the new policy is live");
    assert_eq!(
        new_flows_from(&t, other, to("10.20.3.1:7777"), &pod31, 10),
        10,
        "10.20.3.1 accepted at once"
    );
    std::fs::remove_dir_all(&dir).ok();
}
