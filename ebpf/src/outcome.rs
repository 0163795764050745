//! The outcome of a packet's classification: what the chains left in `SCRATCH`, and its
//! record in `LAST` (what `peerwall verdict --engine bpf` reads).

use crate::classify::{ACT_DROP, NO_RULE};
use crate::maps::{LAST, SCRATCH};

/// Record the outcome of the packet in `LAST` (what `peerwall verdict --engine bpf` reads).
pub(crate) fn record(out: &Outcome) {
    if let Some(r) = LAST.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*r).seq = (*r).seq.wrapping_add(1);
            (*r).verdict = out.action;
            (*r).has_chain = out.has_chain as u8;
            (*r).has_rule = (out.rule != NO_RULE) as u8;
            (*r).chain = out.chain;
            (*r).rule = out.rule;
            (*r).audit = out.audit as u8;
            (*r).audit_chain = out.audit_chain;
            (*r).audit_rule = out.audit_rule;
        }
    }
}

/// Outcome of the whole path.
pub(crate) struct Outcome {
    pub(crate) action: u8,
    pub(crate) chain: u32,
    pub(crate) rule: u32,
    pub(crate) has_chain: bool,
    /// Action code of the first would-drop (0: none), its chain and rule.
    pub(crate) audit: u32,
    pub(crate) audit_chain: u32,
    pub(crate) audit_rule: u32,
}

/// The outcome `classify` left in `SCRATCH` (drop when unreadable: fail closed).
#[inline(always)]
pub(crate) fn outcome() -> Outcome {
    match SCRATCH.get(0) {
        Some(sc) => Outcome {
            action: sc.action as u8,
            chain: sc.chain,
            rule: sc.rule,
            has_chain: sc.has_chain != 0,
            audit: sc.audit,
            audit_chain: sc.audit_chain,
            audit_rule: sc.audit_rule,
        },
        None => Outcome {
            action: ACT_DROP,
            chain: 0,
            rule: NO_RULE,
            has_chain: false,
            audit: 0,
            audit_chain: 0,
            audit_rule: NO_RULE,
        },
    }
}
