//! Protection as data: a cluster in, the gateway configuration, sets, slices and
//! NetworkPolicies out, judged by the reference evaluator.

use super::*;
use peerwall_policy::compile::{validate, PolicyObject};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

fn many(n: u32) -> BTreeSet<IpAddr> {
    (0..n)
        .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0x0a14_0000 + i)))
        .collect()
}

#[test]
fn slices_are_bounded_and_a_change_rewrites_only_the_slices_it_touches() {
    let all = many(2500);
    let first = layout("offloaded", &[], &all);
    assert_eq!(first.len(), 2500_usize.div_ceil(SLICE_FILL));
    assert!(first.iter().all(|s| s.addresses.len() <= SLICE_FILL));
    assert_eq!(first.iter().map(|s| s.addresses.len()).sum::<usize>(), 2500);
    // One pod gone, one new: at most two slices rewritten, nothing else moves.
    let mut next = all.clone();
    let gone = *next.iter().nth(10).unwrap();
    next.remove(&gone);
    next.insert("10.21.0.1".parse().unwrap());
    let changed = layout("offloaded", &first, &next);
    assert!(changed.len() <= 2, "{}", changed.len());
    let mut merged: BTreeMap<String, Slice> =
        first.iter().map(|s| (s.name.clone(), s.clone())).collect();
    for c in changed {
        merged.insert(c.name.clone(), c);
    }
    let union: BTreeSet<IpAddr> = merged
        .values()
        .flat_map(|s| s.addresses.iter().copied())
        .collect();
    assert_eq!(union, next);
    for s in &first {
        let now = &merged[&s.name];
        assert!(now
            .addresses
            .iter()
            .all(|a| s.addresses.contains(a) || !all.contains(a)));
    }
    // Everything gone: slices come back empty (deleted by the caller once settled).
    let emptied = layout("offloaded", &first, &BTreeSet::new());
    assert_eq!(emptied.len(), first.len());
    assert!(emptied.iter().all(|s| s.addresses.is_empty()));
}

#[test]
fn a_new_address_goes_to_a_slice_at_most_half_full_or_a_new_one() {
    let all = many(3000);
    let first = layout("offloaded", &[], &all);
    assert!(first.iter().all(|s| s.addresses.len() == SLICE_FILL));
    // Churn leaves a few holes in every slice, as pods come and go everywhere.
    let mut holey = first.clone();
    for s in &mut holey {
        let gone: Vec<IpAddr> = s.addresses.iter().step_by(100).copied().collect();
        for a in gone {
            s.addresses.remove(&a);
        }
    }
    let have: BTreeSet<IpAddr> = holey
        .iter()
        .flat_map(|s| s.addresses.iter().copied())
        .collect();
    let one: IpAddr = "10.21.0.1".parse().unwrap();
    let mut next = have.clone();
    next.insert(one);
    // Not a slice of 990: a new one, holding only the new address.
    let changed = layout("offloaded", &holey, &next);
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0].addresses, BTreeSet::from([one]));
    assert!(holey.iter().all(|s| s.name != changed[0].name));
    // A slice that fell below half is refilled first, emptiest first.
    let mut low = holey.clone();
    let kept: BTreeSet<IpAddr> = low[1].addresses.iter().take(300).copied().collect();
    low[1].addresses = kept;
    let have: BTreeSet<IpAddr> = low
        .iter()
        .flat_map(|s| s.addresses.iter().copied())
        .collect();
    let mut next = have.clone();
    next.insert(one);
    let changed = layout("offloaded", &low, &next);
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0].name, low[1].name);
    assert_eq!(changed[0].addresses.len(), 301);
    // Filled up to half, then a new slice; one opened for many addresses at once fills up.
    let mut next = have.clone();
    let new: Vec<IpAddr> = (0..1500u32)
        .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0x0a30_0000 + i)))
        .collect();
    next.extend(new.iter().copied());
    let changed = layout("offloaded", &low, &next);
    let sizes: BTreeMap<&str, usize> = changed
        .iter()
        .map(|s| (s.name.as_str(), s.addresses.len()))
        .collect();
    assert_eq!(sizes.len(), 3, "{sizes:?}");
    assert_eq!(sizes[low[1].name.as_str()], REFILL_BELOW);
    let opened: Vec<usize> = changed
        .iter()
        .filter(|s| low.iter().all(|l| l.name != s.name))
        .map(|s| s.addresses.len())
        .collect();
    assert_eq!(
        opened,
        vec![SLICE_FILL, 1500 - (REFILL_BELOW - 300) - SLICE_FILL]
    );
}

fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
fn ns(name: &str, kv: &[(&str, &str)]) -> Namespace {
    Namespace {
        name: name.into(),
        labels: labels(kv),
    }
}
fn pod(ns: &str, name: &str, ip: &str) -> Pod {
    Pod {
        namespace: ns.into(),
        name: name.into(),
        ips: vec![ip.parse().unwrap()],
        ..Default::default()
    }
}
fn ips(v: &[&str]) -> BTreeSet<IpAddr> {
    v.iter().map(|s| s.parse().unwrap()).collect()
}

fn world() -> World {
    World {
        namespaces: vec![
            ns(
                "liqo-tenant-a",
                &[(TENANT_NAMESPACE, "true"), (REMOTE_CLUSTER_ID, "a")],
            ),
            ns(
                "liqo-tenant-b",
                &[(TENANT_NAMESPACE, "true"), (REMOTE_CLUSTER_ID, "b")],
            ),
            ns("app-a", &[(REMOTE_CLUSTER_ID, "a")]),
            ns("app-b", &[(REMOTE_CLUSTER_ID, "b")]),
            ns("local", &[]),
        ],
        pods: vec![
            pod("app-a", "web", "10.200.0.5"),
            pod("app-a", "web6", "fd00::5"),
            pod("app-b", "shadow", "10.200.0.6"),
            // A pod label never moves a pod to a peer its namespace's owner is not.
            Pod {
                labels: labels(&[(REMOTE_CLUSTER_ID, "b")]),
                ..pod("local", "claims-b", "10.200.0.16")
            },
            Pod {
                labels: labels(&[(REMOTE_CLUSTER_ID, "b")]),
                ..pod("app-a", "claims-b", "10.200.0.17")
            },
            Pod {
                labels: labels(&[(REMOTE_CLUSTER_ID, "a")]),
                ..pod("app-a", "says-a", "10.200.0.18")
            },
            pod("local", "plain", "10.200.0.7"),
            pod("liqo-tenant-a", "gateway", "10.200.0.8"),
            Pod {
                node: Some("liqo-c".into()),
                ..pod("local", "mine-on-c", "10.99.0.1")
            },
            Pod {
                gone: true,
                ..pod("app-a", "done", "10.200.0.9")
            },
            Pod {
                ips: vec![],
                ..pod("app-a", "pending", "10.0.0.1")
            },
        ],
        virtual_nodes: vec![Node {
            name: "liqo-c".into(),
            labels: labels(&[(REMOTE_CLUSTER_ID, "a")]),
        }],
        remaps: BTreeMap::new(),
        sources: BTreeMap::new(),
    }
}

/// Peer `a`'s pod CIDR 10.200.0.0/16 overlaps ours and is seen here as 10.71.0.0/16: our pod
/// running on `a` (reflected with 10.71.4.9) is listed by the address its packets carry
/// through the tunnel and in the gateway's forward hook, 10.200.4.9. Other peers' sets,
/// and addresses outside the remapped CIDR, keep the addresses this cluster uses.
#[test]
fn configuration_remaps_pair_spec_and_status_by_position() {
    let body = json!({
        "spec": {"remote": {"cidr": {"pod": ["10.200.0.0/16"], "external": ["10.70.0.0/16"]}}},
        "status": {"remote": {"cidr": {"pod": ["10.71.0.0/16"], "external": ["10.70.0.0/16"]}}},
    });
    let (peer, r) = configuration_remaps(&labels(&[(REMOTE_CLUSTER_ID, "a")]), &body).unwrap();
    assert_eq!(peer, "a");
    assert_eq!(
        r,
        vec![Remap {
            real: "10.200.0.0/16".parse().unwrap(),
            seen: "10.71.0.0/16".parse().unwrap(),
        }]
    );
    assert!(configuration_remaps(&labels(&[]), &body).is_none());
}

#[test]
fn remote_pods_are_listed_by_the_address_the_forward_hook_sees() {
    let mut w = world();
    w.pods.push(Pod {
        node: Some("liqo-c".into()),
        ..pod("local", "remapped-on-a", "10.71.4.9")
    });
    w.remaps.insert(
        "a".into(),
        vec![Remap {
            real: "10.200.0.0/16".parse().unwrap(),
            seen: "10.71.0.0/16".parse().unwrap(),
        }],
    );
    let s = sets(&w);
    assert_eq!(s["a"].remote, ips(&["10.99.0.1", "10.200.4.9"]));
    assert_eq!(s["b"].elsewhere, ips(&["10.99.0.1", "10.71.4.9"]));
    let r = Remap {
        real: "10.200.0.0/16".parse().unwrap(),
        seen: "10.71.0.0/17".parse().unwrap(),
    };
    assert_eq!(
        r.to_real("10.71.0.1".parse().unwrap()),
        None,
        "lengths differ"
    );
    let r6 = Remap {
        real: "fd00:1::/64".parse().unwrap(),
        seen: "fd00:2::/64".parse().unwrap(),
    };
    assert_eq!(
        r6.to_real("fd00:2::7".parse().unwrap()),
        Some("fd00:1::7".parse().unwrap())
    );
}

#[test]
fn sets_follow_namespaces_labels_and_virtual_nodes() {
    let s = sets(&world());
    assert_eq!(
        s["a"].offloaded,
        ips(&["10.200.0.5", "10.200.0.18", "fd00::5"])
    );
    assert_eq!(s["b"].offloaded, ips(&["10.200.0.6"]));
    assert_eq!(s["a"].remote, ips(&["10.99.0.1"]));
    assert_eq!(s["b"].elsewhere, ips(&["10.99.0.1"]));
    assert!(s["b"].remote.is_empty());
}

#[test]
fn gateway_spec_is_valid_and_default_denies() {
    for leaf in [false, true] {
        let s = &sets(&world())["a"];
        let spec = gateway_spec(
            "a-1",
            &["10.10.0.0/16".parse().unwrap()],
            s,
            &Options {
                tunnel: "liqo-tunnel".into(),
                block_leaf_to_leaf: leaf,
                audit: false,
                liqo_ping_port: LIQO_PING_PORT,
                own_namespace_only: false,
                inline_budget: crate::spill::INLINE_BUDGET,
            },
        );
        let doc = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
            "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
        let obj: PolicyObject =
            peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
                .unwrap();
        validate(&obj).unwrap();
        let compiled = peerwall_policy::compile::compile(&[obj]).unwrap();
        let t = &compiled.policy.tables[0];
        assert_eq!(t.name, "peerwall_a_1");
        let rules = &t.chains[0].rules;
        assert_eq!(rules.last().unwrap().name, "default_deny");
        assert_eq!(rules.len(), if leaf { 11 } else { 9 });
        assert_eq!(rules[0].name, "invalid");
        assert_eq!(rules[1].name, "spoofed");
        assert_eq!(rules[rules.len() - 2].name, "replies");
    }
}

/// Peer `a`'s gateway configuration (tunnel `liqo-tunnel*`, Liqo's default tunnel check)
/// for `sources` and `s`, compiled as an agent compiles it.
fn compiled_gateway(sources: &[ipnet::IpNet], s: &PeerSets) -> peerwall_policy::ir::Policy {
    let spec = gateway_spec(
        "a",
        sources,
        s,
        &Options {
            tunnel: DEFAULT_TUNNEL.into(),
            block_leaf_to_leaf: false,
            audit: false,
            liqo_ping_port: LIQO_PING_PORT,
            own_namespace_only: false,
            inline_budget: crate::spill::INLINE_BUDGET,
        },
    );
    let doc = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
        "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
    let obj = peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
        .unwrap();
    peerwall_policy::compile::compile(&[obj]).unwrap().policy
}

/// Anti-spoofing as data: from the tunnel, a source outside the peer's CIDRs is dropped by
/// `spoofed` before any allowance (even towards the peer's own offloaded pods); a source
/// inside reaches them as before; IPv6 from a peer with no IPv6 CIDR is spoofed too; what
/// does not come from the tunnel is not checked.
#[test]
fn spoofed_sources_from_the_tunnel_are_dropped_first() {
    use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};
    let s = PeerSets {
        offloaded: ips(&["10.20.1.2", "fd20::2"]),
        ..Default::default()
    };
    let sources: Vec<ipnet::IpNet> = vec!["10.10.0.0/16".parse().unwrap()];
    let policy = compiled_gateway(&sources, &s);
    let verdict = |src: &str, dst: &str, iif: &str, ct: CtState| {
        let v = evaluate(
            &policy,
            &Packet {
                src: src.parse().unwrap(),
                dst: dst.parse().unwrap(),
                proto: 6,
                sport: 40000,
                dport: 80,
                iif: Some(iif.into()),
                oif: Some("liqo.x".into()),
                ct_state: ct,
            },
        );
        (v.verdict, v.rule.unwrap_or_default())
    };
    let t = "liqo-tunnel";
    assert_eq!(
        verdict("10.10.1.5", "10.20.1.2", t, CtState::New),
        (VerdictAction::Accept, "to_offloaded".into())
    );
    for ct in [CtState::New, CtState::Established] {
        assert_eq!(
            verdict("10.99.1.5", "10.20.1.2", t, ct),
            (VerdictAction::Drop, "spoofed".into())
        );
    }
    assert_eq!(
        verdict("fd10::5", "fd20::2", t, CtState::New),
        (VerdictAction::Drop, "spoofed6".into())
    );
    // Invalid from the tunnel (a segment of a connection that was ended): dropped before any
    // allowance, even towards an offloaded pod and from an allowed source.
    assert_eq!(
        verdict("10.10.1.5", "10.20.1.2", t, CtState::Invalid),
        (VerdictAction::Drop, "invalid".into())
    );
    // Not from the tunnel: not this chain's business.
    assert_eq!(
        verdict("10.99.1.5", "10.20.1.2", "eth0", CtState::New).0,
        VerdictAction::Accept
    );
}

/// Where Liqo remaps a peer CIDR that overlaps ours, the peer's own range (its sources in the
/// forward hook) equals ours, so the source check cannot tell a peer's pod from one of ours.
/// It need not: from the tunnel, no rule grants anything for being one of our pods here. A
/// packet from peer `a`'s tunnel carrying the address of any of our pods that does not run on
/// `a` gets exactly the verdict of an address of `a` that no pod holds, towards every pod and
/// for every state; only our pod running on `a` (by the address its packets carry, 10.200.4.9)
/// is let further (`from_own_pods`).
#[test]
fn posing_as_one_of_our_pods_from_a_remapped_peer_grants_nothing() {
    use peerwall_policy::ir::{evaluate, CtState, Packet};
    let mut w = world();
    w.pods.push(Pod {
        node: Some("liqo-c".into()),
        ..pod("local", "remapped-on-a", "10.71.4.9")
    });
    let body = json!({
        "spec": {"remote": {"cidr": {"pod": ["10.200.0.0/16"], "external": ["10.70.0.0/16"]}}},
        "status": {"remote": {"cidr": {"pod": ["10.71.0.0/16"], "external": ["10.72.0.0/16"]}}},
    });
    let peer_labels = labels(&[(REMOTE_CLUSTER_ID, "a")]);
    let (_, remaps) = configuration_remaps(&peer_labels, &body).unwrap();
    let (_, sources) = configuration_sources(&peer_labels, &body).unwrap();
    w.remaps.insert("a".into(), remaps);
    let s = sets(&w);
    assert!(s["a"]
        .remote
        .contains(&"10.200.4.9".parse::<IpAddr>().unwrap()));
    let policy = compiled_gateway(&sources, &s["a"]);
    let verdict = |src: IpAddr, dst: IpAddr, proto: u8, ct: CtState| {
        let v = evaluate(
            &policy,
            &Packet {
                src,
                dst,
                proto,
                sport: 40000,
                dport: 80,
                iif: Some("liqo-tunnel".into()),
                oif: Some("liqo.x".into()),
                ct_state: ct,
            },
        );
        (v.verdict, v.rule)
    };
    let nobody: IpAddr = "10.200.77.77".parse().unwrap();
    let ours_here: Vec<IpAddr> = w
        .pods
        .iter()
        .filter(|p| p.node.is_none())
        .flat_map(|p| p.ips.clone())
        .filter(IpAddr::is_ipv4)
        .collect();
    assert!(ours_here.len() > 5, "{ours_here:?}");
    let mut dsts = ours_here.clone();
    dsts.push("10.200.4.9".parse().unwrap());
    let mut compared = 0;
    for &src in &ours_here {
        assert!(
            sources.iter().any(|c| c.contains(&src)),
            "{src}: inside the peer's own range, so the source check passes it"
        );
        for &dst in &dsts {
            for proto in [6, 17] {
                for ct in [CtState::New, CtState::Established, CtState::Related] {
                    assert_eq!(
                        verdict(src, dst, proto, ct),
                        verdict(nobody, dst, proto, ct),
                        "{src} -> {dst} proto {proto} {ct:?}: posing as our pod changes the verdict"
                    );
                    compared += 1;
                }
            }
        }
    }
    assert!(compared > 100);
    // Sensitive: our pod on `a` is let further than an unknown address of `a`.
    let local: IpAddr = "10.200.0.7".parse().unwrap();
    assert_ne!(
        verdict("10.200.4.9".parse().unwrap(), local, 6, CtState::New),
        verdict(nobody, local, 6, CtState::New)
    );
}

/// Before Liqo's `Configuration` of the peer is seen its sources cannot be checked, so nothing
/// from its tunnel is forwarded: not new connections to its offloaded pods, not replies, from
/// any source, counted on `no_liqo_configuration`. Liqo's tunnel check (to the gateway itself)
/// still passes, and what does not come from the tunnel is not this chain's business.
#[test]
fn without_liqo_configuration_nothing_from_the_tunnel_is_forwarded() {
    use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};
    let s = PeerSets {
        offloaded: ips(&["10.20.1.2", "fd20::2"]),
        remote: ips(&["10.10.9.20"]),
        ..Default::default()
    };
    let policy = compiled_gateway(&[], &s);
    let verdict =
        |src: &str, dst: &str, iif: &str, oif: Option<&str>, proto: u8, dport: u16, ct| {
            let v = evaluate(
                &policy,
                &Packet {
                    src: src.parse().unwrap(),
                    dst: dst.parse().unwrap(),
                    proto,
                    sport: 40000,
                    dport,
                    iif: Some(iif.into()),
                    oif: oif.map(Into::into),
                    ct_state: ct,
                },
            );
            (v.verdict, v.rule.unwrap_or_default())
        };
    let (t, fwd) = ("liqo-tunnel", Some("liqo.x"));
    let closed = (VerdictAction::Drop, NO_CONFIGURATION_RULE.to_string());
    for ct in [CtState::New, CtState::Established, CtState::Related] {
        assert_eq!(verdict("10.10.1.5", "10.20.1.2", t, fwd, 6, 80, ct), closed);
        assert_eq!(verdict("fd10::5", "fd20::2", t, fwd, 6, 80, ct), closed);
        // Towards our own pods the peer runs: closed too.
        assert_eq!(
            verdict("10.10.9.20", "10.20.1.9", t, fwd, 17, 53, ct),
            closed
        );
    }
    // The invalid rule still comes first.
    assert_eq!(
        verdict("10.10.1.5", "10.20.1.2", t, fwd, 6, 80, CtState::Invalid).1,
        "invalid"
    );
    // Liqo's tunnel check, to the gateway itself.
    assert_eq!(
        verdict(
            "169.254.18.1",
            "169.254.18.2",
            t,
            None,
            17,
            LIQO_PING_PORT,
            CtState::New
        )
        .0,
        VerdictAction::Accept
    );
    // Not from the tunnel.
    assert_eq!(
        verdict("10.99.1.5", "10.20.1.2", "eth0", fwd, 6, 80, CtState::New).0,
        VerdictAction::Accept
    );
    // Once the CIDRs are known the rule is gone and the pod is reachable from them.
    let known = compiled_gateway(&["10.10.0.0/16".parse().unwrap()], &s);
    assert!(known.tables[0].chains[0]
        .rules
        .iter()
        .all(|r| r.name != NO_CONFIGURATION_RULE));
}

/// The gateway itself, as data: from the tunnel only Liqo's tunnel check and replies
/// reach it; from elsewhere (the nodes, the underlay) nothing is checked.
#[test]
fn the_gateway_takes_only_the_tunnel_check_and_replies_from_the_tunnel() {
    use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};
    let policy = compiled_gateway(&[], &PeerSets::default());
    let to_gateway = |iif: &str, proto: u8, dport: u16, ct: CtState| {
        let v = evaluate(
            &policy,
            &Packet {
                src: "169.254.18.2".parse().unwrap(),
                dst: "169.254.18.1".parse().unwrap(),
                proto,
                sport: 12345,
                dport,
                iif: Some(iif.into()),
                oif: None,
                ct_state: ct,
            },
        );
        (v.verdict, v.rule.unwrap_or_default())
    };
    let t = "liqo-tunnel";
    assert_eq!(
        to_gateway(t, 17, LIQO_PING_PORT, CtState::New),
        (VerdictAction::Accept, "liqo_tunnel_check".into())
    );
    assert_eq!(
        to_gateway(t, 6, 22, CtState::New),
        (VerdictAction::Drop, "gateway_deny".into())
    );
    assert_eq!(
        to_gateway(t, 17, 53, CtState::New),
        (VerdictAction::Drop, "gateway_deny".into())
    );
    assert_eq!(
        to_gateway(t, 6, 22, CtState::Established).0,
        VerdictAction::Accept
    );
    assert_eq!(
        to_gateway("eth0", 6, 22, CtState::New).0,
        VerdictAction::Accept
    );
}

#[test]
fn configuration_sources_hold_own_and_seen_cidrs() {
    let body = json!({"spec": {"remote": {"cidr": {"pod": ["10.20.0.0/16"], "external": ["10.30.0.0/16"]}}},
        "status": {"remote": {"cidr": {"pod": ["10.71.0.0/16"], "external": ["10.72.0.0/16"]}}}});
    let (peer, s) = configuration_sources(&labels(&[(REMOTE_CLUSTER_ID, "c")]), &body).unwrap();
    assert_eq!(peer, "c");
    let want: Vec<ipnet::IpNet> = [
        "10.20.0.0/16",
        "10.30.0.0/16",
        "10.71.0.0/16",
        "10.72.0.0/16",
    ]
    .iter()
    .map(|c| c.parse().unwrap())
    .collect();
    assert_eq!(s, want);
}

fn desired(v: &[(&str, &[&str])]) -> BTreeMap<String, PeerSets> {
    v.iter()
        .map(|(peer, a)| {
            let s = PeerSets {
                offloaded: ips(a),
                ..Default::default()
            };
            (peer.to_string(), s)
        })
        .collect()
}

fn published(v: &[(&str, &[&str], bool)]) -> BTreeMap<String, Published> {
    v.iter()
        .map(|(peer, a, settled)| {
            let p = Published {
                offloaded: ips(a),
                settled: *settled,
            };
            (peer.to_string(), p)
        })
        .collect()
}

#[test]
fn reused_ip_waits_until_the_old_tenant_released_it() {
    let want = desired(&[("a", &[]), ("b", &["10.0.0.5"])]);
    // a still publishes the address: b must wait; a drops it at once.
    let (out, held) = gate_reuse(
        &want,
        &published(&[("a", &["10.0.0.5"], true), ("b", &[], true)]),
    );
    assert!(held);
    assert!(out["b"].offloaded.is_empty());
    assert!(out["a"].offloaded.is_empty());
    // a removed it but its agents have not enforced that yet: still wait.
    assert!(gate_reuse(&want, &published(&[("a", &[], false), ("b", &[], true)])).1);
    // enforced: b gets it.
    let (out, held) = gate_reuse(&want, &published(&[("a", &[], true), ("b", &[], true)]));
    assert!(!held);
    assert_eq!(out["b"].offloaded, ips(&["10.0.0.5"]));
}

#[test]
fn an_address_two_tenants_claim_stays_with_its_holder() {
    let want = desired(&[("a", &["10.0.0.5"]), ("b", &["10.0.0.5"])]);
    let (out, held) = gate_reuse(&want, &published(&[("a", &["10.0.0.5"], true)]));
    assert!(held);
    assert_eq!(out["a"].offloaded, ips(&["10.0.0.5"]));
    assert!(out["b"].offloaded.is_empty());
}

#[test]
fn network_policy_names_the_consumer() {
    let np = network_policy_spec("a", &[], &[]);
    assert_eq!(
        np["egress"][0]["to"][0]["namespaceSelector"]["matchExpressions"][0]["values"][0],
        "a"
    );
    assert_eq!(
        offloaded_namespace_owner(&ns(
            "liqo-tenant-a",
            &[(TENANT_NAMESPACE, "true"), (REMOTE_CLUSTER_ID, "a")]
        )),
        None
    );
    assert_eq!(
        offloaded_namespace_owner(&ns("x", &[(REMOTE_CLUSTER_ID, "a")])),
        Some("a")
    );
}

/// The offloaded namespaces' NetworkPolicy (what the controller writes on a provider),
/// judged as a label-aware CNI judges it: an offloaded pod calls home (its consumer's pods and
/// external CIDR, by the addresses seen here) and reaches its consumer's other offloaded
/// namespaces and DNS; not another consumer, its CIDRs, nor the provider's own pods.
#[test]
fn offloaded_pods_call_home_and_nowhere_else() {
    use peerwall_netpol::eval::{decide, Flow};
    use peerwall_netpol::testing::labels;
    use peerwall_netpol::{Cluster, Pod};
    use std::net::IpAddr;
    let pod_at = |ns: &str, name: &str, ip: &str, l: &[(&str, &str)]| {
        std::sync::Arc::new(Pod {
            namespace: ns.into(),
            name: name.into(),
            labels: labels(l),
            ips: vec![ip.parse().unwrap()],
            ..Default::default()
        })
    };
    let home_a: Vec<ipnet::IpNet> = vec![
        "10.10.0.0/16".parse().unwrap(),
        "10.110.0.0/16".parse().unwrap(),
    ];
    let home_b: Vec<ipnet::IpNet> = vec!["10.71.0.0/16".parse().unwrap()];
    let policy_of = |ns: &str, consumer: &str, home: &[ipnet::IpNet]| {
        peerwall_netpol::read::policy_json(offloaded_network_policy(ns, consumer, home, &[]))
            .unwrap()
    };
    let ns_labels = |name: &str, extra: &[(&str, &str)]| {
        let mut l = labels(extra);
        l.insert("kubernetes.io/metadata.name".into(), name.into());
        (name.to_string(), l)
    };
    let build = |home_a: &[ipnet::IpNet]| Cluster {
        namespaces: [
            ns_labels("offload-a", &[("liqo.io/remote-cluster-id", "a")]),
            ns_labels("offload-a2", &[("liqo.io/remote-cluster-id", "a")]),
            ns_labels("offload-b", &[("liqo.io/remote-cluster-id", "b")]),
            ns_labels("local", &[]),
            ns_labels("kube-system", &[]),
        ]
        .into_iter()
        .collect(),
        pods: vec![
            pod_at("offload-a", "p", "10.20.1.10", &[]),
            pod_at("offload-a2", "q", "10.20.1.11", &[]),
            pod_at("offload-b", "r", "10.20.2.10", &[]),
            pod_at("local", "s", "10.20.3.10", &[]),
            pod_at(
                "kube-system",
                "dns",
                "10.20.0.10",
                &[("k8s-app", "kube-dns")],
            ),
        ]
        .into(),
        policies: [
            policy_of("offload-a", "a", home_a),
            policy_of("offload-a2", "a", home_a),
            policy_of("offload-b", "b", &home_b),
        ]
        .into_iter()
        .map(std::sync::Arc::new)
        .collect(),
        cluster_policies: Vec::new(),
        remaps: Default::default(),
    };
    let c = build(&home_a);
    let p = c.pod("offload-a/p").unwrap();
    let to = |dst: &str, proto: u8, dport: u16| -> bool {
        let pod = c.pods.iter().map(|x| &**x).find(|x| x.key() == dst);
        let ip: IpAddr = pod.map_or_else(|| dst.parse().unwrap(), |x| x.ips[0]);
        decide(
            &c,
            &Flow {
                src: p.ips[0],
                dst: ip,
                proto,
                dport,
                src_pod: Some(p),
                dst_pod: pod,
            },
        )
        .allowed()
    };
    assert!(to("10.10.5.5", 6, 80), "its consumer's pods");
    assert!(to("10.110.0.7", 6, 443), "its consumer's external CIDR");
    assert!(
        to("offload-a2/q", 6, 80),
        "its consumer's other offloaded namespace"
    );
    assert!(to("kube-system/dns", 17, 53), "DNS");
    assert!(!to("kube-system/dns", 6, 80), "only DNS of kube-dns");
    assert!(!to("10.71.1.1", 6, 80), "another consumer's CIDR");
    assert!(
        !to("offload-b/r", 6, 80),
        "another consumer's offloaded pod"
    );
    assert!(!to("local/s", 6, 80), "the provider's own pods");
    // Without the consumer's CIDRs (the policy before this fix) the pod cannot call home.
    let old = build(&[]);
    let f = Flow {
        src: p.ips[0],
        dst: "10.10.5.5".parse().unwrap(),
        proto: 6,
        dport: 80,
        src_pod: old.pod("offload-a/p"),
        dst_pod: None,
    };
    assert!(!decide(&old, &f).allowed());
}
