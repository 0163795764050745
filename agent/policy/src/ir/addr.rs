//! Normalized address and port sets.
//!
//! Addresses are kept as sorted, disjoint, non-adjacent inclusive ranges of integers
//! (u32 widened to u128 for IPv4, u128 for IPv6). This canonical form makes equality,
//! membership and diffing trivial, and converts exactly into prefixes for LPM tries.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Address family of an address set or packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// Family of an address.
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    /// Address width in bits.
    pub const fn bits(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }

    /// Largest address of the family as an integer.
    pub const fn max(self) -> u128 {
        match self {
            Self::V4 => u32::MAX as u128,
            Self::V6 => u128::MAX,
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// Integer value of an address.
pub fn addr_to_u128(addr: &IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(*a)),
        IpAddr::V6(a) => u128::from(*a),
    }
}

/// Address of an integer in a family. Values above the family's range are truncated.
pub fn u128_to_addr(family: IpFamily, v: u128) -> IpAddr {
    match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::from((v & u128::from(u32::MAX)) as u32)),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::from(v)),
    }
}

/// An inclusive address range within one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrRange {
    /// First address.
    pub lo: u128,
    /// Last address.
    pub hi: u128,
}

/// A set of addresses of one family in canonical form.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AddrSet {
    family: IpFamily,
    ranges: Vec<AddrRange>,
}

impl AddrSet {
    /// The empty set of a family.
    pub fn empty(family: IpFamily) -> Self {
        Self {
            family,
            ranges: Vec::new(),
        }
    }

    /// Build from arbitrary (overlapping, unsorted) ranges. Ranges with `lo > hi` are ignored.
    pub fn from_ranges(family: IpFamily, ranges: impl IntoIterator<Item = AddrRange>) -> Self {
        let mut v: Vec<AddrRange> = ranges
            .into_iter()
            .filter(|r| r.lo <= r.hi && r.hi <= family.max())
            .collect();
        v.sort();
        let mut out: Vec<AddrRange> = Vec::with_capacity(v.len());
        for r in v {
            match out.last_mut() {
                Some(last) if last.hi == u128::MAX || r.lo <= last.hi + 1 => {
                    last.hi = last.hi.max(r.hi);
                }
                _ => out.push(r),
            }
        }
        Self {
            family,
            ranges: out,
        }
    }

    /// Build from networks (all of `family`; others are ignored).
    pub fn from_nets(family: IpFamily, nets: impl IntoIterator<Item = IpNet>) -> Self {
        Self::from_ranges(
            family,
            nets.into_iter()
                .filter(|n| IpFamily::of(&n.addr()) == family)
                .map(|n| AddrRange {
                    lo: addr_to_u128(&n.network()),
                    hi: addr_to_u128(&n.broadcast()),
                }),
        )
    }

    /// Union of two sets of the same family.
    pub fn union(&self, other: &AddrSet) -> AddrSet {
        Self::from_ranges(
            self.family,
            self.ranges.iter().chain(other.ranges.iter()).copied(),
        )
    }

    /// Family.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// Canonical ranges (sorted, disjoint, non-adjacent).
    pub fn ranges(&self) -> &[AddrRange] {
        &self.ranges
    }

    /// True when no address is in the set.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Membership. An address of the other family is never a member.
    pub fn contains(&self, addr: &IpAddr) -> bool {
        if IpFamily::of(addr) != self.family {
            return false;
        }
        let v = addr_to_u128(addr);
        let idx = self.ranges.partition_point(|r| r.hi < v);
        self.ranges.get(idx).is_some_and(|r| r.lo <= v)
    }

    /// Minimal list of prefixes covering exactly the set (for LPM tries).
    pub fn to_prefixes(&self) -> Vec<IpNet> {
        let mut out = Vec::new();
        for r in &self.ranges {
            range_to_prefixes(self.family, r.lo, r.hi, &mut out);
        }
        out
    }

    /// Render each canonical range in nft syntax: `a`, `a/len` when exactly a prefix, else `a-b`.
    pub fn nft_elements(&self) -> Vec<String> {
        self.ranges
            .iter()
            .map(|r| format_range(self.family, *r))
            .collect()
    }
}

/// What edits of an [`AddrSet`] changed in its canonical form: the canonical ranges that were
/// in it and are gone, and the ones that are new. Both sorted; a range never in both. This is
/// exactly what a backend holding the canonical ranges must delete and add, so a one-address
/// edit of a 100k-address set costs the backend one or two elements, not a diff of the set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RangeEdit {
    /// Canonical ranges no longer in the set.
    pub removed: std::collections::BTreeSet<AddrRange>,
    /// Canonical ranges new in the set.
    pub added: std::collections::BTreeSet<AddrRange>,
}

impl RangeEdit {
    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.added.is_empty()
    }

    /// Compose: `self` followed by `next` (a range added and removed again cancels out).
    pub fn then(&mut self, next: RangeEdit) {
        for r in next.removed {
            if !self.added.remove(&r) {
                self.removed.insert(r);
            }
        }
        for r in next.added {
            if !self.removed.remove(&r) {
                self.added.insert(r);
            }
        }
    }

    fn replaced(old: &[AddrRange], new: Vec<AddrRange>) -> Self {
        let (old, new): (std::collections::BTreeSet<_>, std::collections::BTreeSet<_>) =
            (old.iter().copied().collect(), new.into_iter().collect());
        Self {
            removed: old.difference(&new).copied().collect(),
            added: new.difference(&old).copied().collect(),
        }
    }
}

impl AddrSet {
    /// Add the addresses of `r` (clipped to the family); returns what changed. O(log n) search
    /// plus one splice of the ranges `r` touches.
    pub fn insert_range(&mut self, r: AddrRange) -> RangeEdit {
        let r = AddrRange {
            lo: r.lo,
            hi: r.hi.min(self.family.max()),
        };
        if r.lo > r.hi {
            return RangeEdit::default();
        }
        // Ranges overlapping or adjacent to `r` merge with it.
        let i = self
            .ranges
            .partition_point(|x| x.hi != u128::MAX && x.hi + 1 < r.lo);
        let j = self
            .ranges
            .partition_point(|x| r.hi == u128::MAX || x.lo <= r.hi + 1);
        let j = j.max(i);
        let merged = AddrRange {
            lo: self.ranges[i..j].first().map_or(r.lo, |x| x.lo.min(r.lo)),
            hi: self.ranges[i..j].last().map_or(r.hi, |x| x.hi.max(r.hi)),
        };
        let edit = RangeEdit::replaced(&self.ranges[i..j], vec![merged]);
        if !edit.is_empty() {
            self.ranges.splice(i..j, [merged]);
        }
        edit
    }

    /// Remove the addresses of `r`; returns what changed.
    pub fn remove_range(&mut self, r: AddrRange) -> RangeEdit {
        if r.lo > r.hi {
            return RangeEdit::default();
        }
        let i = self.ranges.partition_point(|x| x.hi < r.lo);
        let j = self.ranges.partition_point(|x| x.lo <= r.hi).max(i);
        if i == j {
            return RangeEdit::default();
        }
        let mut left = Vec::with_capacity(2);
        let (first, last) = (self.ranges[i], self.ranges[j - 1]);
        if first.lo < r.lo {
            left.push(AddrRange {
                lo: first.lo,
                hi: r.lo - 1,
            });
        }
        if last.hi > r.hi {
            left.push(AddrRange {
                lo: r.hi + 1,
                hi: last.hi,
            });
        }
        let edit = RangeEdit::replaced(&self.ranges[i..j], left.clone());
        self.ranges.splice(i..j, left);
        edit
    }
}

/// Render one range as an address, a prefix when it is exactly one, else `a-b`.
pub fn format_range(family: IpFamily, r: AddrRange) -> String {
    let lo = u128_to_addr(family, r.lo);
    if r.lo == r.hi {
        return lo.to_string();
    }
    let mut one = Vec::new();
    range_to_prefixes(family, r.lo, r.hi, &mut one);
    if let [net] = one.as_slice() {
        return net.to_string();
    }
    format!("{}-{}", lo, u128_to_addr(family, r.hi))
}

fn range_to_prefixes(family: IpFamily, lo: u128, hi: u128, out: &mut Vec<IpNet>) {
    let bits = u32::from(family.bits());
    let mut cur = lo;
    loop {
        // Largest block aligned at `cur` that does not pass `hi`.
        let align = if cur == 0 {
            bits
        } else {
            cur.trailing_zeros().min(bits)
        };
        let mut size_log = align;
        while size_log > 0 {
            let span_minus_one = if size_log >= 128 {
                u128::MAX
            } else {
                (1u128 << size_log) - 1
            };
            match cur.checked_add(span_minus_one) {
                Some(end) if end <= hi => break,
                _ => size_log -= 1,
            }
        }
        let prefix_len = (bits - size_log) as u8;
        let net = match family {
            IpFamily::V4 => Ipv4Net::new(Ipv4Addr::from(cur as u32), prefix_len).map(IpNet::V4),
            IpFamily::V6 => Ipv6Net::new(Ipv6Addr::from(cur), prefix_len).map(IpNet::V6),
        };
        // prefix_len <= bits always holds, so construction cannot fail.
        if let Ok(net) = net {
            out.push(net);
        }
        let span_minus_one = if size_log >= 128 {
            u128::MAX
        } else {
            (1u128 << size_log) - 1
        };
        let end = cur.saturating_add(span_minus_one);
        if end >= hi {
            break;
        }
        cur = end + 1;
    }
}

/// A set of ports in canonical form (sorted, disjoint, non-adjacent inclusive ranges).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PortSet {
    ranges: Vec<(u16, u16)>,
}

impl PortSet {
    /// Build from arbitrary ranges (`lo > hi` ignored).
    pub fn from_ranges(ranges: impl IntoIterator<Item = (u16, u16)>) -> Self {
        let mut v: Vec<(u16, u16)> = ranges.into_iter().filter(|(a, b)| a <= b).collect();
        v.sort();
        let mut out: Vec<(u16, u16)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match out.last_mut() {
                Some(last) if last.1 == u16::MAX || a <= last.1 + 1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        Self { ranges: out }
    }

    /// Canonical ranges.
    pub fn ranges(&self) -> &[(u16, u16)] {
        &self.ranges
    }

    /// Membership.
    pub fn contains(&self, port: u16) -> bool {
        let idx = self.ranges.partition_point(|r| r.1 < port);
        self.ranges.get(idx).is_some_and(|r| r.0 <= port)
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// nft element syntax for each range.
    pub fn nft_elements(&self) -> Vec<String> {
        self.ranges
            .iter()
            .map(|(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v4(s: &str) -> u128 {
        addr_to_u128(&s.parse().unwrap())
    }

    #[test]
    fn merges_overlapping_and_adjacent() {
        let s = AddrSet::from_ranges(
            IpFamily::V4,
            [
                AddrRange {
                    lo: v4("10.0.0.5"),
                    hi: v4("10.0.0.9"),
                },
                AddrRange {
                    lo: v4("10.0.0.1"),
                    hi: v4("10.0.0.4"),
                },
                AddrRange {
                    lo: v4("10.0.0.7"),
                    hi: v4("10.0.0.20"),
                },
                AddrRange {
                    lo: v4("10.0.1.0"),
                    hi: v4("10.0.1.0"),
                },
            ],
        );
        assert_eq!(
            s.nft_elements(),
            vec!["10.0.0.1-10.0.0.20".to_string(), "10.0.1.0".to_string()]
        );
    }

    #[test]
    fn range_to_prefixes_known() {
        let s = AddrSet::from_ranges(
            IpFamily::V4,
            [AddrRange {
                lo: v4("10.0.0.1"),
                hi: v4("10.0.0.6"),
            }],
        );
        let p: Vec<String> = s.to_prefixes().iter().map(|n| n.to_string()).collect();
        assert_eq!(
            p,
            vec!["10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31", "10.0.0.6/32"]
        );
        let all = AddrSet::from_ranges(
            IpFamily::V6,
            [AddrRange {
                lo: 0,
                hi: u128::MAX,
            }],
        );
        assert_eq!(all.to_prefixes(), vec!["::/0".parse::<IpNet>().unwrap()]);
        let all4 = AddrSet::from_ranges(
            IpFamily::V4,
            [AddrRange {
                lo: 0,
                hi: u32::MAX as u128,
            }],
        );
        assert_eq!(all4.nft_elements(), vec!["0.0.0.0/0".to_string()]);
    }

    #[test]
    fn family_mismatch_is_never_member() {
        let s = AddrSet::from_nets(IpFamily::V4, ["0.0.0.0/0".parse().unwrap()]);
        assert!(s.contains(&"1.2.3.4".parse().unwrap()));
        assert!(!s.contains(&"::1".parse().unwrap()));
    }

    proptest! {
        // A range converted to prefixes covers exactly the range: every prefix lies inside it,
        // prefixes do not overlap, and their sizes add up to the range size.
        #[test]
        fn prefixes_cover_exactly_v4(a in any::<u32>(), b in any::<u32>()) {
            let (lo, hi) = (a.min(b) as u128, a.max(b) as u128);
            let s = AddrSet::from_ranges(IpFamily::V4, [AddrRange { lo, hi }]);
            let p = s.to_prefixes();
            let mut total: u128 = 0;
            let mut prev_end: Option<u128> = None;
            for n in &p {
                let nlo = addr_to_u128(&n.network());
                let nhi = addr_to_u128(&n.broadcast());
                prop_assert!(nlo >= lo && nhi <= hi);
                if let Some(e) = prev_end { prop_assert_eq!(nlo, e + 1); }
                prev_end = Some(nhi);
                total += nhi - nlo + 1;
            }
            prop_assert_eq!(total, hi - lo + 1);
            prop_assert!(p.len() <= 62);
        }

        #[test]
        fn prefixes_cover_exactly_v6(a in any::<u128>(), b in any::<u128>()) {
            let (lo, hi) = (a.min(b), a.max(b));
            let s = AddrSet::from_ranges(IpFamily::V6, [AddrRange { lo, hi }]);
            let p = s.to_prefixes();
            let mut prev_end: Option<u128> = None;
            prop_assert_eq!(addr_to_u128(&p[0].network()), lo);
            for n in &p {
                let nlo = addr_to_u128(&n.network());
                let nhi = addr_to_u128(&n.broadcast());
                prop_assert!(nlo >= lo && nhi <= hi);
                if let Some(e) = prev_end { prop_assert_eq!(nlo, e + 1); }
                prev_end = Some(nhi);
            }
            prop_assert_eq!(prev_end, Some(hi));
            prop_assert!(p.len() <= 254);
        }

        // Membership in the canonical set equals membership in any input range.
        #[test]
        fn canonical_membership(ranges in proptest::collection::vec((0u32..4096, 0u32..64), 0..12), probe in 0u32..4200) {
            let rs: Vec<AddrRange> = ranges.iter().map(|(s, l)| AddrRange { lo: *s as u128, hi: (*s + *l) as u128 }).collect();
            let set = AddrSet::from_ranges(IpFamily::V4, rs.clone());
            let addr = IpAddr::V4(Ipv4Addr::from(probe));
            let expected = rs.iter().any(|r| r.lo <= probe as u128 && probe as u128 <= r.hi);
            prop_assert_eq!(set.contains(&addr), expected);
            let via_prefixes = set.to_prefixes().iter().any(|n| n.contains(&addr));
            prop_assert_eq!(via_prefixes, expected);
            for w in set.ranges().windows(2) { prop_assert!(w[0].hi + 1 < w[1].lo); }
        }

        // Edits keep the canonical form, equal rebuilding from scratch, and their RangeEdit
        // turns the old canonical ranges into the new ones (what a backend replays).
        #[test]
        fn edits_match_rebuilding(ops in proptest::collection::vec((any::<bool>(), 0u32..300, 0u32..20), 0..40)) {
            let mut set = AddrSet::empty(IpFamily::V4);
            let mut model = std::collections::BTreeSet::new();
            let mut total = RangeEdit::default();
            let start: std::collections::BTreeSet<AddrRange> = set.ranges().iter().copied().collect();
            for (add, lo, len) in ops {
                let r = AddrRange { lo: lo as u128, hi: (lo + len) as u128 };
                let before: std::collections::BTreeSet<AddrRange> = set.ranges().iter().copied().collect();
                let edit = if add { set.insert_range(r) } else { set.remove_range(r) };
                for a in lo..=lo + len {
                    if add { model.insert(a); } else { model.remove(&a); }
                }
                let rebuilt = AddrSet::from_ranges(IpFamily::V4, model.iter().map(|a| AddrRange { lo: *a as u128, hi: *a as u128 }));
                prop_assert_eq!(&set, &rebuilt);
                let mut replay = before;
                for x in &edit.removed { prop_assert!(replay.remove(x)); }
                for x in &edit.added { prop_assert!(replay.insert(*x)); }
                prop_assert_eq!(replay.into_iter().collect::<Vec<_>>(), set.ranges().to_vec());
                total.then(edit);
            }
            let mut replay = start;
            for x in &total.removed { prop_assert!(replay.remove(x)); }
            for x in &total.added { prop_assert!(replay.insert(*x)); }
            prop_assert_eq!(replay.into_iter().collect::<Vec<_>>(), set.ranges().to_vec());
        }

        #[test]
        fn port_membership(ranges in proptest::collection::vec((any::<u16>(), 0u16..300), 0..8), probe in any::<u16>()) {
            let rs: Vec<(u16, u16)> = ranges.iter().map(|(s, l)| (*s, s.saturating_add(*l))).collect();
            let set = PortSet::from_ranges(rs.clone());
            prop_assert_eq!(set.contains(probe), rs.iter().any(|(a, b)| *a <= probe && probe <= *b));
        }
    }
}
