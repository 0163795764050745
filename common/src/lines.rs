//! One-line host tables (`HOST_LINES`, one map holding four: each address dimension of each
//! slot): the IPv4 hosts of an address dimension's exact-match map (`SRCH<s>`, `DSTH<s>`), each
//! with the first word of its rule bitmap, placed by a hash of (chain, address) into lines of
//! one cache line each, so that a chain of at most 64 rules finds its host in one line the cache
//! may not hold, where the host map's lookup reads a bucket and two lines of an element (the
//! gateway benchmark's profile: a fifth of an allowed new flow's time). One map, not four: a
//! program may use at most 64 maps, and the datapath's programs use all but a few. eBPF twin:
//! `ebpf/src/lines.rs`; writer: `agent/backend/bpf/src/loader/lines.rs`.
//!
//! Entry 0 holds the four tables' headers, table `t` ([`host_table`]) in word `t`:
//! [`HOST_LINES_ON`] and the mask of each table's lines. Table `t`'s lines follow, entries
//! `1 + t * lines ..` ([`host_line_entry`]). A line is [`HostLine`]: a header word
//! ([`HOST_LINE_OVERFLOW`]) and [`HOST_LINE_SLOTS`] slots of a key ([`host_line_key`], 0 for an
//! empty slot) and a word.
//!
//! What a lookup may conclude, and the invariant that makes it sound (the writer keeps it):
//! - a slot holds the key: the host map holds the host, and its bitmap's first word is the
//!   slot's word;
//! - no slot holds it and the line's overflow bit is clear: the host map does not hold it (the
//!   trie answers);
//! - otherwise (the table off, or the line overflowed): ask the host map.
//!
//! Every host of the host map is therefore in its line or in an overflowed line. A host missing
//! from both would skip the host map, and could miss a drop rule that names it alone.

/// The tables in `HOST_LINES`.
pub const HOST_TABLES: u32 = 4;

/// The table of slot `slot`'s source (`dst` false) or destination hosts.
#[inline(always)]
pub const fn host_table(slot: u32, dst: bool) -> u32 {
    (slot & 1) * 2 + dst as u32
}

/// Slots per line.
pub const HOST_LINE_SLOTS: usize = 3;

/// A table's header (entry 0's word [`host_table`]): the table is written and consistent with
/// its host map (else every lookup asks the host map; the writer also leaves it off where
/// fewer than half the hosts have a slot). Its low 32 bits are the mask of the lines.
pub const HOST_LINES_ON: u64 = 1 << 63;

/// A line's word 0: some host of this line's hash is not in its slots (ask the host map).
pub const HOST_LINE_OVERFLOW: u64 = 1;

/// One line: word 0 the header ([`HOST_LINE_OVERFLOW`]), then per slot `i` the key at word
/// `1 + 2i` and the bitmap's first word at `2 + 2i`; word 7 is zero. Host byte order, 64 bytes,
/// no padding: the map is `BPF_F_MMAPABLE`, so its values start page-aligned and each line is
/// one cache line. User space writes it one aligned `u64` at a time through the mapping (a
/// reader sees each word old or new). eBPF twin: `ebpf/src/lines.rs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLine {
    /// The words.
    pub w: [u64; 8],
}

impl HostLine {
    /// A line with no slot used and no overflow.
    pub const EMPTY: HostLine = HostLine { w: [0; 8] };
}

/// The key of IPv4 host `addr` (its four bytes as in the packet) of chain `chain`: the chain
/// plus one in the high half (so no key is 0, the empty slot), the address's bytes read
/// little-endian in the low half (a plain load on x86 and on the eBPF target, `bpfel`).
#[inline(always)]
pub const fn host_line_key(chain: u32, addr: [u8; 4]) -> u64 {
    ((chain as u64 + 1) << 32) | u32::from_le_bytes(addr) as u64
}

/// The line of `key` in a table of `mask + 1` lines, counted from 1 (as a table's entries
/// are, after its header: [`host_line_entry`]).
///
/// The hash is MurmurHash3's 64-bit finalizer, whose every output bit depends on every key
/// bit: pod addresses are structured (a few varying octets), and a single multiply's middle
/// bits put 1024 such hosts into 64 lines unevenly enough that five lines held fewer than
/// three (`tests/bpf.rs`, `a_gateway_holds_16_mib_and_hosts_past_the_host_table_still_match`).
/// Addresses an attacker could choose can only overflow lines: their hosts are then asked from
/// the host map, as before the tables.
#[inline(always)]
pub const fn host_line_of(key: u64, mask: u32) -> u32 {
    let mut h = key;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    1 + (h as u32 & mask)
}

/// The `HOST_LINES` entry of line `line` ([`host_line_of`]) of table `table` of `mask + 1`
/// lines.
#[inline(always)]
pub const fn host_line_entry(table: u32, line: u32, mask: u32) -> u32 {
    table.wrapping_mul(mask.wrapping_add(1)).wrapping_add(line)
}

/// Lines of each table beside host maps of `hosts` entries: a power of two, one line per 16
/// hosts. At the default 65536: 4096 lines, 12288 slots, 256 KiB a table (a quarter of its
/// host map's buckets); with a policy of 1000 hosts, a line overflows with a probability of
/// about 1e-4 (Poisson, 0.24 hosts a line).
pub const fn host_lines_for(hosts: u32) -> u32 {
    let n = hosts / 16;
    if n <= 1 {
        1
    } else {
        n.next_power_of_two()
    }
}

/// `HOST_LINES`' entries with tables of `lines` lines: the headers' entry and four tables.
pub const fn host_line_entries(lines: u32) -> u32 {
    1 + HOST_TABLES * lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_never_the_empty_slot_and_differ_by_chain_and_address() {
        assert_ne!(host_line_key(0, [0; 4]), 0);
        assert_ne!(host_line_key(u32::MAX - 1, [0; 4]), 0);
        assert_ne!(
            host_line_key(1, [10, 0, 0, 1]),
            host_line_key(2, [10, 0, 0, 1])
        );
        assert_ne!(
            host_line_key(1, [10, 0, 0, 1]),
            host_line_key(1, [1, 0, 0, 10])
        );
    }

    #[test]
    fn lines_are_within_the_table_past_its_header() {
        for mask in [0u32, 1, 4095] {
            for i in 0..10_000u32 {
                let l = host_line_of(host_line_key(i % 7, i.to_be_bytes()), mask);
                assert!((1..=mask + 1).contains(&l), "{l} of mask {mask}");
            }
        }
        assert_eq!(host_lines_for(0), 1);
        assert_eq!(host_lines_for(65536), 4096);
        assert_eq!(host_lines_for(1000), 64);
        // The four tables' lines, one after another past entry 0.
        let mask = 3;
        let mut next = 1;
        for t in 0..HOST_TABLES {
            for l in 1..=mask + 1 {
                assert_eq!(host_line_entry(t, l, mask), next);
                next += 1;
            }
        }
        assert_eq!(next, host_line_entries(mask + 1));
        assert_eq!(
            [
                host_table(0, false),
                host_table(0, true),
                host_table(1, false),
                host_table(1, true)
            ],
            [0, 1, 2, 3]
        );
    }

    #[test]
    fn structured_addresses_spread_over_the_lines() {
        // 1024 odd hosts of 10.0.0.0/21 (as tests/bpf.rs has them) over 64 lines: every line
        // gets some, and none more than twice the mean.
        let mut per = [0u32; 65];
        for i in 0..1024u32 {
            let a = [10, 0, (i / 128) as u8, (2 * (i % 128) + 1) as u8];
            per[host_line_of(host_line_key(0, a), 63) as usize] += 1;
        }
        assert!(per[1..].iter().all(|n| (3..=32).contains(n)), "{per:?}");
    }

    #[test]
    fn a_line_is_one_cache_line() {
        assert_eq!(core::mem::size_of::<HostLine>(), 64);
    }
}
