//! A compiled policy with the address slices (`AddressSet` objects) of its sets merged in, kept
//! up to date one slice at a time.
//!
//! A set declared with `fromAddressSets: true` holds its inline elements plus the addresses of
//! every slice that names it. An address stays a member while any source lists it (counted per
//! source), so a pod moving from one slice to another, or listed inline and in a slice, never
//! leaves the set in between. A slice change is diffed against that slice's previous addresses
//! (at most 1000) and becomes [`SetOp`]s on the compiled IR ([`Policy::edit_set`]): nothing is
//! re-validated or recompiled, and the [`SetChange`]s returned are what the backend changes in
//! the kernel. Pure: data in, data out.

use std::collections::BTreeMap;

use peerwall_intent::types::MAX_SLICE_ADDRESSES;
use peerwall_intent::{AddressSetObject, Origin};

use crate::compile::values::parse_addr_item;
use crate::compile::{Compiled, FieldError, ObjectErrors, Problem};
use crate::ir::{AddrRange, AddrSet, IpFamily, Policy, SetChange, SetElements, SetOp};

/// A validated AddressSet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedSlice {
    /// `namespace/name` of the slice.
    pub origin: Origin,
    /// The FirewallConfiguration it fills.
    pub target: Origin,
    /// The set it fills.
    pub set: String,
    /// Family of its addresses (none when it is empty).
    pub family: Option<IpFamily>,
    /// Its addresses, sorted, without duplicates.
    pub ranges: Vec<AddrRange>,
}

/// Validate an AddressSet on its own (the webhook's and the agent's check): names present,
/// at most [`MAX_SLICE_ADDRESSES`] addresses, each an address, CIDR or range, all of one family.
pub fn check_slice(obj: &AddressSetObject) -> Result<CheckedSlice, ObjectErrors> {
    let mut errors = Vec::new();
    let mut err = |path: String, problem| errors.push(FieldError { path, problem });
    if obj.spec.firewall_configuration.is_empty() {
        err("spec.firewallConfiguration".into(), Problem::Required);
    }
    if obj.spec.set.is_empty() {
        err("spec.set".into(), Problem::Required);
    }
    if obj.spec.addresses.len() > MAX_SLICE_ADDRESSES {
        err(
            "spec.addresses".into(),
            Problem::TooManyAddresses {
                count: obj.spec.addresses.len(),
                max: MAX_SLICE_ADDRESSES,
            },
        );
    }
    let mut family = None;
    let mut ranges = Vec::with_capacity(obj.spec.addresses.len());
    for (i, a) in obj.spec.addresses.iter().enumerate() {
        let path = format!("spec.addresses[{i}]");
        match parse_addr_item(a) {
            Ok(item) => match family {
                Some(f) if f != item.family => err(path, Problem::MixedFamilies(a.clone())),
                _ => {
                    family = Some(item.family);
                    ranges.push(item.range);
                }
            },
            Err(p) => err(path, p),
        }
    }
    if !errors.is_empty() {
        return Err(ObjectErrors {
            origin: obj.origin.0.clone(),
            errors,
        });
    }
    ranges.sort_unstable();
    ranges.dedup();
    Ok(CheckedSlice {
        origin: obj.origin.clone(),
        target: obj.target(),
        set: obj.spec.set.clone(),
        family,
        ranges,
    })
}

/// How many slices fill each set, by `(configuration origin, set)`.
pub fn slice_counts<'a>(
    slices: impl IntoIterator<Item = &'a CheckedSlice>,
) -> BTreeMap<(String, String), u32> {
    let mut out: BTreeMap<(String, String), u32> = BTreeMap::new();
    for s in slices {
        *out.entry((s.target.0.clone(), s.set.clone())).or_default() += 1;
    }
    out
}

/// Why `obj` (under `key`, its `namespace/name`) must wait: a set declaring how many
/// AddressSets fill it (`addressSets`, which peerwall's controller writes after the slices
/// themselves) while fewer are in force (`counts`, [`slice_counts`]). Configurations and
/// slices arrive by separate watches, so a configuration can come before the slices written
/// ahead of it; enforcing it then would enforce a set without their addresses.
pub fn waiting_for_slices(
    key: &str,
    obj: &peerwall_intent::PolicyObject,
    counts: &BTreeMap<(String, String), u32>,
) -> Option<String> {
    let short: Vec<String> = obj
        .spec
        .table
        .sets
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let want = s.address_sets?;
            let seen = counts
                .get(&(key.to_string(), s.name.clone()))
                .copied()
                .unwrap_or(0);
            (seen < want).then(|| {
                format!(
                    "spec.table.sets[{i}] ({:?}): {want} AddressSets declared (addressSets), {seen} seen",
                    s.name
                )
            })
        })
        .collect();
    (!short.is_empty()).then(|| {
        format!(
            "waiting for the AddressSets of its sets: {}",
            short.join("; ")
        )
    })
}

/// Why a valid slice is not merged into any set (its addresses are left out).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SliceIssue {
    /// Its FirewallConfiguration is not enforced here (absent, or refused).
    #[error("spec.firewallConfiguration: {target:?} is not an enforced FirewallConfiguration")]
    NoConfiguration {
        /// `namespace/name`.
        target: String,
    },
    /// The configuration has no such set.
    #[error("spec.set: {set:?} names no set of {target} (spec.table.sets)")]
    NoSet {
        /// Configuration.
        target: String,
        /// Set.
        set: String,
    },
    /// The set is not declared `fromAddressSets: true`.
    #[error("spec.set: set {set:?} of {target} does not take address sets (fromAddressSets is not true)")]
    NotFromSlices {
        /// Configuration.
        target: String,
        /// Set.
        set: String,
    },
    /// The slice's addresses are of the other family.
    #[error(
        "spec.addresses: {slice} addresses, but set {set:?} of {target} holds {set_family} ones"
    )]
    Family {
        /// Configuration.
        target: String,
        /// Set.
        set: String,
        /// The slice's family.
        slice: IpFamily,
        /// The set's family.
        set_family: IpFamily,
    },
}

/// Members of one set drawn from several sources, counted.
#[derive(Clone, Debug, Default)]
struct Members {
    counts: BTreeMap<AddrRange, u32>,
    /// Widest member span so far (bounds the search for members overlapping a removed one).
    widest: u128,
}

impl Members {
    fn add(&mut self, r: AddrRange, ops: &mut Vec<SetOp>) {
        self.widest = self.widest.max(r.hi - r.lo);
        let c = self.counts.entry(r).or_insert(0);
        *c += 1;
        if *c == 1 {
            ops.push(SetOp::Add(r));
        }
    }

    fn remove(&mut self, r: AddrRange, ops: &mut Vec<SetOp>) {
        let Some(c) = self.counts.get_mut(&r) else {
            return;
        };
        *c -= 1;
        if *c > 0 {
            return;
        }
        self.counts.remove(&r);
        ops.push(SetOp::Remove(r));
        // Members still overlapping it keep their addresses.
        let from = AddrRange {
            lo: r.lo.saturating_sub(self.widest),
            hi: 0,
        };
        let to = AddrRange {
            lo: r.hi,
            hi: u128::MAX,
        };
        for m in self.counts.range(from..=to).map(|(m, _)| *m) {
            if m.hi >= r.lo && m.lo <= r.hi {
                ops.push(SetOp::Add(AddrRange {
                    lo: m.lo.max(r.lo),
                    hi: m.hi.min(r.hi),
                }));
            }
        }
    }
}

/// Where a merged slice's addresses went.
#[derive(Clone, Debug)]
struct Merged {
    table: String,
    set: String,
    ranges: Vec<AddrRange>,
}

/// A compiled policy with its slices merged in.
#[derive(Clone, Debug, Default)]
pub struct Sliced {
    compiled: Compiled,
    /// (table, set) → members, for the sets that take slices.
    members: BTreeMap<(String, String), Members>,
    /// Slices merged, by origin.
    merged: BTreeMap<Origin, Merged>,
}

impl Sliced {
    /// Merge `slices` into `compiled` (the bulk form: one canonicalization per set). Returns
    /// the merged policy and the slices left out, with why.
    pub fn new(
        compiled: Compiled,
        slices: &[CheckedSlice],
    ) -> (Self, BTreeMap<Origin, SliceIssue>) {
        let mut members: BTreeMap<(String, String), Members> = BTreeMap::new();
        for t in &compiled.policy.tables {
            for s in t.sets.iter().filter(|s| s.from_slices) {
                if let SetElements::Addr(a) = &s.elements {
                    let m = members.entry((t.name.clone(), s.name.clone())).or_default();
                    let mut ignored = Vec::new();
                    for r in a.ranges() {
                        m.add(*r, &mut ignored);
                    }
                }
            }
        }
        let mut out = Self {
            compiled,
            members,
            merged: BTreeMap::new(),
        };
        let mut issues = BTreeMap::new();
        for s in slices {
            match out.resolve(s) {
                Ok((table, set)) => {
                    let m = out.members.entry((table.clone(), set.clone())).or_default();
                    let mut ignored = Vec::new();
                    for r in &s.ranges {
                        m.add(*r, &mut ignored);
                    }
                    out.merged.insert(
                        s.origin.clone(),
                        Merged {
                            table,
                            set,
                            ranges: s.ranges.clone(),
                        },
                    );
                }
                Err(e) => {
                    issues.insert(s.origin.clone(), e);
                }
            }
        }
        for ((table, set), m) in &out.members {
            let Some(family) = out
                .compiled
                .policy
                .addr_set(table, set)
                .map(AddrSet::family)
            else {
                continue;
            };
            let contents = AddrSet::from_ranges(family, m.counts.keys().copied());
            // The set exists: it was found above.
            let _ = out.compiled.policy.replace_set(table, set, &contents);
        }
        (out, issues)
    }

    /// The set a slice fills: (table, set).
    fn resolve(&self, s: &CheckedSlice) -> Result<(String, String), SliceIssue> {
        let table = self
            .compiled
            .policy
            .tables
            .iter()
            .find(|t| t.origin == s.target)
            .ok_or_else(|| SliceIssue::NoConfiguration {
                target: s.target.0.clone(),
            })?;
        let set = table
            .sets
            .iter()
            .find(|x| x.name == s.set)
            .ok_or_else(|| SliceIssue::NoSet {
                target: s.target.0.clone(),
                set: s.set.clone(),
            })?;
        let SetElements::Addr(a) = &set.elements else {
            return Err(SliceIssue::NotFromSlices {
                target: s.target.0.clone(),
                set: s.set.clone(),
            });
        };
        if !set.from_slices {
            return Err(SliceIssue::NotFromSlices {
                target: s.target.0.clone(),
                set: s.set.clone(),
            });
        }
        match s.family {
            Some(f) if f != a.family() => Err(SliceIssue::Family {
                target: s.target.0.clone(),
                set: s.set.clone(),
                slice: f,
                set_family: a.family(),
            }),
            _ => Ok((table.name.clone(), set.name.clone())),
        }
    }

    /// Replace the slice `origin` with `slice` (`None`: it was deleted). Returns the set
    /// changes to make in the kernel; when the new slice cannot be merged, its previous
    /// addresses are withdrawn too and the issue comes back with those changes.
    pub fn update(
        &mut self,
        origin: &Origin,
        slice: Option<&CheckedSlice>,
    ) -> (Vec<SetChange>, Option<SliceIssue>) {
        let target = match slice.map(|s| self.resolve(s)) {
            Some(Ok(t)) => Some(t),
            Some(Err(e)) => return (self.withdraw(origin), Some(e)),
            None => None,
        };
        let (Some(slice), Some((table, set))) = (slice, target) else {
            return (self.withdraw(origin), None);
        };
        let same_set = self
            .merged
            .get(origin)
            .is_some_and(|m| m.table == table && m.set == set);
        if !same_set {
            let mut changes = self.withdraw(origin);
            let mut ops = Vec::new();
            let m = self
                .members
                .entry((table.clone(), set.clone()))
                .or_default();
            for r in &slice.ranges {
                m.add(*r, &mut ops);
            }
            changes.extend(self.edit(&table, &set, &ops));
            self.merged.insert(
                origin.clone(),
                Merged {
                    table,
                    set,
                    ranges: slice.ranges.clone(),
                },
            );
            return (changes, None);
        }
        let old = self
            .merged
            .get(origin)
            .map(|m| m.ranges.clone())
            .unwrap_or_default();
        let (added, removed) = sorted_diff(&old, &slice.ranges);
        let mut ops = Vec::new();
        let m = self
            .members
            .entry((table.clone(), set.clone()))
            .or_default();
        for r in added {
            m.add(r, &mut ops);
        }
        for r in removed {
            m.remove(r, &mut ops);
        }
        if let Some(m) = self.merged.get_mut(origin) {
            m.ranges.clone_from(&slice.ranges);
        }
        (self.edit(&table, &set, &ops).into_iter().collect(), None)
    }

    /// Take the new inline elements of `sets` (object origin, set name) from `new`, the
    /// compilation of objects that differ from this one's only there
    /// ([`peerwall_intent::elements::inline_element_changes`]): each set edited in place, with
    /// the changes to make in the kernel. None, with nothing changed, when a set is not an
    /// address set of both compilations, takes slices, or changes family, or when the
    /// compilations' warnings differ: then the caller compiles and applies the whole policy.
    pub fn replace_inline(
        &mut self,
        new: &Compiled,
        sets: &[(Origin, String)],
    ) -> Option<Vec<SetChange>> {
        if new.warnings != self.compiled.warnings {
            return None;
        }
        let mut edits = Vec::new();
        for (origin, set) in sets {
            let table = self
                .compiled
                .policy
                .tables
                .iter()
                .find(|t| t.origin == *origin)?;
            if self
                .members
                .contains_key(&(table.name.clone(), set.clone()))
            {
                return None;
            }
            let was = self.compiled.policy.addr_set(&table.name, set)?;
            let now = new.policy.addr_set(&table.name, set)?;
            if was.family() != now.family() {
                return None;
            }
            let (added, removed) = sorted_diff(was.ranges(), now.ranges());
            let ops: Vec<SetOp> = removed
                .into_iter()
                .map(SetOp::Remove)
                .chain(added.into_iter().map(SetOp::Add))
                .collect();
            edits.push((table.name.clone(), set.clone(), ops));
        }
        Some(
            edits
                .into_iter()
                .filter_map(|(table, set, ops)| self.edit(&table, &set, &ops))
                .collect(),
        )
    }

    /// Take a merged slice's addresses out of its set.
    fn withdraw(&mut self, origin: &Origin) -> Vec<SetChange> {
        let Some(old) = self.merged.remove(origin) else {
            return Vec::new();
        };
        let mut ops = Vec::new();
        if let Some(m) = self.members.get_mut(&(old.table.clone(), old.set.clone())) {
            for r in &old.ranges {
                m.remove(*r, &mut ops);
            }
        }
        self.edit(&old.table, &old.set, &ops).into_iter().collect()
    }

    fn edit(&mut self, table: &str, set: &str, ops: &[SetOp]) -> Option<SetChange> {
        if ops.is_empty() {
            return None;
        }
        self.compiled
            .policy
            .edit_set(table, set, ops)
            .ok()
            .filter(|c| !c.edit.is_empty())
    }

    /// The merged compilation.
    pub fn compiled(&self) -> &Compiled {
        &self.compiled
    }

    /// The merged policy.
    pub fn policy(&self) -> &Policy {
        &self.compiled.policy
    }

    /// Whether the slice `origin` is merged.
    pub fn is_merged(&self, origin: &Origin) -> bool {
        self.merged.contains_key(origin)
    }
}

/// (in `new` but not `old`, in `old` but not `new`), both inputs sorted and deduplicated.
fn sorted_diff(old: &[AddrRange], new: &[AddrRange]) -> (Vec<AddrRange>, Vec<AddrRange>) {
    let (mut added, mut removed) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(o), Some(n)) if o == n => {
                i += 1;
                j += 1;
            }
            (Some(o), Some(n)) if o < n => {
                removed.push(*o);
                i += 1;
            }
            (Some(_), Some(n)) => {
                added.push(*n);
                j += 1;
            }
            (Some(o), None) => {
                removed.push(*o);
                i += 1;
            }
            (None, Some(n)) => {
                added.push(*n);
                j += 1;
            }
            (None, None) => break,
        }
    }
    (added, removed)
}

#[cfg(test)]
mod tests;
