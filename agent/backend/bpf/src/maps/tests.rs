//! The map contents, evaluated as the datapath evaluates them, give the reference verdict.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::*;
use peerwall_policy::compile::compile as compile_ir;
use peerwall_policy::ir::{addr::AddrRange, evaluate_at_ingress, AddrSet, Packet, PortSet};
use peerwall_policy::testgen::{objects, random_packet, random_specs, IFACES};

fn ifaces() -> Vec<Iface> {
    IFACES
        .iter()
        .enumerate()
        .map(|(i, n)| Iface {
            name: n.to_string(),
            ifindex: i as u32 + 1,
        })
        .collect()
}

fn ifindex(name: &Option<String>) -> u32 {
    name.as_ref()
        .and_then(|n| IFACES.iter().position(|i| i == n))
        .map_or(0, |i| i as u32 + 1)
}

#[test]
fn maps_equal_reference_on_random_policies() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut cases = 0;
    for _ in 0..400 {
        let specs = random_specs(&mut rng);
        let policy = compile_ir(&objects(&specs)).expect("valid").policy;
        let bp = compile(&policy, &ifaces()).expect("fits");
        for _ in 0..40 {
            let pkt: Packet = random_packet(&mut rng);
            let dp = DatapathPacket {
                pkt: &pkt,
                iif: ifindex(&pkt.iif),
                oif: ifindex(&pkt.oif),
            };
            assert_eq!(
                simulate(&bp, &dp),
                evaluate_at_ingress(&policy, &pkt),
                "policy {specs:#?}\npacket {pkt:?}"
            );
            cases += 1;
        }
    }
    assert_eq!(cases, 16000);
}

/// The kernel-conntrack datapath's classification without the kernel's state
/// (`OPEN_EITHER`, with the check against `OPEN_EVERY`), on the compiled chains of random
/// policies: where it holds, it is each chain's decision under new, established and related
/// alike; and it holds for most packets, and not for all (the random policies test states).
#[test]
fn a_chain_decided_under_open_either_decides_so_in_every_open_state() {
    let mut rng = StdRng::seed_from_u64(11);
    let (mut held, mut not) = (0, 0);
    for _ in 0..300 {
        let specs = random_specs(&mut rng);
        let policy = compile_ir(&objects(&specs)).expect("valid").policy;
        let bp = compile(&policy, &ifaces()).expect("fits");
        for _ in 0..20 {
            let pkt: Packet = random_packet(&mut rng);
            let (iif, oif) = (ifindex(&pkt.iif), ifindex(&pkt.oif));
            for c in &bp.chains {
                match simulate_chain_open_either(c, &pkt, iif, oif) {
                    Some(decided) => {
                        for s in [CtState::New, CtState::Established, CtState::Related] {
                            let p = Packet {
                                ct_state: s,
                                ..pkt.clone()
                            };
                            assert_eq!(
                                simulate_chain(c, &p, iif, oif),
                                decided,
                                "chain {} state {s:?}\npolicy {specs:#?}\npacket {pkt:?}",
                                c.id
                            );
                        }
                        held += 1;
                    }
                    None => not += 1,
                }
            }
        }
    }
    assert!(held > 10 * not && not > 0, "{held} held, {not} did not");
}

/// A chain's start bitmap for a family (`START`, read where its description has the family's
/// bit) is what the protocol hash answers for every protocol of the family, and a chain has
/// none only where the hash tells protocols apart or has nothing for the family (the policy
/// decides); random policies have chains of both kinds.
#[test]
fn a_start_bitmap_is_the_protocol_hash_answer_for_every_protocol() {
    let mut rng = StdRng::seed_from_u64(13);
    let (mut one, mut apart) = (0, 0);
    for _ in 0..300 {
        let specs = random_specs(&mut rng);
        let policy = compile_ir(&objects(&specs)).expect("valid").policy;
        let bp = compile(&policy, &ifaces()).expect("fits");
        for c in &bp.chains {
            for (fidx, fam) in [(0, IpFamily::V4), (1, IpFamily::V6)] {
                let fam = family_code(fam);
                let hashed = |p: u8| {
                    let of = |pr: Option<u8>| c.proto.iter().find(|e| e.0 == fam && e.1 == pr);
                    of(Some(p)).or_else(|| of(None)).map(|e| e.2)
                };
                let bit = c.info().constrained & peerwall_common::constrained::start(fidx) != 0;
                let answers: Vec<Option<Bitmap>> = (0..=255u8).map(hashed).collect();
                match c.start(fidx) {
                    Some(b) => {
                        assert!(bit, "{c:?}");
                        assert!(answers.iter().all(|a| *a == Some(b)), "{c:?}");
                        one += 1;
                    }
                    None => {
                        assert!(!bit, "{c:?}");
                        let none = answers.iter().all(Option::is_none);
                        assert!(none || answers.iter().any(|a| *a != answers[0]), "{c:?}");
                        apart += usize::from(!none);
                    }
                }
            }
        }
    }
    assert!(
        one > 0 && apart > 0,
        "one bitmap: {one}, told apart: {apart}"
    );
}

#[test]
fn set_algebra() {
    let s = |r: &[(u128, u128)]| {
        AddrSet::from_ranges(
            IpFamily::V4,
            r.iter().map(|(lo, hi)| AddrRange { lo: *lo, hi: *hi }),
        )
    };
    let a = s(&[(0, 10), (20, 30)]);
    let b = s(&[(5, 25)]);
    assert_eq!(a.intersect(&b), s(&[(5, 10), (20, 25)]));
    assert_eq!(a.minus(&b), s(&[(0, 4), (26, 30)]));
    assert_eq!(b.minus(&a), s(&[(11, 19)]));
    assert_eq!(a.minus(&a), s(&[]));
    let p = |r: &[(u16, u16)]| PortSet::from_ranges(r.iter().copied());
    assert_eq!(
        p(&[(80, 90)]).minus(&p(&[(85, 85)])),
        p(&[(80, 84), (86, 90)])
    );
    assert_eq!(
        p(&[(0, 65535)]).minus(&p(&[(0, 0), (65535, 65535)])),
        p(&[(1, 65534)])
    );
    assert_eq!(p(&[(1, 10)]).intersect(&p(&[(5, 20)])), p(&[(5, 10)]));
}

#[test]
fn port_prefixes_cover_ranges() {
    let set = PortSet::from_ranges([(80, 90), (0, 0), (65535, 65535)]);
    let p = port_prefixes(&set);
    assert_eq!(p[0], (0, 16));
    let covered: usize = p.iter().map(|(_, l)| 1usize << (16 - l)).sum();
    assert_eq!(covered, 11 + 1 + 1);
    assert_eq!(
        port_prefixes(&PortSet::from_ranges([(0, 65535)])),
        vec![(0, 0)]
    );
}

#[test]
fn enclosing_prefixes_carry_their_rules() {
    // r0: dst in 10.0.0.0/8; r1: dst in 10.1.0.0/16; r2: dst not in 10.1.2.3.
    let yaml = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: x}\nspec:\n  table:\n    name: t\n    family: IPV4\n    chains:\n      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: r0, action: drop, match: [{op: eq, ip: {value: 10.0.0.0/8, position: dst}}]}\n            - {name: r1, action: drop, match: [{op: eq, ip: {value: 10.1.0.0/16, position: dst}}]}\n            - {name: r2, action: drop, match: [{op: neq, ip: {value: 10.1.2.3, position: dst}}]}\n";
    let objs = peerwall_intent::load::parse_documents(yaml, "t").unwrap();
    let policy = compile_ir(&objs).unwrap().policy;
    let bp = compile(&policy, &[]).unwrap();
    let c = &bp.chains[0];
    let find = |n: &str| c.dst.iter().find(|(p, _)| p.to_string() == n).unwrap().1;
    let b = find("10.1.0.0/16");
    assert!(b.get(0) && b.get(1) && !b.get(2));
    let h = find("10.1.2.3/32");
    assert!(
        h.get(0) && h.get(1) && h.get(2),
        "the /32 inherits both enclosing prefixes"
    );
    assert!(c.masks[1].neg.get(2) && !c.masks[1].neg.get(0));
    assert_eq!(c.masks[0].any.first(), Some(0), "no source tests: any");
}

/// Liqo's remapping of an overlapping pod CIDR (observed, never applied by peerwall) and a
/// gateway policy keyed on the peer's own addresses: the datapath classifies a packet from a
/// node towards the remapped CIDR on the address the forward hook sees, as the judge does.
#[test]
fn observed_nat_rewrites_what_the_datapath_classifies() {
    use peerwall_intent::{load::parse_documents, Role};
    let remap = "apiVersion: networking.liqo.io/v1beta1\nkind: FirewallConfiguration\nmetadata: {name: remap, namespace: t}\nspec:\n  table:\n    name: remap-podcidr\n    family: IPV4\n    chains:\n    - name: outgoing\n      policy: accept\n      type: nat\n      hook: prerouting\n      priority: -100\n      rules:\n        natRules:\n        - natType: dnat\n          to: 10.20.0.0/16\n          match:\n          - {op: eq, ip: {value: 10.71.0.0/16, position: dst}}\n          - {op: neq, dev: {value: liqo-tunnel, position: in}}\n";
    let filter = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: gw, namespace: t}\nspec:\n  table:\n    name: gw\n    family: IPV4\n    chains:\n    - name: to_peer\n      type: filter\n      hook: forward\n      priority: 0\n      policy: accept\n      rules:\n        filterRules:\n        - {name: peer_pod, action: drop, match: [{op: eq, ip: {value: 10.20.9.10, position: dst}}]}\n";
    let mut objs = parse_documents(remap, "r").unwrap();
    objs[0].role = Role::Observe;
    objs.extend(parse_documents(filter, "f").unwrap());
    let policy = compile_ir(&objs).unwrap().policy;
    assert_eq!(policy.tables.len(), 1, "the observed table is not enforced");
    let bp = compile(&policy, &ifaces()).unwrap();
    // Both Geneve interfaces (ifindex 2, 3), not the tunnel (1).
    let on: Vec<u32> = bp.views.iter().map(|v| v.ifindex).collect();
    assert_eq!(on, vec![2, 3]);
    for (dst, iif, want) in [
        ("10.71.9.10", "liqo.abcdefghij", VerdictAction::Drop),
        ("10.71.9.11", "liqo.abcdefghij", VerdictAction::Accept),
        ("10.71.9.10", "liqo-tunnel", VerdictAction::Accept),
        ("10.20.9.10", "liqo-tunnel", VerdictAction::Drop),
    ] {
        let pkt = Packet {
            src: "10.20.3.10".parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto: 17,
            sport: 1000,
            dport: 53,
            iif: Some(iif.into()),
            oif: Some("liqo-tunnel".into()),
            ct_state: peerwall_policy::ir::CtState::New,
        };
        let dp = DatapathPacket {
            pkt: &pkt,
            iif: ifindex(&pkt.iif),
            oif: ifindex(&pkt.oif),
        };
        let judge = evaluate_at_ingress(&policy, &pkt);
        assert_eq!(judge.verdict, want, "{dst} on {iif}");
        assert_eq!(simulate(&bp, &dp), judge, "{dst} on {iif}");
    }
}
