//! NetworkPolicies and ClusterNetworkPolicies across the gateway, through the real binary:
//! random cluster snapshots (namespaces, local and remote pods with named ports,
//! NetworkPolicies of every shape, ClusterNetworkPolicies of both tiers) judged
//! with `peerwall verdict --cluster --matrix` by the reference evaluator and by both kernels
//! (nftables in a scratch namespace, the eBPF datapath under BPF_PROG_TEST_RUN): the three
//! truth tables must be equal. The reference is held to the NetworkPolicy semantics by the
//! unit tests of `netpol` (`the_tier_gives_the_semantics_verdict_for_every_crossing_pair`,
//! and `..._with_cluster_policies` for both tiers).

use peerwall_testkit::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn selector(rng: &mut StdRng, key: &str, values: &[&str]) -> Value {
    match rng.random_range(0..5) {
        0 => json!({}),
        1 => json!({"matchLabels": {key: values[rng.random_range(0..values.len())]}}),
        n => {
            let op = ["In", "NotIn", "Exists", "DoesNotExist"][(n + rng.random_range(0..2)) % 4];
            let mut e = json!({"key": key, "operator": op});
            if op == "In" || op == "NotIn" {
                e["values"] = json!(values
                    .iter()
                    .filter(|_| rng.random_bool(0.5))
                    .collect::<Vec<_>>());
            }
            json!({"matchExpressions": [e]})
        }
    }
}

fn rules(rng: &mut StdRng, peers_key: &str) -> Value {
    let n = rng.random_range(0..3);
    let rules: Vec<Value> = (0..n)
        .map(|_| {
            let mut r = json!({});
            let peers: Vec<Value> = (0..rng.random_range(0..3))
                .map(|_| match rng.random_range(0..4) {
                    0 => {
                        let cidr = ["10.0.0.0/8", "10.2.0.0/16", "10.1.0.0/30"][rng.random_range(0..3)];
                        let mut b = json!({ "cidr": cidr });
                        if rng.random_bool(0.5) {
                            b["except"] = json!(["10.2.0.2/31"]);
                        }
                        json!({"ipBlock": b})
                    }
                    1 => json!({"podSelector": selector(rng, "pod", &["a", "b", "c"])}),
                    2 => json!({"namespaceSelector": selector(rng, "ns", &["x", "y", "z"])}),
                    _ => json!({
                        "namespaceSelector": selector(rng, "ns", &["x", "y", "z"]),
                        "podSelector": selector(rng, "pod", &["a", "b", "c"]),
                    }),
                })
                .collect();
            if !peers.is_empty() || rng.random_bool(0.3) {
                r[peers_key] = json!(peers);
            }
            let ports: Vec<Value> = (0..rng.random_range(0..3))
                .map(|_| {
                    let proto = ["TCP", "TCP", "UDP", "SCTP"][rng.random_range(0..4)];
                    match rng.random_range(0..4) {
                        0 => json!({"protocol": proto}),
                        1 => json!({"protocol": proto, "port": 80}),
                        2 => json!({"protocol": proto, "port": 81, "endPort": 8081}),
                        _ => json!({"protocol": proto, "port": format!("serve-81-{}", proto.to_lowercase())}),
                    }
                })
                .collect();
            if !ports.is_empty() {
                r["ports"] = json!(ports);
            }
            r
        })
        .collect();
    json!(rules)
}

/// A consumer-side snapshot: x and z run locally, y's pods run on peer `p1`.
fn snapshot(rng: &mut StdRng) -> String {
    let mut items = vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "liqo-tenant-p1",
            "labels": {"liqo.io/tenant-namespace": "true", "liqo.io/remote-cluster-id": "p1"}}}),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "liqo-p1",
            "labels": {"liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "p1"}}}),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "worker"}}),
    ];
    for (n, ns) in ["x", "y", "z"].iter().enumerate() {
        items.push(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": {"ns": ns}}}));
        for (m, p) in ["a", "b", "c"].iter().enumerate() {
            let ip = format!("10.{}.0.{}", n + 1, m + 1);
            let p81 = if rng.random_bool(0.3) { 8081 } else { 81 };
            items.push(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": p, "namespace": ns, "labels": {"pod": p}},
                "spec": {"nodeName": if *ns == "y" { "liqo-p1" } else { "worker" },
                    "containers": [{"name": "c", "image": "agnhost", "ports": [
                        {"name": "serve-80-tcp", "containerPort": 80},
                        {"name": "serve-81-tcp", "containerPort": p81},
                        {"name": "serve-81-udp", "containerPort": p81, "protocol": "UDP"},
                        {"name": "serve-81-sctp", "containerPort": p81, "protocol": "SCTP"}]}]},
                "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}));
        }
    }
    for i in 0..rng.random_range(1..5) {
        let ns = ["x", "y", "z"][rng.random_range(0..3)];
        let mut spec = json!({"podSelector": selector(rng, "pod", &["a", "b", "c"])});
        match rng.random_range(0..4) {
            0 => spec["ingress"] = rules(rng, "from"),
            1 => {
                spec["egress"] = rules(rng, "to");
                spec["policyTypes"] = json!(["Egress"]);
            }
            2 => {
                spec["ingress"] = rules(rng, "from");
                spec["egress"] = rules(rng, "to");
                spec["policyTypes"] = json!(["Ingress", "Egress"]);
            }
            // policyTypes left to the defaults: Egress only when egress rules are given.
            _ => spec["egress"] = rules(rng, "to"),
        }
        items.push(
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": format!("p{i}"), "namespace": ns}, "spec": spec}),
        );
    }
    items.extend(cluster_policies(rng));
    serde_yaml::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": items})).unwrap()
}

/// Zero to three random ClusterNetworkPolicies (v1alpha2): either tier, tying priorities, every
/// subject, peer and action, ports by number, range and name, a peer peerwall does not enforce.
fn cluster_policies(rng: &mut StdRng) -> Vec<Value> {
    let rules = |rng: &mut StdRng, peers_key: &str| -> Value {
        let egress = peers_key == "to";
        let list: Vec<Value> = (0..rng.random_range(1..3))
            .map(|_| {
                let peers: Vec<Value> = (0..rng.random_range(1..3))
                    .map(|_| match rng.random_range(0..if egress { 5 } else { 3 }) {
                        0 => json!({"namespaces": selector(rng, "ns", &["x", "y", "z"])}),
                        1 => json!({"pods": {"namespaceSelector": selector(rng, "ns", &["x", "y", "z"]),
                                             "podSelector": selector(rng, "pod", &["a", "b", "c"])}}),
                        2 => json!({"pods": {"namespaceSelector": {},
                                             "podSelector": selector(rng, "pod", &["a", "b", "c"])}}),
                        3 => {
                            let net = ["10.0.0.0/8", "10.2.0.0/16", "10.1.0.0/30"]
                                [rng.random_range(0..3)];
                            json!({"networks": [net]})
                        }
                        _ => json!({"domainNames": ["example.com"]}),
                    })
                    .collect();
                let action = ["Accept", "Deny", "Pass"][rng.random_range(0..3)];
                let mut r = json!({"action": action, peers_key: peers});
                if rng.random_bool(0.6) {
                    r["protocols"] = json!([match rng.random_range(0..4) {
                        0 => json!({"tcp": {"destinationPort": {"number": 80}}}),
                        1 => json!({"udp": {"destinationPort": {"range": {"start": 81, "end": 8081}}}}),
                        2 => json!({"sctp": {"destinationPort": {"number": 81}}}),
                        _ => json!({"destinationNamedPort": "serve-81-tcp"}),
                    }]);
                }
                r
            })
            .collect();
        Value::from(list)
    };
    (0..rng.random_range(0..4))
        .map(|i| {
            let subject = if rng.random_bool(0.5) {
                json!({"namespaces": selector(rng, "ns", &["x", "y", "z"])})
            } else {
                json!({"pods": {"namespaceSelector": selector(rng, "ns", &["x", "y", "z"]),
                                "podSelector": selector(rng, "pod", &["a", "b", "c"])}})
            };
            let mut spec = json!({
                "tier": if rng.random_bool(0.5) { "Admin" } else { "Baseline" },
                "priority": rng.random_range(0..3),
                "subject": subject,
            });
            if rng.random_bool(0.7) {
                spec["ingress"] = rules(rng, "from");
            }
            if rng.random_bool(0.7) {
                spec["egress"] = rules(rng, "to");
            }
            json!({"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
                   "metadata": {"name": format!("cnp{i}")}, "spec": spec})
        })
        .collect()
}

fn matrix(dir: &std::path::Path, engine: &str) -> Vec<Value> {
    let o = std::process::Command::new(peerwall())
        .args(["verdict", "--cluster"])
        .arg(dir)
        .args(["--matrix", "--engine", engine, "--output", "json"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{engine}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let rows: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
    rows.into_iter()
        .map(|mut r| {
            // The kernels name the deciding rule as the reference does; the verdict and
            // the rule are compared, the accepting chain's policy aside.
            r.as_object_mut().unwrap().remove("chain");
            r
        })
        .collect()
}

#[test]
fn random_snapshots_give_the_same_truth_table_on_every_engine() {
    require_root();
    let dir = std::env::temp_dir().join(format!("pw-netpol-{}", std::process::id()));
    let mut rng = StdRng::seed_from_u64(1819);
    let mut cells = 0;
    let mut denied = 0;
    for round in 0..6 {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cluster.yaml"), snapshot(&mut rng)).unwrap();
        let reference = matrix(&dir, "reference");
        // 9 pods, 3 remote: 2 x 3 x 6 = 36 crossing pairs, 6 probes each.
        assert_eq!(reference.len(), 36 * 6, "round {round}");
        for engine in ["nftables", "bpf"] {
            let got = matrix(&dir, engine);
            for (r, g) in reference.iter().zip(&got) {
                assert_eq!(
                    r,
                    g,
                    "round {round}, {engine}: {}",
                    std::fs::read_to_string(dir.join("cluster.yaml")).unwrap()
                );
            }
        }
        cells += reference.len();
        denied += reference.iter().filter(|r| r["verdict"] == "drop").count();
    }
    // The snapshots exercise both outcomes.
    assert!(
        denied > cells / 10 && denied < cells * 9 / 10,
        "{denied} of {cells} denied"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `peerwall verdict --cluster examples/cluster ARGS`.
fn example_verdict(args: &[&str]) -> std::process::Output {
    std::process::Command::new(peerwall())
        .args(["verdict", "--cluster"])
        .arg(repo("examples/cluster"))
        .args(args)
        .output()
        .unwrap()
}

/// The shipped example: the truth table its comments promise, on every engine (the offloaded
/// backend reaches frontend/web only because the example's ProtectionPolicy opens it:
/// consumer protection keeps it in its namespace otherwise).
#[test]
fn the_example_cluster_matrix() {
    require_root();
    for engine in ["reference", "nftables", "bpf"] {
        let o = example_verdict(&[
            "--matrix", "--proto", "tcp", "--dport", "8080", "--engine", engine,
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            "TCP/8080\n\
             -               backend/api  backend/db  frontend/shell  frontend/web\n\
             backend/api     -            -           X               .\n\
             backend/db      -            -           X               .\n\
             frontend/shell  X            X           -               -\n\
             frontend/web    .            X           -               -\n\n",
            "{engine}"
        );
    }
    // One pair, named: the deciding rule names the policy.
    let o = example_verdict(&[
        "--from",
        "frontend/shell",
        "--to",
        "backend/db",
        "--dport",
        "5432",
        "--output",
        "json",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        r#"{"verdict":"drop","table":"pwnp_provider1","chain":"ingress","rule":"backend/db-from-api:ingress isolated"}"#
    );
    // Pods that do not cross a gateway are refused with the reason.
    let o = example_verdict(&["--from", "frontend/shell", "--to", "frontend/web"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("both run locally"));
}

/// `verdict --cluster` with an address for a peer's pod the snapshot does not hold (what a
/// provider asks about a consumer's pods): judged as the gateway sees it, on every engine. On
/// the example (this cluster the consumer, provider1's pods in 10.20.0.0/16): frontend/shell's
/// egress opens the provider's range, so an unknown pod there is reached; an address of a pod
/// the snapshot holds is that pod (backend/db, excepted); the consumer protection keeps a
/// provider pod that is not offloaded from frontend/web, where the offloaded backend/api
/// passes. A peer that is not in the snapshot is refused with the ones that are.
#[test]
fn the_example_cluster_judges_a_peers_pod_by_its_address() {
    require_root();
    let cases = [
        ("frontend/shell", "10.20.7.7", "80", "accept"),
        ("frontend/shell", "10.20.1.11", "5432", "drop"),
        ("10.20.7.7", "frontend/web", "8080", "drop"),
        ("10.20.1.10", "frontend/web", "8080", "accept"),
    ];
    for engine in ["reference", "nftables", "bpf"] {
        for (from, to, dport, verdict) in cases {
            let o = example_verdict(&[
                "--from", from, "--to", to, "--dport", dport, "--engine", engine, "--output",
                "json",
            ]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["verdict"], verdict, "{engine} {from} -> {to}: {v}");
        }
    }
    // The trace names the address, not a pod of this cluster.
    let o = example_verdict(&[
        "--from",
        "10.20.7.7",
        "--to",
        "frontend/web",
        "--dport",
        "8080",
        "--peer",
        "provider1",
        "--trace",
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(
            "egress of 10.20.7.7 (a pod of peer provider1):\n  not a pod of this cluster"
        ),
        "{text}"
    );
    assert!(
        text.starts_with("drop (rule peerwall_provider1/from_peer/default_deny)"),
        "{text}"
    );
    let o = example_verdict(&[
        "--from",
        "10.20.7.7",
        "--to",
        "frontend/web",
        "--peer",
        "nope",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--peer \"nope\": no such peer in the snapshot (peers: provider1)"),
        "{err}"
    );
}

/// The shipped admin example (`examples/admin/`, ClusterNetworkPolicies over the example
/// cluster): an Admin Deny, an Admin Pass to an allowing and to an isolating NetworkPolicy, and
/// a Baseline Deny, each with the verdict every engine gives and the trace naming the tier,
/// policy and rule that decided.
#[test]
fn the_admin_example_explains_each_tier() {
    require_root();
    let cases = [
        (
            "frontend/shell",
            "backend/api",
            "8080",
            "drop",
            "Admin tier: denied by ClusterNetworkPolicy no-shell-to-backend, rule 0",
        ),
        (
            "frontend/web",
            "backend/api",
            "8080",
            "accept",
            "NetworkPolicies: allowed by backend/api-from-web, rule 0",
        ),
        (
            "frontend/web",
            "backend/db",
            "5432",
            "drop",
            "NetworkPolicies: isolated by backend/db-from-api and no rule allows it: denied",
        ),
        (
            "backend/api",
            "frontend/web",
            "8080",
            "drop",
            "Baseline tier: denied by ClusterNetworkPolicy frontend-closed-by-default, rule 0",
        ),
    ];
    for engine in ["reference", "nftables", "bpf"] {
        for (from, to, dport, verdict, last) in cases {
            let o = std::process::Command::new(peerwall())
                .args(["verdict", "--cluster"])
                .arg(repo("examples/cluster"))
                .arg(repo("examples/admin"))
                .args(["--from", from, "--to", to, "--dport", dport, "--trace"])
                .args(["--engine", engine, "--output", "json"])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(
                v["verdict"]["verdict"], verdict,
                "{engine} {from} -> {to}: {v}"
            );
            let steps = &v["trace"]["ingress"]["steps"];
            let text = steps.to_string();
            assert!(
                steps.as_array().unwrap().last().unwrap() == last,
                "{engine} {from} -> {to}: {text}"
            );
            if last.starts_with("NetworkPolicies") {
                assert!(text.contains("Admin tier: passed on by ClusterNetworkPolicy frontend-to-namespace-owners"), "{text}");
            }
        }
    }
}
