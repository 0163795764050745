//! The lab's ClusterNetworkPolicies: what the provider admin writes over the lab's cluster,
//! one policy per tier behaviour, each visible in a row of the matrix.

use crate::netpol;

/// The provider admin's ClusterNetworkPolicies in the lab, one per tier behaviour, each
/// visible in a row of the matrix:
/// - an Admin Deny over a NetworkPolicy's allowance: `local/local-0`'s egress NetworkPolicy
///   lets it echo (UDP 9090) to a's pods; `no-echo-to-a` denies it;
/// - an Admin Accept over a NetworkPolicy's isolation: `local-0` takes only HTTP from the
///   provider's pod on c (`local-from-ours`); `ours-echo-home` accepts its UDP 9090 too;
/// - a Pass: `ours-http-to-owners` hands HTTP from that pod to the NetworkPolicies, before
///   `ours-nothing-else` denies everything else it sends to `local-0` (ICMP);
/// - a Baseline Deny where no NetworkPolicy isolates: `local/cache` refuses HTTP from everyone
///   by default (`cache-closed-by-default`), the provider's pod on c included.
pub fn lab_cluster_policies() -> Vec<netpol::cnp::ClusterNetworkPolicy> {
    use netpol::cnp::{Action, ClusterNetworkPolicy, Peer, Rule, Subject, Tier};
    use netpol::{Port, Ports, Protocol, Selector};
    let sel = |kv: &[(&str, &str)]| Selector {
        labels: kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        exprs: Vec::new(),
    };
    let pods_of = |ns: &str, app: &str| Subject::Pods {
        namespaces: sel(&[("kubernetes.io/metadata.name", ns)]),
        pods: sel(&[("app", app)]),
    };
    let ours = || Peer::Pods {
        namespaces: Selector::default(),
        pods: sel(&[("app", "ours")]),
    };
    let port = |protocol, n| Port {
        protocol,
        ports: Ports::Range(n, n),
    };
    let rule = |name: &str, action, peers, ports| Rule {
        name: name.into(),
        action,
        peers,
        ports,
    };
    let policy = |name: &str, tier, priority, subject, ingress, egress| ClusterNetworkPolicy {
        name: name.into(),
        tier,
        priority,
        subject,
        ingress,
        egress,
    };
    let a_pods = "10.10.1.0/24".parse().map(|n| vec![n]).unwrap_or_default();
    vec![
        policy(
            "ours-http-to-owners",
            Tier::Admin,
            10,
            pods_of("local", "local"),
            vec![rule(
                "http",
                Action::Pass,
                vec![ours()],
                vec![port(Protocol::Tcp, 8080)],
            )],
            Vec::new(),
        ),
        policy(
            "ours-echo-home",
            Tier::Admin,
            20,
            pods_of("local", "local"),
            vec![rule(
                "echo",
                Action::Accept,
                vec![ours()],
                vec![port(Protocol::Udp, 9090)],
            )],
            Vec::new(),
        ),
        policy(
            "no-echo-to-a",
            Tier::Admin,
            30,
            pods_of("local", "local"),
            Vec::new(),
            vec![rule(
                "echo",
                Action::Deny,
                vec![Peer::Networks(a_pods)],
                vec![port(Protocol::Udp, 9090)],
            )],
        ),
        policy(
            "ours-nothing-else",
            Tier::Admin,
            40,
            pods_of("local", "local"),
            vec![rule("all", Action::Deny, vec![ours()], Vec::new())],
            Vec::new(),
        ),
        policy(
            "cache-closed-by-default",
            Tier::Baseline,
            100,
            pods_of("local", "cache"),
            vec![rule(
                "http",
                Action::Deny,
                vec![Peer::Namespaces(Selector::default())],
                vec![port(Protocol::Tcp, 8080)],
            )],
            Vec::new(),
        ),
    ]
}
