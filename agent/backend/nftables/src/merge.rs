//! Rule merging: a run of consecutive rules of a chain that differ only in their inline
//! addresses, ports and protocols, and share one verdict, becomes one rule looking the packet
//! up in one set keyed by the concatenation of the fields that tell the rules apart (`ip daddr
//! . th dport @set`, an interval set: the kernel's pipapo); fields with the same values in
//! every rule stay matches of their own. A packet then pays one lookup where it paid one
//! evaluation per rule (a 64-rule policy is one lookup, as kube-proxy's nftables backend turns
//! its services into one verdict map).
//!
//! The verdict is the same for every packet: the rules of a run share their verdict and their
//! other matches, so "the first rule of the run that matches" and "some rule of the run
//! matches" decide alike, and a rule's elements are exactly the boxes (protocol × addresses ×
//! ports) it matches. The kernel refuses overlapping elements, so a rule whose boxes overlap an
//! earlier rule's in the run ends the run (the verdict would not change, but the set could not
//! be loaded).
//!
//! Counters stay per rule: a run of counting rules gets a counter on every element of its set,
//! each element commented with its rule's name, and a packet matches one element only (they
//! are disjoint), so the elements of a rule count exactly the packets the rule would have
//! (`rule_counters` adds them up per rule). Rules something else observes one by one are never
//! merged: those with an event log rule in front of them, those of an audited chain. Pure: data
//! in, data out.

use std::ops::Range;

use peerwall_policy::ir::{self, eval::proto, Action, Dir, IpFamily, Source, Test, VerdictAction};

use crate::model::addr_elem;
use crate::model::{proto_keyword, AddrPart, Columns, Element, Key, KeyType, Tuple};

/// Fewest rules worth a lookup: below this, evaluating the rules is as cheap.
pub const MERGE_MIN_RULES: usize = 4;
/// Most elements in one merged set (a rule whose fields multiply past this is never merged).
pub const MERGE_MAX_ELEMENTS: usize = 2048;

/// How the rules of a chain are rendered, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Rule `i` on its own.
    Rule(usize),
    /// A merged run.
    Merged(Merged),
}

/// A run of rules rendered as one.
#[derive(Clone, Debug, PartialEq)]
pub struct Merged {
    /// The rules (indices in the chain).
    pub rules: Range<usize>,
    /// Indices, in the first rule's matches, of the matches every rule of the run shares
    /// (rendered as they are, before the lookup).
    pub shared: Vec<usize>,
    /// Whether the lookup needs the TCP/UDP guard in front of it: it reads ports and has no
    /// protocol column to restrict them to TCP and UDP.
    pub port_guard: bool,
    /// The lookup's key.
    pub key: Key,
    /// Its set's key type.
    pub key_type: KeyType,
    /// The set's elements, each with the index of the rule it stands for (sorted).
    pub elements: Vec<(Element, usize)>,
    /// Whether the rules count (a counter on every element).
    pub counter: bool,
}

/// A merged rule's comment: the names of its rules, as many as fit nft's 128 bytes.
pub fn comment(names: &[&str]) -> String {
    let all = names.join(", ");
    if all.len() <= 120 {
        return all;
    }
    let (first, last) = (names[0], names[names.len() - 1]);
    let both = format!("{first} … {last}");
    if both.len() <= 120 {
        return both;
    }
    format!("{first} …")
}

/// A field the merged key can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Column {
    Proto,
    Addr(Dir, IpFamily),
    Port(Dir),
}

/// One position of a rule's matches: a column, or a match kept as it is.
#[derive(Clone, Debug, PartialEq)]
enum Slot<'a> {
    Column(Column),
    Kept(&'a ir::Match),
}

/// A rule's values in each column (None: the column is not in its shape).
#[derive(Clone, Debug, Default)]
struct Values {
    protos: Option<Vec<u8>>,
    saddr: Option<Vec<ir::AddrRange>>,
    daddr: Option<Vec<ir::AddrRange>>,
    sport: Option<Vec<(u16, u16)>>,
    dport: Option<Vec<(u16, u16)>>,
}

/// A rule that may join a run: its shape and values.
struct Candidate<'a> {
    slots: Vec<Slot<'a>>,
    values: Values,
    family: Option<IpFamily>,
    action: &'a Action,
}

impl Candidate<'_> {
    /// Whether `other` may follow this rule in a run: same verdict, same kept matches, same
    /// columns.
    fn joins(&self, other: &Candidate<'_>) -> bool {
        other.action == self.action
            && other.slots == self.slots
            && columns(other).is_some_and(|c| Some(c) == columns(self))
    }
}

/// Put a test's values into its column; false when the rule already filled it (two tests of
/// one field: the rule is not merged).
fn fill<T: Clone>(column: &mut Option<Vec<T>>, values: &[T]) -> bool {
    if column.is_some() {
        return false;
    }
    *column = Some(values.to_vec());
    true
}

fn candidate(r: &ir::Rule) -> Option<Candidate<'_>> {
    if !matches!(
        r.action,
        Action::Verdict(VerdictAction::Accept | VerdictAction::Drop | VerdictAction::Reject)
    ) {
        return None;
    }
    let mut v = Values::default();
    let mut family = None;
    let mut slots = Vec::with_capacity(r.matches.len());
    for m in &r.matches {
        let column = match &m.test {
            // Protocols nft lists by the names peerwall writes (drift compares elements as
            // listed); others stay matches of their own.
            Test::Proto(list)
                if !m.negate
                    && v.protos.is_none()
                    && list.iter().all(|&p| proto_keyword(p).is_some()) =>
            {
                v.protos = Some(list.clone());
                Some(Column::Proto)
            }
            Test::Addr {
                dir,
                set,
                source: Source::Inline { .. },
            } if !m.negate => {
                if family.is_some_and(|f| f != set.family()) {
                    return None;
                }
                family = Some(set.family());
                let column = match dir {
                    Dir::Src => &mut v.saddr,
                    Dir::Dst => &mut v.daddr,
                };
                if !fill(column, set.ranges()) {
                    return None;
                }
                Some(Column::Addr(*dir, set.family()))
            }
            Test::Port {
                dir,
                set,
                source: Source::Inline { .. },
            } if !m.negate => {
                let column = match dir {
                    Dir::Src => &mut v.sport,
                    Dir::Dst => &mut v.dport,
                };
                if !fill(column, set.ranges()) {
                    return None;
                }
                Some(Column::Port(*dir))
            }
            _ => None,
        };
        slots.push(match column {
            Some(c) => Slot::Column(c),
            None => Slot::Kept(m),
        });
    }
    Some(Candidate {
        slots,
        values: v,
        family,
        action: &r.action,
    })
}

/// The columns of a shape; None when it has no column worth a lookup.
fn columns(c: &Candidate<'_>) -> Option<Columns> {
    let v = &c.values;
    let cols = Columns {
        proto: v.protos.is_some(),
        family: c.family.unwrap_or(IpFamily::V4),
        saddr: v.saddr.is_some(),
        daddr: v.daddr.is_some(),
        sport: v.sport.is_some(),
        dport: v.dport.is_some(),
    };
    // A protocol alone is one small list: nothing to gain.
    (cols.saddr || cols.daddr || cols.sport || cols.dport).then_some(cols)
}

/// One element as inclusive ranges per column: protocol, source, destination, ports.
type Bounds = [(u128, u128); 5];

fn overlap(a: &Bounds, b: &Bounds) -> bool {
    a.iter().zip(b).all(|(x, y)| x.0 <= y.1 && y.0 <= x.1)
}

/// The boxes a rule matches (each a product of one value per column). Protocols other than
/// TCP and UDP are left out when the rule tests ports: a port test never holds on them.
fn boxes(v: &Values, limit: usize) -> Option<Vec<Bounds>> {
    let all = (0u128, u128::MAX);
    let protos: Vec<(u128, u128)> = match &v.protos {
        Some(ps) => {
            // Distinct elements only: the kernel refuses a duplicate.
            let distinct: std::collections::BTreeSet<u8> = ps
                .iter()
                .copied()
                .filter(|&p| (v.sport.is_none() && v.dport.is_none()) || proto::carries_ports(p))
                .collect();
            distinct
                .into_iter()
                .map(|p| (u128::from(p), u128::from(p)))
                .collect()
        }
        None => vec![all],
    };
    let addrs = |a: &Option<Vec<ir::AddrRange>>| match a {
        Some(rs) => rs.iter().map(|r| (r.lo, r.hi)).collect(),
        None => vec![all],
    };
    let ports = |p: &Option<Vec<(u16, u16)>>| match p {
        Some(rs) => rs
            .iter()
            .map(|&(a, b)| (u128::from(a), u128::from(b)))
            .collect(),
        None => vec![all],
    };
    let cols: [Vec<(u128, u128)>; 5] = [
        protos,
        addrs(&v.saddr),
        addrs(&v.daddr),
        ports(&v.sport),
        ports(&v.dport),
    ];
    let n = cols
        .iter()
        .try_fold(1usize, |n, c| n.checked_mul(c.len()))?;
    if n > limit {
        return None;
    }
    let mut out = vec![[all; 5]];
    for (i, c) in cols.iter().enumerate() {
        out = out
            .iter()
            .flat_map(|b| {
                c.iter().map(move |&r| {
                    let mut nb = *b;
                    nb[i] = r;
                    nb
                })
            })
            .collect();
    }
    Some(out)
}

/// The set element of box `b` under `cols`.
fn element(cols: Columns, b: &Bounds) -> Element {
    let addr = |on: bool, (lo, hi): (u128, u128)| {
        on.then(|| match addr_elem(cols.family, ir::AddrRange { lo, hi }) {
            Element::Prefix(a, l) => AddrPart::Prefix(a, l),
            Element::AddrRange(a, z) => AddrPart::Range(a, z),
            Element::Addr(a) => AddrPart::Addr(a),
            // addr_elem gives addresses only.
            _ => AddrPart::Range(
                ir::addr::u128_to_addr(cols.family, lo),
                ir::addr::u128_to_addr(cols.family, hi),
            ),
        })
    };
    let port = |(lo, hi): (u128, u128)| (lo as u16, hi as u16);
    let t = Tuple {
        columns: cols,
        proto: b[0].0 as u8,
        saddr: addr(cols.saddr, b[1]),
        daddr: addr(cols.daddr, b[2]),
        sport: if cols.sport { port(b[3]) } else { (0, 0) },
        dport: if cols.dport { port(b[4]) } else { (0, 0) },
    };
    // One column: a plain set of that field.
    let only = [cols.proto, cols.saddr, cols.daddr, cols.sport, cols.dport]
        .iter()
        .filter(|&&c| c)
        .count()
        == 1;
    if !only {
        return Element::Tuple(t);
    }
    if let Some(a) = t.saddr.or(t.daddr) {
        return a.element();
    }
    let (lo, hi) = if cols.sport { t.sport } else { t.dport };
    if lo == hi {
        Element::Port(lo)
    } else {
        Element::PortRange(lo, hi)
    }
}

/// Whether field `f` holds the same values in every rule of `values`.
fn uniform<T: PartialEq>(values: &[Values], f: impl Fn(&Values) -> &T) -> bool {
    values.iter().all(|v| f(v) == f(&values[0]))
}

/// The lookup key and set type of `cols`.
fn key_of(cols: Columns) -> (Key, KeyType) {
    let keys = cols.keys();
    if let [one] = keys.as_slice() {
        let ty = match one {
            Key::Port { .. } => KeyType::InetService,
            _ => KeyType::of(cols.family),
        };
        return (*one, ty);
    }
    (Key::Tuple(cols), KeyType::Tuple(cols))
}

/// Plan the rendering of chain `c`: which rules merge into runs. `observed(rule)` says whether
/// something looks at the rule on its own (an event log rule): such rules are never merged.
/// `counts(rule)`: whether the rule counts (a run's rules all count, or none does).
pub fn plan_chain(
    c: &ir::Chain,
    observed: impl Fn(&ir::Rule) -> bool,
    counts: impl Fn(&ir::Rule) -> bool,
) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut i = 0;
    while i < c.rules.len() {
        let Some((run, merged)) = run_at(c, i, &observed, &counts) else {
            steps.push(Step::Rule(i));
            i += 1;
            continue;
        };
        steps.push(Step::Merged(merged));
        i = run.end;
    }
    steps
}

/// The longest mergeable run starting at rule `i`, if it has at least [`MERGE_MIN_RULES`].
fn run_at(
    c: &ir::Chain,
    i: usize,
    observed: &impl Fn(&ir::Rule) -> bool,
    counts: &impl Fn(&ir::Rule) -> bool,
) -> Option<(Range<usize>, Merged)> {
    let first = &c.rules[i];
    if observed(first) {
        return None;
    }
    let head = candidate(first)?;
    let cols = columns(&head)?;
    let counter = counts(first);
    // A rule that matches nothing (only protocols its port test excludes) has no element to
    // count in: it stays a rule.
    let mut all: Vec<(Bounds, usize)> = boxes(&head.values, MERGE_MAX_ELEMENTS)
        .filter(|b| !b.is_empty())?
        .into_iter()
        .map(|b| (b, i))
        .collect();
    // Each rule's values, for the columns every rule shares (below).
    let mut values = vec![head.values.clone()];
    let mut end = i + 1;
    while end < c.rules.len() {
        let r = &c.rules[end];
        if observed(r) || counts(r) != counter {
            break;
        }
        let Some(next) = candidate(r) else { break };
        if !head.joins(&next) {
            break;
        }
        let Some(b) = boxes(&next.values, MERGE_MAX_ELEMENTS - all.len()) else {
            break;
        };
        if b.is_empty() || b.iter().any(|x| all.iter().any(|(y, _)| overlap(x, y))) {
            break;
        }
        all.extend(b.into_iter().map(|b| (b, end)));
        values.push(next.values);
        end += 1;
    }
    if end - i < MERGE_MIN_RULES {
        return None;
    }
    // A column with the same values in every rule narrows nothing down: it stays a match of
    // its own (in front of the lookup), and the key is the columns that tell rules apart.
    let same = Columns {
        proto: cols.proto && uniform(&values, |v| &v.protos),
        family: cols.family,
        saddr: cols.saddr && uniform(&values, |v| &v.saddr),
        daddr: cols.daddr && uniform(&values, |v| &v.daddr),
        sport: cols.sport && uniform(&values, |v| &v.sport),
        dport: cols.dport && uniform(&values, |v| &v.dport),
    };
    let key_cols = Columns {
        proto: cols.proto && !same.proto,
        family: cols.family,
        saddr: cols.saddr && !same.saddr,
        daddr: cols.daddr && !same.daddr,
        sport: cols.sport && !same.sport,
        dport: cols.dport && !same.dport,
    };
    if !(key_cols.saddr || key_cols.daddr || key_cols.sport || key_cols.dport) {
        return None;
    }
    let kept = |s: &Slot<'_>| match s {
        Slot::Kept(_) => true,
        Slot::Column(Column::Proto) => same.proto,
        Slot::Column(Column::Addr(Dir::Src, _)) => same.saddr,
        Slot::Column(Column::Addr(Dir::Dst, _)) => same.daddr,
        Slot::Column(Column::Port(Dir::Src)) => same.sport,
        Slot::Column(Column::Port(Dir::Dst)) => same.dport,
    };
    let shared = head
        .slots
        .iter()
        .enumerate()
        .filter(|(_, s)| kept(s))
        .map(|(k, _)| k)
        .collect();
    // The ports need TCP, UDP or SCTP in front of the lookup unless a protocol already says
    // so: a protocol column (its elements carry ports only), or one kept protocol list of them.
    let ports_kept = same.proto
        && values[0]
            .protos
            .as_ref()
            .is_some_and(|ps| ps.iter().all(|&p| proto::carries_ports(p)));
    let (key, key_type) = key_of(key_cols);
    let mut elements: Vec<(Element, usize)> = all
        .iter()
        .map(|(b, r)| (element(key_cols, b), *r))
        .collect();
    elements.sort();
    // Boxes of one rule that differed only in a kept column.
    elements.dedup();
    Some((
        i..end,
        Merged {
            rules: i..end,
            shared,
            port_guard: (key_cols.sport || key_cols.dport) && !key_cols.proto && !ports_kept,
            key,
            key_type,
            elements,
            counter,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::ir::{AddrSet, Chain, ChainKind, Hook, Match, PortSet, Rule};

    fn addr(net: &str) -> Match {
        Match {
            negate: false,
            test: Test::Addr {
                dir: Dir::Dst,
                set: AddrSet::from_nets(IpFamily::V4, [net.parse().unwrap()]),
                source: Source::Inline { count: 1 },
            },
        }
    }

    fn port(lo: u16, hi: u16) -> Match {
        Match {
            negate: false,
            test: Test::Port {
                dir: Dir::Dst,
                set: PortSet::from_ranges([(lo, hi)]),
                source: Source::Inline { count: 1 },
            },
        }
    }

    fn iif() -> Match {
        Match {
            negate: false,
            test: Test::Iface {
                dir: ir::IfDir::In,
                name: "liqo-tunnel".into(),
                wildcard: false,
            },
        }
    }

    fn udp() -> Match {
        Match {
            negate: false,
            test: Test::Proto(vec![proto::UDP]),
        }
    }

    fn rule(name: &str, matches: Vec<Match>, v: VerdictAction) -> Rule {
        Rule {
            name: name.into(),
            matches,
            action: Action::Verdict(v),
            counter: false,
        }
    }

    fn chain(rules: Vec<Rule>) -> Chain {
        Chain {
            name: "c".into(),
            kind: ChainKind::Filter,
            hook: Hook::Forward,
            priority: 0,
            policy: VerdictAction::Drop,
            rules,
        }
    }

    /// The mixed benchmark's shape: interface, prefix, protocol, port range.
    fn mixed(n: usize) -> Vec<Rule> {
        (0..n)
            .map(|i| {
                rule(
                    &format!("r{i}"),
                    vec![
                        iif(),
                        addr(&format!("10.{}.0.0/16", 100 + i)),
                        udp(),
                        port(1000 + 10 * i as u16, 1005 + 10 * i as u16),
                    ],
                    VerdictAction::Accept,
                )
            })
            .collect()
    }

    #[test]
    fn a_run_of_same_shape_rules_becomes_one_lookup() {
        let mut rules = mixed(6);
        rules.push(rule("deny", vec![iif()], VerdictAction::Drop));
        let steps = plan_chain(&chain(rules), |_| false, |_| true);
        assert_eq!(steps.len(), 2, "{steps:?}");
        let Step::Merged(m) = &steps[0] else {
            panic!("{steps:?}")
        };
        assert_eq!(m.rules, 0..6);
        // The interface and the protocol (UDP in every rule) stay matches of their own; the
        // address and the port are the key, and UDP makes the TCP/UDP guard needless.
        assert_eq!(m.shared, vec![0, 2]);
        assert!(!m.port_guard);
        let Key::Tuple(cols) = m.key else {
            panic!("{:?}", m.key)
        };
        assert!(!cols.proto && cols.daddr && cols.dport && !cols.saddr && !cols.sport);
        assert_eq!(m.elements.len(), 6);
        // Each element stands for its rule, in the rules' order here (ascending prefixes).
        assert!(m.elements.iter().enumerate().all(|(k, (_, r))| *r == k));
        assert_eq!(steps[1], Step::Rule(6));
    }

    #[test]
    fn observed_rules_different_verdicts_and_short_runs_stay_rules() {
        // An observed rule (its event log rule) in the middle splits 8 rules into 3 + 1 + 4:
        // only the last run merges. So does a rule that counts among rules that do not.
        let rules = mixed(8);
        let split = [Step::Rule(0), Step::Rule(1), Step::Rule(2), Step::Rule(3)];
        let steps = plan_chain(&chain(rules.clone()), |r| r.name == "r3", |_| true);
        assert_eq!(steps[..4], split);
        assert!(matches!(&steps[4], Step::Merged(m) if m.rules == (4..8) && m.counter));
        let steps = plan_chain(&chain(rules.clone()), |_| false, |r| r.name == "r3");
        assert_eq!(steps[..4], split);
        assert!(matches!(&steps[4], Step::Merged(m) if m.rules == (4..8) && !m.counter));
        // A drop among accepts ends the run.
        let mut rules = mixed(8);
        rules[4].action = Action::Verdict(VerdictAction::Drop);
        let steps = plan_chain(&chain(rules), |_| false, |_| true);
        assert!(
            matches!(&steps[0], Step::Merged(m) if m.rules == (0..4)),
            "{steps:?}"
        );
        assert_eq!(steps[1], Step::Rule(4));
        assert_eq!(steps[2..], [Step::Rule(5), Step::Rule(6), Step::Rule(7)]);
    }

    #[test]
    fn an_overlapping_rule_ends_the_run() {
        let mut rules = mixed(5);
        // Same prefix and an overlapping port range as r1.
        rules.insert(
            2,
            rule(
                "dup",
                vec![iif(), addr("10.101.0.0/16"), udp(), port(1012, 1020)],
                VerdictAction::Accept,
            ),
        );
        let steps = plan_chain(&chain(rules), |_| false, |_| true);
        assert_eq!(steps[..2], [Step::Rule(0), Step::Rule(1)], "{steps:?}");
        assert!(matches!(&steps[2], Step::Merged(m) if m.rules == (2..6)));
    }

    #[test]
    fn ports_without_a_protocol_keep_the_guard_and_one_column_is_a_plain_set() {
        let rules: Vec<Rule> = (0..5)
            .map(|i| {
                rule(
                    &format!("p{i}"),
                    vec![port(100 * i + 1, 100 * i + 50)],
                    VerdictAction::Drop,
                )
            })
            .collect();
        let steps = plan_chain(&chain(rules), |_| false, |_| true);
        let Step::Merged(m) = &steps[0] else {
            panic!("{steps:?}")
        };
        assert!(m.port_guard);
        assert_eq!(m.key, Key::Port { source: false });
        assert_eq!(m.key_type, KeyType::InetService);
        assert_eq!(m.elements[0], (Element::PortRange(1, 50), 0));
    }

    #[test]
    fn protocols_a_port_test_never_matches_are_left_out() {
        let rules = |second: [u8; 2]| -> Vec<Rule> {
            (0..4)
                .map(|i| {
                    rule(
                        &format!("q{i}"),
                        vec![
                            Match {
                                negate: false,
                                test: Test::Proto(vec![proto::ICMP, second[i as usize % 2]]),
                            },
                            port(10 * i + 1, 10 * i + 1),
                        ],
                        VerdictAction::Accept,
                    )
                })
                .collect()
        };
        // Protocols that differ are a column: TCP and UDP elements only, no guard needed.
        let steps = plan_chain(&chain(rules([proto::TCP, proto::UDP])), |_| false, |_| true);
        let Step::Merged(m) = &steps[0] else {
            panic!("{steps:?}")
        };
        assert_eq!(m.elements.len(), 4);
        assert!(!m.port_guard && m.shared.is_empty());
        assert!(m.elements.iter().all(|(e, _)| matches!(
            e,
            Element::Tuple(t) if t.proto == proto::TCP || t.proto == proto::UDP
        )));
        // The same list everywhere is kept as a match; with ICMP in it, the guard stays.
        let steps = plan_chain(&chain(rules([proto::TCP, proto::TCP])), |_| false, |_| true);
        let Step::Merged(m) = &steps[0] else {
            panic!("{steps:?}")
        };
        assert!(m.port_guard && m.shared == [0]);
        assert_eq!(m.key, Key::Port { source: false });
    }

    #[test]
    fn comments_fit_nft() {
        assert_eq!(comment(&["a", "b"]), "a, b");
        let long: Vec<String> = (0..64).map(|i| format!("rule-{i}")).collect();
        let names: Vec<&str> = long.iter().map(String::as_str).collect();
        assert_eq!(comment(&names), "rule-0 … rule-63");
        let huge = "x".repeat(120);
        assert_eq!(comment(&[&huge, &huge]), format!("{huge} …"));
        assert!(comment(&[&huge, &huge]).len() <= 128);
    }
}
