//! What `nft -j list` says, read as typed objects ([`Listing`]), and the questions the backend
//! asks of it: which tables are in the kernel and whose ([`Listing::kernel_tables`]), the rule
//! counters (a merged rule's elements added up per rule, [`Listing::rule_counters`]), one
//! table's structure as drift detection compares it ([`Listing::table`]), its outline and
//! digest (adoption), its set elements. The JSON is parsed into these types by
//! [`crate::json::read`], called by the runners only; nothing here sees JSON.
//!
//! What the backend never interprets (a chain's or a set's declaration, a rule's statements)
//! is kept as canonical JSON text with counter values zeroed: compared, never parsed twice.

use std::collections::BTreeMap;

use peerwall_backend::RuleCounter;
use peerwall_policy::ir;
use serde::Serialize;

use crate::model;

/// A packet and byte count, as a rule's `counter` statement or a set element lists it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// A `log` statement of a rule: where it sends packets and with which prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogStatement {
    /// `prefix`.
    pub prefix: Option<String>,
    /// NFLOG `group`, when it logs to one.
    pub group: Option<u16>,
}

/// A table: family and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedTable {
    /// Family keyword (`inet`, `ip`, …).
    pub family: String,
    /// Name.
    pub name: String,
}

/// A chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedChain {
    /// Family keyword.
    pub family: String,
    /// Table.
    pub table: String,
    /// Name.
    pub name: String,
    /// `type` of a base chain (`filter`, `nat`, …).
    pub kind: Option<String>,
    /// `hook` of a base chain.
    pub hook: Option<String>,
    /// The whole declaration (type, hook, priority, policy, …), canonical JSON text.
    pub declaration: String,
}

/// One element of a set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedElement {
    /// The element as nft lists it without its counter, canonical JSON text: what
    /// [`crate::json::element_texts`] renders for the element applied.
    pub text: String,
    /// Its comment (a merged rule's element names its rule).
    pub comment: Option<String>,
    /// Its counter, when the set counts.
    pub counter: Option<Counter>,
}

/// A set, with its elements when the listing carried them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedSet {
    /// Family keyword.
    pub family: String,
    /// Table.
    pub table: String,
    /// Name.
    pub name: String,
    /// Whether its elements count packets (`counter` statement).
    pub counts: bool,
    /// The declaration without elements (type, flags, statements), canonical JSON text.
    pub declaration: String,
    /// Elements (empty in a terse listing).
    pub elements: Vec<ListedElement>,
}

/// A rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedRule {
    /// Family keyword.
    pub family: String,
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Handle (absent where the listing is of commands, not of the kernel).
    pub handle: Option<u64>,
    /// Comment: the rule's name.
    pub comment: Option<String>,
    /// Its first counter.
    pub counter: Option<Counter>,
    /// Named sets it looks up (`@name`), in order.
    pub lookups: Vec<String>,
    /// Its `log` statements.
    pub logs: Vec<LogStatement>,
    /// Statements, canonical JSON text, counter values zeroed.
    pub statements: Vec<String>,
}

/// A listing: every table, chain, set and rule in it, each in listing order (objects the
/// backend has no use for, such as maps and flowtables, are left out).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    /// Tables.
    pub tables: Vec<ListedTable>,
    /// Chains.
    pub chains: Vec<ListedChain>,
    /// Sets.
    pub sets: Vec<ListedSet>,
    /// Rules.
    pub rules: Vec<ListedRule>,
}

/// A table present in the kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelTable {
    /// Family keyword.
    pub family: String,
    /// Name.
    pub name: String,
    /// Owner recorded in the marker, when the table is ours.
    pub owner: Option<String>,
}

/// Whether a set name is a merged rule's ([`crate::merge`]): its elements carry the rules'
/// names.
fn is_merged_name(name: &str) -> bool {
    name.strip_prefix(model::AUTO_SET_PREFIX)
        .is_some_and(|n| n.starts_with('m'))
}

impl Listing {
    /// Tables with their owner when they carry our marker.
    pub fn kernel_tables(&self) -> Vec<KernelTable> {
        self.tables
            .iter()
            .map(|t| KernelTable {
                family: t.family.clone(),
                name: t.name.clone(),
                owner: self
                    .rules
                    .iter()
                    .filter(|r| r.family == t.family && r.table == t.name)
                    .filter(|r| r.chain == model::MARKER_CHAIN)
                    .find_map(|r| r.comment.as_deref()?.strip_prefix(model::MARKER_PREFIX))
                    .map(str::to_string),
            })
            .collect()
    }

    /// Whether `(family, table)` names a table of this listing that peerwall owns.
    fn owned(&self) -> impl Fn(&str, &str) -> bool {
        let owned: Vec<KernelTable> = self
            .kernel_tables()
            .into_iter()
            .filter(|t| t.owner.is_some())
            .collect();
        move |family: &str, table: &str| owned.iter().any(|t| t.family == family && t.name == table)
    }

    /// The merged rules' sets that count, in owned tables: (family, table, name). Their
    /// elements, listed on their own, give the per-rule counters.
    pub fn merged_counting_sets(&self) -> Vec<(String, String, String)> {
        let owned = self.owned();
        self.sets
            .iter()
            .filter(|s| s.counts && is_merged_name(&s.name) && owned(&s.family, &s.table))
            .map(|s| (s.family.clone(), s.table.clone(), s.name.clone()))
            .collect()
    }

    /// Counters of every named rule with a counter in owned tables; `sets` holds the merged
    /// rules' sets with their elements (a merged rule counts per element, by the rule named
    /// in each element's comment, in the order the rules first appear).
    pub fn rule_counters(&self, sets: &[ListedSet]) -> Vec<RuleCounter> {
        let owned = self.owned();
        let mut out = Vec::new();
        for r in &self.rules {
            if !owned(&r.family, &r.table) || r.chain == model::MARKER_CHAIN {
                continue;
            }
            let counter = |rule: &str, c: Counter| RuleCounter {
                table: r.table.clone(),
                chain: r.chain.clone(),
                rule: rule.to_string(),
                packets: c.packets,
                bytes: c.bytes,
            };
            let merged = r.lookups.iter().find(|n| is_merged_name(n)).and_then(|n| {
                sets.iter()
                    .find(|s| s.name == *n && s.table == r.table && s.family == r.family)
            });
            if let Some(set) = merged {
                let mut per_rule: Vec<RuleCounter> = Vec::new();
                for e in &set.elements {
                    let (Some(rule), c) = (&e.comment, e.counter.unwrap_or_default()) else {
                        continue;
                    };
                    match per_rule.iter_mut().find(|x| x.rule == *rule) {
                        Some(x) => {
                            x.packets += c.packets;
                            x.bytes += c.bytes;
                        }
                        None => per_rule.push(counter(rule, c)),
                    }
                }
                if !per_rule.is_empty() {
                    out.extend(per_rule);
                    continue;
                }
            }
            if let (Some(rule), Some(c)) = (&r.comment, r.counter) {
                out.push(counter(rule, c));
            }
        }
        self.in_base_chains(out)
    }

    /// Counters of rules in dispatch class chains ([`crate::dispatch`]) counted in the base
    /// chain they came from, each rule's copies added up: the counters the rules would have
    /// without dispatch. A class chain `__pw_k<run>_…` belongs to the chain whose rule looks up
    /// the run's map `__pw_v<run>_…`.
    fn in_base_chains(&self, counters: Vec<RuleCounter>) -> Vec<RuleCounter> {
        let run_of = |name: &str, kind: char| -> Option<String> {
            let rest = name
                .strip_prefix(model::AUTO_SET_PREFIX)?
                .strip_prefix(kind)?;
            rest.split_once('_').map(|(run, _)| run.to_string())
        };
        let base: BTreeMap<(String, String), String> = self
            .rules
            .iter()
            .flat_map(|r| {
                r.lookups.iter().filter_map(move |l| {
                    run_of(l, 'v').map(|run| ((r.table.clone(), run), r.chain.clone()))
                })
            })
            .collect();
        let mut out: Vec<RuleCounter> = Vec::with_capacity(counters.len());
        let mut at: BTreeMap<(String, String, String), usize> = BTreeMap::new();
        for mut c in counters {
            if let Some(chain) =
                run_of(&c.chain, 'k').and_then(|run| base.get(&(c.table.clone(), run)))
            {
                c.chain = chain.clone();
            }
            match at.entry((c.table.clone(), c.chain.clone(), c.rule.clone())) {
                std::collections::btree_map::Entry::Occupied(e) => {
                    let x = &mut out[*e.get()];
                    x.packets += c.packets;
                    x.bytes += c.bytes;
                }
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(out.len());
                    out.push(c);
                }
            }
        }
        out
    }

    /// One table of the listing: the table and everything in it, as listed. None when absent.
    pub fn of_table(&self, family: ir::TableFamily, name: &str) -> Option<Listing> {
        let fam = family.nft();
        let here = |f: &str, t: &str| f == fam && t == name;
        let tables: Vec<ListedTable> = self
            .tables
            .iter()
            .filter(|t| here(&t.family, &t.name))
            .cloned()
            .collect();
        if tables.is_empty() {
            return None;
        }
        let pick = |f: &str, t: &str| here(f, t);
        Some(Listing {
            tables,
            chains: (self.chains.iter())
                .filter(|c| pick(&c.family, &c.table))
                .cloned()
                .collect(),
            sets: (self.sets.iter())
                .filter(|s| pick(&s.family, &s.table))
                .cloned()
                .collect(),
            rules: (self.rules.iter())
                .filter(|r| pick(&r.family, &r.table))
                .cloned()
                .collect(),
        })
    }

    /// The listing's structure, what drift detection compares: counters zeroed, set elements
    /// left out.
    pub fn structure(mut self) -> Listing {
        for s in &mut self.sets {
            s.elements.clear();
        }
        for r in &mut self.rules {
            r.counter = r.counter.map(|_| Counter::default());
        }
        self
    }

    /// [`of_table`](Self::of_table)'s structure.
    pub fn table(&self, family: ir::TableFamily, name: &str) -> Option<Listing> {
        self.of_table(family, name).map(Listing::structure)
    }

    /// Chains and, per chain, its rules' comments in order: what a listing and the commands
    /// that created the table must agree on.
    pub fn outline(&self) -> BTreeMap<String, Vec<Option<String>>> {
        let mut out: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
        for c in &self.chains {
            out.entry(c.name.clone()).or_default();
        }
        for r in &self.rules {
            out.entry(r.chain.clone())
                .or_default()
                .push(r.comment.clone());
        }
        out
    }

    /// The digest a listed table was created with (its marker chain's digest rule).
    pub fn digest(&self) -> Option<&str> {
        self.rules
            .iter()
            .filter(|r| r.chain == model::MARKER_CHAIN)
            .find_map(|r| r.comment.as_deref()?.strip_prefix(model::DIGEST_PREFIX))
    }

    /// The elements of every set of the listing, by set name, as sorted texts: compared with
    /// [`crate::json::element_texts`] of what was applied.
    pub fn elements(&self) -> BTreeMap<String, Vec<String>> {
        self.sets
            .iter()
            .map(|s| {
                let mut v: Vec<String> = s.elements.iter().map(|e| e.text.clone()).collect();
                v.sort_unstable();
                (s.name.clone(), v)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
