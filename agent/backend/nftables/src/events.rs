//! Events of the nftables backend: log rules send packets to NFLOG group N, each with a prefix
//! naming the event kind and the rule (`pw:<kind>:<id>`, [`prefix`]); [`Nflog`] reads them over
//! netlink and turns them into [`Event`]s.
//!
//! The rule's id is a hash of `table/chain/rule`; the names come back from the applied tables
//! ([`Names::of_tables`], the agent) or from the kernel's listing ([`Names::of_listing`],
//! `peerwall observe` without an agent), so a prefix never has to hold a long name. Bounded at
//! every step: a named limit per table in the kernel, a socket buffer (what overflows is
//! lost, never a packet), and [`FlowLimiter`] (one event per flow, kind and rule per interval).
//! nftables cannot count the packets a limit kept out of the log: an event's counts are the
//! packets that reached the log; the rule counters hold the totals.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::listing::Listing;
use crate::netlink::message::attrs;

use peerwall_backend::{Event, EventError, EventKind, EventSource, FlowLimiter, IfNames};
use peerwall_policy::ir::CtState;

use crate::model::{Expr, Table};

/// The kind's code in a prefix.
fn code(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Drop => "d",
        EventKind::Reject => "r",
        EventKind::AuditDrop => "ad",
        EventKind::AuditReject => "ar",
        EventKind::Accept => "a",
    }
}

fn kind_of_code(c: &str) -> Option<EventKind> {
    [
        EventKind::Drop,
        EventKind::Reject,
        EventKind::AuditDrop,
        EventKind::AuditReject,
        EventKind::Accept,
    ]
    .into_iter()
    .find(|k| code(*k) == c)
}

/// FNV-1a, 64 bits: stable across versions and hosts (the prefix is in the kernel's ruleset).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h ^= 0xff;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The log prefix of an event of `kind` decided by `rule` (None: the chain policy) of
/// `table`/`chain`: `pw:<kind>:<16 hex digits>`, 21 to 22 bytes whatever the names.
pub fn prefix(kind: EventKind, table: &str, chain: &str, rule: Option<&str>) -> String {
    let id = match rule {
        Some(r) => fnv1a(&[table.as_bytes(), chain.as_bytes(), r.as_bytes()]),
        None => fnv1a(&[table.as_bytes(), chain.as_bytes()]),
    };
    format!("pw:{}:{id:016x}", code(kind))
}

/// The kind a prefix names, if it is one of ours.
pub fn parse_prefix(p: &str) -> Option<EventKind> {
    let rest = p.strip_prefix("pw:")?;
    let (k, id) = rest.split_once(':')?;
    (id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .then_some(())
        .and_then(|_| kind_of_code(k))
}

/// Where a logged packet's rule is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleRef {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule; None: the chain policy.
    pub rule: Option<String>,
}

/// Prefix → rule, shared between the backend (which refreshes it on every apply) and its
/// event reader.
#[derive(Clone, Debug, Default)]
pub struct Names(Arc<Mutex<HashMap<String, RuleRef>>>);

impl Names {
    /// Replace the names with those of `tables` (the model as applied).
    pub fn set_tables(&self, tables: &[Table]) {
        let map = Self::of_tables(tables);
        if let Ok(mut m) = self.0.lock() {
            *m = map;
        }
    }

    /// The names of the log rules of `tables`.
    pub fn of_tables(tables: &[Table]) -> HashMap<String, RuleRef> {
        let mut out = HashMap::new();
        for t in tables {
            for r in &t.rules {
                for e in &r.exprs {
                    if let Expr::Log { prefix, .. } = e {
                        out.insert(
                            prefix.clone(),
                            RuleRef {
                                table: t.name.clone(),
                                chain: r.chain.clone(),
                                rule: (!r.comment.is_empty()).then(|| r.comment.clone()),
                            },
                        );
                    }
                }
            }
        }
        out
    }

    /// The names of the log rules in a ruleset listing.
    pub fn of_listing(listing: &Listing) -> HashMap<String, RuleRef> {
        let mut out = HashMap::new();
        for r in &listing.rules {
            let prefix = r.logs.iter().find_map(|l| l.prefix.as_deref());
            let Some(prefix) = prefix.filter(|p| parse_prefix(p).is_some()) else {
                continue;
            };
            out.insert(
                prefix.to_string(),
                RuleRef {
                    table: r.table.clone(),
                    chain: r.chain.clone(),
                    rule: r.comment.clone(),
                },
            );
        }
        out
    }

    /// Replace the names.
    pub fn set(&self, map: HashMap<String, RuleRef>) {
        if let Ok(mut m) = self.0.lock() {
            *m = map;
        }
    }

    fn get(&self, prefix: &str) -> Option<RuleRef> {
        self.0.lock().ok()?.get(prefix).cloned()
    }
}

// Netlink and nfnetlink_log constants (linux/netlink.h, linux/netfilter/nfnetlink_log.h).
const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULA_CFG_TIMEOUT: u16 = 4;
const NFULA_CFG_FLAGS: u16 = 6;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULNL_CFG_F_CONNTRACK: u16 = 2;
const NFULA_TIMESTAMP: u16 = 3;
const NFULA_IFINDEX_INDEV: u16 = 4;
const NFULA_IFINDEX_OUTDEV: u16 = 5;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;
const NFULA_CT_INFO: u16 = 19;
/// Bytes of each packet copied to user space: IPv6 header + TCP ports, with room.
const COPY_RANGE: u32 = 128;
/// How long the kernel may hold logged packets to batch them, in hundredths of a second.
/// Its default (100: one second) delays every event of light traffic by up to a second;
/// 10 ms keeps events prompt, and floods still travel in full batches (the kernel sends a
/// batch as soon as its buffer or queue threshold fills).
const FLUSH_TIMEOUT_CS: u32 = 1;

/// One logged packet, decoded (pure: [`parse_messages`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logged {
    /// The log prefix.
    pub prefix: String,
    /// Kernel timestamp, when the packet had one.
    pub time: Option<SystemTime>,
    /// Input ifindex (0: none).
    pub iif: u32,
    /// Output ifindex (0: none).
    pub oif: u32,
    /// Conntrack state (None: no conntrack entry, i.e. invalid).
    pub ct_state: Option<CtState>,
    /// Source, destination, protocol, ports (ICMP: echo id, type), IP length.
    pub src: IpAddr,
    /// Destination.
    pub dst: IpAddr,
    /// Protocol.
    pub proto: u8,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// IP total length.
    pub len: u64,
}

fn be32(d: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(d.get(..4)?.try_into().ok()?))
}

/// enum ip_conntrack_info → state.
fn ct_state_of(info: u32) -> CtState {
    match info {
        0 | 3 => CtState::Established,
        1 | 4 => CtState::Related,
        2 => CtState::New,
        7 => CtState::Untracked,
        _ => CtState::Invalid,
    }
}

/// The addresses, protocol and ports of an IP packet (the payload NFLOG copied).
fn parse_ip(p: &[u8]) -> Option<(IpAddr, IpAddr, u8, u16, u16, u64)> {
    let version = p.first()? >> 4;
    let (src, dst, proto, l4, len, first_fragment) = match version {
        4 => {
            let ihl = usize::from(p[0] & 0xf) * 4;
            let s: [u8; 4] = p.get(12..16)?.try_into().ok()?;
            let d: [u8; 4] = p.get(16..20)?.try_into().ok()?;
            let frag = u16::from_be_bytes([*p.get(6)?, *p.get(7)?]) & 0x1fff;
            (
                IpAddr::from(s),
                IpAddr::from(d),
                *p.get(9)?,
                ihl,
                u64::from(u16::from_be_bytes([*p.get(2)?, *p.get(3)?])),
                frag == 0,
            )
        }
        6 => {
            let s: [u8; 16] = p.get(8..24)?.try_into().ok()?;
            let d: [u8; 16] = p.get(24..40)?.try_into().ok()?;
            (
                IpAddr::from(s),
                IpAddr::from(d),
                *p.get(6)?,
                40,
                40 + u64::from(u16::from_be_bytes([*p.get(4)?, *p.get(5)?])),
                true,
            )
        }
        _ => return None,
    };
    let l4h = p.get(l4..).filter(|_| first_fragment).unwrap_or(&[]);
    let (sport, dport) = match proto {
        6 | 17 if l4h.len() >= 4 => (
            u16::from_be_bytes([l4h[0], l4h[1]]),
            u16::from_be_bytes([l4h[2], l4h[3]]),
        ),
        // ICMP / ICMPv6: echo id, type (as the bpf datapath reports them).
        1 | 58 if l4h.len() >= 6 => (u16::from_be_bytes([l4h[4], l4h[5]]), u16::from(l4h[0])),
        _ => (0, 0),
    };
    Some((src, dst, proto, sport, dport, len))
}

/// The logged packets in a buffer of netlink messages; other messages are skipped.
pub fn parse_messages(mut buf: &[u8]) -> Vec<Logged> {
    let mut out = Vec::new();
    while buf.len() >= 16 {
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        let ty = u16::from_ne_bytes([buf[4], buf[5]]);
        if len < 16 || len > buf.len() {
            break;
        }
        if ty == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET && len >= 20 {
            if let Some(l) = parse_packet(&buf[20..len]) {
                out.push(l);
            }
        }
        let next = (len + 3) & !3;
        buf = if next >= buf.len() { &[] } else { &buf[next..] };
    }
    out
}

fn parse_packet(body: &[u8]) -> Option<Logged> {
    let (mut prefix, mut time, mut iif, mut oif, mut ct, mut payload) =
        (None, None, 0, 0, None, None);
    for (ty, d) in attrs(body) {
        match ty {
            NFULA_PREFIX => {
                let s = d.split(|b| *b == 0).next().unwrap_or_default();
                prefix = Some(String::from_utf8_lossy(s).into_owned());
            }
            NFULA_TIMESTAMP if d.len() >= 16 => {
                let sec = u64::from_be_bytes(d[..8].try_into().ok()?);
                let usec = u64::from_be_bytes(d[8..16].try_into().ok()?);
                time = Some(UNIX_EPOCH + Duration::from_secs(sec) + Duration::from_micros(usec));
            }
            NFULA_IFINDEX_INDEV => iif = be32(d)?,
            NFULA_IFINDEX_OUTDEV => oif = be32(d)?,
            NFULA_CT_INFO => ct = be32(d).map(ct_state_of),
            NFULA_PAYLOAD => payload = Some(d),
            _ => {}
        }
    }
    let (src, dst, proto, sport, dport, len) = parse_ip(payload?)?;
    Some(Logged {
        prefix: prefix?,
        time,
        iif,
        oif,
        ct_state: ct,
        src,
        dst,
        proto,
        sport,
        dport,
        len,
    })
}

/// A config message for `group` with the given attributes (type, payload).
fn config_message(group: u16, seq: u32, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    use crate::netlink::message::{Writer, NLM_F_ACK, NLM_F_REQUEST};
    let mut w = Writer::new();
    // nfgenmsg: family AF_UNSPEC, res_id = the group.
    let m = w.begin_msg(
        (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        0,
        group,
    );
    for (ty, data) in attrs {
        w.attr(*ty, data);
    }
    w.end_msg(m);
    w.into_bytes()
}

/// The NFLOG listener of one group, in the network namespace it was made in.
pub struct Nflog {
    sock: OwnedFd,
    names: Names,
    ifnames: IfNames,
    limiter: FlowLimiter,
    /// Ends of bursts are looked for every half interval ([`FlowLimiter::flush`]).
    flush_every: Duration,
    next_flush: SystemTime,
    buf: Vec<u8>,
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> EventError {
    move |source| EventError::Io { what, source }
}

impl Nflog {
    /// Bind NFLOG group `group` in the calling thread's network namespace (one listener per
    /// group: a second one gets EBUSY). `interval`: at most one event per flow, kind and rule
    /// in it.
    pub fn bind(group: u16, names: Names, interval: Duration) -> Result<Self, EventError> {
        let sock = crate::netlink::socket::netfilter_socket()
            .map_err(io("opening a netfilter netlink socket"))?;
        let fd = sock.as_raw_fd();
        // A large receive buffer absorbs bursts up to the limits; beyond it the kernel drops
        // log messages (ENOBUFS on our side), never packets.
        let size: libc::c_int = 4 << 20;
        // SAFETY: valid socket and option pointer/size.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            );
        }
        let ifnames = IfNames::here()?;
        let mut me = Self {
            sock,
            names,
            ifnames,
            limiter: FlowLimiter::new(interval, 16_384),
            flush_every: interval / 2,
            next_flush: SystemTime::now(),
            buf: vec![0; 1 << 16],
        };
        me.request(
            group,
            1,
            &[(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND])],
            "binding the NFLOG group",
        )?;
        let mut m = COPY_RANGE.to_be_bytes().to_vec();
        m.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
        let flags = NFULNL_CFG_F_CONNTRACK.to_be_bytes();
        let flush = FLUSH_TIMEOUT_CS.to_be_bytes();
        me.request(
            group,
            2,
            &[
                (NFULA_CFG_MODE, &m),
                (NFULA_CFG_FLAGS, &flags),
                (NFULA_CFG_TIMEOUT, &flush),
            ],
            "setting the NFLOG copy mode and flush timeout",
        )?;
        Ok(me)
    }

    /// Send a config request and wait for its acknowledgement.
    fn request(
        &mut self,
        group: u16,
        seq: u32,
        attrs: &[(u16, &[u8])],
        what: &'static str,
    ) -> Result<(), EventError> {
        let msg = config_message(group, seq, attrs);
        // SAFETY: zeroed sockaddr_nl is valid; pid 0 is the kernel.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: valid buffer and address for the call.
        let n = unsafe {
            libc::sendto(
                self.sock.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if n < 0 {
            return Err(io(what)(std::io::Error::last_os_error()));
        }
        loop {
            let got = self.recv(Duration::from_secs(2)).map_err(io(what))?;
            let Some(got) = got else {
                return Err(io(what)(std::io::Error::from(std::io::ErrorKind::TimedOut)));
            };
            let answers = crate::netlink::message::answers(&self.buf[..got]).unwrap_or_default();
            if let Some(a) = answers.iter().find(|a| a.seq == seq) {
                if a.error == 0 {
                    return Ok(());
                }
                return Err(io(what)(std::io::Error::from_raw_os_error(-a.error)));
            }
        }
    }

    /// Receive one datagram, waiting at most `timeout`; None on timeout.
    fn recv(&mut self, timeout: Duration) -> std::io::Result<Option<usize>> {
        use std::os::fd::AsFd;
        if !peerwall_backend::events::wait_readable(self.sock.as_fd(), timeout)? {
            return Ok(None);
        }
        // SAFETY: valid buffer of the given length.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            // Overrun: the kernel dropped log messages, not packets. Go on.
            if e.raw_os_error() == Some(libc::ENOBUFS) || e.kind() == std::io::ErrorKind::WouldBlock
            {
                return Ok(Some(0));
            }
            return Err(e);
        }
        Ok(Some(n as usize))
    }

    fn event(&mut self, l: Logged) -> Option<Event> {
        let verdict = parse_prefix(&l.prefix)?;
        let r = self.names.get(&l.prefix)?;
        Some(Event {
            time: l.time.unwrap_or_else(SystemTime::now),
            verdict,
            table: r.table,
            chain: r.chain,
            rule: r.rule,
            src: l.src,
            dst: l.dst,
            proto: l.proto,
            sport: l.sport,
            dport: l.dport,
            iif: self.ifnames.name(l.iif),
            oif: self.ifnames.name(l.oif),
            ct_state: l.ct_state,
            packets: 1,
            bytes: l.len,
        })
    }
}

impl EventSource for Nflog {
    fn next_batch(&mut self, timeout: Duration) -> Result<Vec<Event>, EventError> {
        let mut out = Vec::new();
        let mut wait = timeout;
        // Everything already queued, without waiting after the first datagram.
        while let Some(n) = self.recv(wait).map_err(io("reading NFLOG messages"))? {
            wait = Duration::ZERO;
            let logged = parse_messages(&self.buf[..n]);
            for l in logged {
                if let Some(e) = self.event(l).and_then(|e| self.limiter.offer(e)) {
                    out.push(e);
                }
            }
            if out.len() >= 1024 {
                break;
            }
        }
        let now = SystemTime::now();
        if now >= self.next_flush {
            out.extend(self.limiter.flush(now));
            self.next_flush = now + self.flush_every;
        }
        Ok(out)
    }
}

/// Whether any rule of a ruleset listing logs peerwall events to NFLOG `group`: without one,
/// nothing will ever arrive there.
pub fn logs_events(listing: &Listing, group: u16) -> bool {
    listing
        .rules
        .iter()
        .flat_map(|r| &r.logs)
        .any(|l| l.group == Some(group) && l.prefix.as_deref().and_then(parse_prefix).is_some())
}

#[cfg(test)]
mod tests;
