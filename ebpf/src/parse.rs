//! Packet parsing common to tc (skb loads) and XDP (direct access with bounds checks):
//! Ethernet/L3 offsets, IPv4/IPv6 (extension headers, fragments), TCP/UDP/ICMP fields.

use crate::mem::zero;
use core::mem::size_of;

use aya_ebpf::helpers::generated::bpf_xdp_load_bytes;
use aya_ebpf::programs::{TcContext, XdpContext};
use peerwall_common::family;

// Packet access common to tc (skb loads) and XDP (direct access with bounds checks).

pub(crate) trait Source {
    fn read<T: Copy>(&self, off: usize) -> Option<T>;
}

impl Source for TcContext {
    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Option<T> {
        self.load::<T>(off).ok()
    }
}

/// Direct access to an skb's linear data (plain loads, no helper call), falling back to
/// `bpf_skb_load_bytes` for what lies beyond it (a non-linear skb).
pub(crate) struct TcDirect<'a> {
    pub(crate) ctx: &'a TcContext,
}

impl Source for TcDirect<'_> {
    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Option<T> {
        if off > 0x3ff {
            return self.ctx.read(off);
        }
        let data = self.ctx.data() as *const u8;
        let end = self.ctx.data_end() as *const u8;
        // The pointer first, then its end compared with the packet's: the form the verifier
        // tracks (it proves the range of the very register that is then read).
        // SAFETY: pointer arithmetic only; nothing is read unless in bounds.
        let start = unsafe { data.add(off & 0x3ff) };
        // SAFETY: as above.
        let stop = unsafe { start.add(size_of::<T>()) };
        if stop > end {
            return self.ctx.read(off);
        }
        // SAFETY: `start .. stop` lies within the skb's linear data.
        Some(unsafe { core::ptr::read_unaligned(start as *const T) })
    }
}

impl Source for XdpContext {
    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Option<T> {
        let mut v = core::mem::MaybeUninit::<T>::uninit();
        // SAFETY: the helper writes exactly size_of::<T>() bytes into `v` or fails.
        let rc = unsafe {
            bpf_xdp_load_bytes(
                self.ctx,
                off as u32,
                v.as_mut_ptr().cast(),
                size_of::<T>() as u32,
            )
        };
        if rc != 0 {
            return None;
        }
        // SAFETY: initialised by the successful helper call.
        Some(unsafe { v.assume_init() })
    }
}

pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_IPV6: u16 = 0x86DD;
pub(crate) const IPPROTO_TCP: u8 = 6;
pub(crate) const IPPROTO_UDP: u8 = 17;
pub(crate) const IPPROTO_ICMP: u8 = 1;
pub(crate) const IPPROTO_ICMPV6: u8 = 58;
pub(crate) const IPPROTO_SCTP: u8 = 132;

/// What the classifier needs of a packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Pkt {
    pub(crate) family: u8,
    pub(crate) proto: u8,
    /// Ports were read (TCP/UDP/SCTP, first fragment).
    pub(crate) has_ports: bool,
    pub(crate) tcp_flags: u8,
    /// SCTP: the first chunk's type (conntrack: which chunks may open a flow).
    pub(crate) sctp_chunk: u8,
    pub(crate) icmp_type: u8,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    /// ICMP echo id (host order).
    pub(crate) icmp_id: u16,
    pub(crate) src: [u8; 16],
    pub(crate) dst: [u8; 16],
    /// IP total length (bytes counted).
    pub(crate) len: u32,
    /// Offset of the layer-4 header from the IP header.
    pub(crate) l4: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parse {
    /// Not IP: not ours.
    NotIp,
    /// IP but unparseable: fail closed.
    Bad,
    /// Parsed into the output.
    Ok,
}

// size: see the doc comment: one inlined function for the verifier.
/// Parse the L3 and L4 headers at `l3` into `p`.
///
/// Long on purpose: one inlined function with straight-line bounds checks is what the verifier
/// follows cheaply; split into non-inlined helpers, every call would cost a verifier state
/// and pass packet pointers across calls, which the verifier tracks poorly.
#[inline(always)]
pub(crate) fn parse<S: Source>(s: &S, l3: usize, ethertype: u16, p: &mut Pkt) -> Parse {
    // Every field zero (`Pkt` is 4-aligned, 52 bytes): 13 word stores, not a byte-wise
    // `memset` (`mem.rs`).
    // SAFETY: `p` is a valid, aligned `Pkt`; all-zero is a valid one.
    unsafe { zero(p as *mut Pkt) };
    let first_frag;
    if ethertype == ETH_P_IP {
        // The fixed header in one load.
        let Some(h) = s.read::<[u8; 20]>(l3) else {
            return Parse::Bad;
        };
        let vihl = h[0];
        if vihl >> 4 != 4 {
            return Parse::Bad;
        }
        let ihl = ((vihl & 0x0f) as u32) * 4;
        if ihl < 20 {
            return Parse::Bad;
        }
        let tot = [h[2], h[3]];
        let frag = [h[6], h[7]];
        let proto = h[9];
        let src = [h[12], h[13], h[14], h[15]];
        let dst = [h[16], h[17], h[18], h[19]];
        p.family = family::V4;
        p.proto = proto;
        p.len = u16::from_be_bytes(tot) as u32;
        if p.len < ihl {
            return Parse::Bad;
        }
        p.src[..4].copy_from_slice(&src);
        p.dst[..4].copy_from_slice(&dst);
        p.l4 = ihl;
        first_frag = (u16::from_be_bytes(frag) & 0x1fff) == 0;
    } else if ethertype == ETH_P_IPV6 {
        // The fixed header before the addresses in one load.
        let Some(h) = s.read::<[u8; 8]>(l3) else {
            return Parse::Bad;
        };
        if h[0] >> 4 != 6 {
            return Parse::Bad;
        }
        let plen = [h[4], h[5]];
        let mut next = h[6];
        let Some(src) = s.read::<[u8; 16]>(l3 + 8) else {
            return Parse::Bad;
        };
        let Some(dst) = s.read::<[u8; 16]>(l3 + 24) else {
            return Parse::Bad;
        };
        p.family = family::V6;
        p.src = src;
        p.dst = dst;
        p.len = 40 + u16::from_be_bytes(plen) as u32;
        let mut off: u32 = 40;
        let mut ff = true;
        // Extension headers, bounded: hop-by-hop, routing, fragment, destination options, AH.
        let mut i = 0;
        while i < 6 {
            i += 1;
            match next {
                0 | 43 | 60 => {
                    let Some(h) = s.read::<[u8; 2]>(l3 + off as usize) else {
                        return Parse::Bad;
                    };
                    next = h[0];
                    off += (h[1] as u32 + 1) * 8;
                }
                51 => {
                    let Some(h) = s.read::<[u8; 2]>(l3 + off as usize) else {
                        return Parse::Bad;
                    };
                    next = h[0];
                    off += (h[1] as u32 + 2) * 4;
                }
                44 => {
                    let Some(h) = s.read::<[u8; 4]>(l3 + off as usize) else {
                        return Parse::Bad;
                    };
                    next = h[0];
                    if (u16::from_be_bytes([h[2], h[3]]) & 0xfff8) != 0 {
                        ff = false;
                    }
                    off += 8;
                }
                _ => break,
            }
            if off > 512 {
                return Parse::Bad;
            }
        }
        p.proto = next;
        p.l4 = off;
        first_frag = ff;
    } else {
        return Parse::NotIp;
    }
    if !first_frag {
        return Parse::Ok;
    }
    let l4 = l3 + p.l4 as usize;
    match p.proto {
        IPPROTO_TCP => {
            // Ports to flags in one load.
            let Some(t) = s.read::<[u8; 14]>(l4) else {
                return Parse::Bad;
            };
            p.sport = u16::from_be_bytes([t[0], t[1]]);
            p.dport = u16::from_be_bytes([t[2], t[3]]);
            p.has_ports = true;
            p.tcp_flags = t[13];
        }
        IPPROTO_UDP => {
            let Some(ports) = s.read::<[u8; 4]>(l4) else {
                return Parse::Bad;
            };
            p.sport = u16::from_be_bytes([ports[0], ports[1]]);
            p.dport = u16::from_be_bytes([ports[2], ports[3]]);
            p.has_ports = true;
        }
        IPPROTO_SCTP => {
            // Common header (ports, verification tag, checksum) and the first chunk's header.
            let Some(h) = s.read::<[u8; 16]>(l4) else {
                return Parse::Bad;
            };
            p.sport = u16::from_be_bytes([h[0], h[1]]);
            p.dport = u16::from_be_bytes([h[2], h[3]]);
            p.has_ports = true;
            p.sctp_chunk = h[12];
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let Some(h) = s.read::<[u8; 6]>(l4) else {
                return Parse::Bad;
            };
            p.icmp_type = h[0];
            p.icmp_id = u16::from_be_bytes([h[4], h[5]]);
        }
        _ => {}
    }
    Parse::Ok
}
