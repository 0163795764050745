use peerwall_policy::compile;

use super::*;
use crate::render::{render_policy, RenderOptions};

/// The FirewallConfiguration of one table `t` (family `family`) with chain `fwd` (forward
/// hook, policy accept) holding `rules` (YAML items under `filterRules`), and sets `s0`..`s9`
/// of one address each.
fn policy(family: &str, rules: &str) -> peerwall_policy::ir::Policy {
    let mut y = format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: t, namespace: ns}}\nspec:\n  table:\n    name: t\n    family: {family}\n    sets:\n"
    );
    for i in 0..10 {
        y.push_str(&format!(
            "      - {{name: s{i}, keyType: ipv4_addr, elements: [{{key: 10.0.{i}.1}}, {{key: 10.1.{i}.1}}]}}\n"
        ));
    }
    y.push_str("    chains:\n      - name: fwd\n        hook: forward\n        policy: accept\n        priority: 0\n        type: filter\n        rules:\n          filterRules:\n");
    y.push_str(rules);
    let objs = peerwall_intent::load::parse_all(&y, "test").expect("parses");
    compile::compile(&objs.objects).expect("compiles").policy
}

fn accept_dst(name: &str, set: &str, port: u16) -> String {
    format!(
        "            - name: {name}\n              action: accept\n              match:\n                - op: eq\n                  ip: {{value: \"@{set}\", position: dst}}\n                - op: eq\n                  proto: {{value: udp}}\n                - op: eq\n                  port: {{value: \"{port}\", position: dst}}\n"
    )
}

const REPLIES: &str = "            - name: replies\n              action: accept\n              match:\n                - op: eq\n                  ctstate: {value: [established, related]}\n";
const TUNNEL_DROP: &str = "            - name: tunnel\n              action: drop\n              match:\n                - op: eq\n                  dev: {value: liqo-tunnel, position: in}\n";

fn rendered(p: &peerwall_policy::ir::Policy, opts: RenderOptions) -> Table {
    render_policy(p, opts).remove(0)
}

fn lines(t: &Table) -> Vec<String> {
    t.rules
        .iter()
        .map(|r| {
            format!(
                "{}: {} [{}]",
                r.chain,
                r.exprs.iter().map(Expr::text).collect::<Vec<_>>().join(" "),
                r.comment
            )
        })
        .collect()
}

#[test]
fn accepting_rules_of_key_fields_add_and_the_lookup_follows_the_replies() {
    let rules = format!(
        "{REPLIES}{}{}",
        accept_dst("a", "s0", 53),
        accept_dst("b", "s1", 80)
    );
    let t = rendered(&policy("INET", &rules), RenderOptions::default());
    let l = lines(&t);
    assert!(
        l[0].contains("ct state") && l[0].ends_with("accept [replies]"),
        "{l:#?}"
    );
    assert_eq!(
        l[1],
        "fwd: ip daddr . ip saddr . th dport . meta l4proto @__pw_d0_4 counter accept [__pw_decided]"
    );
    assert_eq!(
        l[2],
        "fwd: ip6 daddr . ip6 saddr . th dport . meta l4proto @__pw_d0_6 counter accept [__pw_decided]"
    );
    assert!(l[3].ends_with("goto __pw_keep0 [a]"), "{l:#?}");
    assert!(l[4].ends_with("goto __pw_keep0 [b]"), "{l:#?}");
    // The keep chain: both families' updates, then an accept of its own.
    let keep: Vec<&String> = l.iter().filter(|x| x.starts_with("__pw_keep0:")).collect();
    assert_eq!(
        keep,
        [
            "__pw_keep0: update @__pw_d0_4 { ip daddr . ip saddr . th dport . meta l4proto } [__pw_decided]",
            "__pw_keep0: update @__pw_d0_6 { ip6 daddr . ip6 saddr . th dport . meta l4proto } [__pw_decided]",
            "__pw_keep0: accept [__pw_decided]",
        ]
    );
    assert_eq!(sets_of(&t), ["__pw_d0_4", "__pw_d0_6"]);
    assert!(t
        .sets
        .iter()
        .filter(|s| s.timeout.is_some())
        .all(|s| s.timeout == Some(TIMEOUT_SECS) && s.capacity().is_some()));
    assert!(t
        .regular
        .iter()
        .any(|r| r.name == "__pw_keep0" && r.base == "fwd"));
    // An ip table has the IPv4 set alone.
    let t = rendered(&policy("IPV4", &rules), RenderOptions::default());
    assert_eq!(sets_of(&t), ["__pw_d0_4"]);
}

#[test]
fn a_drop_by_another_field_pins_the_lookup_below_it() {
    // A drop on the input interface after the first accept: the lookup goes below it, and only
    // the accept below adds.
    let rules = format!(
        "{}{TUNNEL_DROP}{}",
        accept_dst("a", "s0", 53),
        accept_dst("b", "s1", 80)
    );
    let t = rendered(&policy("IPV4", &rules), RenderOptions::default());
    let l = lines(&t);
    assert!(l[0].ends_with("accept [a]"), "{l:#?}");
    assert!(l[1].ends_with("drop [tunnel]"), "{l:#?}");
    assert!(
        l[2].ends_with("[__pw_decided]") && l[2].contains("@__pw_d0_4"),
        "{l:#?}"
    );
    assert!(l[3].ends_with("goto __pw_keep0 [b]"), "{l:#?}");
    // The drop last: nothing below it to shortcut, no cache.
    let rules = format!(
        "{}{}{TUNNEL_DROP}",
        accept_dst("a", "s0", 53),
        accept_dst("b", "s1", 80)
    );
    let t = rendered(&policy("IPV4", &rules), RenderOptions::default());
    assert!(sets_of(&t).is_empty(), "{:#?}", lines(&t));
    assert!(t.regular.is_empty());
    assert!(lines(&t).iter().all(|l| !l.contains("goto")));
}

#[test]
fn a_rule_testing_the_source_port_never_adds_and_a_drop_by_it_pins() {
    let sport_accept = "            - name: sp\n              action: accept\n              match:\n                - op: eq\n                  proto: {value: udp}\n                - op: eq\n                  port: {value: \"5353\", position: src}\n";
    let sport_drop = sport_accept.replace("action: accept", "action: drop");
    // An accept by the source port: kept as it is, the rule below still adds.
    let rules = format!("{sport_accept}{}", accept_dst("a", "s0", 53));
    let l = lines(&rendered(&policy("IPV4", &rules), RenderOptions::default()));
    assert!(l.iter().any(|x| x.ends_with("accept [sp]")), "{l:#?}");
    assert!(
        l.iter().any(|x| x.ends_with("goto __pw_keep0 [a]")),
        "{l:#?}"
    );
    // A drop by the source port below an accept: a packet of the same key from another port
    // would be dropped, so no cached verdict may skip it: the lookup goes below it.
    let rules = format!(
        "{}{sport_drop}{}",
        accept_dst("a", "s0", 53),
        accept_dst("b", "s1", 80)
    );
    let l = lines(&rendered(&policy("IPV4", &rules), RenderOptions::default()));
    let drop_at = l.iter().position(|x| x.ends_with("drop [sp]")).unwrap();
    let lookup_at = l
        .iter()
        .position(|x| x.contains("@__pw_d0_4 counter"))
        .unwrap();
    assert!(lookup_at > drop_at, "{l:#?}");
    assert!(l.iter().any(|x| x.ends_with("accept [a]")), "{l:#?}");
}

#[test]
fn no_cache_where_counters_are_forced_in_audit_mode_or_when_asked() {
    let rules = format!("{REPLIES}{}", accept_dst("a", "s0", 53));
    let p = policy("IPV4", &rules);
    for opts in [
        RenderOptions {
            force_counters: true,
            ..RenderOptions::default()
        },
        RenderOptions {
            no_flow_cache: true,
            ..RenderOptions::default()
        },
    ] {
        let t = rendered(&p, opts);
        assert!(sets_of(&t).is_empty() && t.regular.is_empty(), "{opts:?}");
    }
    let mut audited = p.clone();
    audited.tables[0].audit = true;
    let t = rendered(&audited, RenderOptions::default());
    assert!(sets_of(&t).is_empty(), "{:#?}", lines(&t));
}

#[test]
fn a_dispatched_run_adds_from_its_class_chains() {
    let mut rules = String::from(REPLIES);
    for i in 0..10 {
        rules.push_str(&accept_dst(
            &format!("r{i}"),
            &format!("s{i}"),
            8000 + i as u16,
        ));
    }
    let t = rendered(&policy("IPV4", &rules), RenderOptions::default());
    let l = lines(&t);
    assert!(l.iter().any(|x| x.contains("vmap @__pw_v")), "{l:#?}");
    let class_gotos = l
        .iter()
        .filter(|x| x.starts_with("__pw_k") && x.contains("goto __pw_keep0"))
        .count();
    assert_eq!(class_gotos, 10, "{l:#?}");
    assert!(l.iter().all(|x| !x.ends_with(" accept [r0]")), "{l:#?}");
}

#[test]
fn every_edit_of_a_table_with_a_cache_flushes_it_first() {
    let rules = format!("{REPLIES}{}", accept_dst("a", "s0", 53));
    let old = rendered(&policy("INET", &rules), RenderOptions::default());
    let mut new = old.clone();
    let s0 = new.sets.iter_mut().find(|s| s.name == "s0").unwrap();
    s0.elements.pop();
    let cmds = crate::plan::element_commands(&new, &old);
    let kinds: Vec<String> = cmds
        .iter()
        .map(|c| match c {
            Command::FlushSet { set, .. } => format!("flush {set}"),
            Command::DeleteElements { set, .. } => format!("delete {set}"),
            Command::AddElements { set, .. } => format!("add {set}"),
            _ => "other".into(),
        })
        .collect();
    assert_eq!(kinds, ["flush __pw_d0_4", "flush __pw_d0_6", "delete s0"]);
    // Nothing changed: nothing flushed.
    assert!(crate::plan::element_commands(&old, &old).is_empty());
    // The slice path's edits, for two tables: each table's flushes once, ahead of all.
    let cmds = with_flushes(vec![
        Command::DeleteElements {
            table: &new,
            set: "s0",
            elements: vec![],
        },
        Command::AddElements {
            table: &new,
            set: "s1",
            elements: vec![],
        },
    ]);
    assert_eq!(cmds.len(), 4);
    assert!(matches!(
        cmds[0],
        Command::FlushSet {
            set: "__pw_d0_4",
            ..
        }
    ));
    assert!(matches!(
        cmds[1],
        Command::FlushSet {
            set: "__pw_d0_6",
            ..
        }
    ));
    // Over netlink, a flush is a delete without elements, in the same batch.
    let edits = crate::netlink::element_edits(&cmds[..2]).expect("netlink");
    assert!(edits.iter().all(|e| e.flush && !e.add && e.keys.is_empty()));
}

#[test]
fn a_flush_goes_to_nft_as_flush_set() {
    let rules = format!("{REPLIES}{}", accept_dst("a", "s0", 53));
    let t = rendered(&policy("IPV4", &rules), RenderOptions::default());
    let doc = crate::json::document(&flushes(&t));
    assert_eq!(
        doc,
        serde_json::json!({"nftables": [{"flush": {"set": {
            "family": "ip", "table": "t", "name": "__pw_d0_4"}}}]})
    );
    // The set as nft creates it: a timeout set of the key's four types, sized.
    let set = t.sets.iter().find(|s| s.name == "__pw_d0_4").unwrap();
    let created = crate::json::document(&[Command::Create(&t)]).to_string();
    assert!(
        created.contains(r#""type":["ipv4_addr","ipv4_addr","inet_service","inet_proto"]"#)
            && created.contains(r#""flags":["timeout"]"#)
            && created.contains(&format!(r#""size":{}"#, set.capacity().unwrap())),
        "{created}"
    );
}
