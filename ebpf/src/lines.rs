//! The one-line host tables' lookup (`HOST_LINES`; layout and invariant:
//! `peerwall_common::lines`): an IPv4 host of a chain of one bitmap word in one line, read with
//! inlined array lookups (no helper call, no hash of the key bytes), before the host map.

use peerwall_common::{
    family, host_line_entry, host_line_key, host_line_of, HOST_LINES_ON, HOST_LINE_OVERFLOW,
    HOST_LINE_SLOTS, HOST_TABLES,
};

use crate::maps::HOST_LINES;
use crate::parse::Pkt;

/// What a host's line says.
pub(crate) enum Line {
    /// The host map holds the host; its bitmap's first word.
    Hit(u64),
    /// The host map does not hold it: the trie answers.
    Absent,
    /// Ask the host map (the table off, not IPv4, or the line overflowed).
    Unknown,
}

/// Look host `addr` of chain `chain` up in table `table` ([`peerwall_common::host_table`]).
///
/// The reads are volatile and in this order, which the writer's in-place protocol relies on
/// (`agent/backend/bpf/src/loader/lines.rs`): the table's header, then the line's keys, then
/// the line's overflow bit. The writer sets a line's overflow bit before it clears a key, so a
/// key read as cleared is followed by an overflow bit read as set (x86's loads are not
/// reordered with older loads; the loader turns the tables on only there).
#[inline(always)]
pub(crate) fn host_line(table: u32, chain: u32, p: &Pkt, addr: &[u8; 16]) -> Line {
    if p.family != family::V4 || table >= HOST_TABLES {
        return Line::Unknown;
    }
    let Some(head) = HOST_LINES.get(0) else {
        return Line::Unknown;
    };
    // SAFETY: a word of an entry of a successful lookup (`table` < 4).
    let h = unsafe { core::ptr::read_volatile(&head.w[table as usize]) };
    if h & HOST_LINES_ON == 0 {
        return Line::Unknown;
    }
    let (key, mask) = (
        host_line_key(chain, [addr[0], addr[1], addr[2], addr[3]]),
        h as u32,
    );
    let Some(line) = HOST_LINES.get(host_line_entry(table, host_line_of(key, mask), mask)) else {
        return Line::Unknown;
    };
    let mut i = 0;
    while i < HOST_LINE_SLOTS {
        // SAFETY: words of an entry of a successful lookup, indices below 8.
        unsafe {
            if core::ptr::read_volatile(&line.w[1 + 2 * i]) == key {
                return Line::Hit(core::ptr::read_volatile(&line.w[2 + 2 * i]));
            }
        }
        i += 1;
    }
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&line.w[0]) } & HOST_LINE_OVERFLOW != 0 {
        Line::Unknown
    } else {
        Line::Absent
    }
}
