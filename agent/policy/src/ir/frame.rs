//! How the eBPF datapath reads a raw Ethernet frame, as a specification: the oracle the
//! datapath fuzzer holds BPF_PROG_TEST_RUN to (`tests/fuzz`, target `datapath`). Pure: bytes
//! in, a [`FrameView`] out.
//!
//! The rules, which `docs/reliability.md` documents for operators:
//! - **Not IP** (the EtherType is neither IPv4 nor IPv6, VLAN tags included): not classified,
//!   passed; another layer's business.
//! - **Malformed IP** (a header shorter than its fixed part, a wrong version, an IPv4 header
//!   length under 20 or above the total length, an IPv6 extension header beyond the frame or
//!   past 512 bytes, a TCP, UDP, SCTP or ICMP header cut short in a first fragment, SCTP
//!   without its first chunk's header): dropped, fail closed, with no rule and no counter.
//! - **IPv6 extension headers**: hop-by-hop, routing, destination options, fragment and AH are
//!   walked, at most six; after six the next header number is taken as the protocol.
//! - **Fragments**: classified as they come (a gateway's tc hook sees them before any
//!   reassembly). A later fragment (offset ≠ 0) has no transport header: TCP, UDP and SCTP fragments
//!   match no port, which the reference evaluator cannot express, so the fuzzer only checks
//!   that they are classified; for ICMP the type reads as 0.
//! - **Conntrack**, for a packet of no known flow: TCP with a flag combination conntrack
//!   refuses (`tcp_valid_flags`) or that cannot open a connection (anything but a SYN: no
//!   connection is picked up mid-stream, as conntrack with `nf_conntrack_tcp_loose=0`, which
//!   peerwall sets, so that no segment of a connection ended or forgotten starts it again in
//!   the other direction), ICMP errors (whose quoted flow is unknown) and ICMP replies
//!   (echo, timestamp, information, address mask) are `invalid`, as is SCTP whose first chunk
//!   cannot open an association (DATA, SACK, ABORT, COOKIE ACK, SHUTDOWN COMPLETE, anything
//!   unknown: conntrack's `sctp_new` refuses them); everything else is `new`.
//!   ICMP types are read per protocol number, whatever the IP version.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::eval::proto;
use super::{CtState, Packet};

/// EtherType of IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;
/// Ethernet header length.
pub const ETH_HLEN: usize = 14;
/// Most IPv6 extension headers walked.
pub const MAX_EXT_HEADERS: usize = 6;
/// Furthest offset of the layer-4 header from the IPv6 header that is read.
pub const MAX_L4_OFFSET: usize = 512;

/// What the datapath makes of a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameView {
    /// Not IPv4 or IPv6: passed, not classified.
    NotIp,
    /// IP that cannot be read: dropped, no rule.
    Malformed(&'static str),
    /// A later fragment of TCP, UDP or SCTP: classified without ports.
    PortlessFragment,
    /// The packet the rules see (interfaces as given), conntrack state for no known flow.
    Packet(Packet),
}

/// Header fields of an IP packet, before conntrack.
struct Fields {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    l4: usize,
    first_fragment: bool,
}

fn at<const N: usize>(b: &[u8], off: usize) -> Option<[u8; N]> {
    b.get(off..off.checked_add(N)?)?.try_into().ok()
}

fn ipv4(ip: &[u8]) -> Result<Fields, &'static str> {
    let h = at::<20>(ip, 0).ok_or("IPv4 header cut short")?;
    if h[0] >> 4 != 4 {
        return Err("IP version is not 4");
    }
    let ihl = usize::from(h[0] & 0x0f) * 4;
    if ihl < 20 {
        return Err("IPv4 header length under 20");
    }
    if usize::from(u16::from_be_bytes([h[2], h[3]])) < ihl {
        return Err("IPv4 total length under the header length");
    }
    Ok(Fields {
        src: IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15])),
        dst: IpAddr::V4(Ipv4Addr::new(h[16], h[17], h[18], h[19])),
        proto: h[9],
        l4: ihl,
        first_fragment: u16::from_be_bytes([h[6], h[7]]) & 0x1fff == 0,
    })
}

fn ipv6(ip: &[u8]) -> Result<Fields, &'static str> {
    let h = at::<8>(ip, 0).ok_or("IPv6 header cut short")?;
    if h[0] >> 4 != 6 {
        return Err("IP version is not 6");
    }
    let src = at::<16>(ip, 8).ok_or("IPv6 header cut short")?;
    let dst = at::<16>(ip, 24).ok_or("IPv6 header cut short")?;
    let (mut next, mut off, mut first_fragment) = (h[6], 40usize, true);
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            0 | 43 | 60 => {
                let e = at::<2>(ip, off).ok_or("IPv6 extension header cut short")?;
                next = e[0];
                off += (usize::from(e[1]) + 1) * 8;
            }
            51 => {
                let e = at::<2>(ip, off).ok_or("IPv6 extension header cut short")?;
                next = e[0];
                off += (usize::from(e[1]) + 2) * 4;
            }
            44 => {
                let e = at::<4>(ip, off).ok_or("IPv6 fragment header cut short")?;
                next = e[0];
                if u16::from_be_bytes([e[2], e[3]]) & 0xfff8 != 0 {
                    first_fragment = false;
                }
                off += 8;
            }
            _ => break,
        }
        if off > MAX_L4_OFFSET {
            return Err("IPv6 extension headers past 512 bytes");
        }
    }
    Ok(Fields {
        src: IpAddr::V6(Ipv6Addr::from(src)),
        dst: IpAddr::V6(Ipv6Addr::from(dst)),
        proto: next,
        l4: off,
        first_fragment,
    })
}

/// Flag combinations conntrack accepts (FIN, SYN, RST, ACK; URG and PSH aside).
pub fn tcp_flags_valid(flags: u8) -> bool {
    matches!(flags & 0x17, 0x02 | 0x12 | 0x04 | 0x14 | 0x11 | 0x10)
}

/// Whether a TCP segment of no known connection opens one: a SYN (not with ACK, RST or FIN;
/// URG, PSH, ECE and CWR aside), the only segment conntrack's `tcp_new` starts an entry with
/// when it picks nothing up mid-stream (`nf_conntrack_tcp_loose=0`).
pub fn tcp_opens(flags: u8) -> bool {
    flags & 0x17 == 0x02
}

/// Conntrack state of an ICMP packet of type `t` (ICMP or ICMPv6 by protocol number) when no
/// flow is known: errors quote an unknown flow, replies answer nothing.
fn icmp_state(proto_num: u8, t: u8) -> CtState {
    let (error, reply) = if proto_num == proto::ICMP {
        (
            matches!(t, 3 | 4 | 5 | 11 | 12),
            matches!(t, 0 | 14 | 16 | 18),
        )
    } else {
        (matches!(t, 1..=4), t == 129)
    };
    if error || reply {
        CtState::Invalid
    } else {
        CtState::New
    }
}

/// Whether an SCTP packet whose first chunk has type `chunk` can start a conntrack entry:
/// INIT, INIT ACK, HEARTBEAT, HEARTBEAT ACK, SHUTDOWN, SHUTDOWN ACK, ERROR, COOKIE ECHO
/// (the chunks conntrack's state table moves out of NONE with; RFC 9260 §3.2 numbers).
pub fn sctp_chunk_opens(chunk: u8) -> bool {
    matches!(chunk, 1 | 2 | 4 | 5 | 7 | 8 | 9 | 10)
}

/// Read `frame` (Ethernet) as the datapath does, for a packet that came in on `iif` and
/// leaves by `oif`.
pub fn read_frame(frame: &[u8], iif: Option<&str>, oif: Option<&str>) -> FrameView {
    let Some(et) = at::<2>(frame, 12) else {
        return FrameView::NotIp;
    };
    let ip = &frame[ETH_HLEN..];
    let fields = match u16::from_be_bytes(et) {
        ETH_P_IP => ipv4(ip),
        ETH_P_IPV6 => ipv6(ip),
        _ => return FrameView::NotIp,
    };
    let f = match fields {
        Ok(f) => f,
        Err(why) => return FrameView::Malformed(why),
    };
    let (mut sport, mut dport, mut ct_state) = (0, 0, CtState::New);
    let is_icmp = f.proto == proto::ICMP || f.proto == proto::ICMPV6;
    if !f.first_fragment {
        if proto::carries_ports(f.proto) {
            return FrameView::PortlessFragment;
        }
        if is_icmp {
            ct_state = icmp_state(f.proto, 0);
        }
    } else {
        match f.proto {
            proto::TCP => {
                let Some(t) = at::<14>(ip, f.l4) else {
                    return FrameView::Malformed("TCP header cut short");
                };
                sport = u16::from_be_bytes([t[0], t[1]]);
                dport = u16::from_be_bytes([t[2], t[3]]);
                if !tcp_flags_valid(t[13]) || !tcp_opens(t[13]) {
                    ct_state = CtState::Invalid;
                }
            }
            proto::UDP => {
                let Some(u) = at::<4>(ip, f.l4) else {
                    return FrameView::Malformed("UDP header cut short");
                };
                sport = u16::from_be_bytes([u[0], u[1]]);
                dport = u16::from_be_bytes([u[2], u[3]]);
            }
            proto::SCTP => {
                // Common header (ports, tag, checksum), then the first chunk's type.
                let Some(h) = at::<16>(ip, f.l4) else {
                    return FrameView::Malformed("SCTP header cut short");
                };
                sport = u16::from_be_bytes([h[0], h[1]]);
                dport = u16::from_be_bytes([h[2], h[3]]);
                if !sctp_chunk_opens(h[12]) {
                    ct_state = CtState::Invalid;
                }
            }
            p if is_icmp => {
                let Some(h) = at::<6>(ip, f.l4) else {
                    return FrameView::Malformed("ICMP header cut short");
                };
                ct_state = icmp_state(p, h[0]);
            }
            _ => {}
        }
    }
    FrameView::Packet(Packet {
        src: f.src,
        dst: f.dst,
        proto: f.proto,
        sport,
        dport,
        iif: iif.map(str::to_string),
        oif: oif.map(str::to_string),
        ct_state,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eth(et: u16, ip: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&et.to_be_bytes());
        f.extend_from_slice(ip);
        f
    }

    fn v4(proto_num: u8, frag: u16, l4: &[u8]) -> Vec<u8> {
        let mut h = vec![
            0x45, 0, 0, 0, 0, 0, 0, 0, 64, proto_num, 0, 0, 10, 0, 0, 1, 10, 1, 0, 2,
        ];
        let tot = (20 + l4.len()) as u16;
        h[2..4].copy_from_slice(&tot.to_be_bytes());
        h[6..8].copy_from_slice(&frag.to_be_bytes());
        h.extend_from_slice(l4);
        eth(ETH_P_IP, &h)
    }

    fn v6(next: u8, ext: &[u8], l4: &[u8]) -> Vec<u8> {
        let mut h = vec![0x60, 0, 0, 0, 0, 0, next, 64];
        let plen = (ext.len() + l4.len()) as u16;
        h[4..6].copy_from_slice(&plen.to_be_bytes());
        h.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        h.extend_from_slice(&[0xfd, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        h.extend_from_slice(ext);
        h.extend_from_slice(l4);
        eth(ETH_P_IPV6, &h)
    }

    fn packet(v: FrameView) -> Packet {
        match v {
            FrameView::Packet(p) => p,
            other => panic!("not a packet: {other:?}"),
        }
    }

    const SYN: [u8; 20] = [
        0x9c, 0x40, 0, 80, 0, 0, 0, 0, 0, 0, 0, 0, 0x50, 0x02, 0, 0, 0, 0, 0, 0,
    ];

    #[test]
    fn a_tcp_syn_is_new_with_its_ports() {
        let p = packet(read_frame(&v4(6, 0, &SYN), Some("a"), Some("b")));
        assert_eq!((p.proto, p.sport, p.dport), (6, 40000, 80));
        assert_eq!(p.ct_state, CtState::New);
        assert_eq!(p.iif.as_deref(), Some("a"));
        assert_eq!(p.dst, "10.1.0.2".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn sctp_reads_ports_and_only_opening_chunks_are_new() {
        // Ports 40000 → 80, tag 0, checksum, then an INIT chunk header.
        let mut h = [0u8; 16];
        h[0..2].copy_from_slice(&40000u16.to_be_bytes());
        h[2..4].copy_from_slice(&80u16.to_be_bytes());
        h[12] = 1;
        let p = packet(read_frame(&v4(132, 0, &h), None, None));
        assert_eq!((p.sport, p.dport, p.ct_state), (40000, 80, CtState::New));
        h[12] = 0; // DATA outside any association
        let p = packet(read_frame(&v4(132, 0, &h), None, None));
        assert_eq!(p.ct_state, CtState::Invalid);
        assert_eq!(
            read_frame(&v4(132, 0, &h[..12]), None, None),
            FrameView::Malformed("SCTP header cut short")
        );
        assert_eq!(
            read_frame(&v4(132, 0x0001, &h), None, None),
            FrameView::PortlessFragment
        );
    }

    #[test]
    fn bad_tcp_flags_are_invalid() {
        let mut t = SYN;
        t[13] = 0x03; // SYN+FIN
        assert_eq!(
            packet(read_frame(&v4(6, 0, &t), None, None)).ct_state,
            CtState::Invalid
        );
    }

    #[test]
    fn no_tcp_connection_is_picked_up_mid_stream() {
        let state = |flags: u8| {
            let mut t = SYN;
            t[13] = flags;
            packet(read_frame(&v4(6, 0, &t), None, None)).ct_state
        };
        // A SYN opens, with ECN's bits or PSH too.
        for f in [0x02, 0xc2, 0x0a] {
            assert_eq!(state(f), CtState::New, "flags {f:#x}");
        }
        // An ACK, a data segment, a SYN-ACK, a FIN-ACK or an RST of no known connection
        // (conntrack with tcp_loose=0: `tcp_new` refuses all but a SYN).
        for f in [0x10, 0x18, 0x12, 0x11, 0x04, 0x14] {
            assert_eq!(state(f), CtState::Invalid, "flags {f:#x}");
        }
    }

    #[test]
    fn cut_short_headers_are_malformed_and_not_ip_is_passed() {
        assert!(matches!(
            read_frame(&v4(6, 0, &SYN[..10]), None, None),
            FrameView::Malformed(_)
        ));
        assert!(matches!(
            read_frame(&v4(6, 0, &SYN)[..30], None, None),
            FrameView::Malformed(_)
        ));
        assert_eq!(
            read_frame(&eth(0x8100, &[0; 40]), None, None),
            FrameView::NotIp
        );
        assert_eq!(read_frame(&[0; 10], None, None), FrameView::NotIp);
        let mut bad_len = v4(17, 0, &[0; 8]);
        bad_len[14] = 0x44; // IHL 16
        assert!(matches!(
            read_frame(&bad_len, None, None),
            FrameView::Malformed(_)
        ));
    }

    #[test]
    fn later_fragments_have_no_ports() {
        assert_eq!(
            read_frame(&v4(6, 0x0010, &SYN), None, None),
            FrameView::PortlessFragment
        );
        // More-fragments with offset 0 is a first fragment: ports are read.
        assert_eq!(
            packet(read_frame(&v4(6, 0x2000, &SYN), None, None)).dport,
            80
        );
        // ICMPv4 later fragment: type reads as 0 (echo reply), which answers nothing.
        assert_eq!(
            packet(read_frame(&v4(1, 0x0010, &[8, 0, 0, 0, 0, 1]), None, None)).ct_state,
            CtState::Invalid
        );
    }

    #[test]
    fn ipv6_extension_headers_are_walked_up_to_six() {
        // hop-by-hop (8 bytes) then UDP.
        let hbh = [17, 0, 0, 0, 0, 0, 0, 0];
        let p = packet(read_frame(
            &v6(0, &hbh, &[0, 53, 0, 54, 0, 8, 0, 0]),
            None,
            None,
        ));
        assert_eq!((p.proto, p.sport, p.dport), (17, 53, 54));
        // Seven destination-options headers: the seventh is taken as the protocol.
        let mut ext = vec![];
        for _ in 0..7 {
            ext.extend_from_slice(&[60, 0, 0, 0, 0, 0, 0, 0]);
        }
        assert_eq!(packet(read_frame(&v6(60, &ext, &[]), None, None)).proto, 60);
        // A fragment header with an offset: a later fragment.
        let frag = [6, 0, 0, 0x08, 0, 0, 0, 1];
        assert_eq!(
            read_frame(&v6(44, &frag, &SYN), None, None),
            FrameView::PortlessFragment
        );
        // An extension header past the frame.
        assert!(matches!(
            read_frame(&v6(0, &[], &[]), None, None),
            FrameView::Malformed(_)
        ));
    }

    #[test]
    fn icmp_errors_and_replies_of_no_flow_are_invalid() {
        let s = |t: u8| packet(read_frame(&v4(1, 0, &[t, 0, 0, 0, 0, 1]), None, None)).ct_state;
        assert_eq!(s(8), CtState::New);
        assert_eq!(s(0), CtState::Invalid);
        assert_eq!(s(3), CtState::Invalid);
        assert_eq!(s(13), CtState::New);
        let s6 = |t: u8| packet(read_frame(&v6(58, &[], &[t, 0, 0, 0, 0, 1]), None, None)).ct_state;
        assert_eq!(s6(128), CtState::New);
        assert_eq!(s6(129), CtState::Invalid);
        assert_eq!(s6(1), CtState::Invalid);
        assert_eq!(s6(135), CtState::New);
    }
}
