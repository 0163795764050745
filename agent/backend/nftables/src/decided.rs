//! The decided-flow cache: a flow that a base chain's walk accepted is accepted again by one
//! lookup of its addresses, destination port and protocol, until the policy changes.
//!
//! A packet that conntrack never sees answered (one-way UDP, the first segments of a
//! connection) is `new` on every packet, so every packet walks the chain: at a thousand
//! NetworkPolicies that is the address dispatch and then one source lookup per rule of its
//! class. Here, a rule that accepts and tests nothing but the packet's addresses, destination
//! port and protocol goes to the chain's *keep* chain instead of accepting: that chain adds the
//! packet's key (`daddr . saddr . dport . l4proto`) to the chain's timeout set, then accepts.
//! A rule near the top of the chain accepts every packet whose key is in the set.
//!
//! **Why the lookup gives the walk's verdict.** Let packet P be accepted by rule R of a walk
//! that starts at the lookup's position, and P' have P's key. Every rule from that position on
//! either tests key fields only, or accepts (a rule that tests anything else — ct state, an
//! interface, the source port — with any other verdict or statement *pins*: the lookup goes
//! below the last such rule, or the chain gets no cache). R tests key fields only (it is one
//! of the rules that add). A rule before R that tests key fields only did not match P, so it
//! does not match P'; one that tests other fields accepts if it matches. So P' is accepted by
//! an earlier rule or reaches R and is accepted: the walk accepts P' too. Rules with no
//! verdict whose only effects are counting and logging (event rules, the flow log) change no
//! verdict and are skipped for cached packets, as an established connection skips them.
//!
//! **Revocation.** Every change to a table with a cache empties its sets in the same
//! transaction: a recreated table starts empty, and an in-place element edit
//! ([`crate::plan::elements_only`], [`crate::NftBackend::update_sets`]) carries
//! [`Command::FlushSet`] for them. Nothing decided under a policy outlives it, with one bound:
//! a packet judged by the old rules while the transaction commits can add its key after the
//! flush; its element expires after [`TIMEOUT_SECS`] (a lookup does not refresh it), and the
//! agent ends the tracked connections the new policy refuses ([`crate::ended`]), whose
//! packets that table drops before this one runs.
//!
//! **What it does not cover.** Accepts decided by the chain's policy, by rules that test other
//! fields (replies by `ct state`) and by tables in audit mode (their would-drops accept) are not
//! cached; packets whose ports cannot be read (non-first fragments) walk. A full set (its
//! size, [`crate::model::TIMEOUT_SET_CAPACITY`]) only means the walk: the keep chain's accept
//! is a rule of its own, so a failed add does not stop it. Rule counters count the packets
//! that walked; the lookup rule ([`RULE`]) counts the packets it accepted. Pure: data in, data
//! out.

use peerwall_policy::ir::{IpFamily, TableFamily};

use crate::model::{
    Columns, Command, Expr, Key, KeyType, Regular, Right, Rule, Set, Table, AUTO_SET_PREFIX,
};

/// How long a decision lasts after its walk (a lookup does not refresh it).
pub const TIMEOUT_SECS: u32 = 10;

/// The comment of the lookup rule and of the keep chain's rules.
pub const RULE: &str = "__pw_decided";

/// The key: destination and source address, destination port, protocol.
fn columns(family: IpFamily) -> Columns {
    Columns::flow(family, false)
}

/// The families a table of `f` holds packets of.
fn families(f: TableFamily) -> &'static [IpFamily] {
    match f {
        TableFamily::Ip => &[IpFamily::V4],
        TableFamily::Ip6 => &[IpFamily::V6],
        TableFamily::Inet => &[IpFamily::V4, IpFamily::V6],
    }
}

/// The set of base chain number `chain` for `family`.
pub fn set_name(chain: usize, family: IpFamily) -> String {
    let f = match family {
        IpFamily::V4 => 4,
        IpFamily::V6 => 6,
    };
    format!("{AUTO_SET_PREFIX}d{chain}_{f}")
}

/// The keep chain of base chain number `chain`.
pub fn keep_chain(chain: usize) -> String {
    format!("{AUTO_SET_PREFIX}keep{chain}")
}

/// The cache sets of a table (flushed with any edit of it): its peerwall-named timeout sets.
pub fn sets_of(t: &Table) -> Vec<&str> {
    t.sets
        .iter()
        .filter(|s| s.timeout.is_some() && s.name.starts_with(AUTO_SET_PREFIX))
        .map(|s| s.name.as_str())
        .collect()
}

/// What a rule is to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Accepts, testing key fields only: it adds.
    Adds,
    /// Tests key fields only, another verdict (drop, reject, a dispatch jump).
    KeyOnly,
    /// Accepts, testing other fields too: never adds, never pins.
    AcceptsOther,
    /// No verdict, only counting and logging.
    Neutral,
    /// Anything else: no cached verdict may skip it.
    Pins,
}

fn key_only(k: &Key) -> bool {
    match k {
        Key::Addr { .. } | Key::L4Proto | Key::Port { source: false } => true,
        Key::Tuple(c) => !c.sport,
        _ => false,
    }
}

fn role(r: &Rule) -> Role {
    let mut keys_only = true;
    let mut verdict = None;
    for e in &r.exprs {
        match e {
            Expr::Match { left, .. } => keys_only &= key_only(left),
            Expr::Counter | Expr::Log { .. } | Expr::LimitRef(_) => {}
            Expr::Vmap { key, .. } => {
                keys_only &= key_only(key);
                verdict = Some(false);
            }
            Expr::Accept => verdict = Some(true),
            Expr::Drop | Expr::Reject(_) => verdict = Some(false),
            _ => return Role::Pins,
        }
    }
    match (verdict, keys_only) {
        (Some(true), true) => Role::Adds,
        (Some(true), false) => Role::AcceptsOther,
        (Some(false), true) => Role::KeyOnly,
        (Some(false), false) => Role::Pins,
        (None, _) => Role::Neutral,
    }
}

/// Give every base filter chain of `t` where it helps a decided-flow cache (module docs).
/// Run after the address dispatch: its class chains are part of their base chain's walk.
pub fn add(t: &mut Table) {
    for ci in 0..t.chains.len() {
        add_to_chain(t, ci);
    }
}

fn add_to_chain(t: &mut Table, ci: usize) {
    let chain = t.chains[ci].name.clone();
    if t.chains[ci].kind != peerwall_policy::ir::ChainKind::Filter {
        return;
    }
    let classes: Vec<&str> = t
        .regular
        .iter()
        .filter(|r| r.base == chain)
        .map(|r| r.name.as_str())
        .collect();
    let base: Vec<usize> = (0..t.rules.len())
        .filter(|&i| t.rules[i].chain == chain)
        .collect();
    let in_classes: Vec<(usize, Role)> = (0..t.rules.len())
        .filter(|&i| classes.contains(&t.rules[i].chain.as_str()))
        .map(|i| (i, role(&t.rules[i])))
        .collect();
    // A class chain's rules are reached from a dispatch rule: nothing there may pin.
    if in_classes.iter().any(|&(_, r)| r == Role::Pins) {
        return;
    }
    let roles: Vec<Role> = base.iter().map(|&i| role(&t.rules[i])).collect();
    let mut at = roles
        .iter()
        .rposition(|r| *r == Role::Pins)
        .map_or(0, |p| p + 1);
    // Accepts by other fields (replies by ct state) stay first: cheaper than the lookup.
    while roles.get(at) == Some(&Role::AcceptsOther) {
        at += 1;
    }
    // The class chains' rules add where their dispatch comes after the lookup (above it, the
    // packets they accept never reach it).
    let dispatched_below = base[at..].iter().any(|&i| {
        t.rules[i]
            .exprs
            .iter()
            .any(|e| matches!(e, Expr::Vmap { .. }))
    });
    let classes_below: &[(usize, Role)] = if dispatched_below { &in_classes } else { &[] };
    let adders: Vec<usize> = base[at..]
        .iter()
        .zip(&roles[at..])
        .map(|(&i, &r)| (i, r))
        .chain(classes_below.iter().copied())
        .filter(|&(_, r)| r == Role::Adds)
        .map(|(i, _)| i)
        .collect();
    if adders.is_empty() {
        return;
    }
    let keep = keep_chain(ci);
    for &i in &adders {
        if let Some(last) = t.rules[i].exprs.last_mut() {
            *last = Expr::Goto(keep.clone());
        }
    }
    let fams = families(t.family);
    let lookups: Vec<Rule> = fams
        .iter()
        .map(|&f| Rule {
            chain: chain.clone(),
            comment: RULE.into(),
            exprs: vec![
                Expr::Match {
                    negate: false,
                    left: Key::Tuple(columns(f)),
                    right: Right::SetRef(set_name(ci, f)),
                },
                Expr::Counter,
                Expr::Accept,
            ],
        })
        .collect();
    let position = base.get(at).copied().unwrap_or(t.rules.len());
    t.rules.splice(position..position, lookups);
    for &f in fams {
        t.sets.push(Set::timeout_set(
            set_name(ci, f),
            KeyType::Tuple(columns(f)),
            TIMEOUT_SECS,
        ));
        t.rules.push(Rule {
            chain: keep.clone(),
            comment: RULE.into(),
            exprs: vec![Expr::Update {
                set: set_name(ci, f),
                key: Key::Tuple(columns(f)),
            }],
        });
    }
    t.rules.push(Rule {
        chain: keep.clone(),
        comment: RULE.into(),
        exprs: vec![Expr::Accept],
    });
    t.regular.push(Regular {
        name: keep,
        base: chain,
    });
}

/// The commands that empty the caches of `t` (none when it has none).
pub fn flushes(t: &Table) -> Vec<Command<'_>> {
    sets_of(t)
        .into_iter()
        .map(|set| Command::FlushSet { table: t, set })
        .collect()
}

/// `cmds` with the flushes of every table they edit elements of in front, for the same
/// transaction (the edits' own order kept).
pub fn with_flushes<'a>(cmds: Vec<Command<'a>>) -> Vec<Command<'a>> {
    let mut tables: Vec<&'a Table> = Vec::new();
    for c in &cmds {
        if let Command::AddElements { table, .. } | Command::DeleteElements { table, .. } = c {
            if !tables.iter().any(|t| t.name == table.name) {
                tables.push(table);
            }
        }
    }
    let mut out: Vec<Command<'a>> = tables.into_iter().flat_map(flushes).collect();
    if out.is_empty() {
        return cmds;
    }
    out.extend(cmds);
    out
}

#[cfg(test)]
mod tests;
