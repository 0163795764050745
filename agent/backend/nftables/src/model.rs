//! A typed model of what peerwall puts into nftables: tables, sets, chains, rules and their
//! expressions, and the commands of a transaction. Rendering ([`crate::render`]) builds it from
//! the IR, planning ([`mod@crate::plan`]) diffs it as types, and only a [`crate::Runner`] turns it
//! into libnftables JSON ([`crate::json`]) or keeps it in memory ([`crate::FakeNft`]).

// size: one vocabulary, type by type (table, set, element, chain, rule, key, statement,
// command): the renderers, the planner and both runners read all of it together.

use std::net::IpAddr;

use peerwall_policy::ir::{ChainKind, CtState, Hook, IpFamily, NatTarget, TableFamily};

mod capacity;
pub use capacity::{capacity_for, MIN_CAPACITY, TIMEOUT_SET_CAPACITY};

/// Name of the marker chain that identifies tables owned by peerwall: a regular (hookless,
/// never run) chain whose one rule's comment names the owner.
pub const MARKER_CHAIN: &str = "__peerwall";
/// Prefix of the marker rule's comment.
pub const MARKER_PREFIX: &str = "peerwall owner=";

/// Comment prefix of the marker chain's second rule: the digest of what the table was created
/// as ([`crate::json::digest`]), so that a later process can tell an unchanged table from one
/// to recreate without having applied it itself.
pub const DIGEST_PREFIX: &str = "peerwall digest=";
/// Prefix of sets generated for inline lists.
pub const AUTO_SET_PREFIX: &str = "__pw_";

/// nft's name of an IP protocol number, where it has one.
pub fn proto_keyword(p: u8) -> Option<&'static str> {
    use peerwall_policy::ir::eval::proto;
    match p {
        proto::TCP => Some("tcp"),
        proto::UDP => Some("udp"),
        proto::SCTP => Some("sctp"),
        proto::ICMP => Some("icmp"),
        proto::ICMPV6 => Some("ipv6-icmp"),
        _ => None,
    }
}

/// nft's keyword of an address family in payload expressions and NAT statements.
pub fn family_keyword(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// One owned table and everything in it.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// Table name.
    pub name: String,
    /// Family.
    pub family: TableFamily,
    /// Owner written into the marker rule (origin of the object).
    pub owner: String,
    /// Named sets (their elements can change in place).
    pub sets: Vec<Set>,
    /// Base chains, in IR order (by name).
    pub chains: Vec<Chain>,
    /// Regular chains that a dispatch map jumps to ([`crate::dispatch`]), each with the base
    /// chain whose rules it holds (their counters count there).
    pub regular: Vec<Regular>,
    /// The dispatch's maps, as their elements are edited in place ([`crate::dispatch::edit`]):
    /// the sets their runs look up decide their elements ([`Table::dispatch_sources`]). Follows
    /// from the rest (not compared).
    pub dispatch_maps: Vec<DispatchMap>,
    /// Rules, in order.
    pub rules: Vec<Rule>,
    /// The table's event rate limit: a named limit object ([`EVENT_LIMIT`]) that every log
    /// rule of the table shares; None when events are off.
    pub event_limit: Option<EventLimit>,
}

/// Name of the limit object that bounds the events of one table.
pub const EVENT_LIMIT: &str = "peerwall_events";

/// A rate limit: `rate N/second burst M packets`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventLimit {
    /// Packets per second.
    pub rate: u32,
    /// Burst.
    pub burst: u32,
}

impl Table {
    /// Whether `other` differs from this table at most in set contents (so that element
    /// updates turn one into the other).
    pub fn same_structure(&self, other: &Table) -> bool {
        self.name == other.name
            && self.family == other.family
            && self.owner == other.owner
            && self.chains == other.chains
            && self.regular == other.regular
            && self.rules == other.rules
            && self.event_limit == other.event_limit
            && self.sets.len() == other.sets.len()
            && self.sets.iter().zip(&other.sets).all(|(a, b)| {
                a.name == b.name
                    && a.key == b.key
                    && a.interval == b.interval
                    && a.counter == b.counter
                    && a.verdict_map == b.verdict_map
                    && a.capacity() == b.capacity()
                    && (!a.is_merged() && !b.is_merged() || a == b)
            })
    }

    /// The sets whose contents decide a dispatch map's elements: a change to one of them
    /// edits the maps too.
    pub fn dispatch_sources(&self) -> std::collections::BTreeSet<&str> {
        self.dispatch_maps
            .iter()
            .flat_map(|m| m.lookups.iter().flatten())
            .filter_map(|l| match l {
                Lookup::Set(n) => Some(n.as_str()),
                Lookup::One(_) => None,
            })
            .collect()
    }

    /// The (hook, priority) pairs of its chains.
    pub fn hook_priorities(&self) -> std::collections::BTreeSet<(Hook, i32)> {
        self.chains.iter().map(|c| (c.hook, c.priority)).collect()
    }
}

/// Key type of a set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyType {
    /// `ipv4_addr`.
    Ipv4Addr,
    /// `ipv6_addr`.
    Ipv6Addr,
    /// `inet_service` (ports).
    InetService,
    /// A concatenation (`inet_proto . ipv4_addr . inet_service`, …): the key of a merged
    /// rule's set ([`crate::merge`]).
    Tuple(Columns),
}

impl KeyType {
    /// nft's type names, one per component (one for a plain key).
    pub fn nft_types(self) -> Vec<&'static str> {
        match self {
            Self::Ipv4Addr => vec!["ipv4_addr"],
            Self::Ipv6Addr => vec!["ipv6_addr"],
            Self::InetService => vec!["inet_service"],
            Self::Tuple(c) => c.types(),
        }
    }

    /// nft's text for the type (`ipv4_addr`, `inet_proto . ipv4_addr . inet_service`).
    pub fn nft(self) -> String {
        self.nft_types().join(" . ")
    }

    /// The address key type of a family.
    pub fn of(f: IpFamily) -> Self {
        match f {
            IpFamily::V4 => Self::Ipv4Addr,
            IpFamily::V6 => Self::Ipv6Addr,
        }
    }
}

/// A named set.
#[derive(Clone, Debug, PartialEq)]
pub struct Set {
    /// Set name.
    pub name: String,
    /// Key type.
    pub key: KeyType,
    /// `flags interval` (ranges and prefixes); without it the kernel uses a hash set, an O(1)
    /// lookup instead of a tree walk.
    pub interval: bool,
    /// Elements (canonical, disjoint).
    pub elements: Vec<Element>,
    /// A counter on every element (`counter` in the set): a merged rule's per-rule counts.
    pub counter: bool,
    /// Each element's comment, in the order of `elements` (a merged rule's set: the name of
    /// the rule the element stands for); empty for other sets.
    pub comments: Vec<String>,
    /// A verdict map (`type ipv4_addr : verdict`): its elements are [`Element::Jump`], an
    /// address and the chain it jumps to ([`crate::dispatch`]).
    pub verdict_map: bool,
    /// `flags timeout; timeout N s`: elements expire N s after their last [`Expr::Update`]
    /// (the ended table's sets; None for every policy set).
    pub timeout: Option<u32>,
}

impl Set {
    /// An empty timeout set of `key` whose elements the packet path adds and refreshes
    /// ([`Expr::Update`]) and expire `secs` after their last update.
    pub fn timeout_set(name: String, key: KeyType, secs: u32) -> Self {
        Self {
            name,
            key,
            interval: false,
            elements: Vec::new(),
            counter: false,
            comments: Vec::new(),
            verdict_map: false,
            timeout: Some(secs),
        }
    }

    /// Whether this is a merged rule's set ([`crate::merge`]): its elements are part of the
    /// table's structure (they stand for rules), never edited in place.
    pub fn is_merged(&self) -> bool {
        !self.comments.is_empty()
    }
}

/// A set element or a value on the right of a match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Element {
    /// One address.
    Addr(IpAddr),
    /// A prefix.
    Prefix(IpAddr, u8),
    /// An address range (inclusive).
    AddrRange(IpAddr, IpAddr),
    /// One port.
    Port(u16),
    /// A port range (inclusive).
    PortRange(u16, u16),
    /// A concatenation (an element of a merged rule's set).
    Tuple(Tuple),
    /// An element of a verdict map: an address and the chain its packets jump to.
    Jump(IpAddr, ClassChain),
}

/// A regular chain a dispatch map jumps to: one class of addresses of one dispatched run of
/// rules ([`crate::dispatch`]). Named by the run and by a hash of which of its rules the class
/// holds, so that an address joining an existing class is one map element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassChain {
    /// The run, numbered in table order.
    pub run: u32,
    /// Hash of the rules (positions in the run) the class holds.
    pub class: u64,
}

impl ClassChain {
    /// The chain's name: `__pw_k<run>_<class>`.
    pub fn name(self) -> String {
        format!("{AUTO_SET_PREFIX}k{}_{:016x}", self.run, self.class)
    }
}

/// What one rule of a dispatched run looks its address up in ([`crate::dispatch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A host set, by name.
    Set(String),
    /// One address.
    One(IpAddr),
}

/// One verdict map of the address dispatch, as [`crate::dispatch::edit`] edits its elements
/// in place: what each rule of its run looks up, and the chain of each class of addresses
/// it was rendered with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DispatchMap {
    /// The map's name.
    pub map: String,
    /// By position in the run: the rule's lookup, None where it is of the other family.
    pub lookups: Vec<Option<Lookup>>,
    /// Each class (the positions of the rules that select its addresses, ascending) and the
    /// chain the map sends it to.
    pub classes: std::collections::BTreeMap<Vec<u32>, ClassChain>,
}

/// A regular chain of a table and the base chain its rules came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regular {
    /// Its name ([`ClassChain::name`]).
    pub name: String,
    /// The base chain whose rules it holds.
    pub base: String,
}

/// Which fields a merged rule's set key concatenates, always in this order: destination and
/// source address (of `family`), destination and source port, protocol. The kernel's
/// concatenated interval set (pipapo) narrows the candidate elements field by field, and each
/// step costs in proportion to the candidates left: the most selective fields go first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Columns {
    /// `meta l4proto`.
    pub proto: bool,
    /// Family of the address columns.
    pub family: IpFamily,
    /// `ip saddr` / `ip6 saddr`.
    pub saddr: bool,
    /// `ip daddr` / `ip6 daddr`.
    pub daddr: bool,
    /// `th sport`.
    pub sport: bool,
    /// `th dport`.
    pub dport: bool,
}

impl Columns {
    /// A flow's columns of one family: both addresses, the destination port, the protocol,
    /// and the source port when `sport` (the key of the timeout sets the packet path fills:
    /// [`crate::ended`], [`crate::decided`]).
    pub fn flow(family: IpFamily, sport: bool) -> Self {
        Self {
            proto: true,
            family,
            saddr: true,
            daddr: true,
            sport,
            dport: true,
        }
    }

    /// The keys read, in order.
    pub fn keys(self) -> Vec<Key> {
        let mut k = Vec::new();
        for (on, source) in [(self.daddr, false), (self.saddr, true)] {
            if on {
                k.push(Key::Addr {
                    family: self.family,
                    source,
                });
            }
        }
        for (on, source) in [(self.dport, false), (self.sport, true)] {
            if on {
                k.push(Key::Port { source });
            }
        }
        if self.proto {
            k.push(Key::L4Proto);
        }
        k
    }

    /// nft's type name of each key, in order.
    pub fn types(self) -> Vec<&'static str> {
        self.keys()
            .iter()
            .map(|k| match k {
                Key::L4Proto => "inet_proto",
                Key::Port { .. } => "inet_service",
                _ => KeyType::of(self.family).nft_types()[0],
            })
            .collect()
    }
}

/// One address component of a [`Tuple`]: an address, a prefix or a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AddrPart {
    /// One address.
    Addr(IpAddr),
    /// A prefix.
    Prefix(IpAddr, u8),
    /// An inclusive range.
    Range(IpAddr, IpAddr),
}

impl AddrPart {
    /// As a plain element.
    pub fn element(self) -> Element {
        match self {
            Self::Addr(a) => Element::Addr(a),
            Self::Prefix(a, l) => Element::Prefix(a, l),
            Self::Range(a, b) => Element::AddrRange(a, b),
        }
    }
}

/// One element of a merged rule's set: a value for each of `columns` (the others unused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    /// The key's columns.
    pub columns: Columns,
    /// Protocol number.
    pub proto: u8,
    /// Source address.
    pub saddr: Option<AddrPart>,
    /// Destination address.
    pub daddr: Option<AddrPart>,
    /// Source ports (inclusive).
    pub sport: (u16, u16),
    /// Destination ports (inclusive).
    pub dport: (u16, u16),
}

impl Tuple {
    /// Its components, in the key's order.
    pub fn parts(&self) -> Vec<TuplePart> {
        let c = self.columns;
        let mut v = Vec::new();
        for (on, a) in [(c.daddr, self.daddr), (c.saddr, self.saddr)] {
            if let (true, Some(a)) = (on, a) {
                v.push(TuplePart::Elem(a.element()));
            }
        }
        for (on, (lo, hi)) in [(c.dport, self.dport), (c.sport, self.sport)] {
            if on {
                v.push(TuplePart::Elem(if lo == hi {
                    Element::Port(lo)
                } else {
                    Element::PortRange(lo, hi)
                }));
            }
        }
        if c.proto {
            v.push(TuplePart::Proto(self.proto));
        }
        v
    }
}

/// A component of a [`Tuple`] as the runners print it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TuplePart {
    /// A protocol number.
    Proto(u8),
    /// An address, prefix, range, port or port range.
    Elem(Element),
}

/// A base chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// Name.
    pub name: String,
    /// Type.
    pub kind: ChainKind,
    /// Hook.
    pub hook: Hook,
    /// Priority.
    pub priority: i32,
    /// Policy: accept or drop.
    pub policy: Policy,
}

/// A chain policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// accept.
    Accept,
    /// drop.
    Drop,
}

/// A rule of a chain.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    /// Chain it belongs to.
    pub chain: String,
    /// The rule's name, kept as its comment (counters and listings find rules by it).
    pub comment: String,
    /// Statements, in order.
    pub exprs: Vec<Expr>,
}

/// What a match reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    /// `ip saddr`, `ip6 daddr`, …
    Addr {
        /// Family.
        family: IpFamily,
        /// Source (`saddr`) or destination (`daddr`).
        source: bool,
    },
    /// `th sport` / `th dport` (preceded by an l4proto test: ports exist for TCP and UDP only).
    Port {
        /// Source port.
        source: bool,
    },
    /// `meta l4proto`.
    L4Proto,
    /// `meta iifname`.
    IifName,
    /// `meta oifname`.
    OifName,
    /// `ct state`.
    CtState,
    /// `tcp flags` (MSS clamping runs on SYNs only).
    TcpFlags,
    /// `tcp flags & (fin | syn | rst | ack)`: the flags conntrack opens a connection by (with
    /// [`Right::Syn`], `!=`: a segment that cannot open one).
    TcpOpenFlags,
    /// A concatenation of keys (`meta l4proto . ip daddr . th dport`): a merged rule's lookup.
    Tuple(Columns),
}

/// The right side of a match.
#[derive(Clone, Debug, PartialEq)]
pub enum Right {
    /// `@set`.
    SetRef(String),
    /// One value.
    Element(Element),
    /// An anonymous set.
    Elements(Vec<Element>),
    /// Protocols by number (named where nft has a name).
    Protos(Vec<u8>),
    /// An interface name (a trailing `*` is a prefix match).
    IfName(String),
    /// Conntrack states.
    CtStates(Vec<CtState>),
    /// The SYN flag.
    Syn,
}

/// The ICMP flavour of a reject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectType {
    /// `icmp` (ip tables).
    Icmp,
    /// `icmpv6` (ip6 tables).
    Icmpv6,
    /// `icmpx` (inet tables).
    Icmpx,
}

/// One statement of a rule.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A comparison: `left (==|!=) right`, or membership for sets.
    Match {
        /// `!=`.
        negate: bool,
        /// What is read.
        left: Key,
        /// What it is compared to.
        right: Right,
    },
    /// `counter`.
    Counter,
    /// `accept`.
    Accept,
    /// `drop`.
    Drop,
    /// `reject with … port-unreachable`.
    Reject(RejectType),
    /// `ct mark set N`.
    CtMarkSet(u32),
    /// `meta mark set ct mark`.
    MetaMarkFromCtMark,
    /// `tcp option maxseg size set N|rt mtu`.
    MssSet(Option<u16>),
    /// `notrack`.
    Notrack,
    /// `snat`/`dnat` (`family` given in inet tables).
    Nat {
        /// Destination NAT (else source).
        destination: bool,
        /// Family keyword for inet tables.
        family: Option<IpFamily>,
        /// Address or prefix mapping.
        target: NatTarget,
    },
    /// `masquerade`.
    Masquerade,
    /// `limit name "…"`: stops the rule when the named limit is exceeded.
    LimitRef(String),
    /// `ip daddr vmap @map`: jump to the chain the map gives for the key, if any.
    Vmap {
        /// What is looked up.
        key: Key,
        /// The verdict map's name.
        map: String,
    },
    /// `goto chain`: continue in `chain`, not coming back (the decided-flow cache's keep
    /// chain, [`crate::decided`]).
    Goto(String),
    /// `update @set { key }`: refresh the packet's element of a [`Set::timeout`] set.
    Update {
        /// The set's name.
        set: String,
        /// The packet's element.
        key: Key,
    },
    /// `log prefix "…" group N` (NFLOG: the packet goes to the listener of group N).
    Log {
        /// Prefix (what the event reader decodes: [`crate::events`]).
        prefix: String,
        /// NFLOG group.
        group: u16,
    },
}

/// One step of a transaction.
#[derive(Clone, Debug, PartialEq)]
pub enum Command<'a> {
    /// Create the table and everything in it (it must not exist).
    Create(&'a Table),
    /// Replace the table wholesale in the same transaction (add, delete, create).
    Recreate(&'a Table),
    /// Delete a table.
    Delete {
        /// Family.
        family: TableFamily,
        /// Name.
        name: String,
    },
    /// Add an empty table; nothing happens when it exists (the emergency switch's record).
    AddTable {
        /// Family.
        family: TableFamily,
        /// Name.
        name: String,
    },
    /// Insert a rule at the head of its chain, in a table of any owner (the switch's accept).
    InsertRule {
        /// Family.
        family: TableFamily,
        /// Table.
        table: String,
        /// The rule.
        rule: Rule,
    },
    /// Delete one rule by the handle the kernel listed it with.
    DeleteRule {
        /// Family.
        family: TableFamily,
        /// Table.
        table: String,
        /// Chain.
        chain: String,
        /// Handle.
        handle: u64,
    },
    /// Add elements to a set.
    AddElements {
        /// Table.
        table: &'a Table,
        /// Set name.
        set: &'a str,
        /// Elements.
        elements: Vec<Element>,
    },
    /// Remove every element of a set (a decided-flow cache's, [`crate::decided`]).
    FlushSet {
        /// Table.
        table: &'a Table,
        /// Set name.
        set: &'a str,
    },
    /// Remove elements from a set.
    DeleteElements {
        /// Table.
        table: &'a Table,
        /// Set name.
        set: &'a str,
        /// Elements.
        elements: Vec<Element>,
    },
}

impl Command<'_> {
    /// Set elements this command adds or removes.
    pub fn element_count(&self) -> usize {
        match self {
            Self::AddElements { elements, .. } | Self::DeleteElements { elements, .. } => {
                elements.len()
            }
            _ => 0,
        }
    }
}

/// One canonical address range as an element: a host, a prefix, or a range.
pub(crate) fn addr_elem(family: IpFamily, r: peerwall_policy::ir::AddrRange) -> Element {
    let text = peerwall_policy::ir::addr::format_range(family, r);
    let lo = peerwall_policy::ir::addr::u128_to_addr(family, r.lo);
    if text.contains('-') {
        Element::AddrRange(lo, peerwall_policy::ir::addr::u128_to_addr(family, r.hi))
    } else if let Some((_, len)) = text.split_once('/') {
        Element::Prefix(lo, len.parse().unwrap_or(0))
    } else {
        Element::Addr(lo)
    }
}
