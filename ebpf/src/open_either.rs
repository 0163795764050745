//! Classification without the kernel's state (`ct::OPEN_EITHER`, `conntrack.rs`'s
//! `CT_OPEN_EITHER`): a UDP packet or a TCP SYN of a flow the kernel's table may hold is
//! classified under new, established and related at once; the chains note where that did
//! not decide for all three (`classify.rs`, `note_open_split`), and [`settle_open_either`]
//! keeps the outcome, takes it as new's once the kernel says new, or classifies the packet
//! again with the kernel's state.

use aya_ebpf::bindings::__sk_buff;
use peerwall_common::{ct, flags, CACHED_COUNTERS};

use crate::classify::{ACT_DROP, ACT_REJECT};
use crate::conntrack::{CT_FIRST_REPLY, CT_NO_WRITE, CT_UNKNOWN};
use crate::counters::count_trail;
use crate::maps::{SCRATCH, WORK};
use crate::{classify_work, kernel_state_tc};

/// After `WORK`'s packet was classified under `OPEN_EITHER` (its state not looked up,
/// [`crate::conntrack::CT_OPEN_EITHER`]): where every chain's decision held for each state the
/// packet can have, its rules are counted (`count`: 1) and the outcome stands; else the
/// kernel's table gives the state and the packet is classified again, as it would have been
/// without the shortcut.
/// A global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn settle_open_either(skb: *mut __sk_buff, flags: u32, count: u32) -> u32 {
    let Some(sc) = SCRATCH.get(0) else {
        return 0;
    };
    // Beyond the trail, the chains' rules could not be counted afterwards.
    if sc.ambiguous == 0 && sc.steps as usize <= CACHED_COUNTERS {
        if count != 0 {
            count_trail();
        }
        return 0;
    }
    let seen_on = flags & flags::FLOW_SEEN != 0;
    // The first call did not read the packet's `FLOW_SEEN` entry where the known-flow path
    // had not (a packet that may open a connection either way is classified first): this one
    // reads it, so a flow no table knows is new without asking the kernel (a line the
    // known-flow path read is still in the CPU's cache).
    let tracked = kernel_state_tc(skb, seen_on as u32, 0, 0);
    let Some(w) = WORK.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: per-CPU slot of a successful lookup.
    unsafe {
        let r = &mut (*w).r;
        r.state = tracked & 0xff;
        r.open_either = false;
        r.count = count != 0;
        r.commit = r.commit && tracked & CT_NO_WRITE == 0;
        r.unknown = tracked & CT_UNKNOWN != 0;
        r.first_reply = tracked & CT_FIRST_REPLY != 0;
    }
    if tracked & 0xff == ct::NEW && taken_as_new() {
        if count != 0 {
            count_trail();
        }
        return 0;
    }
    classify_work()
}

/// Whether the classification under `OPEN_EITHER` in `SCRATCH` is, or becomes, the one of a
/// `new` packet: no chain decided otherwise for `new` (the path as `new` is the one taken), or
/// the first that did decided a drop or reject, which ends the path there, with nothing
/// after it on record (no audit from a later chain); `SCRATCH` then ends at that chain. A
/// denied packet of a flood whose `FLOW_SEEN` entries are all live (the `replies` rule made
/// its classification depend on the state) is then classified once, as before the shortcut.
#[inline(always)]
fn taken_as_new() -> bool {
    let Some(sc) = SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
    let sc = unsafe { &mut *sc };
    if sc.new_split == 0 {
        return sc.steps as usize <= CACHED_COUNTERS;
    }
    let step = sc.new_step as usize;
    let action = sc.new_action as u8;
    if (action != ACT_DROP && action != ACT_REJECT)
        || step >= CACHED_COUNTERS
        || (sc.audit != 0 && sc.audit_step as usize >= step)
    {
        return false;
    }
    sc.action = sc.new_action;
    sc.chain = sc.new_chain;
    sc.rule = sc.new_rule;
    sc.has_chain = 1;
    sc.trail[step] = sc.new_counter;
    sc.steps = step as u32 + 1;
    true
}
