//! The publisher against a simulated API server: writes get versions, the controller's cache
//! lags behind, agents apply slices late, writes fail. Whatever the interleaving: an address
//! never joins a peer while another peer's slices hold it or another peer has not applied
//! everything, slices stay bounded and duplicate-free, a quiet system converges to the
//! desired sets, and a change of one address writes one slice.

use super::*;
use crate::{Namespace, Pod, SLICE_FILL};
use rand::{Rng, SeedableRng};

const PEERS: [&str; 3] = ["alpha", "beta", "gamma"];

fn opts() -> Options {
    Options {
        tunnel: "liqo-tunnel".into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: crate::LIQO_PING_PORT,
        own_namespace_only: false,
        inline_budget: crate::spill::INLINE_BUDGET,
    }
}

fn context(ix: &mut DesiredIndex) {
    let mut ns = vec![];
    for p in PEERS {
        ns.push(Namespace {
            name: format!("liqo-tenant-{p}"),
            labels: [
                ("liqo.io/remote-cluster-id".to_string(), p.to_string()),
                ("liqo.io/tenant-namespace".to_string(), "true".to_string()),
            ]
            .into(),
        });
        ns.push(Namespace {
            name: format!("offloaded-{p}"),
            labels: [("liqo.io/remote-cluster-id".to_string(), p.to_string())].into(),
        });
    }
    ix.set_context(ns, vec![], BTreeMap::new());
}

fn pod(peer: &str, name: &str, ip: IpAddr) -> Pod {
    Pod {
        namespace: format!("offloaded-{peer}"),
        name: name.into(),
        ips: vec![ip],
        ..Default::default()
    }
}

/// One object in the simulated API.
#[derive(Clone, Debug)]
struct Obj {
    version: u64,
    /// Spec generation: moved by writes of the slice, not by status (`applied`) writes.
    generation: i64,
    slice: Slice,
    applied: bool,
}

type ApiState = BTreeMap<(String, String), Obj>;

struct Sim {
    truth: ApiState,
    version: u64,
    /// What the controller's cache shows: a past state of the API, never going back.
    history: Vec<ApiState>,
    cache_at: usize,
}

impl Sim {
    fn new() -> Self {
        Sim {
            truth: BTreeMap::new(),
            version: 100,
            history: vec![BTreeMap::new()],
            cache_at: 0,
        }
    }

    fn snapshot(&mut self) {
        self.history.push(self.truth.clone());
    }

    fn sync(&self, pb: &mut Publisher) {
        let cache = &self.history[self.cache_at];
        for peer in PEERS {
            let s = pb.slices_mut(peer);
            s.begin_sync();
            for ((p, name), o) in cache {
                if p == peer {
                    s.observe(
                        name,
                        &o.version.to_string(),
                        Some(o.generation),
                        o.applied,
                        || o.slice.clone(),
                    );
                }
            }
            s.end_sync();
        }
    }

    /// Check the gate against the API's truth, then write.
    fn write(&mut self, peer: &str, s: &Slice) -> u64 {
        let before = self
            .truth
            .get(&(peer.to_string(), s.name.clone()))
            .map(|o| o.slice.addresses.clone())
            .unwrap_or_default();
        if matches!(Kind::of_set(&s.set), Some((Kind::Offloaded, _))) {
            for ip in s.addresses.difference(&before) {
                for ((other, _), o) in &self.truth {
                    if other == peer {
                        continue;
                    }
                    assert!(
                        !(o.slice.set == s.set && o.slice.addresses.contains(ip)),
                        "{ip} joins {peer} while {other} publishes it"
                    );
                    assert!(
                        o.applied,
                        "{ip} joins {peer} while {other} has not applied {}",
                        o.slice.name
                    );
                }
            }
        }
        self.version += 1;
        let generation = self
            .truth
            .get(&(peer.to_string(), s.name.clone()))
            .map_or(1, |o| o.generation + 1);
        self.truth.insert(
            (peer.to_string(), s.name.clone()),
            Obj {
                version: self.version,
                generation,
                slice: s.clone(),
                applied: false,
            },
        );
        self.snapshot();
        self.version
    }

    fn published(&self, peer: &str, set: &str) -> BTreeSet<IpAddr> {
        self.truth
            .iter()
            .filter(|((p, _), o)| p == peer && o.slice.set == set)
            .flat_map(|(_, o)| o.slice.addresses.iter().copied())
            .collect()
    }
}

/// One reconcile of `peer`: sync, plan, write (a write fails with probability `fail`), delete
/// what is deletable.
fn reconcile_failing(
    sim: &mut Sim,
    pb: &mut Publisher,
    peer: &str,
    rng: &mut impl Rng,
    fail: f64,
) -> Plan {
    sim.sync(pb);
    let plan = pb.plan(peer, &opts());
    for s in &plan.writes {
        if rng.random_bool(fail) {
            pb.slices_mut(peer).write_failed(&s.name);
        } else {
            let v = sim.write(peer, s);
            pb.slices_mut(peer).written(&s.name, v.to_string());
        }
    }
    let known: Vec<String> = ["offloaded", "offloaded6", "remote", "remote6"]
        .map(String::from)
        .to_vec();
    for name in pb.slices_mut(peer).deletable(&known) {
        sim.truth.remove(&(peer.to_string(), name.clone()));
        sim.snapshot();
        pb.slices_mut(peer).deleted(&name);
    }
    plan
}

/// One reconcile where every write succeeds.
impl Sim {
    /// The cache shows every write, and every agent has applied it.
    fn all_applied(&mut self) {
        for o in self.truth.values_mut() {
            o.applied = true;
            self.version += 1;
            o.version = self.version;
        }
        self.snapshot();
        self.cache_at = self.history.len() - 1;
    }
}

fn reconcile(sim: &mut Sim, pb: &mut Publisher, peer: &str) -> Plan {
    reconcile_failing(
        sim,
        pb,
        peer,
        &mut rand::rngs::StdRng::seed_from_u64(0),
        0.0,
    )
}

#[test]
fn random_interleavings_keep_reuse_gated_slices_bounded_and_converge() {
    for seed in 0..60u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut pb = Publisher::new();
        context(&mut pb.desired);
        let mut sim = Sim::new();
        // Who holds which address now (pods move between peers: IP reuse).
        let mut owner: BTreeMap<u32, &str> = BTreeMap::new();
        let ip_of = |i: u32| -> IpAddr {
            if i.is_multiple_of(7) {
                format!("fd00::{i:x}").parse().unwrap()
            } else {
                IpAddr::from(std::net::Ipv4Addr::from(0x0a14_0000 + i))
            }
        };
        for step in 0..400 {
            match rng.random_range(0..10) {
                0..=3 => {
                    let i = rng.random_range(0..2500u32);
                    let peer = PEERS[rng.random_range(0..PEERS.len())];
                    if let Some(old) = owner.insert(i, peer) {
                        pb.desired
                            .remove_pod(&format!("offloaded-{old}"), &format!("p{i}"));
                    }
                    pb.desired.upsert_pod(pod(peer, &format!("p{i}"), ip_of(i)));
                }
                4 => {
                    if let Some((&i, &old)) =
                        owner.iter().nth(rng.random_range(0..owner.len().max(1)))
                    {
                        owner.remove(&i);
                        pb.desired
                            .remove_pod(&format!("offloaded-{old}"), &format!("p{i}"));
                    }
                }
                5 => {
                    // Agents apply what they were given (a status write: a new version of
                    // the same generation).
                    for o in sim.truth.values_mut() {
                        if rng.random_bool(0.5) && !o.applied {
                            o.applied = true;
                            sim.version += 1;
                            o.version = sim.version;
                        }
                    }
                    sim.snapshot();
                }
                6 => {
                    // The cache catches up, part of the way.
                    let last = sim.history.len() - 1;
                    sim.cache_at = rng.random_range(sim.cache_at..=last);
                }
                _ => {
                    let peer = PEERS[rng.random_range(0..PEERS.len())];
                    reconcile_failing(&mut sim, &mut pb, peer, &mut rng, 0.05);
                }
            }
            for ((_, name), o) in &sim.truth {
                assert!(
                    o.slice.addresses.len() <= SLICE_FILL,
                    "seed {seed} step {step}: {name} over the bound"
                );
            }
        }
        // Quiet: the cache catches up, agents apply, every peer reconciles until nothing is left.
        for _ in 0..10 {
            for o in sim.truth.values_mut() {
                if !o.applied {
                    o.applied = true;
                    sim.version += 1;
                    o.version = sim.version;
                }
            }
            sim.snapshot();
            sim.cache_at = sim.history.len() - 1;
            for peer in PEERS {
                reconcile(&mut sim, &mut pb, peer);
            }
        }
        for peer in PEERS {
            for set in ["offloaded", "offloaded6"] {
                let want: BTreeSet<IpAddr> = owner
                    .iter()
                    .filter(|(_, p)| **p == peer)
                    .map(|(i, _)| ip_of(*i))
                    .filter(|ip| Kind::Offloaded.set_name(*ip) == set)
                    .collect();
                assert_eq!(sim.published(peer, set), want, "seed {seed}: {peer} {set}");
            }
            // No address in two slices of a set.
            let mut seen = BTreeSet::new();
            for ((p, _), o) in &sim.truth {
                if p == peer {
                    for ip in &o.slice.addresses {
                        assert!(
                            seen.insert((o.slice.set.clone(), *ip)),
                            "seed {seed}: {ip} twice in {peer}"
                        );
                    }
                }
            }
        }
        assert_eq!(pb.held_back(), 0, "seed {seed}");
    }
}

#[test]
fn one_pod_at_100k_writes_one_slice_and_reads_nothing_else() {
    let mut pb = Publisher::new();
    context(&mut pb.desired);
    let mut sim = Sim::new();
    for i in 0..100_000u32 {
        pb.desired.upsert_pod(pod(
            "alpha",
            &format!("p{i}"),
            IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i)),
        ));
    }
    let first = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(first.writes.len(), 100_000 / SLICE_FILL);
    assert!(first.writes.iter().all(|s| s.addresses.len() == SLICE_FILL));
    sim.all_applied();
    let again = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!((again.writes.len(), again.held), (0, 0));
    // One pod more: one slice, which gains exactly that address.
    let ip: IpAddr = "10.200.0.1".parse().unwrap();
    pb.desired.upsert_pod(pod("alpha", "new", ip));
    let plan = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(plan.writes.len(), 1);
    assert!(plan.writes[0].addresses.contains(&ip));
    assert_eq!(
        plan.writes[0].addresses.len(),
        1,
        "a new slice: all others are full"
    );
    // One pod gone: its slice, without it.
    let gone = IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + 4242));
    pb.desired.remove_pod("offloaded-alpha", "p4242");
    let plan = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(plan.writes.len(), 1);
    assert_eq!(plan.writes[0].addresses.len(), SLICE_FILL - 1);
    assert!(!plan.writes[0].addresses.contains(&gone));
    // The next pod fills the slice with the most room.
    let ip2: IpAddr = "10.200.0.2".parse().unwrap();
    pb.desired.upsert_pod(pod("alpha", "new2", ip2));
    let plan = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(plan.writes.len(), 1);
    assert_eq!(plan.writes[0].addresses.len(), 2);
}

#[test]
fn a_new_pod_beside_slices_with_holes_opens_a_slice_rather_than_rewriting_a_full_one() {
    let mut pb = Publisher::new();
    context(&mut pb.desired);
    let mut sim = Sim::new();
    let ip = |i: u32| IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
    for i in 0..3000u32 {
        pb.desired.upsert_pod(pod("alpha", &format!("p{i}"), ip(i)));
    }
    let first = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(first.writes.len(), 3);
    sim.all_applied();
    // A pod gone from every slice: each holds 999.
    for i in [7, 1007, 2007] {
        pb.desired.remove_pod("offloaded-alpha", &format!("p{i}"));
    }
    let holes = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(holes.writes.len(), 3);
    assert!(holes
        .writes
        .iter()
        .all(|s| s.addresses.len() == SLICE_FILL - 1));
    // A new pod: a new slice of one address, not a slice of 999 rewritten.
    let new: IpAddr = "10.200.0.1".parse().unwrap();
    pb.desired.upsert_pod(pod("alpha", "new", new));
    let plan = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(plan.writes.len(), 1);
    assert_eq!(plan.writes[0].addresses, BTreeSet::from([new]));
}

#[test]
fn an_edit_by_someone_else_is_repaired() {
    let mut pb = Publisher::new();
    context(&mut pb.desired);
    let mut sim = Sim::new();
    for i in 0..10u32 {
        pb.desired.upsert_pod(pod(
            "alpha",
            &format!("p{i}"),
            IpAddr::from([10, 0, 0, i as u8]),
        ));
    }
    reconcile(&mut sim, &mut pb, "alpha");
    // Someone takes an address out and puts a foreign one in.
    let key = sim.truth.keys().next().cloned().unwrap();
    let o = sim.truth.get_mut(&key).unwrap();
    o.slice.addresses.remove(&IpAddr::from([10, 0, 0, 3]));
    o.slice.addresses.insert(IpAddr::from([192, 168, 0, 1]));
    sim.version += 1;
    o.version = sim.version;
    o.generation += 1;
    sim.snapshot();
    sim.cache_at = sim.history.len() - 1;
    let plan = reconcile(&mut sim, &mut pb, "alpha");
    assert_eq!(plan.writes.len(), 1);
    assert_eq!(
        sim.published("alpha", "offloaded"),
        (0..10u8).map(|i| IpAddr::from([10, 0, 0, i])).collect()
    );
}
