//! IR → nftables, as libnftables JSON (what is applied) with a text view for humans.
//!
//! One table per FirewallConfiguration. Address lists of more than one value and all table
//! sets become named sets (never one rule per address): hash sets when they hold hosts,
//! interval sets when they hold prefixes or ranges; ports lists are anonymous
//! sets. Every rule carries its name as comment, and a counter when asked.
//! JSON is used for applying because nft's text parser refuses keyword names (a chain called
//! `drop`), which the JSON parser takes.
//!
//! Ownership: every table holds a regular (hookless, never run) chain [`MARKER_CHAIN`] whose one
//! rule's comment names the owner; peerwall only ever modifies tables that carry it.

use serde_json::{json, Value};

use peerwall_policy::ir::{
    self, Action, AddrSet, Dir, IfDir, IpFamily, NatAction, NatTarget, PortSet, SetElements,
    Source, TableFamily, Test, VerdictAction,
};

/// Name of the marker chain that identifies tables owned by peerwall.
pub const MARKER_CHAIN: &str = "__peerwall";
/// Prefix of the marker rule's comment.
pub const MARKER_PREFIX: &str = "peerwall owner=";
/// Prefix of sets generated for inline lists.
pub const AUTO_SET_PREFIX: &str = "__pw_";

/// Rendering options.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenderOptions {
    /// Put a counter on every rule (the probe engine reads them to tell which rule decided).
    pub force_counters: bool,
}

/// A set as rendered: its declaration and elements.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderedSet {
    /// Set name.
    pub name: String,
    /// nft key type.
    pub key_type: &'static str,
    /// `flags interval` (ranges and prefixes); without it the kernel uses a hash set, an O(1)
    /// lookup instead of a tree walk: chosen when every element is a single address or a
    /// small run of addresses (see [`HASH_RUN_MAX`]).
    pub interval: bool,
    /// Elements as JSON values (canonical, disjoint).
    pub elements: Vec<Value>,
}

/// Longest run of adjacent addresses still expanded into single hash-set elements (random pod
/// IPs often sit next to each other; canonical ranges merge them).
pub const HASH_RUN_MAX: u128 = 16;
/// Largest hash set produced by expanding runs.
const HASH_MAX_ELEMENTS: u128 = 4_000_000;

/// A rendered table: sets (whose elements can change in place) and everything else.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderedTable {
    /// Table name.
    pub name: String,
    /// Family.
    pub family: TableFamily,
    /// Owner (origin of the object).
    pub owner: String,
    /// Named sets.
    pub sets: Vec<RenderedSet>,
    /// Chains (`add chain` objects, in creation order).
    pub chains: Vec<Value>,
    /// Rules (`add rule` objects, in order).
    pub rules: Vec<Value>,
}

impl RenderedTable {
    /// Whether `other` differs from this table at most in set contents (so that element
    /// updates turn one into the other).
    pub fn same_structure(&self, other: &RenderedTable) -> bool {
        self.name == other.name
            && self.family == other.family
            && self.owner == other.owner
            && self.chains == other.chains
            && self.rules == other.rules
            && self.sets.len() == other.sets.len()
            && self.sets.iter().zip(&other.sets).all(|(a, b)| {
                a.name == b.name && a.key_type == b.key_type && a.interval == b.interval
            })
    }

    fn table_obj(&self) -> Value {
        json!({"table": {"family": self.family.nft(), "name": self.name}})
    }

    /// Commands that (re)create the table from scratch, atomically within one transaction:
    /// `add table` (no-op if present), `delete table`, then the full definition.
    pub fn recreate_commands(&self) -> Vec<Value> {
        let mut cmds = vec![
            json!({"add": self.table_obj()}),
            json!({"delete": self.table_obj()}),
        ];
        cmds.extend(self.create_commands());
        cmds
    }

    /// Commands that create the table (it must not exist).
    pub fn create_commands(&self) -> Vec<Value> {
        let fam = self.family.nft();
        let mut cmds = vec![json!({"add": self.table_obj()})];
        cmds.push(
            json!({"add": {"chain": {"family": fam, "table": self.name, "name": MARKER_CHAIN}}}),
        );
        cmds.push(
            json!({"add": {"rule": {"family": fam, "table": self.name, "chain": MARKER_CHAIN,
            "comment": format!("{MARKER_PREFIX}{}", self.owner), "expr": [{"counter": null}]}}}),
        );
        for s in &self.sets {
            let mut set = json!({"family": fam, "table": self.name, "name": s.name,
                "type": s.key_type});
            if s.interval {
                set["flags"] = json!(["interval"]);
            }
            if !s.elements.is_empty() {
                set["elem"] = Value::Array(s.elements.clone());
            }
            cmds.push(json!({"add": {"set": set}}));
        }
        // Netfilter runs base chains of equal hook and priority in reverse registration order
        // (a new hook is inserted before existing ones of the same priority). The evaluator
        // orders ties by name, ascending: so chains are created in descending name order.
        for c in self.chains.iter().rev() {
            cmds.push(json!({"add": {"chain": c}}));
        }
        for r in &self.rules {
            cmds.push(json!({"add": {"rule": r}}));
        }
        cmds
    }

    /// Command that deletes the table.
    pub fn delete_command(&self) -> Value {
        json!({"delete": self.table_obj()})
    }

    /// Element changes turning `old`'s set contents into `self`'s (same structure assumed).
    pub fn element_commands(&self, old: &RenderedTable) -> Vec<Value> {
        let fam = self.family.nft();
        let mut dels = Vec::new();
        let mut adds = Vec::new();
        // O(elements): membership through hashed canonical text (100k-element sets are normal).
        let keys = |v: &[Value]| -> std::collections::HashSet<String> {
            v.iter().map(Value::to_string).collect()
        };
        for (new_set, old_set) in self.sets.iter().zip(&old.sets) {
            let (new_keys, old_keys) = (keys(&new_set.elements), keys(&old_set.elements));
            let removed: Vec<Value> = old_set
                .elements
                .iter()
                .filter(|e| !new_keys.contains(&e.to_string()))
                .cloned()
                .collect();
            let added: Vec<Value> = new_set
                .elements
                .iter()
                .filter(|e| !old_keys.contains(&e.to_string()))
                .cloned()
                .collect();
            if !removed.is_empty() {
                dels.push(
                    json!({"delete": {"element": {"family": fam, "table": self.name,
                    "name": new_set.name, "elem": removed}}}),
                );
            }
            if !added.is_empty() {
                adds.push(
                    json!({"add": {"element": {"family": fam, "table": self.name,
                    "name": new_set.name, "elem": added}}}),
                );
            }
        }
        // Deletes first: a merged interval may be replaced by an overlapping one.
        dels.extend(adds);
        dels
    }
}

fn addr_elem(family: IpFamily, r: ir::AddrRange) -> Value {
    let text = ir::addr::format_range(family, r);
    if let Some((a, b)) = text.split_once('-') {
        json!({"range": [a, b]})
    } else if let Some((a, len)) = text.split_once('/') {
        json!({"prefix": {"addr": a, "len": len.parse::<u8>().unwrap_or(0)}})
    } else {
        json!(text)
    }
}

fn addr_elems(set: &AddrSet) -> Vec<Value> {
    set.ranges()
        .iter()
        .map(|r| addr_elem(set.family(), *r))
        .collect()
}

/// A named address set: a hash set of single addresses when the set is made of hosts and short
/// runs of hosts, an interval set otherwise.
fn addr_set(name: String, set: &AddrSet) -> RenderedSet {
    let runs_are_short = set.ranges().iter().all(|r| r.hi - r.lo < HASH_RUN_MAX);
    let total: u128 = set.ranges().iter().map(|r| r.hi - r.lo + 1).sum();
    if runs_are_short && total <= HASH_MAX_ELEMENTS {
        let family = set.family();
        let elements = set
            .ranges()
            .iter()
            .flat_map(|r| {
                (r.lo..=r.hi).map(move |a| json!(ir::addr::u128_to_addr(family, a).to_string()))
            })
            .collect();
        RenderedSet {
            name,
            key_type: addr_key_type(family),
            interval: false,
            elements,
        }
    } else {
        RenderedSet {
            name,
            key_type: addr_key_type(set.family()),
            interval: true,
            elements: addr_elems(set),
        }
    }
}

fn port_elems(set: &PortSet) -> Vec<Value> {
    set.ranges()
        .iter()
        .map(|(a, b)| {
            if a == b {
                json!(a)
            } else {
                json!({"range": [a, b]})
            }
        })
        .collect()
}

fn addr_key_type(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ipv4_addr",
        IpFamily::V6 => "ipv6_addr",
    }
}

fn mat(negate: bool, left: Value, right: Value) -> Value {
    json!({"match": {"op": if negate { "!=" } else { "==" }, "left": left, "right": right}})
}

fn proto_name(p: u8) -> Value {
    match p {
        ir::eval::proto::TCP => json!("tcp"),
        ir::eval::proto::UDP => json!("udp"),
        ir::eval::proto::ICMP => json!("icmp"),
        ir::eval::proto::ICMPV6 => json!("ipv6-icmp"),
        n => json!(n),
    }
}

/// Render one IR table.
pub fn render_table(t: &ir::Table, opts: RenderOptions) -> RenderedTable {
    let fam = t.family.nft();
    let mut sets: Vec<RenderedSet> = t
        .sets
        .iter()
        .map(|s| match &s.elements {
            SetElements::Addr(a) => addr_set(s.name.clone(), a),
            SetElements::Port(p) => RenderedSet {
                name: s.name.clone(),
                key_type: "inet_service",
                interval: true,
                elements: port_elems(p),
            },
        })
        .collect();
    let mut chains = Vec::new();
    let mut rules = Vec::new();
    for (ci, c) in t.chains.iter().enumerate() {
        chains.push(json!({"family": fam, "table": t.name, "name": c.name,
            "type": c.kind.nft(), "hook": c.hook.nft(), "prio": c.priority,
            "policy": c.policy.as_str()}));
        for (ri, r) in c.rules.iter().enumerate() {
            let mut expr = Vec::new();
            for (mi, m) in r.matches.iter().enumerate() {
                match &m.test {
                    Test::Addr { dir, set, source } => {
                        let proto = match set.family() {
                            IpFamily::V4 => "ip",
                            IpFamily::V6 => "ip6",
                        };
                        let field = match dir {
                            Dir::Src => "saddr",
                            Dir::Dst => "daddr",
                        };
                        let left = json!({"payload": {"protocol": proto, "field": field}});
                        let right = match source {
                            Source::Named(n) => json!(format!("@{n}")),
                            Source::Inline { count } if *count > 1 => {
                                let name = format!("{AUTO_SET_PREFIX}{ci}_{ri}_{mi}");
                                sets.push(addr_set(name.clone(), set));
                                json!(format!("@{name}"))
                            }
                            Source::Inline { .. } => match addr_elems(set).as_slice() {
                                [one] => one.clone(),
                                many => json!({"set": many}),
                            },
                        };
                        expr.push(mat(m.negate, left, right));
                    }
                    Test::Port { dir, set, source } => {
                        // Ports exist only for TCP and UDP: ICMP never satisfies a port match.
                        expr.push(mat(
                            false,
                            json!({"meta": {"key": "l4proto"}}),
                            json!({"set": ["tcp", "udp"]}),
                        ));
                        let field = match dir {
                            Dir::Src => "sport",
                            Dir::Dst => "dport",
                        };
                        let left = json!({"payload": {"protocol": "th", "field": field}});
                        let right = match source {
                            Source::Named(n) => json!(format!("@{n}")),
                            Source::Inline { .. } => match port_elems(set).as_slice() {
                                [one] => one.clone(),
                                many => json!({"set": many}),
                            },
                        };
                        expr.push(mat(m.negate, left, right));
                    }
                    Test::Proto(list) => {
                        let right = match list.as_slice() {
                            [one] => proto_name(*one),
                            many => {
                                json!({"set": many.iter().map(|p| proto_name(*p)).collect::<Vec<_>>()})
                            }
                        };
                        expr.push(mat(m.negate, json!({"meta": {"key": "l4proto"}}), right));
                    }
                    Test::Iface {
                        dir,
                        name,
                        wildcard,
                    } => {
                        let key = match dir {
                            IfDir::In => "iifname",
                            IfDir::Out => "oifname",
                        };
                        let value = if *wildcard {
                            format!("{name}*")
                        } else {
                            name.clone()
                        };
                        expr.push(mat(m.negate, json!({"meta": {"key": key}}), json!(value)));
                    }
                    Test::CtState(mask) => {
                        let states: Vec<&str> = ir::CtState::ALL
                            .iter()
                            .filter(|s| mask & s.bit() != 0)
                            .map(|s| s.nft())
                            .collect();
                        expr.push(mat(
                            m.negate,
                            json!({"ct": {"key": "state"}}),
                            json!({"set": states}),
                        ));
                    }
                }
            }
            if r.counter || opts.force_counters {
                expr.push(json!({"counter": null}));
            }
            match &r.action {
                Action::Verdict(VerdictAction::Accept) => expr.push(json!({"accept": null})),
                Action::Verdict(VerdictAction::Drop) => expr.push(json!({"drop": null})),
                Action::Verdict(VerdictAction::Reject) => {
                    let ty = match t.family {
                        TableFamily::Inet => "icmpx",
                        TableFamily::Ip => "icmp",
                        TableFamily::Ip6 => "icmpv6",
                    };
                    expr.push(json!({"reject": {"type": ty, "expr": "port-unreachable"}}));
                }
                Action::CtMark(v) => {
                    expr.push(json!({"mangle": {"key": {"ct": {"key": "mark"}}, "value": v}}))
                }
                Action::MetaMarkFromCtMark => expr.push(
                    json!({"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"ct": {"key": "mark"}}}}),
                ),
                Action::TcpMssClamp(v) => {
                    expr.push(json!({"match": {"op": "in",
                        "left": {"payload": {"protocol": "tcp", "field": "flags"}}, "right": "syn"}}));
                    let value = match v {
                        Some(mss) => json!(mss),
                        None => json!({"rt": {"key": "mtu"}}),
                    };
                    expr.push(json!({"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": value}}));
                }
                Action::Notrack => expr.push(json!({"notrack": null})),
                Action::Nat(n) => {
                    let (kind, target) = match n {
                        NatAction::Dnat(a) => ("dnat", Some(a)),
                        NatAction::Snat(a) => ("snat", Some(a)),
                        NatAction::Masquerade => ("masquerade", None),
                    };
                    match target {
                        Some(target) => {
                            let mut stmt = match target {
                                NatTarget::Addr(a) => json!({"addr": a.to_string()}),
                                // `snat ip prefix to 10.0.0.0/16` (NF_NAT_RANGE_NETMAP).
                                NatTarget::Prefix(n) => json!({
                                    "addr": {"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}},
                                    "flags": "netmap",
                                    "type_flags": "prefix",
                                }),
                            };
                            if t.family == TableFamily::Inet {
                                stmt["family"] = json!(match target.family() {
                                    IpFamily::V4 => "ip",
                                    IpFamily::V6 => "ip6",
                                });
                            }
                            expr.push(json!({ kind: stmt }));
                        }
                        None => expr.push(json!({ kind: null })),
                    }
                }
            }
            rules.push(json!({"family": fam, "table": t.name, "chain": c.name,
                "comment": r.name, "expr": expr}));
        }
    }
    RenderedTable {
        name: t.name.clone(),
        family: t.family,
        owner: sanitize_owner(&t.origin.0),
        sets,
        chains,
        rules,
    }
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
pub fn render_policy(p: &ir::Policy, opts: RenderOptions) -> Vec<RenderedTable> {
    p.tables.iter().map(|t| render_table(t, opts)).collect()
}

/// Wrap commands into an nft JSON document.
pub fn document(cmds: Vec<Value>) -> Value {
    json!({ "nftables": cmds })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::ir::IpFamily;

    fn set(nets: &[&str]) -> AddrSet {
        AddrSet::from_nets(IpFamily::V4, nets.iter().map(|n| n.parse().unwrap()))
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
            vec![json!("10.0.0.1"), json!("10.0.0.2"), json!("10.0.0.9")]
        );
        let nets = addr_set("s".into(), &set(&["10.0.0.0/24", "10.1.0.1/32"]));
        assert!(nets.interval);
        assert_eq!(
            nets.elements[0],
            json!({"prefix": {"addr": "10.0.0.0", "len": 24}})
        );
        // A short run of adjacent hosts (canonical ranges merge them) stays a hash set; a
        // longer one does not.
        let run = addr_set("s".into(), &set(&["10.0.0.0/29"]));
        assert!(!run.interval && run.elements.len() == 8);
        assert!(addr_set("s".into(), &set(&["10.0.0.0/27"])).interval);
        assert!(!addr_set("s".into(), &AddrSet::from_nets(IpFamily::V4, [])).interval);
    }

    #[test]
    fn element_updates_are_computed_from_the_difference() {
        let table = |s: RenderedSet| RenderedTable {
            name: "t".into(),
            family: TableFamily::Inet,
            owner: "o".into(),
            sets: vec![s],
            chains: vec![],
            rules: vec![],
        };
        let many: Vec<String> = (0..50_000)
            .map(|i| format!("10.{}.{}.1/32", i / 256, i % 256))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let old = table(addr_set("s".into(), &set(&refs)));
        let mut more = refs.clone();
        more.push("10.250.0.1/32");
        let new = table(addr_set("s".into(), &set(&more[1..])));
        assert!(new.same_structure(&old));
        let cmds = new.element_commands(&old);
        assert_eq!(cmds.len(), 2, "one delete, one add");
        assert_eq!(cmds[0]["delete"]["element"]["elem"], json!(["10.0.0.1"]));
        assert_eq!(cmds[1]["add"]["element"]["elem"], json!(["10.250.0.1"]));
    }
}
