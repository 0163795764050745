//! Layouts as the kernel sees them, and the verdict cache's hash.

use super::*;
use core::mem::size_of;

#[test]
fn action_codes_round_trip() {
    for a in [
        ActionCode::Accept,
        ActionCode::Drop,
        ActionCode::Reject,
        ActionCode::AuditDrop,
        ActionCode::AuditReject,
    ] {
        assert_eq!(ActionCode::from_u8(a as u8), Some(a));
    }
    assert_eq!(ActionCode::from_u8(9), None);
}

#[test]
fn layouts_have_no_implicit_padding() {
    assert_eq!(size_of::<Bitmap>(), 128);
    assert_eq!(size_of::<AddrKeyData>(), 24);
    assert_eq!(size_of::<PortKeyData>(), 8);
    assert_eq!(size_of::<ProtoKey>(), 8);
    assert_eq!(size_of::<IfKey>(), 8);
    assert_eq!(size_of::<DimMasks>(), 256);
    assert_eq!(size_of::<ChainInfo>(), 12);
    assert_eq!(size_of::<RuleInfo>(), 4);
    assert_eq!(size_of::<HookChains>(), 4 + 4 * MAX_HOOK_CHAINS);
    assert_eq!(size_of::<Counter>(), 16);
    assert_eq!(size_of::<Config>(), 8);
    assert_eq!(size_of::<FlowKey>(), 40);
    assert_eq!(size_of::<VerdictKey4>(), 16);
    // With the kernel's 48-byte element header and the 16-byte key, a `VERDICTS4` element
    // is 104 bytes (the value rounded up to 40); a per-CPU way is one cache line.
    assert_eq!(size_of::<CachedVerdict>(), 36);
    assert_eq!(size_of::<CpuVerdict4>(), 64);
    assert_eq!(size_of::<CpuVerdicts4>(), 128);
    assert_eq!(size_of::<CpuVerdictTags>(), 128);
    assert_eq!(size_of::<PairDrop>(), 32);
    assert_eq!(size_of::<PairDrops>(), 64);
    assert_eq!(size_of::<FreshLine>(), 64);
    assert_eq!(size_of::<FlowState>(), 16);
    assert_eq!(size_of::<NewFlowSlot>(), 64);
    assert_eq!(core::mem::offset_of!(NewFlowSlot, state), 48);
    assert_eq!(size_of::<ProbeRecord>(), 24);
    assert_eq!(size_of::<FlowEvent>(), 88);
    assert_eq!(size_of::<EventConfig>(), 16);
    assert_eq!(size_of::<EventFlow>(), 56);
}

#[test]
fn verdict_sets_cover_the_table_and_follow_the_key() {
    let k = VerdictKey4 {
        src: [172, 16, 0, 9],
        dst: [10, 0, 3, 7],
        sport: 40000u16.to_be_bytes(),
        dport: 8080u16.to_be_bytes(),
        proto: 17,
        icmp_type: 0,
        _pad: [0; 2],
    };
    // The words are the key's bytes, as the datapath loads them from the packet.
    let bytes: [u8; 16] = unsafe { core::mem::transmute(k) };
    let loaded: [u32; 4] = core::array::from_fn(|i| {
        u32::from_ne_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    });
    assert_eq!(k.words(), loaded);
    // 4096 flows differing in the source port alone spread over the sets: no set holds
    // more than a few (a two-way set overflows at three).
    let mut per_set = [0u32; CPU_VERDICT_SETS as usize];
    for port in 0..4096u16 {
        let mut f = k;
        f.sport = (20000 + port).to_be_bytes();
        let s = verdict_set(f.words());
        assert!(s < CPU_VERDICT_SETS);
        per_set[s as usize] += 1;
    }
    assert!(
        per_set.iter().all(|&n| n <= 8),
        "{:?}",
        per_set.iter().max()
    );
    assert!(per_set.iter().filter(|&&n| n > 0).count() > 1200);
    // Within a set, the tags tell the flows apart: of the pairs of these flows that share a
    // set, about one in 256 shares a tag too (a tag is the hash's next byte).
    let mut tags = [[0u8; 8]; CPU_VERDICT_SETS as usize];
    let mut n = [0usize; CPU_VERDICT_SETS as usize];
    for port in 0..4096u16 {
        let mut f = k;
        f.sport = (20000 + port).to_be_bytes();
        let s = verdict_set(f.words()) as usize;
        tags[s][n[s]] = verdict_tag(f.words());
        n[s] += 1;
    }
    let (mut pairs, mut same) = (0u32, 0u32);
    for (t, &len) in tags.iter().zip(&n) {
        for i in 0..len {
            for j in i + 1..len {
                pairs += 1;
                same += u32::from(t[i] == t[j]);
            }
        }
    }
    assert!(pairs > 2000, "{pairs}");
    assert!(same * 64 < pairs, "{same} of {pairs} pairs share a tag");
    // IPv6: every byte of the key reaches the set.
    let k6 = FlowKey {
        src: [0xfd; 16],
        dst: [0xfe; 16],
        sport: [1, 2],
        dport: [3, 4],
        proto: 6,
        family: family::V6,
        _pad: [0; 2],
    };
    let mut other = k6;
    other.dst[15] ^= 1;
    assert_ne!(fold_key6(&k6), fold_key6(&other));
}

#[test]
fn bitmap_first() {
    let mut b = Bitmap::EMPTY;
    assert_eq!(b.first(), None);
    b.set(700);
    b.set(65);
    assert_eq!(b.first(), Some(65));
    assert!(b.get(700) && !b.get(64));
}

#[test]
fn new_flow_slots_spread_and_tell_directions_apart() {
    let k = |a: u8, b: u8, sport: u16| v4_key(a, b, sport, 80, 6);
    let mask = NEW_FLOW_SLOTS - 1;
    // Within the table, and the same key always in the same slot.
    assert!(new_flow_slot(&k(1, 2, 40000), mask) <= mask);
    assert_eq!(
        new_flow_slot(&k(1, 2, 40000), mask),
        new_flow_slot(&k(1, 2, 40000), mask)
    );
    // A flow and its reverse: different slots (the datapath looks both up).
    let f = k(1, 2, 40000);
    let r = reply_of(&f);
    assert_ne!(new_flow_slot(&f, mask), new_flow_slot(&r, mask));
    // 4096 flows differing in source port only land in nearly as many slots.
    let distinct = distinct_slots(
        NEW_FLOW_SLOTS as usize,
        (0..4096u16).map(|p| new_flow_slot(&k(1, 2, 30000 + p), mask)),
    );
    assert!(distinct > 3900, "{distinct} slots for 4096 flows");
}

#[test]
fn a_flow_and_its_reply_share_their_seen_entry_and_flows_spread() {
    let k = |a: u8, b: u8, sport: u16, dport: u16| v4_key(a, b, sport, dport, 17);
    let mask = FLOW_SEEN_SLOTS - 1;
    let f = k(1, 2, 40000, 53);
    let r = reply_of(&f);
    assert_eq!(flow_seen_slot(&f, mask), flow_seen_slot(&r, mask));
    assert!(flow_seen_slot(&f, mask) <= mask);
    // ICMP echo: the identifier stays in `sport` both ways (the datapath's `reverse`).
    let echo = v4_key(1, 2, 777, 0, 1);
    let echo_reply = FlowKey {
        src: echo.dst,
        dst: echo.src,
        ..echo
    };
    assert_eq!(
        flow_seen_slot(&echo, mask),
        flow_seen_slot(&echo_reply, mask)
    );
    // Another protocol, or another port: another entry.
    assert_ne!(
        flow_seen_slot(&f, mask),
        flow_seen_slot(&FlowKey { proto: 6, ..f }, mask)
    );
    assert_ne!(
        flow_seen_slot(&f, mask),
        flow_seen_slot(&k(1, 2, 40001, 53), mask)
    );
    // The ports crossed over share it (the price of ICMP's symmetry): a stamp there is only
    // ever too recent, which makes the datapath look, never miss a flow.
    assert_eq!(
        flow_seen_slot(&f, mask),
        flow_seen_slot(&k(1, 2, 53, 40000), mask)
    );
    // A flood's flows (source port and address sprayed) land in nearly as many entries.
    let distinct = distinct_slots(
        FLOW_SEEN_SLOTS as usize,
        (0..8192u32).map(|i| {
            flow_seen_slot(
                &k((i % 250) as u8, 2, 20000 + (i / 250) as u16 * 97, 80),
                mask,
            )
        }),
    );
    assert!(distinct > 7900, "{distinct} entries for 8192 flows");
}

#[test]
fn a_flow_its_reply_and_its_other_ports_share_their_pair_stamp() {
    let k = |a: u8, b: u8, sport: u16, dport: u16| v4_key(a, b, sport, dport, 17);
    let pair = |k: &FlowKey| flow_seen_pair_slot(k);
    let f = k(1, 2, 40000, 53);
    // Past the flow stamps, within the map.
    assert!((FLOW_SEEN_SLOTS..FLOW_SEEN_SLOTS + FLOW_SEEN_PAIRS).contains(&pair(&f)));
    assert_eq!(
        FLOW_SEEN_LINES * FLOW_SEEN_LANES,
        FLOW_SEEN_SLOTS + FLOW_SEEN_PAIRS
    );
    // The reply, and any other flow between the two addresses of the protocol, share it:
    // written with each of their flow stamps, an idle pair stamp says all of them are idle.
    assert_eq!(pair(&f), pair(&reply_of(&f)));
    assert_eq!(pair(&f), pair(&k(1, 2, 1234, 8080)));
    assert_eq!(pair(&f), pair(&reply_of(&k(1, 2, 9, 9))));
    // The datapath's key words of the known-flow path give the same slot.
    assert_eq!(pair(&f), flow_seen_pair_slot_of_words(&flow_words(&f)));
    // Another protocol or another address: (nearly always) another pair.
    assert_ne!(pair(&f), pair(&FlowKey { proto: 6, ..f }));
    assert_ne!(pair(&f), pair(&k(1, 3, 40000, 53)));
    // A flood's sources sprayed over 4096 addresses land in nearly as many pairs.
    let distinct = distinct_slots(
        FLOW_SEEN_PAIRS as usize,
        (0..4096u32).map(|i| {
            let mut key = k(0, 2, 20000, 80);
            key.src[2] = (i >> 8) as u8;
            key.src[3] = i as u8;
            pair(&key) - FLOW_SEEN_SLOTS
        }),
    );
    assert!(distinct > 3000, "{distinct} pairs for 4096 sources");
}

#[test]
fn a_seen_entry_is_idle_only_past_the_flows_lifetime_and_its_margin() {
    let unit = 1u64 << FLOW_SEEN_SHIFT;
    let idle = FLOW_IDLE_NS;
    let t = 5_000 * unit + 123;
    let stamp = flow_seen_stamp(t);
    // A flow written at `t` is live until `t + idle`: never idle before.
    assert!(!flow_seen_idle(stamp, t, idle));
    assert!(!flow_seen_idle(stamp, t + idle, idle));
    assert!(!flow_seen_idle(stamp, t + idle + unit, idle));
    // Past its lifetime and the margin: idle.
    assert!(flow_seen_idle(stamp, t + idle + 4 * unit, idle));
    // A stamp written a unit late (a race of two CPUs) stays not idle as long.
    assert!(!flow_seen_idle(stamp.wrapping_add(1), t + idle, idle));
    // A stamp ahead of the clock it is compared with (another CPU's later clock read, or a
    // coarse clock a tick behind): live, not idle.
    assert!(!flow_seen_idle(stamp.wrapping_add(1), t, idle));
    assert!(!flow_seen_idle(
        stamp.wrapping_add(FLOW_SEEN_AHEAD as u16),
        t,
        idle
    ));
    assert!(flow_seen_idle(
        stamp.wrapping_add(FLOW_SEEN_AHEAD as u16 + 1),
        t,
        idle
    ));
    // Across the 16-bit wrap.
    let late = (1u64 << (16 + FLOW_SEEN_SHIFT)) - unit;
    let s = flow_seen_stamp(late);
    assert!(!flow_seen_idle(s, late + idle, idle));
    assert!(flow_seen_idle(s, late + idle + 4 * unit, idle));
    // The stamp an entry no flow covers may be set to is idle.
    assert!(flow_seen_idle(flow_seen_idle_stamp(t, idle), t, idle));
    // Zero (never written) at a boot younger than the lifetime: not idle (the datapath looks).
    assert!(!flow_seen_idle(0, idle / 2, idle));
}

/// An IPv4 flow key from 10.0.0.a:sport to 10.0.1.b:dport.
fn v4_key(a: u8, b: u8, sport: u16, dport: u16, proto: u8) -> FlowKey {
    FlowKey {
        src: [10, 0, 0, a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        dst: [10, 0, 1, b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto,
        family: 1,
        _pad: [0; 2],
    }
}

/// How many distinct slots `slots` takes in a table of up to 2^17 (no allocation: the crate is
/// `no_std`).
fn distinct_slots(n: usize, slots: impl Iterator<Item = u32>) -> usize {
    let mut seen = [0u64; (1 << 17) / 64];
    assert!(n <= 1 << 17);
    let mut distinct = 0;
    for s in slots {
        let (w, b) = (s as usize / 64, 1u64 << (s % 64));
        if seen[w] & b == 0 {
            seen[w] |= b;
            distinct += 1;
        }
    }
    distinct
}

/// The key of `k`'s replies.
fn reply_of(k: &FlowKey) -> FlowKey {
    FlowKey {
        src: k.dst,
        dst: k.src,
        sport: k.dport,
        dport: k.sport,
        ..*k
    }
}

#[test]
fn a_set_may_serve_until_its_mark_wrapping() {
    // Served while now < at + ttl: at `until` itself no longer.
    assert!(verdict_may_serve(1000, 999));
    assert!(!verdict_may_serve(1000, 1000));
    assert!(!verdict_may_serve(1000, 5000));
    // Across the 32-bit wrap of jiffies.
    assert!(verdict_may_serve(10, u32::MAX - 5));
    assert!(!verdict_may_serve(u32::MAX - 5, 10));
    // An empty map (0) says nothing may be served at a clock well past it.
    assert!(!verdict_may_serve(0, 4_000_000));
}

#[test]
fn a_way_is_free_only_once_its_verdict_no_longer_serves() {
    // Every `until` around a few points, the 32-bit wrap among them, against every `now` from
    // well before it to the hint's range: never free while `now < until` (the verdict may
    // serve), always free within three units after it (two, and one more where the hint
    // would be 0), and never written (0) is free.
    for base in [0u32, 1000, 0x7fff_fff0, u32::MAX - 40] {
        for du in 0..64u32 {
            let until = base.wrapping_add(du);
            let hint = verdict_until_hint(until);
            assert_ne!(hint, 0, "until {until}");
            for back in 1..=1800u32 {
                let now = until.wrapping_sub(back);
                assert!(!verdict_way_free(hint, now), "until {until}, now {now}");
            }
            for ahead in (3 << VERDICT_HINT_SHIFT)..(100 << VERDICT_HINT_SHIFT) {
                let now = until.wrapping_add(ahead);
                assert!(verdict_way_free(hint, now), "until {until}, now {now}");
            }
        }
    }
    assert!(verdict_way_free(0, 0));
    assert!(verdict_way_free(0, 123_456));
}

/// `open_slots`' rule, checked over every chain of 6 rules with random state slots and every
/// set of rules the other dimensions could allow: a decision under `OPEN_EITHER` whose rule is
/// in `OPEN_EVERY` (or that no rule makes) is the decision under each of new, established and
/// related; and the check is not vacuous: where it fails, some state decides otherwise.
#[test]
fn a_decision_under_open_either_holds_for_every_open_state_when_its_rule_is_in_open_every() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let bits = |w: u64| Bitmap {
        w: core::array::from_fn(|i| if i == 0 { w & 0x3f } else { 0 }),
    };
    let (mut held, mut differed) = (0, 0);
    for _ in 0..2000 {
        let slots: [Bitmap; 5] = core::array::from_fn(|_| bits(next()));
        let (either, every) = open_slots(&slots);
        for a in 0..64u64 {
            let a = bits(a);
            let and = |b: &Bitmap| Bitmap {
                w: core::array::from_fn(|i| a.w[i] & b.w[i]),
            };
            let decided = and(&either).first();
            let per_state: [Option<usize>; 3] =
                [ct::NEW, ct::ESTABLISHED, ct::RELATED].map(|s| and(&slots[s as usize]).first());
            let agrees = per_state.iter().all(|r| *r == decided);
            if decided.is_none_or(|r| every.get(r)) {
                assert!(agrees, "{decided:?} against {per_state:?}");
                held += 1;
            } else if !agrees {
                differed += 1;
            }
        }
    }
    assert!(
        held > 1000 && differed > 1000,
        "{held} held, {differed} differed"
    );
}

#[test]
fn pair_sets_spread_the_denied_destinations_of_one_source() {
    // The gateway benchmark's denied flood: one source at a time, 1024 destinations of a
    // /22. Pairs of a set beyond its two ways are not cached (classified in full): few are.
    let src = u32::from_ne_bytes([172, 16, 3, 9]);
    let mut per_set = [0u32; PAIR_DROP_SETS as usize];
    for i in 0..1024u32 {
        let d = 0x0a_0a_00_00u32 + i;
        let s = pair_set(src, u32::from_ne_bytes(d.to_be_bytes()), 17);
        assert!(s < PAIR_DROP_SETS);
        per_set[s as usize] += 1;
    }
    let beyond: u32 = per_set
        .iter()
        .map(|&n| n.saturating_sub(PAIR_DROP_WAYS as u32))
        .sum();
    assert!(
        beyond < 64,
        "{beyond} of 1024 pairs beyond their set's ways"
    );
    // The protocol and either address move the set.
    let d = u32::from_ne_bytes([10, 10, 0, 1]);
    assert_ne!(pair_set(src, d, 17), pair_set(src, d, 6));
    assert_ne!(pair_set(src, d, 17), pair_set(d, src, 17));
}
