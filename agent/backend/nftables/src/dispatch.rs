//! Address dispatch: a long run of rules that each look one address up in a named set (the
//! NetworkPolicy tier's `ip daddr @selected … accept`, one rule per policy clause) costs the
//! kernel one lookup per rule for every packet that matches none of them early. Such a run is
//! rendered instead as one verdict-map lookup on that address (`ip daddr vmap @__pw_v<run>_4`)
//! jumping to a regular chain per *class* of addresses: the addresses that the same rules of
//! the run select. A class chain holds exactly those rules, in their order, without the lookup
//! the map already made; an address no rule of the run selects is not in the map, and the
//! packet goes on after the run as it would have. So every packet meets the rules it could
//! match, in the same order, and nothing else: the same first match, the same verdict and the
//! same counters (a rule's copies in several classes are added up by
//! [`crate::listing::Listing::rule_counters`]), in one hash lookup instead of one per rule.
//!
//! Classes depend on set contents: an address joining, leaving or changing an existing class
//! is one map element edited in place ([`edit`], on the set update path
//! [`crate::NftBackend::update_sets`]); a new class is a new chain and an emptied one a chain
//! gone: the table is rendered again and recreated in one transaction. Runs shorter than
//! [`MIN_RUN`] stay as they are, and so does a run whose classes would copy too many rules
//! (`within_budget`).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hasher;
use std::net::IpAddr;

use peerwall_policy::ir::IpFamily;

use crate::model::{
    ClassChain, DispatchMap, Element, Expr, Key, KeyType, Lookup, Regular, Right, Rule, Set, Table,
    AUTO_SET_PREFIX,
};

pub mod edit;

/// Shortest run worth a map: below it, the rules' own lookups cost about as much.
pub const MIN_RUN: usize = 8;

/// Where a rule looks its dispatch address up: the statement, the family, what it selects.
#[derive(Clone, Debug)]
struct Anchor {
    expr: usize,
    family: IpFamily,
    selects: Lookup,
}

impl Anchor {
    /// The addresses the lookup selects.
    fn addrs<'a>(&'a self, sets: &HostSets<'a>) -> Vec<IpAddr> {
        match &self.selects {
            Lookup::Set(n) => sets
                .get(n.as_str())
                .map(|s| {
                    s.elements
                        .iter()
                        .filter_map(|e| match e {
                            Element::Addr(a) => Some(*a),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default(),
            Lookup::One(a) => vec![*a],
        }
    }
}

/// Sets whose elements are single addresses (hash sets), by name; their addresses are read only
/// for the runs dispatched.
type HostSets<'a> = HashMap<&'a str, &'a Set>;

fn host_sets(t: &Table) -> HostSets<'_> {
    t.sets
        .iter()
        .filter(|s| !s.interval && !s.verdict_map && !s.is_merged())
        .filter(|s| matches!(s.key, KeyType::Ipv4Addr | KeyType::Ipv6Addr))
        .filter(|s| s.elements.iter().all(|e| matches!(e, Element::Addr(_))))
        .map(|s| (s.name.as_str(), s))
        .collect()
}

/// The first positive test of the rule's source (or destination) address against a host set
/// or one address.
fn anchor(r: &Rule, source: bool, sets: &HostSets<'_>) -> Option<Anchor> {
    r.exprs.iter().enumerate().find_map(|(i, e)| match e {
        Expr::Match {
            negate: false,
            left: Key::Addr { family, source: s },
            right,
        } if *s == source => {
            let selects = match right {
                Right::SetRef(n) if sets.contains_key(n.as_str()) => Lookup::Set(n.clone()),
                Right::Element(Element::Addr(a)) => Lookup::One(*a),
                _ => return None,
            };
            Some(Anchor {
                expr: i,
                family: *family,
                selects,
            })
        }
        _ => None,
    })
}

/// Maximal runs (positions in `rules`) of consecutive rules anchored at `source`, at least
/// [`MIN_RUN`] long.
fn runs(
    rules: &[usize],
    all: &[Rule],
    source: bool,
    sets: &HostSets<'_>,
) -> Vec<Vec<(usize, Anchor)>> {
    let mut out = Vec::new();
    let mut cur: Vec<(usize, Anchor)> = Vec::new();
    for &ri in rules {
        match anchor(&all[ri], source, sets) {
            Some(a) => cur.push((ri, a)),
            None if cur.len() >= MIN_RUN => out.push(std::mem::take(&mut cur)),
            None => cur.clear(),
        }
    }
    if cur.len() >= MIN_RUN {
        out.push(cur);
    }
    out
}

/// Whether the classes copy few enough rules: at most four copies of each on average, plus
/// a constant. A policy where every address is in its own mix of many sets stays linear
/// rather than multiplying its rules.
fn within_budget(run_len: usize, copies: usize) -> bool {
    copies <= 4 * run_len + 1024
}

fn class_hash(positions: &[u32]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for p in positions {
        h.write_u32(*p);
    }
    h.finish()
}

/// One run rendered as dispatch: the map rules that replace it in its chain, the maps, the
/// class chains and their rules. None when over budget.
struct Rendered {
    map_rules: Vec<Rule>,
    maps: Vec<Set>,
    regular: Vec<Regular>,
    class_rules: Vec<Rule>,
    dispatch_maps: Vec<DispatchMap>,
}

fn render_run(
    run_no: u32,
    run: &[(usize, Anchor)],
    all: &[Rule],
    sets: &HostSets<'_>,
    chain: &str,
    source: bool,
) -> Option<Rendered> {
    let mut out = Rendered {
        map_rules: Vec::new(),
        maps: Vec::new(),
        regular: Vec::new(),
        class_rules: Vec::new(),
        dispatch_maps: Vec::new(),
    };
    let mut copies = 0usize;
    for family in [IpFamily::V4, IpFamily::V6] {
        // Address → the run's rules (positions) that select it, ascending.
        let mut by_addr: HashMap<IpAddr, Vec<u32>> = HashMap::new();
        for (pos, (_, a)) in run.iter().enumerate() {
            if a.family != family {
                continue;
            }
            for addr in a.addrs(sets) {
                by_addr.entry(addr).or_default().push(pos as u32);
            }
        }
        if !run.iter().any(|(_, a)| a.family == family) {
            continue;
        }
        let mut classes: BTreeMap<Vec<u32>, Vec<IpAddr>> = BTreeMap::new();
        for (addr, positions) in by_addr {
            classes.entry(positions).or_default().push(addr);
        }
        copies += classes.keys().map(Vec::len).sum::<usize>();
        if !within_budget(run.len(), copies) {
            return None;
        }
        let mut elements = Vec::new();
        let mut names: HashMap<u64, &Vec<u32>> = HashMap::new();
        let mut kept = BTreeMap::new();
        for (positions, addrs) in &classes {
            let cc = ClassChain {
                run: run_no,
                class: class_hash(positions),
            };
            // Two classes of one name would share a chain: keep the run linear instead.
            if names.insert(cc.class, positions).is_some() {
                return None;
            }
            kept.insert(positions.clone(), cc);
            let name = cc.name();
            out.regular.push(Regular {
                name: name.clone(),
                base: chain.to_string(),
            });
            for &p in positions {
                let (ri, a) = &run[p as usize];
                let mut r = all[*ri].clone();
                r.exprs.remove(a.expr);
                r.chain = name.clone();
                out.class_rules.push(r);
            }
            elements.extend(addrs.iter().map(|a| Element::Jump(*a, cc)));
        }
        elements.sort_unstable();
        let map = format!(
            "{AUTO_SET_PREFIX}v{run_no}_{}",
            match family {
                IpFamily::V4 => 4,
                IpFamily::V6 => 6,
            }
        );
        out.dispatch_maps.push(DispatchMap {
            map: map.clone(),
            lookups: run
                .iter()
                .map(|(_, a)| (a.family == family).then(|| a.selects.clone()))
                .collect(),
            classes: kept,
        });
        out.maps.push(Set {
            name: map.clone(),
            key: KeyType::of(family),
            interval: false,
            elements,
            counter: false,
            comments: Vec::new(),
            verdict_map: true,
            timeout: None,
        });
        out.map_rules.push(Rule {
            chain: chain.to_string(),
            comment: String::new(),
            exprs: vec![Expr::Vmap {
                key: Key::Addr { family, source },
                map,
            }],
        });
    }
    Some(out)
}

/// Render every long enough run of `t`'s base chains as dispatch (see the module).
pub fn dispatch(t: &mut Table) {
    let sets = host_sets(t);
    let mut replaced: HashMap<usize, Vec<Rule>> = HashMap::new();
    let mut dropped: Vec<usize> = Vec::new();
    let mut maps = Vec::new();
    let mut regular = Vec::new();
    let mut class_rules = Vec::new();
    let mut dispatch_maps = Vec::new();
    let mut run_no = 0u32;
    for c in &t.chains {
        let rules: Vec<usize> = (0..t.rules.len())
            .filter(|&i| t.rules[i].chain == c.name)
            .collect();
        // The address position whose runs cover more rules.
        let candidates = [false, true].map(|source| runs(&rules, &t.rules, source, &sets));
        let covered = |rs: &Vec<Vec<(usize, Anchor)>>| rs.iter().map(Vec::len).sum::<usize>();
        let (source, chosen) = if covered(&candidates[1]) > covered(&candidates[0]) {
            (true, &candidates[1])
        } else {
            (false, &candidates[0])
        };
        for run in chosen {
            let Some(r) = render_run(run_no, run, &t.rules, &sets, &c.name, source) else {
                continue;
            };
            run_no += 1;
            replaced.insert(run[0].0, r.map_rules);
            dropped.extend(run.iter().skip(1).map(|(ri, _)| *ri));
            maps.extend(r.maps);
            regular.extend(r.regular);
            class_rules.extend(r.class_rules);
            dispatch_maps.extend(r.dispatch_maps);
        }
    }
    if replaced.is_empty() {
        return;
    }
    let dropped: std::collections::HashSet<usize> = dropped.into_iter().collect();
    let old = std::mem::take(&mut t.rules);
    for (i, r) in old.into_iter().enumerate() {
        if let Some(m) = replaced.remove(&i) {
            t.rules.extend(m);
        } else if !dropped.contains(&i) {
            t.rules.push(r);
        }
    }
    t.rules.extend(class_rules);
    t.sets.extend(maps);
    t.regular.extend(regular);
    t.dispatch_maps = dispatch_maps;
}

#[cfg(test)]
mod tests;
