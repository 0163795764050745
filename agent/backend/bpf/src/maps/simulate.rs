//! A simulator of the datapath over compiled map contents, for tests: the same lookups and
//! ANDs the program does, in user space.

use ipnet::IpNet;
use peerwall_common::{Bitmap, DimMasks};
use peerwall_policy::ir::{self, eval::proto, Hook, IpFamily, VerdictAction};
use std::net::IpAddr;

use super::*;

/// A packet as the datapath sees it after routing: the interfaces by index.
#[derive(Clone, Debug)]
pub struct DatapathPacket<'a> {
    /// The packet.
    pub pkt: &'a ir::Packet,
    /// Input interface index.
    pub iif: u32,
    /// Output interface index (forward path).
    pub oif: u32,
}

pub(super) fn lpm_port(entries: &[(u16, u8, Bitmap)], p: u16) -> Option<&Bitmap> {
    entries
        .iter()
        .filter(|(port, len, _)| {
            let mask = if *len == 0 { 0 } else { u16::MAX << (16 - len) };
            p & mask == *port
        })
        .max_by_key(|(_, len, _)| *len)
        .map(|(_, _, b)| b)
}

/// An address dimension's lookup as the chain's description has the datapath make it: the
/// exact-match map (its host entries) unless `no_hosts`, then the trie (its other prefixes)
/// unless `no_prefixes`; every host fits the exact-match map here.
fn described_addr<'a>(
    entries: &'a [(IpNet, Bitmap)],
    a: &IpAddr,
    no_hosts: bool,
    no_prefixes: bool,
) -> Option<&'a Bitmap> {
    let host = || {
        entries
            .iter()
            .find(|(n, _)| is_host(n) && n.addr() == *a)
            .map(|(_, b)| b)
    };
    let trie = || {
        entries
            .iter()
            .filter(|(n, _)| !is_host(n) && n.contains(a))
            .max_by_key(|(n, _)| n.prefix_len())
            .map(|(_, b)| b)
    };
    (!no_hosts)
        .then(host)
        .flatten()
        .or_else(|| (!no_prefixes).then(trie).flatten())
}

pub(super) fn and_into(acc: &mut Bitmap, b: &Bitmap) {
    for i in 0..acc.w.len() {
        acc.w[i] &= b.w[i];
    }
}

pub(super) fn and_masked(acc: &mut Bitmap, l: Option<&Bitmap>, m: &DimMasks) {
    for i in 0..acc.w.len() {
        let x = l.map_or(0, |b| b.w[i]);
        acc.w[i] &= (x ^ m.neg.w[i]) | m.any.w[i];
    }
}

/// Evaluate one chain exactly as the datapath does (linear scans instead of tries):
/// (verdict, deciding rule position).
pub fn simulate_chain(
    c: &ChainMaps,
    p: &ir::Packet,
    iif: u32,
    oif: u32,
) -> (VerdictAction, Option<usize>) {
    simulate_chain_slot(c, p, iif, oif, ct_number(p.ct_state) as usize)
}

/// [`simulate_chain`] of a packet whose state is one of new, established and related, unknown
/// which, as the kernel-conntrack datapath classifies it (`OPEN_EITHER`): the decision, or
/// None where it does not hold for all three (its rule is not in `OPEN_EVERY`).
pub fn simulate_chain_open_either(
    c: &ChainMaps,
    p: &ir::Packet,
    iif: u32,
    oif: u32,
) -> Option<(VerdictAction, Option<usize>)> {
    let (v, rule) = simulate_chain_slot(c, p, iif, oif, ct::OPEN_EITHER as usize);
    let every = &c.ct_slots()[ct::OPEN_EVERY as usize];
    let holds = c.info().constrained & peerwall_common::constrained::CT == 0
        || rule.is_none_or(|r| every.get(r));
    holds.then_some((v, rule))
}

/// One chain with the state dimension read at `CT` slot `slot`.
fn simulate_chain_slot(
    c: &ChainMaps,
    p: &ir::Packet,
    iif: u32,
    oif: u32,
    slot: usize,
) -> (VerdictAction, Option<usize>) {
    let fam = family_code(p.family());
    let cons = c.info().constrained;
    let fidx = u32::from(p.family() == IpFamily::V6);
    // The family's start bitmap where the description says so, else the protocol hash.
    let first = if cons & peerwall_common::constrained::start(fidx) != 0 {
        c.start(fidx)
    } else {
        let known = c
            .proto
            .iter()
            .find(|(f, pr, _)| *f == fam && *pr == Some(p.proto));
        known
            .or_else(|| c.proto.iter().find(|(f, pr, _)| *f == fam && pr.is_none()))
            .map(|(_, _, b)| *b)
    };
    let Some(first) = first else {
        return (c.policy, None);
    };
    let mut acc = first;
    let pick = |v: &[(u32, Bitmap)], idx: u32| {
        v.iter()
            .find(|(i, _)| *i == idx)
            .or_else(|| v.iter().find(|(i, _)| *i == 0))
            .map(|(_, b)| *b)
            .unwrap_or(Bitmap::EMPTY)
    };
    and_into(&mut acc, &pick(&c.iif, iif));
    and_into(&mut acc, &pick(&c.oif, oif));
    and_into(&mut acc, &c.ct_slots()[slot]);
    let skips = |no_hosts: u32, no_prefixes: u32| (cons & no_hosts != 0, cons & no_prefixes != 0);
    let (h, t) = skips(
        peerwall_common::constrained::SRC_NO_HOSTS,
        peerwall_common::constrained::SRC_NO_PREFIXES,
    );
    and_masked(&mut acc, described_addr(&c.src, &p.src, h, t), &c.masks[0]);
    let (h, t) = skips(
        peerwall_common::constrained::DST_NO_HOSTS,
        peerwall_common::constrained::DST_NO_PREFIXES,
    );
    and_masked(&mut acc, described_addr(&c.dst, &p.dst, h, t), &c.masks[1]);
    if proto::carries_ports(p.proto) {
        and_masked(&mut acc, lpm_port(&c.sport, p.sport), &c.masks[2]);
        and_masked(&mut acc, lpm_port(&c.dport, p.dport), &c.masks[3]);
    }
    match acc.first() {
        Some(r) if r < c.rules.len() => (c.rules[r].action, Some(r)),
        _ => (c.policy, None),
    }
}

/// The destination the datapath classifies on: `VIEW`'s longest entry for (iif, dst).
fn viewed_dst(bp: &BpfPolicy, iif: u32, dst: IpAddr) -> IpAddr {
    bp.views
        .iter()
        .filter(|e| e.ifindex == iif && e.from.contains(&dst))
        .max_by_key(|e| e.from.prefix_len())
        .and_then(|e| ir::nat::map_prefix(e.from, e.to, dst))
        .unwrap_or(dst)
}

/// Evaluate a packet, as it arrives on `dp.iif`, over the compiled maps as the datapath does.
pub fn simulate(bp: &BpfPolicy, dp: &DatapathPacket<'_>) -> ir::Verdict {
    let dst = viewed_dst(bp, dp.iif, dp.pkt.dst);
    let viewed;
    let p = if dst == dp.pkt.dst {
        dp.pkt
    } else {
        viewed = ir::Packet {
            dst,
            ..dp.pkt.clone()
        };
        &viewed
    };
    let fi = usize::from(p.family() == IpFamily::V6);
    let mut last = ir::Verdict::nothing_on_path();
    for h in p.path().hooks() {
        let (iif, oif) = match h {
            Hook::Prerouting | Hook::Input => (dp.iif, 0),
            _ => (dp.iif, dp.oif),
        };
        let hc = &bp.hooks[hook_number(*h) as usize * 2 + fi];
        for id in &hc.chains[..hc.count as usize] {
            let c = &bp.chains[*id as usize];
            let (v, r) = simulate_chain(c, p, iif, oif);
            let rule = r.map(|i| c.rules[i].name.clone());
            if !last.fold(&c.table, &c.chain, c.audit, v, rule) {
                return last;
            }
        }
    }
    last
}
