//! The interface dimensions of a chain (`IIF`, `OIF`): the bitmap of the rules that hold for
//! the packet's interface, looked up by (chain, ifindex) in the slot's hash, else the
//! wildcard's entry (ifindex 0). A gateway's packets arrive on a handful of interfaces (its
//! tunnels, its Geneve devices), so a one-word chain body keeps, per CPU and dimension, the
//! last word it looked up ([`IfMemo`], in `WORK`) and reads it again instead of hashing the
//! same key.
//!
//! Why the memo is never stale: it holds for the policy epoch it was read under
//! (`Config::active`), and the maps a policy epoch reads never change under it. The agent
//! writes a new policy into the idle slot, or only the live slot's tries in place (never these
//! hashes), and starts a new epoch after either (`agent/backend/bpf/src/loader.rs`, `apply`
//! and `update_sets`); epochs only grow. The verdict cache relies on the same.

use aya_ebpf::maps::HashMap;
use peerwall_common::{Bitmap, IfKey};

use crate::dims::step;
use crate::maps::WORK;
use crate::work::IfMemo;

/// `acc &=` the bitmap of `chain`'s rules that hold for interface `ifindex` in `map` (the
/// slot's `IIF` or `OIF` hash, `out` saying which): its own entry, else the wildcard's; none
/// allows no rule. Whether any rule is left. A one-word body (`NW == 1`) serves it from this
/// CPU's memo of the dimension when that is of the same epoch, chain and interface, and
/// otherwise looks it up and remembers it.
#[inline(always)]
pub(crate) fn if_step<const NW: usize>(
    acc: &mut Bitmap,
    map: &HashMap<IfKey, Bitmap>,
    epoch: u32,
    chain: u32,
    ifindex: u32,
    out: bool,
) -> bool {
    // SAFETY (both lookups): read-only lookups of plain data.
    let lookup = || {
        unsafe { map.get(&IfKey { chain, ifindex }) }
            .or_else(|| unsafe { map.get(&IfKey { chain, ifindex: 0 }) })
    };
    if NW != 1 {
        return step::<NW>(acc, lookup());
    }
    let Some(w) = WORK.get_ptr_mut(0) else {
        return step::<1>(acc, lookup());
    };
    // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
    let m = unsafe {
        if out {
            &mut (*w).oif_memo
        } else {
            &mut (*w).iif_memo
        }
    };
    if m.valid == 0 || m.epoch != epoch || m.chain != chain || m.ifindex != ifindex {
        let b = lookup();
        *m = IfMemo {
            valid: 1,
            epoch,
            chain,
            ifindex,
            found: b.is_some() as u32,
            _pad: 0,
            word: b.map_or(0, |b| b.w[0]),
        };
    }
    if m.found == 0 {
        return false;
    }
    acc.w[0] &= m.word;
    acc.w[0] != 0
}
