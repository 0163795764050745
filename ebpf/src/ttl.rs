//! The datapath's clocks: how long a cached verdict lives (`cache.rs`: its stamp and its
//! lifetime, in jiffies, at most one second at whatever HZ the kernel runs), and the coarse
//! clock as read once for a packet ([`coarse_ns`]).

use crate::maps::{CLOCKS, WORK};
use aya_ebpf::helpers::generated::{bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns};

/// Cached verdicts are timed in jiffies: the verifier inlines `bpf_jiffies64` into one load,
/// where a nanosecond clock is a helper call that every packet of a known flow would pay. A
/// verdict is served for at most one second's worth of them, which needs the kernel's HZ:
/// [`ttl`] measures it against `bpf_ktime_get_ns` (on the rare path that caches a verdict), and
/// until it has [`CALIBRATION_NS`] of measurement uses [`TTL_UNCALIBRATED`].
///
/// 100 jiffies: at most one second at every HZ Linux builds with (≥ 100).
pub(crate) const TTL_UNCALIBRATED: u32 = 100;

/// How long [`ttl`] measures before it trusts its HZ (a lower bound that tightens as the
/// measurement grows: after 50 ms, 88% of HZ 250; after a second, HZ − 1).
pub(crate) const CALIBRATION_NS: u64 = 50_000_000;

/// Now, in jiffies (low 32 bits: compared wrapping).
#[inline(always)]
pub(crate) fn stamp() -> u32 {
    // SAFETY: no arguments.
    unsafe { bpf_jiffies64() as u32 }
}

/// How many jiffies make at most one second: a lower bound of HZ measured since the first
/// cached verdict, less one for the tick the verdict's stamp may sit late in, or
/// [`TTL_UNCALIBRATED`] while the measurement is shorter than [`CALIBRATION_NS`].
#[inline(always)]
fn ttl() -> u32 {
    // SAFETY: no arguments.
    let (ns, j) = unsafe { (bpf_ktime_get_ns(), bpf_jiffies64()) };
    let Some(c) = CLOCKS.get_ptr_mut(0) else {
        return TTL_UNCALIBRATED;
    };
    // SAFETY: pointer from a successful lookup; racing CPUs each write a valid sample.
    let (ns0, j0) = unsafe { ((*c)[0], (*c)[1]) };
    if ns0 == 0 {
        // SAFETY: as above.
        unsafe { *c = [ns, j] };
        return TTL_UNCALIBRATED;
    }
    let dns = ns.wrapping_sub(ns0);
    if !(CALIBRATION_NS..1 << 62).contains(&dns) {
        return TTL_UNCALIBRATED;
    }
    let dj = j.wrapping_sub(j0);
    if dj >= 1 << 40 {
        return TTL_UNCALIBRATED;
    }
    // `dj` ticks in `dns` counts at most one tick more than elapsed (the samples may sit just
    // before one tick and just after another): HZ ≥ (dj − 1) / dns. Per second, in µs so that
    // the product stays far below 2^64; the division truncates, erring short.
    let hz = dj.saturating_sub(1) * 1_000_000 / (dns / 1000);
    (hz.saturating_sub(1) as u32).clamp(TTL_UNCALIBRATED, 10_000)
}

/// Jiffies a [`ttl`] measured on this CPU is reused for (`Work::ttl_now`) before it is measured
/// again: every lower bound of HZ stays one, so reusing one is never wrong, and measuring
/// costs two clock reads on the path that caches a verdict, which a flood of denied new flows
/// takes for every packet. 64 jiffies: a quarter second at most (HZ ≥ 250 on gateways; 0.64 s
/// at HZ 100), so the measurement still tightens within seconds of a load.
const TTL_REUSE: u32 = 64;

/// [`ttl`], measured at most once per [`TTL_REUSE`] jiffies on this CPU, at `now` (jiffies).
#[inline(always)]
pub(crate) fn ttl_reused(now: u32) -> u16 {
    let Some(w) = WORK.get_ptr_mut(0) else {
        return ttl() as u16;
    };
    // SAFETY: per-CPU slot of a successful lookup.
    let c = unsafe { &raw mut (*w).ttl_now };
    // SAFETY: per-CPU slot of a successful lookup; only this CPU's programs use it.
    unsafe {
        let [t, at] = *c;
        if t != 0 && now.wrapping_sub(at) < TTL_REUSE {
            return t as u16;
        }
        let t = ttl();
        *c = [t, now];
        t as u16
    }
}

/// The coarse clock (`bpf_ktime_get_coarse_ns`: the last tick's time, no clock-source read) for
/// `WORK`'s packet, read at most once per packet (`Work::coarse`; the entries zero it where
/// the known-flow path did not read it for this packet): a helper call costs as much as a
/// cached map lookup, and the known-flow path, the mirror's lease and conntrack's vouch check
/// each read it. Every use compares it with a bound set seconds apart from the packet's time
/// (the lease, the vouch, `FLOW_SEEN`'s idle horizon): a value a few hundred nanoseconds older
/// than a fresh read is, like the coarse clock's own tick, nothing to them, and an older clock
/// only makes stamps look younger (never idle early).
#[inline(always)]
pub(crate) fn coarse_ns() -> u64 {
    let Some(w) = WORK.get_ptr_mut(0) else {
        // SAFETY: no arguments.
        return unsafe { bpf_ktime_get_coarse_ns() };
    };
    // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
    unsafe {
        if (*w).coarse == 0 {
            (*w).coarse = bpf_ktime_get_coarse_ns();
        }
        (*w).coarse
    }
}
