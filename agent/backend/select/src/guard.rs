//! The bpf backend's guard ([`peerwall_backend_bpf::backend::Guard`]): an nftables table that
//! drops what arrives on an interface the datapath is meant to filter but is not attached to.
//!
//! The datapath filters an interface from the moment its tc link is attached, which the agent
//! does at the interface poll after the device appears. A device made again under its name
//! (Liqo's userspace WireGuard creates `liqo-tunnel` anew each time its gateway container
//! starts, `pkg/gateway/tunnel/wireguard/netlink.go`, `createLinkUserspace`) would otherwise
//! forward everything from the peer until that poll, and for as long as no agent runs. The
//! table is kernel state: it holds while the agent is away.
//!
//! One rule per pattern, in a chain at prerouting before conntrack (priority −300, `raw`):
//! `iifname "liqo-tunnel*" iif != { 7, 12 } drop`. nftables matches the name, the kernel
//! keeps the ifindexes as numbers, so a device made again under the name (a new ifindex) is
//! dropped until the datapath is attached to it and the agent lets it through. With no
//! interface attached the rule has no ifindex test. Base chains decide independently (an
//! accept elsewhere does not skip this one), and the chain's policy is accept: it drops
//! nothing the datapath filters.
//!
//! The table carries no ownership marker: it is not one of peerwall's policy tables, and no
//! policy may name it. `peerwall delete --backend bpf` removes it; so does the emergency
//! switch (`peerwall allow-all on`), which lets everything through; the agent puts it back.
//!
//! Checking is cheap: the ruleset's generation (one netlink request) tells whether any
//! transaction committed since the table was last written; only then is the ruleset listed,
//! and the table compared with its listing right after the write: gone, or changed (a flushed
//! chain, a rule inserted before the drop), it is written again and reported as drift.

use peerwall_backend::{BackendError, Drift};
use peerwall_backend_bpf::backend::Guard;
use peerwall_backend_nftables::listing::Listing;
use peerwall_backend_nftables::netlink::{message::nfproto, Session};
use peerwall_backend_nftables::{Nft, Runner};
use peerwall_policy::ir::TableFamily;

/// The guard's table (family `inet`).
pub const TABLE: &str = peerwall_backend_bpf::backend::GUARD_TABLE;

const NFT: &str = peerwall_backend_nftables::NAME;

/// A pattern nftables cannot take inside its double quotes.
#[derive(Debug, thiserror::Error)]
#[error("interface pattern {0:?}: a double quote or backslash cannot be written into an nftables rule; name the interfaces without them")]
pub struct UnquotablePattern(pub String);

/// The script that makes the guard what `patterns` and `attached` say, in one transaction
/// (the table created if missing, deleted, and written again: never a moment without it).
pub fn script(patterns: &[String], attached: &[u32]) -> Result<String, UnquotablePattern> {
    let mut rules = String::new();
    for p in patterns {
        if p.contains(['"', '\\']) {
            return Err(UnquotablePattern(p.clone()));
        }
        let not_attached = if attached.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = attached.iter().map(u32::to_string).collect();
            format!(" iif != {{ {} }}", list.join(", "))
        };
        rules.push_str(&format!(
            "    iifname \"{p}\"{not_attached} counter drop comment \"peerwall: not attached to the bpf datapath yet\"\n"
        ));
    }
    Ok(format!(
        "table inet {TABLE} {{\n}}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n  chain guard {{\n    type filter hook prerouting priority raw; policy accept;\n{rules}  }}\n}}\n"
    ))
}

/// The guard as last written, with the ruleset's generation right after.
#[derive(Debug, Default)]
pub struct NftGuard {
    nft: Option<Nft>,
    session: Option<Session>,
    written: Option<Written>,
}

#[derive(Debug, PartialEq)]
struct Written {
    patterns: Vec<String>,
    attached: Vec<u32>,
    generation: Option<u32>,
    /// The table as listed right after the write ([`shape`]).
    shape: Option<Vec<String>>,
}

/// Whether `listing` holds the guard's table.
fn holds_table(listing: &Listing) -> bool {
    listing
        .tables
        .iter()
        .any(|t| t.family == "inet" && t.name == TABLE)
}

/// The ruleset here, terse (the guard's own set is anonymous, listed inline).
fn list(nft: &Nft) -> Result<Listing, BackendError> {
    nft.list_ruleset_terse()
        .map_err(BackendError::host(NFT, "listing the ruleset"))
}

/// The guard's table as a listing shows it, counters aside: its chains' declarations and its
/// rules' statements, in order (None: no such table). Devices print by name, so a device
/// renamed or gone changes it too, and the guard is written again, the same.
fn shape(listing: &Listing) -> Option<Vec<String>> {
    holds_table(listing).then(|| {
        let chains = listing
            .chains
            .iter()
            .filter(|c| c.family == "inet" && c.table == TABLE)
            .map(|c| format!("chain {} {}", c.name, c.declaration));
        let rules = listing
            .rules
            .iter()
            .filter(|r| r.family == "inet" && r.table == TABLE)
            .map(|r| format!("rule {} {}", r.chain, r.statements.join(" ")));
        chains.chain(rules).collect()
    })
}

impl NftGuard {
    fn parts(&mut self) -> (&Nft, &mut Session) {
        let nft = self.nft.get_or_insert_with(Nft::host);
        let session = self.session.get_or_insert_with(|| Session::new(None));
        (nft, session)
    }
}

impl Guard for NftGuard {
    fn keep(
        &mut self,
        patterns: &[String],
        attached: &[u32],
    ) -> Result<Option<Drift>, BackendError> {
        let last = self.written.take();
        let (nft, session) = self.parts();
        let generation = session.generation().ok();
        let same = last
            .as_ref()
            .is_some_and(|w| w.patterns == patterns && w.attached == attached);
        // Written as wanted and nothing committed since: still there, unchanged.
        if same && generation.is_some() && last.as_ref().is_some_and(|w| w.generation == generation)
        {
            self.written = last;
            return Ok(None);
        }
        // Unchanged, but something committed since: is the table there as written? Its
        // chain and rules are compared with the listing taken right after the write (a rule
        // inserted before the drop, a flushed chain or another policy would each let
        // packets through). A change is written without asking: the script replaces
        // whatever is there.
        let drift = match last.filter(|_| same) {
            Some(w) => match (shape(&list(nft)?), &w.shape) {
                (None, _) => Some(Drift::Missing {
                    table: format!("inet {TABLE}"),
                }),
                (Some(now), Some(then)) if &now == then => {
                    // As written: remember the generation it was seen at.
                    self.written = Some(Written { generation, ..w });
                    return Ok(None);
                }
                (Some(_), Some(_)) => Some(Drift::Modified {
                    table: format!("inet {TABLE}"),
                }),
                // Its shape unknown (listed beside another commit): written again.
                (Some(_), None) => None,
            },
            None => None,
        };
        let text =
            script(patterns, attached).map_err(BackendError::host(NFT, "writing the guard"))?;
        nft.apply_text(&text).map_err(BackendError::host(
            NFT,
            "writing the guard of interfaces not attached yet",
        ))?;
        // What it lists as right after the write, for the next comparison. Something else
        // committed around the listing: it may hold that change, so it is not kept as the
        // guard's shape, and the next check writes the guard again.
        let before = session.generation().ok();
        let listed = shape(&list(nft)?);
        let after = session.generation().ok();
        let (generation, shape) = if before.is_some() && before == after {
            (after, listed)
        } else {
            (None, None)
        };
        self.written = Some(Written {
            patterns: patterns.to_vec(),
            attached: attached.to_vec(),
            generation,
            shape,
        });
        Ok(drift)
    }

    fn release(&mut self) -> Result<(), BackendError> {
        if self.written.is_none() && self.session.is_some() {
            // Released before and not written since.
            return Ok(());
        }
        self.written = None;
        let (_, session) = self.parts();
        session
            .delete_table(nfproto(TableFamily::Inet), TABLE)
            .map(|_there| ())
            .map_err(BackendError::host(NFT, "deleting the guard"))
    }
}

/// Delete the guard in this namespace, there or not (`peerwall delete`, the emergency switch).
pub fn remove() -> Result<(), BackendError> {
    NftGuard::default().release()
}

/// One rule of the guard as `nft` lists it: what `peerwall inspect` shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardRule {
    /// The `--interfaces` pattern it drops on (`iifname`).
    pub pattern: String,
    /// The interfaces the datapath is attached to, let through: a device's name as nftables
    /// prints it, or its ifindex where no device has that index now. Empty: nothing attached,
    /// every interface the pattern names is dropped.
    pub lets_through: Vec<String>,
    /// Packets it dropped.
    pub dropped: u64,
}

/// The guard's rules in `listing` (a ruleset listing of this namespace); None: no guard table.
pub fn rules_in(listing: &Listing) -> Option<Vec<GuardRule>> {
    holds_table(listing).then(|| {
        listing
            .rules
            .iter()
            .filter(|r| r.family == "inet" && r.table == TABLE)
            .map(|r| {
                let mut rule = GuardRule {
                    pattern: String::new(),
                    lets_through: Vec::new(),
                    dropped: r.counter.map_or(0, |c| c.packets),
                };
                for st in &r.statements {
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(st) else {
                        continue;
                    };
                    let m = &v["match"];
                    match m["left"]["meta"]["key"].as_str() {
                        Some("iifname") => rule.pattern = scalar(&m["right"]),
                        Some("iif") => {
                            rule.lets_through = match m["right"]["set"].as_array() {
                                Some(items) => items.iter().map(scalar).collect(),
                                None => vec![scalar(&m["right"])],
                            }
                        }
                        _ => {}
                    }
                }
                rule
            })
            .collect()
    })
}

/// A string or a number of nft's JSON as it prints.
fn scalar(v: &serde_json::Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_string)
}

/// The guard in this namespace, read with `nft` (None: no guard table).
pub fn rules() -> Result<Option<Vec<GuardRule>>, BackendError> {
    Ok(rules_in(&list(&Nft::host())?))
}

/// `peerwall inspect`'s lines on the guard; `allow_all`: the emergency switch is on (which
/// keeps it away).
pub fn text(rules: Option<&[GuardRule]>, allow_all: bool) -> String {
    let Some(rules) = rules else {
        return format!(
            "guard ABSENT (nftables table inet {TABLE}): an interface made again under an --interfaces pattern passes unfiltered until the datapath is attached to it{}\n",
            if allow_all {
                "; the emergency switch keeps it away while it is on"
            } else {
                "; a running agent puts it back at its next upkeep"
            }
        );
    };
    let mut s = String::new();
    for r in rules {
        let through = if r.lets_through.is_empty() {
            "nothing (no interface attached)".to_string()
        } else {
            r.lets_through.join(", ")
        };
        s.push_str(&format!(
            "guard (nftables table inet {TABLE}) iifname {:?}: lets through {through}; dropped {} packets\n",
            r.pattern, r.dropped
        ));
    }
    s
}

/// `peerwall inspect --output json`'s `guard`: null where absent.
pub fn json(rules: Option<&[GuardRule]>) -> serde_json::Value {
    rules.map_or(serde_json::Value::Null, |rules| {
        serde_json::Value::Array(
            rules
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "pattern": r.pattern,
                        "lets_through": r.lets_through,
                        "dropped": r.dropped,
                    })
                })
                .collect(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_backend_nftables::listing::{Counter, ListedRule, ListedTable};

    fn rule(statements: &[&str], packets: u64) -> ListedRule {
        ListedRule {
            family: "inet".into(),
            table: TABLE.into(),
            chain: "guard".into(),
            handle: Some(2),
            comment: None,
            counter: Some(Counter { packets, bytes: 0 }),
            lookups: vec![],
            logs: vec![],
            statements: statements.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn the_listed_guard_reads_as_pattern_devices_and_drops() {
        let listing = Listing {
            tables: vec![ListedTable {
                family: "inet".into(),
                name: TABLE.into(),
            }],
            rules: vec![
                rule(
                    &[
                        r#"{"match":{"left":{"meta":{"key":"iifname"}},"op":"==","right":"liqo-tunnel*"}}"#,
                        r#"{"match":{"left":{"meta":{"key":"iif"}},"op":"!=","right":{"set":["liqo-tunnel",12]}}}"#,
                        r#"{"counter":{"bytes":0,"packets":0}}"#,
                        r#"{"drop":null}"#,
                    ],
                    7,
                ),
                rule(
                    &[
                        r#"{"match":{"left":{"meta":{"key":"iifname"}},"op":"==","right":"liqo.*"}}"#,
                        r#"{"drop":null}"#,
                    ],
                    0,
                ),
            ],
            ..Listing::default()
        };
        let rules = rules_in(&listing).unwrap();
        assert_eq!(rules[0].pattern, "liqo-tunnel*");
        assert_eq!(rules[0].lets_through, ["liqo-tunnel", "12"]);
        assert_eq!(rules[0].dropped, 7);
        assert!(rules[1].lets_through.is_empty());
        let t = text(Some(&rules), false);
        assert!(
            t.contains("iifname \"liqo-tunnel*\": lets through liqo-tunnel, 12; dropped 7 packets"),
            "{t}"
        );
        assert!(
            t.contains("lets through nothing (no interface attached)"),
            "{t}"
        );
        assert_eq!(json(Some(&rules))[0]["lets_through"][1], "12");
    }

    #[test]
    fn no_guard_table_is_absent_and_says_what_passes() {
        assert_eq!(rules_in(&Listing::default()), None);
        assert!(text(None, false).starts_with("guard ABSENT"));
        assert!(text(None, true).contains("emergency switch"));
        assert!(json(None).is_null());
    }

    #[test]
    fn each_pattern_drops_what_arrives_on_interfaces_not_attached() {
        let s = script(&["liqo-tunnel*".into(), "liqo.*".into()], &[7, 12]).unwrap();
        assert!(s.starts_with("table inet peerwall-guard {\n}\ndelete table inet peerwall-guard\n"));
        assert!(s.contains("type filter hook prerouting priority raw; policy accept;"));
        assert!(s.contains("iifname \"liqo-tunnel*\" iif != { 7, 12 } counter drop"));
        assert!(s.contains("iifname \"liqo.*\" iif != { 7, 12 } counter drop"));
    }

    #[test]
    fn with_nothing_attached_every_matching_interface_is_dropped() {
        let s = script(&["liqo-tunnel".into()], &[]).unwrap();
        assert!(s.contains("iifname \"liqo-tunnel\" counter drop"), "{s}");
        assert!(!s.contains("iif !="), "{s}");
    }

    #[test]
    fn a_pattern_nftables_cannot_quote_is_refused() {
        let e = script(&["a\"b".into()], &[]).unwrap_err();
        assert!(e.to_string().contains("\"a\\\"b\""), "{e}");
    }
}
