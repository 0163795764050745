//! The policy IR: what every backend installs and what the reference evaluator judges.
//!
//! It is pure data: no kube, aya, tokio or filesystem types. Values are normalized
//! (address lists as canonical range sets, port ranges merged, one `Match` per field with its
//! own negation), names are validated, and every rule carries a stable id
//! (table / chain / rule name) that traces back to the FirewallConfiguration it came from.

pub mod addr;
pub mod eval;
pub mod frame;
pub mod nat;
pub mod sets;

use std::fmt;

pub use addr::{AddrRange, AddrSet, IpFamily, PortSet, RangeEdit};
pub use eval::{
    evaluate, evaluate_at_ingress, AuditHit, CtState, Packet, PacketPath, Verdict, VerdictAction,
};
pub use sets::{compose, SetChange, SetEditError, SetOp};

/// The whole compiled policy of a host.
#[derive(Clone, Debug, Default, PartialEq, Hash)]
pub struct Policy {
    /// Tables, sorted by (name, family).
    pub tables: Vec<Table>,
    /// Tables another enforcer keeps in force in the same network namespace (Liqo's firewall
    /// controller in its gateways): never applied by peerwall, read for the address rewrites
    /// their NAT rules perform before the filter hooks ([`nat::dst_rewrites`]).
    pub observed: Vec<Table>,
}

pub use peerwall_intent::Origin;

/// nftables table family that peerwall enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TableFamily {
    /// `ip`: IPv4 only.
    Ip,
    /// `ip6`: IPv6 only.
    Ip6,
    /// `inet`: both.
    Inet,
}

impl TableFamily {
    /// nft keyword.
    pub fn nft(self) -> &'static str {
        match self {
            Self::Ip => "ip",
            Self::Ip6 => "ip6",
            Self::Inet => "inet",
        }
    }

    /// The family of an nft keyword (`ip`, `ip6`, `inet`); other families are not peerwall's.
    pub fn from_nft(s: &str) -> Option<Self> {
        [Self::Ip, Self::Ip6, Self::Inet]
            .into_iter()
            .find(|f| f.nft() == s)
    }

    /// Whether packets of `family` traverse chains of this table.
    pub fn sees(self, family: IpFamily) -> bool {
        matches!(
            (self, family),
            (Self::Inet, _) | (Self::Ip, IpFamily::V4) | (Self::Ip6, IpFamily::V6)
        )
    }
}

/// One table.
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct Table {
    /// nftables table name.
    pub name: String,
    /// Family.
    pub family: TableFamily,
    /// Object this table came from.
    pub origin: Origin,
    /// Named sets (from `spec.table.sets`), in declaration order.
    pub sets: Vec<NamedSet>,
    /// Base chains, sorted by name.
    pub chains: Vec<Chain>,
    /// Audit mode: a drop or reject of this table's chains (a rule's or a chain policy's) is
    /// a would-drop, the packet is accepted by that chain ([`eval`]).
    pub audit: bool,
}

/// A named set.
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct NamedSet {
    /// Set name.
    pub name: String,
    /// Contents.
    pub elements: SetElements,
    /// Also filled from `AddressSet` slices (`fromAddressSets: true`): its contents are the
    /// inline elements plus every slice's addresses ([`crate::sliced`]).
    pub from_slices: bool,
}

/// Contents of a named set.
#[derive(Clone, Debug, PartialEq, Hash)]
pub enum SetElements {
    /// Addresses of one family.
    Addr(AddrSet),
    /// Ports / integers.
    Port(PortSet),
}

/// Chain type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChainKind {
    /// Decides verdicts.
    Filter,
    /// Translates addresses; never decides.
    Nat,
    /// Reroutes output packets; never decides.
    Route,
}

impl ChainKind {
    /// nft keyword.
    pub fn nft(self) -> &'static str {
        match self {
            Self::Filter => "filter",
            Self::Nat => "nat",
            Self::Route => "route",
        }
    }
}

/// Netfilter hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// Before routing.
    Prerouting,
    /// To this host.
    Input,
    /// Routed through this host.
    Forward,
    /// From this host.
    Output,
    /// After routing.
    Postrouting,
}

impl Hook {
    /// nft keyword.
    pub fn nft(self) -> &'static str {
        match self {
            Self::Prerouting => "prerouting",
            Self::Input => "input",
            Self::Forward => "forward",
            Self::Output => "output",
            Self::Postrouting => "postrouting",
        }
    }
}

/// A base chain.
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct Chain {
    /// Name.
    pub name: String,
    /// Type.
    pub kind: ChainKind,
    /// Hook.
    pub hook: Hook,
    /// Priority.
    pub priority: i32,
    /// Default verdict: `Accept` or `Drop`.
    pub policy: VerdictAction,
    /// Ordered rules.
    pub rules: Vec<Rule>,
}

/// A rule: all matches must hold, then the action runs.
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct Rule {
    /// Name (unique in its chain).
    pub name: String,
    /// Matches (ANDed).
    pub matches: Vec<Match>,
    /// Action.
    pub action: Action,
    /// Whether the rule counts packets and bytes.
    pub counter: bool,
}

/// Stable identity of a rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct RuleId {
    /// Table name.
    pub table: String,
    /// Chain name.
    pub chain: String,
    /// Rule name.
    pub rule: String,
}

/// A single-field match with its own negation.
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct Match {
    /// `neq`.
    pub negate: bool,
    /// What is tested.
    pub test: Test,
}

/// Packet direction of an address or port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Source.
    Src,
    /// Destination.
    Dst,
}

/// Interface direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IfDir {
    /// Input interface.
    In,
    /// Output interface.
    Out,
}

/// Where a set of values came from: inline in the rule, or a named table set.
#[derive(Clone, Debug, PartialEq, Hash)]
pub enum Source {
    /// Written in the rule; `count` is how many values the user wrote.
    Inline {
        /// Number of values written (a list of more than one becomes a named set in nftables).
        count: usize,
    },
    /// `@name` reference to a table set.
    Named(String),
}

/// What a match tests. Each test holds only on packets where the field exists:
/// an address test only on packets of its family, a port test only on TCP, UDP and SCTP.
#[derive(Clone, Debug, PartialEq, Hash)]
pub enum Test {
    /// Source or destination address in a set.
    Addr {
        /// Which address.
        dir: Dir,
        /// Resolved addresses.
        set: AddrSet,
        /// Origin of the values.
        source: Source,
    },
    /// Source or destination port in a set (TCP, UDP and SCTP only).
    Port {
        /// Which port.
        dir: Dir,
        /// Resolved ports.
        set: PortSet,
        /// Origin of the values.
        source: Source,
    },
    /// Layer-4 protocol number in a list.
    Proto(Vec<u8>),
    /// Interface name (exact or prefix).
    Iface {
        /// Which interface.
        dir: IfDir,
        /// Name or prefix.
        name: String,
        /// Prefix match.
        wildcard: bool,
    },
    /// Conntrack state in a set (bit mask of [`CtState::bit`]).
    CtState(u8),
}

/// What a rule does.
#[derive(Clone, Debug, PartialEq, Hash)]
pub enum Action {
    /// Decides a verdict.
    Verdict(VerdictAction),
    /// `ct mark set VALUE`.
    CtMark(u32),
    /// `meta mark set ct mark`.
    MetaMarkFromCtMark,
    /// Clamp TCP MSS to a value or to the route MTU.
    TcpMssClamp(Option<u16>),
    /// Disable conntrack for the packet.
    Notrack,
    /// NAT.
    Nat(NatAction),
}

impl Action {
    /// The verdict this action decides, if it decides one.
    pub fn verdict(&self) -> Option<VerdictAction> {
        match self {
            Self::Verdict(v) => Some(*v),
            _ => None,
        }
    }
}

/// NAT action.
#[derive(Clone, Debug, PartialEq, Hash)]
pub enum NatAction {
    /// Destination NAT.
    Dnat(NatTarget),
    /// Source NAT.
    Snat(NatTarget),
    /// Masquerade.
    Masquerade,
}

/// Where a NAT rule translates to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NatTarget {
    /// One address.
    Addr(std::net::IpAddr),
    /// A prefix mapping (nftables `prefix to`, netmap): the host part of the address is kept
    /// and the network part replaced. Liqo remaps overlapping pod and external CIDRs this way,
    /// and its masquerade bypass maps a CIDR onto itself (`remapping/cidr.go`,
    /// `configuration-controller/firewall.go`; rendered by Liqo's
    /// `pkg/firewall/utils/natrule.go` as a NAT with the prefix flag).
    Prefix(ipnet::IpNet),
}

impl NatTarget {
    /// Address family.
    pub fn family(&self) -> IpFamily {
        match self {
            Self::Addr(a) => IpFamily::of(a),
            Self::Prefix(n) => IpFamily::of(&n.addr()),
        }
    }
}

impl fmt::Display for NatTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Addr(a) => write!(f, "{a}"),
            Self::Prefix(n) => write!(f, "{n}"),
        }
    }
}

impl Policy {
    /// A short fingerprint of what this policy enforces (its tables; not the observed ones),
    /// logged with each apply so that which policy a host holds, and since when, can be read
    /// from its log: equal for equal policies, in any process of the same build (SipHash with
    /// fixed keys over the tables' derived `Hash`, a fraction of the compile's cost).
    pub fn digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        self.tables.hash(&mut h);
        h.finish()
    }

    /// The destination rewrites between ingress and the forward hook: NAT rules of the
    /// enforced tables (applied by nftables) and of the observed ones.
    pub fn dst_rewrites(&self) -> (Vec<nat::DstRewrite>, Vec<nat::Unexpressed>) {
        nat::dst_rewrites(self.tables.iter().chain(&self.observed))
    }

    /// Find a table by name and family.
    pub fn table(&self, name: &str) -> Option<&Table> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// Total number of rules.
    pub fn rule_count(&self) -> usize {
        self.tables
            .iter()
            .flat_map(|t| &t.chains)
            .map(|c| c.rules.len())
            .sum()
    }
}
