//! The bpf backend against real kernels: programs attached with tcx (and XDP) to interfaces
//! named like Liqo's, real packets through veth pairs and a real WireGuard tunnel
//! (wireguard-go), maps readable with bpftool, enforcement surviving the agent's exit and a
//! restart, the emergency switch, and the verifier at the largest policy size. What invalidates
//! the datapath's caches is `invalidation.rs`.

use std::process::{Child, Command, Stdio};

use peerwall_backend_bpf::loader::Datapath;
use peerwall_backend_bpf::maps::Iface;
use peerwall_testkit::bpf::*;
use peerwall_testkit::prelude::*;

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
    // An Ethernet device (the veth named like Geneve's) runs the entry of every device type,
    // which reads its 14-byte header length from the kernel (the WireGuard test: 0).
    assert_eq!(
        linked_program(&pins.0, "tc-liqo:abcdefghij"),
        "peerwall_tc_any"
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
    // Its description (bytes 8..12: `constrained`) tells the datapath which lookups it makes:
    // both addresses tested, each a host, so neither trie is looked up.
    let info = chains
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["value"][0] != "0x00")
        .unwrap();
    let byte = |i: usize| {
        u8::from_str_radix(
            info["value"][i].as_str().unwrap().trim_start_matches("0x"),
            16,
        )
        .unwrap()
    };
    let constrained = u32::from_le_bytes([byte(8), byte(9), byte(10), byte(11)]);
    {
        use peerwall_common::constrained as c;
        assert_eq!(
            constrained & (c::SRC | c::DST | c::SRC_NO_HOSTS | c::DST_NO_HOSTS),
            c::SRC | c::DST,
            "{info}"
        );
        assert_eq!(
            constrained & (c::SRC_NO_PREFIXES | c::DST_NO_PREFIXES),
            c::SRC_NO_PREFIXES | c::DST_NO_PREFIXES,
            "no trie lookup: {info}"
        );
    }
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
    let before = counted(&pins, slot, 0);
    assert!(before >= 1);
    // The same policy applied again by a new process: the live slot already holds it (its
    // recorded digest), so nothing switches and the counters go on (as nftables keeps its).
    apply_bpf(&t.gateway, &pins, &[], &repo("examples/thesis-block.yaml"));
    assert_eq!(
        active_slot(&pins),
        slot,
        "an identical policy switches nothing"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "still enforced"
    );
    assert!(
        counted(&pins, slot, 0) > before,
        "the counter goes on from {before}"
    );
    // `peerwall inspect` decodes the same pins, with names.
    let v = inspect_json(&t.gateway, &pins);
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
    // The kernel memory it reports is what bpftool says of each pinned map.
    let (mut bytes, mut maps) = (0u64, 0u64);
    for e in std::fs::read_dir(&pins.0).unwrap().flatten() {
        if !e.file_type().unwrap().is_file() {
            continue;
        }
        let o = std::process::Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(e.path())
            .output()
            .unwrap();
        if !o.status.success() {
            continue; // a pinned program or link
        }
        let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        bytes += m["bytes_memlock"].as_u64().unwrap();
        maps += 1;
    }
    assert!(bytes > 0 && maps > 10, "{bytes} bytes in {maps} maps");
    assert_eq!(
        (v["memory"]["bytes"].as_u64(), v["memory"]["maps"].as_u64()),
        (Some(bytes), Some(maps)),
        "{}",
        v["memory"]
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

/// An upgrade over pins of a peerwall whose cached verdicts and table of new flows had another
/// layout: the load replaces them (the verifier would refuse the new program's accesses to
/// them) and keeps everything else pinned.
/// A gateway that tracks connections as a Liqo gateway does (a NAT rule) holds at most 16 MiB
/// of pinned kernel memory with the default sizes, and a policy with more hosts than the
/// exact-match maps hold still decides every one of them: the hosts past the capacity are
/// looked up in the trie.
#[test]
fn a_gateway_holds_16_mib_and_hosts_past_the_host_table_still_match() {
    let t = Topology::new();
    track_connections(&t.gateway);
    // One more provider pod, 10.20.5.5.
    ip(&t.provider, &["addr", "add", "10.20.5.5/32", "dev", "eth0"]);
    // 1023 hosts in 10.0.0.0/16 (odd addresses: no two merge into a prefix) sort before the
    // provider pods: with room for 1024, 10.20.1.2 is the last host in the exact-match map and
    // 10.20.5.5 (and 100 more) go to the trie.
    let mut elements: Vec<String> = (0..1023u32)
        .map(|i| format!("10.0.{}.{}", i / 128, 2 * (i % 128) + 1))
        .collect();
    elements.extend(["10.20.1.2".to_string(), "10.20.5.5".to_string()]);
    elements.extend((0..100u32).map(|i| format!("10.30.0.{}", 2 * i + 1)));
    let yaml = format!(
        r#"apiVersion: peerwall.io/v1alpha1
kind: FirewallConfiguration
metadata: {{name: many-hosts, namespace: liqo-tenant-cluster1}}
spec:
  table:
    name: peerwall_cluster1
    family: INET
    sets:
      - name: offloaded
        keyType: ipv4_addr
        elements: [{}]
    chains:
      - name: from_consumer
        type: filter
        hook: forward
        priority: 0
        policy: accept
        rules:
          filterRules:
            - name: to_offloaded_pods
              action: accept
              match:
                - {{op: eq, dev: {{value: liqo-tunnel, position: in}}}}
                - {{op: eq, ip: {{value: "@offloaded", position: dst}}}}
            - name: default_deny
              action: drop
              match:
                - {{op: eq, dev: {{value: liqo-tunnel, position: in}}}}
"#,
        elements
            .iter()
            .map(|e| format!("{{key: {e}}}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let file = std::env::temp_dir().join(format!("pw-many-hosts-{}.yaml", std::process::id()));
    std::fs::write(&file, yaml).unwrap();
    let pins = Pins::new("hosts");
    let extra = ["--bpf-conntrack", "auto", "--host-table-size", "1024"];
    let out = apply_bpf_said(&t.gateway, &pins, &extra, &file);
    assert!(
        out.contains("the policy has 1125 destination hosts and the host maps hold 1024"),
        "{out}"
    );
    // In the exact-match map, past it (in the trie), and outside the set.
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "a host in DSTH"
    );
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.5.5"),
        "a host in the trie"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "outside the set"
    );
    let v = inspect_json(&t.gateway, &pins);
    let slot = v["active_slot"].as_u64().unwrap();
    let dsth = live_dsth(&v);
    assert_eq!(
        (dsth["hosts"].as_u64(), dsth["capacity"].as_u64()),
        (Some(1024), Some(1024))
    );
    // Its one-line table: one line per 16 hosts of the capacity, three slots each, so of 1024
    // hosts only 192 would have a slot: the table stays off, and every lookup asks the host
    // map (as the pings above did).
    let lines = &dsth["lines"];
    assert_eq!(
        (lines["on"].as_bool(), lines["hosts"].as_u64()),
        (Some(false), Some(0)),
        "{dsth}"
    );
    let trie = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e[0] == format!("DST{slot}"))
        .cloned()
        .unwrap();
    assert_eq!(
        trie[1], 101,
        "the hosts past the map are in the trie: {trie}"
    );
    let text = peerwall_net(&t.gateway, &["inspect", "--pin-dir", pins.arg()]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!(
            "hosts DSTH{slot} is full (1024 hosts, --host-table-size)"
        )),
        "{text}"
    );
    assert!(
        text.contains("conntrack IPv4 TCP and UDP: the kernel's table"),
        "{text}"
    );
    assert!(
        text.contains(&format!("host-lines DSTH{slot}: off")),
        "{text}"
    );
    // The default sizes on a gateway that tracks connections.
    ok(peerwall_net(
        &t.gateway,
        &["delete", "--backend", "bpf", "--pin-dir", pins.arg()],
    ));
    let default = Pins::new("hosts-default");
    apply_bpf(&t.gateway, &default, &["--bpf-conntrack", "auto"], &file);
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.5.5"),
        "default sizes"
    );
    let v = inspect_json(&t.gateway, &default);
    // With the default sizes, the one-line table is on and holds the IPv4 hosts but those of
    // an overflowed line's fourth slot and past.
    let dsth = live_dsth(&v);
    let lines = &dsth["lines"];
    assert_eq!(
        (lines["on"].as_bool(), lines["lines"].as_u64()),
        (Some(true), Some(4096)),
        "{dsth}"
    );
    let (held, overflowed) = (
        lines["hosts"].as_u64().unwrap(),
        lines["overflowed"].as_u64().unwrap(),
    );
    assert!(
        held <= 1125 && held + 3 * overflowed >= 1125 - overflowed && held > 1100,
        "{dsth}"
    );
    let bytes = v["memory"]["bytes"].as_u64().unwrap();
    let text = peerwall_net(&t.gateway, &["inspect", "--pin-dir", default.arg()]);
    let text = String::from_utf8_lossy(&text.stdout);
    // docs/ebpf.md quotes this line.
    eprintln!(
        "{}",
        text.lines()
            .find(|l| l.starts_with("kernel memory"))
            .unwrap_or("")
    );
    assert!(bytes <= 16 << 20, "{}", v["memory"]);
    let _ = std::fs::remove_file(&file);
}

/// A load turns the one-line host tables off before any program it loads can run (a table an
/// older peerwall left pinned could be stale against host maps it changed), and an apply of the
/// contents the live slot already holds (a restarted agent's first) writes them whole and
/// turns them on again; the policy holds throughout.
#[test]
fn a_load_turns_the_host_lines_off_until_it_writes_them() {
    let t = Topology::new();
    let pins = Pins::new("lines-off");
    let file = repo("examples/provider-protection.yaml");
    apply_bpf(&t.gateway, &pins, &[], &file);
    let on = || live_dsth(&inspect_json(&t.gateway, &pins))["lines"]["on"].as_bool();
    assert_eq!(on(), Some(true), "written and on");
    let b = Datapath::load(&pins.0).expect("load over the pins");
    assert_eq!(on(), Some(false), "turned off by the load");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2")
            && !ping(&t.consumer, "10.10.1.67", "10.20.9.9"),
        "the policy holds while the tables are off"
    );
    drop(b);
    apply_bpf(&t.gateway, &pins, &[], &file);
    assert_eq!(on(), Some(true), "on again after the same contents' apply");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2")
            && !ping(&t.consumer, "10.10.1.67", "10.20.9.9"),
        "the policy holds with the tables on"
    );
}

/// `peerwall inspect --output json`'s entry of the live slot's destination host map.
fn live_dsth(v: &serde_json::Value) -> serde_json::Value {
    let slot = v["active_slot"].as_u64().unwrap();
    v["host_maps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == format!("DSTH{slot}"))
        .cloned()
        .unwrap()
}

/// The datapath as the agent holds it open costs the kernel what its pins say, give or take
/// its per-CPU scratch: no table of the object outside the pins (the benchmarks' baselines
/// are one entry each; at their full size one preallocated hash alone held 80 MiB per gateway
/// for as long as the agent ran, which `peerwall inspect` could not see).
#[test]
fn the_open_datapath_holds_no_memory_beyond_its_pins() {
    let pins = Pins::new("held");
    let mut b = Datapath::load(&pins.0).expect("load");
    b.tc_program().expect("the program verifies");
    let held = b.memory();
    let pinned = peerwall_backend_bpf::memory::pinned_memory(&pins.0).expect("pins");
    assert!(
        pinned.bytes > 0 && held.bytes >= pinned.bytes,
        "{held:?} {pinned:?}"
    );
    assert!(
        held.bytes - pinned.bytes <= 1 << 20,
        "maps held open beyond the pins: {held:?} against pinned {pinned:?}"
    );
}

/// Where spares are kept (the gateway-pod mode), a gateway's load after another's takes the
/// datapath made ready ahead: its maps come pinned under the gateway's own directory, none are
/// left pinned where the spare was made, and it enforces like any other.
#[test]
fn a_new_gateway_takes_the_spare_datapath_and_enforces() {
    use peerwall_backend_bpf::loader;
    use peerwall_backend_select::{BackendKind, Settings};
    let t = Topology::new();
    // Dropped in reverse order: the gateways' pins, then the directories holding them.
    let (gateways, spares) = (Pins::new("gateways"), Pins::new("spares"));
    let (a, b) = (Pins(gateways.0.join("a")), Pins(gateways.0.join("b")));
    peerwall_backend_select::keep_spare_datapaths(&spares.0, &gateways.0).expect("spares");
    let settings = |pins: &Pins, ifaces: &[&str]| Settings {
        pin_dir: pins.0.clone(),
        interfaces: ifaces.iter().map(ToString::to_string).collect(),
        ..Settings::new(BackendKind::Bpf)
    };
    // The first gateway loads its own; a spare is made once no load runs.
    let taken = loader::spares_taken();
    let _first = peerwall_backend_select::open(&settings(&a, &["pwt-none"]), None).expect("a");
    assert_eq!(loader::spares_taken(), taken, "nothing to take yet");
    assert!(poll(60, loader::spare_ready), "a spare is made");
    let left: Vec<_> = std::fs::read_dir(&spares.0)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "a spare pins nothing: {left:?}");
    // The next gateway, in its pod's namespace, takes it.
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "baseline");
    let mut second = peerwall_backend_select::open(
        &settings(&b, &["liqo-tunnel", "liqo.*"]),
        Some(t.gateway.name()),
    )
    .expect("b");
    assert_eq!(
        loader::spares_taken(),
        taken + 1,
        "the second load took the spare"
    );
    let id = |p: &Pins| {
        bpftool_json(&["map", "show", "pinned", &format!("{}/CONFIG", p.arg())])["id"].clone()
    };
    assert!(
        id(&b).is_u64() && id(&a) != id(&b),
        "maps of its own: {} {}",
        id(&a),
        id(&b)
    );
    let yaml = std::fs::read_to_string(repo("examples/thesis-block.yaml")).unwrap();
    let objs = peerwall_intent::load::parse_documents(&yaml, "thesis").unwrap();
    let policy = peerwall_policy::compile::compile(&objs).unwrap().policy;
    second.apply(&policy).expect("apply");
    assert_thesis_block_enforced(&t.consumer);
    let v = inspect_json(&t.gateway, &b);
    assert!(
        v["attached"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "tc:liqo-tunnel"),
        "{v}"
    );
    // And the next spare is made for the gateway after it.
    assert!(poll(60, loader::spare_ready), "the next spare is made");
}

/// The rule counters hold what the policy has (one per rule and per chain policy, chains one
/// after another), and a policy with more than the table holds is still enforced in full:
/// the rules past it are not counted, and `apply` and `inspect` say so.
#[test]
fn rules_past_the_counter_table_are_enforced_and_reported_not_counted() {
    let t = Topology::new();
    // 100 rules; rule 5 drops 10.20.1.3, rule 90 (past a table of 64) drops 10.20.1.2.
    let rules: String = (0..100u32)
        .map(|i| {
            let dst = match i {
                5 => "10.20.1.3".to_string(),
                90 => "10.20.1.2".to_string(),
                _ => format!("10.99.0.{i}"),
            };
            format!(
                "            - {{name: r{i}, action: drop, match: [{{op: eq, ip: {{value: {dst}, position: dst}}}}]}}\n"
            )
        })
        .collect();
    // A chain of one rule: its counters come first (chains are numbered in name order: 0, and
    // its policy at 1), the long chain's after them (rule r at 2 + r), so the table of 64 ends
    // at its rule 61.
    let yaml = format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: counted, namespace: liqo-tenant-cluster1}}\nspec:\n  table:\n    name: t\n    family: IPV4\n    chains:\n      - name: early\n        type: filter\n        hook: forward\n        priority: -10\n        policy: accept\n        rules:\n          filterRules:\n            - {{name: seen, action: accept, match: [{{op: eq, ip: {{value: 10.20.3.1, position: dst}}}}]}}\n      - name: long\n        type: filter\n        hook: forward\n        priority: 0\n        policy: accept\n        rules:\n          filterRules:\n{rules}"
    );
    let file = std::env::temp_dir().join(format!("pw-counted-{}.yaml", std::process::id()));
    std::fs::write(&file, yaml).unwrap();
    let pins = Pins::new("counted");
    let out = apply_bpf_said(&t.gateway, &pins, &["--counter-table-size", "64"], &file);
    assert!(
        out.contains("the policy has 103 counters (a rule or chain policy each) and the counter table holds 64"),
        "{out}"
    );
    // Both drops hold, counted or not; the rest passes.
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.3"), "rule 5");
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "rule 90");
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.3.1"), "the policy");
    let v = inspect_json(&t.gateway, &pins);
    let chain = |name: &str| {
        v["chains"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == format!("t/{name}"))
            .cloned()
            .unwrap()
    };
    let early = chain("early");
    assert!(
        early["rules"][0]["packets"].as_u64().unwrap() >= 1,
        "{early}"
    );
    assert!(early["policy_packets"].as_u64().unwrap() >= 1, "{early}");
    let c = chain("long");
    let rules = &c["rules"];
    assert!(rules[5]["packets"].as_u64().unwrap() >= 1, "{}", rules[5]);
    assert_eq!(rules[61]["packets"], 0, "{}", rules[61]);
    assert!(rules[62]["packets"].is_null(), "{}", rules[62]);
    assert!(rules[90]["packets"].is_null(), "{}", rules[90]);
    assert!(c["policy_packets"].is_null(), "{c}");
    let text = peerwall_net(&t.gateway, &["inspect", "--pin-dir", pins.arg()]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains(" r90 ") && l.contains("not counted (past the counter table")),
        "{text}"
    );
    // The kernel's maps: 64 counters per slot, whatever the CPUs.
    let slot = v["active_slot"].as_u64().unwrap();
    let m = bpftool_json(&[
        "map",
        "show",
        "pinned",
        &format!("{}/COUNTERS{slot}", pins.arg()),
    ]);
    assert_eq!(m["max_entries"], 64, "{m}");
    let _ = std::fs::remove_file(&file);
}

#[test]
fn upgrade_replaces_verdict_caches_of_an_older_layout() {
    require_root();
    let pins = Pins::new("upgrade");
    std::fs::create_dir_all(&pins.0).expect("pin dir");
    // A verdict cache of an older layout (32-byte verdicts), the table of flows not replied
    // yet as releases before the array pinned it (an LRU hash of flow keys, 40 bytes, to
    // states, 16), and conntrack's FLOW_SEEN as releases before its entries of 32 stamps
    // pinned it (an array of 131072 single u16 stamps).
    for (name, kind, key, value, entries) in [
        ("VERDICTS4", "lru_hash", "16", "32", "1024"),
        ("FLOWS_NEW", "lru_hash", "40", "16", "1024"),
        ("FLOW_SEEN", "array", "4", "2", "131072"),
    ] {
        let path = pins.0.join(name);
        let made = sh(
            "bpftool",
            &[
                "map",
                "create",
                path.to_str().unwrap_or_default(),
                "type",
                kind,
                "key",
                key,
                "value",
                value,
                "entries",
                entries,
                "name",
                name,
            ],
        );
        assert!(made.status.success(), "bpftool map create {name}: {made:?}");
    }
    let show =
        |name: &str| bpftool_json(&["map", "show", "pinned", &format!("{}/{name}", pins.arg())]);
    let value_size = |name: &str| show(name)["bytes_value"].as_u64();
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
    let flows_new = show("FLOWS_NEW");
    assert_eq!(
        (
            flows_new["type"].as_str(),
            flows_new["bytes_value"].as_u64(),
            flows_new["max_entries"].as_u64()
        ),
        (
            Some("array"),
            Some(64),
            Some(u64::from(peerwall_common::NEW_FLOW_SLOTS))
        ),
        "the old FLOWS_NEW is replaced by this release's direct-mapped table: {flows_new}"
    );
    let seen = show("FLOW_SEEN");
    assert_eq!(
        (seen["bytes_value"].as_u64(), seen["max_entries"].as_u64()),
        (Some(64), Some(u64::from(peerwall_common::FLOW_SEEN_LINES))),
        "the old FLOW_SEEN is replaced by entries of 32 stamps: {seen}"
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
    // The same policy again: no switch.
    let slot = active_slot(&pins);
    apply_bpf(&t.gateway, &pins, &["--xdp"], &f);
    assert_eq!(
        active_slot(&pins),
        slot,
        "an identical policy switches nothing"
    );
    // The pins removed by hand (the digest of the live slot's contents stays in /run) and
    // the same policy applied: new maps, which the old digest does not describe, are written
    // and enforce (a digest not bound to its maps would leave them empty).
    let digest = peerwall_backend_bpf::meta::digest_path(&pins.0, slot as u32);
    assert!(digest.exists(), "{}", digest.display());
    // 10.20.3.2: a provider pod nobody offloaded.
    ip(&t.provider, &["addr", "add", "10.20.3.2/32", "dev", "eth0"]);
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.3.2"),
        "not offloaded"
    );
    std::fs::remove_dir_all(&pins.0).unwrap();
    assert!(digest.exists(), "the digest outlives the pins");
    assert!(
        poll(5, || ping(&t.consumer, "10.10.1.67", "10.20.3.2")),
        "detached: {:?}",
        sh("bpftool", &["net", "list"])
    );
    apply_bpf(&t.gateway, &pins, &["--xdp"], &f);
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.3.2"),
        "default deny holds over new pins"
    );
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "the offloaded pod over new pins"
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
    // liqo-tunnel is an L3 (no Ethernet header) device: the entry attached to it, the one
    // of every device type, reads the IP header at offset 0 (the kernel's `mac_len`).
    assert_eq!(
        linked_program(&pins.0, &format!("tc-{TUNNEL}")),
        "peerwall_tc_any"
    );
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
    // Every gateway verifies its programs when it starts (50 on a node verify 100 programs),
    // so the verifier's work is bounded here, in the instructions it walked (deterministic,
    // unlike its time): the datapath's bulk is in global functions, each checked once on its
    // own. Walked as static functions, once per call site and caller state, it was 430,000
    // instructions per program (over a second of verification each). 74,712 before the
    // chains' start bitmaps (`START`), 83,254 with them (their branch, array or protocol
    // hash, is walked on both sides in each of the four chain bodies), 70,527 with one
    // classification body per policy slot (each `bpf_loop` with one callback, inlined),
    // 73,246 before the pair-drop cache and 84,333 with it (the chain bodies' check of
    // whether their decision held for every port, and its serving on the known-flow path).
    const VERIFIED_BUDGET: u32 = 85_000;
    let tc = b
        .tc_program()
        .expect("the verifier accepts the tc program")
        .info()
        .unwrap()
        .verified_instruction_count()
        .expect("the kernel reports verified instructions");
    let l3 = b
        .tc_l3_program()
        .expect("the verifier accepts the tc program of L3 devices")
        .info()
        .unwrap()
        .verified_instruction_count()
        .expect("the kernel reports verified instructions");
    assert!(
        tc <= VERIFIED_BUDGET && l3 <= VERIFIED_BUDGET,
        "the verifier walked {tc} (tc) and {l3} (tc, L3) instructions, over {VERIFIED_BUDGET}"
    );
    // This kernel (6.18) offers the cast of the entry for every device type, which is then
    // the one attached: it verifies within the same budget.
    assert!(b.tc_any(), "the entry for every device type is chosen here");
    let any = b
        .tc_any_program()
        .expect("the verifier accepts the tc program of every device type")
        .info()
        .unwrap()
        .verified_instruction_count()
        .expect("the kernel reports verified instructions");
    assert!(
        any <= VERIFIED_BUDGET,
        "the verifier walked {any} instructions of the entry for every device type, over {VERIFIED_BUDGET}"
    );
    // The XDP entry (`--xdp`) too: its call chain has the least room in the 512 bytes the
    // verifier gives a chain of frames together, so inlining a step into a caller shows here
    // first ("combined stack size of 3 calls is 528").
    let xdp = b
        .xdp_program()
        .expect("the verifier accepts the XDP program")
        .info()
        .unwrap()
        .verified_instruction_count()
        .expect("the kernel reports verified instructions");
    assert!(
        xdp <= VERIFIED_BUDGET,
        "the verifier walked {xdp} instructions of the XDP entry, over {VERIFIED_BUDGET}"
    );
    // Each chain runs in an inlined loop, and every map operation calls its map's own code:
    // neither the `bpf_loop` helper (an indirect call per chain) nor the generic map helpers
    // (an indirect call each) survive the verifier's rewrite. Both indirect calls are
    // retpolines where the kernel mitigates Spectre v2. LLVM merging two lookups of different
    // maps into one call, or one `bpf_loop` call choosing between callbacks, shows here.
    for (what, id) in [
        ("tc", b.tc_program().unwrap().info().unwrap().id()),
        ("tc, L3", b.tc_l3_program().unwrap().info().unwrap().id()),
        (
            "tc, every device type",
            b.tc_any_program().unwrap().info().unwrap().id(),
        ),
    ] {
        let xlated = std::process::Command::new("bpftool")
            .args(["prog", "dump", "xlated", "id", &id.to_string()])
            .output()
            .expect("bpftool");
        assert!(
            xlated.status.success(),
            "bpftool prog dump xlated: {xlated:?}"
        );
        let text = String::from_utf8_lossy(&xlated.stdout);
        let calls = |helper: &str| text.matches(&format!("call {helper}#")).count();
        assert!(
            text.matches("call ").count() > 100,
            "the {what} program's translated code lists its calls: {}",
            &text[..text.len().min(2000)]
        );
        for helper in [
            "bpf_loop",
            "bpf_map_lookup_elem",
            "bpf_map_update_elem",
            "bpf_map_delete_elem",
        ] {
            assert_eq!(
                calls(helper),
                0,
                "the {what} program calls the generic {helper} helper"
            );
        }
    }
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

/// A chain's description says which lookups of an address dimension the datapath makes (none
/// in the exact-match map without hosts, none in the trie without prefixes). A set edit that
/// brings a dimension its first entry of a kind is therefore not made in place, where the
/// description would stay: the whole slot is written, and the new prefix matches.
#[test]
fn a_set_edit_bringing_a_dimensions_first_prefix_is_matched() {
    use peerwall_policy::ir::{AddrRange, IpFamily, Packet, SetChange, SetElements};
    let compiled = |elements: &str| {
        let yaml = format!("apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: kinds, namespace: t}}\nspec:\n  table:\n    name: kinds\n    family: INET\n    sets:\n      - {{name: pods, keyType: ipv4_addr, elements: [{elements}]}}\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {{name: to-pods, action: accept, match: [{{op: eq, ip: {{value: '@pods', position: dst}}}}]}}\n");
        let objs = peerwall_intent::load::parse_documents(&yaml, "kinds").unwrap();
        peerwall_policy::compile::compile(&objs).unwrap().policy
    };
    let policy = compiled("{key: 10.20.1.2}");
    let pins = Pins::new("kinds");
    let names = ["liqo.x".to_string()];
    let mut probe =
        peerwall_probe::bpf::BpfProbe::new(&policy, &names, pins.0.parent().unwrap()).unwrap();
    let to = |dst: &str| Packet {
        src: "10.10.1.67".parse().unwrap(),
        dst: dst.parse().unwrap(),
        proto: 6,
        sport: 40000,
        dport: 80,
        iif: Some("liqo.x".into()),
        oif: Some("liqo.x".into()),
        ct_state: peerwall_policy::ir::CtState::New,
    };
    let judge =
        |p: &peerwall_policy::ir::Policy, dst: &str| peerwall_policy::ir::evaluate(p, &to(dst));
    assert_eq!(
        probe.verdict(&to("10.20.1.2")).unwrap(),
        judge(&policy, "10.20.1.2")
    );
    assert_eq!(judge(&policy, "10.20.8.5").rule, None, "not in the set yet");
    // The set gains a /24: the destination dimension's first prefix.
    let next = compiled("{key: 10.20.1.2}, {key: 10.20.8.0/24}");
    let SetElements::Addr(mut set) = policy.tables[0].sets[0].elements.clone() else {
        panic!("an address set");
    };
    let edit = set.insert_range(AddrRange {
        lo: 0x0a14_0800,
        hi: 0x0a14_08ff,
    });
    assert_eq!(next.tables[0].sets[0].elements, SetElements::Addr(set));
    let changes = [SetChange {
        table: "kinds".into(),
        family: next.tables[0].family,
        set: "pods".into(),
        addr_family: IpFamily::V4,
        edit,
    }];
    let dp = probe.datapath();
    let in_place = dp.update_sets(&next, &changes).expect("update");
    assert!(in_place.is_none(), "made in place: {in_place:?}");
    // What the backend then does (`BpfBackend::update_sets`): the whole policy.
    dp.apply(&next, &[]).expect("apply");
    let want = judge(&next, "10.20.8.5");
    assert_eq!(want.rule.as_deref(), Some("to-pods"));
    assert_eq!(probe.verdict(&to("10.20.8.5")).unwrap(), want);
    assert_eq!(
        probe.verdict(&to("10.20.1.2")).unwrap(),
        judge(&next, "10.20.1.2")
    );
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

/// Single ports and ranges share the port trie (`DPORT<s>`): a single port inside a range
/// carries the range's rules too, so the lowest rule still decides. (An exact-match map in
/// front of the trie, as hosts have, measured no faster: `cargo xtask bench` with 1023
/// single-port rules, 223–227 ns per first packet without it, 226–235 with it.)
#[test]
fn single_ports_and_ranges_share_the_port_trie_and_the_lowest_rule_decides() {
    let t = Topology::new();
    let pins = Pins::new("ports");
    let dir = std::env::temp_dir().join(format!("pw-bpf-ports-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("ports.yaml");
    std::fs::write(
        &f,
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: p, namespace: t}\nspec:\n  table:\n    name: ports\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: open-7104, action: accept, match: [{op: eq, port: {value: '7104', position: dst}}]}\n            - {name: no-7000, action: drop, match: [{op: eq, port: {value: '7000', position: dst}}]}\n            - {name: no-7100-7107, action: drop, match: [{op: eq, port: {value: '7100-7107', position: dst}}]}\n",
    )
    .unwrap();
    let ports = [7000u16, 7001, 7103, 7104, 7108];
    let _servers: Vec<Listener> = ports
        .iter()
        .map(|p| Listener::tcp(&t.provider, "10.20.1.2", *p))
        .collect();
    for p in ports {
        assert!(
            tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", p),
            "baseline: port {p}"
        );
    }
    apply_bpf(&t.gateway, &pins, &[], &f);
    let reached: Vec<(u16, bool)> = ports
        .iter()
        .map(|p| (*p, tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", *p)))
        .collect();
    assert_eq!(
        reached,
        vec![
            (7000, false),
            (7001, true),
            (7103, false),
            (7104, true),
            (7108, true)
        ],
        "single port dropped, range dropped, the single port inside the range accepted"
    );
    // The trie holds both single ports (full-length keys: 32 bits of chain, 16 of port) and
    // the range's prefixes, readable with bpftool.
    let slot = active_slot(&pins);
    let trie = bpftool_json(&[
        "map",
        "dump",
        "pinned",
        &format!("{}/DPORT{slot}", pins.arg()),
    ]);
    let byte = |e: &serde_json::Value, i: usize| {
        u8::from_str_radix(e["key"][i].as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
    };
    // LPM key: prefix length (u32, host order), then chain (4 bytes) and port (2, BE).
    let mut singles: Vec<u16> = Vec::new();
    let mut ranges = 0;
    for e in trie.as_array().unwrap() {
        let len = u32::from_ne_bytes([byte(e, 0), byte(e, 1), byte(e, 2), byte(e, 3)]);
        if len == 48 {
            singles.push(u16::from_be_bytes([byte(e, 8), byte(e, 9)]));
        } else {
            ranges += 1;
        }
    }
    singles.sort();
    assert_eq!(singles, vec![7000, 7104], "{trie}");
    assert!(ranges >= 1, "the range's prefixes: {trie}");
    std::fs::remove_dir_all(&dir).ok();
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
    // The agent's start (load, verification) takes seconds on a busy 2-core machine.
    assert!(
        poll(30, || attached("tc-liqo:abcdefghij")),
        "agent attached to the existing Geneve interface"
    );
    // A new provider node joins: a new Geneve interface on the gateway.
    let extra = NetNs::new("pwt-new").unwrap();
    let wire = || {
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
    };
    wire();
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
    // Through the new interface, in one poll: another source passes (the path is live, so a
    // drop is the rule's) while the source the wildcard rule names is dropped.
    wait_until(
        "the wildcard rule in force on the new interface",
        10,
        || ping(&extra, "10.20.9.10", "10.10.1.67") && !ping(&extra, "10.20.9.9", "10.10.1.67"),
    );
    // The interface deleted and created again under its name (a restarted tunnel or node
    // link): the kernel detached the link pinned for the earlier device, whose pin stays.
    // The agent must attach to the new device, not take the pin for enforcement.
    let pin = pins.0.join("links/tc-liqo:newnode123");
    let before = peerwall_backend_bpf::loader::link_state(&pin).unwrap();
    ip(&t.gateway, &["link", "del", "liqo.newnode123"]);
    assert_eq!(
        peerwall_backend_bpf::loader::link_state(&pin)
            .unwrap()
            .ifindex,
        None,
        "the kernel detached the link of the deleted device"
    );
    wire();
    wait_until(
        "the wildcard rule in force on the interface created again",
        10,
        || ping(&extra, "10.20.9.10", "10.10.1.67") && !ping(&extra, "10.20.9.9", "10.10.1.67"),
    );
    let after = peerwall_backend_bpf::loader::link_state(&pin).unwrap();
    assert!(
        after.id != before.id && after.ifindex.is_some(),
        "a new link filters the new device: {before:?} → {after:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The tunnel made again under its name while no agent runs (Liqo's userspace WireGuard makes
/// `liqo-tunnel` anew each time its gateway container starts): the new device has no tc
/// program, and before the guard it forwarded everything from the peer until an agent
/// attached to it. The guard (`inet peerwall-guard`, kernel state that holds without the
/// agent) drops what arrives on it until then, and lets it through once the datapath is
/// attached.
#[test]
fn a_tunnel_made_again_passes_nothing_until_the_datapath_is_attached_to_it() {
    let t = Topology::new();
    let pins = Pins::new("guard");
    let dir = std::env::temp_dir().join(format!("pw-bpf-guard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("p.yaml"),
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: g, namespace: t}\nspec:\n  table:\n    name: guarded\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: not-68, action: drop, match: [{op: eq, dev: {value: liqo-tunnel, position: in}, ip: {value: 10.10.1.68, position: src}}]}\n",
    )
    .unwrap();
    let enforced = || {
        ping(&t.consumer, "10.10.1.67", "10.20.1.2")
            && !ping(&t.consumer, "10.10.1.68", "10.20.1.2")
    };
    let guard = || {
        String::from_utf8_lossy(
            &in_ns(
                &t.gateway,
                "nft",
                &["list", "table", "inet", "peerwall-guard"],
            )
            .stdout,
        )
        .into_owned()
    };
    let ifindex = || {
        let o = in_ns(&t.gateway, "cat", &["/sys/class/net/liqo-tunnel/ifindex"]);
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let mut agent = bpf_agent(&t.gateway, &pins, &dir, 100);
    wait_until("the policy in force on the tunnel", 30, enforced);
    // The guard lets through exactly the interfaces the datapath is attached to (nft names
    // the ifindexes it holds by their devices).
    let first = ifindex();
    // Both attached devices let through (whatever their order) before each pattern's drop.
    let lets_through = |g: &str| {
        let lines: Vec<&str> = g.lines().map(str::trim).collect();
        let accept = lines.iter().position(|l| {
            l.starts_with("iif {")
                && l.contains(" accept")
                && l.contains(r#""liqo-tunnel""#)
                && l.contains(r#""liqo.abcdefghij""#)
        });
        ["liqo-tunnel*", "liqo.*"].iter().all(|p| {
            let drop = lines
                .iter()
                .position(|l| l.starts_with(&format!(r#"iifname "{p}" counter"#)));
            accept.zip(drop).is_some_and(|(a, d)| a < d)
        })
    };
    let g = guard();
    assert!(
        lets_through(&g),
        "the guard lets the attached interfaces through:\n{g}"
    );
    // `peerwall inspect` reads the same from the kernel: each pattern, what it lets through.
    let seen = inspect_json(&t.gateway, &pins)["guard"].clone();
    for p in ["liqo-tunnel*", "liqo.*"] {
        assert!(
            seen.as_array().unwrap().iter().any(|r| r["pattern"] == p
                && r["lets_through"]
                    .as_array()
                    .is_some_and(|l| l.contains(&"liqo-tunnel".into())
                        && l.contains(&"liqo.abcdefghij".into()))),
            "inspect shows {p} letting both devices through: {seen}"
        );
    }
    // Removed behind the agent's back (the gateway pod holds NET_ADMIN in its namespace): put
    // back as drift.
    ok(in_ns(
        &t.gateway,
        "nft",
        &["delete", "table", "inet", "peerwall-guard"],
    ));
    wait_until("the guard put back", 10, || lets_through(&guard()));
    // Changed behind its back, the table left in place: a rule accepting everything before
    // the drop would let every device through. Written again as it was.
    ok(in_ns(
        &t.gateway,
        "nft",
        &[
            "insert",
            "rule",
            "inet",
            "peerwall-guard",
            "guard",
            "accept",
        ],
    ));
    assert!(
        guard().lines().any(|l| l.trim() == "accept"),
        "the accept rule went in:\n{}",
        guard()
    );
    wait_until(
        "the guard written again without the accept rule",
        10,
        || {
            let g = guard();
            lets_through(&g) && !g.lines().any(|l| l.trim() == "accept")
        },
    );
    // The emergency switch lets everything through, the guard goes with it; switched off,
    // the agent puts it back.
    ok(peerwall_in(
        &t.gateway,
        &["allow-all", "on", "--pin-dir", pins.arg()],
    ));
    assert!(guard().is_empty(), "the switch took the guard away");
    let text = peerwall_net(&t.gateway, &["inspect", "--pin-dir", pins.arg()]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("guard ABSENT") && text.contains("emergency switch"),
        "inspect says the guard is away and why:\n{text}"
    );
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        guard().is_empty(),
        "the agent kept the guard away while the switch is on"
    );
    ok(peerwall_in(
        &t.gateway,
        &["allow-all", "off", "--pin-dir", pins.arg()],
    ));
    wait_until("the guard back once the switch is off", 10, || {
        lets_through(&guard())
    });
    // The agent goes (a restart, an upgrade), then Liqo's gateway container restarts and
    // makes the tunnel anew: a new device, a new ifindex, no program on it.
    agent.kill();
    t.make_tunnel_again();
    assert_ne!(ifindex(), first, "the tunnel is a new device");
    // Nothing from the new tunnel is forwarded, the source the policy allows included; the
    // guard's counter shows the packets reached the gateway and were dropped there.
    for src in ["10.10.1.68", "10.10.1.67"] {
        assert!(
            !ping(&t.consumer, src, "10.20.1.2"),
            "{src}: forwarded from a tunnel no datapath filters\n{}",
            guard()
        );
    }
    // The guard holds the old device's ifindex, which no device has now (nft prints it as a
    // number), and dropped the pings.
    let g = guard();
    let holds_old =
        |l: &str| l.contains(&format!(" {first},")) || l.contains(&format!(" {first} "));
    assert!(
        g.lines()
            .any(|l| l.trim().starts_with("iif {") && l.contains(" accept") && holds_old(l))
            && g.lines()
                .any(|l| l.contains(r#"iifname "liqo-tunnel*""#)
                    && !l.contains("counter packets 0 ")),
        "the guard lets the old ifindex through and dropped the pings:\n{g}"
    );
    // As `peerwall inspect` shows it, with no agent running.
    let seen = inspect_json(&t.gateway, &pins)["guard"].clone();
    assert!(
        seen.as_array()
            .unwrap()
            .iter()
            .any(|r| r["pattern"] == "liqo-tunnel*"
                && r["lets_through"]
                    .as_array()
                    .is_some_and(|l| l.contains(&first.as_str().into()))
                && r["dropped"].as_u64().is_some_and(|n| n >= 2)),
        "inspect shows the old ifindex let through and the pings dropped: {seen}"
    );
    // An agent again: attached to the new tunnel, then let through the guard.
    let mut agent = bpf_agent(&t.gateway, &pins, &dir, 100);
    wait_until("the policy in force on the tunnel made again", 30, enforced);
    let g = guard();
    assert!(
        lets_through(&g)
            && !g.contains(&format!(" {first},"))
            && !g.contains(&format!(" {first} ")),
        "the guard lets the new tunnel through, not the old one's ifindex ({first}):\n{g}"
    );
    // The node switched to the nftables backend: its apply deletes the guard in the same
    // transaction as its policy (the guard would drop every tunnel, none attached then).
    agent.kill();
    let o = peerwall_in(
        &t.gateway,
        &[
            "apply",
            "--backend",
            "nftables",
            "-f",
            &dir.join("p.yaml").to_string_lossy(),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("peerwall-guard"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !in_ns(
            &t.gateway,
            "nft",
            &["list", "table", "inet", "peerwall-guard"]
        )
        .status
        .success(),
        "the nftables apply deleted the guard"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Conntrack's shortcut for unknown flows (`FLOW_SEEN`: a packet whose entry is idle is new
/// without a lookup in the flow tables) is armed only while every attached program keeps the
/// entries, and stamps the flows already tracked when it is armed again: an established
/// flow's reply, allowed only as established, passes throughout.
#[test]
fn conntracks_shortcut_is_armed_only_while_every_program_keeps_it() {
    let (t, pins, file) = stateful_gateway("seen");
    let armed = flow_seen_armed;
    // ICMP echo keeps its identifier in the same field both ways: its reply, accepted only as
    // established, must find the request's stamp.
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "the echo reply was dropped: its FLOW_SEEN entry is not the request's"
    );
    let flow = UdpFlow::open(&t, 5000, 7000);
    // Unsolicited, the provider's datagram is new: dropped (the check below can fail).
    assert!(
        !flow.reply_passes("early"),
        "a new flow from the provider passed"
    );
    // The consumer opens the flow; the provider's answers pass from then on.
    flow.start();
    assert!(
        flow.reply_passes("r1"),
        "the reply of an established flow was dropped"
    );
    // The flow's entry (shared by both directions) holds a recent stamp.
    let key = peerwall_backend_bpf::loader::key_of(&peerwall_backend::Flow {
        src: "10.10.1.67".parse().unwrap(),
        dst: "10.20.1.2".parse().unwrap(),
        proto: 17,
        sport: 5000,
        dport: 7000,
    });
    let slot = peerwall_common::flow_seen_slot(&key, peerwall_common::FLOW_SEEN_SLOTS - 1);
    let now = peerwall_common::flow_seen_stamp(clock_monotonic_ns());
    let stamp = seen_entry(&pins, slot);
    assert!(
        now.wrapping_sub(stamp) <= 2,
        "FLOW_SEEN[{slot}] = {stamp}, now {now}"
    );
    // A program of another load (its own FLOW_SEEN) attached through this pin directory, as
    // an older release's adopted link would be: the next apply disarms the shortcut.
    t.gateway
        .veth("liqo.foreign1", &t.gateway, "pwforeign1")
        .expect("veth");
    let other = Pins::new("seen-other");
    apply_bpf(
        &t.gateway,
        &other,
        &["--interfaces", "liqo.foreign1"],
        &file,
    );
    std::fs::rename(
        other.0.join("links/tc-liqo:foreign1"),
        pins.0.join("links/tc-liqo:foreign1"),
    )
    .unwrap();
    apply_bpf(&t.gateway, &pins, &[], &file);
    assert!(!armed(&pins), "armed beside a program that does not stamp");
    assert!(
        flow.reply_passes("r2"),
        "the reply was dropped with the shortcut off"
    );
    // The flow's entry lost (as under a program that does not stamp), the foreign link gone:
    // arming again stamps the tracked flows first, so the reply, first after the verdict
    // cache's second, is still known.
    set_seen_entry(&pins, slot, 0);
    assert_eq!(seen_entry(&pins, slot), 0);
    std::fs::remove_file(pins.0.join("links/tc-liqo:foreign1")).unwrap();
    apply_bpf(&t.gateway, &pins, &[], &file);
    assert!(armed(&pins), "not armed again once every link stamps");
    std::thread::sleep(std::time::Duration::from_millis(1300));
    assert!(
        flow.reply_passes("r3"),
        "the established flow's reply was dropped after the shortcut was armed again"
    );
    let _ = std::fs::remove_file(&file);
}

/// An upgrade over pins whose `FLOW_SEEN` is of another layout (here this release's before
/// its pair stamps: 4096 entries): the load makes a new, empty one, so it disarms the
/// shortcut and withdraws the sweep's vouch (`CT_SWEPT`) before any of its programs attaches.
/// The programs adopted with their links keep their own map, so the shortcut stays off while
/// they run; once this release's programs replace them, arming stamps the flows already
/// tracked, flow and pair, first. An established flow's reply, allowed only as established,
/// passes throughout. (Armed over the empty map, a program of the new object took the
/// reply's idle stamps for a new flow, and a stale vouch had the kernel's connections taken
/// for new ones too.)
#[test]
fn a_flow_seen_of_another_layout_is_stamped_before_the_shortcut_trusts_it() {
    let (t, pins, file) = stateful_gateway("seen-layout");
    let flow = UdpFlow::open(&t, 5001, 7001);
    flow.start();
    assert!(
        flow.reply_passes("r1"),
        "the reply of an established flow was dropped"
    );
    // `FLOW_SEEN` as pinned before its pair stamps, and a sweep's vouch as the kernel-table
    // mode leaves it (until ten minutes from now).
    let seen = pins.0.join("FLOW_SEEN");
    std::fs::remove_file(&seen).unwrap();
    must(
        "bpftool",
        &[
            "map",
            "create",
            seen.to_str().unwrap_or_default(),
            "type",
            "array",
            "key",
            "4",
            "value",
            "64",
            "entries",
            "4096",
            "name",
            "FLOW_SEEN",
            "flags",
            "1024",
        ],
    );
    let until = clock_monotonic_ns() + 600_000_000_000;
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>();
    map_update(
        &pins,
        "CT_SWEPT",
        &hex(&0u32.to_le_bytes()),
        &hex(&until.to_le_bytes()),
    );
    assert!(flow_seen_armed(&pins));
    {
        let mut b = Datapath::load(&pins.0).expect("the new object loads over the old pins");
        assert!(
            !b.flow_seen_armed().unwrap(),
            "the load left the shortcut armed over a FLOW_SEEN it just made"
        );
        assert_eq!(
            b.kernel_swept_until().unwrap(),
            0,
            "the load left a sweep vouching for stamps in the dropped FLOW_SEEN"
        );
    }
    // The apply adopts the running links: their programs keep the dropped map, so the
    // shortcut stays off beside them.
    apply_bpf(&t.gateway, &pins, &[], &file);
    assert!(
        !flow_seen_armed(&pins),
        "armed beside programs of the old map"
    );
    assert!(
        flow.reply_passes("r2"),
        "the reply was dropped after the upgrade"
    );
    // This release's programs replace them (links gone, as when the gateway's interfaces are
    // made again): armed, the tracked flow's stamps, its own and its pair's, in the new map.
    for l in std::fs::read_dir(pins.0.join("links")).unwrap() {
        std::fs::remove_file(l.unwrap().path()).unwrap();
    }
    apply_bpf(&t.gateway, &pins, &[], &file);
    assert!(flow_seen_armed(&pins), "armed once every link stamps");
    let key = peerwall_backend_bpf::loader::key_of(&peerwall_backend::Flow {
        src: "10.10.1.67".parse().unwrap(),
        dst: "10.20.1.2".parse().unwrap(),
        proto: 17,
        sport: 5001,
        dport: 7001,
    });
    let now = peerwall_common::flow_seen_stamp(clock_monotonic_ns());
    for slot in [
        peerwall_common::flow_seen_slot(&key, peerwall_common::FLOW_SEEN_SLOTS - 1),
        peerwall_common::flow_seen_pair_slot(&key),
    ] {
        let stamp = seen_entry(&pins, slot);
        assert!(
            now.wrapping_sub(stamp) <= 2,
            "FLOW_SEEN[{slot}] = {stamp}, now {now}"
        );
    }
    // Past the verdict cache's second: the reply is classified, its state from conntrack.
    std::thread::sleep(std::time::Duration::from_millis(1300));
    assert!(
        flow.reply_passes("r3"),
        "the established flow's reply was dropped once the shortcut was armed again"
    );
    let _ = std::fs::remove_file(&file);
}

/// The bytes of a plain-data kernel struct (no padding: `peerwall_common`'s layouts).
fn bytes_of<T: Copy>(v: &T) -> Vec<String> {
    // SAFETY: `T` is one of peerwall_common's `repr(C)` plain-data map types, read as bytes.
    let b = unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) };
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Write `stamp` into `FLOW_SEEN`'s slot `slot` with bpftool: its entry read, the lane
/// changed, the entry written back (nothing else runs meanwhile in these tests).
fn set_seen_entry(pins: &Pins, slot: u32, stamp: u16) {
    let map = format!("{}/FLOW_SEEN", pins.arg());
    let (line, lane) = peerwall_common::seen_line_of(slot);
    let key: Vec<String> = line.to_le_bytes().iter().map(|b| b.to_string()).collect();
    let mut args = vec!["map", "lookup", "pinned", map.as_str(), "key"];
    args.extend(key.iter().map(String::as_str));
    let mut b = value_bytes(&bpftool_json(&args)["value"]);
    b[2 * lane..2 * lane + 2].copy_from_slice(&stamp.to_le_bytes());
    let value: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    map_update(pins, "FLOW_SEEN", &bytes_of(&line), &value);
}

/// `bpftool map update pinned PINS/MAP key hex K value hex V`.
fn map_update(pins: &Pins, name: &str, key: &[String], value: &[String]) {
    let map = format!("{}/{name}", pins.arg());
    let mut args = vec!["map", "update", "pinned", map.as_str(), "key", "hex"];
    args.extend(key.iter().map(String::as_str));
    args.extend(["value", "hex"]);
    args.extend(value.iter().map(String::as_str));
    must("bpftool", &args);
}

/// A flow conntrack forgot long ago (expired entries of it in both tables, both directions)
/// starts again while its `FLOW_SEEN` entry is idle: the shortcut inserts it without looking,
/// and neither the lookups nor the commit of its reply let the expired entries hide it: the
/// reply, allowed only as established, passes, and again once the verdict cache has expired
/// (the flow moved to the established table).
#[test]
fn a_flow_started_again_past_expired_entries_of_itself_is_known() {
    use peerwall_common::{FlowState, NewFlowSlot};
    let (t, pins, file) = stateful_gateway("stale");
    let flow = peerwall_backend::Flow {
        src: "10.10.1.67".parse().unwrap(),
        dst: "10.20.1.2".parse().unwrap(),
        proto: 17,
        sport: 5001,
        dport: 7001,
    };
    let k = peerwall_backend_bpf::loader::key_of(&flow);
    let r = peerwall_backend_bpf::loader::key_of(&peerwall_backend::Flow {
        src: flow.dst,
        dst: flow.src,
        sport: flow.dport,
        dport: flow.sport,
        ..flow
    });
    // Expired: last seen at boot (1 ns), the lifetime long past.
    let expired = FlowState {
        last_seen_ns: 1,
        replied: 1,
        ended: 0,
        _pad: [0; 6],
    };
    for key in [&k, &r] {
        map_update(&pins, "FLOWS", &bytes_of(key), &bytes_of(&expired));
    }
    let slot = |key: &peerwall_common::FlowKey| {
        peerwall_common::new_flow_slot(key, peerwall_common::NEW_FLOW_SLOTS - 1)
    };
    map_update(
        &pins,
        "FLOWS_NEW",
        &bytes_of(&slot(&r)),
        &bytes_of(&NewFlowSlot {
            key: r,
            _pad: [0; 8],
            state: FlowState {
                replied: 0,
                ..expired
            },
        }),
    );
    // Its FLOW_SEEN entry idle (whatever the machine's uptime).
    let seen = peerwall_common::flow_seen_slot(&k, peerwall_common::FLOW_SEEN_SLOTS - 1);
    let idle =
        peerwall_common::flow_seen_idle_stamp(clock_monotonic_ns(), peerwall_common::FLOW_IDLE_NS);
    set_seen_entry(&pins, seen, idle);
    let flow = UdpFlow::open(&t, 5001, 7001);
    // Expired entries make no flow: the provider's datagram is new, and dropped.
    assert!(
        !flow.reply_passes("early"),
        "an expired flow let a new one in"
    );
    flow.start();
    assert!(
        flow.reply_passes("r1"),
        "the reply was dropped: expired entries hid the flow"
    );
    std::thread::sleep(std::time::Duration::from_millis(1300));
    assert!(
        flow.reply_passes("r2"),
        "the reply past the verdict cache was dropped: the flow was not established"
    );
    let _ = std::fs::remove_file(&file);
}

/// A UDP flow from the consumer (10.10.1.67) to the provider (10.20.1.2) through the gateway,
/// both ends bound.
struct UdpFlow {
    c: std::net::UdpSocket,
    p: std::net::UdpSocket,
    cport: u16,
    pport: u16,
}

impl UdpFlow {
    fn open(t: &Topology, cport: u16, pport: u16) -> Self {
        use std::net::UdpSocket;
        let c = t
            .consumer
            .run_in(move || UdpSocket::bind(("10.10.1.67", cport)))
            .unwrap()
            .unwrap();
        let p = t
            .provider
            .run_in(move || UdpSocket::bind(("10.20.1.2", pport)))
            .unwrap()
            .unwrap();
        for s in [&c, &p] {
            s.set_read_timeout(Some(std::time::Duration::from_millis(500)))
                .unwrap();
        }
        Self { c, p, cport, pport }
    }

    /// The consumer's datagram, which opens the flow; it must reach the provider.
    fn start(&self) {
        let mut buf = [0u8; 16];
        self.c.send_to(b"hello", ("10.20.1.2", self.pport)).unwrap();
        assert!(
            self.p.recv(&mut buf).is_ok(),
            "the consumer's datagram was not forwarded"
        );
    }

    /// Whether the provider's datagram `what`, a reply once the flow started (the policy
    /// accepts it only as established), reaches the consumer.
    fn reply_passes(&self, what: &str) -> bool {
        self.p
            .send_to(what.as_bytes(), ("10.10.1.67", self.cport))
            .unwrap();
        let mut b = [0u8; 16];
        matches!(self.c.recv(&mut b), Ok(n) if &b[..n] == what.as_bytes())
    }
}

/// Whether conntrack's `FLOW_SEEN` shortcut is armed (`CONFIG.flags`).
fn flow_seen_armed(pins: &Pins) -> bool {
    config_flags(pins) & peerwall_common::flags::FLOW_SEEN != 0
}

/// A gateway enforcing [`STATEFUL`] with the bpf backend (`peerwall apply`), its policy file;
/// the shortcut armed after the apply (every link is this object's).
fn stateful_gateway(tag: &str) -> (Topology, Pins, std::path::PathBuf) {
    let t = Topology::new();
    let pins = Pins::new(tag);
    let file = std::env::temp_dir().join(format!("pw-{tag}-{}.yaml", std::process::id()));
    std::fs::write(&file, STATEFUL).unwrap();
    apply_bpf(&t.gateway, &pins, &[], &file);
    assert!(
        flow_seen_armed(&pins),
        "armed after the first apply: every link is this object's"
    );
    (t, pins, file)
}
