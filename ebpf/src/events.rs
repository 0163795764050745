//! Events: drops, rejects, would-drops (audit) and, with the flow log, the first packet of each
//! flow per chain that accepted it, sent to user space through the `EVENTS` ring buffer
//! ([`FlowEvent`]). Never per packet: at most one event per flow, kind and chain per
//! `EVENT_CONF.flow_interval_ns` (the packets in between are counted
//! into the next one, in `EVENT_FLOWS`), and at most `rate` per second per CPU overall (a token
//! bucket per CPU). When the ring buffer is full the event is lost, never the packet.

use aya_ebpf::helpers::generated::{bpf_ktime_get_ns, bpf_loop};
use peerwall_common::{
    counter_owner, ct, event, CachedVerdict, EventConfig, EventFlow, FlowEvent, CACHED_COUNTERS,
};

use crate::classify::{ACT_ACCEPT, ACT_AUDIT_DROP, ACT_AUDIT_REJECT, ACT_DROP, ACT_REJECT};
use crate::flow::flow_key;
use crate::maps::{EVENTS, EVENT_BUCKET, EVENT_CONF, EVENT_FLOWS, OWNERS0, OWNERS1, SCRATCH, WORK};
use crate::parse::{IPPROTO_ICMP, IPPROTO_ICMPV6};

const TOKEN: u64 = 1_000_000_000;

/// Take one token from this CPU's bucket.
#[inline(always)]
fn take_token(now: u64, conf: &EventConfig) -> bool {
    let Some(b) = EVENT_BUCKET.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU slot of a successful lookup.
    let b = unsafe { &mut *b };
    let elapsed = now.wrapping_sub(b.last_ns).min(10 * TOKEN);
    b.last_ns = now;
    let cap = conf.burst as u64 * TOKEN;
    b.tokens = (b.tokens + elapsed * conf.rate as u64).min(cap);
    if b.tokens < TOKEN {
        return false;
    }
    b.tokens -= TOKEN;
    true
}

/// `COUNTERS` index of epoch `epoch`'s slot → (chain, rule or [`event::POLICY`]), as its
/// `OWNERS` entry says.
#[inline(always)]
pub(crate) fn decode_counter(c: u32, epoch: u32) -> (u32, u32) {
    let owner = if epoch & 1 == 0 {
        OWNERS0.get(c)
    } else {
        OWNERS1.get(c)
    };
    let o = owner.copied().unwrap_or(counter_owner(u32::MAX, None));
    let rule = o & 0xffff;
    (o >> 16, if rule == 0xffff { event::POLICY } else { rule })
}

/// The event kind of a final action, or of a would-drop's audit code.
#[inline(always)]
pub(crate) fn kind_of(action: u32) -> u8 {
    match action as u8 {
        ACT_DROP => event::DROP,
        ACT_REJECT => event::REJECT,
        ACT_AUDIT_DROP => event::AUDIT_DROP,
        ACT_AUDIT_REJECT => event::AUDIT_REJECT,
        _ => event::ACCEPT,
    }
}

/// What an event says beyond the packet in `WORK`.
#[repr(C)]
pub(crate) struct Said {
    pub(crate) kind: u8,
    pub(crate) chain: u32,
    pub(crate) rule: u32,
    pub(crate) iif: u32,
    pub(crate) oif: u32,
    pub(crate) state: u32,
    pub(crate) epoch: u32,
}

/// Count `WORK`'s packet in its flow's event state and send an event when one is due. A
/// global function: the verifier checks it once, not at each of its callers'
/// calls; `s` is never null (the verifier requires the test of a global function's pointer
/// argument).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn note(s: *const Said) -> u32 {
    // SAFETY: a valid `Said` or null.
    let (Some(s), Some(w), Some(conf)) = (unsafe { s.as_ref() }, WORK.get(0), EVENT_CONF.get(0))
    else {
        return 0;
    };
    let p = &w.p;
    // One state per flow, kind and chain (chain ids are below 64).
    let mut k = flow_key(p);
    k._pad[0] = s.kind;
    k._pad[1] = s.chain as u8;
    // SAFETY: no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let len = p.len as u64;
    let f = match EVENT_FLOWS.get_ptr_mut(&k) {
        Some(f) => f,
        None => {
            let fresh = EventFlow {
                last_ns: 0,
                packets: 0,
                bytes: 0,
                seen_ns: 0,
                iif: 0,
                oif: 0,
                rule: 0,
                epoch: 0,
                sport: 0,
                dport: 0,
                state: 0,
                _pad: [0; 3],
            };
            if EVENT_FLOWS.insert(&k, &fresh, 0).is_err() {
                return 0;
            }
            match EVENT_FLOWS.get_ptr_mut(&k) {
                Some(f) => f,
                None => return 0,
            }
        }
    };
    let (sport, dport) = if p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6 {
        (p.icmp_id, p.icmp_type as u16)
    } else {
        (p.sport, p.dport)
    };
    // SAFETY: value of a successful lookup; plain integers, races between CPUs only lose counts.
    let f = unsafe { &mut *f };
    f.packets += 1;
    f.bytes += len;
    if (f.last_ns != 0 && now.wrapping_sub(f.last_ns) < conf.flow_interval_ns)
        || !take_token(now, conf)
    {
        // Counted, not reported: the latest packet, for the event user space sends if the
        // flow goes quiet before its next one is due (a sent event leaves nothing to keep).
        f.seen_ns = now;
        f.iif = s.iif;
        f.oif = s.oif;
        f.rule = s.rule;
        f.epoch = s.epoch;
        f.sport = sport;
        f.dport = dport;
        f.state = s.state as u8;
        return 0;
    }
    let Some(mut e) = EVENTS.reserve::<FlowEvent>(0) else {
        return 0;
    };
    e.write(FlowEvent {
        ts_ns: now,
        packets: f.packets,
        bytes: f.bytes,
        src: p.src,
        dst: p.dst,
        sport,
        dport,
        iif: s.iif,
        oif: s.oif,
        chain: s.chain,
        rule: s.rule,
        epoch: s.epoch,
        family: p.family,
        proto: p.proto,
        state: s.state as u8,
        kind: s.kind,
        _pad: [0; 4],
    });
    e.submit(0);
    f.last_ns = now;
    f.packets = 0;
    f.bytes = 0;
    0
}

/// The event of a classified packet (`WORK`, its outcome in `SCRATCH`), if the flags ask
/// for one. A global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn note_outcome(flags: u32) -> u32 {
    if flags & peerwall_common::flags::EVENTS == 0 {
        return 0;
    }
    let out = &crate::outcome::outcome();
    let Some(w) = WORK.get(0) else {
        return 0;
    };
    let r = &w.r;
    if out.action != ACT_ACCEPT || out.audit != 0 {
        let (kind, chain, rule) = if out.action != ACT_ACCEPT {
            (kind_of(out.action as u32), out.chain, out.rule)
        } else {
            (kind_of(out.audit), out.audit_chain, out.audit_rule)
        };
        note(&Said {
            kind,
            chain,
            rule,
            iif: r.iif,
            oif: r.oif,
            state: r.state,
            epoch: r.epoch,
        });
    }
    if flags & peerwall_common::flags::FLOW_LOG != 0 && r.state == ct::NEW && out.has_chain {
        flow_log(out.action, out.audit != 0);
    }
    0
}

/// What the flow log's per-chain callback needs.
#[repr(C)]
struct FlowLog {
    /// `SCRATCH.trail` index of the audited chain's would-drop (not an accept), or `u32::MAX`.
    skip: u32,
    iif: u32,
    oif: u32,
    epoch: u32,
}

/// One chain of the flow log: the chain at trail position `index` accepted the packet.
/// `bpf_loop` calls it, so the verifier checks it once whatever the number of chains.
extern "C" fn flow_log_step(index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is the FlowLog on the caller's stack that bpf_loop hands back.
    let c = unsafe { &*(ctx as *const FlowLog) };
    let i = index as usize;
    if i >= CACHED_COUNTERS {
        return 1;
    }
    if i as u32 == c.skip {
        return 0;
    }
    let Some(sc) = SCRATCH.get(0) else {
        return 1;
    };
    let (chain, rule) = decode_counter(sc.trail[i], c.epoch);
    note(&Said {
        kind: event::ACCEPT,
        chain,
        rule,
        iif: c.iif,
        oif: c.oif,
        state: ct::NEW,
        epoch: c.epoch,
    });
    0
}

/// The flow log: every chain that accepted the first packet of a flow (`WORK`, outcome `out`)
/// reports it, as nftables' `ct state new` log rules do; the first [`CACHED_COUNTERS`] chains of
/// the path (the `SCRATCH.trail` holds their decisions).
#[inline(never)]
fn flow_log(action: u8, audited: bool) {
    let (Some(sc), Some(w)) = (SCRATCH.get(0), WORK.get(0)) else {
        return;
    };
    let r = &w.r;
    let n = sc.steps.min(CACHED_COUNTERS as u32);
    // Evaluation stops at the first refusal: every chain before it accepted.
    let accepted = if action == ACT_ACCEPT {
        n
    } else {
        n.saturating_sub(1)
    };
    if accepted == 0 {
        return;
    }
    let mut c = FlowLog {
        skip: if audited { sc.audit_step } else { u32::MAX },
        iif: r.iif,
        oif: r.oif,
        epoch: r.epoch,
    };
    // SAFETY: bpf_loop calls `flow_log_step` with a pointer to `c`, which outlives the call.
    unsafe {
        bpf_loop(
            accepted,
            flow_log_step as *mut core::ffi::c_void,
            (&mut c as *mut FlowLog).cast(),
            0,
        );
    }
}

/// The event of a packet served from the verdict cache (`v`): a drop, or (`audits`: tc, which
/// sees every accepted packet) a would-drop.
#[inline(always)]
pub(crate) fn note_cached(v: &CachedVerdict, epoch: u32, audits: bool) {
    let n = (v.counted as usize).min(CACHED_COUNTERS);
    let (kind, step) = if v.action == ACT_DROP {
        (event::DROP, n.wrapping_sub(1))
    } else if audits && v.audit != 0 {
        (kind_of(v.audit as u32), v.audit_step as usize)
    } else {
        return;
    };
    if step >= CACHED_COUNTERS {
        return;
    }
    let (chain, rule) = decode_counter(v.counters[step] as u32, epoch);
    note(&Said {
        kind,
        chain,
        rule,
        iif: v.ifindex,
        oif: v.oif,
        state: v.state as u32,
        epoch,
    });
}
