//! Which tracked connections a policy change ends: those whose first packet the policy in
//! force allowed before the change and refuses after it, whichever tier refuses it now (a pod
//! that left a NetworkPolicy's peers, or provider protection's `offloaded` set: deleted,
//! relabelled, its address reused). Pure: policies and flows in, flows out; the agent lists
//! and ends them through the backend ([`crate::Revoke`]).
//!
//! Judged by the reference evaluator, for the flow's original direction as a new, forwarded
//! packet (Liqo's NAT in front, as the policy observes it), once for each input interface the
//! policies name (the tunnel) and once for one they do not (a node): a flow is ended when one
//! of them was allowed and is refused now. Both judgements read the same tuple, so a
//! connection the policy never allowed is never ended here, whatever address view it was
//! tracked under.

use std::collections::BTreeSet;

use crate::Flow;
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

/// The `ended` connections `after` allows again: their first packet accepted from every input
/// interface the policy names and from anywhere else (where they came from is not known, so a
/// connection one input would still refuse stays ended: fail closed).
pub fn allowed_again(after: &Policy, ended: &[Flow]) -> Vec<Flow> {
    let mut inputs = BTreeSet::from([ELSEWHERE.to_string()]);
    named_inputs(after, &mut inputs);
    ended
        .iter()
        .filter(|f| f.src.is_ipv4() == f.dst.is_ipv4())
        .filter(|f| inputs.iter().all(|i| allows(after, f, i)))
        .copied()
        .collect()
}

/// Whether `after` only widens what `before` accepts: the same tables, chains and rules,
/// except address sets that only gained addresses, each tested only by accept rules of filter
/// chains, positively (`eq @set`). Then no packet `before` accepted is refused `after` (a
/// rule that matches more accepts more; every other rule is as it was), so no connection can
/// have lost its allowance and none needs judging: the agent skips listing them (an `nft`
/// agent's ctnetlink dump, a walk of the kernel's whole connection hash) for the commonest
/// change, a pod offloaded.
pub fn only_widened(before: &Policy, after: &Policy) -> bool {
    narrowing(before, after).is_none()
}

/// What in `after` may refuse a packet `before` accepted (the first difference found), or
/// None when it only widens ([`only_widened`]): logged when the agent judges connections.
pub fn narrowing(before: &Policy, after: &Policy) -> Option<String> {
    if before.tables.len() != after.tables.len() {
        return Some("a table came or went".into());
    }
    before
        .tables
        .iter()
        .zip(&after.tables)
        .find_map(|(b, a)| table_narrowing(b, a).map(|why| format!("table {}: {why}", a.name)))
}

fn table_narrowing(b: &ir::Table, a: &ir::Table) -> Option<String> {
    // Every field but the sets and chains (destructured: a new field must be thought of here).
    let bare = |t: &ir::Table| {
        let ir::Table {
            name,
            family,
            origin,
            audit,
            sets: _,
            chains: _,
        } = t;
        (name.clone(), *family, origin.clone(), *audit)
    };
    if bare(b) != bare(a) {
        return Some("the table itself changed".into());
    }
    if b.sets.len() != a.sets.len() {
        return Some("a set came or went".into());
    }
    for (bs, as_) in b.sets.iter().zip(&a.sets) {
        let same = bs.name == as_.name
            && bs.from_slices == as_.from_slices
            && match (&bs.elements, &as_.elements) {
                (ir::SetElements::Addr(x), ir::SetElements::Addr(y)) => covers(y, x),
                (x, y) => x == y,
            };
        if !same {
            return Some(format!("set {} lost elements or changed", as_.name));
        }
    }
    if b.chains.len() != a.chains.len() {
        return Some("a chain came or went".into());
    }
    b.chains
        .iter()
        .zip(&a.chains)
        .find_map(|(bc, ac)| chain_narrowing(bc, ac).map(|why| format!("chain {}: {why}", ac.name)))
}

fn chain_narrowing(b: &ir::Chain, a: &ir::Chain) -> Option<String> {
    // Every field but the rules (destructured: a new field must be thought of here).
    let bare = |c: &ir::Chain| {
        let ir::Chain {
            name,
            kind,
            hook,
            priority,
            policy,
            rules: _,
        } = c;
        (name.clone(), *kind, *hook, *priority, *policy)
    };
    if bare(b) != bare(a) {
        return Some("the chain itself changed".into());
    }
    if b.rules.len() != a.rules.len() {
        return Some("a rule came or went".into());
    }
    b.rules.iter().zip(&a.rules).find_map(|(br, ar)| {
        let refusing = matches!(
            ar.action.verdict(),
            Some(VerdictAction::Drop | VerdictAction::Reject)
        );
        let accepting = ar.action == ir::Action::Verdict(VerdictAction::Accept);
        let filter = a.kind == ir::ChainKind::Filter;
        let same_rule = br.name == ar.name
            && br.action == ar.action
            && br.counter == ar.counter
            && br.matches.len() == ar.matches.len();
        let widened = same_rule
            && br.matches.iter().zip(&ar.matches).all(|(bm, am)| {
                bm == am
                    || (filter
                        && grown_set_test(bm, am)
                        // A set that grew matches more where tested positively (an accept rule
                        // then accepts more), less where negated (a drop or reject rule then
                        // refuses less): either way, no packet accepted before is refused now.
                        && ((accepting && !am.negate) || (refusing && am.negate)))
            });
        (!widened).then(|| format!("rule {} changed", ar.name))
    })
}

/// The same test of a named address set, on the same side and with the same negation, whose
/// addresses only grew.
fn grown_set_test(b: &ir::Match, a: &ir::Match) -> bool {
    match (&b.test, &a.test) {
        (
            Test::Addr {
                dir: bd,
                set: bs,
                source: bsrc,
            },
            Test::Addr {
                dir: ad,
                set: as_,
                source: asrc,
            },
        ) => {
            b.negate == a.negate
                && bd == ad
                && bsrc == asrc
                && matches!(asrc, ir::Source::Named(_))
                && covers(as_, bs)
        }
        _ => false,
    }
}

/// Whether `outer` holds every address of `inner`: each canonical range of `inner` lies
/// within one of `outer`'s. Both are sorted and disjoint, so one walk decides (100k
/// addresses: a pod offloaded is judged in well under a millisecond).
fn covers(outer: &ir::AddrSet, inner: &ir::AddrSet) -> bool {
    if outer.family() != inner.family() {
        return false;
    }
    let mut o = outer.ranges().iter().peekable();
    inner.ranges().iter().all(|r| {
        while o.next_if(|x| x.hi < r.lo).is_some() {}
        o.peek().is_some_and(|x| x.lo <= r.lo && r.hi <= x.hi)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_netpol::{
        Cluster, IpBlock, NetworkPolicy, Peer, Pod, Port, Ports, Protocol, Rule, Selector,
    };
    use peerwall_protection::{gateway_spec, Options, PeerSets};

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
            ]
            .into_iter()
            .map(std::sync::Arc::new)
            .collect(),
            policies: vec![std::sync::Arc::new(NetworkPolicy {
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
            })],
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

    /// The controller's gateway configuration for peer `a` with `pods` offloaded.
    fn gateway(pods: &[&str]) -> Policy {
        let s = PeerSets {
            offloaded: pods.iter().map(|p| p.parse().unwrap()).collect(),
            ..Default::default()
        };
        let spec = gateway_spec(
            "a",
            &["10.10.0.0/16".parse().unwrap()],
            &s,
            &Options {
                tunnel: "liqo-tunnel*".into(),
                block_leaf_to_leaf: false,
                audit: false,
                liqo_ping_port: peerwall_protection::LIQO_PING_PORT,
                own_namespace_only: false,
                inline_budget: peerwall_protection::spill::INLINE_BUDGET,
            },
        );
        let doc = serde_json::json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
            "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
        let obj =
            peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
                .unwrap();
        peerwall_policy::compile::compile(&[obj]).unwrap().policy
    }

    /// Provider protection: an offloaded pod leaving the `offloaded` set ends what its peer's
    /// pods opened to it through the tunnel; what our pods opened towards the peer stays.
    #[test]
    fn a_pod_leaving_the_offloaded_set_ends_its_flows_from_the_tunnel() {
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

    /// A pod offloaded (an address joining `offloaded`, tested by the accept rule
    /// `to_offloaded` only) widens; a pod leaving does not, nor does an address joining a
    /// set a drop rule tests (the spoofing check's sources), nor a rule changed.
    #[test]
    fn only_an_accepting_set_that_grew_skips_the_judgement() {
        let one = gateway(&["10.20.1.2"]);
        let two = gateway(&["10.20.1.2", "10.20.1.3"]);
        assert!(only_widened(&one, &two), "a pod offloaded");
        // What the judgement would have found: nothing, for flows of every kind.
        let flows: Vec<Flow> = ["10.10.1.67", "10.20.1.2", "10.20.1.3", "10.20.9.9"]
            .iter()
            .flat_map(|s| {
                ["10.20.1.2", "10.20.1.3", "10.10.1.67"].map(|d| Flow {
                    src: s.parse().unwrap(),
                    dst: d.parse().unwrap(),
                    proto: 6,
                    sport: 40000,
                    dport: 80,
                })
            })
            .collect();
        assert!(no_longer_allowed(&one, &two, &flows).is_empty());
        assert!(only_widened(&two, &two), "nothing changed");
        assert!(!only_widened(&two, &one), "a pod gone");
        // Adjacent addresses merge into one range: still only grown.
        let three = gateway(&["10.20.1.2", "10.20.1.3", "10.20.1.4"]);
        assert!(only_widened(&two, &three));
        // The same growth in a set a drop rule tests refuses more.
        let dropping = |p: &Policy| {
            let mut p = p.clone();
            for r in p
                .tables
                .iter_mut()
                .flat_map(|t| &mut t.chains)
                .flat_map(|c| &mut c.rules)
            {
                r.action = ir::Action::Verdict(VerdictAction::Drop);
            }
            p
        };
        assert!(
            !only_widened(&dropping(&one), &dropping(&two)),
            "a drop rule that matches more"
        );
        // Negated in a drop rule (`ip daddr != @offloaded drop`), the same growth refuses
        // less: only widened; a pod leaving refuses more.
        let refusing_outside = |p: &Policy| {
            let mut p = dropping(p);
            for m in p
                .tables
                .iter_mut()
                .flat_map(|t| &mut t.chains)
                .flat_map(|c| &mut c.rules)
                .flat_map(|r| &mut r.matches)
                .filter(|m| matches!(m.test, Test::Addr { .. }))
            {
                m.negate = true;
            }
            p
        };
        assert!(only_widened(
            &refusing_outside(&one),
            &refusing_outside(&two)
        ));
        assert_eq!(
            narrowing(&refusing_outside(&two), &refusing_outside(&one)).as_deref(),
            Some("table peerwall_a: set offloaded lost elements or changed")
        );
        assert!(
            no_longer_allowed(&refusing_outside(&one), &refusing_outside(&two), &flows).is_empty()
        );
        let mut renamed = two.clone();
        renamed.tables[0].chains[0].rules[0].name.push('x');
        assert!(!only_widened(&two, &renamed), "a rule changed");
        assert!(!only_widened(&one, &Policy::default()), "a table gone");
    }
}
