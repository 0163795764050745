//! What identifies a flow and what its packets may be: a packet's conntrack key (original
//! direction) and its reverse, and the TCP flags, SCTP chunks and ICMP types conntrack judges
//! packets by. Pure functions of the parsed packet, shared by conntrack, the verdict cache and
//! the events.

use peerwall_common::FlowKey;

use crate::parse::{Pkt, IPPROTO_ICMP, IPPROTO_ICMPV6};

pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;

pub(crate) fn flow_key(p: &Pkt) -> FlowKey {
    let (sport, dport) = if p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6 {
        (p.icmp_id, 0)
    } else {
        (p.sport, p.dport)
    };
    FlowKey {
        src: p.src,
        dst: p.dst,
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto: p.proto,
        family: p.family,
        _pad: [0; 2],
    }
}

/// The key of the opposite direction. ICMP echo keeps its identifier in `sport` both ways.
pub(crate) fn reverse(k: &FlowKey) -> FlowKey {
    let icmp = k.proto == IPPROTO_ICMP || k.proto == IPPROTO_ICMPV6;
    FlowKey {
        src: k.dst,
        dst: k.src,
        sport: if icmp { k.sport } else { k.dport },
        dport: if icmp { k.dport } else { k.sport },
        proto: k.proto,
        family: k.family,
        _pad: [0; 2],
    }
}

/// The TCP flag combinations conntrack accepts (`tcp_valid_flags`), URG/PSH aside.
#[inline(always)]
pub(crate) fn tcp_flags_valid(flags: u8) -> bool {
    let f = flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK);
    matches!(f, TCP_SYN | 0x12 | TCP_RST | 0x14 | 0x11 | TCP_ACK)
}

/// Whether a TCP segment of no known flow opens one: a SYN alone among FIN, SYN, RST and ACK
/// (no pickup mid-stream). Twin of `peerwall_policy::ir::frame::tcp_opens`.
#[inline(always)]
pub(crate) fn tcp_opens(flags: u8) -> bool {
    flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK) == TCP_SYN
}

/// SCTP chunks a flow can start with (conntrack's `sctp_new`): INIT, INIT ACK, HEARTBEAT,
/// HEARTBEAT ACK, SHUTDOWN, SHUTDOWN ACK, ERROR, COOKIE ECHO. Twin of
/// `peerwall_policy::ir::frame::sctp_chunk_opens`.
#[inline(always)]
pub(crate) fn sctp_chunk_opens(chunk: u8) -> bool {
    matches!(chunk, 1 | 2 | 4 | 5 | 7 | 8 | 9 | 10)
}

/// ICMP types that are errors (quote another packet).
pub(crate) fn icmp_is_error(p: &Pkt) -> bool {
    if p.proto == IPPROTO_ICMP {
        matches!(p.icmp_type, 3 | 4 | 5 | 11 | 12)
    } else {
        matches!(p.icmp_type, 1..=4)
    }
}

/// ICMP types a flow cannot start with (replies).
pub(crate) fn icmp_is_reply(p: &Pkt) -> bool {
    if p.proto == IPPROTO_ICMP {
        matches!(p.icmp_type, 0 | 14 | 16 | 18)
    } else {
        p.icmp_type == 129
    }
}

/// Echo requests are tracked by id; ICMP types other than echo carry no usable id.
pub(crate) fn icmp_keyed(p: &Pkt) -> bool {
    if p.proto == IPPROTO_ICMP {
        matches!(p.icmp_type, 0 | 8)
    } else {
        matches!(p.icmp_type, 128 | 129)
    }
}
