//! Events: what the datapath did to real traffic, with the rule that did it.
//!
//! Both backends report the same [`Event`]s: every drop, reject and would-drop (a drop or
//! reject of an audited table, [`peerwall_policy::ir::Table::audit`]), and with the flow log the
//! first packet of each accepted flow, per chain that accepted it. Never one event per packet:
//! at most one per flow, kind and rule per interval ([`FlowLimiter`] in user space for
//! nftables, `EVENT_FLOWS` in the bpf datapath), the packets in between counted in the next.
//! How each backend reads them (an [`EventSource`]): nftables from NFLOG, bpf from its ring
//! buffer. This module is pure except [`IfNames`], which asks the kernel for interface names.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use peerwall_policy::ir::{CtState, VerdictAction};

/// What happened to the packets of an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventKind {
    /// Dropped.
    Drop,
    /// Rejected (dropped, ICMP port unreachable sent back).
    Reject,
    /// An audited chain would have dropped them; accepted.
    AuditDrop,
    /// An audited chain would have rejected them; accepted.
    AuditReject,
    /// The first packet of a flow, accepted by the chain (flow log).
    Accept,
}

impl EventKind {
    /// Name as printed and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Drop => "drop",
            Self::Reject => "reject",
            Self::AuditDrop => "audit-drop",
            Self::AuditReject => "audit-reject",
            Self::Accept => "accept",
        }
    }

    /// The verdict label of `peerwall_drops_total` (`drop`, `reject`, `audit`), None for accept.
    pub fn drop_label(self) -> Option<&'static str> {
        match self {
            Self::Drop => Some("drop"),
            Self::Reject => Some("reject"),
            Self::AuditDrop | Self::AuditReject => Some("audit"),
            Self::Accept => None,
        }
    }

    /// The event kind of a chain's decision `v` (audited or not).
    pub fn of(v: VerdictAction, audited: bool) -> Self {
        match (v, audited) {
            (VerdictAction::Accept, _) => Self::Accept,
            (VerdictAction::Drop, false) => Self::Drop,
            (VerdictAction::Reject, false) => Self::Reject,
            (VerdictAction::Drop, true) => Self::AuditDrop,
            (VerdictAction::Reject, true) => Self::AuditReject,
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event: a flow, what was done to it, by which rule, and how much since its last event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// When (RFC 3339, UTC, microseconds).
    #[serde(serialize_with = "rfc3339", deserialize_with = "from_rfc3339")]
    pub time: SystemTime,
    /// What happened.
    pub verdict: EventKind,
    /// Table of the deciding chain.
    pub table: String,
    /// Deciding chain.
    pub chain: String,
    /// Deciding rule; None when the chain policy decided.
    pub rule: Option<String>,
    /// Source address.
    pub src: IpAddr,
    /// Destination address (as the filter hooks see it).
    pub dst: IpAddr,
    /// IP protocol number.
    pub proto: u8,
    /// Source port (TCP/UDP), ICMP echo id, else 0.
    pub sport: u16,
    /// Destination port (TCP/UDP), ICMP type, else 0.
    pub dport: u16,
    /// Input interface ("" when none).
    pub iif: String,
    /// Output interface ("" when none or not known yet).
    pub oif: String,
    /// Conntrack state, when known.
    pub ct_state: Option<CtState>,
    /// Packets of this flow, kind and rule since its previous event, this one included.
    pub packets: u64,
    /// Their bytes (IP length).
    pub bytes: u64,
}

fn rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_time(*t))
}

fn from_rfc3339<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
    let s = String::deserialize(d)?;
    parse_time(&s).ok_or_else(|| serde::de::Error::custom(format!("not a UTC time: {s:?}")))
}

/// [`format_time`]'s text back to a time.
pub fn parse_time(s: &str) -> Option<SystemTime> {
    let s = s.strip_suffix('Z')?;
    let (date, clock) = s.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, dd) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = clock.split_once('.').unwrap_or((clock, "0"));
    let mut c = hms.split(':').map(|x| x.parse::<u64>().ok());
    let (h, mi, se) = (c.next()??, c.next()??, c.next()??);
    let micros: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    let days = days_from_civil(y, m, dd);
    let secs = u64::try_from(days).ok()? * 86_400 + h * 3600 + mi * 60 + se;
    Some(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros))
}

/// (year, month, day) → days since 1970-01-01 (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `2026-11-23T10:00:00.123456Z`.
pub fn format_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, dd) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{dd:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

impl Event {
    /// `table/chain/rule` (`table/chain/policy` when the policy decided).
    pub fn rule_path(&self) -> String {
        format!(
            "{}/{}/{}",
            self.table,
            self.chain,
            self.rule.as_deref().unwrap_or("policy")
        )
    }

    /// One line of text, as `peerwall observe` prints it.
    pub fn text(&self) -> String {
        self.text_named(None, None)
    }

    /// The protocol as `text` and the JSON of a cluster-wide `observe` name it: `tcp`, `udp`,
    /// `icmp`, `icmpv6`, `sctp`, else `proto-<number>`.
    pub fn protocol_name(&self) -> String {
        match self.proto {
            1 => "icmp".to_string(),
            6 => "tcp".to_string(),
            17 => "udp".to_string(),
            58 => "icmpv6".to_string(),
            132 => "sctp".to_string(),
            p => format!("proto-{p}"),
        }
    }

    /// [`Self::text`] with the pods behind the addresses, where known: `10.10.1.67:40312
    /// (shop/cart)`.
    pub fn text_named(&self, src_name: Option<&str>, dst_name: Option<&str>) -> String {
        let proto = self.protocol_name();
        let ports = matches!(self.proto, 6 | 17);
        let ep = |a: &IpAddr, p: u16, name: Option<&str>| {
            let at = match (ports, a) {
                (true, IpAddr::V6(_)) => format!("[{a}]:{p}"),
                (true, IpAddr::V4(_)) => format!("{a}:{p}"),
                (false, _) => a.to_string(),
            };
            match name {
                Some(n) => format!("{at} ({n})"),
                None => at,
            }
        };
        let ct = self.ct_state.map_or("-", |c| c.nft());
        let ifs = match (self.iif.as_str(), self.oif.as_str()) {
            ("", "") => String::new(),
            (i, "") => format!(" in {i}"),
            ("", o) => format!(" out {o}"),
            (i, o) => format!(" {i} -> {o}"),
        };
        format!(
            "{} {:<12} {} {} -> {}{} ct {} by {} ({} pkts, {} bytes)",
            format_time(self.time),
            self.verdict.as_str(),
            proto,
            ep(&self.src, self.sport, src_name),
            ep(&self.dst, self.dport, dst_name),
            ifs,
            ct,
            self.rule_path(),
            self.packets,
            self.bytes
        )
    }
}

/// Which events `peerwall observe` shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// `drop`, `reject`, `audit` (both audit kinds) or `accept`; None: all.
    pub verdict: Option<String>,
    /// `table/chain/rule`, `chain/rule` or `rule`; None: all.
    pub rule: Option<String>,
    /// Only events at or after this time.
    pub since: Option<SystemTime>,
}

/// Why a filter was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FilterError {
    /// `--verdict` is not one of the kinds.
    #[error("--verdict {0:?}: expected drop, reject, audit or accept")]
    Verdict(String),
}

impl EventFilter {
    /// Check the filter's values.
    pub fn check(&self) -> Result<(), FilterError> {
        match self.verdict.as_deref() {
            None | Some("drop" | "reject" | "audit" | "accept") => Ok(()),
            Some(v) => Err(FilterError::Verdict(v.to_string())),
        }
    }

    /// Whether `e` passes.
    pub fn matches(&self, e: &Event) -> bool {
        let verdict_ok = match self.verdict.as_deref() {
            None => true,
            Some("audit") => matches!(e.verdict, EventKind::AuditDrop | EventKind::AuditReject),
            Some(v) => e.verdict.as_str() == v,
        };
        let rule_ok = self.rule.as_deref().is_none_or(|r| {
            let full = e.rule_path();
            full == r || full.ends_with(&format!("/{r}"))
        });
        let since_ok = self.since.is_none_or(|s| e.time >= s);
        verdict_ok && rule_ok && since_ok
    }
}

/// What identifies a flow for rate limiting: the 5-tuple, the kind and the rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FlowId {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    sport: u16,
    dport: u16,
    verdict: EventKind,
    rule: String,
}

impl FlowId {
    fn of(e: &Event) -> Self {
        Self {
            src: e.src,
            dst: e.dst,
            proto: e.proto,
            sport: e.sport,
            dport: e.dport,
            verdict: e.verdict,
            rule: e.rule_path(),
        }
    }
}

#[derive(Clone, Debug)]
struct FlowCount {
    last: Option<SystemTime>,
    packets: u64,
    bytes: u64,
    /// The flow's latest packet not reported yet: the event [`FlowLimiter::flush`] sends with
    /// the counts since the last one when the flow has gone quiet.
    latest: Option<Event>,
}

/// At most one event per flow, kind and rule per `interval`, the packets in between counted
/// into the next one, or, when the flow goes quiet, into one [`flush`](Self::flush) sends an
/// interval after its last event: every packet is counted in exactly one event. At most
/// `capacity` flows remembered (when full, the flows quiet for an interval are forgotten, and
/// if that is not enough, all: amortized O(1)), so memory is bounded whatever the traffic.
/// What nftables events go through (the bpf datapath does the same in the kernel).
#[derive(Debug)]
pub struct FlowLimiter {
    interval: Duration,
    capacity: usize,
    flows: HashMap<FlowId, FlowCount>,
}

impl FlowLimiter {
    /// A limiter.
    pub fn new(interval: Duration, capacity: usize) -> Self {
        Self {
            interval,
            capacity: capacity.max(1),
            flows: HashMap::new(),
        }
    }

    /// Count `e` (its `packets` and `bytes`); the event to report, with the counts since the
    /// flow's last one, when one is due.
    pub fn offer(&mut self, mut e: Event) -> Option<Event> {
        let id = FlowId::of(&e);
        if !self.flows.contains_key(&id) && self.flows.len() >= self.capacity {
            self.evict(e.time);
        }
        let f = self.flows.entry(id).or_insert(FlowCount {
            last: None,
            packets: 0,
            bytes: 0,
            latest: None,
        });
        f.packets += e.packets;
        f.bytes += e.bytes;
        let due = f.last.is_none_or(|l| {
            e.time
                .duration_since(l)
                .is_ok_and(|since| since >= self.interval)
        });
        if !due {
            f.latest = Some(e);
            return None;
        }
        e.packets = f.packets;
        e.bytes = f.bytes;
        f.last = Some(e.time);
        f.packets = 0;
        f.bytes = 0;
        f.latest = None;
        Some(e)
    }

    /// The events of the flows quiet for an interval since their last event with packets
    /// counted since it (the end of a burst, which no later packet would report): each is the
    /// flow's latest packet with those counts. Call it about every interval; O(flows).
    pub fn flush(&mut self, now: SystemTime) -> Vec<Event> {
        let interval = self.interval;
        let mut out = Vec::new();
        for f in self.flows.values_mut() {
            let quiet = f
                .last
                .is_some_and(|l| now.duration_since(l).is_ok_and(|d| d >= interval));
            if !quiet || f.packets == 0 {
                continue;
            }
            let Some(mut e) = f.latest.take() else {
                continue;
            };
            e.packets = f.packets;
            e.bytes = f.bytes;
            f.last = Some(e.time);
            f.packets = 0;
            f.bytes = 0;
            out.push(e);
        }
        out
    }

    /// Make room: forget the flows with no event for an interval, or all of them.
    fn evict(&mut self, now: SystemTime) {
        let interval = self.interval;
        self.flows.retain(|_, f| {
            f.last
                .is_some_and(|l| now.duration_since(l).is_ok_and(|d| d < interval))
        });
        if self.flows.len() >= self.capacity {
            self.flows.clear();
        }
    }

    /// Flows remembered.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }
}

/// Why reading events failed.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// A kernel call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
    /// The backend has no events (it was built without them).
    #[error("events are off: start the agent with --events")]
    Off,
}

/// Where a backend's events come from. Made inside the backend's network namespace; usable
/// from any thread afterwards.
pub trait EventSource: Send {
    /// The events that arrived, waiting at most `timeout` for the first.
    fn next_batch(&mut self, timeout: Duration) -> Result<Vec<Event>, EventError>;
}

/// Wait until `fd` is readable, at most `timeout`: true when it is, false on timeout or a
/// signal (the caller just reads again later).
pub fn wait_readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut pfd, 1, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(r > 0)
}

/// Interface names of one network namespace, by index, asked of a socket made in it
/// (`SIOCGIFNAME` answers for the socket's namespace, whichever thread asks). Cached.
#[derive(Debug)]
pub struct IfNames {
    sock: OwnedFd,
    cache: HashMap<u32, String>,
}

impl IfNames {
    /// For the calling thread's network namespace.
    pub fn here() -> Result<Self, EventError> {
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(EventError::Io {
                what: "opening a socket for interface names",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: a fresh descriptor we own.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            sock,
            cache: HashMap::new(),
        })
    }

    /// The name of `ifindex` ("" for 0; `if<N>` when it is gone).
    pub fn name(&mut self, ifindex: u32) -> String {
        if ifindex == 0 {
            return String::new();
        }
        if let Some(n) = self.cache.get(&ifindex) {
            return n.clone();
        }
        // SAFETY: zeroed ifreq is valid; SIOCGIFNAME fills ifr_name for ifr_ifindex.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        req.ifr_ifru.ifru_ifindex = ifindex as i32;
        // SAFETY: valid socket and ifreq pointer for the duration of the call.
        let r = unsafe { libc::ioctl(self.sock.as_raw_fd(), libc::SIOCGIFNAME, &mut req) };
        let name = if r == 0 {
            let bytes: Vec<u8> = req
                .ifr_name
                .iter()
                .take_while(|c| **c != 0)
                .map(|c| *c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            return format!("if{ifindex}");
        };
        self.cache.insert(ifindex, name.clone());
        name
    }

    /// Forget cached names (interfaces come and go).
    pub fn forget(&mut self) {
        self.cache.clear();
    }
}

#[cfg(test)]
mod tests;
