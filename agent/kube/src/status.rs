//! `peerwall status`: every peer's protection at a glance, from what the API server holds: the
//! peer's Liqo tenant namespace, its gateway configurations and their per-host conditions
//! (written by the agents, with their backend), the controller's `NotEnforced` condition, and
//! the Events agents publish (`Dropped`/`Rejected`/`WouldDrop` summaries, `Ignored`). Pure:
//! [`summarize`] takes plain data; the CLI fetches it ([`fetch`]). Before the peers, whether
//! each component of the install works ([`components`]).

pub mod components;
mod fetch;

pub use fetch::{fetch, fetch_install};

use std::collections::BTreeMap;

use serde::Serialize;

/// One Event, reduced to what the status reads.
#[derive(Clone, Debug, Default)]
pub struct EventInfo {
    /// `Dropped`, `Rejected`, `WouldDrop`, `Ignored`, `NotApplied`, ...
    pub reason: String,
    /// Namespace and name of the object it is about.
    pub namespace: String,
    /// Name of that object.
    pub name: String,
    /// Its note.
    pub note: String,
    /// When it last happened (Unix seconds), if known.
    pub time: Option<i64>,
    /// How many times (a series counts repeats).
    pub count: u64,
}

/// One host that reported on a peer's configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Host {
    /// Host name (node, or gateway pod).
    pub host: String,
    /// Backend it enforces with, as it reported.
    pub backend: Option<String>,
    /// `Applied`, `Error`.
    pub state: String,
    /// It reported the configuration's current generation.
    pub current: bool,
    /// Its message (errors, warnings, the emergency switch).
    pub message: Option<String>,
}

/// A peer's protection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerStatus {
    /// The peer (Liqo cluster id).
    pub peer: String,
    /// Its tenant namespace.
    pub namespace: String,
    /// Gateway configurations found for it (peerwall objects labelled for its gateway).
    pub configurations: Vec<String>,
    /// The newest generation among them.
    pub generation: Option<i64>,
    /// Any of them in audit mode.
    pub audit: bool,
    /// Hosts reporting, per configuration.
    pub hosts: Vec<Host>,
    /// The controller's `NotEnforced` message, if any configuration has it.
    pub not_enforced: Option<String>,
    /// Packets dropped or rejected in the window, as the agents' summaries count them.
    pub drops: u64,
    /// Packets an audited chain would have dropped in the window.
    pub would_drops: u64,
    /// The latest error: an `Error` condition's message, or an `Ignored` event.
    pub last_error: Option<String>,
    /// Enforced: at least one host applies the current generation of every configuration,
    /// none errs, and the controller does not report it unenforced.
    pub enforced: bool,
    /// The controller has not seen Liqo's `Configuration` of the peer, so its gateway
    /// configuration drops everything from the tunnel (no source can be checked yet).
    pub tunnel_closed: bool,
}

/// Whether a gateway configuration holds the rule that closes the tunnel while Liqo's
/// `Configuration` is unknown ([`crate::protection::NO_CONFIGURATION_RULE`]).
fn closes_tunnel(c: &serde_json::Value) -> bool {
    c["spec"]["table"]["chains"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|ch| ch["rules"]["filterRules"].as_array().into_iter().flatten())
        .any(|r| r["name"].as_str() == Some(crate::protection::NO_CONFIGURATION_RULE))
}

/// The count at the start of a summary note ("gw-1: dropped 12 packets from …").
fn packets_of(note: &str) -> u64 {
    let after = note
        .split_once(": ")
        .map_or(note, |(_, rest)| rest)
        .trim_start_matches("would have ");
    after
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The status of every peer with a tenant namespace (`tenants`: namespace → peer), from the
/// gateway `configs` (FirewallConfigurations as JSON) and `events` after `since` (Unix s).
pub fn summarize(
    tenants: &BTreeMap<String, String>,
    configs: &[serde_json::Value],
    events: &[EventInfo],
    since: i64,
) -> Vec<PeerStatus> {
    let mut out = Vec::new();
    for (ns, peer) in tenants {
        let mine: Vec<&serde_json::Value> = configs
            .iter()
            .filter(|c| {
                c["metadata"]["labels"][crate::PEER].as_str() == Some(peer.as_str())
                    && c["metadata"]["labels"][crate::TARGET].as_str()
                        == Some(crate::TARGET_GATEWAY)
            })
            .collect();
        let mut s = PeerStatus {
            peer: peer.clone(),
            namespace: ns.clone(),
            configurations: Vec::new(),
            generation: None,
            audit: false,
            hosts: Vec::new(),
            not_enforced: None,
            drops: 0,
            would_drops: 0,
            last_error: None,
            enforced: !mine.is_empty(),
            tunnel_closed: mine.iter().any(|c| closes_tunnel(c)),
        };
        let mut error_time: Option<(i64, String)> = None;
        for c in &mine {
            let name = c["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let cns = c["metadata"]["namespace"].as_str().unwrap_or_default();
            s.configurations.push(format!("{cns}/{name}"));
            let generation = c["metadata"]["generation"].as_i64();
            s.generation = s.generation.max(generation);
            s.audit |= c["spec"]["audit"].as_bool().unwrap_or(false);
            let mut applied_current = false;
            for cond in c["status"]["conditions"].as_array().into_iter().flatten() {
                let state = cond["type"].as_str().unwrap_or_default().to_string();
                let message = cond["message"].as_str().map(str::to_string);
                let current = cond["observedGeneration"].as_i64() == generation;
                if state == "NotEnforced" {
                    s.not_enforced = message.clone();
                    s.enforced = false;
                    continue;
                }
                if state == "Error" {
                    s.enforced = false;
                    s.last_error = message.clone();
                }
                applied_current |= state == "Applied" && current;
                s.hosts.push(Host {
                    host: cond["host"].as_str().unwrap_or_default().to_string(),
                    backend: cond["backend"].as_str().map(str::to_string),
                    state,
                    current,
                    message,
                });
            }
            s.enforced &= applied_current;
            for e in events
                .iter()
                .filter(|e| e.namespace == cns && e.name == name)
                .filter(|e| e.time.is_none_or(|t| t >= since))
            {
                let n = packets_of(&e.note) * e.count.max(1);
                match e.reason.as_str() {
                    "Dropped" | "Rejected" => s.drops += n,
                    "WouldDrop" => s.would_drops += n,
                    "Ignored" | "NotApplied" => {
                        let t = e.time.unwrap_or(0);
                        if error_time.as_ref().is_none_or(|(old, _)| t >= *old) {
                            error_time = Some((t, e.note.clone()));
                        }
                    }
                    _ => {}
                }
            }
        }
        if s.last_error.is_none() {
            s.last_error = error_time.map(|(_, n)| n);
        }
        s.hosts = merge_hosts(std::mem::take(&mut s.hosts));
        out.push(s);
    }
    out
}

/// One entry per host: a host reports once per configuration of the peer, and the peer is
/// current on it only where every one of them is; its error, if any, is the one kept.
fn merge_hosts(hosts: Vec<Host>) -> Vec<Host> {
    let mut out: Vec<Host> = Vec::new();
    for h in hosts {
        match out.iter_mut().find(|o| o.host == h.host) {
            None => out.push(h),
            Some(o) => {
                o.current &= h.current;
                if o.backend.is_none() {
                    o.backend = h.backend;
                }
                if h.state != "Applied" && o.state == "Applied" {
                    o.state = h.state;
                    o.message = h.message;
                }
            }
        }
    }
    out
}

/// The table `peerwall status` prints.
pub fn render(rows: &[PeerStatus], window_minutes: u64) -> String {
    // Errors in full below the table: a message is never cut.
    let mut notes: Vec<String> = Vec::new();
    let mut t = vec![[
        "PEER".to_string(),
        "ENFORCED".into(),
        "HOSTS (BACKEND)".into(),
        "GENERATION".into(),
        "AUDIT".into(),
        format!("DROPS {window_minutes}m"),
        "LAST ERROR".into(),
    ]];
    for r in rows {
        let hosts: Vec<String> = r
            .hosts
            .iter()
            .map(|h| {
                format!(
                    "{}{} ({})",
                    h.host,
                    match (h.state.as_str(), h.current) {
                        ("Applied", true) => "",
                        ("Applied", false) => " [old generation]",
                        _ => " [error]",
                    },
                    h.backend.as_deref().unwrap_or("?")
                )
            })
            .collect();
        let enforced = match (&r.not_enforced, r.configurations.is_empty(), r.enforced) {
            (_, true, _) => "no configuration".to_string(),
            (Some(_), _, _) => "NOT ENFORCED".to_string(),
            (None, _, true) if r.tunnel_closed => {
                "yes, tunnel closed (no Liqo Configuration)".to_string()
            }
            (None, _, true) => "yes".to_string(),
            (None, _, false) => "no".to_string(),
        };
        let current: Vec<String> = r
            .hosts
            .iter()
            .filter(|h| h.current && h.state == "Applied")
            .map(|h| h.host.clone())
            .collect();
        t.push([
            r.peer.clone(),
            enforced,
            if hosts.is_empty() {
                "–".into()
            } else {
                hosts.join(", ")
            },
            r.generation.map_or("–".into(), |g| {
                format!("{g} ({}/{} hosts current)", current.len(), r.hosts.len())
            }),
            if r.audit { "on".into() } else { "off".into() },
            if r.would_drops > 0 {
                format!("{} (+{} would-drop)", r.drops, r.would_drops)
            } else {
                r.drops.to_string()
            },
            match r.last_error.clone().or_else(|| r.not_enforced.clone()) {
                Some(e) => {
                    notes.push(format!("[{}] {}: {e}", notes.len() + 1, r.peer));
                    format!("[{}] below", notes.len())
                }
                None => "–".into(),
            },
        ]);
    }
    let widths: Vec<usize> = (0..7)
        .map(|i| t.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &t {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    if !notes.is_empty() {
        out.push('\n');
        for n in notes {
            out.push_str(&n);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(peer: &str, generation: i64, conditions: serde_json::Value) -> serde_json::Value {
        json!({
            "metadata": {"name": "peerwall-gateway", "namespace": format!("liqo-tenant-{peer}"),
                "generation": generation,
                "labels": {"peerwall.io/target": "gateway", "peerwall.io/remote-cluster-id": peer}},
            "spec": {"table": {"name": "t"}},
            "status": {"conditions": conditions},
        })
    }

    /// A gateway configuration built before Liqo's `Configuration` of the peer was seen
    /// closes the tunnel, and the status says so; one with the peer's CIDRs does not.
    #[test]
    fn a_closed_tunnel_is_named() {
        use crate::protection as p;
        let applied = json!([{"host": "n1", "type": "Applied", "status": "True", "observedGeneration": 1, "backend": "nftables"}]);
        let opts = p::boot::default_options();
        let mut configs = Vec::new();
        for (peer, sources) in [("a", vec![]), ("b", vec!["10.10.0.0/16".parse().unwrap()])] {
            let who = p::Peer {
                id: peer.into(),
                tenant_namespace: format!("liqo-tenant-{peer}"),
                sources,
            };
            let mut c = p::gateway_object(&who, &Default::default(), &opts);
            c["metadata"]["generation"] = json!(1);
            c["status"] = json!({"conditions": applied.clone()});
            configs.push(c);
        }
        let tenants = BTreeMap::from([
            ("liqo-tenant-a".to_string(), "a".to_string()),
            ("liqo-tenant-b".to_string(), "b".to_string()),
        ]);
        let rows = summarize(&tenants, &configs, &[], 0);
        assert!(rows[0].tunnel_closed && rows[0].enforced);
        assert!(!rows[1].tunnel_closed && rows[1].enforced);
        let out = render(&rows, 15);
        assert!(
            out.lines()
                .any(|l| l.starts_with("a ")
                    && l.contains("yes, tunnel closed (no Liqo Configuration)")),
            "{out}"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("b ") && l.contains(" yes ")),
            "{out}"
        );
    }

    #[test]
    fn a_peer_is_enforced_when_a_host_applies_its_current_generation() {
        let tenants = BTreeMap::from([
            ("liqo-tenant-a".to_string(), "a".to_string()),
            ("liqo-tenant-b".to_string(), "b".to_string()),
            ("liqo-tenant-c".to_string(), "c".to_string()),
        ]);
        let configs = vec![
            config(
                "a",
                3,
                json!([{"host": "n1", "type": "Applied", "status": "True", "observedGeneration": 3, "backend": "bpf"}]),
            ),
            config(
                "b",
                2,
                json!([
                    {"host": "n1", "type": "Applied", "status": "True", "observedGeneration": 1, "backend": "nftables"},
                    {"host": "n2", "type": "Error", "status": "True", "observedGeneration": 2, "message": "spec.table.chains[0].policy: bad", "backend": "nftables"},
                ]),
            ),
        ];
        let events = vec![
            EventInfo {
                reason: "Dropped".into(),
                namespace: "liqo-tenant-a".into(),
                name: "peerwall-gateway".into(),
                note: "n1: dropped 12 packets from 10.0.0.1 to 10.0.0.2 by rule t/c/r in the last 60 s".into(),
                time: Some(1000),
                count: 2,
            },
            EventInfo {
                reason: "Dropped".into(),
                namespace: "liqo-tenant-a".into(),
                name: "peerwall-gateway".into(),
                note: "n1: dropped 5 packets from 10.0.0.1 to 10.0.0.2 by rule t/c/r in the last 60 s".into(),
                time: Some(10),
                count: 1,
            },
            EventInfo {
                reason: "WouldDrop".into(),
                namespace: "liqo-tenant-a".into(),
                name: "peerwall-gateway".into(),
                note: "n1: would have dropped 7 packets from 10.0.0.1 to 10.0.0.3 by rule t/c/r in the last 60 s".into(),
                time: Some(1000),
                count: 1,
            },
        ];
        let rows = summarize(&tenants, &configs, &events, 900);
        assert_eq!(rows.len(), 3);
        let a = &rows[0];
        assert!(a.enforced, "{a:?}");
        assert_eq!(
            (a.drops, a.would_drops),
            (24, 7),
            "the old event is outside the window"
        );
        assert_eq!(a.hosts[0].backend.as_deref(), Some("bpf"));
        let b = &rows[1];
        assert!(!b.enforced);
        assert_eq!(
            b.last_error.as_deref(),
            Some("spec.table.chains[0].policy: bad")
        );
        assert!(!b.hosts[0].current);
        let c = &rows[2];
        assert!(!c.enforced && c.configurations.is_empty());
        let text = render(&rows, 15);
        assert!(text.contains("n1 (bpf)"), "{text}");
        assert!(text.contains("n1 [old generation] (nftables)"), "{text}");
        assert!(text.contains("no configuration"), "{text}");
        assert!(text.contains("24 (+7 would-drop)"), "{text}");
    }

    /// A host reporting on two configurations of one peer is one host, current only if both
    /// are; a long error is printed whole, below the table.
    #[test]
    fn each_host_once_and_errors_in_full() {
        let tenants = BTreeMap::from([("liqo-tenant-a".to_string(), "a".to_string())]);
        let mut second = config(
            "a",
            4,
            json!([{"host": "n1", "type": "Applied", "status": "True", "observedGeneration": 3, "backend": "nftables"}]),
        );
        second["metadata"]["name"] = json!("peerwall-netpol");
        let long = format!(
            "spec.table.chains[0].rules.filterRules[0].match[0].ip.value: {}",
            "x".repeat(300)
        );
        let configs = vec![
            config(
                "a",
                2,
                json!([{"host": "n1", "type": "Applied", "status": "True", "observedGeneration": 2, "backend": "nftables"},
                       {"host": "n2", "type": "Error", "status": "True", "observedGeneration": 2, "backend": "nftables", "message": long}]),
            ),
            second,
        ];
        let rows = summarize(&tenants, &configs, &[], 0);
        let hosts: Vec<&str> = rows[0].hosts.iter().map(|h| h.host.as_str()).collect();
        assert_eq!(hosts, ["n1", "n2"], "{rows:?}");
        assert!(
            !rows[0].hosts[0].current,
            "n1 is behind on the second configuration"
        );
        let out = render(&rows, 15);
        assert!(out.contains("(0/2 hosts current)"), "{out}");
        assert!(out.contains(&format!("[1] a: {long}")), "{out}");
    }

    #[test]
    fn the_controllers_not_enforced_condition_wins() {
        let tenants = BTreeMap::from([("liqo-tenant-a".to_string(), "a".to_string())]);
        let configs = vec![config(
            "a",
            1,
            json!([{"host": "peerwall-controller", "type": "NotEnforced", "status": "True", "message": "no host applied generation 1 for 60 s"}]),
        )];
        let rows = summarize(&tenants, &configs, &[], 0);
        assert!(!rows[0].enforced);
        assert!(render(&rows, 15).contains("NOT ENFORCED"));
    }
}
