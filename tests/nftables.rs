//! The nftables backend against real kernels: packets through veth pairs named like Liqo's
//! gateway interfaces, rules visible in `nft list`, atomic updates, ownership, drift repair.

use peerwall_backend_nftables::{Drift, Nft, NftBackend};
use peerwall_policy::compile;
use peerwall_testkit::prelude::*;

fn nft_list(ns: &NetNs, args: &[&str]) -> String {
    let mut full = vec!["nft"];
    full.extend_from_slice(args);
    let o = in_ns(ns, full[0], &full[1..]);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn compile_file(rel: &str) -> peerwall_policy::ir::Policy {
    let objs = peerwall_intent::load::load_paths(&[repo(rel)]).expect("loads");
    compile::compile(&objs).expect("compiles").policy
}

/// `peerwall apply -f` of `yaml` (written to a scratch file named after `name`) in the
/// topology's gateway.
fn apply_yaml(t: &Topology, name: &str, yaml: &str) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!("pw-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join(format!("{name}.yaml"));
    std::fs::write(&f, yaml).unwrap();
    let o = peerwall_in(&t.gateway, &["apply", "-f", f.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    o
}

#[test]
fn thesis_block_drops_pod1_to_pod2_only() {
    let t = Topology::new();
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "baseline connectivity"
    );
    let o = peerwall_in(
        &t.gateway,
        &[
            "apply",
            "-f",
            repo("examples/thesis-block.yaml").to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_thesis_block_enforced(&t.consumer);
    let listing = nft_list(&t.gateway, &["list", "table", "ip", "table_name"]);
    assert!(
        listing.contains("ip saddr 10.10.1.67 ip daddr 10.20.1.2 counter packets 1 "),
        "{listing}"
    );
    assert!(listing.contains("comment \"drop_traffic\""), "{listing}");
    // The counters command reads them back.
    let o = peerwall_in(&t.gateway, &["counters", "--output", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["rule"], "drop_traffic");
    assert_eq!(v[0]["packets"], 1);
    // delete removes our table.
    assert!(peerwall_in(&t.gateway, &["delete"]).status.success());
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    assert!(!nft_list(&t.gateway, &["list", "ruleset"]).contains("table_name"));
}

#[test]
fn provider_protection_default_deny_and_set_updates_in_place() {
    let t = Topology::new();
    let _srv1 = Listener::tcp(&t.provider, "10.20.1.2", 8080);
    let _srv2 = Listener::tcp(&t.provider, "10.20.3.1", 8080);
    let _back = Listener::tcp(&t.consumer, "10.10.1.67", 9090);
    let mut policy = compile_file("examples/provider-protection.yaml");
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    let r = b.apply(&policy).expect("apply");
    assert_eq!(r.recreated, vec!["peerwall_cluster1"]);
    assert_provider_protection(&t);
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    let sets = nft_list(
        &t.gateway,
        &[
            "list",
            "set",
            "inet",
            "peerwall_cluster1",
            "offloaded_cluster1",
        ],
    );
    // Hosts only: a hash set (O(1) lookups), adjacent pods listed one by one.
    assert!(
        sets.contains("10.20.1.2,")
            && sets.contains("10.20.1.3")
            && sets.contains("10.20.2.10")
            && !sets.contains("flags interval"),
        "{sets}"
    );

    // Offload one more pod: only a set element changes, in place.
    let table = &mut policy.tables[0];
    let peerwall_policy::ir::SetElements::Addr(a) = &table.sets[0].elements else {
        panic!()
    };
    let extra = peerwall_policy::ir::AddrSet::from_nets(
        peerwall_policy::ir::IpFamily::V4,
        ["10.20.3.1/32".parse().unwrap()],
    );
    table.sets[0].elements = peerwall_policy::ir::SetElements::Addr(a.union(&extra));
    let r = b.apply(&policy).expect("update");
    assert!(r.recreated.is_empty(), "{r:?}");
    assert_eq!(r.updated, vec!["peerwall_cluster1"]);
    assert_eq!(r.element_changes, 1);
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "newly offloaded pod reachable"
    );
    // Counters survive an in-place update (the table was not recreated).
    let c = b.counters().unwrap();
    let deny = c.iter().find(|c| c.rule == "default_deny").unwrap();
    assert!(deny.packets >= 2, "{c:?}");
    // Nothing to do when nothing changed.
    assert!(!b.apply(&policy).unwrap().changed);
}

#[test]
fn reject_answers_with_port_unreachable() {
    let t = Topology::new();
    let yaml = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: r, namespace: t}\nspec:\n  table:\n    name: rej\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: no-pod2, action: reject, match: [{op: eq, ip: {value: '10.20.1.2, fd20::2', position: dst}}]}\n";
    let o = apply_yaml(&t, "reject", yaml);
    // A list mixing families in one match is refused with its path.
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value: \"10.20.1.2, fd20::2\" mixes IPv4 and IPv6"), "{err}");
    let o = apply_yaml(
        &t,
        "reject",
        &yaml.replace("'10.20.1.2, fd20::2'", "'10.20.1.2, 10.20.1.3'"),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = ping_output(&t.consumer, "10.10.1.67", "10.20.1.3");
    assert!(out.contains("Destination Port Unreachable"), "{out}");
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.3.1"));
    // The two-address list became a named interval set, not two rules.
    let listing = nft_list(&t.gateway, &["list", "table", "inet", "rej"]);
    assert!(listing.contains("ip daddr @__pw_0_0_0"), "{listing}");
    assert_eq!(listing.matches("reject").count(), 1, "{listing}");
}

#[test]
fn ipv6_is_enforced() {
    let t = Topology::new();
    assert!(
        ping(&t.consumer, "fd10::67", "fd20::2"),
        "baseline v6 connectivity"
    );
    let o = apply_yaml(
        &t,
        "v6",
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: v6, namespace: t}\nspec:\n  table:\n    name: six\n    family: IPV6\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: block, action: drop, match: [{op: eq, ip: {value: 'fd10::/64', position: src}, dev: {value: liqo-tunnel, position: in}}]}\n",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!ping(&t.consumer, "fd10::67", "fd20::2"), "v6 dropped");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "v4 untouched by an ip6 table"
    );
}

/// A rule asking two ports to differ (`sport != 80`, `dport != 40000`) accepts only datagrams
/// where both do. nft 1.0.6 joins compares of the adjacent port fields into one compare of
/// the joined field, true when either differs; the backend renders each negated port as the
/// one-value range it is, which nft never joins.
#[test]
fn two_negated_ports_are_each_required() {
    let t = Topology::new();
    let _echo = [5000, 40000].map(|port| udp_echo(&t.provider, "10.20.1.2", port));
    let o = apply_yaml(
        &t,
        "negated",
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: neg, namespace: t}\nspec:\n  table:\n    name: neg\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {name: neither, action: accept, match: [{op: neq, port: {value: '80', position: src}}, {op: neq, port: {value: '40000', position: dst}}]}\n",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let echoed = |sport: u16, dport: u16| {
        // Replies come back from the echo's port to `sport`: neither is 80 or 40000.
        let mut s =
            Session::udp(&t.consumer, "10.10.1.67", sport, "10.20.1.2", dport).expect("socat");
        (0..3).any(|i| s.echoes(&format!("d{i}"), std::time::Duration::from_millis(700)))
    };
    assert!(echoed(81, 5000), "both ports differ: delivered");
    assert!(!echoed(80, 5000), "source port 80: dropped");
    assert!(!echoed(81, 40000), "destination port 40000: dropped");
    let listing = nft_list(&t.gateway, &["list", "table", "inet", "neg"]);
    assert!(
        listing.contains("th sport != 80-80") && listing.contains("th dport != 40000-40000"),
        "{listing}"
    );
    assert!(!listing.contains("@th,0,32"), "{listing}");
}

#[test]
fn bad_input_changes_nothing() {
    let t = Topology::new();
    let good = repo("examples/thesis-block.yaml");
    assert!(
        peerwall_in(&t.gateway, &["apply", "-f", good.to_str().unwrap()])
            .status
            .success()
    );
    let before = nft_list(&t.gateway, &["list", "ruleset"]);
    let dir = std::env::temp_dir().join(format!("pw-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&good)
            .unwrap()
            .replace("10.20.1.2", "10.20.1.300"),
    )
    .unwrap();
    let o = peerwall_in(&t.gateway, &["apply", "-f", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("liqo-tenant-cluster1/block-pod1-pod2: spec.table.chains[0].rules.filterRules[0].match[1].ip.value: \"10.20.1.300\" is not an address, CIDR or range"),
        "{err}"
    );
    assert_eq!(nft_list(&t.gateway, &["list", "ruleset"]), before);
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "last good policy still enforced"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn foreign_tables_are_never_touched() {
    let t = Topology::new();
    let foreign = "table ip table_name {\n chain keep {\n type filter hook forward priority 0; policy accept;\n }\n}\ntable inet other {\n chain c {\n type filter hook input priority 0; policy accept;\n }\n}\n";
    Nft::in_netns(t.gateway.name()).apply_text(foreign).unwrap();
    let before = nft_list(&t.gateway, &["list", "ruleset"]);
    let o = peerwall_in(
        &t.gateway,
        &[
            "apply",
            "-f",
            repo("examples/thesis-block.yaml").to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("table ip table_name exists and is not owned by peerwall"),
        "{err}"
    );
    assert_eq!(nft_list(&t.gateway, &["list", "ruleset"]), before);
    // Our own tables come and go without disturbing the foreign one.
    let o = peerwall_in(
        &t.gateway,
        &[
            "apply",
            "-f",
            repo("examples/provider-protection.yaml").to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(peerwall_in(&t.gateway, &["delete"]).status.success());
    assert_eq!(nft_list(&t.gateway, &["list", "ruleset"]), before);
}

#[test]
fn drift_is_detected_and_repaired() {
    let t = Topology::new();
    let policy = compile_file("examples/thesis-block.yaml");
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    b.apply(&policy).unwrap();
    assert_eq!(b.drift().unwrap(), vec![]);
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    // Counters moving is not drift.
    assert_eq!(b.drift().unwrap(), vec![]);
    // Someone flushes our chain.
    Nft::in_netns(t.gateway.name())
        .apply_text("flush chain ip table_name filter_chain_name\n")
        .unwrap();
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    assert_eq!(
        b.drift().unwrap(),
        vec![Drift::Modified {
            table: "table_name".into()
        }]
    );
    b.repair().unwrap();
    assert_eq!(b.drift().unwrap(), vec![]);
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "repaired");
    // Someone deletes the table.
    Nft::in_netns(t.gateway.name())
        .apply_text("delete table ip table_name\n")
        .unwrap();
    assert_eq!(
        b.drift().unwrap(),
        vec![Drift::Missing {
            table: "table_name".into()
        }]
    );
    b.repair().unwrap();
    assert_eq!(b.drift().unwrap(), vec![]);
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "restored");
}

#[test]
fn the_ruleset_generation_gates_the_drift_check_and_hides_no_change() {
    use peerwall_backend_nftables::Runner;
    let t = Topology::new();
    let policy = compile_file("examples/thesis-block.yaml");
    let nft = Nft::in_netns(t.gateway.name());
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    b.apply(&policy).unwrap();
    // The kernel's generation, read over netlink in the gateway's namespace, stands while
    // nothing is committed (traffic and counters are no commit) and moves at any commit.
    let g = nft.generation().expect("NFT_MSG_GETGEN answers");
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    assert_eq!(nft.generation(), Some(g));
    assert!(b.repair().unwrap().is_empty());
    assert!(b.repair().unwrap().is_empty());
    assert_eq!(nft.generation(), Some(g), "a drift check commits nothing");
    // A commit behind our back between two ticks: found by the next one.
    nft.apply_text("flush chain ip table_name filter_chain_name\n")
        .unwrap();
    assert_ne!(nft.generation(), Some(g));
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "flushed");
    assert_eq!(
        b.repair().unwrap(),
        vec![Drift::Modified {
            table: "table_name".into()
        }]
    );
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "repaired");
    // The same for an edit of nothing but a table another program owns: no drift of ours.
    nft.apply_text("add table ip someone_else\n").unwrap();
    assert!(b.repair().unwrap().is_empty());
    assert!(b.repair_full().unwrap().is_empty());
    assert!(b.repair_full().unwrap().is_empty());
}

/// A table deleted over netlink (the bpf backend's boot table, once its tunnel is attached):
/// gone from `nft list tables` with its rules (the ping it dropped passes), a second delete
/// finds none, and another table of the same name in another family stays.
#[test]
fn a_table_deleted_over_netlink_is_gone_and_a_missing_one_is_said() {
    use peerwall_backend_nftables::netlink::Session;
    let t = Topology::new();
    let nft = Nft::in_netns(t.gateway.name());
    nft.apply_text(
        "table inet pw_boot_x {\n chain f {\n type filter hook forward priority 0; policy drop;\n }\n}\ntable ip pw_boot_x {\n}\n",
    )
    .unwrap();
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "held");
    let mut s = Session::new(Some(t.gateway.name()));
    assert!(s.delete_table(1, "pw_boot_x").unwrap(), "it was there");
    let tables = nft_list(&t.gateway, &["list", "tables"]);
    assert!(!tables.contains("inet pw_boot_x"), "{tables}");
    assert!(
        tables.contains("ip pw_boot_x"),
        "the other family's stays: {tables}"
    );
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "its rules went with it"
    );
    assert!(!s.delete_table(1, "pw_boot_x").unwrap(), "none left");
    // The kept socket still works after the kernel's "no such table".
    assert!(s.delete_table(2, "pw_boot_x").unwrap());
    assert!(!nft_list(&t.gateway, &["list", "tables"]).contains("pw_boot_x"));
}

#[test]
fn agent_keeps_a_directory_enforced_and_the_last_good_policy_on_bad_input() {
    let t = Topology::new();
    let dir = std::env::temp_dir().join(format!("pw-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read_to_string(repo("examples/thesis-block.yaml")).unwrap();
    std::fs::write(dir.join("policy.yaml"), &good).unwrap();
    let child = std::process::Command::new("ip")
        .args(["netns", "exec", t.gateway.name()])
        .arg(peerwall())
        .args(["agent", "--interval-ms", "50", "--source"])
        .arg(format!("dir:{}", dir.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _agent = Proc::killed_on_drop(child);
    let listed = |t: &Topology| nft_list(&t.gateway, &["list", "ruleset"]);
    assert!(poll(5, || listed(&t).contains("drop_traffic")), "applied");
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    // A bad edit is not applied: the last good policy stays.
    std::fs::write(
        dir.join("policy.yaml"),
        good.replace("10.20.1.2", "10.20.1.300"),
    )
    .unwrap();
    // The agent has read it (and refused it) before the check: not a fixed wait that a slow
    // agent would pass.
    let refused = || {
        let o = in_ns(&t.gateway, "curl", &["-s", "http://127.0.0.1:9977/metrics"]);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .any(|l| l.starts_with("peerwall_invalid_policies_total") && !l.ends_with(" 0"))
    };
    assert!(poll(5, refused), "the agent saw the bad edit");
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "still enforced"
    );
    // A good edit is: pod2 is now 10.20.1.3.
    std::fs::write(
        dir.join("policy.yaml"),
        good.replace("10.20.1.2", "10.20.1.3"),
    )
    .unwrap();
    assert!(
        poll(5, || listed(&t).contains("ip daddr 10.20.1.3")),
        "updated"
    );
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.3"));
    // The agent's endpoints.
    let get = |path: &str| {
        let o = in_ns(
            &t.gateway,
            "curl",
            &["-s", "-m", "2", &format!("http://127.0.0.1:9977{path}")],
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(get("/healthz"), "ok\n");
    assert_eq!(get("/readyz"), "ready\n");
    let m = get("/metrics");
    assert!(
        m.contains("peerwall_policy_generation{backend=\"nftables\"} 2"),
        "{m}"
    );
    assert!(m.contains("peerwall_invalid_policies_total 1"), "{m}");
    assert!(
        m.contains("peerwall_apply_seconds_count{backend=\"nftables\"} 2"),
        "{m}"
    );
    // Rule counters are read every 2 s (each read lists the ruleset): the ping's within that.
    let dropped = "peerwall_rule_packets_total{table=\"table_name\",chain=\"filter_chain_name\",rule=\"drop_traffic\"} 1";
    assert!(poll(5, || get("/metrics").contains(dropped)), "{m}");
    // Someone deletes the table: the agent restores it.
    Nft::in_netns(t.gateway.name())
        .apply_text("delete table ip table_name\n")
        .unwrap();
    assert!(poll(5, || listed(&t).contains("drop_traffic")), "repaired");
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.3"));
    assert!(poll(5, || get("/metrics")
        .contains("peerwall_drift_repairs_total 1")));
    std::fs::remove_dir_all(&dir).ok();
}

/// The controller's gateway configuration, enforced with real packets: provider protection
/// (only offloaded pods reachable), consumer protection (our pods running on the peer may reach
/// our local pods) and leaf-to-leaf blocking (but not our pods on other peers).
#[test]
fn controller_gateway_policy_protects_both_sides() {
    use peerwall::protection::{gateway_object, Options, Peer, PeerSets};
    let t = Topology::new();
    let ips = |v: &[&str]| v.iter().map(|s| s.parse().unwrap()).collect();
    // Seen from this gateway: 10.10.1.67 is one of our pods the peer runs for us; 10.20.1.2 was
    // offloaded to us by the peer; 10.20.1.3 is one of our pods running on another peer.
    let sets = PeerSets {
        offloaded: ips(&["10.20.1.2"]),
        remote: ips(&["10.10.1.67"]),
        elsewhere: ips(&["10.20.1.3"]),
    };
    let apply = |leaf: bool| {
        let opts = Options {
            tunnel: TUNNEL.into(),
            block_leaf_to_leaf: leaf,
            audit: false,
            liqo_ping_port: peerwall::protection::LIQO_PING_PORT,
            own_namespace_only: false,
            inline_budget: peerwall::protection::spill::INLINE_BUDGET,
        };
        let peer = Peer {
            id: "a".into(),
            tenant_namespace: "liqo-tenant-a".into(),
            sources: vec!["10.10.0.0/16".parse().unwrap()],
        };
        let doc = gateway_object(&peer, &sets, &opts);
        let obj =
            peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
                .expect("decode");
        let policy = compile::compile(&[obj]).expect("compile").policy;
        NftBackend::new(Nft::in_netns(t.gateway.name()))
            .apply(&policy)
            .expect("apply");
    };
    apply(true);
    assert!(
        ping(&t.consumer, "10.10.1.68", "10.20.1.2"),
        "the peer reaches what it offloaded"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.68", "10.20.3.1"),
        "and nothing else (provider protection)"
    );
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.3.1"),
        "our pod on the peer reaches our local pods (consumer protection allows it)"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "but not our pods on other peers (leaf to leaf blocked)"
    );
    apply(false);
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "leaf to leaf allowed without the flag"
    );
    assert!(!ping(&t.consumer, "10.10.1.68", "10.20.3.1"));
}

/// The controller's gateway configuration with its addresses in AddressSet slices (3001
/// offloaded pods over 31 slices of at most `SLICE_FILL`): one pod joining a slice is one element added in the
/// kernel (seen by `nft monitor`, nothing else changes), its packets pass at once, and the
/// element comparison of drift detection agrees with what was applied — and notices an
/// element someone else removed.
#[test]
fn a_slice_change_touches_only_its_elements() {
    use peerwall::protection;
    use peerwall_policy::sliced::{check_slice, Sliced};
    let t = Topology::new();
    let (peer, opts, sets) = sliced_peer();
    let slices = protection::peer_slices(&sets, &opts);
    assert_eq!(
        slices.len(),
        3001_usize.div_ceil(protection::SLICE_FILL),
        "3001 addresses: slices of the offloaded set, none elsewhere"
    );
    let decode =
        |v: serde_json::Value| peerwall_intent::load::parse_all(&v.to_string(), "test").unwrap();
    let fwc = decode(protection::gateway_object(
        &peer,
        &Default::default(),
        &opts,
    ));
    let checked: Vec<_> = slices
        .iter()
        .map(|s| {
            let l = decode(protection::address_set_object(&peer, s));
            check_slice(&l.address_sets[0]).unwrap()
        })
        .collect();
    let compiled = compile::compile(&fwc.objects).expect("compile");
    let (mut sliced, issues) = Sliced::new(compiled, &checked);
    assert!(issues.is_empty(), "{issues:?}");
    let mut backend = NftBackend::new(Nft::in_netns(t.gateway.name()));
    backend.apply(sliced.policy()).expect("apply");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "offloaded pod"
    );
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.3"), "not yet");
    assert_eq!(backend.drift().unwrap(), Vec::<Drift>::new());

    // 10.20.1.3 joins the slice with room, as the controller lays it out.
    let changed = protection::layout(
        "offloaded",
        &slices,
        &sets
            .offloaded
            .iter()
            .copied()
            .chain(["10.20.1.3".parse().unwrap()])
            .collect(),
    );
    assert_eq!(changed.len(), 1, "one slice rewritten");
    let next =
        check_slice(&decode(protection::address_set_object(&peer, &changed[0])).address_sets[0])
            .unwrap();
    let mut monitor = std::process::Command::new("ip")
        .args(["netns", "exec", t.gateway.name(), "nft", "monitor"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("nft monitor");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (changes, issue) = sliced.update(&next.origin, Some(&next));
    let result = backend.update_sets(sliced.policy(), &changes);
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Stopped before any assertion: a failing one must not leave it running.
    monitor.kill().ok();
    let out = monitor.wait_with_output().unwrap();
    assert!(issue.is_none());
    let report = result.expect("update");
    assert_eq!(report.element_changes, 1, "{report:?}");
    assert!(
        report.over_netlink,
        "one address: no nft process {report:?}"
    );
    assert_eq!(peerwall_backend_nftables::netlink::fallbacks(), 0);
    assert!(report.recreated.is_empty());
    let events = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = events
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("# new generation"))
        .collect();
    assert_eq!(
        lines,
        ["add element inet peerwall_a offloaded { 10.20.1.3 }"],
        "the kernel saw exactly one element added"
    );
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "passes at once"
    );
    assert_eq!(backend.drift().unwrap(), Vec::<Drift>::new());

    // It leaves again: one element deleted (over netlink), its packets stop at once.
    let now: Vec<_> = slices
        .iter()
        .map(|s| {
            if s.name == changed[0].name {
                changed[0].clone()
            } else {
                s.clone()
            }
        })
        .collect();
    let back = protection::layout("offloaded", &now, &sets.offloaded);
    assert_eq!(back.len(), 1, "one slice rewritten");
    let back =
        check_slice(&decode(protection::address_set_object(&peer, &back[0])).address_sets[0])
            .unwrap();
    let (changes, issue) = sliced.update(&back.origin, Some(&back));
    assert!(issue.is_none());
    let report = backend
        .update_sets(sliced.policy(), &changes)
        .expect("update");
    assert_eq!(
        (report.element_changes, report.over_netlink),
        (1, true),
        "{report:?}"
    );
    assert_eq!(peerwall_backend_nftables::netlink::fallbacks(), 0);
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "gone at once"
    );
    let listed = nft_list(
        &t.gateway,
        &["list", "set", "inet", "peerwall_a", "offloaded"],
    );
    assert!(
        !listed.contains("10.20.1.3") && listed.contains("10.20.1.2"),
        "{listed}"
    );
    assert_eq!(backend.drift().unwrap(), Vec::<Drift>::new());

    // Someone removes an element behind the agent's back: the element check notices.
    Nft::in_netns(t.gateway.name())
        .apply_text("delete element inet peerwall_a offloaded { 10.20.1.2 }\n")
        .unwrap();
    assert_eq!(
        backend.drift().unwrap(),
        vec![Drift::Modified {
            table: "peerwall_a".into()
        }]
    );
}

/// Five accept rules that differ only in destination, protocol and port range, then a drop:
/// rendered as one lookup in a concatenated interval set (`ip daddr . th dport`, TCP in front),
/// and real TCP connections through the gateway get exactly the reference evaluator's verdict,
/// at the edges of every range; each rule's counter counts its own connections (element
/// counters). Drift checks hold; a rule without a counter among counting ones splits the run.
#[test]
fn a_run_of_rules_becomes_one_set_lookup_with_the_same_verdicts() {
    use peerwall_policy::ir::{self, VerdictAction};
    let t = Topology::new();
    let rule = |name: &str, dst: &str, ports: &str, counter: &str| {
        format!(
            "            - name: {name}\n              action: accept\n{counter}              match:\n                - op: eq\n                  dev: {{value: {TUNNEL}, position: in}}\n                - op: eq\n                  ip: {{value: \"{dst}\", position: dst}}\n                - op: eq\n                  proto: {{value: tcp}}\n                - op: eq\n                  port: {{value: \"{ports}\", position: dst}}\n"
        )
    };
    let doc = |uncounted: &str| {
        let mut y = String::from(
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: merged, namespace: liqo-tenant-cluster1}\nspec:\n  table:\n    name: merged\n    family: IPV4\n    chains:\n      - name: fwd\n        hook: forward\n        policy: accept\n        priority: 0\n        type: filter\n        rules:\n          filterRules:\n",
        );
        for (name, dst, ports) in [
            ("r0", "10.20.1.2", "8000-8009"),
            ("r1", "10.20.1.3", "8010-8019"),
            ("r2", "10.20.3.0/24", "8020-8029"),
            ("r3", "10.20.1.2-10.20.1.3", "8030"),
            ("r4", "10.20.3.1", "8040-8049"),
        ] {
            // `counter` defaults to true.
            let counter = if name == uncounted {
                "              counter: false\n"
            } else {
                ""
            };
            y.push_str(&rule(name, dst, ports, counter));
        }
        y.push_str(&format!(
            "            - name: deny\n              action: drop\n              match:\n                - op: eq\n                  dev: {{value: {TUNNEL}, position: in}}\n"
        ));
        let objs = peerwall_intent::load::parse_all(&y, "test").expect("parses");
        compile::compile(&objs.objects).expect("compiles").policy
    };
    let policy = doc("");
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    b.apply(&policy).expect("apply");
    let listing = nft_list(&t.gateway, &["list", "table", "ip", "merged"]);
    assert!(
        listing.contains("iifname \"liqo-tunnel\" ip daddr . tcp dport @__pw_m0_0 accept")
            && listing.contains("comment \"r0, r1, r2, r3, r4\"")
            && listing.contains("type ipv4_addr . inet_service"),
        "{listing}"
    );
    // Every edge of every rule, and ports just outside them, on each pod.
    let ports = [
        7999, 8000, 8009, 8010, 8019, 8020, 8029, 8030, 8031, 8040, 8049, 8050,
    ];
    let pods = ["10.20.1.2", "10.20.1.3", "10.20.3.1"];
    let mut listeners = Vec::new();
    for pod in pods {
        for p in ports {
            listeners.push(Listener::tcp(&t.provider, pod, p));
        }
    }
    let mut accepted = 0;
    for pod in pods {
        for p in ports {
            let pkt = ir::Packet {
                src: "10.10.1.67".parse().unwrap(),
                dst: pod.parse().unwrap(),
                proto: ir::eval::proto::TCP,
                sport: 40000,
                dport: p,
                iif: Some(TUNNEL.into()),
                oif: Some(GENEVE.into()),
                ct_state: ir::CtState::New,
            };
            let want = ir::eval::evaluate(&policy, &pkt).verdict == VerdictAction::Accept;
            accepted += usize::from(want);
            assert_eq!(
                tcp_connects(&t.consumer, "10.10.1.67", pod, p),
                want,
                "{pod}:{p} (reference: {})",
                if want { "accept" } else { "drop" }
            );
        }
    }
    assert_eq!(accepted, 10, "the grid covers both verdicts");
    assert_eq!(b.drift().unwrap(), Vec::<Drift>::new());
    assert_eq!(
        b.drift_check(true).unwrap(),
        Vec::<Drift>::new(),
        "elements too"
    );
    // Two accepted connections per rule, each of several packets.
    let c = b.counters().unwrap();
    for r in ["r0", "r1", "r2", "r3", "r4"] {
        assert!(
            c.iter().any(|c| c.rule == r && c.packets >= 4),
            "{r}: {c:?}"
        );
    }
    // r2 without a counter among counting rules splits the run: no set, every rule on its own.
    let split = doc("r2");
    b.apply(&split).expect("apply");
    let listing = nft_list(&t.gateway, &["list", "table", "ip", "merged"]);
    assert!(!listing.contains("@__pw_m0_"), "{listing}");
    assert!(tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", 8000));
    let c = b.counters().unwrap();
    assert!(c.iter().any(|c| c.rule == "r0" && c.packets >= 1), "{c:?}");
    assert!(!c.iter().any(|c| c.rule == "r2"), "{c:?}");
    drop(listeners);
}

/// A long run of rules that each look the destination up in a named set (the shape of the
/// NetworkPolicy tier) is dispatched through a verdict map to one chain per class of
/// addresses: real connections get the reference's verdict, the counters name the deciding
/// rules, the kernel's map elements are what was applied (drift), and an address joining an
/// existing class is two elements in place (its set's and the map's), a new class a new table.
#[test]
fn a_long_run_of_set_lookups_is_dispatched_with_the_same_verdicts() {
    use peerwall_policy::ir::{self, VerdictAction};
    let t = Topology::new();
    // s<i> for rule r<i> (port 8000+i); 10.20.1.2 in s0-s4, 10.20.1.3 in s5, 10.20.9.9 in s0
    // only (so that the class "s0 alone" exists), 10.20.3.1 (`extra`) where the test puts it.
    let doc = |extra: &[usize]| {
        let mut y = String::from(
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: np, namespace: liqo-tenant-cluster1}\nspec:\n  table:\n    name: np\n    family: IPV4\n    sets:\n",
        );
        for i in 0..10 {
            let mut members: Vec<&str> = Vec::new();
            if i < 5 {
                members.push("10.20.1.2");
            }
            if i == 5 {
                members.push("10.20.1.3");
            }
            if i == 0 {
                members.push("10.20.9.9");
            }
            if extra.contains(&i) {
                members.push("10.20.3.1");
            }
            let elems: String = members.iter().map(|m| format!("{{key: {m}}},")).collect();
            y.push_str(&format!(
                "      - {{name: s{i}, keyType: ipv4_addr, elements: [{elems}]}}\n"
            ));
        }
        y.push_str("    chains:\n      - name: fwd\n        hook: forward\n        policy: accept\n        priority: 0\n        type: filter\n        rules:\n          filterRules:\n");
        for i in 0..10 {
            y.push_str(&format!(
                "            - name: r{i}\n              action: accept\n              match:\n                - op: eq\n                  ip: {{value: \"@s{i}\", position: dst}}\n                - op: eq\n                  proto: {{value: tcp}}\n                - op: eq\n                  port: {{value: \"{}\", position: dst}}\n",
                8000 + i
            ));
        }
        y.push_str(&format!(
            "            - name: deny\n              action: drop\n              match:\n                - op: eq\n                  dev: {{value: {TUNNEL}, position: in}}\n"
        ));
        let objs = peerwall_intent::load::parse_all(&y, "test").expect("parses");
        compile::compile(&objs.objects).expect("compiles").policy
    };
    let pods = ["10.20.1.2", "10.20.1.3", "10.20.3.1"];
    // Both edges of the class of 10.20.1.2 (r0-r4), r5's port, r7's, one no rule names.
    let ports: Vec<u16> = vec![7999, 8000, 8004, 8005, 8007, 8009];
    let mut listeners = Vec::new();
    for pod in pods {
        for p in &ports {
            listeners.push(Listener::tcp(&t.provider, pod, *p));
        }
    }
    // Every pod's ports against the reference; the pods' accepted connections counted.
    let grid_of = |policy: &ir::Policy, pods: &[&str]| {
        let mut accepted = 0;
        for &pod in pods {
            for p in &ports {
                let pkt = ir::Packet {
                    src: "10.10.1.67".parse().unwrap(),
                    dst: pod.parse().unwrap(),
                    proto: ir::eval::proto::TCP,
                    sport: 40000,
                    dport: *p,
                    iif: Some(TUNNEL.into()),
                    oif: Some(GENEVE.into()),
                    ct_state: ir::CtState::New,
                };
                let want = ir::eval::evaluate(policy, &pkt).verdict == VerdictAction::Accept;
                accepted += usize::from(want);
                assert_eq!(
                    tcp_connects(&t.consumer, "10.10.1.67", pod, *p),
                    want,
                    "{pod}:{p} (reference: {})",
                    if want { "accept" } else { "drop" }
                );
            }
        }
        accepted
    };
    let grid = |policy: &ir::Policy| grid_of(policy, &pods);
    let policy = doc(&[]);
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    b.apply(&policy).expect("apply");
    let listing = nft_list(&t.gateway, &["list", "table", "ip", "np"]);
    assert!(
        listing.contains("ip daddr vmap @__pw_v0_4")
            && listing.contains("type ipv4_addr : verdict"),
        "{listing}"
    );
    assert!(
        !listing.contains("ip daddr @s3"),
        "the run is gone from fwd: {listing}"
    );
    assert_eq!(grid(&policy), 3, "the grid covers both verdicts");
    assert_eq!(
        b.drift_check(true).unwrap(),
        Vec::<Drift>::new(),
        "map elements too"
    );
    // The deciding rules counted, in their chain, copies added up.
    let c = b.counters().unwrap();
    for r in ["r0", "r4", "r5"] {
        assert!(
            c.iter()
                .any(|c| c.rule == r && c.chain == "fwd" && c.packets >= 2),
            "{r}: {c:?}"
        );
    }
    assert!(!c.iter().any(|c| c.chain.starts_with("__pw_")), "{c:?}");

    // Where the map sends `addr`: the chain its element jumps to, as the kernel lists it.
    let jump_of = |addr: &str| {
        let map = nft_list(&t.gateway, &["list", "map", "ip", "np", "__pw_v0_4"]);
        let at = map.find(&format!("{addr} : jump "))?;
        let rest = &map[at + addr.len() + " : jump ".len()..];
        let end = rest.find([',', ' ', '\n', '}']).unwrap_or(rest.len());
        Some(rest[..end].to_string())
    };
    // Element edits of the set and the map go over netlink (an address joining, changing or
    // leaving its class), none refused.
    let in_place = |r: &peerwall_backend_nftables::ApplyReport, changes: usize, what: &str| {
        assert!(r.recreated.is_empty(), "{what}: {r:?}");
        assert_eq!(r.element_changes, changes, "{what}: {r:?}");
        assert!(r.over_netlink, "{what}: {r:?}");
        assert_eq!(peerwall_backend_nftables::netlink::fallbacks(), 0, "{what}");
    };

    // 10.20.3.1 joins s0: the class of 10.20.9.9, one set and one map element.
    let joined = doc(&[0]);
    let r = b.apply(&joined).expect("apply");
    in_place(&r, 2, "joins");
    assert_eq!(grid(&joined), 4);
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());
    assert_eq!(jump_of("10.20.3.1"), jump_of("10.20.9.9"));

    // ... moves to s5 alone, the class of 10.20.1.3: its map element's jump changes (the
    // element deleted and added in one transaction), its set element moves.
    let moved = doc(&[5]);
    let r = b.apply(&moved).expect("apply");
    in_place(&r, 4, "changes class");
    assert_eq!(grid_of(&moved, &["10.20.3.1"]), 1);
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());
    assert!(jump_of("10.20.3.1").is_some());
    assert_eq!(jump_of("10.20.3.1"), jump_of("10.20.1.3"));
    assert_ne!(jump_of("10.20.3.1"), jump_of("10.20.9.9"));

    // ... and leaves every set: no element left in the map.
    let left = doc(&[]);
    let r = b.apply(&left).expect("apply");
    in_place(&r, 2, "leaves");
    assert_eq!(grid_of(&left, &["10.20.3.1"]), 0);
    assert_eq!(jump_of("10.20.3.1"), None);
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());

    // The same three through the agent's slice path (`update_sets`: the sets' changes as
    // AddressSets bring them, the map's elements derived from them, nothing rendered).
    let pod: u128 = 0x0a14_0301;
    let change = |policy: &ir::Policy, set: &str, add: bool| {
        let set = policy.tables[0]
            .sets
            .iter()
            .position(|s| s.name == set)
            .expect("the set");
        let ir::SetElements::Addr(mut contents) = policy.tables[0].sets[set].elements.clone()
        else {
            panic!("an address set");
        };
        let one = ir::AddrRange { lo: pod, hi: pod };
        let edit = if add {
            contents.insert_range(one)
        } else {
            contents.remove_range(one)
        };
        ir::SetChange {
            table: policy.tables[0].name.clone(),
            family: policy.tables[0].family,
            set: policy.tables[0].sets[set].name.clone(),
            addr_family: ir::IpFamily::V4,
            edit,
        }
    };
    let joined = doc(&[0]);
    let r = b
        .update_sets(&joined, &[change(&left, "s0", true)])
        .expect("update");
    in_place(&r, 2, "joins, slice path");
    assert_eq!(grid_of(&joined, &["10.20.3.1"]), 1);
    assert_eq!(jump_of("10.20.3.1"), jump_of("10.20.9.9"));
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());
    let moved = doc(&[5]);
    let r = b
        .update_sets(
            &moved,
            &[change(&joined, "s0", false), change(&left, "s5", true)],
        )
        .expect("update");
    in_place(&r, 4, "changes class, slice path");
    assert_eq!(grid_of(&moved, &["10.20.3.1"]), 1);
    assert_eq!(jump_of("10.20.3.1"), jump_of("10.20.1.3"));
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());
    let r = b
        .update_sets(&left, &[change(&moved, "s5", false)])
        .expect("update");
    in_place(&r, 2, "leaves, slice path");
    assert_eq!(grid_of(&left, &["10.20.3.1"]), 0);
    assert_eq!(jump_of("10.20.3.1"), None);
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());

    // ... and s7 too: a class no address had, a new chain: the table is recreated.
    let new_class = doc(&[0, 7]);
    let r = b.apply(&new_class).expect("apply");
    assert_eq!(r.recreated, ["np"], "{r:?}");
    assert_eq!(grid(&new_class), 5);
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());

    // A map element removed behind the agent's back is drift.
    Nft::in_netns(t.gateway.name())
        .apply_text("delete element ip np __pw_v0_4 { 10.20.1.3 }\n")
        .unwrap();
    assert_eq!(
        b.drift_check(true).unwrap(),
        vec![Drift::Modified { table: "np".into() }]
    );
    drop(listeners);
}

/// An interval set (a run of addresses too long for a hash set) edited in place over netlink,
/// as `nft` would write it: a range split by an address leaving it, merged again, and a range
/// of its own beside; packets follow each edit, the kernel lists the ranges `nft` would, and
/// drift detection agrees with what was applied.
#[test]
fn an_interval_set_is_edited_in_place_over_netlink() {
    use peerwall_policy::ir::{AddrRange, AddrSet, IpFamily, SetElements};
    let t = Topology::new();
    let dir = std::env::temp_dir().join(format!("pw-interval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("iv.yaml");
    std::fs::write(
        &f,
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: iv, namespace: t}\nspec:\n  table:\n    name: peerwall_iv\n    family: INET\n    sets:\n      - {name: blocked, keyType: ipv4_addr, elements: [{key: 10.20.1.0/27}]}\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: to_blocked, action: drop, match: [{op: eq, ip: {value: '@blocked', position: dst}}]}\n",
    )
    .unwrap();
    let objs = peerwall_intent::load::load_paths(&[f]).expect("loads");
    let mut policy = compile::compile(&objs).expect("compiles").policy;
    std::fs::remove_dir_all(&dir).ok();
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    b.apply(&policy).expect("apply");
    let list = || {
        nft_list(
            &t.gateway,
            &["list", "set", "inet", "peerwall_iv", "blocked"],
        )
    };
    assert!(list().contains("flags interval"), "{}", list());
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "blocked");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.3.1"),
        "not in the set"
    );
    let base: u128 = 0x0a14_0100;
    let ranges = |rs: &[(u128, u128)]| {
        SetElements::Addr(AddrSet::from_ranges(
            IpFamily::V4,
            rs.iter().map(|(lo, hi)| AddrRange {
                lo: base + lo,
                hi: base + hi,
            }),
        ))
    };
    let mut step = |rs: &[(u128, u128)], listed: &str, what: &str| {
        policy.tables[0].sets[0].elements = ranges(rs);
        let r = b.apply(&policy).expect(what);
        assert_eq!(r.updated, vec!["peerwall_iv"], "{what}: {r:?}");
        assert!(r.over_netlink, "{what}: {r:?}");
        assert_eq!(peerwall_backend_nftables::netlink::fallbacks(), 0, "{what}");
        let l = list();
        assert!(l.contains(listed), "{what}: {l}");
        assert_eq!(b.drift().unwrap(), Vec::<Drift>::new(), "{what}");
    };
    // 10.20.1.2 leaves: [.0-.31] becomes [.0-.1] and [.3-.31].
    step(
        &[(0, 1), (3, 31)],
        "10.20.1.0/31, 10.20.1.3-10.20.1.31",
        "split",
    );
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "left the set");
    // It comes back, and 10.20.3.1 joins as a range of its own.
    step(
        &[(0, 31), (0x201, 0x201)],
        "10.20.1.0/27, 10.20.3.1",
        "merge",
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "back in the set"
    );
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.3.1"), "joined");
}

/// The decided-flow cache (`decided.rs`) against a real kernel: a one-way UDP flow (conntrack
/// never sees it answered, so every datagram is `new` and would walk the chain) is accepted by
/// the cache's lookup after its first datagram, and each way of changing the policy — the
/// slice path's in-place edit over netlink and an apply of a changed set — empties the cache
/// in the same transaction: the flow stops at once, not when its decision expires.
#[test]
fn a_decided_flow_is_served_by_one_lookup_and_every_change_revokes_it() {
    use peerwall_policy::ir;
    let t = Topology::new();
    let doc = |sources: &str| {
        let y = format!(
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: cache, namespace: t}}\nspec:\n  table:\n    name: peerwall_cache\n    family: INET\n    sets:\n      - {{name: src, keyType: ipv4_addr, elements: [{sources}]}}\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {{name: replies, action: accept, match: [{{op: eq, ctstate: {{value: [established, related]}}}}]}}\n            - {{name: web, action: accept, match: [{{op: eq, ip: {{value: '@src', position: src}}}}, {{op: eq, ip: {{value: 10.20.1.2, position: dst}}}}, {{op: eq, proto: {{value: udp}}}}, {{op: eq, port: {{value: '8000', position: dst}}}}]}}\n"
        );
        let objs = peerwall_intent::load::parse_all(&y, "test").expect("parses");
        compile::compile(&objs.objects).expect("compiles").policy
    };
    let allowed = doc("{key: 10.10.1.67}, {key: 10.10.1.99}");
    let mut b = NftBackend::new(Nft::in_netns(t.gateway.name()));
    b.apply(&allowed).expect("apply");
    let listing = nft_list(&t.gateway, &["list", "table", "inet", "peerwall_cache"]);
    assert!(
        listing.contains("@__pw_d0_4 counter") && listing.contains("goto __pw_keep0"),
        "{listing}"
    );
    // The provider's end only counts (it sends to itself, never back through the gateway).
    let dir = std::env::temp_dir().join(format!("pw-decided-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rx = Chatter::start(
        &format!("/run/netns/{}", t.provider.name()),
        ("10.20.1.2", 8000),
        ("10.20.1.2", 9),
        dir.join("rx"),
    );
    let _tx = Chatter::start(
        &format!("/run/netns/{}", t.consumer.name()),
        ("10.10.1.67", 40000),
        ("10.20.1.2", 8000),
        dir.join("tx"),
    );
    let flowing = |what: &str| {
        let start = rx.received();
        std::thread::sleep(std::time::Duration::from_millis(600));
        let n = rx.received() - start;
        assert!(n >= 5, "{what}: {n} datagrams in 600 ms");
    };
    // Stops within the packets in flight, and stays stopped for longer than a decision lasts
    // were it not revoked (10 s would be the test's length; 1.2 s shows it: the flow sends
    // 20 a second).
    let stopped = |what: &str| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let start = rx.received();
        std::thread::sleep(std::time::Duration::from_millis(1200));
        let n = rx.received() - start;
        assert_eq!(n, 0, "{what}: {n} datagrams after the change");
    };
    let cached = || {
        nft_list(
            &t.gateway,
            &["list", "set", "inet", "peerwall_cache", "__pw_d0_4"],
        )
        .contains("10.20.1.2 . 10.10.1.67 . 8000 . udp")
    };
    flowing("allowed");
    // Datagrams of a flow conntrack never saw answered are `new` (no reply), and after the
    // first the lookup accepts them: its counter moves, the key is in the set, the rule's own
    // counter saw the first.
    assert!(cached(), "the flow's key is in the cache");
    let served: u64 = b
        .counters()
        .expect("counters")
        .iter()
        .filter(|c| c.rule == "__pw_decided")
        .map(|c| c.packets)
        .sum();
    assert!(served >= 5, "the lookup served the flow: {served}");
    assert!(
        in_ns(
            &t.gateway,
            "conntrack",
            &["-L", "-p", "udp", "--dport", "8000"]
        )
        .stdout
        .windows(b"UNREPLIED".len())
        .any(|w| w == b"UNREPLIED"),
        "the flow stays unreplied"
    );

    // The slice path: 10.10.1.67 leaves `src`, in place over netlink.
    let ir::SetElements::Addr(contents) = allowed.tables[0].sets[0].elements.clone() else {
        panic!("an address set");
    };
    let mut contents = contents;
    let pod: u128 = 0x0a0a_0143;
    let edit = contents.remove_range(ir::AddrRange { lo: pod, hi: pod });
    let revoked = doc("{key: 10.10.1.99}");
    let r = b
        .update_sets(
            &revoked,
            &[ir::SetChange {
                table: "peerwall_cache".into(),
                family: ir::TableFamily::Inet,
                set: "src".into(),
                addr_family: ir::IpFamily::V4,
                edit,
            }],
        )
        .expect("update");
    assert!(r.recreated.is_empty() && r.over_netlink, "{r:?}");
    stopped("the slice path");
    assert!(!cached(), "the cache emptied");
    assert_eq!(b.drift_check(true).unwrap(), Vec::<Drift>::new());

    // Back (an apply that adds the element: the elements-only plan), then gone again the same
    // way.
    let r = b.apply(&allowed).expect("apply");
    assert!(r.recreated.is_empty(), "{r:?}");
    flowing("allowed again");
    assert!(cached());
    let r = b.apply(&revoked).expect("apply");
    assert!(r.recreated.is_empty() && r.element_changes == 1, "{r:?}");
    stopped("an apply of the changed set");
    assert!(!cached());
    std::fs::remove_dir_all(&dir).ok();
}

/// `--nft-flow-cache off` renders the same policy without the decided-flow cache (every rule
/// accepting as written); the default puts it back.
#[test]
fn the_flow_cache_can_be_turned_off() {
    let t = Topology::new();
    let yaml = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: cacheoff, namespace: t}\nspec:\n  table:\n    name: peerwall_cacheoff\n    family: INET\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {name: replies, action: accept, match: [{op: eq, ctstate: {value: [established, related]}}]}\n            - {name: web, action: accept, match: [{op: eq, ip: {value: 10.20.1.2, position: dst}}, {op: eq, proto: {value: udp}}, {op: eq, port: {value: '8000', position: dst}}]}\n";
    let dir = std::env::temp_dir().join(format!("pw-cacheoff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("c.yaml");
    std::fs::write(&f, yaml).unwrap();
    let listed = |extra: &[&str]| {
        let mut args = vec!["apply"];
        args.extend_from_slice(extra);
        args.extend(["-f", f.to_str().unwrap()]);
        let o = peerwall_in(&t.gateway, &args);
        assert!(o.status.success(), "{o:?}");
        nft_list(&t.gateway, &["list", "table", "inet", "peerwall_cacheoff"])
    };
    let off = listed(&["--nft-flow-cache", "off"]);
    assert!(
        !off.contains("__pw_") && off.contains("udp dport 8000 counter packets 0 bytes 0 accept"),
        "{off}"
    );
    let on = listed(&[]);
    assert!(
        on.contains("@__pw_d0_4 counter") && on.contains("goto __pw_keep0 comment \"web\""),
        "{on}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
