//! ProtectionPolicies as data: validation with field paths, resolution per peer, and what the
//! merged gateway configuration and NetworkPolicy let through, judged by the reference
//! evaluator and by the NetworkPolicy evaluator.

use std::collections::BTreeMap;

use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};
use serde_json::json;

use super::*;
use crate::{
    gateway_spec_with, namespaces, Declared, Options, PeerSets, DEFAULT_TUNNEL, LIQO_PING_PORT,
};
use peerwall_netpol::{Cluster, Pod};

fn spec(v: serde_json::Value) -> ProtectionPolicySpec {
    serde_json::from_value(v).unwrap()
}

fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn pod(
    ns: &str,
    name: &str,
    ip: &str,
    l: &[(&str, &str)],
    peer: Option<&str>,
) -> std::sync::Arc<Pod> {
    std::sync::Arc::new(Pod {
        namespace: ns.into(),
        name: name.into(),
        labels: labels(l),
        ips: vec![ip.parse().unwrap()],
        peer: peer.map(str::to_string),
        ..Default::default()
    })
}

/// A provider with `monitoring` (prometheus, grafana), `shop` (our namespace with a pod on
/// peer `a`), another namespace `billing`, consumer a's offloaded namespace (with a pod
/// labelled like prometheus, which must never be selected) and a's tenant namespace.
fn cluster() -> Cluster {
    let ns = |name: &str, extra: &[(&str, &str)]| {
        let mut l = labels(extra);
        l.insert("kubernetes.io/metadata.name".into(), name.into());
        (name.to_string(), l)
    };
    Cluster {
        namespaces: [
            ns("monitoring", &[]),
            ns("shop", &[]),
            ns("billing", &[]),
            ns("app-a", &[(REMOTE_CLUSTER_ID, "a")]),
            ns(
                "liqo-tenant-a",
                &[(REMOTE_CLUSTER_ID, "a"), (TENANT_NAMESPACE, "true")],
            ),
        ]
        .into_iter()
        .collect(),
        pods: vec![
            pod(
                "monitoring",
                "prometheus",
                "10.20.5.10",
                &[("app", "prometheus")],
                None,
            ),
            pod(
                "monitoring",
                "grafana",
                "10.20.5.11",
                &[("app", "grafana")],
                None,
            ),
            pod("shop", "front", "10.20.6.10", &[("app", "front")], None),
            pod(
                "shop",
                "cart-on-a",
                "10.10.9.20",
                &[("app", "cart")],
                Some("a"),
            ),
            pod(
                "billing",
                "ledger",
                "10.20.7.10",
                &[("app", "ledger")],
                None,
            ),
            pod("app-a", "web", "10.20.1.10", &[("app", "prometheus")], None),
        ]
        .into(),
        policies: vec![],
        cluster_policies: vec![],
        remaps: Default::default(),
    }
}

fn defaults() -> Settings {
    Settings {
        audit: false,
        block_leaf_to_leaf: false,
        own_namespace_only: true,
    }
}

fn open_prometheus(from: &[&str], ports: serde_json::Value) -> ProtectionPolicySpec {
    spec(json!({
        "peers": ["a"],
        "open": [{
            "name": "prometheus",
            "from": from,
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}},
            "ports": ports,
        }],
    }))
}

#[test]
fn invalid_policies_name_the_field_and_the_value() {
    let cases = [
        (
            json!({"open": [{"name": "x", "from": ["PeerPods"], "podSelector": {}, "ports": [{"protocol": "ICMP"}]}]}),
            "spec.open[0].ports[0].protocol: \"ICMP\": one of TCP, UDP, SCTP",
        ),
        (
            json!({"open": [{"name": "x", "from": ["PeerPods"], "podSelector": {}, "ports": [{"port": 90, "endPort": 80}]}]}),
            "spec.open[0].ports[0].endPort: 80: below port 90",
        ),
        (
            json!({"open": [{"name": "x", "from": [], "podSelector": {}}]}),
            "spec.open[0].from: []: at least one of Offloaded, PeerPods, OwnPods",
        ),
        (
            json!({"open": [{"name": "x", "from": ["OwnPods"]}]}),
            "spec.open[0].namespaceSelector: \"absent\": select the pods",
        ),
        (
            json!({"open": [{"name": "Bad_Name", "from": ["OwnPods"], "podSelector": {}}]}),
            "spec.open[0].name: \"Bad_Name\": a DNS label",
        ),
        (
            json!({"open": [{"name": "x", "from": ["OwnPods"], "podSelector": {"matchExpressions": [{"key": "app", "operator": "Equals", "values": ["a"]}]}}]}),
            "spec.open[0].podSelector.matchExpressions[0].operator: \"Equals\": one of In, NotIn, Exists, DoesNotExist",
        ),
        (
            json!({"open": [{"name": "x", "from": ["OwnPods"], "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]}}]}),
            "spec.open[0].namespaceSelector.matchExpressions[0].values: []: In and NotIn need at least one value",
        ),
        (
            json!({"open": [{"name": "x", "from": ["OwnPods"], "podSelector": {}}], "close": [{"name": "x", "ports": [{"port": 22}]}]}),
            "spec.close[0].name: \"x\": used twice in open/close",
        ),
        (
            json!({"close": [{"name": "ssh", "ports": []}]}),
            "spec.close[0].ports: []: at least one port",
        ),
        (
            json!({"peers": ["a", "a"]}),
            "spec.peers[1]: \"a\": named twice",
        ),
    ];
    for (v, want) in cases {
        let err = check("p", &spec(v.clone())).unwrap_err().to_string();
        assert!(err.starts_with(want), "{v}: {err}");
    }
    // Unknown fields are refused by the type itself (the webhook reports serde's path).
    assert!(serde_json::from_value::<ProtectionPolicySpec>(json!({"opn": []})).is_err());
}

#[test]
fn openings_select_provider_pods_only_and_settings_apply_in_order() {
    let c = cluster();
    let every = check(
        "a-every",
        &spec(json!({"settings": {"blockLeafToLeaf": true, "audit": true}})),
    )
    .unwrap();
    let named = check(
        "z-named",
        &open_prometheus(&["PeerPods"], json!([{"port": 8080}])),
    )
    .unwrap();
    let mut named_audit = named.clone();
    named_audit.switches.audit = Some(false);
    // A policy naming the peer comes after the ones for every peer, whatever the names.
    let f = for_peer(&[named_audit, every.clone()], "a", defaults(), &c);
    assert!(f.settings.block_leaf_to_leaf);
    assert!(!f.settings.audit);
    assert_eq!(f.open.len(), 1);
    // consumer a's offloaded pod carries the same label: never selected.
    assert_eq!(
        f.open[0]
            .addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        vec!["10.20.5.10"]
    );
    // Another peer gets the every-peer settings, not the opening.
    let g = for_peer(&[named, every], "b", defaults(), &c);
    assert!(g.open.is_empty());
    assert!(g.settings.audit);
}

/// The merged gateway configuration of peer a, compiled as the agent compiles it.
fn compiled(policies: &[Checked], own_namespace_only: bool) -> peerwall_policy::ir::Policy {
    let c = cluster();
    let opts = Options {
        tunnel: DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: LIQO_PING_PORT,
        own_namespace_only,
        inline_budget: crate::spill::INLINE_BUDGET,
    };
    let d = Declared {
        namespaces: namespaces::namespace_sets(&c, "a"),
        exceptions: for_peer(policies, "a", opts.settings(), &c),
    };
    let s = PeerSets {
        offloaded: ["10.20.1.10".parse().unwrap()].into(),
        remote: ["10.10.9.20".parse().unwrap()].into(),
        ..Default::default()
    };
    // The peer's Configuration is known (its pods, and our pods it runs, are in 10/8).
    let spec = gateway_spec_with("a", &["10.0.0.0/8".parse().unwrap()], &s, &opts, &d);
    let doc = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
        "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
    let obj = peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
        .unwrap();
    peerwall_policy::compile::compile(&[obj]).unwrap().policy
}

fn verdict(
    policy: &peerwall_policy::ir::Policy,
    src: &str,
    dst: &str,
    proto: u8,
    dport: u16,
    ct: CtState,
) -> (VerdictAction, String) {
    let v = evaluate(
        policy,
        &Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            sport: 40000,
            dport,
            iif: Some("liqo-tunnel".into()),
            oif: Some("liqo.x".into()),
            ct_state: ct,
        },
    );
    (v.verdict, v.rule.unwrap_or_default())
}

#[test]
fn an_opening_for_the_peers_pods_lets_them_reach_the_selected_pods_on_its_ports_only() {
    let p = check(
        "metrics",
        &open_prometheus(
            &["PeerPods"],
            json!([{"port": 8080}, {"protocol": "UDP", "port": 9000, "endPort": 9010}]),
        ),
    )
    .unwrap();
    let policy = compiled(&[p], true);
    let new = CtState::New;
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.5.10", 6, 8080, new),
        (VerdictAction::Accept, "open.metrics.prometheus.tcp".into())
    );
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.5.10", 17, 9005, new),
        (VerdictAction::Accept, "open.metrics.prometheus.udp".into())
    );
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.5.10", 6, 22, new),
        (VerdictAction::Drop, "default_deny".into())
    );
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.5.11", 6, 8080, new),
        (VerdictAction::Drop, "default_deny".into())
    );
    // Without the policy, prometheus is closed too (the opening is what opens it).
    let closed = compiled(&[], true);
    assert_eq!(
        verdict(&closed, "10.10.1.5", "10.20.5.10", 6, 8080, new).0,
        VerdictAction::Drop
    );
}

#[test]
fn an_opening_for_our_pods_only_leaves_the_peers_pods_out() {
    let p = check("metrics", &open_prometheus(&["OwnPods"], json!([]))).unwrap();
    let policy = compiled(&[p], true);
    let new = CtState::New;
    // Our cart running on a reaches prometheus on any port; a's own pod does not.
    assert_eq!(
        verdict(&policy, "10.10.9.20", "10.20.5.10", 17, 53, new),
        (VerdictAction::Accept, "open.metrics.prometheus".into())
    );
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.5.10", 17, 53, new).0,
        VerdictAction::Drop
    );
}

#[test]
fn consumer_protection_keeps_our_pods_in_their_namespace_unless_told_otherwise() {
    let policy = compiled(&[], true);
    let new = CtState::New;
    // cart (shop, running on a) reaches shop's front, not billing's ledger nor monitoring.
    assert_eq!(
        verdict(&policy, "10.10.9.20", "10.20.6.10", 6, 80, new),
        (VerdictAction::Accept, "own.shop".into())
    );
    assert_eq!(
        verdict(&policy, "10.10.9.20", "10.20.7.10", 6, 80, new),
        (VerdictAction::Drop, "default_deny".into())
    );
    // The peer's own pods never count as ours.
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.6.10", 6, 80, new).0,
        VerdictAction::Drop
    );
    // `ownNamespaceOnly: false` (per peer) or the controller's flag: every pod here.
    let wide = check(
        "wide",
        &spec(json!({"peers": ["a"], "settings": {"ownNamespaceOnly": false}})),
    )
    .unwrap();
    for policy in [compiled(&[wide], true), compiled(&[], false)] {
        assert_eq!(
            verdict(&policy, "10.10.9.20", "10.20.7.10", 6, 80, new),
            (VerdictAction::Accept, "from_own_pods".into())
        );
    }
}

#[test]
fn a_closing_drops_new_connections_to_offloaded_pods_but_not_replies() {
    let p = check(
        "no-ssh",
        &spec(json!({"close": [{"name": "ssh", "ports": [{"port": 22}]}]})),
    )
    .unwrap();
    let policy = compiled(&[p], true);
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.1.10", 6, 22, CtState::New),
        (VerdictAction::Drop, "close.no-ssh.ssh.tcp".into())
    );
    assert_eq!(
        verdict(&policy, "10.10.1.5", "10.20.1.10", 6, 80, CtState::New),
        (VerdictAction::Accept, "to_offloaded".into())
    );
    assert_eq!(
        verdict(
            &policy,
            "10.10.1.5",
            "10.20.1.10",
            6,
            22,
            CtState::Established
        )
        .0,
        VerdictAction::Accept
    );
    // A packet conntrack does not track (Liqo's `gw-notrack` takes the Geneve port's UDP out
    // of conntrack on every interface) is refused as a new one is, not let to `to_offloaded`.
    assert_eq!(
        verdict(
            &policy,
            "10.10.1.5",
            "10.20.1.10",
            6,
            22,
            CtState::Untracked
        ),
        (VerdictAction::Drop, "close.no-ssh.ssh.tcp".into())
    );
}

/// The offloaded namespaces' NetworkPolicy with an opening for offloaded pods, judged by the
/// NetworkPolicy evaluator as a label-aware CNI evaluates it: the selected provider pod on
/// the opened port, nothing else of the provider, and never a pod of a consumer's
/// namespace that carries the same labels.
#[test]
fn an_opening_for_offloaded_pods_goes_into_their_network_policy() {
    use peerwall_netpol::eval::{decide, Flow};
    let p = check(
        "metrics",
        &open_prometheus(&["Offloaded"], json!([{"port": 8080}])),
    )
    .unwrap();
    let mut c = cluster();
    c.namespaces.insert(
        "app-b".into(),
        labels(&[
            (REMOTE_CLUSTER_ID, "b"),
            ("kubernetes.io/metadata.name", "monitoring"),
        ]),
    );
    c.pods.push(pod(
        "app-b",
        "b-prom",
        "10.20.2.10",
        &[("app", "prometheus")],
        None,
    ));
    let f = for_peer(&[p], "a", defaults(), &c);
    let open: Vec<&Open> = f.for_offloaded().collect();
    assert_eq!(open.len(), 1);
    c.policies.push(std::sync::Arc::new(
        peerwall_netpol::read::policy_json(crate::offloaded_network_policy(
            "app-a",
            "a",
            &[],
            &open,
        ))
        .unwrap(),
    ));
    let from = c.pod("app-a/web").unwrap().clone();
    let allowed = |to: &str, dport: u16| {
        let to = c.pod(to).unwrap();
        decide(
            &c,
            &Flow {
                src: from.ips[0],
                dst: to.ips[0],
                proto: Protocol::Tcp.number(),
                dport,
                src_pod: Some(&from),
                dst_pod: Some(to),
            },
        )
        .allowed()
    };
    assert!(allowed("monitoring/prometheus", 8080));
    assert!(!allowed("monitoring/prometheus", 22));
    assert!(!allowed("monitoring/grafana", 8080));
    assert!(!allowed("app-b/b-prom", 8080));
    assert_eq!(
        reports(&f)["metrics"],
        PeerReport {
            gateway_rules: 0,
            selected_addresses: 1,
            network_policy_rules: 1
        }
    );
}
