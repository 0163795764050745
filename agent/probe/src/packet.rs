//! Crafting probe packets and recognising them (and ICMP errors about them) on the wire. Pure.
//!
//! Every probe carries a 32-bit marker where it survives forwarding and is quoted in ICMP
//! errors: the TCP sequence number, the ICMP echo id/sequence, the first UDP payload bytes
//! (UDP is recognised in quotes by its ports), or for SCTP the INIT's initiate tag or the DATA
//! chunk's TSN (both at the same offset).

use std::net::IpAddr;

use etherparse::{IpNumber, PacketBuilder};

use peerwall_policy::ir::eval::proto;
use peerwall_policy::ir::Packet;

/// Ethertype of IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// Ethertype of IPv6.
pub const ETH_P_IPV6: u16 = 0x86DD;
const MAGIC: &[u8; 7] = b"pwprobe";

/// How to shape the probe for the conntrack state it must have.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// TCP without SYN (part of an established connection).
    pub tcp_ack: bool,
    /// Corrupt the UDP checksum (conntrack classifies the packet invalid).
    pub bad_checksum: bool,
    /// TCP with SYN and FIN together (conntrack classifies the packet invalid).
    pub tcp_syn_fin: bool,
    /// Send an ICMP port-unreachable quoting a UDP packet dst→src (conntrack: related).
    pub icmp_error: bool,
    /// Send an ICMP echo reply no request was seen for (conntrack: invalid).
    pub echo_reply: bool,
    /// SCTP: a DATA chunk tagged [`SCTP_VTAG`] instead of an INIT (part of an association;
    /// conntrack: established when it knows one with that tag, invalid when it knows none).
    pub sctp_data: bool,
}

/// Verification tag of SCTP DATA probes (what an established association's tag is set to).
/// Its bytes read the same both ways, so it is the same tag whichever byte order a tool uses.
pub const SCTP_VTAG: u32 = 0x7077_7770;

/// An SCTP packet (RFC 9260 §3): common header with a CRC32c checksum, then one chunk: an
/// INIT (tag 0, initiate tag `marker`) or, for `data`, a DATA chunk (tag [`SCTP_VTAG`], TSN
/// `marker`) carrying `payload`.
pub fn sctp(sport: u16, dport: u16, marker: u32, data: bool, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(48 + payload.len());
    b.extend_from_slice(&sport.to_be_bytes());
    b.extend_from_slice(&dport.to_be_bytes());
    b.extend_from_slice(&(if data { SCTP_VTAG } else { 0 }).to_be_bytes());
    b.extend_from_slice(&[0; 4]);
    if data {
        // DATA: type 0, flags B|E (one unfragmented message), length, TSN, stream 0, seq 0,
        // payload protocol 0, then the payload padded to 4 bytes.
        let len = 16 + payload.len();
        b.extend_from_slice(&[0, 0x03]);
        b.extend_from_slice(&(len as u16).to_be_bytes());
        b.extend_from_slice(&marker.to_be_bytes());
        b.extend_from_slice(&[0; 8]);
        b.extend_from_slice(payload);
        b.resize(b.len().next_multiple_of(4), 0);
    } else {
        // INIT: type 0x01, length 20, initiate tag, a_rwnd, 10 streams each way, initial TSN.
        b.extend_from_slice(&[1, 0, 0, 20]);
        b.extend_from_slice(&marker.to_be_bytes());
        b.extend_from_slice(&65535u32.to_be_bytes());
        b.extend_from_slice(&10u16.to_be_bytes());
        b.extend_from_slice(&10u16.to_be_bytes());
        b.extend_from_slice(&marker.to_be_bytes());
    }
    // The checksum goes out least significant byte first (RFC 9260 appendix A).
    let sum = crc32c::crc32c(&b);
    b[8..12].copy_from_slice(&sum.to_le_bytes());
    b
}

/// Ports of the UDP flow quoted by an `icmp_error` probe (dst→src direction).
pub fn related_inner_ports(marker: u32) -> (u16, u16) {
    (1024 + (marker % 60000) as u16, 53)
}

fn octets4(a: &IpAddr) -> [u8; 4] {
    match a {
        IpAddr::V4(v) => v.octets(),
        IpAddr::V6(_) => [0; 4],
    }
}

fn octets6(a: &IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V6(v) => v.octets(),
        IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
    }
}

fn ip_step(src: &IpAddr, dst: &IpAddr) -> etherparse::PacketBuilderStep<etherparse::IpHeaders> {
    match src {
        IpAddr::V4(_) => PacketBuilder::ipv4(octets4(src), octets4(dst), 64),
        IpAddr::V6(_) => PacketBuilder::ipv6(octets6(src), octets6(dst), 64),
    }
}

/// Build the IP packet (no link header) for `pkt`.
pub fn build_ip(pkt: &Packet, marker: u32, shape: Shape) -> Vec<u8> {
    let v6 = pkt.src.is_ipv6();
    let mut out = Vec::new();
    let step = ip_step(&pkt.src, &pkt.dst);
    let mut payload = MAGIC.to_vec();
    payload.extend_from_slice(&marker.to_be_bytes());
    // Writing into a Vec cannot fail for well-formed headers; an error leaves `out` short,
    // which the caller's send then reports.
    let _ = match pkt.proto {
        proto::TCP => {
            let b = step.tcp(pkt.sport, pkt.dport, marker, 64240);
            let b = match (shape.tcp_ack, shape.tcp_syn_fin) {
                (true, _) => b.ack(1),
                (false, true) => b.syn().fin(),
                (false, false) => b.syn(),
            };
            b.write(&mut out, &[])
        }
        proto::UDP => step.udp(pkt.sport, pkt.dport).write(&mut out, &payload),
        proto::SCTP => step.write(
            &mut out,
            IpNumber(proto::SCTP),
            &sctp(pkt.sport, pkt.dport, marker, shape.sctp_data, &payload),
        ),
        proto::ICMP | proto::ICMPV6 if shape.icmp_error => {
            // The quoted packet went dst→src; conntrack finds its flow and marks this related.
            let (qs, qd) = related_inner_ports(marker);
            let mut inner = Vec::new();
            let _ = ip_step(&pkt.dst, &pkt.src)
                .udp(qs, qd)
                .write(&mut inner, &payload);
            if v6 {
                step.icmpv6_raw(1, 4, [0; 4]).write(&mut out, &inner)
            } else {
                step.icmpv4_raw(3, 3, [0; 4]).write(&mut out, &inner)
            }
        }
        proto::ICMP if !v6 && shape.echo_reply => step
            .icmpv4_echo_reply((marker >> 16) as u16, marker as u16)
            .write(&mut out, &payload),
        proto::ICMPV6 if v6 && shape.echo_reply => step
            .icmpv6_echo_reply((marker >> 16) as u16, marker as u16)
            .write(&mut out, &payload),
        proto::ICMP if !v6 => step
            .icmpv4_echo_request((marker >> 16) as u16, marker as u16)
            .write(&mut out, &payload),
        proto::ICMPV6 if v6 => step
            .icmpv6_echo_request((marker >> 16) as u16, marker as u16)
            .write(&mut out, &payload),
        other => step.write(&mut out, IpNumber(other), &payload),
    };
    if shape.bad_checksum {
        let l4 = if v6 { 40 } else { 20 };
        let off = match pkt.proto {
            proto::TCP => Some(l4 + 16),
            proto::UDP => Some(l4 + 6),
            _ => None,
        };
        if let Some(o) = off {
            if let Some(b) = out.get_mut(o) {
                *b ^= 0x5a;
            }
        }
    }
    out
}

/// Prefix an Ethernet header.
pub fn ethernet(src_mac: [u8; 6], dst_mac: [u8; 6], ip: &[u8]) -> Vec<u8> {
    let ethertype = match ip.first().map(|b| b >> 4) {
        Some(6) => ETH_P_IPV6,
        _ => ETH_P_IP,
    };
    let mut f = Vec::with_capacity(14 + ip.len());
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(ip);
    f
}

/// A parsed IP packet: addresses, protocol and layer-4 bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpView<'a> {
    /// Source.
    pub src: IpAddr,
    /// Destination.
    pub dst: IpAddr,
    /// Layer-4 protocol.
    pub proto: u8,
    /// Layer-4 header and payload.
    pub l4: &'a [u8],
}

/// Parse an IP packet (IPv6 without extension headers: probes carry none).
pub fn parse_ip(b: &[u8]) -> Option<IpView<'_>> {
    match b.first()? >> 4 {
        4 => {
            let ihl = usize::from(b[0] & 0x0f) * 4;
            let src: [u8; 4] = b.get(12..16)?.try_into().ok()?;
            let dst: [u8; 4] = b.get(16..20)?.try_into().ok()?;
            Some(IpView {
                src: IpAddr::from(src),
                dst: IpAddr::from(dst),
                proto: *b.get(9)?,
                l4: b.get(ihl..)?,
            })
        }
        6 => {
            let src: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            let dst: [u8; 16] = b.get(24..40)?.try_into().ok()?;
            Some(IpView {
                src: IpAddr::from(src),
                dst: IpAddr::from(dst),
                proto: *b.get(6)?,
                l4: b.get(40..)?,
            })
        }
        _ => None,
    }
}

/// The IP packet inside an Ethernet frame.
pub fn strip_ethernet(frame: &[u8]) -> Option<&[u8]> {
    let et = u16::from_be_bytes(frame.get(12..14)?.try_into().ok()?);
    (et == ETH_P_IP || et == ETH_P_IPV6).then(|| &frame[14..])
}

/// Whether layer-4 bytes carry the marker for this protocol.
pub fn l4_has_marker(proto_num: u8, l4: &[u8], pkt: &Packet, marker: u32, shape: Shape) -> bool {
    let be16 = |o: usize| l4.get(o..o + 2).map(|s| u16::from_be_bytes([s[0], s[1]]));
    let be32 = |o: usize| {
        l4.get(o..o + 4)
            .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    };
    match proto_num {
        proto::TCP => {
            be16(0) == Some(pkt.sport) && be16(2) == Some(pkt.dport) && be32(4) == Some(marker)
        }
        proto::UDP => {
            be16(0) == Some(pkt.sport)
                && be16(2) == Some(pkt.dport)
                && l4.get(8..15) == Some(&MAGIC[..])
                && be32(15) == Some(marker)
        }
        proto::SCTP => {
            be16(0) == Some(pkt.sport) && be16(2) == Some(pkt.dport) && be32(16) == Some(marker)
        }
        proto::ICMP | proto::ICMPV6 if shape.icmp_error => {
            // Our own ICMP error: its quote holds the inner UDP ports.
            let inner = l4.get(8..).and_then(parse_ip);
            let (qs, qd) = related_inner_ports(marker);
            inner.is_some_and(|i| {
                i.l4.get(0..2) == Some(&qs.to_be_bytes()[..])
                    && i.l4.get(2..4) == Some(&qd.to_be_bytes()[..])
            })
        }
        proto::ICMP | proto::ICMPV6 => {
            be16(4) == Some((marker >> 16) as u16) && be16(6) == Some(marker as u16)
        }
        _ => l4.get(0..7) == Some(&MAGIC[..]) && be32(7) == Some(marker),
    }
}

/// Whether an IP packet is the probe (possibly forwarded: TTL and checksums may differ).
pub fn is_probe(ip: &[u8], pkt: &Packet, marker: u32, shape: Shape) -> bool {
    parse_ip(ip).is_some_and(|v| {
        v.src == pkt.src
            && v.dst == pkt.dst
            && v.proto == pkt.proto
            && l4_has_marker(v.proto, v.l4, pkt, marker, shape)
    })
}

/// Whether an IP packet is an ICMP/ICMPv6 destination-unreachable quoting the probe.
pub fn is_unreachable_for(ip: &[u8], pkt: &Packet, marker: u32) -> bool {
    let Some(v) = parse_ip(ip) else {
        return false;
    };
    let unreach = match v.proto {
        proto::ICMP => v.l4.first() == Some(&3),
        proto::ICMPV6 => v.l4.first() == Some(&1),
        _ => false,
    };
    if !unreach || v.dst != pkt.src {
        return false;
    }
    let Some(q) = v.l4.get(8..).and_then(parse_ip) else {
        return false;
    };
    if q.src != pkt.src || q.dst != pkt.dst || q.proto != pkt.proto {
        return false;
    }
    // Quotes hold at least the first 8 layer-4 bytes.
    let be16 = |o: usize| q.l4.get(o..o + 2).map(|s| u16::from_be_bytes([s[0], s[1]]));
    match q.proto {
        proto::TCP => {
            be16(0) == Some(pkt.sport)
                && be16(2) == Some(pkt.dport)
                && q.l4.get(4..8) == Some(&marker.to_be_bytes()[..])
        }
        proto::UDP | proto::SCTP => be16(0) == Some(pkt.sport) && be16(2) == Some(pkt.dport),
        proto::ICMP | proto::ICMPV6 => {
            be16(4) == Some((marker >> 16) as u16) && be16(6) == Some(marker as u16)
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::ir::CtState;

    fn pkt(proto: u8, src: &str, dst: &str) -> Packet {
        Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            sport: 40000,
            dport: 80,
            iif: Some("a".into()),
            oif: Some("b".into()),
            ct_state: CtState::New,
        }
    }

    #[test]
    fn probes_recognise_themselves() {
        for (p, s, d) in [
            (proto::TCP, "10.0.0.1", "10.0.0.2"),
            (proto::UDP, "10.0.0.1", "10.0.0.2"),
            (proto::ICMP, "10.0.0.1", "10.0.0.2"),
            (proto::TCP, "fd00::1", "fd00::2"),
            (proto::UDP, "fd00::1", "fd00::2"),
            (proto::ICMPV6, "fd00::1", "fd00::2"),
            (proto::SCTP, "10.0.0.1", "10.0.0.2"),
            (proto::SCTP, "fd00::1", "fd00::2"),
            (47, "10.0.0.1", "10.0.0.2"),
        ] {
            let k = pkt(p, s, d);
            let ip = build_ip(&k, 0xdead_beef, Shape::default());
            assert!(is_probe(&ip, &k, 0xdead_beef, Shape::default()), "{p} {s}");
            assert!(!is_probe(&ip, &k, 0xdead_bee0, Shape::default()), "{p} {s}");
            let f = ethernet([2; 6], [4; 6], &ip);
            assert_eq!(strip_ethernet(&f), Some(&ip[..]));
        }
    }

    #[test]
    fn sctp_checksum_is_crc32c_sent_least_significant_byte_first() {
        // RFC 3720 B.4: 32 zero bytes have CRC32c 0x8a9136aa, transmitted aa 36 91 8a.
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        for data in [false, true] {
            let mut b = sctp(40000, 80, 0x1234_5679, data, b"pwprobe");
            assert_eq!(b.len() % 4, 0);
            let sent: [u8; 4] = b[8..12].try_into().unwrap();
            b[8..12].fill(0);
            assert_eq!(sent, crc32c::crc32c(&b).to_le_bytes());
            // INIT: tag 0 and chunk type 1; DATA: the association's tag and type 0.
            assert_eq!(b[4..8], if data { SCTP_VTAG } else { 0 }.to_be_bytes());
            assert_eq!(b[12], u8::from(!data));
            assert_eq!(b[16..20], 0x1234_5679u32.to_be_bytes());
        }
    }

    #[test]
    fn icmp_error_probe_is_recognised() {
        let k = pkt(proto::ICMP, "10.0.0.1", "10.0.0.2");
        let shape = Shape {
            icmp_error: true,
            ..Shape::default()
        };
        let ip = build_ip(&k, 77, shape);
        assert!(is_probe(&ip, &k, 77, shape));
        assert!(!is_probe(&ip, &k, 78, shape));
    }

    #[test]
    fn unreachable_quote_is_recognised() {
        let k = pkt(proto::UDP, "10.0.0.1", "10.0.0.2");
        let probe = build_ip(&k, 5, Shape::default());
        let mut out = Vec::new();
        PacketBuilder::ipv4([10, 0, 0, 9], [10, 0, 0, 1], 64)
            .icmpv4_raw(3, 3, [0; 4])
            .write(&mut out, &probe[..28])
            .unwrap();
        assert!(is_unreachable_for(&out, &k, 5));
        let other = pkt(proto::UDP, "10.0.0.3", "10.0.0.2");
        assert!(!is_unreachable_for(&out, &other, 5));
    }
}
