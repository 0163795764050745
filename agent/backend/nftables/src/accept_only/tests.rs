use peerwall_policy::compile;

use crate::model::Table;
use crate::render::{render_policy, EventOptions, RenderOptions};

/// A table of two forward chains: `in` (priority 10, policy `in_policy`) with `in_rules`, and
/// `out` (priority 20, policy accept) holding `out_rules` (YAML items under `filterRules`).
fn table(
    audit: bool,
    in_policy: &str,
    in_rules: &str,
    out_rules: &str,
) -> peerwall_policy::ir::Policy {
    let chain = |name: &str, prio: u8, policy: &str, rules: &str| {
        format!("      - name: {name}\n        hook: forward\n        policy: {policy}\n        priority: {prio}\n        type: filter\n        rules:\n          filterRules:\n{rules}")
    };
    let y = format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: t, namespace: ns}}\nspec:\n  audit: {audit}\n  table:\n    name: t\n    family: INET\n    chains:\n{}{}",
        chain("in", 10, in_policy, in_rules),
        chain("out", 20, "accept", out_rules),
    );
    let objs = peerwall_intent::load::parse_all(&y, "test").expect("parses");
    compile::compile(&objs.objects).expect("compiles").policy
}

const REPLIES: &str = "            - name: replies\n              action: accept\n              match:\n                - op: eq\n                  ctstate: {value: [established, related]}\n";
const FROM_A_NET: &str = "            - name: a-net\n              action: accept\n              match:\n                - op: eq\n                  ip: {value: 10.1.0.0/16, position: src}\n";
const TUNNEL_DROP: &str = "            - name: tunnel\n              action: drop\n              match:\n                - op: eq\n                  dev: {value: liqo-tunnel, position: in}\n";

fn chains(t: &Table) -> Vec<&str> {
    t.chains.iter().map(|c| c.name.as_str()).collect()
}

fn rendered(p: &peerwall_policy::ir::Policy, opts: RenderOptions) -> Table {
    render_policy(p, opts).remove(0)
}

#[test]
fn a_chain_of_accepts_under_an_accept_policy_is_left_out_with_its_rules() {
    let out = format!("{REPLIES}{FROM_A_NET}");
    let t = rendered(
        &table(false, "accept", &format!("{REPLIES}{TUNNEL_DROP}"), &out),
        RenderOptions::default(),
    );
    assert_eq!(chains(&t), ["in"]);
    assert!(t.rules.iter().all(|r| r.chain != "out"), "{:#?}", t.rules);
    // An empty chain of policy accept too.
    let t = rendered(
        &table(false, "accept", TUNNEL_DROP, ""),
        RenderOptions::default(),
    );
    assert_eq!(chains(&t), ["in"]);
}

#[test]
fn a_chain_that_can_drop_is_kept() {
    // A drop rule among the accepts.
    let t = rendered(
        &table(false, "accept", REPLIES, &format!("{REPLIES}{TUNNEL_DROP}")),
        RenderOptions::default(),
    );
    assert_eq!(
        chains(&t),
        ["out"],
        "`in` accepts only; `out` drops the tunnel"
    );
    // Policy drop: what no rule accepts is dropped.
    let t = rendered(
        &table(false, "drop", REPLIES, TUNNEL_DROP),
        RenderOptions::default(),
    );
    assert_eq!(chains(&t), ["in", "out"]);
}

#[test]
fn chains_read_by_users_or_the_probe_are_kept() {
    let p = table(false, "drop", REPLIES, REPLIES);
    // Their counters tell the probe engine which rule decided.
    let probe = RenderOptions {
        force_counters: true,
        ..Default::default()
    };
    assert_eq!(chains(&rendered(&p, probe)), ["in", "out"]);
    // Audit mode: every rule counted and logged as a user reads it.
    let audited = table(true, "drop", REPLIES, REPLIES);
    assert_eq!(
        chains(&rendered(&audited, RenderOptions::default())),
        ["in", "out"]
    );
    // The flow log of accepted flows: a log rule in the chain.
    let events = RenderOptions {
        events: Some(EventOptions {
            group: 7,
            rate: 10,
            burst: 20,
            flow_log: true,
        }),
        ..Default::default()
    };
    assert_eq!(chains(&rendered(&p, events)), ["in", "out"]);
}
