//! Rule counters (`COUNTERS<s>`, per CPU): a packet counted in the rules that decided it, as
//! a cached verdict is served (`cache/serve.rs`) and as a classification that did not count as
//! it went is settled (`open_either.rs`).

use peerwall_common::CACHED_COUNTERS;

use crate::maps::{COUNTERS0, COUNTERS1, SCRATCH, WORK};

/// Count one packet of `len` bytes in counter `counter` of the policy of `epoch`.
#[inline(always)]
pub(crate) fn count_one(epoch: u32, counter: u32, len: u64) {
    let c = if epoch & 1 == 0 {
        COUNTERS0.get_ptr_mut(counter)
    } else {
        COUNTERS1.get_ptr_mut(counter)
    };
    if let Some(c) = c {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len;
        }
    }
}

/// Count one packet of `len` bytes in the first `counted` of `counters` (at most
/// [`CACHED_COUNTERS`]) of the policy of `epoch`: what a cached verdict or a pair drop holds of
/// the rules that decided it.
#[inline(always)]
pub(crate) fn count_held(epoch: u32, counters: &[u16; CACHED_COUNTERS], counted: u8, len: u64) {
    let n = (counted as usize).min(CACHED_COUNTERS);
    let mut i = 0;
    while i < CACHED_COUNTERS {
        if i >= n {
            break;
        }
        count_one(epoch, counters[i] as u32, len);
        i += 1;
    }
}

/// Count `WORK`'s packet in the rules that decided it, from the trail of its classification
/// (`SCRATCH`, at most [`CACHED_COUNTERS`] chains): what a classification that did not count
/// as it went (`Route::open_either`) counts once its outcome holds.
#[inline(never)]
pub(crate) fn count_trail() {
    let (Some(w), Some(sc)) = (WORK.get(0), SCRATCH.get(0)) else {
        return;
    };
    let n = (sc.steps as usize).min(CACHED_COUNTERS);
    let mut i = 0;
    while i < CACHED_COUNTERS {
        if i >= n {
            break;
        }
        count_one(w.r.epoch, sc.trail[i], w.p.len as u64);
        i += 1;
    }
}
