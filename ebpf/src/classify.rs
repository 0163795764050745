//! Classification: per chain, one bitmap lookup per dimension, ANDed; the lowest bit decides.
//! Hooks are run in path order with `bpf_loop`, chains in priority order.

use aya_ebpf::helpers::generated::bpf_loop;
use peerwall_common::{
    constrained, ct, dim, family, hook, host_table, start_index, ActionCode, Bitmap, DimMasks,
    HookChains, ProtoKey, CACHED_COUNTERS, MAX_HOOK_CHAINS, MAX_RULES, WORDS,
};

use crate::dims::{
    addr_data, addr_key, addr_step, copy_bitmap, port_key, step, step_masked, DST_SKIPS, SRC_SKIPS,
};
use crate::iface_memo::if_step;
use crate::lines::host_line;
use crate::maps::{
    ACC, CHAINS0, CHAINS1, COUNTERS0, COUNTERS1, CT0, CT1, DPORT0, DPORT1, DST0, DST1, DSTH0,
    DSTH1, HOOKS0, HOOKS1, IIF0, IIF1, MASKS0, MASKS1, OIF0, OIF1, PROTO0, PROTO1, RULES0, RULES1,
    SCRATCH, SPORT0, SPORT1, SRC0, SRC1, SRCH0, SRCH1, START, WORK,
};
use crate::parse::Pkt;
use crate::route::PATH_FORWARD;
use crate::work::{Query, Route};

// Classification.

// Verdict codes are `peerwall-common`'s, shared with the map compiler.
pub(crate) const ACT_ACCEPT: u8 = ActionCode::Accept as u8;
pub(crate) const ACT_DROP: u8 = ActionCode::Drop as u8;
pub(crate) const ACT_REJECT: u8 = ActionCode::Reject as u8;
pub(crate) const ACT_AUDIT_DROP: u8 = ActionCode::AuditDrop as u8;
pub(crate) const ACT_AUDIT_REJECT: u8 = ActionCode::AuditReject as u8;
pub(crate) const NO_RULE: u32 = u32::MAX;

/// Chains of at most this many rules take the one-word body of the evaluation: their rules'
/// bits all lie in the first word, and a bit past a chain's rules could only name a rule it
/// does not have (its policy decides then), so each step ANDs and scans one word of the 16 (a
/// chain of 64 rules reads 8 bytes of each bitmap instead of 128). Two bodies with a constant
/// word count each, not one with a count read from the map: the verifier would walk a bounded
/// loop of unknown length once per possible count. [`chain_step`] picks the body by the
/// chain's rule count, and each is a function of its own, so the stack holds one of them
/// (inlined side by side, their frames added up past the 512 bytes XDP's call chain has).
pub(crate) const ONE_WORD_RULES: u32 = 64;

macro_rules! slot_eval {
    ($name:ident, $src:ident, $dst:ident, $srch:ident, $dsth:ident, $sport:ident, $dport:ident, $proto:ident, $iif:ident,
     $oif:ident, $ct:ident, $masks:ident, $chains:ident, $rules:ident, $counters:ident,
     $slot:expr) => {
        /// Run one chain over the first `NW` bitmap words; the outcome goes to `SCRATCH`
        /// (action, deciding rule or NO_RULE). One function per word count, each with its body
        /// inlined: the caller picks one, so the call chain's stack holds one body's frame.
        #[inline(never)]
        fn $name<const NW: usize>(q: &Query, p: &Pkt) -> u32 {
            let (mut action, idx, counter) = $name::run::<NW>(q, p);
            if let Some(sc) = SCRATCH.get_ptr_mut(0) {
                // An audited chain's drop or reject: the chain accepts; the first one is kept.
                if action == ACT_AUDIT_DROP || action == ACT_AUDIT_REJECT {
                    // SAFETY: per-CPU slot of a successful lookup.
                    unsafe {
                        if (*sc).audit == 0 {
                            (*sc).audit = action as u32;
                            (*sc).audit_chain = q.chain;
                            (*sc).audit_rule = idx;
                            (*sc).audit_step = (*sc).steps;
                        }
                    }
                    action = ACT_ACCEPT;
                }
                // SAFETY: per-CPU slot of a successful lookup.
                unsafe {
                    (*sc).action = action as u32;
                    (*sc).rule = idx;
                    (*sc).chain = q.chain;
                    (*sc).has_chain = 1;
                    let step = (*sc).steps as usize;
                    if step < CACHED_COUNTERS {
                        (*sc).trail[step] = counter;
                    }
                    (*sc).steps = (*sc).steps.saturating_add(1);
                }
            }
            0
        }

        mod $name {
            use super::*;

            // size: see the doc comment: one inlined body for the verifier.
            /// One chain, start to end: every dimension's lookup ANDed into the rule bitmap,
            /// the lowest bit decides. Long on purpose: one inlined body per slot keeps each
            /// map reference a constant the verifier resolves, and the lookups share one
            /// accumulator on the stack.
            #[inline(always)]
            pub(super) fn run<const NW: usize>(q: &Query, p: &Pkt) -> (u8, u32, u32) {
                let chain = q.chain;
                let Some(info) = $chains.get(chain) else {
                    return (ACT_DROP, NO_RULE, NO_RULE);
                };
                let policy = info.policy;
                let nrules = info.rules;
                let base = info.counters as u32;
                // The accumulator lives in per-CPU map memory: whatever path led here, the
                // verifier sees the same state afterwards and prunes.
                let Some(accp) = ACC.get_ptr_mut(0) else {
                    return (ACT_DROP, NO_RULE, NO_RULE);
                };
                // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
                let acc = unsafe { &mut *accp };
                let fidx = u32::from(p.family != family::V4);
                let pk = ProtoKey {
                    chain,
                    family: p.family,
                    proto: p.proto,
                    _pad: [0; 2],
                };
                // Protocols no rule names share the family's "other" entry (`_pad[0] = 1`).
                let other = ProtoKey {
                    chain,
                    family: p.family,
                    proto: 0,
                    _pad: [1, 0],
                };
                // Where every protocol of the family starts from one bitmap, the array holds
                // it (an inlined read); else the protocol hash. Each copied into `ACC` on its
                // own branch, both with the keys on the stack: past it the two states are
                // the same, and the verifier walks the rest of the chain once.
                let started = if info.constrained & constrained::start(fidx) != 0 {
                    start_from::<NW>(acc, START.get(start_index($slot, chain, fidx)))
                } else {
                    // SAFETY: read-only lookups of plain data.
                    let found =
                        unsafe { $proto.get(&pk) }.or_else(|| unsafe { $proto.get(&other) });
                    start_from::<NW>(acc, found)
                };
                if !started {
                    return (policy, NO_RULE, base.wrapping_add(nrules));
                }
                let cons = if q.all_lookups {
                    info.constrained & !constrained::NO_LOOKUPS
                } else {
                    info.constrained
                };
                let done = 'dims: {
                    // The addresses first, most likely to empty the bitmap: a denied packet's
                    // lookups end there (a flood towards addresses no rule accepts skips
                    // the interfaces, the state and the ports), while an accepted one makes
                    // every lookup whatever the order (the AND of the bitmaps is the same).
                    //
                    // Each address: the host's line (chains of one word), the host map, then
                    // the trie; the host lookups skipped where the chain's dimension has no entry
                    // there (`*_NO_HOSTS`, `*_NO_PREFIXES`).
                    if cons & constrained::DST != 0
                        && !addr_step::<NW>(
                            acc,
                            cons >> DST_SKIPS,
                            !q.no_lines,
                            || host_line(host_table($slot, true), chain, p, &p.dst),
                            // SAFETY: read-only lookup of plain data.
                            || unsafe { $dsth.get(&addr_data(chain, p, &p.dst)) },
                            || $dst.get(addr_key(chain, p, &p.dst)),
                            $masks.get(chain * 4 + dim::DST),
                        )
                    {
                        break 'dims true;
                    }
                    if cons & constrained::SRC != 0
                        && !addr_step::<NW>(
                            acc,
                            cons >> SRC_SKIPS,
                            !q.no_lines,
                            || host_line(host_table($slot, false), chain, p, &p.src),
                            // SAFETY: read-only lookup of plain data.
                            || unsafe { $srch.get(&addr_data(chain, p, &p.src)) },
                            || $src.get(addr_key(chain, p, &p.src)),
                            $masks.get(chain * 4 + dim::SRC),
                        )
                    {
                        break 'dims true;
                    }
                    if cons & constrained::IIF != 0
                        && !if_step::<NW>(acc, &$iif, q.epoch, chain, q.iif, false)
                    {
                        break 'dims true;
                    }
                    if cons & constrained::OIF != 0
                        && !if_step::<NW>(acc, &$oif, q.epoch, chain, q.oif, true)
                    {
                        break 'dims true;
                    }
                    if cons & constrained::CT != 0
                        && !step::<NW>(acc, $ct.get(chain * ct::SLOTS + q.state))
                    {
                        break 'dims true;
                    }
                    // The ports last: a chain whose bitmap emptied before them decided
                    // whatever the packet's ports (its policy), and so did one that tests
                    // none, or one whose first rule left tests neither port (no rule before
                    // it is left, and it holds for every port); any other may have decided
                    // by a port (`Scratch::narrow`, what a pair drop needs: `cache/pair.rs`).
                    if p.has_ports && cons & (constrained::DPORT | constrained::SPORT) != 0 {
                        // One-word chains only: in the sixteen-word body the scan for the
                        // first rule was a fifth of the verifier's walk (`tests/bpf.rs`).
                        // Noted in `SCRATCH` at once, not carried in a register to the
                        // chain's end: the verifier would walk the rest once per value.
                        let first = acc.w[0].trailing_zeros();
                        let narrow = NW != 1
                            || (first < 64
                                && first < nrules
                                && !(port_wild(
                                    cons & constrained::DPORT,
                                    $masks.get(chain * 4 + dim::DPORT),
                                    first as usize,
                                ) && port_wild(
                                    cons & constrained::SPORT,
                                    $masks.get(chain * 4 + dim::SPORT),
                                    first as usize,
                                )));
                        if narrow {
                            note_narrow();
                        }
                        if cons & constrained::DPORT != 0
                            && !step_masked::<NW>(
                                acc,
                                $dport.get(port_key(chain, p.dport)),
                                $masks.get(chain * 4 + dim::DPORT),
                            )
                        {
                            break 'dims true;
                        }
                        if cons & constrained::SPORT != 0
                            && !step_masked::<NW>(
                                acc,
                                $sport.get(port_key(chain, p.sport)),
                                $masks.get(chain * 4 + dim::SPORT),
                            )
                        {
                            break 'dims true;
                        }
                    }
                    false
                };
                let rule = if done { None } else { acc.first_within::<NW>() };
                // Under `OPEN_EITHER` (the state one of new, established, related): the
                // decision holds for all three only when its rule matches all three
                // (`peerwall_common::open_slots`); a decision by the policy always does.
                if q.state == ct::OPEN_EITHER && cons & constrained::CT != 0 {
                    if let Some(r) = rule {
                        let every = $ct.get(chain * ct::SLOTS + ct::OPEN_EVERY);
                        if (r as u32) < nrules && !every.is_some_and(|b| b.get(r)) {
                            note_open_split(chain, r as u32, NW as u32, $slot);
                        }
                    }
                }
                let (action, idx) = match rule {
                    Some(r) if (r as u32) < nrules => {
                        let r = r as u32;
                        match $rules.get(chain * MAX_RULES as u32 + r) {
                            Some(ri) => (ri.action, r),
                            None => (ACT_DROP, r),
                        }
                    }
                    _ => (policy, NO_RULE),
                };
                let counter = base.wrapping_add(if idx == NO_RULE { nrules } else { idx });
                if !q.count {
                    return (action, idx, counter);
                }
                if let Some(c) = $counters.get_ptr_mut(counter) {
                    // SAFETY: per-CPU slot of a successful lookup.
                    unsafe {
                        (*c).packets += 1;
                        (*c).bytes += p.len as u64;
                    }
                }
                (action, idx, counter)
            }
        }
    };
}

/// Note in `SCRATCH` that a chain on the packet's path may have decided by a port
/// (`Scratch::narrow`).
#[inline(always)]
fn note_narrow() {
    if let Some(sc) = SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe { (*sc).narrow = 1 };
    }
}

/// Whether rule `r` holds whatever a port dimension says: the chain does not test it
/// (`constrained` 0), or the rule is among those it does not constrain (its `any` mask).
#[inline(always)]
fn port_wild(constrained: u32, m: Option<&DimMasks>, r: usize) -> bool {
    constrained == 0 || m.is_some_and(|m| m.any.get(r))
}

/// Copy a chain's start bitmap (its first `NW` words) into the accumulator; false without one
/// (the chain's policy decides).
#[inline(always)]
fn start_from<const NW: usize>(acc: &mut Bitmap, first: Option<&Bitmap>) -> bool {
    let Some(first) = first else {
        return false;
    };
    if NW == WORDS {
        copy_bitmap(acc, first);
    } else {
        let mut i = 0;
        while i < NW {
            acc.w[i] = first.w[i];
            i += 1;
        }
    }
    true
}

slot_eval!(
    eval0, SRC0, DST0, SRCH0, DSTH0, SPORT0, DPORT0, PROTO0, IIF0, OIF0, CT0, MASKS0, CHAINS0,
    RULES0, COUNTERS0, 0
);
slot_eval!(
    eval1, SRC1, DST1, SRCH1, DSTH1, SPORT1, DPORT1, PROTO1, IIF1, OIF1, CT1, MASKS1, CHAINS1,
    RULES1, COUNTERS1, 1
);

/// A chain run under `OPEN_EITHER` decided by rule `r`, which does not match all three
/// states: the classification is ambiguous (`Scratch::ambiguous`), and where it is the first
/// chain whose decision for `new` differs, that decision is noted (`Scratch::new_split`),
/// from the rules `ACC` still holds (those of any of the three states; `new`'s are among them)
/// within the chain's first `nw` words, in policy slot `slot`. A global function: the
/// verifier checks it once, not in each chain body.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn note_open_split(chain: u32, r: u32, nw: u32, slot: u32) -> u32 {
    let (Some(sc), Some(acc)) = (SCRATCH.get_ptr_mut(0), ACC.get(0)) else {
        return 0;
    };
    // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
    let sc = unsafe { &mut *sc };
    sc.ambiguous = 1;
    if sc.new_split != 0 {
        return 0;
    }
    let (info, new_bits) = if slot & 1 == 0 {
        (CHAINS0.get(chain), CT0.get(chain * ct::SLOTS + ct::NEW))
    } else {
        (CHAINS1.get(chain), CT1.get(chain * ct::SLOTS + ct::NEW))
    };
    let (Some(info), Some(new_bits)) = (info, new_bits) else {
        return 0;
    };
    let nrules = info.rules;
    let new_rule = if nw == 1 {
        acc.first_within_and::<1>(new_bits)
    } else {
        acc.first_within_and::<WORDS>(new_bits)
    };
    let (action, idx) = match new_rule {
        Some(n) if (n as u32) < nrules => {
            let n = n as u32;
            let ri = if slot & 1 == 0 {
                RULES0.get(chain * MAX_RULES as u32 + n)
            } else {
                RULES1.get(chain * MAX_RULES as u32 + n)
            };
            (ri.map_or(ACT_DROP, |ri| ri.action), n)
        }
        _ => (info.policy, NO_RULE),
    };
    if idx == r {
        return 0;
    }
    sc.new_split = 1;
    sc.new_step = sc.steps;
    sc.new_action = action as u32;
    sc.new_chain = chain;
    sc.new_rule = idx;
    sc.new_counter = (info.counters as u32).wrapping_add(if idx == NO_RULE { nrules } else { idx });
    0
}

#[inline(always)]
pub(crate) fn hooks_of(slot: u32, idx: u32) -> Option<&'static HookChains> {
    if slot == 0 {
        HOOKS0.get(idx)
    } else {
        HOOKS1.get(idx)
    }
}

/// State shared with the per-chain callback of `bpf_loop`; the query itself is in `WORK`
/// (`Work::q`), where the chain bodies read it.
#[repr(C)]
pub(crate) struct LoopCtx {
    /// Index into `HOOKS` (of the slot whose callback runs: [`chain_step0`], [`chain_step1`]).
    pub(crate) hook_idx: u32,
    /// Set when a chain refused the packet.
    pub(crate) refused: u32,
}

/// The chain bodies, as global functions: the verifier checks a global function once, on
/// its own, not once per call site and caller state as it does a static one. Called from the
/// `bpf_loop` callback of each of the four hooks (and of each program entry), the static
/// bodies were most of the instructions the verifier walked (each load of a gateway's program
/// took over a second, `cargo xtask bench-peers`). No arguments: each reads the query from
/// `WORK`, where [`classify`] wrote it once for all the packet's chains.
macro_rules! global_chain_body {
    ($($sym:ident => $eval:ident, $nw:expr;)*) => {
        $(
            #[unsafe(no_mangle)]
            #[inline(never)]
            pub extern "C" fn $sym() -> u32 {
                match WORK.get(0) {
                    Some(w) => $eval::<{ $nw }>(&w.q, &w.p),
                    None => 0,
                }
            }
        )*
    };
}
global_chain_body! {
    pw_chain0_one => eval0, 1;
    pw_chain0_all => eval0, WORDS;
    pw_chain1_one => eval1, 1;
    pw_chain1_all => eval1, WORDS;
}

/// One iteration of policy slot 0: evaluate chain `index` of the hook. The verifier checks
/// this body once per `bpf_loop` call site, whatever the number of chains.
extern "C" fn chain_step0(index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    chain_step::<0>(index, ctx)
}

/// [`chain_step0`] for policy slot 1.
extern "C" fn chain_step1(index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    chain_step::<1>(index, ctx)
}

/// One iteration: evaluate chain `index` of the hook in policy slot `SLOT`. One body per slot,
/// each with its own maps: with the slot read at run time, LLVM merged the two `HOOKS`
/// lookups into one call whose map the verifier cannot tell, and left it to the generic
/// helper (a call per chain of every classified packet, 5 % of a denied flood's time in the
/// program on the gateway benchmark's path) where it inlines a lookup of a known array.
#[inline(always)]
fn chain_step<const SLOT: u32>(index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is the LoopCtx on the caller's stack that bpf_loop hands back.
    let lc = unsafe { &mut *(ctx as *mut LoopCtx) };
    let hc = if SLOT == 0 {
        HOOKS0.get(lc.hook_idx)
    } else {
        HOOKS1.get(lc.hook_idx)
    };
    let Some(hc) = hc else {
        return 1;
    };
    let i = index as usize;
    if i >= MAX_HOOK_CHAINS {
        return 1;
    }
    let chain = hc.chains[i];
    let Some(w) = WORK.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
    unsafe { (*w).q.chain = chain };
    let info = if SLOT == 0 {
        CHAINS0.get(chain)
    } else {
        CHAINS1.get(chain)
    };
    let one = info.is_none_or(|c| c.rules <= ONE_WORD_RULES);
    match (SLOT == 0, one) {
        (true, true) => pw_chain0_one(),
        (true, false) => pw_chain0_all(),
        (false, true) => pw_chain1_one(),
        (false, false) => pw_chain1_all(),
    };
    let a = match SCRATCH.get(0) {
        Some(sc) => sc.action,
        None => ACT_DROP as u32,
    };
    if a != ACT_ACCEPT as u32 {
        lc.refused = 1;
        return 1;
    }
    0
}

/// Run every chain of `hk` in policy slot `SLOT` for the packet in `WORK`; false when the
/// packet was refused. The slot is a constant so that each `bpf_loop` call site has one
/// callback: the verifier then inlines the loop (a plain loop calling the callback directly,
/// `inline_bpf_loop` in `kernel/bpf/verifier.c`, which requires one callback and zero flags in
/// every state reaching the call). With the slot read at run time, one call site chose
/// between both callbacks, the helper stayed a call, and each chain cost it an indirect call
/// (a retpoline where the kernel mitigates Spectre v2).
#[inline(always)]
fn run_hook<const SLOT: u32>(hk: u32, family: u8) -> bool {
    let fidx = if family == family::V4 { 0 } else { 1 };
    let hook_idx = hk * 2 + fidx;
    let count = match hooks_of(SLOT, hook_idx) {
        Some(hc) => hc.count.min(MAX_HOOK_CHAINS as u32),
        None => return true,
    };
    if count == 0 {
        return true;
    }
    let mut lc = LoopCtx {
        hook_idx,
        refused: 0,
    };
    let step = if SLOT == 0 {
        chain_step0 as *mut core::ffi::c_void
    } else {
        chain_step1 as *mut core::ffi::c_void
    };
    // SAFETY: bpf_loop calls `step` with a pointer to `lc`, which outlives the call.
    unsafe {
        bpf_loop(count, step, (&mut lc as *mut LoopCtx).cast(), 0);
    }
    lc.refused == 0
}

/// Evaluate `WORK`'s packet on its path: (prerouting, forward, postrouting) or (prerouting,
/// input), in the policy slot of its epoch.
#[inline(always)]
pub(crate) fn classify(route: &Route) -> u32 {
    if route.epoch & 1 == 0 {
        classify_in::<0>(route)
    } else {
        classify_in::<1>(route)
    }
}

/// [`classify`] in policy slot `SLOT`: one body per slot, each with its own `bpf_loop`
/// call sites ([`run_hook`]). Not inlined: in one body, LLVM merged the two slots' `bpf_loop`
/// calls into one whose callback the verifier cannot tell, and it left the loop a helper call
/// (`tests/bpf.rs` checks the translated program).
#[inline(never)]
fn classify_in<const SLOT: u32>(route: &Route) -> u32 {
    let (path, iif, oif, state, count) =
        (route.path, route.iif, route.oif, route.state, route.count);
    if let Some(sc) = SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*sc).action = ACT_ACCEPT as u32;
            (*sc).chain = 0;
            (*sc).rule = NO_RULE;
            (*sc).has_chain = 0;
            (*sc).steps = 0;
            (*sc).audit = 0;
            (*sc).ambiguous = 0;
            (*sc).new_split = 0;
            (*sc).narrow = 0;
        }
    }
    let Some(w) = WORK.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
    unsafe {
        (*w).q = Query {
            count,
            epoch: route.epoch,
            chain: 0,
            iif,
            oif: 0,
            state,
            all_lookups: route.all_lookups,
            no_lines: route.no_lines,
        };
    }
    // SAFETY: as above.
    let family = unsafe { (*w).p.family };
    if !run_hook::<SLOT>(hook::PREROUTING, family) {
        return 0;
    }
    if path == PATH_FORWARD {
        // SAFETY: as above.
        unsafe { (*w).q.oif = oif };
        if !run_hook::<SLOT>(hook::FORWARD, family) {
            return 0;
        }
        let _ = run_hook::<SLOT>(hook::POSTROUTING, family);
    } else {
        let _ = run_hook::<SLOT>(hook::INPUT, family);
    }
    0
}
