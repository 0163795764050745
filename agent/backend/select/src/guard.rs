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
//! A chain at prerouting before conntrack (priority −300, `raw`): first the interfaces the
//! datapath is attached to, let through (`iif { 7, 12 } accept`), then one rule per pattern
//! (`iifname "liqo-tunnel*" counter drop`). nftables matches the name, the kernel keeps the
//! ifindexes as numbers, so a device made again under the name (a new ifindex) is dropped
//! until the datapath is attached to it and the agent lets it through. With no interface
//! attached there is no accept rule. Base chains decide independently (an accept here ends
//! this chain only, not the hook's other chains), and the chain's policy is accept: it drops
//! nothing the datapath filters.
//!
//! The attached interfaces come first because every packet of the gateway's namespace walks
//! this chain, and nearly all of them arrive on an attached interface: one ifindex lookup
//! ends the chain for them, where a rule per pattern (`iifname "p" iif != { … } drop`, the
//! guard's first form) compared each pattern's name, then the ifindex, for every packet
//! (`cargo xtask bench-gateway` measures the guard: the row "limit: empty tcx program and the
//! bpf backend's guard"). A guard in the first form is still read ([`rules_in`]).
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
    if !attached.is_empty() {
        let list: Vec<String> = attached.iter().map(u32::to_string).collect();
        rules.push_str(&format!(
            "    iif {{ {} }} accept comment \"peerwall: attached to the bpf datapath\"\n",
            list.join(", ")
        ));
    }
    for p in patterns {
        if p.contains(['"', '\\']) {
            return Err(UnquotablePattern(p.clone()));
        }
        rules.push_str(&format!(
            "    iifname \"{p}\" counter drop comment \"peerwall: not attached to the bpf datapath yet\"\n"
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
/// Each pattern's rule lets through the interfaces of the accept rule before it (the guard
/// [`script`] writes), or of its own `iif !=` test (the guard's first form).
pub fn rules_in(listing: &Listing) -> Option<Vec<GuardRule>> {
    holds_table(listing).then(|| {
        let mut attached: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for r in listing
            .rules
            .iter()
            .filter(|r| r.family == "inet" && r.table == TABLE)
        {
            let mut rule = GuardRule {
                pattern: String::new(),
                lets_through: Vec::new(),
                dropped: r.counter.map_or(0, |c| c.packets),
            };
            let (mut own, mut accepts) = (None, false);
            for st in &r.statements {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(st) else {
                    continue;
                };
                accepts |= v.get("accept").is_some();
                let m = &v["match"];
                match m["left"]["meta"]["key"].as_str() {
                    Some("iifname") => rule.pattern = scalar(&m["right"]),
                    Some("iif") => {
                        own = Some(match m["right"]["set"].as_array() {
                            Some(items) => items.iter().map(scalar).collect(),
                            None => vec![scalar(&m["right"])],
                        })
                    }
                    _ => {}
                }
            }
            if accepts && rule.pattern.is_empty() {
                // An accept without an interface test (not the agent's: inserted behind its
                // back, until its next upkeep writes the guard again) lets every device through.
                attached = own.unwrap_or_else(|| vec!["every interface".to_string()]);
                continue;
            }
            rule.lets_through = own.unwrap_or_else(|| attached.clone());
            out.push(rule);
        }
        out
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

    /// A listing holding the guard's table with `rules`.
    fn listing(rules: Vec<ListedRule>) -> Listing {
        Listing {
            tables: vec![ListedTable {
                family: "inet".into(),
                name: TABLE.into(),
            }],
            rules,
            ..Listing::default()
        }
    }

    /// A pattern's drop rule as nft lists it: the name match, `more` statements, the drop.
    fn pattern_drop(pattern: &str, more: &[&str], packets: u64) -> ListedRule {
        let name = format!(
            r#"{{"match":{{"left":{{"meta":{{"key":"iifname"}}}},"op":"==","right":"{pattern}"}}}}"#
        );
        let mut st = vec![name.as_str()];
        st.extend_from_slice(more);
        st.push(r#"{"drop":null}"#);
        rule(&st, packets)
    }

    #[test]
    fn the_listed_guard_reads_as_pattern_devices_and_drops() {
        // The guard's first form: each pattern's rule with its own `iif !=` test.
        let listing = listing(vec![
            pattern_drop(
                "liqo-tunnel*",
                &[
                    r#"{"match":{"left":{"meta":{"key":"iif"}},"op":"!=","right":{"set":["liqo-tunnel",12]}}}"#,
                    r#"{"counter":{"bytes":0,"packets":0}}"#,
                ],
                7,
            ),
            pattern_drop("liqo.*", &[], 0),
        ]);
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
    fn the_attached_interfaces_pass_first_and_each_pattern_drops_the_rest() {
        let s = script(&["liqo-tunnel*".into(), "liqo.*".into()], &[7, 12]).unwrap();
        assert!(s.starts_with("table inet peerwall-guard {\n}\ndelete table inet peerwall-guard\n"));
        assert!(s.contains("type filter hook prerouting priority raw; policy accept;"));
        let rules: Vec<&str> = s
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("iif"))
            .collect();
        assert_eq!(rules.len(), 3, "{s}");
        assert!(rules[0].starts_with("iif { 7, 12 } accept"), "{s}");
        assert!(
            rules[1].starts_with("iifname \"liqo-tunnel*\" counter drop"),
            "{s}"
        );
        assert!(
            rules[2].starts_with("iifname \"liqo.*\" counter drop"),
            "{s}"
        );
    }

    #[test]
    fn with_nothing_attached_every_matching_interface_is_dropped() {
        let s = script(&["liqo-tunnel".into()], &[]).unwrap();
        assert!(s.contains("iifname \"liqo-tunnel\" counter drop"), "{s}");
        assert!(!s.contains("accept comment"), "{s}");
    }

    #[test]
    fn the_accept_rules_interfaces_are_what_each_pattern_lets_through() {
        let listing = listing(vec![
            rule(
                &[
                    r#"{"match":{"left":{"meta":{"key":"iif"}},"op":"==","right":{"set":["liqo-tunnel",12]}}}"#,
                    r#"{"accept":null}"#,
                ],
                0,
            ),
            pattern_drop(
                "liqo-tunnel*",
                &[r#"{"counter":{"bytes":0,"packets":3}}"#],
                3,
            ),
            pattern_drop("liqo.*", &[], 0),
        ]);
        let rules = rules_in(&listing).unwrap();
        assert_eq!(rules.len(), 2, "the accept rule is no pattern: {rules:?}");
        assert_eq!(rules[0].pattern, "liqo-tunnel*");
        assert_eq!(rules[0].lets_through, ["liqo-tunnel", "12"]);
        assert_eq!(rules[0].dropped, 3);
        assert_eq!(rules[1].pattern, "liqo.*");
        assert_eq!(rules[1].lets_through, ["liqo-tunnel", "12"]);
        // A bare accept inserted before the drops is shown as what it does.
        let drifted = super::tests::listing(vec![
            rule(&[r#"{"accept":null}"#], 0),
            pattern_drop("liqo-tunnel*", &[], 0),
        ]);
        assert_eq!(
            rules_in(&drifted).unwrap()[0].lets_through,
            ["every interface"]
        );
    }

    #[test]
    fn a_pattern_nftables_cannot_quote_is_refused() {
        let e = script(&["a\"b".into()], &[]).unwrap_err();
        assert!(e.to_string().contains("\"a\\\"b\""), "{e}");
    }
}
