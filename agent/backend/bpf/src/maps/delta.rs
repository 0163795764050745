//! Set edits → address-map entry changes, without compiling the policy again.
//!
//! In an address dimension of a chain, the map holds one entry per prefix of the cover of
//! every rule's set `S_i` (each set's minimal prefixes), valued with the rules whose set
//! contains the whole prefix (`{i : p ⊆ S_i}`; the longest match then answers for an address).
//! A set edit changes `S_j` only inside its changed ranges, so the only entries that can change
//! are the prefixes of those ranges and the existing entries overlapping them: each is
//! recomputed by point queries on the (already edited) sets, O(log n) apiece. A chain where the
//! edited set is combined with another test of the same dimension (`eq A, neq B`) needs the
//! range algebra of a full compilation: [`set_delta`] then answers `None`.

use ipnet::IpNet;
use peerwall_common::Bitmap;
use peerwall_policy::ir::{self, AddrRange, AddrSet, ChainKind, Dir, SetChange, Source, Test};

use super::{BpfPolicy, ChainMaps};

/// One changed entry of an address dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddrEntryChange {
    /// Chain id.
    pub chain: u32,
    /// Source or destination dimension.
    pub dir: Dir,
    /// The prefix.
    pub net: IpNet,
    /// Its new rules, or `None`: the entry goes away.
    pub value: Option<Bitmap>,
}

/// The set of each deciding rule in dimension `dir`: `None` when the rule does not test it,
/// `Some(set)` when it has exactly one test there; `Err` when a rule combines several.
fn rule_sets(chain: &ir::Chain, dir: Dir) -> Result<Vec<Option<&AddrSet>>, ()> {
    let mut out = Vec::new();
    for r in chain.rules.iter().filter(|r| r.action.verdict().is_some()) {
        let mut tests = r.matches.iter().filter_map(|m| match &m.test {
            Test::Addr { dir: d, set, .. } if *d == dir => Some(set),
            _ => None,
        });
        let first = tests.next();
        if tests.next().is_some() {
            return Err(());
        }
        out.push(first);
    }
    Ok(out)
}

fn references(chain: &ir::Chain, dir: Dir, set: &str) -> bool {
    chain
        .rules
        .iter()
        .filter(|r| r.action.verdict().is_some())
        .flat_map(|r| &r.matches)
        .any(|m| {
            matches!(&m.test, Test::Addr { dir: d, source: Source::Named(n), .. } if *d == dir && n == set)
        })
}

fn bounds(n: &IpNet) -> AddrRange {
    AddrRange {
        lo: ir::addr::addr_to_u128(&n.network()),
        hi: ir::addr::addr_to_u128(&n.broadcast()),
    }
}

fn family_of(n: &IpNet) -> ir::IpFamily {
    ir::IpFamily::of(&n.addr())
}

/// The canonical range of `set` holding all of `r`, if one does.
fn holding(set: &AddrSet, r: AddrRange) -> Option<AddrRange> {
    let rs = set.ranges();
    let i = rs.partition_point(|x| x.hi < r.lo);
    rs.get(i).copied().filter(|x| x.lo <= r.lo && r.hi <= x.hi)
}

/// Whether `n` is one of the minimal prefixes covering `set`.
fn in_cover(set: &AddrSet, n: &IpNet) -> bool {
    if set.family() != family_of(n) {
        return false;
    }
    holding(set, bounds(n)).is_some_and(|r| {
        AddrSet::from_ranges(set.family(), [r])
            .to_prefixes()
            .contains(n)
    })
}

fn entries_of(c: &ChainMaps, dir: Dir) -> &Vec<(IpNet, Bitmap)> {
    match dir {
        Dir::Src => &c.src,
        Dir::Dst => &c.dst,
    }
}

/// The entry changes that `changes` (already applied to `policy`, [`ir::Policy::edit_set`])
/// make to `live` (the datapath's view of the policy before them), or `None` when a chain
/// needs a full compilation.
pub fn set_delta(
    live: &BpfPolicy,
    policy: &ir::Policy,
    changes: &[SetChange],
) -> Option<Vec<AddrEntryChange>> {
    // Every (chain, dimension) a change reaches, with all the ranges changed there: a key
    // is evaluated once, however many changes (several slices of one set, several sets)
    // reach it.
    let mut work: std::collections::BTreeMap<(String, String, u8), Vec<(ir::IpFamily, AddrRange)>> =
        Default::default();
    for c in changes {
        let table = policy.table(&c.table)?;
        for chain in table.chains.iter().filter(|x| x.kind == ChainKind::Filter) {
            for (d, dir) in [(0u8, Dir::Src), (1, Dir::Dst)] {
                if references(chain, dir, &c.set) {
                    work.entry((table.name.clone(), chain.name.clone(), d))
                        .or_default()
                        .extend(
                            c.edit
                                .removed
                                .iter()
                                .chain(&c.edit.added)
                                .map(|r| (c.addr_family, *r)),
                        );
                }
            }
        }
    }
    let mut out = Vec::new();
    for ((table, chain, d), mut changed) in work {
        let dir = if d == 0 { Dir::Src } else { Dir::Dst };
        let ir_chain = policy
            .table(&table)?
            .chains
            .iter()
            .find(|c| c.name == chain)?;
        let sets = rule_sets(ir_chain, dir).ok()?;
        let maps = live
            .chains
            .iter()
            .find(|m| m.table == table && m.chain == chain)?;
        changed.sort_unstable();
        changed.dedup();
        // Candidates: the prefixes of the changed ranges, and existing entries overlapping
        // them.
        let mut candidates: std::collections::BTreeMap<IpNet, Option<Bitmap>> = Default::default();
        for (family, r) in &changed {
            for n in AddrSet::from_ranges(*family, [*r]).to_prefixes() {
                candidates.insert(n, None);
            }
        }
        // The changed region per family, canonical (sorted, disjoint) for the overlap search.
        let region = |fam: ir::IpFamily| {
            AddrSet::from_ranges(
                fam,
                changed.iter().filter(|(f, _)| *f == fam).map(|(_, r)| *r),
            )
        };
        let (v4, v6) = (region(ir::IpFamily::V4), region(ir::IpFamily::V6));
        for (n, b) in entries_of(maps, dir) {
            let (fam, nb) = (family_of(n), bounds(n));
            let rs = match fam {
                ir::IpFamily::V4 => v4.ranges(),
                ir::IpFamily::V6 => v6.ranges(),
            };
            let i = rs.partition_point(|x| x.hi < nb.lo);
            let overlaps = rs.get(i).is_some_and(|x| x.lo <= nb.hi);
            if overlaps || candidates.contains_key(n) {
                candidates.insert(*n, Some(*b));
            }
        }
        for (n, old) in candidates {
            let (fam, nb) = (family_of(&n), bounds(&n));
            let mut value = Bitmap::EMPTY;
            let mut covered = false;
            for (i, s) in sets.iter().enumerate() {
                let Some(s) = s else { continue };
                if s.family() == fam && holding(s, nb).is_some() {
                    value.set(i);
                    covered |= in_cover(s, &n);
                }
            }
            let new = covered.then_some(value);
            if new != old {
                out.push(AddrEntryChange {
                    chain: maps.id,
                    dir,
                    net: n,
                    value: new,
                });
            }
        }
    }
    Some(out)
}

/// Apply entry changes to the datapath's view (so it keeps matching the kernel's maps).
pub fn apply_delta(p: &mut BpfPolicy, changes: &[AddrEntryChange]) {
    for ch in changes {
        let Some(c) = p.chains.iter_mut().find(|c| c.id == ch.chain) else {
            continue;
        };
        let v = match ch.dir {
            Dir::Src => &mut c.src,
            Dir::Dst => &mut c.dst,
        };
        match (v.iter().position(|(n, _)| *n == ch.net), ch.value) {
            (Some(i), Some(b)) => v[i].1 = b,
            (Some(i), None) => {
                v.swap_remove(i);
            }
            (None, Some(b)) => v.push((ch.net, b)),
            (None, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::compile;
    use peerwall_policy::ir::SetOp;
    use proptest::prelude::*;

    const POLICY: &str = r#"
apiVersion: peerwall.io/v1alpha1
kind: FirewallConfiguration
metadata: {name: gw, namespace: t}
spec:
  table:
    name: gw
    family: INET
    sets:
    - {name: pods, keyType: ipv4_addr, fromAddressSets: true}
    - {name: own, keyType: ipv4_addr, elements: [{key: 10.0.0.0/28}, {key: 10.0.1.5}]}
    chains:
    - name: fwd
      type: filter
      hook: forward
      priority: 0
      policy: accept
      rules:
        filterRules:
        - {name: own, match: [{op: eq, ip: {value: "@own", position: dst}}], action: accept}
        - {name: not_pods, match: [{op: neq, ip: {value: "@pods", position: src}}], action: drop}
        - {name: pods, match: [{op: eq, ip: {value: "@pods", position: dst}}], action: accept}
        - {name: wide, match: [{op: eq, ip: {value: "10.0.0.0/24", position: dst}}], action: drop}
"#;

    type Entries = Vec<(IpNet, Bitmap)>;

    fn sorted(p: &BpfPolicy) -> Vec<(u32, Entries, Entries)> {
        p.chains
            .iter()
            .map(|c| {
                let (mut s, mut d) = (c.src.clone(), c.dst.clone());
                s.sort_by_key(|x| x.0);
                d.sort_by_key(|x| x.0);
                (c.id, s, d)
            })
            .collect()
    }

    proptest! {
        // Entry changes from point queries equal the difference of two full compilations,
        // whatever the edits (hosts and prefixes, overlapping other rules' prefixes).
        #[test]
        fn delta_equals_recompiling(edits in proptest::collection::vec(
            (any::<bool>(), 0u8..40, prop_oneof![Just(32u8), Just(31u8), Just(29u8)]), 1..12)
        ) {
            let objs = peerwall_intent::load::parse_documents(POLICY, "t").unwrap();
            let mut policy = compile::compile(&objs).unwrap().policy;
            let ifaces = [];
            let mut live = crate::maps::compile(&policy, &ifaces).unwrap();
            // Batches of up to three changes, as several slices changing in one round give.
            for batch in edits.chunks(3) {
                let mut changes = Vec::new();
                for (add, host, len) in batch {
                    let net: IpNet = format!("10.0.0.{}/{len}", host * 4).parse::<IpNet>().unwrap().trunc();
                    let r = bounds(&net);
                    let op = if *add { SetOp::Add(r) } else { SetOp::Remove(r) };
                    changes.push(policy.edit_set("gw", "pods", &[op]).unwrap());
                }
                let d = set_delta(&live, &policy, &changes).expect("single tests: no fallback");
                let keys: std::collections::BTreeSet<_> = d.iter().map(|c| (c.chain, c.dir == Dir::Src, c.net)).collect();
                prop_assert_eq!(keys.len(), d.len(), "one change per entry");
                apply_delta(&mut live, &d);
                let fresh = crate::maps::compile(&policy, &ifaces).unwrap();
                prop_assert_eq!(sorted(&live), sorted(&fresh));
            }
        }
    }

    #[test]
    fn a_combined_test_falls_back_to_compiling() {
        let text = POLICY.replace(
            r#"- {name: pods, match: [{op: eq, ip: {value: "@pods", position: dst}}], action: accept}"#,
            r#"- {name: pods, match: [{op: eq, ip: {value: "@pods", position: dst}}, {op: neq, ip: {value: "10.0.0.9", position: dst}}], action: accept}"#,
        );
        let objs = peerwall_intent::load::parse_documents(&text, "t").unwrap();
        let mut policy = compile::compile(&objs).unwrap().policy;
        let live = crate::maps::compile(&policy, &[]).unwrap();
        let change = policy
            .edit_set(
                "gw",
                "pods",
                &[SetOp::Add(AddrRange {
                    lo: 0x0a00_0001,
                    hi: 0x0a00_0001,
                })],
            )
            .unwrap();
        assert_eq!(set_delta(&live, &policy, &[change]), None);
    }
}
