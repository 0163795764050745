//! In-place set edits against a real kernel under churn: the agent's O(changes) path for
//! AddressSet slices ([`NftBackend::update_sets`] over netlink) keeps an interval set equal,
//! element for element, to the canonical set it was told, with no edit refused by the kernel
//! (a refused batch falls back to `nft`, then to a whole apply: correct, but tens to hundreds
//! of milliseconds per pod).

use peerwall_backend_nftables::{Drift, Nft, NftBackend};
use peerwall_policy::compile;
use peerwall_policy::ir::{AddrRange, AddrSet, IpFamily, SetChange, SetElements};
use peerwall_testkit::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The kernel's elements of `inet peerwall_churn offloaded`, as `nft` lists them.
fn listed(ns: &NetNs) -> String {
    let o = in_ns(
        ns,
        "nft",
        &["list", "set", "inet", "peerwall_churn", "offloaded"],
    );
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let Some(start) = text.find("elements = {") else {
        return String::new();
    };
    let rest = &text[start + "elements = {".len()..];
    let body = &rest[..rest.find('}').unwrap_or(rest.len())];
    body.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Apply, in `ns`, a FirewallConfiguration whose table `peerwall_<name>` has one IPv4 set
/// `set` holding `elements` (YAML items) and a forward chain accepting packets to it: the
/// compiled policy, the backend that applied it and the set's contents.
fn one_set_applied(
    ns: &NetNs,
    name: &str,
    set: &str,
    elements: &str,
) -> (peerwall_policy::ir::Policy, NftBackend<Nft>, AddrSet) {
    let dir = std::env::temp_dir().join(format!("pw-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &f,
        format!("apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: {name}, namespace: t}}\nspec:\n  table:\n    name: peerwall_{name}\n    family: INET\n    sets:\n      - {{name: {set}, keyType: ipv4_addr, elements: [{elements}]}}\n    chains:\n      - name: fwd\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {{name: to_{set}, action: accept, match: [{{op: eq, ip: {{value: '@{set}', position: dst}}}}]}}\n"),
    )
    .unwrap();
    let objs = peerwall_intent::load::load_paths(&[f]).expect("loads");
    std::fs::remove_dir_all(&dir).ok();
    let policy = compile::compile(&objs).expect("compiles").policy;
    let mut b = NftBackend::new(Nft::in_netns(ns.name()));
    b.apply(&policy).expect("apply");
    let SetElements::Addr(contents) = policy.tables[0].sets[0].elements.clone() else {
        panic!("an address set");
    };
    (policy, b, contents)
}

/// A pod population offloaded in one block (one interval), then churned as `bench-control`
/// does: new pods after the block, pods of the block deleted, several changes per round.
/// After every round the kernel lists exactly the canonical ranges, no batch was refused, and
/// drift detection agrees.
#[test]
fn an_interval_set_stays_exact_through_pod_churn() {
    require_root();
    let ns = NetNs::new("pwx-churn").expect("netns");
    let (mut policy, mut b, mut set) =
        one_set_applied(&ns, "churn", "offloaded", "{key: 10.32.0.0-10.32.19.135}");
    assert_eq!(set.ranges().len(), 1, "one block");
    assert_eq!(listed(&ns), "10.32.0.0-10.32.19.135");
    let seed = std::env::var("PEERWALL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("PEERWALL_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let base: u128 = 0x0a20_0000;
    let mut next: u128 = 5000;
    let one = |a: u128| AddrRange {
        lo: base + a,
        hi: base + a,
    };
    let mut edits = 0;
    for round in 0..150 {
        // As the agent sends them: one change per slice the round saw move, each relative to
        // the set as the previous one left it (several may edit the same range).
        let mut changes = Vec::new();
        for _ in 0..rng.random_range(1..=4) {
            let edit = if rng.random_bool(0.5) {
                next += 1;
                set.insert_range(one(next - 1))
            } else {
                set.remove_range(one(rng.random_range(0..next)))
            };
            if !edit.is_empty() {
                changes.push(SetChange {
                    table: "peerwall_churn".into(),
                    family: policy.tables[0].family,
                    set: "offloaded".into(),
                    addr_family: IpFamily::V4,
                    edit,
                });
            }
        }
        if changes.is_empty() {
            continue;
        }
        edits += 1;
        policy.tables[0].sets[0].elements = SetElements::Addr(set.clone());
        let report = b
            .update_sets(&policy, &changes)
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): {e}"));
        assert!(
            report.over_netlink && report.recreated.is_empty(),
            "round {round} (seed {seed}): {report:?}"
        );
        assert_eq!(
            peerwall_backend_nftables::netlink::fallbacks(),
            0,
            "round {round} (seed {seed}): the kernel refused an edit of {changes:?}"
        );
        let want = AddrSet::nft_elements(&set).join(", ");
        assert_eq!(listed(&ns), want, "round {round} (seed {seed})");
    }
    assert!(edits > 100, "the churn edited the set ({edits} rounds)");
    assert_eq!(b.drift().unwrap(), Vec::<Drift>::new());
}

/// The kernel's declared size of `inet peerwall_grow pods`.
fn listed_size(ns: &NetNs) -> Option<usize> {
    let o = in_ns(ns, "nft", &["list", "set", "inet", "peerwall_grow", "pods"]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    text.lines()
        .find_map(|l| l.trim().strip_prefix("size "))
        .and_then(|n| n.trim().parse().ok())
}

/// A hash set declares a size (the kernel's fixed-size hash, the faster lookup), and pods
/// added and removed one at a time through the in-place path carry it across its size both
/// ways: within it, one element over netlink; at the edge, the table recreated with the next
/// size, never an element the kernel refuses.
#[test]
fn a_hash_set_grows_and_shrinks_across_its_declared_size() {
    require_root();
    let ns = NetNs::new("pwx-grow").expect("netns");
    let addr = |i: u128| 0x0a21_0000u128 + 2 * i;
    let elements: String = (0..30)
        .map(|i| format!("{{key: {}}}, ", std::net::Ipv4Addr::from(addr(i) as u32)))
        .collect();
    let (mut policy, mut b, mut set) = one_set_applied(&ns, "grow", "pods", &elements);
    assert_eq!(listed_size(&ns), Some(64), "30 pods: room for 64");
    let one = |i: u128| AddrRange {
        lo: addr(i),
        hi: addr(i),
    };
    let fallbacks = peerwall_backend_nftables::netlink::fallbacks();
    let mut n: u128 = 30;
    let mut recreated = Vec::new();
    // Up to 70 pods (across 32 and 64), then down to 20.
    let steps = (0..40).map(|_| true).chain((0..50).map(|_| false));
    for grow in steps {
        let edit = if grow {
            n += 1;
            set.insert_range(one(n - 1))
        } else {
            n -= 1;
            set.remove_range(one(n))
        };
        let changes = vec![SetChange {
            table: "peerwall_grow".into(),
            family: policy.tables[0].family,
            set: "pods".into(),
            addr_family: IpFamily::V4,
            edit,
        }];
        policy.tables[0].sets[0].elements = SetElements::Addr(set.clone());
        let report = b
            .update_sets(&policy, &changes)
            .unwrap_or_else(|e| panic!("{n} pods: {e}"));
        let size = peerwall_backend_nftables::model::capacity_for(n as usize);
        assert_eq!(listed_size(&ns), Some(size), "{n} pods: {report:?}");
        if report.recreated.is_empty() {
            assert!(report.over_netlink, "{n} pods: {report:?}");
        } else {
            recreated.push(n);
        }
        let want = AddrSet::nft_elements(&set).join(", ");
        let o = in_ns(
            &ns,
            "nft",
            &["list", "set", "inet", "peerwall_grow", "pods"],
        );
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let mut got: Vec<&str> = text
            .split_once("elements = {")
            .map(|(_, rest)| rest.split('}').next().unwrap_or(""))
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        got.sort_unstable();
        let mut want: Vec<&str> = want.split(", ").filter(|e| !e.is_empty()).collect();
        want.sort_unstable();
        assert_eq!(got, want, "{n} pods");
    }
    // The size changes where the element count crosses a power of two: 33 and 65 pods on the
    // way up, 64 and 32 on the way down; every other edit was one element in place.
    assert_eq!(recreated, [33, 65, 64, 32], "where the table was recreated");
    assert_eq!(
        peerwall_backend_nftables::netlink::fallbacks(),
        fallbacks,
        "the kernel refused an element edit"
    );
    assert_eq!(b.drift().unwrap(), Vec::<Drift>::new());
}
