//! Reject: an ICMP/ICMPv6 port-unreachable built in tc from the offending packet and
//! redirected back out of the interface it came in on.

use aya_ebpf::bindings::TC_ACT_SHOT;
use aya_ebpf::helpers::generated::{
    bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes, bpf_skb_store_bytes,
};
use aya_ebpf::programs::TcContext;
use peerwall_common::family;

use crate::flow::icmp_is_error;
use crate::maps::{IFACES, REJECT_BUF, WORK};
use crate::parse::{IPPROTO_ICMP, IPPROTO_ICMPV6};

pub(crate) const TC_ACT_REDIRECT: i32 = 7;

/// One's-complement sum of big-endian 16-bit words.
#[inline(always)]
pub(crate) fn csum_add(mut sum: u32, b: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < b.len() {
        sum += u16::from_be_bytes([b[i], b[i + 1]]) as u32;
        i += 2;
    }
    sum
}

#[inline(always)]
pub(crate) fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// Copy the start of the packet's IP header into `dst` (its length is a constant at each call).
#[inline(always)]
pub(crate) fn load_quote(ctx: &TcContext, l2: usize, dst: &mut [u8]) -> bool {
    // SAFETY: the helper writes dst.len() bytes into `dst`.
    unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            l2 as u32,
            dst.as_mut_ptr().cast(),
            dst.len() as u32,
        ) == 0
    }
}

/// Turn the packet into an ICMP (ICMPv6) port-unreachable quoting it and send it back out of
/// the interface it came in on, as nftables' `reject` does. Packets the kernel would not answer
/// (ICMP errors, non-first fragments, IPv4 with options) are dropped silently. A global
/// function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn reject(skb: *mut aya_ebpf::bindings::__sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(w) = WORK.get(0) else {
        return TC_ACT_SHOT;
    };
    let p = &w.p;
    let is_icmp = p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6;
    if (is_icmp && icmp_is_error(p)) || (!p.has_ports && !is_icmp && p.l4 == 0) {
        return TC_ACT_SHOT;
    }
    // SAFETY: the skb pointer is the program's context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain data.
    let l2 = match unsafe { IFACES.get(&ifindex) } {
        Some(i) => i.l2_len as usize,
        None => 14,
    } & 0xff;
    if l2 == 14 {
        let Ok(macs) = ctx.load::<[u8; 12]>(0) else {
            return TC_ACT_SHOT;
        };
        let mut swapped = [0u8; 12];
        swapped[..6].copy_from_slice(&macs[6..12]);
        swapped[6..].copy_from_slice(&macs[..6]);
        if ctx.store(0, &swapped, 0).is_err() {
            return TC_ACT_SHOT;
        }
    } else if l2 != 0 {
        return TC_ACT_SHOT;
    }
    let Some(bp) = REJECT_BUF.get_ptr_mut(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: per-CPU buffer of a successful lookup.
    let m = unsafe { &mut *bp };
    *m = [0u8; 96];
    let len = if p.family == family::V4 {
        // IPv4 header (20) + ICMP header (8) + quote: the IP header and 8 bytes of layer 4.
        if p.l4 != 20 || !load_quote(ctx, l2, &mut m[28..56]) {
            return TC_ACT_SHOT;
        }
        m[0] = 0x45;
        m[1] = 0xc0;
        m[2..4].copy_from_slice(&56u16.to_be_bytes());
        m[8] = 64;
        m[9] = IPPROTO_ICMP;
        // From the address the packet was sent to, back to its sender.
        m[12..16].copy_from_slice(&p.dst[..4]);
        m[16..20].copy_from_slice(&p.src[..4]);
        let ipsum = csum_fold(csum_add(0, &m[..20]));
        m[10..12].copy_from_slice(&ipsum.to_be_bytes());
        m[20] = 3; // destination unreachable
        m[21] = 3; // port unreachable
        let icsum = csum_fold(csum_add(0, &m[20..56]));
        m[22..24].copy_from_slice(&icsum.to_be_bytes());
        56
    } else {
        // IPv6 header (40) + ICMPv6 header (8) + quote: the IPv6 header and 8 bytes.
        if !load_quote(ctx, l2, &mut m[48..96]) {
            return TC_ACT_SHOT;
        }
        m[0] = 0x60;
        m[4..6].copy_from_slice(&56u16.to_be_bytes());
        m[6] = IPPROTO_ICMPV6;
        m[7] = 64;
        m[8..24].copy_from_slice(&p.dst);
        m[24..40].copy_from_slice(&p.src);
        m[40] = 1; // destination unreachable
        m[41] = 4; // port unreachable
                   // Pseudo-header: addresses, upper-layer length, next header.
        let mut sum = csum_add(0, &m[8..40]);
        sum += 56 + IPPROTO_ICMPV6 as u32;
        sum = csum_add(sum, &m[40..96]);
        let c = csum_fold(sum);
        m[42..44].copy_from_slice(&c.to_be_bytes());
        96
    };
    // Shrink the packet to the answer and write it over the original headers.
    // SAFETY: resizing the skb this program owns; the buffer holds `len` (<= 96) bytes.
    unsafe {
        if bpf_skb_change_tail(ctx.skb.skb, (l2 + len) as u32, 0) != 0
            || bpf_skb_store_bytes(
                ctx.skb.skb.cast(),
                l2 as u32,
                m.as_ptr().cast(),
                len as u32,
                0,
            ) != 0
        {
            return TC_ACT_SHOT;
        }
    }
    // SAFETY: plain helper call; the packet leaves through the interface it arrived on.
    unsafe { bpf_redirect(ifindex, 0) };
    TC_ACT_REDIRECT
}
