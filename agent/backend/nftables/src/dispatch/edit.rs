//! A dispatch map's elements edited in place ([`map_edits`]): when addresses join or leave
//! the host sets a dispatched run looks up (a pod relabelled under a NetworkPolicy tier),
//! each such address's class is found again from the run's lookups ([`DispatchMap`]) and its
//! map element follows: deleted when no rule of the run selects it any more, added when one
//! does, its jump changed when the rules that select it change. That is what rendering the
//! table again ([`super::dispatch`]) would give, as long as the classes stay those rendered:
//! an address whose rules make a class no chain holds, or a class every address left, is a
//! chain more or less, the table's structure, and so is a map whose count crosses the size it
//! declares: the caller renders it again.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use crate::model::{capacity_for, ClassChain, DispatchMap, Element, KeyType, Lookup, Set, Table};

/// Addresses changed in one call at most; a larger change is rendered again (each address
/// is a walk of its maps' elements).
pub const MAX_ADDRESSES: usize = 1024;

/// One set's element changes: the elements leaving it, then those joining.
#[derive(Clone, Copy, Debug)]
pub struct SetEdit<'a> {
    /// The set's name.
    pub set: &'a str,
    /// Elements deleted.
    pub gone: &'a [Element],
    /// Elements added.
    pub new: &'a [Element],
}

/// One map's element changes: the elements to delete, then those to add.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEdit {
    /// The map's name.
    pub map: String,
    /// Elements deleted.
    pub gone: Vec<Element>,
    /// Elements added.
    pub new: Vec<Element>,
}

/// The edits of `t`'s dispatch maps that `edits` of its sets (each set at most once) make,
/// as rendering `t` again with those sets would have them; None when that rendering would
/// differ in more than map elements (a class without a chain, a chain left without a class,
/// an element of a dispatched set that is not one address) or the change is larger than
/// [`MAX_ADDRESSES`].
pub fn map_edits(t: &Table, edits: &[SetEdit<'_>]) -> Option<Vec<MapEdit>> {
    let edited: HashMap<&str, &SetEdit<'_>> = edits.iter().map(|e| (e.set, e)).collect();
    if edited.len() != edits.len() {
        return None;
    }
    let sources = t.dispatch_sources();
    let mut touched = Vec::new();
    for e in edits.iter().filter(|e| sources.contains(e.set)) {
        for el in e.gone.iter().chain(e.new) {
            let Element::Addr(a) = el else {
                return None;
            };
            touched.push(*a);
        }
    }
    if touched.is_empty() {
        return Some(Vec::new());
    }
    touched.sort_unstable();
    touched.dedup();
    if touched.len() > MAX_ADDRESSES {
        return None;
    }
    let sets: HashMap<&str, &Set> = t.sets.iter().map(|s| (s.name.as_str(), s)).collect();
    // Whether set `name` holds `a` once the edits are made.
    let holds = |name: &str, a: IpAddr| {
        let el = Element::Addr(a);
        match edited.get(name) {
            Some(e) if e.new.contains(&el) => true,
            Some(e) if e.gone.contains(&el) => false,
            _ => sets.get(name).is_some_and(|s| s.elements.contains(&el)),
        }
    };
    let mut out = Vec::new();
    for dm in &t.dispatch_maps {
        let looks_up_edited = dm
            .lookups
            .iter()
            .flatten()
            .any(|l| matches!(l, Lookup::Set(n) if edited.contains_key(n.as_str())));
        if !looks_up_edited {
            continue;
        }
        let map = sets.get(dm.map.as_str())?;
        let v4 = map.key == KeyType::Ipv4Addr;
        let edit = one_map(
            dm,
            map,
            touched.iter().filter(|a| a.is_ipv4() == v4),
            &holds,
        )?;
        if !edit.gone.is_empty() || !edit.new.is_empty() {
            out.push(edit);
        }
    }
    Some(out)
}

/// The edits of one map for the addresses `touched` (of its family).
fn one_map<'a>(
    dm: &DispatchMap,
    map: &Set,
    touched: impl Iterator<Item = &'a IpAddr>,
    holds: &impl Fn(&str, IpAddr) -> bool,
) -> Option<MapEdit> {
    let mut edit = MapEdit {
        map: dm.map.clone(),
        gone: Vec::new(),
        new: Vec::new(),
    };
    let mut left: HashSet<IpAddr> = HashSet::new();
    let mut emptied: HashSet<ClassChain> = HashSet::new();
    for &a in touched {
        // The rules of the run that select `a` now, ascending: its class.
        let positions: Vec<u32> = dm
            .lookups
            .iter()
            .enumerate()
            .filter(|(_, l)| match l {
                Some(Lookup::Set(n)) => holds(n, a),
                Some(Lookup::One(x)) => *x == a,
                None => false,
            })
            .map(|(p, _)| p as u32)
            .collect();
        let to = match positions.is_empty() {
            true => None,
            false => Some(*dm.classes.get(&positions)?),
        };
        let from = map.elements.iter().find_map(|e| match e {
            Element::Jump(x, c) if *x == a => Some(*c),
            _ => None,
        });
        if from == to {
            continue;
        }
        if let Some(c) = from {
            edit.gone.push(Element::Jump(a, c));
            left.insert(a);
            emptied.insert(c);
        }
        if let Some(c) = to {
            edit.new.push(Element::Jump(a, c));
        }
    }
    // A class that lost addresses keeps its chain only while some address is still in it.
    for c in emptied {
        let stays = map
            .elements
            .iter()
            .any(|e| matches!(e, Element::Jump(x, k) if *k == c && !left.contains(x)))
            || edit
                .new
                .iter()
                .any(|e| matches!(e, Element::Jump(_, k) if *k == c));
        if !stays {
            return None;
        }
    }
    // The size the map declares follows its element count ([`Set::capacity`]): a count that
    // crosses it is a map of another size.
    let len = map.elements.len() - edit.gone.len() + edit.new.len();
    if map.capacity() != Some(capacity_for(len)) {
        return None;
    }
    Some(edit)
}

#[cfg(test)]
#[path = "edit/tests.rs"]
mod tests;
