//! rtnetlink, as the mirror needs it: dump requests for routes, rules and forwarding
//! (`RTM_GETROUTE`, `RTM_GETRULE`, `RTM_GETNETCONF`) and the parse of their answers into
//! [`super::Route`], [`super::Rule`] and [`super::Forwarding`]. Bytes in, values out: the
//! socket is [`super::watch`]'s. Layouts are `linux/netlink.h`, `linux/rtnetlink.h`,
//! `linux/fib_rules.h` and `linux/netconf.h`, host byte order except addresses.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use super::{Family, Forwarding, Route, Rule};

/// `nlmsghdr` size.
const NLMSG_HDR: usize = 16;
/// `NLMSG_ERROR`.
const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`.
const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`.
const NLM_F_REQUEST: u16 = 1;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`).
const NLM_F_DUMP: u16 = 0x300;

/// Message types.
pub mod msg {
    /// A link changed (its routes may have gone with it, unannounced).
    pub const NEWLINK: u16 = 16;
    /// A link went away.
    pub const DELLINK: u16 = 17;
    /// A route (dump answer or notification).
    pub const NEWROUTE: u16 = 24;
    /// A route went away.
    pub const DELROUTE: u16 = 25;
    /// Dump routes.
    pub const GETROUTE: u16 = 26;
    /// A rule.
    pub const NEWRULE: u16 = 32;
    /// Dump rules.
    pub const GETRULE: u16 = 34;
    /// Forwarding and friends of an interface.
    pub const NEWNETCONF: u16 = 80;
    /// Dump netconf.
    pub const GETNETCONF: u16 = 82;
}

/// rtnetlink multicast groups (`RTNLGRP_*`) whose messages can change the mirror.
pub const GROUPS: [u32; 10] = [
    1,  // LINK
    5,  // IPV4_IFADDR
    7,  // IPV4_ROUTE
    8,  // IPV4_RULE
    9,  // IPV6_IFADDR
    11, // IPV6_ROUTE
    19, // IPV6_RULE
    24, // IPV4_NETCONF
    25, // IPV6_NETCONF
    32, // NEXTHOP
];

/// `AF_INET`, `AF_INET6`.
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

fn af(f: Family) -> u8 {
    match f {
        Family::V4 => AF_INET,
        Family::V6 => AF_INET6,
    }
}

fn family_of(af: u8) -> Option<Family> {
    match af {
        AF_INET => Some(Family::V4),
        AF_INET6 => Some(Family::V6),
        _ => None,
    }
}

/// A dump request of `kind` ([`msg::GETROUTE`], [`msg::GETRULE`], [`msg::GETNETCONF`]) for
/// `family`.
pub fn dump_request(kind: u16, family: Family, seq: u32) -> Vec<u8> {
    // rtmsg and fib_rule_hdr are 12 bytes, netconfmsg 1 (padded to 4); family first in each.
    let body = if kind == msg::GETNETCONF { 4 } else { 12 };
    let len = NLMSG_HDR + body;
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(len as u32).to_ne_bytes());
    b.extend_from_slice(&kind.to_ne_bytes());
    b.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes());
    b.push(af(family));
    b.resize(len, 0);
    b
}

/// A message of a dump answer or a notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// A route.
    Route(Family, Route),
    /// A rule.
    Rule(Family, Rule),
    /// Forwarding of an interface.
    Forwarding(Family, Forwarding),
    /// The end of a dump.
    Done,
    /// Anything else (of another family, a cached route, a type the mirror does not read).
    Other,
}

/// What went wrong reading an answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RtnlError {
    /// A message or attribute runs past its buffer.
    #[error("truncated rtnetlink message at byte {0}")]
    Truncated(usize),
    /// The kernel refused the request.
    #[error("the kernel answered errno {0}")]
    Kernel(i32),
}

/// The messages in `buf` (one `recv`), in order.
pub fn parse(buf: &[u8]) -> Result<Vec<Message>, RtnlError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + NLMSG_HDR <= buf.len() {
        let len = u32_at(buf, at)? as usize;
        if len < NLMSG_HDR || at + len > buf.len() {
            return Err(RtnlError::Truncated(at));
        }
        let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        let body = &buf[at + NLMSG_HDR..at + len];
        out.push(match kind {
            NLMSG_DONE => Message::Done,
            NLMSG_ERROR => {
                let errno = i32::from_ne_bytes(
                    body.get(..4)
                        .and_then(|b| b.try_into().ok())
                        .ok_or(RtnlError::Truncated(at))?,
                );
                if errno != 0 {
                    return Err(RtnlError::Kernel(-errno));
                }
                Message::Other
            }
            msg::NEWROUTE => route(body).map_err(|e| shift(e, at))?,
            msg::NEWRULE => rule(body).map_err(|e| shift(e, at))?,
            msg::NEWNETCONF => netconf(body).map_err(|e| shift(e, at))?,
            _ => Message::Other,
        });
        at += align(len);
    }
    Ok(out)
}

fn shift(e: RtnlError, by: usize) -> RtnlError {
    match e {
        RtnlError::Truncated(n) => RtnlError::Truncated(n + by + NLMSG_HDR),
        k => k,
    }
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, RtnlError> {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_ne_bytes)
        .ok_or(RtnlError::Truncated(at))
}

/// The attributes after a fixed header of `fixed` bytes: (type without flag bits, payload).
fn attrs(body: &[u8], fixed: usize) -> Result<Vec<(u16, &[u8])>, RtnlError> {
    let mut out = Vec::new();
    let mut at = align(fixed);
    while at + 4 <= body.len() {
        let len = u16::from_ne_bytes([body[at], body[at + 1]]) as usize;
        let kind = u16::from_ne_bytes([body[at + 2], body[at + 3]]) & 0x3fff;
        if len < 4 || at + len > body.len() {
            return Err(RtnlError::Truncated(at));
        }
        out.push((kind, &body[at + 4..at + len]));
        at += align(len);
    }
    Ok(out)
}

fn u32_attr(v: &[u8]) -> Option<u32> {
    v.get(..4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_ne_bytes)
}

fn addr(f: Family, v: &[u8]) -> Option<IpAddr> {
    match f {
        Family::V4 => <[u8; 4]>::try_from(v.get(..4)?)
            .ok()
            .map(|a| IpAddr::V4(Ipv4Addr::from(a))),
        Family::V6 => <[u8; 16]>::try_from(v.get(..16)?)
            .ok()
            .map(|a| IpAddr::V6(Ipv6Addr::from(a))),
    }
}

/// `RTA_*` the mirror reads.
const RTA_DST: u16 = 1;
const RTA_MULTIPATH: u16 = 9;
const RTA_TABLE: u16 = 15;
const RTA_ENCAP: u16 = 22;
const RTA_NH_ID: u16 = 30;
/// `RTNH_F_DEAD | RTNH_F_LINKDOWN`.
const NH_DOWN: u32 = 1 | 16;
/// `RTM_F_CLONED`: a cached route (IPv6), not a table's.
const RTM_F_CLONED: u32 = 0x200;

fn route(b: &[u8]) -> Result<Message, RtnlError> {
    if b.len() < 12 {
        return Err(RtnlError::Truncated(0));
    }
    let Some(family) = family_of(b[0]) else {
        return Ok(Message::Other);
    };
    let flags = u32_at(b, 8)?;
    if flags & RTM_F_CLONED != 0 {
        return Ok(Message::Other);
    }
    let (dst_len, mut table, kind) = (b[1], u32::from(b[4]), b[7]);
    let (mut dst, mut nexthop_object, mut encap) = (None, false, false);
    let mut dead = flags & NH_DOWN != 0;
    for (t, v) in attrs(b, 12)? {
        match t {
            RTA_DST => dst = addr(family, v),
            RTA_TABLE => table = u32_attr(v).unwrap_or(table),
            RTA_NH_ID => nexthop_object = true,
            RTA_ENCAP => encap = true,
            RTA_MULTIPATH => dead = all_paths_down(v),
            _ => {}
        }
    }
    let unspecified = match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let Ok(dst) = IpNet::new(dst.unwrap_or(unspecified), dst_len) else {
        return Err(RtnlError::Truncated(1));
    };
    Ok(Message::Route(
        family,
        Route {
            table,
            kind,
            dst: dst.trunc(),
            dead,
            nexthop_object,
            encap,
        },
    ))
}

/// Whether every `rtnexthop` of an `RTA_MULTIPATH` payload is dead or its link down (a
/// nexthop's encapsulation, in its own attributes, is not read: the route's own counts).
fn all_paths_down(v: &[u8]) -> bool {
    let mut at = 0;
    let mut any = false;
    while at + 8 <= v.len() {
        let len = u16::from_ne_bytes([v[at], v[at + 1]]) as usize;
        if len < 8 {
            break;
        }
        any = true;
        if u32::from(v[at + 2]) & NH_DOWN == 0 {
            return false;
        }
        at += align(len);
    }
    any
}

/// `FRA_*` that select nothing.
const FRA_GOTO: u16 = 4;
const FRA_PRIORITY: u16 = 6;
const FRA_SUPPRESS_IFGROUP: u16 = 13;
const FRA_SUPPRESS_PREFIXLEN: u16 = 14;
const FRA_TABLE: u16 = 15;
const FRA_PAD: u16 = 18;
const FRA_PROTOCOL: u16 = 21;
/// `FIB_RULE_INVERT`.
const FIB_RULE_INVERT: u32 = 2;

fn rule(b: &[u8]) -> Result<Message, RtnlError> {
    if b.len() < 12 {
        return Err(RtnlError::Truncated(0));
    }
    let Some(family) = family_of(b[0]) else {
        return Ok(Message::Other);
    };
    let (dst_len, src_len, tos, mut table, action) = (b[1], b[2], b[3], u32::from(b[4]), b[7]);
    let flags = u32_at(b, 8)?;
    let mut selector_free =
        dst_len == 0 && src_len == 0 && tos == 0 && flags & FIB_RULE_INVERT == 0;
    let (mut priority, mut suppresses) = (0, false);
    for (t, v) in attrs(b, 12)? {
        match t {
            FRA_PRIORITY => priority = u32_attr(v).unwrap_or(0),
            FRA_TABLE => table = u32_attr(v).unwrap_or(table),
            FRA_SUPPRESS_IFGROUP | FRA_SUPPRESS_PREFIXLEN => {
                suppresses |= u32_attr(v).is_some_and(|n| n != u32::MAX)
            }
            FRA_GOTO | FRA_PAD | FRA_PROTOCOL => {}
            // Addresses, interfaces, marks, ports, protocols, uids, l3mdev, dscp, flow
            // labels, and whatever a later kernel adds: a selector.
            _ => selector_free = false,
        }
    }
    Ok(Message::Rule(
        family,
        Rule {
            priority,
            action,
            table,
            selector_free,
            suppresses,
        },
    ))
}

/// `NETCONFA_*`.
const NETCONFA_IFINDEX: u16 = 1;
const NETCONFA_FORWARDING: u16 = 2;

fn netconf(b: &[u8]) -> Result<Message, RtnlError> {
    let Some(family) = b.first().copied().and_then(family_of) else {
        return Ok(Message::Other);
    };
    let (mut ifindex, mut on) = (None, None);
    for (t, v) in attrs(b, 1)? {
        match t {
            NETCONFA_IFINDEX => ifindex = u32_attr(v).map(|n| n as i32),
            NETCONFA_FORWARDING => on = u32_attr(v).map(|n| n != 0),
            _ => {}
        }
    }
    Ok(match (ifindex, on) {
        (Some(ifindex), Some(on)) => Message::Forwarding(family, Forwarding { ifindex, on }),
        _ => Message::Other,
    })
}
