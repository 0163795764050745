//! Making cached verdicts stale: a new generation of their sets ([`outdate`], [`forget`]).

use peerwall_common::{family, FlowKey};

use super::key::{key4, key6, set_of};
use crate::maps::{VERDICTS4, VERDICTS6, VERDICT_GENS};
use crate::parse::{IPPROTO_ICMP, IPPROTO_ICMPV6};

/// Make every verdict cached in set `set` stale, on every CPU.
#[inline(always)]
fn bump(set: u32) {
    if let Some(g) = VERDICT_GENS.get_ptr_mut(set) {
        // One atomic add (`lock xadd` on x86-64: a full barrier, so the removals before it are
        // visible to whoever reads the new generation). The target has no `AtomicU32`.
        // SAFETY: an aligned u32 of map memory; the instruction writes only it.
        unsafe {
            core::arch::asm!(
                "lock *(u32 *)({0} + 0) += {1}",
                in(reg) g,
                in(reg) 1u64,
                options(nostack, preserves_flags)
            );
        }
    }
}

/// Make the cached verdicts of flow `k`'s packets stale without removing them (see
/// [`forget`]): a new generation of their sets is all it takes, since no verdict is served
/// under another. For a flow conntrack did not know (its first accept), whose packets rarely
/// have a verdict cached at all: the removal is a locked hash-bucket walk, which a flood of
/// new flows would otherwise pay on every packet.
///
/// A global function: the verifier checks it once; `k` is never null.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn outdate(k: *const FlowKey) -> u32 {
    // SAFETY: a valid key or null.
    let Some(k) = (unsafe { k.as_ref() }) else {
        return 0;
    };
    match k.proto {
        IPPROTO_ICMP => {
            bump(set_of(k, 8));
            bump(set_of(k, 0));
        }
        IPPROTO_ICMPV6 => {
            bump(set_of(k, 128));
            bump(set_of(k, 129));
        }
        _ => bump(set_of(k, 0)),
    }
    0
}

/// Forget the cached verdicts of the packets of flow `k` (both echo types for ICMP): a
/// commit changed their conntrack state. Their `VERDICTS4`/`VERDICTS6` entries go first, then
/// their sets' generations move on, which makes the copies on every CPU stale, and any verdict
/// whose classification read the old state: one that reads the new generation finds the
/// entries already gone.
///
/// A global function: the verifier checks it once; `k` is never null.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn forget(k: *const FlowKey) -> u32 {
    // SAFETY: a valid key or null.
    let Some(k) = (unsafe { k.as_ref() }) else {
        return 0;
    };
    let icmp = match k.proto {
        IPPROTO_ICMP => Some((8, 0)),
        IPPROTO_ICMPV6 => Some((128, 129)),
        _ => None,
    };
    let v4 = k.family == family::V4;
    let remove = |extra: u8| {
        if v4 {
            let _ = VERDICTS4.remove(&key4(k, extra));
        } else {
            let _ = VERDICTS6.remove(&key6(k, extra));
            crate::apart::apart();
        }
        bump(set_of(k, extra));
    };
    match icmp {
        Some((request, reply)) => {
            remove(request);
            remove(reply);
        }
        None => remove(0),
    }
    0
}
