//! Rules that change packets or how they are tracked, rather than decide them: NAT chains and
//! rules, route chains, conntrack and packet marks, MSS clamping, notrack. Liqo's gateways run
//! such rules (its remapping NAT); a peerwall object carrying them could redirect or untrack
//! another tenant's traffic, so an agent enforces them from peerwall's objects only when told
//! to (`peerwall agent --allow-packet-changes`), and the webhook refuses them otherwise.

use crate::types::{ChainType, FilterAction, FirewallConfigurationSpec};

/// One packet-changing element of a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PacketChange {
    /// Field path, as validation errors name fields (`spec.table.chains[0].rules.natRules[1]`).
    pub path: String,
    /// What it does, for the message.
    pub what: &'static str,
}

/// Every packet-changing element of `spec`, in field order (empty: the spec only filters).
pub fn packet_changes(spec: &FirewallConfigurationSpec) -> Vec<PacketChange> {
    let mut out = Vec::new();
    for (i, c) in spec.table.chains.iter().enumerate() {
        let chain = format!("spec.table.chains[{i}]");
        match c.type_ {
            Some(ChainType::Nat) => out.push(PacketChange {
                path: format!("{chain}.type"),
                what: "a NAT chain (rewrites addresses)",
            }),
            Some(ChainType::Route) => out.push(PacketChange {
                path: format!("{chain}.type"),
                what: "a route chain (re-routes changed packets)",
            }),
            Some(ChainType::Filter) | None => {}
        }
        for (j, _) in c.rules.nat_rules.iter().flatten().enumerate() {
            out.push(PacketChange {
                path: format!("{chain}.rules.natRules[{j}]"),
                what: "a NAT rule (rewrites addresses)",
            });
        }
        for (j, _) in c.rules.route_rules.iter().flatten().enumerate() {
            out.push(PacketChange {
                path: format!("{chain}.rules.routeRules[{j}]"),
                what: "a route rule",
            });
        }
        for (j, r) in c.rules.filter_rules.iter().flatten().enumerate() {
            let what = match r.action {
                Some(FilterAction::Ctmark) => "sets the conntrack mark",
                Some(FilterAction::Metamarkfromctmark) => "sets the packet mark",
                Some(FilterAction::Tcpmssclamp) => "rewrites the TCP MSS",
                Some(FilterAction::Notrack) => "turns connection tracking off",
                Some(FilterAction::Accept | FilterAction::Drop | FilterAction::Reject) | None => {
                    continue
                }
            };
            out.push(PacketChange {
                path: format!("{chain}.rules.filterRules[{j}].action"),
                what,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load;

    fn spec(yaml: &str) -> FirewallConfigurationSpec {
        let v: serde_json::Value = serde_yaml::from_str(yaml).expect("yaml");
        serde_json::from_value(v).expect("spec")
    }

    #[test]
    fn a_filtering_spec_changes_nothing() {
        let s = spec(
            "table: {name: t, family: INET, chains: [{name: f, type: filter, hook: forward, policy: drop, rules: {filterRules: [{name: a, action: accept, match: [{op: eq, ctstate: {value: [established]}}]}, {name: d, action: drop}, {name: r, action: reject}]}}]}",
        );
        assert!(packet_changes(&s).is_empty());
    }

    #[test]
    fn nat_route_marks_mss_and_notrack_are_named_by_field_path() {
        let s = spec(
            "table: {name: t, family: IPV4, chains: [\
             {name: n, type: nat, hook: prerouting, rules: {natRules: [{name: x, natType: dnat, to: 10.0.0.1, match: []}]}},\
             {name: f, type: filter, hook: forward, rules: {filterRules: [{name: a, action: accept}, {name: m, action: ctmark, value: '1'}, {name: u, action: notrack}, {name: s, action: tcpmssclamp, value: '1200'}, {name: p, action: metamarkfromctmark}]}},\
             {name: r, type: route, hook: output, rules: {routeRules: [{name: q}]}}]}",
        );
        let got: Vec<(String, &str)> = packet_changes(&s)
            .into_iter()
            .map(|c| (c.path, c.what))
            .collect();
        let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "spec.table.chains[0].type",
                "spec.table.chains[0].rules.natRules[0]",
                "spec.table.chains[1].rules.filterRules[1].action",
                "spec.table.chains[1].rules.filterRules[2].action",
                "spec.table.chains[1].rules.filterRules[3].action",
                "spec.table.chains[1].rules.filterRules[4].action",
                "spec.table.chains[2].type",
                "spec.table.chains[2].rules.routeRules[0]",
            ]
        );
        assert_eq!(got[3].1, "turns connection tracking off");
    }

    #[test]
    fn every_liqo_shape_that_changes_packets_is_seen() {
        // Liqo's own gateway and fabric configurations (examples/liqo): remapping NAT,
        // masquerade bypass, notrack, MSS clamping, ctmark routing.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/liqo");
        let mut files = 0;
        for sub in ["gateway", "fabric"] {
            for e in std::fs::read_dir(root.join(sub))
                .expect("examples/liqo")
                .flatten()
            {
                let text = std::fs::read_to_string(e.path()).expect("read");
                let origin = e.path().display().to_string();
                let objs = load::parse_documents(&text, &origin).expect("Liqo's shapes load");
                let seen: Vec<&str> = objs
                    .iter()
                    .flat_map(|o| packet_changes(&o.spec))
                    .map(|c| c.what)
                    .collect();
                for (word, what) in [
                    ("natRules", "a NAT rule (rewrites addresses)"),
                    ("notrack", "turns connection tracking off"),
                    ("tcpmssclamp", "rewrites the TCP MSS"),
                    ("ctmark", "sets the conntrack mark"),
                ] {
                    assert_eq!(
                        text.contains(word),
                        seen.contains(&what),
                        "{origin}: {word} / {seen:?}"
                    );
                }
                files += 1;
            }
        }
        assert!(files >= 10, "{files} Liqo shapes read");
    }
}
