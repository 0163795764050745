//! Which tracked connections a policy change ends: those whose first packet the policy in
//! force allowed before the change and refuses after it, whichever tier refuses it now (a pod
//! that left a NetworkPolicy's peers, or provider protection's `offloaded` set: deleted,
//! relabelled, its address reused). Pure: policies and flows in, flows out; the agent lists
//! and ends them through the backend ([`crate::engine`]).
//!
//! Judged by the reference evaluator, for the flow's original direction as a new, forwarded
//! packet (Liqo's NAT in front, as the policy observes it), once for each input interface the
//! policies name (the tunnel) and once for one they do not (a node): a flow is ended when one
//! of them was allowed and is refused now. Both judgements read the same tuple, so a
//! connection the policy never allowed is never ended here, whatever address view it was
//! tracked under.

use std::collections::BTreeSet;

use peerwall_backend::Flow;
use peerwall_policy::ir::{self, CtState, IfDir, Packet, Policy, Test, VerdictAction};

/// An interface name no policy names (a packet from a node, not from a tunnel).
const ELSEWHERE: &str = "-";

/// The input interfaces `policy`'s rules name (a prefix stands for the names it matches).
fn named_inputs(policy: &Policy, out: &mut BTreeSet<String>) {
    for t in &policy.tables {
        for c in &t.chains {
            for r in &c.rules {
                for m in &r.matches {
                    if let Test::Iface {
                        dir: IfDir::In,
                        name,
                        ..
                    } = &m.test
                    {
                        out.insert(name.clone());
                    }
                }
            }
        }
    }
}

fn allows(policy: &Policy, f: &Flow, iif: &str) -> bool {
    let pkt = Packet {
        src: f.src,
        dst: f.dst,
        proto: f.proto,
        sport: f.sport,
        dport: f.dport,
        iif: Some(iif.into()),
        oif: Some(ELSEWHERE.into()),
        ct_state: CtState::New,
    };
    ir::evaluate_at_ingress(policy, &pkt).verdict == VerdictAction::Accept
}

/// The flows `before` allowed and `after` refuses, from the same input interface.
pub fn no_longer_allowed(before: &Policy, after: &Policy, flows: &[Flow]) -> Vec<Flow> {
    if before.tables == after.tables {
        return Vec::new();
    }
    let mut inputs = BTreeSet::from([ELSEWHERE.to_string()]);
    named_inputs(before, &mut inputs);
    named_inputs(after, &mut inputs);
    flows
        .iter()
        .filter(|f| f.src.is_ipv4() == f.dst.is_ipv4())
        .filter(|f| {
            inputs
                .iter()
                .any(|i| allows(before, f, i) && !allows(after, f, i))
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netpol::{
        Cluster, IpBlock, NetworkPolicy, Peer, Pod, Port, Ports, Protocol, Rule, Selector,
    };
    use crate::protection::{gateway_spec, Options, PeerSets};

    fn cluster(from: &[&str]) -> Cluster {
        let pod = |ns: &str, name: &str, ip: &str, peer: Option<&str>| Pod {
            namespace: ns.into(),
            name: name.into(),
            labels: [("app".to_string(), name.to_string())].into(),
            ips: vec![ip.parse().unwrap()],
            local_ips: Vec::new(),
            ports: Vec::new(),
            peer: peer.map(str::to_string),
        };
        Cluster {
            pods: vec![
                pod("shop", "db", "10.20.1.3", Some("peer1")),
                pod("shop", "web", "10.10.1.68", None),
            ],
            policies: vec![NetworkPolicy {
                namespace: "shop".into(),
                name: "db-in".into(),
                pod_selector: Selector {
                    labels: [("app".to_string(), "db".to_string())].into(),
                    ..Selector::default()
                },
                ingress: Some(vec![Rule {
                    peers: from
                        .iter()
                        .map(|c| {
                            Peer::Block(IpBlock {
                                cidr: c.parse().unwrap(),
                                except: Vec::new(),
                            })
                        })
                        .collect(),
                    ports: vec![Port {
                        protocol: Protocol::Tcp,
                        ports: Ports::Range(8080, 8080),
                    }],
                }]),
                egress: None,
            }],
            ..Cluster::default()
        }
    }

    fn tables(c: &Cluster) -> Policy {
        peerwall_netpol::testing::compiled(c)
    }

    #[test]
    fn a_removed_allowance_ends_only_the_flows_it_allowed() {
        let flow = |src: &str, dport: u16| Flow {
            src: src.parse().unwrap(),
            dst: "10.20.1.3".parse().unwrap(),
            proto: 6,
            sport: 40000,
            dport,
        };
        let both = tables(&cluster(&["10.10.1.67/32", "10.10.1.68/32"]));
        let one = tables(&cluster(&["10.10.1.67/32"]));
        let flows = [
            flow("10.10.1.68", 8080),
            flow("10.10.1.67", 8080),
            flow("10.10.1.68", 22),
        ];
        // .68 loses its allowance; .67 keeps it; port 22 was never allowed: left alone.
        assert_eq!(no_longer_allowed(&both, &one, &flows), vec![flows[0]]);
        // Widening ends nothing; nor does an unchanged tier.
        assert!(no_longer_allowed(&one, &both, &flows).is_empty());
        assert!(no_longer_allowed(&one, &one, &flows).is_empty());
    }

    /// Provider protection: an offloaded pod leaving the `offloaded` set ends what its peer's
    /// pods opened to it through the tunnel; what our pods opened towards the peer stays.
    #[test]
    fn a_pod_leaving_the_offloaded_set_ends_its_flows_from_the_tunnel() {
        let gateway = |pods: &[&str]| {
            let s = PeerSets {
                offloaded: pods.iter().map(|p| p.parse().unwrap()).collect(),
                ..Default::default()
            };
            let spec = gateway_spec(
                "a",
                &[],
                &s,
                &Options {
                    tunnel: "liqo-tunnel*".into(),
                    block_leaf_to_leaf: false,
                    audit: false,
                    liqo_ping_port: crate::protection::LIQO_PING_PORT,
                    own_namespace_only: false,
                },
            );
            let doc = serde_json::json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
                "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
            let obj = peerwall_intent::load::object_from_json(
                doc,
                peerwall_intent::load::Group::Peerwall,
            )
            .unwrap();
            peerwall_policy::compile::compile(&[obj]).unwrap().policy
        };
        let flow = |src: &str, dst: &str| Flow {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto: 17,
            sport: 40000,
            dport: 9090,
        };
        let before = gateway(&["10.20.1.2", "10.20.1.3"]);
        let after = gateway(&["10.20.1.2"]);
        let flows = [
            flow("10.10.1.67", "10.20.1.3"),
            flow("10.10.1.67", "10.20.1.2"),
            flow("10.20.3.1", "10.10.1.67"),
        ];
        assert_eq!(no_longer_allowed(&before, &after, &flows), vec![flows[0]]);
    }
}
