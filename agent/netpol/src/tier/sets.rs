//! The tier's named sets: address lists as set keys ([`Addrs`]), and one set per
//! *definition* ([`Registry`]).
//!
//! A set is named after what decides its contents (the selector, the peers, the side of the
//! gateway, a named port), never after a policy's position or the addresses it holds, as
//! Calico names its ipsets after their selectors. So a pod relabelled, created or deleted
//! changes the elements of the sets whose selectors it enters or leaves and nothing else of
//! the table: the backends apply that as element changes (nftables' plan keeps a table whose
//! structure is unchanged), not as a new table. Rules that select by the same definition
//! share its set, which is computed once.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use peerwall_intent::types as api;

/// An address as a number of its family.
pub(super) fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// An address range of one family, as a set element key.
fn range_key(lo: u128, hi: u128, v4: bool) -> String {
    let show = |out: &mut String, v: u128| {
        if v4 {
            push_v4(out, v as u32);
        } else {
            use std::fmt::Write;
            let _ = write!(out, "{}", std::net::Ipv6Addr::from(v));
        }
    };
    let mut out = String::with_capacity(if v4 { 31 } else { 79 });
    show(&mut out, lo);
    if lo != hi {
        out.push('-');
        show(&mut out, hi);
    }
    out
}

/// `a.b.c.d` as `Ipv4Addr`'s `Display` writes it, without the formatting machinery: a tier
/// writes every address of its sets (20,000 at 1,000 policies) on each computation.
fn push_v4(out: &mut String, v: u32) {
    for (i, b) in v.to_be_bytes().into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        if b >= 100 {
            out.push(char::from(b'0' + b / 100));
        }
        if b >= 10 {
            out.push(char::from(b'0' + (b / 10) % 10));
        }
        out.push(char::from(b'0' + b % 10));
    }
}

/// Addresses of both families: single addresses and ranges, in any order and with repeats,
/// written as set keys by [`Addrs::keys`] (sorted, merged). Gathered into a list and sorted
/// once: a set of 20,000 addresses is a sort, not 20,000 ordered inserts.
#[derive(Clone, Default)]
pub(super) struct Addrs {
    v4: Vec<(u128, u128)>,
    v6: Vec<(u128, u128)>,
}

impl Addrs {
    pub(super) fn add_ip(&mut self, ip: IpAddr) {
        let v = to_u128(ip);
        self.side(ip.is_ipv4()).push((v, v));
    }
    pub(super) fn side(&mut self, v4: bool) -> &mut Vec<(u128, u128)> {
        if v4 {
            &mut self.v4
        } else {
            &mut self.v6
        }
    }
    fn of(&self, v4: bool) -> &[(u128, u128)] {
        if v4 {
            &self.v4
        } else {
            &self.v6
        }
    }
    /// Set keys, sorted, overlapping and adjacent entries merged (an nftables interval set
    /// refuses overlaps).
    pub(super) fn keys(&self, v4: bool) -> Vec<String> {
        let mut sorted = self.of(v4).to_vec();
        sorted.sort_unstable();
        let mut merged: Vec<(u128, u128)> = Vec::new();
        for &(lo, hi) in &sorted {
            match merged.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        merged
            .into_iter()
            .map(|(lo, hi)| range_key(lo, hi, v4))
            .collect()
    }
}

/// What a set holds: the pods a policy applies to, or the far end of its rules.
#[derive(Clone, Copy)]
pub(super) enum Role {
    /// The policy's own pods (a chain's `own` position; also the isolation drops).
    Own,
    /// A rule's peers (the `far` position).
    Far,
}

impl Role {
    fn word(self) -> &'static str {
        match self {
            Self::Own => "own",
            Self::Far => "far",
        }
    }
}

/// The set names of one definition, IPv4 then IPv6; None where that family holds nothing
/// (the rule that would look it up could match nothing, and is left out).
pub(super) type Names = [Option<String>; 2];

/// Where a definition's addresses came from, for the tier by difference (`tier/delta.rs`).
#[derive(Clone, Debug)]
pub(super) enum Source {
    /// Exactly the addresses of these classes' pods.
    Classes(super::pods::Group),
    /// Exactly the addresses of these classes' pods, which are those a rule's peers select
    /// across the gateway ([`Far`]): a class that comes or goes joins or leaves it by that.
    Far(super::pods::Group, Far),
    /// These classes' pods may count (those of the rule's peers, if any), and something else
    /// does too (an `ipBlock`'s ranges, a pod by its own address): such a set is only ever
    /// computed whole.
    Fixed(super::pods::Group, Option<Far>),
}

/// The classes a rule's pod peers select across the gateway: those of pods the peers of a
/// policy in `ns` select, on the other side from the policy's own pods (`remote_own`: those
/// on the peer, `Some(true)`, or here, `Some(false)`; None: either side).
#[derive(Clone, Debug)]
pub(super) struct Far {
    pub(super) ns: String,
    pub(super) peers: Vec<crate::Peer>,
    pub(super) remote_own: Option<bool>,
}

/// The tier's sets by definition: each definition's addresses computed once, its sets named
/// `<role>[6]_<64-bit FNV-1a of the definition>`. The name is a function of the definition
/// alone, so it survives every change of contents and of the policies around it; two
/// definitions whose hashes collide (policies are written by namespace users, and FNV is no
/// defence against a chosen collision) are told apart by the full definition each name is
/// kept under, the later one suffixed: a set is never shared by two definitions.
#[derive(Default)]
pub(super) struct Registry {
    by_def: HashMap<String, Names>,
    /// Every name given out.
    taken: HashSet<String>,
    sets: Vec<api::Set>,
    /// Each definition's names and where its addresses came from, in the order made.
    sources: Vec<(Names, Source)>,
}

/// 64-bit FNV-1a: stable across processes, releases and platforms (the controller's names
/// must not change when it restarts or is upgraded, or every gateway's table would be rebuilt).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Registry {
    /// The names of `def`'s sets, if they were made already.
    pub(super) fn known(&self, def: &str) -> Option<&Names> {
        self.by_def.get(def)
    }

    /// Make `def`'s sets from `addrs`, which came from `source` (a family without addresses
    /// gets none).
    pub(super) fn add(&mut self, role: Role, def: String, addrs: &Addrs, source: Source) -> Names {
        let hash = fnv1a(&def);
        let names = [true, false].map(|v4| {
            let keys = addrs.keys(v4);
            if keys.is_empty() {
                return None;
            }
            let fam = if v4 { "" } else { "6" };
            let base = format!("{}{fam}_{hash:016x}", role.word());
            let mut name = base.clone();
            let mut n = 1;
            while !self.taken.insert(name.clone()) {
                n += 1;
                name = format!("{base}_{n}");
            }
            self.sets.push(api::Set {
                from_address_sets: false,
                address_sets: None,
                name: name.clone(),
                key_type: Some(if v4 {
                    api::SetDataType::Ipv4Addr
                } else {
                    api::SetDataType::Ipv6Addr
                }),
                data_type: None,
                elements: keys
                    .into_iter()
                    .map(|key| api::SetElement { key, data: None })
                    .collect(),
            });
            Some(name)
        });
        self.by_def.insert(def, names.clone());
        self.sources.push((names.clone(), source));
        names
    }

    /// The sets made, in the order they were first used, and each definition's names and
    /// source.
    pub(super) fn into_parts(self) -> (Vec<api::Set>, Vec<(Names, Source)>) {
        (self.sets, self.sources)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> Source {
        Source::Classes(super::super::pods::Group::default())
    }

    fn one(ip: &str) -> Addrs {
        let mut a = Addrs::default();
        a.add_ip(ip.parse().unwrap());
        a
    }

    #[test]
    fn addresses_are_written_as_their_display_writes_them() {
        let mut v: u32 = 0x0102_0304;
        for _ in 0..20_000 {
            let a = std::net::Ipv4Addr::from(v);
            assert_eq!(range_key(u128::from(v), u128::from(v), true), a.to_string());
            v = v.wrapping_mul(2_654_435_761).wrapping_add(12_345);
        }
        for a in ["0.0.0.0", "255.255.255.255", "10.0.9.100", "100.10.1.0"] {
            let n = u128::from(u32::from(a.parse::<std::net::Ipv4Addr>().unwrap()));
            assert_eq!(range_key(n, n, true), a);
        }
        assert_eq!(range_key(1, 2, true), "0.0.0.1-0.0.0.2");
        assert_eq!(range_key(1, 2, false), "::1-::2");
    }

    #[test]
    fn keys_are_those_of_the_ordered_set_whatever_the_order_and_repeats() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(55);
        for _ in 0..500 {
            let mut a = Addrs::default();
            let mut ordered = std::collections::BTreeSet::new();
            for _ in 0..rng.random_range(0..60) {
                // Few values, so that repeats, adjacent addresses and overlapping ranges occur.
                let lo: u128 = rng.random_range(0..40);
                let hi = if rng.random_bool(0.2) {
                    lo + rng.random_range(0..6)
                } else {
                    lo
                };
                let v4 = rng.random_bool(0.7);
                a.side(v4).push((lo, hi));
                if v4 {
                    ordered.insert((lo, hi));
                }
            }
            // The keys as they were written from an ordered set (before the list).
            let mut merged: Vec<(u128, u128)> = Vec::new();
            for &(lo, hi) in &ordered {
                match merged.last_mut() {
                    Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                    _ => merged.push((lo, hi)),
                }
            }
            let expected: Vec<String> = merged
                .into_iter()
                .map(|(lo, hi)| range_key(lo, hi, true))
                .collect();
            assert_eq!(a.keys(true), expected);
        }
    }

    #[test]
    fn a_definition_names_its_sets_whatever_they_hold() {
        let mut a = Registry::default();
        let mut b = Registry::default();
        let x = a.add(Role::Far, "far|team=t1".into(), &one("10.0.0.1"), none());
        let y = b.add(Role::Far, "far|team=t1".into(), &one("10.0.0.2"), none());
        assert_eq!(x, y);
        assert!(x[0].as_deref().is_some_and(|n| n.starts_with("far_")));
        assert_eq!(x[1], None, "no IPv6 address, no IPv6 set");
    }

    #[test]
    fn colliding_hashes_never_share_a_set() {
        let mut r = Registry::default();
        let x = r.add(Role::Own, "a".into(), &one("10.0.0.1"), none());
        let base = format!("own_{:016x}", fnv1a("a"));
        assert_eq!(x[0].as_deref(), Some(base.as_str()));
        // A second definition on the same name, as a chosen collision would put it (the
        // memo forgotten, so the registry meets the name as taken by another definition).
        r.by_def.clear();
        let y = r.add(Role::Own, "a".into(), &one("10.0.0.2"), none());
        assert_eq!(y[0].as_deref(), Some(format!("{base}_2").as_str()));
        assert_eq!(r.into_parts().0.len(), 2);
    }

    #[test]
    fn fnv1a_is_the_published_function() {
        // Test vectors of the FNV reference (draft-eastlake-fnv).
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }
}
