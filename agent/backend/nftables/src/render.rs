//! IR → the typed nftables model ([`crate::model`]).
//!
//! One table per FirewallConfiguration. Address lists of more than one value and all table
//! sets become named sets (never one rule per address): hash sets when they hold hosts,
//! interval sets when they hold prefixes or ranges; port lists are anonymous sets. Runs of rules
//! that differ only in inline addresses, ports and protocols become one lookup ([`merge`]).
//! Every rule carries its name as comment (a merged one, its rules' names), and a counter when
//! asked. Ownership: every table holds the marker chain [`MARKER_CHAIN`] naming its owner;
//! peerwall only ever modifies tables that carry it. Pure: data in, data out.

use peerwall_policy::ir::{
    self, Action, AddrSet, Dir, IfDir, NatAction, PortSet, SetElements, Source, TableFamily, Test,
    VerdictAction,
};

mod negations;

use crate::events;
use crate::merge;
use crate::model::addr_elem;
use crate::model::{
    Chain, Element, EventLimit, Expr, Key, KeyType, Policy, RejectType, Right, Rule, Set, Table,
    EVENT_LIMIT,
};
pub use crate::model::{AUTO_SET_PREFIX, MARKER_CHAIN, MARKER_PREFIX};
use peerwall_backend::EventKind;

/// Rendering options.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenderOptions {
    /// Put a counter on every rule (the probe engine reads them to tell which rule decided).
    pub force_counters: bool,
    /// Report events through NFLOG ([`crate::events`]); None: no log rules.
    pub events: Option<EventOptions>,
    /// Keep long runs of address lookups as they are instead of dispatching them through a
    /// verdict map ([`crate::dispatch`]): what the benchmark compares dispatch against.
    pub linear: bool,
    /// No decided-flow cache ([`crate::decided`]): every packet walks its chains, as the
    /// benchmark's comparison row does. The cache is also off where counters are forced (the
    /// probe reads which rule decided every packet) and in tables in audit mode.
    pub no_flow_cache: bool,
}

/// How events are logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventOptions {
    /// NFLOG group the agent listens on.
    pub group: u16,
    /// Events per second per table (a named limit every log rule of the table shares).
    pub rate: u32,
    /// Burst of that limit.
    pub burst: u32,
    /// Also log the first packet of each accepted flow (`ct state new`), per accepting chain.
    pub flow_log: bool,
}

/// The rendered form of a table (the typed model).
pub type RenderedTable = Table;

/// Longest run of adjacent addresses still expanded into single hash-set elements (random pod
/// IPs often sit next to each other; canonical ranges merge them).
pub const HASH_RUN_MAX: u128 = 16;
/// Largest hash set produced by expanding runs.
const HASH_MAX_ELEMENTS: u128 = 4_000_000;

fn addr_elems(set: &AddrSet) -> Vec<Element> {
    set.ranges()
        .iter()
        .map(|r| addr_elem(set.family(), *r))
        .collect()
}

/// Whether a named address set renders as a hash set of single addresses (hosts and short runs
/// of hosts) rather than an interval set. O(ranges), no allocation.
pub fn renders_as_hash(set: &AddrSet) -> bool {
    let runs_are_short = set.ranges().iter().all(|r| r.hi - r.lo < HASH_RUN_MAX);
    runs_are_short && addresses(set) <= HASH_MAX_ELEMENTS
}

/// How many addresses `set` holds.
fn addresses(set: &AddrSet) -> u128 {
    set.ranges().iter().map(|r| r.hi - r.lo + 1).sum()
}

/// How many elements a set that [`renders_as_hash`] has: its addresses.
pub fn hash_len(set: &AddrSet) -> usize {
    usize::try_from(addresses(set)).unwrap_or(usize::MAX)
}

/// The elements that edit `edit` removes from and adds to a rendered address set (`hash`:
/// expanded into single addresses, as [`renders_as_hash`] sets are), net of each other.
pub fn edit_elements(
    family: ir::IpFamily,
    edit: &ir::RangeEdit,
    hash: bool,
) -> (Vec<Element>, Vec<Element>) {
    if !hash {
        let one = |r: &ir::AddrRange| addr_elem(family, *r);
        return (
            edit.removed.iter().map(one).collect(),
            edit.added.iter().map(one).collect(),
        );
    }
    let expand = |rs: &std::collections::BTreeSet<ir::AddrRange>| {
        rs.iter()
            .flat_map(|r| r.lo..=r.hi)
            .collect::<std::collections::BTreeSet<u128>>()
    };
    let (gone, new) = (expand(&edit.removed), expand(&edit.added));
    let elem = |a: &u128| Element::Addr(ir::addr::u128_to_addr(family, *a));
    (
        gone.difference(&new).map(elem).collect(),
        new.difference(&gone).map(elem).collect(),
    )
}

/// A named address set: a hash set of single addresses when the set is made of hosts and short
/// runs of hosts, an interval set otherwise.
fn addr_set(name: String, set: &AddrSet) -> Set {
    let family = set.family();
    if renders_as_hash(set) {
        let elements = set
            .ranges()
            .iter()
            .flat_map(|r| {
                (r.lo..=r.hi).map(move |a| Element::Addr(ir::addr::u128_to_addr(family, a)))
            })
            .collect();
        Set {
            name,
            key: KeyType::of(family),
            interval: false,
            elements,
            counter: false,
            comments: Vec::new(),
            verdict_map: false,
            timeout: None,
        }
    } else {
        Set {
            name,
            key: KeyType::of(family),
            interval: true,
            elements: addr_elems(set),
            counter: false,
            comments: Vec::new(),
            verdict_map: false,
            timeout: None,
        }
    }
}

/// The protocols whose packets carry ports (the guard in front of a port match).
const PORT_PROTOS: [u8; 3] = [
    ir::eval::proto::TCP,
    ir::eval::proto::UDP,
    ir::eval::proto::SCTP,
];

fn port_elems(set: &PortSet) -> Vec<Element> {
    set.ranges()
        .iter()
        .map(|&(a, b)| {
            if a == b {
                Element::Port(a)
            } else {
                Element::PortRange(a, b)
            }
        })
        .collect()
}

/// One value, or an anonymous set of several.
fn one_or_set(mut elements: Vec<Element>) -> Right {
    if elements.len() == 1 {
        Right::Element(elements.remove(0))
    } else {
        Right::Elements(elements)
    }
}

/// Whether `e` is the guard [`match_exprs`] puts in front of a port match.
fn is_port_guard(e: &Expr) -> bool {
    matches!(e, Expr::Match { negate: false, left: Key::L4Proto, right: Right::Protos(p) } if p.as_slice() == PORT_PROTOS)
}

/// Leave out each port guard that an earlier protocol match of the same rule implies
/// (`meta l4proto udp meta l4proto { tcp, udp, sctp } th dport 8080` reads the protocol
/// twice, the second time in an anonymous set): a packet that reaches the guard already
/// passed a test only port-carrying protocols pass.
fn drop_implied_port_guards(exprs: &mut Vec<Expr>) {
    let mut implied = false;
    exprs.retain(|e| {
        if is_port_guard(e) {
            return !implied;
        }
        if let Expr::Match {
            negate: false,
            left: Key::L4Proto,
            right: Right::Protos(p),
        } = e
        {
            implied |= !p.is_empty() && p.iter().all(|x| PORT_PROTOS.contains(x));
        }
        true
    });
}

/// The statements of one IR match. Inline lists of more than one address become a named set
/// of the table (`sets` grows; `auto_name` names it).
fn match_exprs(m: &ir::Match, sets: &mut Vec<Set>, auto_name: impl Fn() -> String) -> Vec<Expr> {
    let negate = m.negate;
    match &m.test {
        Test::Addr { dir, set, source } => {
            let right = match source {
                Source::Named(n) => Right::SetRef(n.clone()),
                Source::Inline { count } if *count > 1 => {
                    let name = auto_name();
                    sets.push(addr_set(name.clone(), set));
                    Right::SetRef(name)
                }
                Source::Inline { .. } => one_or_set(addr_elems(set)),
            };
            let left = Key::Addr {
                family: set.family(),
                source: *dir == Dir::Src,
            };
            vec![Expr::Match {
                negate,
                left,
                right,
            }]
        }
        Test::Port { dir, set, source } => {
            let right = match source {
                Source::Named(n) => Right::SetRef(n.clone()),
                Source::Inline { .. } => one_or_set(port_elems(set)),
            };
            vec![
                // Ports exist only for TCP, UDP and SCTP: ICMP never satisfies a port match.
                Expr::Match {
                    negate: false,
                    left: Key::L4Proto,
                    right: Right::Protos(PORT_PROTOS.to_vec()),
                },
                Expr::Match {
                    negate,
                    left: Key::Port {
                        source: *dir == Dir::Src,
                    },
                    right,
                },
            ]
        }
        Test::Proto(list) => vec![Expr::Match {
            negate,
            left: Key::L4Proto,
            right: Right::Protos(list.clone()),
        }],
        Test::Iface {
            dir,
            name,
            wildcard,
        } => vec![Expr::Match {
            negate,
            left: if *dir == IfDir::In {
                Key::IifName
            } else {
                Key::OifName
            },
            right: Right::IfName(if *wildcard {
                format!("{name}*")
            } else {
                name.clone()
            }),
        }],
        Test::CtState(mask) => vec![Expr::Match {
            negate,
            left: Key::CtState,
            right: Right::CtStates(
                ir::CtState::ALL
                    .iter()
                    .copied()
                    .filter(|s| mask & s.bit() != 0)
                    .collect(),
            ),
        }],
    }
}

/// The statements of an action.
fn action_exprs(a: &Action, family: TableFamily) -> Vec<Expr> {
    match a {
        Action::Verdict(VerdictAction::Accept) => vec![Expr::Accept],
        Action::Verdict(VerdictAction::Drop) => vec![Expr::Drop],
        Action::Verdict(VerdictAction::Reject) => vec![Expr::Reject(match family {
            TableFamily::Inet => RejectType::Icmpx,
            TableFamily::Ip => RejectType::Icmp,
            TableFamily::Ip6 => RejectType::Icmpv6,
        })],
        Action::CtMark(v) => vec![Expr::CtMarkSet(*v)],
        Action::MetaMarkFromCtMark => vec![Expr::MetaMarkFromCtMark],
        Action::TcpMssClamp(v) => vec![
            Expr::Match {
                negate: false,
                left: Key::TcpFlags,
                right: Right::Syn,
            },
            Expr::MssSet(*v),
        ],
        Action::Notrack => vec![Expr::Notrack],
        Action::Nat(NatAction::Masquerade) => vec![Expr::Masquerade],
        Action::Nat(NatAction::Dnat(t) | NatAction::Snat(t)) => vec![Expr::Nat {
            destination: matches!(a, Action::Nat(NatAction::Dnat(_))),
            family: (family == TableFamily::Inet).then(|| t.family()),
            target: *t,
        }],
    }
}

/// The chain; an audited chain's drop policy is accept (its would-drops are logged).
fn chain_of(c: &ir::Chain, audited: bool) -> Chain {
    Chain {
        name: c.name.clone(),
        kind: c.kind,
        hook: c.hook,
        priority: c.priority,
        policy: if c.policy == VerdictAction::Drop && !audited {
            Policy::Drop
        } else {
            Policy::Accept
        },
    }
}

/// The log statements of an event of `kind` decided by `rule` (None: the policy) of chain `c`
/// of table `t`, placed before the deciding rule (or at the chain's end): matches are the
/// deciding rule's, the flow log adds `ct state new`. The named limit ends the rule when
/// exceeded, so the deciding rule that follows always runs.
fn log_exprs(
    ev: &EventOptions,
    kind: EventKind,
    t: &ir::Table,
    c: &ir::Chain,
    rule: Option<&str>,
) -> Vec<Expr> {
    let mut v = Vec::new();
    if kind == EventKind::Accept {
        v.push(Expr::Match {
            negate: false,
            left: Key::CtState,
            right: Right::CtStates(vec![ir::CtState::New]),
        });
    }
    v.push(Expr::LimitRef(EVENT_LIMIT.to_string()));
    v.push(Expr::Log {
        prefix: events::prefix(kind, &t.name, &c.name, rule),
        group: ev.group,
    });
    v
}

/// Whether events of `kind` are logged.
fn logs(ev: &EventOptions, kind: EventKind) -> bool {
    kind != EventKind::Accept || ev.flow_log
}

/// The one rule of a merged run ([`merge`]): the matches its rules share, the TCP/UDP guard
/// when the key reads ports without a protocol column, one lookup in its set (added to
/// `sets`), the run's action.
fn merged_rule(
    t: &ir::Table,
    ci: usize,
    c: &ir::Chain,
    m: merge::Merged,
    sets: &mut Vec<Set>,
) -> Rule {
    let first = m.rules.start;
    let r = &c.rules[first];
    let mut exprs = Vec::new();
    for &mi in &m.shared {
        exprs.extend(match_exprs(&r.matches[mi], sets, || {
            format!("{AUTO_SET_PREFIX}{ci}_{first}_{mi}")
        }));
    }
    if m.port_guard {
        exprs.push(Expr::Match {
            negate: false,
            left: Key::L4Proto,
            right: Right::Protos(PORT_PROTOS.to_vec()),
        });
    }
    drop_implied_port_guards(&mut exprs);
    negations::keep_negations_apart(&mut exprs);
    let name = format!("{AUTO_SET_PREFIX}m{ci}_{first}");
    let (elements, comments) = m
        .elements
        .into_iter()
        .map(|(e, ri)| (e, c.rules[ri].name.clone()))
        .unzip();
    sets.push(Set {
        name: name.clone(),
        key: m.key_type,
        interval: true,
        elements,
        counter: m.counter,
        comments,
        verdict_map: false,
        timeout: None,
    });
    exprs.push(Expr::Match {
        negate: false,
        left: m.key,
        right: Right::SetRef(name),
    });
    exprs.extend(action_exprs(&r.action, t.family));
    let names: Vec<&str> = c.rules[m.rules].iter().map(|r| r.name.as_str()).collect();
    Rule {
        chain: c.name.clone(),
        comment: merge::comment(&names),
        exprs,
    }
}

/// Render one IR table.
pub fn render_table(t: &ir::Table, opts: RenderOptions) -> Table {
    let mut sets: Vec<Set> = t
        .sets
        .iter()
        .map(|s| match &s.elements {
            SetElements::Addr(a) => addr_set(s.name.clone(), a),
            SetElements::Port(p) => Set {
                name: s.name.clone(),
                key: KeyType::InetService,
                interval: true,
                elements: port_elems(p),
                counter: false,
                comments: Vec::new(),
                verdict_map: false,
                timeout: None,
            },
        })
        .collect();
    let mut rules = Vec::new();
    for (ci, c) in t.chains.iter().enumerate() {
        let audited = t.audit && c.kind == ir::ChainKind::Filter;
        // Rules seen one by one (event log rules, audit) are never merged.
        let observed = |r: &ir::Rule| {
            audited
                || opts.events.as_ref().is_some_and(|ev| {
                    r.action
                        .verdict()
                        .is_some_and(|v| logs(ev, EventKind::of(v, audited)))
                })
        };
        let counts = |r: &ir::Rule| r.counter || opts.force_counters;
        for step in merge::plan_chain(c, observed, counts) {
            let ri = match step {
                merge::Step::Rule(ri) => ri,
                merge::Step::Merged(m) => {
                    rules.push(merged_rule(t, ci, c, m, &mut sets));
                    continue;
                }
            };
            let r = &c.rules[ri];
            let mut exprs = Vec::new();
            for (mi, m) in r.matches.iter().enumerate() {
                exprs.extend(match_exprs(m, &mut sets, || {
                    format!("{AUTO_SET_PREFIX}{ci}_{ri}_{mi}")
                }));
            }
            drop_implied_port_guards(&mut exprs);
            negations::keep_negations_apart(&mut exprs);
            let verdict = r.action.verdict();
            let kind = verdict.map(|v| EventKind::of(v, audited));
            if let (Some(ev), Some(kind)) = (&opts.events, kind) {
                if logs(ev, kind) {
                    let mut log = exprs.clone();
                    log.extend(log_exprs(ev, kind, t, c, Some(&r.name)));
                    rules.push(Rule {
                        chain: c.name.clone(),
                        comment: r.name.clone(),
                        exprs: log,
                    });
                }
            }
            if r.counter || opts.force_counters {
                exprs.push(Expr::Counter);
            }
            if audited && matches!(verdict, Some(VerdictAction::Drop | VerdictAction::Reject)) {
                // A would-drop: the chain accepts.
                exprs.push(Expr::Accept);
            } else {
                exprs.extend(action_exprs(&r.action, t.family));
            }
            rules.push(Rule {
                chain: c.name.clone(),
                comment: r.name.clone(),
                exprs,
            });
        }
        if let Some(ev) = &opts.events {
            let kind = EventKind::of(c.policy, audited);
            if c.kind == ir::ChainKind::Filter && logs(ev, kind) {
                rules.push(Rule {
                    chain: c.name.clone(),
                    comment: String::new(),
                    exprs: log_exprs(ev, kind, t, c, None),
                });
            }
        }
    }
    let mut table = Table {
        name: t.name.clone(),
        family: t.family,
        owner: sanitize_owner(&t.origin.0),
        sets,
        chains: t
            .chains
            .iter()
            .map(|c| chain_of(c, t.audit && c.kind == ir::ChainKind::Filter))
            .collect(),
        regular: Vec::new(),
        dispatch_maps: Vec::new(),
        rules,
        event_limit: opts.events.map(|e| EventLimit {
            rate: e.rate,
            burst: e.burst,
        }),
    };
    if !opts.linear {
        crate::dispatch::dispatch(&mut table);
    }
    if !opts.no_flow_cache && !opts.force_counters && !t.audit {
        crate::decided::add(&mut table);
    }
    table
}

fn sanitize_owner(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() || c == '"' || c == '\\' {
                '_'
            } else {
                c
            }
        })
        .take(100)
        .collect()
}

/// Render a whole policy.
pub fn render_policy(p: &ir::Policy, opts: RenderOptions) -> Vec<Table> {
    p.tables.iter().map(|t| render_table(t, opts)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::ir::IpFamily;

    fn set(nets: &[&str]) -> AddrSet {
        AddrSet::from_nets(IpFamily::V4, nets.iter().map(|n| n.parse().unwrap()))
    }

    fn addr(a: &str) -> Element {
        Element::Addr(a.parse().unwrap())
    }

    #[test]
    fn hosts_become_a_hash_set_and_prefixes_an_interval_set() {
        let hosts = addr_set(
            "s".into(),
            &set(&["10.0.0.1/32", "10.0.0.2/32", "10.0.0.9/32"]),
        );
        assert!(!hosts.interval);
        assert_eq!(
            hosts.elements,
            vec![addr("10.0.0.1"), addr("10.0.0.2"), addr("10.0.0.9")]
        );
        let nets = addr_set("s".into(), &set(&["10.0.0.0/24", "10.1.0.1/32"]));
        assert!(nets.interval);
        assert_eq!(
            nets.elements[0],
            Element::Prefix("10.0.0.0".parse().unwrap(), 24)
        );
        // A short run of adjacent hosts (canonical ranges merge them) stays a hash set; a
        // longer one does not.
        let run = addr_set("s".into(), &set(&["10.0.0.0/29"]));
        assert!(!run.interval && run.elements.len() == 8);
        assert!(addr_set("s".into(), &set(&["10.0.0.0/27"])).interval);
        assert!(!addr_set("s".into(), &AddrSet::from_nets(IpFamily::V4, [])).interval);
    }

    fn proto(negate: bool, p: &[u8]) -> Expr {
        Expr::Match {
            negate,
            left: Key::L4Proto,
            right: Right::Protos(p.to_vec()),
        }
    }

    fn dport() -> Expr {
        Expr::Match {
            negate: false,
            left: Key::Port { source: false },
            right: Right::Element(Element::Port(8080)),
        }
    }

    #[test]
    fn a_port_guard_goes_only_where_an_earlier_protocol_match_implies_it() {
        use ir::eval::proto::{ICMP, TCP, UDP};
        let guard = || proto(false, &PORT_PROTOS);
        let kept = |mut v: Vec<Expr>| {
            drop_implied_port_guards(&mut v);
            v
        };
        // `meta l4proto udp` before: the guard reads the protocol a second time for nothing.
        assert_eq!(
            kept(vec![proto(false, &[UDP]), guard(), dport()]),
            [proto(false, &[UDP]), dport()]
        );
        assert_eq!(
            kept(vec![proto(false, &[TCP, UDP]), guard(), dport()]),
            [proto(false, &[TCP, UDP]), dport()]
        );
        // Nothing before, a protocol that carries no ports, a negated test, or the test after
        // the guard: it stays.
        for v in [
            vec![guard(), dport()],
            vec![proto(false, &[UDP, ICMP]), guard(), dport()],
            vec![proto(true, &[UDP]), guard(), dport()],
            vec![guard(), dport(), proto(false, &[UDP])],
            vec![proto(false, &[]), guard(), dport()],
        ] {
            assert_eq!(kept(v.clone()), v);
        }
    }

    #[test]
    fn ranges_that_are_not_prefixes_stay_ranges() {
        let s = AddrSet::from_ranges(
            IpFamily::V4,
            vec![ir::AddrRange {
                lo: ir::addr::addr_to_u128(&"10.0.0.3".parse().unwrap()),
                hi: ir::addr::addr_to_u128(&"10.0.0.200".parse().unwrap()),
            }],
        );
        assert_eq!(
            addr_elems(&s),
            vec![Element::AddrRange(
                "10.0.0.3".parse().unwrap(),
                "10.0.0.200".parse().unwrap()
            )]
        );
    }
}
