//! One dimension of a chain: its lookup keys, which of an address dimension's maps the chain's
//! description has looked up ([`described`]), and the AND of the bitmap found into the rules
//! still allowed ([`step`], [`step_masked`]); `classify.rs` runs them per chain.

use aya_ebpf::maps::lpm_trie::Key;
use peerwall_common::{constrained, family, AddrKeyData, Bitmap, DimMasks, PortKeyData, WORDS};

use crate::lines::Line;
use crate::parse::Pkt;

/// `to = *from`, all 16 words, volatile: as an assignment LLVM calls the linked `memmove`,
/// which copies a byte per iteration (128 for a bitmap, on every chain of more than 64 rules),
/// and inlined as plain words it spills them to a stack frame the call chain has no room for.
#[inline(never)]
pub(crate) fn copy_bitmap(to: &mut Bitmap, from: &Bitmap) {
    let mut i = 0;
    while i < WORDS {
        // SAFETY: both in bounds, of valid memory (references).
        unsafe { core::ptr::write_volatile(&mut to.w[i], core::ptr::read_volatile(&from.w[i])) };
        i += 1;
    }
}

/// acc &= b over the first `NW` words; whether any bit is left. A missing bitmap allows no
/// rule.
#[inline(always)]
pub(crate) fn step<const NW: usize>(acc: &mut Bitmap, b: Option<&Bitmap>) -> bool {
    let Some(b) = b else {
        return false;
    };
    let mut any = 0u64;
    let mut i = 0;
    while i < NW {
        acc.w[i] &= b.w[i];
        any |= acc.w[i];
        i += 1;
    }
    any != 0
}

/// acc &= (lookup ^ neg) | any over the first `NW` words; a missing lookup is an empty bitmap.
#[inline(always)]
pub(crate) fn step_masked<const NW: usize>(
    acc: &mut Bitmap,
    l: Option<&Bitmap>,
    m: Option<&DimMasks>,
) -> bool {
    let Some(m) = m else {
        return false;
    };
    let mut any = 0u64;
    let mut i = 0;
    match l {
        Some(b) => {
            while i < NW {
                acc.w[i] &= (b.w[i] ^ m.neg.w[i]) | m.any.w[i];
                any |= acc.w[i];
                i += 1;
            }
        }
        None => {
            while i < NW {
                acc.w[i] &= m.neg.w[i] | m.any.w[i];
                any |= acc.w[i];
                i += 1;
            }
        }
    }
    any != 0
}

/// Where [`constrained::SRC_NO_HOSTS`] and [`constrained::SRC_NO_PREFIXES`] sit in a chain's
/// `constrained` (shifted down by it, they are bits 0 and 1), and the destination's pair.
pub(crate) const SRC_SKIPS: u32 = constrained::SRC_NO_HOSTS.trailing_zeros();
pub(crate) const DST_SKIPS: u32 = constrained::DST_NO_HOSTS.trailing_zeros();
const _: () = assert!(
    constrained::SRC_NO_PREFIXES == constrained::SRC_NO_HOSTS << 1
        && constrained::DST_NO_PREFIXES == constrained::DST_NO_HOSTS << 1
);

/// An address dimension's answer as the chain's description has it looked up: the host map
/// unless `skips` bit 0 (no host entry), then on a miss the trie unless bit 1 (no prefix).
#[inline(always)]
pub(crate) fn described<'a>(
    skips: u32,
    host: impl FnOnce() -> Option<&'a Bitmap>,
    trie: impl FnOnce() -> Option<&'a Bitmap>,
) -> Option<&'a Bitmap> {
    let found = if skips & 1 == 0 { host() } else { None };
    found.or_else(|| if skips & 2 == 0 { trie() } else { None })
}

/// acc &= (w ^ neg) | any on the first word: a chain of one word's step with the bitmap word
/// a host's line holds.
#[inline(always)]
fn step_word(acc: &mut Bitmap, w: u64, m: Option<&DimMasks>) -> bool {
    let Some(m) = m else {
        return false;
    };
    acc.w[0] &= (w ^ m.neg.w[0]) | m.any.w[0];
    acc.w[0] != 0
}

/// An address dimension's step: for a chain of one word (`NW == 1`) that has hosts, the host's
/// line first ([`crate::lines::host_line`], unless `lines` is false); where it does not know,
/// [`described`]'s host map then trie. Whether any rule is left.
#[inline(always)]
pub(crate) fn addr_step<'a, const NW: usize>(
    acc: &mut Bitmap,
    skips: u32,
    lines: bool,
    line: impl FnOnce() -> Line,
    host: impl FnOnce() -> Option<&'a Bitmap>,
    trie: impl FnOnce() -> Option<&'a Bitmap>,
    m: Option<&DimMasks>,
) -> bool {
    let skips = if NW == 1 && skips & 1 == 0 && lines {
        match line() {
            Line::Hit(w) => return step_word(acc, w, m),
            // The host map holds no entry: as if the chain had no hosts.
            Line::Absent => skips | 1,
            Line::Unknown => skips,
        }
    } else {
        skips
    };
    step_masked::<NW>(acc, described(skips, host, trie), m)
}

pub(crate) fn addr_data(chain: u32, p: &Pkt, addr: &[u8; 16]) -> AddrKeyData {
    AddrKeyData {
        chain: chain.to_be_bytes(),
        family: (p.family as u32).to_be_bytes(),
        addr: *addr,
    }
}

pub(crate) fn addr_key(chain: u32, p: &Pkt, addr: &[u8; 16]) -> Key<AddrKeyData> {
    let bits = if p.family == family::V4 { 32 } else { 128 };
    Key::new(
        peerwall_common::ADDR_KEY_FIXED_BITS + bits,
        addr_data(chain, p, addr),
    )
}

pub(crate) fn port_key(chain: u32, port: u16) -> Key<PortKeyData> {
    Key::new(
        peerwall_common::PORT_KEY_FIXED_BITS + 16,
        PortKeyData {
            chain: chain.to_be_bytes(),
            port: port.to_be_bytes(),
            _pad: [0; 2],
        },
    )
}
