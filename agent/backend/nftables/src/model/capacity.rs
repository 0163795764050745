//! The size a hash set declares, and why: see [`Set::capacity`].

use super::Set;

impl Set {
    /// The `size` declared for a hash set or verdict map of single keys ([`capacity_for`] its
    /// element count); None for interval sets and sets whose elements count packets, which
    /// keep the kernel's own choice.
    ///
    /// The kernel picks a set's backend when the set is created (`nft_select_set_ops`): its
    /// fixed-size hash (`nft_hash`, and `nft_hash_fast` for 4-byte keys: an IPv4 address) only
    /// when the set declares a size, the resizable `nft_rhash` otherwise. A lookup in the
    /// fixed-size hash is a one-word hash and a bucket walk; in `nft_rhash` it is the
    /// rhashtable's keyed hash and compare callbacks. The NetworkPolicy tier, which looks an
    /// address up in about eight sets per packet, forwarded 0.72 (0.69–0.75) of the
    /// conntrack-on gateway's rate with sizes declared against 0.67 (0.66–0.70) without
    /// (`cargo xtask bench-gateway`'s 1000-NetworkPolicy rows, six rounds of each, the two
    /// builds alternating).
    pub fn capacity(&self) -> Option<usize> {
        if self.timeout.is_some() {
            return Some(TIMEOUT_SET_CAPACITY);
        }
        (!self.interval && !self.counter).then(|| capacity_for(self.elements.len()))
    }
}

/// The `size` a hash set of `n` elements declares: room for twice as many, a power of two,
/// at least [`MIN_CAPACITY`]. The kernel refuses elements beyond a set's size (ENFILE), so an
/// element edit that would cross it is applied by recreating the table with the next size
/// ([`crate::NftBackend::update_sets`] falls back); powers of two make that rare: once each
/// time the set doubles or halves.
pub fn capacity_for(n: usize) -> usize {
    n.saturating_mul(2).next_power_of_two().max(MIN_CAPACITY)
}

/// The size of a set whose elements the packet path refreshes and expires ([`Set::timeout`]):
/// fixed, as elements come and go without the agent.
pub const TIMEOUT_SET_CAPACITY: usize = 1 << 16;

/// The smallest size a hash set declares ([`capacity_for`]).
pub const MIN_CAPACITY: usize = 64;

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::super::*;

    fn set(n: usize, interval: bool, counter: bool) -> Set {
        Set {
            name: "s".into(),
            key: KeyType::Ipv4Addr,
            interval,
            elements: (0..n)
                .map(|i| Element::Addr(IpAddr::from([10, 0, (i / 256) as u8, (i % 256) as u8])))
                .collect(),
            counter,
            comments: Vec::new(),
            verdict_map: false,
            timeout: None,
        }
    }

    #[test]
    fn a_hash_set_declares_room_for_twice_its_elements() {
        assert_eq!(capacity_for(0), MIN_CAPACITY);
        assert_eq!(capacity_for(32), 64);
        assert_eq!(capacity_for(33), 128);
        assert_eq!(capacity_for(100_000), 262_144);
        assert_eq!(set(100, false, false).capacity(), Some(256));
        // The kernel's own choice where the fixed-size hash does not fit: ranges, counters.
        assert_eq!(set(100, true, false).capacity(), None);
        assert_eq!(set(100, false, true).capacity(), None);
    }

    #[test]
    fn a_size_crossing_is_a_change_of_structure() {
        let t = |n| Table {
            name: "t".into(),
            family: peerwall_policy::ir::TableFamily::Inet,
            owner: "ns/t".into(),
            sets: vec![set(n, false, false)],
            chains: vec![],
            regular: vec![],
            dispatch_maps: Vec::new(),
            rules: vec![],
            event_limit: None,
        };
        assert!(
            t(20).same_structure(&t(32)),
            "20 and 32 elements: both size 64"
        );
        assert!(!t(32).same_structure(&t(33)), "33 elements need size 128");
    }
}
