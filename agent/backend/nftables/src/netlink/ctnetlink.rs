//! ctnetlink messages, as bytes: the dump of every tracked connection of a namespace (both
//! families in one walk of the kernel's table) and the deletion of connections by their
//! original tuple. Pure: bytes in, bytes out (`include/uapi/linux/netfilter/nfnetlink_conntrack.h`).
//!
//! Why not the `conntrack` tool: `conntrack -L -f ipv4` and `-f ipv6` walk the kernel's whole
//! connection hash (shared by every namespace: 262 144 buckets on a 24 GiB host) once each, and
//! `conntrack -D` dumps the table again *for every connection it deletes*, each time as a new
//! process: ending 1000 connections was 1000 walks and 1000 processes. Here a listing is one
//! walk and a deletion is one hash lookup in the kernel, all on one socket.
//!
//! Byte order: netlink and attribute headers in host order; addresses and ports in network
//! order, as on the wire.

use std::net::IpAddr;

use peerwall_backend::Flow;
use peerwall_policy::ir::eval::proto;

use super::message::{attrs, Writer, NLM_F_ACK, NLM_F_REQUEST};

/// `NFNL_SUBSYS_CTNETLINK`.
const SUBSYS_CTNETLINK: u16 = 1;
/// `IPCTNL_MSG_CT_NEW` (what a dump answers with), `_GET`, `_DELETE`.
const MSG_CT_NEW: u16 = 0;
const MSG_CT_GET: u16 = 1;
const MSG_CT_DELETE: u16 = 2;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`).
const NLM_F_DUMP: u16 = 0x300;
/// `NLMSG_DONE`: the end of a dump.
pub const NLMSG_DONE: u16 = 3;
/// `CTA_TUPLE_ORIG`; in a tuple `CTA_TUPLE_IP`, `CTA_TUPLE_PROTO`.
const CTA_TUPLE_ORIG: u16 = 1;
/// `CTA_TUPLE_REPLY`: the reply direction, NAT applied (its source is the original
/// destination after DNAT).
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
/// `CTA_IP_V4_SRC` .. `CTA_IP_V6_DST`.
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
/// `CTA_PROTO_NUM`, ports, ICMP and ICMPv6 id, type and code.
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTO_ICMP_ID: u16 = 4;
const CTA_PROTO_ICMP_TYPE: u16 = 5;
const CTA_PROTO_ICMP_CODE: u16 = 6;
const CTA_PROTO_ICMPV6_ID: u16 = 7;
const CTA_PROTO_ICMPV6_TYPE: u16 = 8;
const CTA_PROTO_ICMPV6_CODE: u16 = 9;
const NLA_F_NESTED: u16 = 0x8000;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const NLMSG_HDRLEN: usize = 16;
/// `struct nfgenmsg`.
const NFGENMSG_LEN: usize = 4;

/// The ICMP types that start a tracked ICMP "connection" (the kernel tracks only requests:
/// echo, timestamp, information, address mask; ICMPv6 echo and node information query). A
/// [`Flow`] keeps the identifier, not the type, so a deletion asks for each of them.
const ICMP_REQUESTS: [u8; 4] = [8, 13, 15, 17];
const ICMPV6_REQUESTS: [u8; 2] = [128, 139];

/// The request for a dump of every connection of the socket's namespace, both families.
pub fn dump_request(seq: u32) -> Vec<u8> {
    let mut w = Writer::new();
    // Family AF_UNSPEC: no filter, every family in one walk.
    let m = w.begin_msg(
        (SUBSYS_CTNETLINK << 8) | MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        0,
        0,
    );
    w.end_msg(m);
    w.into_bytes()
}

/// What one datagram of a dump held.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DumpPart {
    /// Connections.
    pub flows: Vec<Tracked>,
    /// The dump ended (`NLMSG_DONE`).
    pub done: bool,
    /// The kernel refused the dump (`-errno`).
    pub error: Option<i32>,
}

/// A connection as conntrack keys it and as the forward hook saw its first packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracked {
    /// The original tuple, as the packet that opened it arrived (before any DNAT): what a
    /// deletion names.
    pub orig: Flow,
    /// Its original direction as the forward hook saw it: the source before SNAT (the
    /// original source) and the destination after DNAT (the reply's source). Equal to `orig`
    /// when nothing rewrote the destination (or no reply tuple came).
    pub seen: Flow,
}

/// The connections in one datagram of a dump; None when it is cut short.
pub fn parse_dump(buf: &[u8]) -> Option<DumpPart> {
    let mut part = DumpPart::default();
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().ok()?);
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            return None;
        }
        let body = &buf[at + NLMSG_HDRLEN..at + len];
        match kind {
            NLMSG_DONE => part.done = true,
            super::message::NLMSG_ERROR => {
                let error = i32::from_ne_bytes(body.get(..4)?.try_into().ok()?);
                if error != 0 {
                    part.error = Some(error);
                }
            }
            k if k == (SUBSYS_CTNETLINK << 8) | MSG_CT_NEW => {
                if let Some(f) = body.get(NFGENMSG_LEN..).and_then(tracked_of) {
                    part.flows.push(f);
                }
            }
            _ => {}
        }
        at += (len + 3) & !3;
    }
    Some(part)
}

fn attr(b: &[u8], ty: u16) -> Option<&[u8]> {
    attrs(b).find(|(t, _)| *t == ty).map(|(_, d)| d)
}

fn be16(d: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(d.get(..2)?.try_into().ok()?))
}

fn addr(d: &[u8]) -> Option<IpAddr> {
    match d.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(d).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(d).ok()?)),
        _ => None,
    }
}

/// A connection from its attributes: the original tuple and the forward hook's view of it.
fn tracked_of(body: &[u8]) -> Option<Tracked> {
    let orig = flow_of(attr(body, CTA_TUPLE_ORIG)?)?;
    let seen = match attr(body, CTA_TUPLE_REPLY).and_then(flow_of) {
        Some(reply) => Flow {
            dst: reply.src,
            // ICMP: the identifier stays the source port, no destination port.
            dport: match orig.proto {
                proto::ICMP | proto::ICMPV6 => 0,
                _ => reply.sport,
            },
            ..orig
        },
        None => orig,
    };
    Some(Tracked { orig, seen })
}

/// A tuple's flow, from its attributes (as `conntrack -L` shows it: ICMP's identifier as the
/// source port, destination port 0).
fn flow_of(tuple: &[u8]) -> Option<Flow> {
    let ip = attr(tuple, CTA_TUPLE_IP)?;
    let (src, dst) = match (attr(ip, CTA_IP_V4_SRC), attr(ip, CTA_IP_V4_DST)) {
        (Some(s), Some(d)) => (addr(s)?, addr(d)?),
        _ => (
            addr(attr(ip, CTA_IP_V6_SRC)?)?,
            addr(attr(ip, CTA_IP_V6_DST)?)?,
        ),
    };
    let p = attr(tuple, CTA_TUPLE_PROTO)?;
    let num = *attr(p, CTA_PROTO_NUM)?.first()?;
    let port = |ty| attr(p, ty).and_then(be16);
    let (sport, dport) = match num {
        proto::ICMP => (port(CTA_PROTO_ICMP_ID)?, 0),
        proto::ICMPV6 => (port(CTA_PROTO_ICMPV6_ID)?, 0),
        _ => (
            port(CTA_PROTO_SRC_PORT).unwrap_or(0),
            port(CTA_PROTO_DST_PORT).unwrap_or(0),
        ),
    };
    Some(Flow {
        src,
        dst,
        proto: num,
        sport,
        dport,
    })
}

/// Deletion requests for `flows`, numbered from `seq`: the bytes, and for each message its
/// sequence number and the index of the flow it deletes (an ICMP flow takes one message per
/// request type; at most one of them finds the connection).
pub fn delete_requests(flows: &[Flow], seq: u32) -> (Vec<u8>, Vec<(u32, usize)>) {
    let mut w = Writer::new();
    let mut sent = Vec::new();
    let mut next = seq;
    for (i, f) in flows.iter().enumerate() {
        let icmp_types: &[u8] = match f.proto {
            proto::ICMP => &ICMP_REQUESTS,
            proto::ICMPV6 => &ICMPV6_REQUESTS,
            _ => &[0],
        };
        for icmp_type in icmp_types {
            let family = if f.src.is_ipv6() { AF_INET6 } else { AF_INET };
            let m = w.begin_msg(
                (SUBSYS_CTNETLINK << 8) | MSG_CT_DELETE,
                NLM_F_REQUEST | NLM_F_ACK,
                next,
                family,
                0,
            );
            let tuple = w.begin_attr(CTA_TUPLE_ORIG | NLA_F_NESTED);
            let ip = w.begin_attr(CTA_TUPLE_IP | NLA_F_NESTED);
            match (f.src, f.dst) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    w.attr(CTA_IP_V4_SRC, &s.octets());
                    w.attr(CTA_IP_V4_DST, &d.octets());
                }
                (s, d) => {
                    w.attr(CTA_IP_V6_SRC, &v6(s));
                    w.attr(CTA_IP_V6_DST, &v6(d));
                }
            }
            w.end_attr(ip);
            let p = w.begin_attr(CTA_TUPLE_PROTO | NLA_F_NESTED);
            w.attr(CTA_PROTO_NUM, &[f.proto]);
            match f.proto {
                proto::ICMP => {
                    w.attr(CTA_PROTO_ICMP_ID, &f.sport.to_be_bytes());
                    w.attr(CTA_PROTO_ICMP_TYPE, &[*icmp_type]);
                    w.attr(CTA_PROTO_ICMP_CODE, &[0]);
                }
                proto::ICMPV6 => {
                    w.attr(CTA_PROTO_ICMPV6_ID, &f.sport.to_be_bytes());
                    w.attr(CTA_PROTO_ICMPV6_TYPE, &[*icmp_type]);
                    w.attr(CTA_PROTO_ICMPV6_CODE, &[0]);
                }
                proto::TCP | proto::UDP | proto::SCTP => {
                    w.attr(CTA_PROTO_SRC_PORT, &f.sport.to_be_bytes());
                    w.attr(CTA_PROTO_DST_PORT, &f.dport.to_be_bytes());
                }
                _ => {}
            }
            w.end_attr(p);
            w.end_attr(tuple);
            w.end_msg(m);
            sent.push((next, i));
            next = next.wrapping_add(1);
        }
    }
    (w.into_bytes(), sent)
}

/// An address as 16 bytes (IPv4 mapped; a mixed pair never reaches the kernel's table).
fn v6(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(src: &str, dst: &str, proto: u8, sport: u16, dport: u16) -> Flow {
        Flow {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            sport,
            dport,
        }
    }

    /// A delete request for a connection, turned into the `IPCTNL_MSG_CT_NEW` a dump answers
    /// with (same attributes), parses back to the same flow; both families, ports and ICMP.
    #[test]
    fn what_a_deletion_names_a_dump_reads_back() {
        let flows = [
            flow("10.10.1.68", "10.20.1.3", proto::TCP, 40000, 8080),
            flow("fd00::1", "fd01::2", proto::SCTP, 1024, 5000),
            flow("10.0.0.1", "10.0.0.2", proto::ICMP, 4660, 0),
            flow("fd00::1", "fd00::2", proto::ICMPV6, 7, 0),
            flow("10.0.0.1", "10.0.0.2", 47, 0, 0),
        ];
        let (bytes, sent) = delete_requests(&flows, 100);
        // One message per flow, one per request type for ICMP.
        assert_eq!(sent.len(), 1 + 1 + 4 + 2 + 1);
        assert_eq!(sent[0], (100, 0));
        assert_eq!(sent[2..6].iter().map(|s| s.1).collect::<Vec<_>>(), [2; 4]);
        let mut dump = bytes.clone();
        let mut at = 0;
        while at < dump.len() {
            let len = u32::from_ne_bytes(dump[at..at + 4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes([dump[at + 4], dump[at + 5]]);
            assert_eq!(kind, (SUBSYS_CTNETLINK << 8) | MSG_CT_DELETE);
            dump[at + 4..at + 6]
                .copy_from_slice(&((SUBSYS_CTNETLINK << 8) | MSG_CT_NEW).to_ne_bytes());
            at += len;
        }
        let part = parse_dump(&dump).unwrap();
        let mut want: Vec<Flow> = Vec::new();
        for (_, i) in &sent {
            want.push(flows[*i]);
        }
        assert_eq!(part.flows.iter().map(|t| t.orig).collect::<Vec<_>>(), want);
        assert!(
            part.flows.iter().all(|t| t.seen == t.orig),
            "no reply tuple: as sent"
        );
        assert!(!part.done && part.error.is_none());
    }

    #[test]
    fn a_dump_ends_with_done_and_reports_errors() {
        let mut done = vec![0u8; 20];
        done[..4].copy_from_slice(&20u32.to_ne_bytes());
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        assert!(parse_dump(&done).unwrap().done);
        let mut err = vec![0u8; 36];
        err[..4].copy_from_slice(&36u32.to_ne_bytes());
        err[4..6].copy_from_slice(&super::super::message::NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        assert_eq!(parse_dump(&err).unwrap().error, Some(-1));
        assert_eq!(parse_dump(&done[..12]), Some(DumpPart::default()));
        let mut cut = done.clone();
        cut[..4].copy_from_slice(&40u32.to_ne_bytes());
        assert_eq!(parse_dump(&cut), None);
        // The dump request: one GET of family AF_UNSPEC, as a dump.
        let r = dump_request(9);
        assert_eq!(r.len(), 20);
        assert_eq!(
            u16::from_ne_bytes([r[4], r[5]]),
            (SUBSYS_CTNETLINK << 8) | MSG_CT_GET
        );
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!(r[16], 0);
    }
}
