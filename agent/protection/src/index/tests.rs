//! The index against its specification ([`super::super::sets`]), under random events.

use super::*;
use crate::{sets, World};
use rand::{Rng, SeedableRng};

const PEERS: [&str; 3] = ["alpha", "beta", "gamma"];

fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A random namespace set: tenant namespaces for some peers, offloaded namespaces, plain ones.
fn namespaces(rng: &mut impl Rng) -> Vec<Namespace> {
    let mut out = vec![];
    for p in PEERS {
        if rng.random_bool(0.8) {
            out.push(Namespace {
                name: format!("liqo-tenant-{p}"),
                labels: labels(&[(REMOTE_CLUSTER_ID, p), ("liqo.io/tenant-namespace", "true")]),
            });
        }
    }
    for i in 0..4 {
        let owner = PEERS[rng.random_range(0..PEERS.len())];
        let l = if rng.random_bool(0.5) {
            labels(&[(REMOTE_CLUSTER_ID, owner)])
        } else {
            labels(&[])
        };
        out.push(Namespace {
            name: format!("ns{i}"),
            labels: l,
        });
    }
    out
}

fn nodes(rng: &mut impl Rng) -> Vec<Node> {
    PEERS
        .iter()
        .filter(|_| rng.random_bool(0.7))
        .map(|p| Node {
            name: format!("liqo-{p}"),
            labels: labels(&[(REMOTE_CLUSTER_ID, p)]),
        })
        .collect()
}

fn remaps(rng: &mut impl Rng) -> BTreeMap<String, Vec<Remap>> {
    let mut out = BTreeMap::new();
    if rng.random_bool(0.5) {
        out.insert(
            "beta".to_string(),
            vec![Remap {
                real: "10.0.0.0/24".parse().unwrap(),
                seen: "10.99.0.0/24".parse().unwrap(),
            }],
        );
    }
    out
}

fn pod(rng: &mut impl Rng) -> Pod {
    let ns = match rng.random_range(0..6) {
        5 => "liqo-tenant-alpha".to_string(),
        i => format!("ns{}", i.min(3)),
    };
    let mut ips: Vec<IpAddr> = vec![];
    for _ in 0..rng.random_range(0..3) {
        // A small address space so that pods share addresses (IP reuse) and remaps apply.
        ips.push(if rng.random_bool(0.8) {
            IpAddr::from([
                10,
                if rng.random_bool(0.5) { 0 } else { 99 },
                0,
                rng.random_range(0..12),
            ])
        } else {
            format!("fd00::{}", rng.random_range(0..6)).parse().unwrap()
        });
    }
    let node = match rng.random_range(0..5) {
        0 | 1 => Some(format!("liqo-{}", PEERS[rng.random_range(0..PEERS.len())])),
        2 => Some("worker".to_string()),
        _ => None,
    };
    let labels = if rng.random_bool(0.3) {
        labels(&[(REMOTE_CLUSTER_ID, PEERS[rng.random_range(0..PEERS.len())])])
    } else {
        BTreeMap::new()
    };
    Pod {
        namespace: ns,
        name: format!("p{}", rng.random_range(0..30)),
        labels,
        node,
        ips,
        gone: rng.random_bool(0.1),
    }
}

/// The snapshot the specification reads.
fn world_of(
    ns: &[Namespace],
    vn: &[Node],
    rm: &BTreeMap<String, Vec<Remap>>,
    pods: &HashMap<PodKey, Pod>,
) -> World {
    World {
        namespaces: ns.to_vec(),
        pods: pods.values().cloned().collect(),
        virtual_nodes: vn.to_vec(),
        remaps: rm.clone(),
        sources: BTreeMap::new(),
    }
}

fn all_sets(ix: &DesiredIndex) -> BTreeMap<String, PeerSets> {
    ix.peers()
        .iter()
        .map(|p| (p.clone(), ix.peer_sets(p)))
        .collect()
}

/// Every membership difference between `before` and `after` is among the changes taken.
fn covered(
    before: &BTreeMap<String, PeerSets>,
    after: &BTreeMap<String, PeerSets>,
    taken: &BTreeMap<String, Changes>,
) {
    let peers: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    for p in peers {
        let empty = PeerSets::default();
        let (b, a) = (
            before.get(p).unwrap_or(&empty),
            after.get(p).unwrap_or(&empty),
        );
        for k in Kind::ALL {
            let (mut bb, mut aa) = (b.clone(), a.clone());
            let (bs, as_) = (k.of(&mut bb).clone(), k.of(&mut aa).clone());
            for ip in bs.symmetric_difference(&as_) {
                match taken.get(p.as_str()) {
                    Some(Changes::Resync) => {}
                    Some(Changes::Addresses(s)) if s.contains(&(k, *ip)) => {}
                    other => panic!("{p} {k:?} {ip} changed but not reported: {other:?}"),
                }
            }
        }
    }
}

#[test]
fn random_events_keep_the_index_equal_to_the_specification_and_report_every_change() {
    for seed in 0..200u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut ix = DesiredIndex::new();
        let (mut ns, mut vn, mut rm) = (namespaces(&mut rng), nodes(&mut rng), remaps(&mut rng));
        ix.set_context(ns.clone(), vn.clone(), rm.clone());
        let mut pods: HashMap<PodKey, Pod> = HashMap::new();
        for _ in 0..120 {
            let before = all_sets(&ix);
            let mut taken: BTreeMap<String, Changes> = BTreeMap::new();
            for p in ix.peers().clone() {
                ix.take_changes(&p);
            }
            match rng.random_range(0..20) {
                0 => {
                    ns = namespaces(&mut rng);
                    ix.set_context(ns.clone(), vn.clone(), rm.clone());
                }
                1 => {
                    vn = nodes(&mut rng);
                    rm = remaps(&mut rng);
                    ix.set_context(ns.clone(), vn.clone(), rm.clone());
                }
                2..=6 if !pods.is_empty() => {
                    let k = pods
                        .keys()
                        .nth(rng.random_range(0..pods.len()))
                        .cloned()
                        .unwrap();
                    pods.remove(&k);
                    ix.remove_pod(&k.0, &k.1);
                }
                7 => {
                    // A relist: some pods vanished while the watch was away.
                    ix.begin_relist();
                    pods.retain(|_, _| rng.random_bool(0.7));
                    for _ in 0..3 {
                        let p = pod(&mut rng);
                        pods.insert((p.namespace.clone(), p.name.clone()), p);
                    }
                    // Until the list ends, the last full state is served.
                    for p in pods.values() {
                        ix.upsert_pod(p.clone());
                    }
                    assert_eq!(
                        all_sets(&ix),
                        before,
                        "seed {seed}: a relist in progress changed the sets"
                    );
                    ix.end_relist();
                }
                _ => {
                    let p = pod(&mut rng);
                    pods.insert((p.namespace.clone(), p.name.clone()), p.clone());
                    ix.upsert_pod(p);
                }
            }
            let want = sets(&world_of(&ns, &vn, &rm, &pods));
            let got = all_sets(&ix);
            assert_eq!(got, want, "seed {seed}");
            let peers: BTreeSet<String> = before.keys().chain(got.keys()).cloned().collect();
            for p in peers {
                taken.insert(p.clone(), ix.take_changes(&p));
            }
            covered(&before, &got, &taken);
        }
    }
}

#[test]
fn a_pod_event_reports_only_its_own_addresses() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let _ = &mut rng;
    let mut ix = DesiredIndex::new();
    ix.set_context(
        vec![
            Namespace {
                name: "liqo-tenant-alpha".into(),
                labels: labels(&[
                    (REMOTE_CLUSTER_ID, "alpha"),
                    ("liqo.io/tenant-namespace", "true"),
                ]),
            },
            Namespace {
                name: "offloaded".into(),
                labels: labels(&[(REMOTE_CLUSTER_ID, "alpha")]),
            },
        ],
        vec![],
        BTreeMap::new(),
    );
    for i in 0..10_000u32 {
        ix.upsert_pod(Pod {
            namespace: "offloaded".into(),
            name: format!("p{i}"),
            ips: vec![IpAddr::from(std::net::Ipv4Addr::from(0x0a14_0000 + i))],
            ..Default::default()
        });
    }
    assert_eq!(ix.take_changes("alpha"), Changes::Resync);
    let ip: IpAddr = "10.30.0.1".parse().unwrap();
    ix.upsert_pod(Pod {
        namespace: "offloaded".into(),
        name: "new".into(),
        ips: vec![ip],
        ..Default::default()
    });
    assert_eq!(
        ix.take_changes("alpha"),
        Changes::Addresses(BTreeSet::from([(Kind::Offloaded, ip)]))
    );
    assert_eq!(ix.len("alpha", Kind::Offloaded), 10_001);
    // The same pod again (a status update that changes nothing the sets read): no change.
    ix.upsert_pod(Pod {
        namespace: "offloaded".into(),
        name: "new".into(),
        ips: vec![ip],
        ..Default::default()
    });
    assert_eq!(ix.take_changes("alpha"), Changes::None);
    ix.remove_pod("offloaded", "new");
    assert_eq!(
        ix.take_changes("alpha"),
        Changes::Addresses(BTreeSet::from([(Kind::Offloaded, ip)]))
    );
}

#[test]
fn set_names_round_trip() {
    for k in Kind::ALL {
        for ip in ["10.0.0.1", "fd00::1"] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(Kind::of_set(&k.set_name(ip)), Some((k, ip.is_ipv6())));
        }
    }
    assert_eq!(Kind::of_set("other"), None);
}
