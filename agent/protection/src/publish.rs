//! From desired sets to AddressSet writes, in O(changes): what the API holds for each peer
//! (its slices as last observed, overlaid with the controller's own writes not observed yet),
//! the IP-reuse gate, and the incremental layout.
//!
//! [`Publisher::plan`] takes the addresses that changed for a peer — in its desired sets
//! ([`DesiredIndex::take_changes`]), in what the API shows of its slices (someone else's
//! edit, an agent's report), or held back by the gate last time — and decides, for each, to
//! add it to a slice, take it out, or hold it. The result follows [`super::layout`]'s rules
//! (an address that stays never moves; a new one fills the slice with the most room, among
//! those under half full and those opened by this plan, or a new slice; a change of k
//! addresses rewrites at most k slices) and [`super::gate_reuse`]'s (an offloaded address
//! joins a peer only once no other peer's published slices hold it and every other peer has
//! applied all it was given).
//!
//! A planned write is visible at once (to the next plan, and to other peers' gates as "not
//! settled") and stays so until the API shows that version, so a plan never works from a
//! view older than the controller's own writes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use super::index::{Changes, DesiredIndex, Kind};
use super::slices::Room;
use super::{slice_name, Options, Slice};

/// A version of an object as the API reports it (`metadata.resourceVersion`).
pub type Version = String;

/// Whether the API's `seen` version is at least our `written` one. Kubernetes calls versions
/// opaque; etcd-backed servers use its revision, so numbers compare, and anything else only
/// matches itself.
fn reached(seen: &str, written: &str) -> bool {
    match (seen.parse::<u64>(), written.parse::<u64>()) {
        (Ok(s), Ok(w)) => s >= w,
        _ => seen == written,
    }
}

#[derive(Clone, Debug)]
struct Entry {
    /// What the API shows, and whether every host applied that version.
    observed: Option<(Version, Slice)>,
    /// The spec generation `observed` was read at: a new version of the same generation
    /// (a host writing its status) holds the same addresses, which are not read again.
    generation: Option<i64>,
    applied: bool,
    /// Our write, until the API shows it: the version it got (`None` while in flight).
    written: Option<(Option<Version>, Slice)>,
    /// Seen in the current sync.
    seen: bool,
}

impl Entry {
    fn effective(&self) -> Option<&Slice> {
        self.written
            .as_ref()
            .map(|(_, s)| s)
            .or(self.observed.as_ref().map(|(_, s)| s))
    }
}

/// The slices of one peer's gateway configuration.
#[derive(Clone, Debug)]
pub struct PeerSlices {
    entries: BTreeMap<String, Entry>,
    /// Set name → address → the slices holding it (more than one only after a lost race or
    /// someone else's edit).
    place: HashMap<String, HashMap<IpAddr, Vec<String>>>,
    /// Addresses whose published state changed other than by our plans.
    dirty: BTreeSet<(Kind, IpAddr)>,
    /// Nothing observed yet: the first plan compares everything.
    fresh: bool,
}

impl Default for PeerSlices {
    fn default() -> Self {
        Self {
            entries: BTreeMap::new(),
            place: HashMap::new(),
            dirty: BTreeSet::new(),
            fresh: true,
        }
    }
}

impl PeerSlices {
    /// Whether set `set` holds `ip`, as published (our writes included).
    pub fn has(&self, set: &str, ip: IpAddr) -> bool {
        self.place
            .get(set)
            .and_then(|m| m.get(&ip))
            .is_some_and(|v| !v.is_empty())
    }

    /// Every address published in set `set`.
    pub fn members(&self, set: &str) -> Vec<IpAddr> {
        self.place
            .get(set)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    /// No write of ours is waiting to show, and every host applied every slice.
    pub fn settled(&self) -> bool {
        self.entries
            .values()
            .all(|e| e.written.is_none() && e.applied)
    }

    fn replace_effective(&mut self, name: &str, old: Option<Slice>, ours: bool) {
        let new = self.entries.get(name).and_then(Entry::effective).cloned();
        if old == new {
            return;
        }
        if let Some(o) = &old {
            let m = self.place.entry(o.set.clone()).or_default();
            for ip in &o.addresses {
                if let Some(v) = m.get_mut(ip) {
                    v.retain(|n| n != name);
                    if v.is_empty() {
                        m.remove(ip);
                    }
                }
            }
        }
        if let Some(n) = &new {
            let m = self.place.entry(n.set.clone()).or_default();
            for ip in &n.addresses {
                m.entry(*ip).or_default().push(name.to_string());
            }
        }
        if ours {
            return;
        }
        // Someone else's change (or the API catching up): what differs is compared again.
        let mut sides: BTreeMap<&str, [Option<&BTreeSet<IpAddr>>; 2]> = BTreeMap::new();
        for (i, sl) in [&old, &new].into_iter().enumerate() {
            if let Some(sl) = sl {
                sides.entry(sl.set.as_str()).or_default()[i] = Some(&sl.addresses);
            }
        }
        let empty = BTreeSet::new();
        let mut dirty = vec![];
        for (set, [a, b]) in sides {
            let Some((k, _)) = Kind::of_set(set) else {
                continue;
            };
            let (a, b) = (a.unwrap_or(&empty), b.unwrap_or(&empty));
            dirty.extend(a.symmetric_difference(b).map(|ip| (k, *ip)));
        }
        self.dirty.extend(dirty);
    }

    /// Start a sync with the API's view (each slice then [`Self::observe`]d, then
    /// [`Self::end_sync`]).
    pub fn begin_sync(&mut self) {
        for e in self.entries.values_mut() {
            e.seen = false;
        }
    }

    /// The API shows `slice` at `version` (of spec `generation`, when the API counts them),
    /// applied by every host or not. `content` is read only when the version is new and its
    /// generation too: status writes (every host's condition) move the version alone, and at
    /// 100 slices of 1000 addresses reading them again held the next pod back by 0.3 s.
    pub fn observe(
        &mut self,
        name: &str,
        version: &str,
        generation: Option<i64>,
        applied: bool,
        content: impl FnOnce() -> Slice,
    ) {
        if let Some(e) = self.entries.get_mut(name) {
            e.seen = true;
            e.applied = applied;
            if e.observed.as_ref().is_some_and(|(v, _)| v == version) {
                return;
            }
            let same_spec = generation.is_some() && e.generation == generation;
            if let (true, Some(o)) = (same_spec, e.observed.as_mut()) {
                o.0 = version.to_string();
                let caught_up = e
                    .written
                    .as_ref()
                    .is_some_and(|(w, _)| w.as_deref().is_some_and(|w| reached(version, w)));
                if caught_up {
                    let old = e.effective().cloned();
                    e.written = None;
                    self.replace_effective(name, old, false);
                }
                return;
            }
        }
        let old = self.entries.get(name).and_then(Entry::effective).cloned();
        let e = self.entries.entry(name.to_string()).or_insert(Entry {
            observed: None,
            generation: None,
            applied,
            written: None,
            seen: true,
        });
        e.observed = Some((version.to_string(), content()));
        e.generation = generation;
        if let Some((Some(w), _)) = &e.written {
            if reached(version, w) {
                e.written = None;
            }
        }
        self.replace_effective(name, old, false);
    }

    /// End a sync: slices the API no longer shows are gone (unless our write of them is still
    /// on its way).
    pub fn end_sync(&mut self) {
        let gone: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.seen && e.written.is_none())
            .map(|(n, _)| n.clone())
            .collect();
        for name in gone {
            let old = self
                .entries
                .remove(&name)
                .and_then(|e| e.observed.map(|(_, s)| s));
            self.replace_effective(&name, old, false);
        }
        self.fresh = false;
    }

    /// Our write of `name` succeeded and got `version`.
    pub fn written(&mut self, name: &str, version: Version) {
        if let Some(e) = self.entries.get_mut(name) {
            let done = e
                .observed
                .as_ref()
                .is_some_and(|(seen, _)| reached(seen, &version));
            match &mut e.written {
                Some(w) if !done => w.0 = Some(version),
                _ => {
                    // The API showed it already (a watch event before the response).
                    let old = e.effective().cloned();
                    e.written = None;
                    self.replace_effective(name, old, false);
                }
            }
        }
    }

    /// Our write of `name` failed: the API's view stands (what differs is compared again).
    pub fn write_failed(&mut self, name: &str) {
        let Some(e) = self.entries.get_mut(name) else {
            return;
        };
        let old = e.effective().cloned();
        e.written = None;
        if e.observed.is_none() {
            self.entries.remove(name);
        }
        self.replace_effective(name, old, false);
    }

    /// We deleted `name` (it was empty).
    pub fn deleted(&mut self, name: &str) {
        let old = self
            .entries
            .remove(name)
            .and_then(|e| e.written.map(|(_, s)| s).or(e.observed.map(|(_, s)| s)));
        self.replace_effective(name, old, true);
    }

    /// Slices to delete: empty (or of a set the configuration does not have), shown by the
    /// API as such, and applied by every host.
    pub fn deletable(&self, known_sets: &[String]) -> Vec<String> {
        self.entries
            .iter()
            .filter(|(_, e)| e.written.is_none() && e.applied)
            .filter_map(|(n, e)| e.observed.as_ref().map(|(_, s)| (n, s)))
            .filter(|(_, s)| s.addresses.is_empty() || !known_sets.contains(&s.set))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Take out `remove` and place `add` in set `set`; the changed slices, which become our
    /// writes in flight.
    fn plan(&mut self, set: &str, add: &[IpAddr], remove: &[IpAddr]) -> Vec<Slice> {
        let mut work: BTreeMap<String, Slice> = BTreeMap::new();
        let no_place = HashMap::new();
        let place = self.place.get(set).unwrap_or(&no_place);
        let current =
            |work: &BTreeMap<String, Slice>, entries: &BTreeMap<String, Entry>, n: &str| {
                work.get(n)
                    .cloned()
                    .or_else(|| entries.get(n).and_then(Entry::effective).cloned())
            };
        for ip in remove {
            for n in place.get(ip).into_iter().flatten() {
                if let Some(mut s) = current(&work, &self.entries, n) {
                    s.addresses.remove(ip);
                    work.insert(n.clone(), s);
                }
            }
        }
        // The set's slices with room, after the removals (what they hold from here on is
        // counted by `room` itself).
        let mut room = Room::new(
            self.entries
                .iter()
                .filter_map(|(n, e)| {
                    let s = work.get(n).or(e.effective())?;
                    (s.set == set).then(|| (n.clone(), s.addresses.len()))
                })
                .chain(
                    work.iter()
                        .filter(|(n, s)| s.set == set && !self.entries.contains_key(*n))
                        .map(|(n, s)| (n.clone(), s.addresses.len())),
                ),
        );
        for ip in add {
            match place.get(ip).map(Vec::as_slice) {
                Some([]) | None => {}
                Some([_]) => continue,
                Some([_, dups @ ..]) => {
                    // Listed twice: it stays in its first slice only.
                    for n in dups {
                        if let Some(mut s) = current(&work, &self.entries, n) {
                            s.addresses.remove(ip);
                            work.insert(n.clone(), s);
                        }
                    }
                    continue;
                }
            }
            let name = match room.take() {
                Some(n) => n,
                None => {
                    let n = (0..)
                        .map(|i| slice_name(set, i))
                        .find(|n| !self.entries.contains_key(n) && !work.contains_key(n))
                        .unwrap_or_default();
                    room.opened(n.clone());
                    n
                }
            };
            let mut s = current(&work, &self.entries, &name).unwrap_or(Slice {
                name: name.clone(),
                set: set.to_string(),
                addresses: BTreeSet::new(),
            });
            s.addresses.insert(*ip);
            work.insert(name, s);
        }
        let mut out = Vec::with_capacity(work.len());
        for (name, s) in work {
            let old = self.entries.get(&name).and_then(Entry::effective).cloned();
            if old.as_ref() == Some(&s) {
                continue;
            }
            let e = self.entries.entry(name.clone()).or_insert(Entry {
                observed: None,
                generation: None,
                applied: true,
                written: None,
                seen: true,
            });
            e.written = Some((None, s.clone()));
            self.replace_effective(&name, old, true);
            out.push(s);
        }
        out
    }

    fn take_dirty(&mut self) -> Changes {
        if self.dirty.is_empty() {
            Changes::None
        } else {
            Changes::Addresses(std::mem::take(&mut self.dirty))
        }
    }
}

/// What one plan decided for a peer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Slices to write (server-side apply), in order.
    pub writes: Vec<Slice>,
    /// Offloaded addresses held back by the reuse gate (retried at the next plan).
    pub held: usize,
}

/// Desired sets, published slices and the gate between them, for every peer.
#[derive(Debug, Default)]
pub struct Publisher {
    /// Desired sets, maintained from events.
    pub desired: DesiredIndex,
    slices: BTreeMap<String, PeerSlices>,
    /// Per peer: whether its gateway configuration is applied everywhere, and the offloaded
    /// addresses listed inline in it (older controllers published them there).
    configs: BTreeMap<String, (bool, BTreeSet<IpAddr>)>,
    held: BTreeMap<String, BTreeSet<(Kind, IpAddr)>>,
}

impl Publisher {
    /// Nothing known yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// `peer`'s published slices (created empty on first use).
    pub fn slices_mut(&mut self, peer: &str) -> &mut PeerSlices {
        self.slices.entry(peer.to_string()).or_default()
    }

    /// Peers with published slices.
    pub fn published_peers(&self) -> Vec<String> {
        self.slices.keys().cloned().collect()
    }

    /// What the API shows of every peer's gateway configuration: applied by every host or
    /// not, and the offloaded addresses it lists inline.
    pub fn observe_configs(&mut self, configs: BTreeMap<String, (bool, BTreeSet<IpAddr>)>) {
        self.configs = configs;
    }

    /// Offloaded addresses currently held back, over all peers.
    pub fn held_back(&self) -> usize {
        self.held.values().map(BTreeSet::len).sum()
    }

    fn settled(&self, peer: &str) -> bool {
        self.slices.get(peer).is_none_or(PeerSlices::settled)
            && self.configs.get(peer).is_none_or(|(a, _)| *a)
    }

    /// Whether `ip` may join `peer`'s offloaded set now: no other peer publishes it, and
    /// every other peer applied everything it was given.
    fn gate(&self, peer: &str, ip: IpAddr) -> bool {
        let set = Kind::Offloaded.set_name(ip);
        let others = self
            .slices
            .keys()
            .chain(self.configs.keys())
            .filter(|p| p.as_str() != peer);
        for other in others {
            let published = self.slices.get(other).is_some_and(|s| s.has(&set, ip))
                || self
                    .configs
                    .get(other)
                    .is_some_and(|(_, i)| i.contains(&ip));
            if published || !self.settled(other) {
                return false;
            }
        }
        true
    }

    /// Decide `peer`'s next writes from what changed since its last plan.
    pub fn plan(&mut self, peer: &str, opts: &Options) -> Plan {
        let kinds: Vec<Kind> = Kind::ALL
            .into_iter()
            .filter(|k| *k != Kind::Elsewhere || opts.block_leaf_to_leaf)
            .collect();
        let mut changes = self.desired.take_changes(peer);
        let slices = self.slices_mut(peer);
        if slices.fresh {
            changes = Changes::Resync;
        }
        changes.merge(slices.take_dirty());
        let held = self.held.remove(peer).unwrap_or_default();
        changes.merge(Changes::Addresses(held));
        let candidates: BTreeSet<(Kind, IpAddr)> = match changes {
            Changes::None => BTreeSet::new(),
            Changes::Addresses(s) => s,
            Changes::Resync => {
                let published = self.slices.get(peer);
                let mut all = BTreeSet::new();
                for k in &kinds {
                    all.extend(
                        self.desired
                            .members(peer, *k)
                            .into_iter()
                            .map(|ip| (*k, ip)),
                    );
                    for set in [k.base_name().to_string(), k.v6_name()] {
                        all.extend(
                            published
                                .map(|p| p.members(&set))
                                .unwrap_or_default()
                                .into_iter()
                                .map(|ip| (*k, ip)),
                        );
                    }
                }
                all
            }
        };
        let mut add: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        let mut remove: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        let mut held = BTreeSet::new();
        for (k, ip) in candidates {
            if !kinds.contains(&k) {
                continue;
            }
            let set = k.set_name(ip);
            let want = self.desired.wants(peer, k, ip);
            let have = self.slices.get(peer).is_some_and(|s| s.has(&set, ip));
            match (want, have) {
                // `add` of a published address only drops duplicates.
                (true, true) => add.entry(set).or_default().push(ip),
                (false, true) => remove.entry(set).or_default().push(ip),
                (true, false) if k == Kind::Offloaded && !self.gate(peer, ip) => {
                    held.insert((k, ip));
                }
                (true, false) => add.entry(set).or_default().push(ip),
                (false, false) => {}
            }
        }
        let n_held = held.len();
        if !held.is_empty() {
            self.held.insert(peer.to_string(), held);
        }
        let sets: BTreeSet<String> = add.keys().chain(remove.keys()).cloned().collect();
        let slices = self.slices_mut(peer);
        let mut writes = vec![];
        for set in sets {
            writes.extend(slices.plan(
                &set,
                add.get(&set).map_or(&[][..], Vec::as_slice),
                remove.get(&set).map_or(&[][..], Vec::as_slice),
            ));
        }
        Plan {
            writes,
            held: n_held,
        }
    }
}

#[cfg(test)]
mod tests;
