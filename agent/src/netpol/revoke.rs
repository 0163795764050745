//! Which tracked connections a change of the NetworkPolicy tier ends: those whose first packet
//! the tier's tables allowed before the change and refuse after it. Pure: tables and flows in,
//! flows out; the agent lists and ends them through the backend ([`crate::engine`]).
//!
//! Judged by the reference evaluator on the tier's tables alone (their rules test addresses,
//! protocols and ports, never interfaces), for the flow's original direction as a new,
//! forwarded packet. Both judgements read the same tuple, so a connection the tier never
//! allowed is never ended here, whatever address view it was tracked under.

use peerwall_backend::Flow;
use peerwall_policy::ir::{self, CtState, Packet, Policy, VerdictAction};

/// Whether `table` is a NetworkPolicy tier table ([`super::tier::table_name`]).
pub fn is_tier_table(table: &ir::Table) -> bool {
    table.name.starts_with(super::tier::TABLE_PREFIX)
}

/// The tier tables of `policy`.
pub fn tier_tables(policy: &Policy) -> Vec<ir::Table> {
    policy
        .tables
        .iter()
        .filter(|t| is_tier_table(t))
        .cloned()
        .collect()
}

fn allows(tables: &Policy, f: &Flow) -> bool {
    // The tier's rules name no interface: any names put the packet on the forward path.
    let pkt = Packet {
        src: f.src,
        dst: f.dst,
        proto: f.proto,
        sport: f.sport,
        dport: f.dport,
        iif: Some("-".into()),
        oif: Some("-".into()),
        ct_state: CtState::New,
    };
    ir::evaluate(tables, &pkt).verdict == VerdictAction::Accept
}

/// The flows `before`'s tier tables allowed and `after`'s refuse.
pub fn no_longer_allowed(before: &[ir::Table], after: &[ir::Table], flows: &[Flow]) -> Vec<Flow> {
    if before == after {
        return Vec::new();
    }
    let policy = |tables: &[ir::Table]| Policy {
        tables: tables.to_vec(),
        observed: Vec::new(),
    };
    let (before, after) = (policy(before), policy(after));
    flows
        .iter()
        .filter(|f| f.src.is_ipv4() == f.dst.is_ipv4())
        .filter(|f| allows(&before, f) && !allows(&after, f))
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netpol::{
        Cluster, IpBlock, NetworkPolicy, Peer, Pod, Port, Ports, Protocol, Rule, Selector,
    };

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

    fn tables(c: &Cluster) -> Vec<ir::Table> {
        tier_tables(&crate::netpol::tests::compiled(c))
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
}
