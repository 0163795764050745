//! The local-address mirror: which destinations the gateway's kernel delivers to itself, so the
//! datapath can tell a forwarded packet from a local one with one trie lookup instead of a FIB
//! lookup (the largest single part of a new flow's cost after the chains).
//!
//! The mirror is exact only where the namespace's routing gives every destination one of two
//! fates, delivered (the local table) or forwarded; [`mirror`] decides that per family from a
//! [`Snapshot`] of the routing state (pure: data in, prefixes or the reason out), and
//! [`watch`] keeps the pinned `LOCAL` trie and the `ROUTES` lease in step with the kernel's
//! notifications. [`rtnl`] reads and writes the rtnetlink messages.
//!
//! What must hold, per family (each is something a FIB lookup would otherwise answer
//! differently from "local table, else forwarded"):
//! - the first rule looks the local table up for every packet (a rule before it, or a
//!   selector, could route a local address elsewhere);
//! - no rule ends a lookup (blackhole, unreachable, prohibit), and a rule without selectors
//!   or prefix suppression looks main up;
//! - main holds a unicast default route that is not dead: every destination some table
//!   routes, and any other falls through to it;
//! - no route is blackhole, unreachable, prohibit, uses a nexthop object (which may be a
//!   blackhole) or an encapsulation (the FIB helper does not forward those);
//! - only the local table delivers locally (local, broadcast, anycast, multicast routes),
//!   holds nothing else, and no other table's route is more specific inside one of its
//!   prefixes (IPv4 merges local and main into one longest-prefix match while no custom rule
//!   exists: such a route would win there);
//! - forwarding is on for every interface but loopback.

pub mod rtnl;
pub mod watch;

use std::fmt;

use ipnet::IpNet;

/// A family of the mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// Route types (`RTN_*`).
pub mod kind {
    /// A gateway or direct route.
    pub const UNICAST: u8 = 1;
    /// Delivered locally.
    pub const LOCAL: u8 = 2;
    /// Broadcast (delivered locally).
    pub const BROADCAST: u8 = 3;
    /// Anycast (delivered locally).
    pub const ANYCAST: u8 = 4;
    /// Multicast.
    pub const MULTICAST: u8 = 5;
    /// Dropped silently.
    pub const BLACKHOLE: u8 = 6;
    /// Dropped, host unreachable.
    pub const UNREACHABLE: u8 = 7;
    /// Dropped, administratively prohibited.
    pub const PROHIBIT: u8 = 8;
    /// Lookup goes on with the next rule.
    pub const THROW: u8 = 9;
}

/// Routing tables by number.
pub mod table {
    /// `main`.
    pub const MAIN: u32 = 254;
    /// `local`.
    pub const LOCAL: u32 = 255;
}

/// Rule actions (`FR_ACT_*`) that go on looking up.
pub mod action {
    /// Look a table up.
    pub const TO_TABLE: u8 = 1;
    /// Jump to a later rule.
    pub const GOTO: u8 = 2;
    /// Nothing.
    pub const NOP: u8 = 3;
}

/// One route of any table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Its table.
    pub table: u32,
    /// [`kind`].
    pub kind: u8,
    /// Destination prefix.
    pub dst: IpNet,
    /// Its nexthop is dead or its link down (`RTNH_F_DEAD`, `RTNH_F_LINKDOWN`).
    pub dead: bool,
    /// Through a nexthop object (`RTA_NH_ID`).
    pub nexthop_object: bool,
    /// With a lightweight-tunnel encapsulation (`RTA_ENCAP`).
    pub encap: bool,
}

/// One policy-routing rule, in the kernel's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Priority.
    pub priority: u32,
    /// `FR_ACT_*`.
    pub action: u8,
    /// Table looked up.
    pub table: u32,
    /// Matches every packet: no address, tos, interface, mark, port, protocol, uid or l3mdev
    /// selector, not inverted.
    pub selector_free: bool,
    /// Ignores routes up to some prefix length or of some interface group (`suppress_*`).
    pub suppresses: bool,
}

/// Forwarding of one interface (`ifindex` as netconf gives it: −1 all, −2 default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forwarding {
    /// Interface.
    pub ifindex: i32,
    /// Forwarding on.
    pub on: bool,
}

/// The routing state of one family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Every route of every table.
    pub routes: Vec<Route>,
    /// The rules, in order.
    pub rules: Vec<Rule>,
    /// Forwarding per interface.
    pub forwarding: Vec<Forwarding>,
}

/// Why the mirror does not decide a family's path (the FIB does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Closed {
    /// The first rule is not a selector-free lookup of the local table.
    LocalRuleNotFirst,
    /// A rule ends lookups (`FR_ACT_*` action).
    TerminalRule(u32, u8),
    /// No selector-free rule looks main up.
    NoMainRule,
    /// Main has no live unicast default route.
    NoDefaultRoute,
    /// A route drops or rejects its destinations.
    TerminalRoute(IpNet, u32),
    /// A route uses a nexthop object or an encapsulation.
    OpaqueRoute(IpNet, u32),
    /// A table other than local delivers locally.
    LocalElsewhere(IpNet, u32),
    /// The local table forwards a prefix.
    UnicastInLocal(IpNet),
    /// A route inside one of the local table's prefixes is more specific than it.
    Shadowed(IpNet, IpNet),
    /// Forwarding is off on an interface.
    NotForwarding(i32),
}

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Closed::LocalRuleNotFirst => {
                f.write_str("the first routing rule is not `from all lookup local`")
            }
            Closed::TerminalRule(p, a) => write!(f, "rule {p} ends lookups (action {a})"),
            Closed::NoMainRule => f.write_str("no rule `from all lookup main`"),
            Closed::NoDefaultRoute => f.write_str("no live default route in table main"),
            Closed::TerminalRoute(d, t) => {
                write!(f, "{d} in table {t} is blackhole, unreachable or prohibit")
            }
            Closed::OpaqueRoute(d, t) => write!(
                f,
                "{d} in table {t} uses a nexthop object or an encapsulation"
            ),
            Closed::LocalElsewhere(d, t) => write!(f, "{d} in table {t} delivers locally"),
            Closed::UnicastInLocal(d) => write!(f, "{d} in table local is a unicast route"),
            Closed::Shadowed(inner, outer) => {
                write!(f, "{inner} is more specific than the local table's {outer}")
            }
            Closed::NotForwarding(i) => write!(f, "forwarding is off on interface {i}"),
        }
    }
}

/// Whether routes of this kind deliver to the gateway itself.
fn delivers(k: u8) -> bool {
    [kind::LOCAL, kind::BROADCAST, kind::ANYCAST, kind::MULTICAST].contains(&k)
}

/// Loopback's interface index in every namespace.
const LOOPBACK: i32 = 1;
/// Netconf's "default" entry (the value new interfaces get).
const NETCONF_DEFAULT: i32 = -2;

/// The local table's prefixes when the mirror decides `s`'s paths exactly, else why not.
pub fn mirror(s: &Snapshot) -> Result<Vec<IpNet>, Closed> {
    match s.rules.first() {
        Some(r)
            if r.action == action::TO_TABLE
                && r.table == table::LOCAL
                && r.selector_free
                && !r.suppresses => {}
        _ => return Err(Closed::LocalRuleNotFirst),
    }
    if let Some(r) = s
        .rules
        .iter()
        .find(|r| ![action::TO_TABLE, action::GOTO, action::NOP].contains(&r.action))
    {
        return Err(Closed::TerminalRule(r.priority, r.action));
    }
    if !s.rules.iter().any(|r| {
        r.action == action::TO_TABLE && r.table == table::MAIN && r.selector_free && !r.suppresses
    }) {
        return Err(Closed::NoMainRule);
    }
    if !s.routes.iter().any(|r| {
        r.table == table::MAIN
            && r.kind == kind::UNICAST
            && r.dst.prefix_len() == 0
            && !r.dead
            && !r.nexthop_object
            && !r.encap
    }) {
        return Err(Closed::NoDefaultRoute);
    }
    let mut local = Vec::new();
    for r in &s.routes {
        if [kind::BLACKHOLE, kind::UNREACHABLE, kind::PROHIBIT].contains(&r.kind) {
            return Err(Closed::TerminalRoute(r.dst, r.table));
        }
        if r.nexthop_object || r.encap {
            return Err(Closed::OpaqueRoute(r.dst, r.table));
        }
        match (r.table == table::LOCAL, delivers(r.kind)) {
            (true, true) => local.push(r.dst),
            (true, false) if r.kind != kind::THROW => return Err(Closed::UnicastInLocal(r.dst)),
            (false, true) => return Err(Closed::LocalElsewhere(r.dst, r.table)),
            _ => {}
        }
    }
    for outer in local.iter().filter(|p| p.prefix_len() < p.max_prefix_len()) {
        if let Some(inner) = s.routes.iter().find(|r| {
            !(r.table == table::LOCAL && delivers(r.kind))
                && r.dst.prefix_len() > outer.prefix_len()
                && outer.contains(&r.dst)
        }) {
            return Err(Closed::Shadowed(inner.dst, *outer));
        }
    }
    if let Some(f) = s
        .forwarding
        .iter()
        .find(|f| f.ifindex != LOOPBACK && f.ifindex != NETCONF_DEFAULT && !f.on)
    {
        return Err(Closed::NotForwarding(f.ifindex));
    }
    local.sort_by_key(|p| (p.addr(), p.prefix_len()));
    local.dedup();
    Ok(local)
}

#[cfg(test)]
mod tests;
