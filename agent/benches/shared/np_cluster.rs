//! The cluster the NetworkPolicy benchmarks share (`bench-netpol`, and the gateway
//! benchmark's NetworkPolicy-derived policy): pods, namespaces and NetworkPolicies as the
//! controller reads them.

use std::collections::BTreeMap;

use peerwall::netpol::{
    Cluster, ContainerPort, NetworkPolicy, Peer, Pod, Port, Ports, Protocol, Rule, Selector,
};

/// Namespaces of the cluster.
pub(crate) const NAMESPACES: usize = 100;
/// The peer whose virtual node runs a fifth of the pods.
pub(crate) const PEER: &str = "p1";

pub(crate) fn labels(kv: &[(&str, String)]) -> BTreeMap<String, String> {
    kv.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// The cluster: pod `i` in namespace `ns{i % 100}`, labelled `app: a{i % 50}`,
/// `tier: x{i % 7}`, every fifth on the peer; policy `j` in `ns{j % 100}` selects
/// `app: a{j % 50}` and takes its port `http` from `tier: x{j % 7}` pods of the namespaces
/// labelled `team: t{j % 10}`.
/// `pods` pods in [`NAMESPACES`] namespaces (those `remote` picks on [`PEER`]'s virtual node,
/// 10.20.x; the others local, 10.10.x), each with a named port `http` 8080 of `protocol`, and `policies`
/// NetworkPolicies, each an ingress rule from a namespace and a pod selector on that port.
/// `remote(i)`: whether pod `i` runs on the peer.
pub(crate) fn cluster(
    pods: usize,
    policies: usize,
    protocol: Protocol,
    remote: impl Fn(usize) -> bool,
) -> Cluster {
    let mut c = Cluster::default();
    for n in 0..NAMESPACES {
        c.namespaces.insert(
            format!("ns{n}"),
            labels(&[
                ("team", format!("t{}", n % 10)),
                ("kubernetes.io/metadata.name", format!("ns{n}")),
            ]),
        );
    }
    for i in 0..pods {
        let remote = remote(i);
        let ip = format!(
            "10.{}.{}.{}",
            if remote { 20 } else { 10 },
            i / 250,
            i % 250 + 1
        );
        c.pods.push(std::sync::Arc::new(Pod {
            namespace: format!("ns{}", i % NAMESPACES),
            name: format!("p{i}"),
            labels: labels(&[
                ("app", format!("a{}", i % 50)),
                ("tier", format!("x{}", i % 7)),
            ]),
            ips: ip.parse().into_iter().collect(),
            local_ips: Vec::new(),
            ports: vec![ContainerPort {
                name: Some("http".into()),
                protocol,
                port: 8080,
            }],
            peer: remote.then(|| PEER.to_string()),
        }));
    }
    let selector = |k: &str, v: String| Selector {
        labels: labels(&[(k, v)]),
        exprs: Vec::new(),
    };
    for j in 0..policies {
        c.policies.push(std::sync::Arc::new(NetworkPolicy {
            namespace: format!("ns{}", j % NAMESPACES),
            name: format!("np{j}"),
            pod_selector: selector("app", format!("a{}", j % 50)),
            ingress: Some(vec![Rule {
                peers: vec![Peer::Pods {
                    namespaces: Some(selector("team", format!("t{}", j % 10))),
                    pods: Some(selector("tier", format!("x{}", j % 7))),
                }],
                ports: vec![Port {
                    protocol,
                    ports: Ports::Named("http".into()),
                }],
            }]),
            egress: None,
        }));
    }
    c
}
