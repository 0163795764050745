//! Validation and lowering, data in → data out.

use super::*;
use crate::ir::{evaluate, CtState, Packet, Verdict, VerdictAction};
use peerwall_intent::load::{parse_documents, LoadError};

fn objects(yaml: &str) -> Vec<PolicyObject> {
    parse_documents(yaml, "test.yaml").expect("parses")
}

fn errors(yaml: &str) -> Vec<String> {
    match compile(&objects(yaml)) {
        Ok(_) => vec![],
        Err(e) => e
            .objects
            .iter()
            .flat_map(|o| o.errors.iter().map(ToString::to_string))
            .collect(),
    }
}

fn policy(yaml: &str) -> ir::Policy {
    compile(&objects(yaml)).expect("compiles").policy
}

/// A FirewallConfiguration around one chain's YAML (indented 6 spaces).
fn wrap(family: &str, chain: &str) -> String {
    format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: t, namespace: ns}}\nspec:\n  table:\n    name: t\n    family: {family}\n    chains:\n{chain}"
    )
}

fn pkt(src: &str, dst: &str) -> Packet {
    Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        proto: ir::eval::proto::TCP,
        sport: 40000,
        dport: 80,
        iif: Some("liqo-tunnel".into()),
        oif: Some("liqo.abcdefghij".into()),
        ct_state: CtState::New,
    }
}

const THESIS_BLOCK: &str = include_str!("../../../../examples/thesis-block.yaml");
const PROVIDER: &str = include_str!("../../../../examples/provider-protection.yaml");

#[test]
fn an_audited_object_accepts_what_it_would_drop_and_says_so() {
    let audited = PROVIDER.replacen("spec:\n", "spec:\n  audit: true\n", 1);
    assert_ne!(audited, PROVIDER);
    let enforced = policy(PROVIDER);
    let p = policy(&audited);
    assert!(p.tables.iter().all(|t| t.audit));
    // A packet the enforced policy drops: accepted, with the would-drop reported.
    let mut probe = pkt("10.10.1.67", "10.20.3.10");
    probe.iif = Some("liqo-tunnel".into());
    let e = evaluate(&enforced, &probe);
    assert_ne!(e.verdict, VerdictAction::Accept, "{e:?}");
    let v = evaluate(&p, &probe);
    assert_eq!(v.verdict, VerdictAction::Accept);
    let hit = v.audit.expect("a would-drop");
    assert_eq!(hit.would, e.verdict);
    assert_eq!(
        (Some(hit.table), Some(hit.chain), hit.rule),
        (e.table, e.chain, e.rule)
    );
    // What the enforced policy accepts has no would-drop.
    let allowed = pkt("10.10.1.67", "10.20.1.2");
    assert_eq!(evaluate(&enforced, &allowed).verdict, VerdictAction::Accept);
    assert_eq!(evaluate(&p, &allowed).audit, None);
}

#[test]
fn thesis_block_example() {
    let p = policy(THESIS_BLOCK);
    let v = evaluate(&p, &pkt("10.10.1.67", "10.20.1.2"));
    assert_eq!(
        v,
        Verdict {
            verdict: VerdictAction::Drop,
            table: Some("table_name".into()),
            chain: Some("filter_chain_name".into()),
            rule: Some("drop_traffic".into()),
            audit: None,
        }
    );
    // Reverse traffic and other pods pass (policy accept).
    let back = evaluate(&p, &pkt("10.20.1.2", "10.10.1.67"));
    assert_eq!(back.verdict, VerdictAction::Accept);
    assert_eq!(back.rule, None);
    assert_eq!(
        evaluate(&p, &pkt("10.10.1.68", "10.20.1.2")).verdict,
        VerdictAction::Accept
    );
    // An ip (IPv4) table never sees IPv6 packets: no chain on the path.
    let v6 = evaluate(&p, &pkt("fd00::1", "fd00::2"));
    assert_eq!(v6.chain, None);
}

#[test]
fn thesis_default_deny_with_allowlist() {
    let p = policy(PROVIDER);
    let allowed = evaluate(&p, &pkt("10.10.1.67", "10.20.1.3"));
    assert_eq!(allowed.verdict, VerdictAction::Accept);
    assert_eq!(allowed.rule.as_deref(), Some("to_offloaded_pods"));
    let denied = evaluate(&p, &pkt("10.10.1.67", "10.20.3.1"));
    assert_eq!(denied.verdict, VerdictAction::Drop);
    assert_eq!(denied.rule.as_deref(), Some("default_deny"));
    let mut reply = pkt("10.10.1.67", "10.20.3.1");
    reply.ct_state = CtState::Established;
    assert_eq!(evaluate(&p, &reply).rule.as_deref(), Some("replies"));
    // Traffic not from the tunnel is not this chain's business.
    let mut local = pkt("10.20.1.5", "10.20.3.1");
    local.iif = Some("eth0".into());
    assert_eq!(evaluate(&p, &local).verdict, VerdictAction::Accept);
}

#[test]
fn thesis_default_deny_listing_4_4() {
    let p = policy(&wrap(
        "INET",
        "      - {name: input, type: filter, hook: input, policy: drop, priority: 0}\n",
    ));
    let mut to_gw = pkt("10.10.1.67", "10.20.0.1");
    to_gw.oif = None;
    let v = evaluate(&p, &to_gw);
    assert_eq!(v.verdict, VerdictAction::Drop);
    assert_eq!(v.rule, None);
    // Forwarded traffic does not cross an input chain.
    assert_eq!(
        evaluate(&p, &pkt("10.10.1.67", "10.20.0.1")).verdict,
        VerdictAction::Accept
    );
}

#[test]
fn field_path_errors_name_path_and_value() {
    let chain = "      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: accept, match: [{op: eq, ip: {value: 10.0.0.1, position: src}}]}\n            - {name: b, action: accept, match: [{op: eq, port: {value: '80', position: dst}}]}\n            - name: c\n              action: drop\n              match:\n                - {op: eq, ip: {value: 10.0.0.1, position: src}}\n                - {op: eq, ip: {value: 10.0.0.300, position: dst}}\n";
    assert_eq!(
        errors(&wrap("IPV4", chain)),
        vec![
            "spec.table.chains[0].rules.filterRules[2].match[1].ip.value: \"10.0.0.300\" is not an address, CIDR or range"
        ]
    );
}

#[test]
fn every_error_is_reported() {
    let chain = "      - name: c\n        type: filter\n        hook: postrouting\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: reject, match: [{op: eq, ip: {value: '10.0.0.9-10.0.0.1', position: src}}]}\n            - {name: a, action: accept, match: [{op: eq, port: {value: '70000', position: dst}}]}\n            - {name: b, action: accept, match: [{op: eq, ip: {value: 'fd00::1', position: dst}}]}\n            - {name: d, action: accept, match: [{op: eq, ip: {value: '@nope', position: dst}}]}\n            - {name: e, action: accept, match: [{op: eq}]}\n            - {action: accept, match: [{op: eq, dev: {value: waytoolonginterfacename, position: in}}]}\n";
    let e = errors(&wrap("IPV4", chain));
    let p = "spec.table.chains[0].rules.filterRules";
    assert_eq!(
        e,
        vec![
            format!("{p}[1].name: \"a\" is already used at {p}[0].name"),
            format!("{p}[0].action: \"reject\" is not allowed here: nftables refuses reject in postrouting chains"),
            format!("{p}[0].match[0].ip.value: \"10.0.0.9-10.0.0.1\" is a range whose start is after its end"),
            format!("{p}[1].match[0].port.value: \"70000\" is not a port (0-65535) or port range"),
            format!("{p}[2].match[0].ip.value: \"fd00::1\" is IPv6 but the table family is IPV4"),
            format!("{p}[3].match[0].ip.value: \"@nope\" names no set of this table (spec.table.sets)"),
            format!("{p}[4].match[0]: match entry tests nothing: set one of ip, port, proto, dev, ctstate"),
            format!("{p}[5].match[0].dev.value: \"waytoolonginterfacename\" is not a valid name: interface names have at most 15 characters"),
        ]
    );
}

#[test]
fn chain_level_checks() {
    let e = errors(&wrap(
        "INET",
        "      - {name: n, type: nat, hook: forward, policy: drop, rules: {natRules: [], filterRules: []}}\n      - {name: n, type: route, hook: input, policy: accept}\n      - {name: i, type: filter, hook: ingress, policy: accept}\n      - {name: x, type: nat, hook: prerouting, policy: accept, priority: -300}\n      - {name: 'y z', type: filter, hook: input}\n",
    ));
    let c = "spec.table.chains";
    assert_eq!(
        e,
        vec![
            format!("{c}[0].hook: \"forward\" is not allowed for a chain of type \"nat\": nat chains hook prerouting, input, output or postrouting"),
            format!("{c}[0].policy: \"drop\" is not allowed: only filter chains decide verdicts"),
            format!("{c}[0].rules: 2 of natRules, filterRules, routeRules are set; set exactly one"),
            format!("{c}[1].name: \"n\" is already used at {c}[0].name"),
            format!("{c}[1].hook: \"input\" is not allowed for a chain of type \"route\": route chains only hook output"),
            format!("{c}[2].hook: \"ingress\" is not allowed for a chain of type \"filter\": an ingress chain needs a device, which the API cannot name; use prerouting"),
            format!("{c}[3].priority: -300 is not allowed: nat chains must run after conntrack (priority > -200)"),
            format!("{c}[4].name: \"y z\" is not a valid name: use a letter, digit or '_' first, then letters, digits, '_', '.', '-', '/'"),
            format!("{c}[4].policy: required field is missing"),
        ]
    );
}

#[test]
fn verdicts_refused_in_nat_chains() {
    let e = errors(&wrap(
        "IPV4",
        "      - name: n\n        type: nat\n        hook: prerouting\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: drop, match: []}\n            - {name: m, action: ctmark, value: '0x10', match: []}\n",
    ));
    assert_eq!(e.len(), 1);
    assert!(e[0].starts_with(
        "spec.table.chains[0].rules.filterRules[0].action: \"drop\" is not allowed here"
    ));
}

#[test]
fn deserialization_errors_have_paths() {
    let yaml = wrap(
        "IPV4",
        "      - {name: c, type: filter, hook: forward, policy: deny}\n",
    );
    match parse_documents(&yaml, "f.yaml") {
        Err(LoadError::Field { path, message, .. }) => {
            assert_eq!(path, "spec.table.chains[0].policy");
            assert_eq!(
                message, "unknown value `deny` (accepted: `drop`, `accept`)",
                "{message}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    let unknown = wrap(
        "IPV4",
        "      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: drop, match: [{op: eq, mark: {value: '1'}}]}\n",
    );
    match parse_documents(&unknown, "f.yaml") {
        Err(LoadError::Field { path, message, .. }) => {
            assert_eq!(
                path,
                "spec.table.chains[0].rules.filterRules[0].match[0].mark"
            );
            assert!(message.contains("unknown field `mark`"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn host_bits_are_normalized_with_a_warning() {
    let c = compile(&objects(&wrap(
        "IPV4",
        "      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: drop, match: [{op: eq, ip: {value: 10.10.1.67/24, position: src}}]}\n",
    )))
    .unwrap();
    assert_eq!(c.warnings.len(), 1);
    assert_eq!(
        c.warnings[0].1.to_string(),
        "spec.table.chains[0].rules.filterRules[0].match[0].ip.value: \"10.10.1.67/24\" has host bits set; enforced as \"10.10.1.0/24\""
    );
    let p = c.policy;
    assert_eq!(
        evaluate(&p, &pkt("10.10.1.1", "10.20.0.1")).verdict,
        VerdictAction::Drop
    );
    assert_eq!(
        evaluate(&p, &pkt("10.10.2.1", "10.20.0.1")).verdict,
        VerdictAction::Accept
    );
}

#[test]
fn neq_applies_to_each_field_and_ports_need_tcp_or_udp() {
    let p = policy(&wrap(
        "INET",
        "      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: drop, match: [{op: neq, ip: {value: 10.0.0.0/8, position: src}, port: {value: '22', position: dst}}]}\n",
    ));
    let mut k = pkt("192.168.1.1", "10.0.0.1");
    k.dport = 80;
    assert_eq!(evaluate(&p, &k).verdict, VerdictAction::Drop);
    k.dport = 22;
    assert_eq!(evaluate(&p, &k).verdict, VerdictAction::Accept);
    k.dport = 80;
    k.proto = ir::eval::proto::ICMP;
    assert_eq!(
        evaluate(&p, &k).verdict,
        VerdictAction::Accept,
        "ICMP has no ports"
    );
    let mut v6 = pkt("fd00::1", "fd00::2");
    v6.dport = 80;
    assert_eq!(
        evaluate(&p, &v6).verdict,
        VerdictAction::Accept,
        "an IPv4 address match never holds on IPv6, even negated"
    );
}

#[test]
fn out_interface_is_unknown_at_prerouting() {
    let c = compile(&objects(&wrap(
        "INET",
        "      - name: c\n        type: filter\n        hook: prerouting\n        policy: accept\n        rules:\n          filterRules:\n            - {name: eq, action: drop, match: [{op: eq, dev: {value: liqo.abcdefghij, position: out}}]}\n            - {name: neq, action: reject, match: [{op: neq, dev: {value: liqo.abcdefghij, position: out}}]}\n",
    )))
    .unwrap();
    assert_eq!(c.warnings.len(), 2);
    let v = evaluate(&c.policy, &pkt("10.0.0.1", "10.0.0.2"));
    assert_eq!(v.verdict, VerdictAction::Reject);
    assert_eq!(v.rule.as_deref(), Some("neq"));
}

#[test]
fn chains_run_in_priority_then_name_order_and_accept_moves_on() {
    let yaml = format!(
        "{}---\n{}",
        wrap(
            "INET",
            "      - {name: z_late, type: filter, hook: forward, policy: accept, priority: 10, rules: {filterRules: [{name: d, action: drop, match: [{op: eq, proto: {value: tcp}}]}]}}\n      - {name: a_early, type: filter, hook: forward, policy: accept, priority: -10, rules: {filterRules: [{name: ok, action: accept, match: [{op: eq, proto: {value: tcp}}]}]}}\n",
        ),
        wrap(
            "INET",
            "      - {name: mid, type: filter, hook: forward, policy: accept, priority: 10, rules: {filterRules: [{name: rj, action: reject, match: [{op: eq, proto: {value: tcp}}]}]}}\n",
        )
        .replace("name: t, namespace", "name: t2, namespace")
        .replace("    name: t\n", "    name: s\n")
    );
    let p = policy(&yaml);
    // a_early accepts (moves on); at priority 10 table "s" sorts before "t": reject wins.
    let v = evaluate(&p, &pkt("10.0.0.1", "10.0.0.2"));
    assert_eq!(v.verdict, VerdictAction::Reject);
    assert_eq!(v.table.as_deref(), Some("s"));
    assert_eq!(v.rule.as_deref(), Some("rj"));
}

#[test]
fn marks_do_not_decide() {
    let p = policy(&wrap(
        "IPV4",
        "      - name: c\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {name: m, action: ctmark, value: '0x10', match: []}\n            - {name: n, action: metamarkfromctmark, match: []}\n",
    ));
    let v = evaluate(&p, &pkt("10.0.0.1", "10.0.0.2"));
    assert_eq!(v.verdict, VerdictAction::Drop);
    assert_eq!(v.rule, None);
}

#[test]
fn duplicate_tables_across_objects() {
    let yaml = format!(
        "{}---\n{}",
        wrap("IPV4", ""),
        wrap("IPV6", "").replace("name: t, namespace", "name: u, namespace")
    );
    assert_eq!(
        errors(&yaml),
        vec!["spec.table.name: \"t\" is already used at ns/t spec.table.name"]
    );
}

#[test]
fn sets_are_validated_and_resolved() {
    let yaml = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: s}\nspec:\n  table:\n    name: s\n    family: INET\n    sets:\n      - {name: pods, keyType: ipv4_addr, elements: [{key: 10.0.0.1}, {key: '10.0.0.5-10.0.0.9'}, {key: 10.1.0.0/16}]}\n      - {name: ports, keyType: integer, elements: [{key: '80'}, {key: '8000-8080'}]}\n      - {name: bad, keyType: ipv6_cidr, elements: [{key: 10.0.0.1}]}\n    chains: []\n";
    assert_eq!(
        errors(yaml),
        vec!["spec.table.sets[2].elements[0].key: \"10.0.0.1\" is not a valid ipv6_cidr element"]
    );
    let ok = yaml.replace("      - {name: bad, keyType: ipv6_cidr, elements: [{key: 10.0.0.1}]}\n", "").replace(
        "    chains: []\n",
        "    chains:\n      - name: c\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {name: a, action: accept, match: [{op: eq, ip: {value: '@pods', position: dst}, port: {value: '@ports', position: dst}}]}\n            - {name: b, action: accept, match: [{op: eq, ip: {value: '@ports', position: dst}}]}\n",
    );
    assert_eq!(
        errors(&ok),
        vec!["spec.table.chains[0].rules.filterRules[1].match[0].ip.value: \"@ports\" is not a set of addresses (ipv4_addr, ipv4_cidr, ipv6_addr, ipv6_cidr)"]
    );
    let good = ok.replace("            - {name: b, action: accept, match: [{op: eq, ip: {value: '@ports', position: dst}}]}\n", "");
    let p = policy(&good);
    let mut k = pkt("10.9.9.9", "10.0.0.7");
    k.dport = 8080;
    assert_eq!(evaluate(&p, &k).verdict, VerdictAction::Accept);
    k.dport = 8081;
    assert_eq!(evaluate(&p, &k).verdict, VerdictAction::Drop);
}

#[test]
fn a_valid_liqo_object_loads_unchanged() {
    // Shape of the objects Liqo's gateway writes today (nat chains, ctmark, route chain).
    let yaml = "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata:\n  name: remap\n  namespace: liqo-tenant-x\n  labels: {networking.liqo.io/firewall-category: gateway, networking.liqo.io/firewall-subcategory: ip-mapping}\nspec:\n  table:\n    name: remap-podcidr\n    family: IPV4\n    chains:\n      - name: outgoing\n        type: nat\n        hook: postrouting\n        policy: accept\n        priority: 100\n        rules:\n          natRules:\n            - name: remap\n              natType: snat\n              to: 10.71.0.1\n              match:\n                - {op: eq, ip: {value: 10.0.0.0/16, position: src}, dev: {value: liqo-tunnel, position: out}}\n      - name: incoming\n        type: nat\n        hook: prerouting\n        policy: accept\n        priority: -100\n        rules:\n          natRules:\n            - {name: dnat, natType: dnat, to: 10.0.0.1, match: [{op: eq, ip: {value: 10.71.0.1, position: dst}}]}\n      - name: mark\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: mark, action: ctmark, value: '1', match: [{op: eq, dev: {value: 'liqo.', position: in, wildcard: true}}]}\n";
    let objs = objects(yaml);
    assert_eq!(objs[0].origin.0, "liqo-tenant-x/remap");
    let p = compile(&objs).unwrap().policy;
    assert_eq!(p.tables[0].chains.len(), 3);
    // NAT and marking never decide verdicts.
    assert_eq!(
        evaluate(&p, &pkt("10.0.0.5", "10.71.0.1")).verdict,
        VerdictAction::Accept
    );
}

#[test]
fn ctstate_before_conntrack_and_reserved_names_are_refused() {
    let e = errors(&wrap(
        "INET",
        "      - name: __mine\n        type: filter\n        hook: prerouting\n        priority: -300\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: drop, match: [{op: eq, ctstate: {value: [established]}}]}\n",
    ));
    assert_eq!(
        e,
        vec![
            "spec.table.chains[0].name: \"__mine\" is not a valid name: names starting with \"__\" are reserved for peerwall",
            "spec.table.chains[0].rules.filterRules[0].match[0].ctstate: -300 is not allowed: conntrack has not classified the packet yet at priority <= -200; use a later priority",
        ]
    );
}

#[test]
fn rules_mixing_families_are_refused() {
    let e = errors(&wrap(
        "INET",
        "      - name: c\n        type: filter\n        hook: forward\n        policy: accept\n        rules:\n          filterRules:\n            - {name: a, action: drop, match: [{op: eq, ip: {value: 10.0.0.1, position: src}}, {op: eq, ip: {value: 'fd00::1', position: dst}}]}\n",
    ));
    assert_eq!(
        e,
        vec!["spec.table.chains[0].rules.filterRules[0].match: the rule tests both IPv4 and IPv6 addresses and could never match; split it in two rules"]
    );
}

/// A FirewallConfiguration with one named set of `elements` (JSON list) and one rule
/// accepting its destinations; default drop.
fn with_set(elements: &str) -> String {
    format!(
        "{{\"apiVersion\": \"peerwall.io/v1alpha1\", \"kind\": \"FirewallConfiguration\", \"metadata\": {{\"name\": \"t\", \"namespace\": \"ns\"}}, \"spec\": {{\"table\": {{\"name\": \"t\", \"family\": \"INET\", \"sets\": [{{\"name\": \"s\", \"keyType\": \"ipv4_addr\", \"elements\": {elements}}}], \"chains\": [{{\"name\": \"c\", \"type\": \"filter\", \"hook\": \"forward\", \"priority\": 0, \"policy\": \"drop\", \"rules\": {{\"filterRules\": [{{\"name\": \"in_set\", \"action\": \"accept\", \"match\": [{{\"op\": \"eq\", \"ip\": {{\"value\": \"@s\", \"position\": \"dst\"}}}}]}}]}}}}]}}}}}}"
    )
}

fn verdict_to(p: &ir::Policy, dst: &str) -> VerdictAction {
    evaluate(p, &pkt("10.200.0.1", dst)).verdict
}

#[test]
fn a_million_element_set_compiles_and_judges_its_members() {
    let n = 1_000_000u32;
    let elems: Vec<String> = (0..n)
        .map(|i| {
            let a = std::net::Ipv4Addr::from(0x0a00_0000 + 2 * i);
            format!("{{\"key\": \"{a}\"}}")
        })
        .collect();
    let p = policy(&with_set(&format!("[{}]", elems.join(","))));
    assert_eq!(verdict_to(&p, "10.0.0.0"), VerdictAction::Accept);
    let last = std::net::Ipv4Addr::from(0x0a00_0000 + 2 * (n - 1));
    assert_eq!(verdict_to(&p, &last.to_string()), VerdictAction::Accept);
    // Odd addresses are between members.
    assert_eq!(verdict_to(&p, "10.0.0.1"), VerdictAction::Drop);
}

#[test]
fn empty_duplicate_and_overlapping_elements_are_one_canonical_set() {
    let p = policy(&with_set("[]"));
    assert_eq!(verdict_to(&p, "10.0.0.1"), VerdictAction::Drop);
    let messy = with_set(
        "[{\"key\": \"10.0.0.1\"}, {\"key\": \"10.0.0.1\"}, {\"key\": \"10.0.0.0/30\"}, {\"key\": \"10.0.0.2-10.0.0.9\"}, {\"key\": \"10.0.0.8/29\"}]",
    );
    let clean = with_set("[{\"key\": \"10.0.0.0-10.0.0.15\"}]");
    let (pm, pc) = (policy(&messy), policy(&clean));
    assert_eq!(
        pm.tables[0].sets, pc.tables[0].sets,
        "the same canonical set"
    );
    for a in ["10.0.0.0", "10.0.0.9", "10.0.0.15"] {
        assert_eq!(verdict_to(&pm, a), VerdictAction::Accept, "{a}");
    }
    assert_eq!(verdict_to(&pm, "10.0.0.16"), VerdictAction::Drop);
}

#[test]
fn numeric_fields_at_and_past_their_limits() {
    let rule = |m: &str| {
        wrap(
            "INET",
            &format!("      - {{name: c, type: filter, hook: forward, priority: 0, policy: accept, rules: {{filterRules: [{{name: r, action: drop, match: [{m}]}}]}}}}\n"),
        )
    };
    // Ports: 0 and 65535 are ports; 65536 and reversed ranges are refused with the path.
    for ok in ["0", "65535", "0-65535"] {
        let y = rule(&format!("{{op: eq, port: {{value: \"{ok}\", position: dst}}}}, {{op: eq, proto: {{value: tcp}}}}"));
        assert_eq!(errors(&y), Vec::<String>::new(), "port {ok}");
    }
    for bad in ["65536", "90-80", "-1", "x"] {
        let y = rule(&format!("{{op: eq, port: {{value: \"{bad}\", position: dst}}}}, {{op: eq, proto: {{value: tcp}}}}"));
        let e = errors(&y);
        assert!(
            e.iter()
                .any(|m| m.contains("match[0].port.value") && m.contains(bad)),
            "port {bad}: {e:?}"
        );
    }
    // Priorities: nftables' range is a 32-bit signed integer.
    let chain = |prio: &str| {
        wrap(
            "INET",
            &format!("      - {{name: c, type: filter, hook: forward, priority: {prio}, policy: accept}}\n"),
        )
    };
    for ok in ["-2147483648", "2147483647"] {
        assert_eq!(errors(&chain(ok)), Vec::<String>::new(), "priority {ok}");
    }
    for bad in ["2147483648", "-2147483649"] {
        // Refused as the document is read, with the path and the value.
        let e = parse_documents(&chain(bad), "test.yaml")
            .expect_err("out of range")
            .to_string();
        assert!(
            e.contains("spec.table.chains[0].priority") && e.contains(bad),
            "priority {bad}: {e}"
        );
    }
    // Prefix lengths.
    for bad in ["10.0.0.0/33", "fd00::/129"] {
        let y = rule(&format!(
            "{{op: eq, ip: {{value: \"{bad}\", position: dst}}}}"
        ));
        let e = errors(&y);
        assert!(
            e.iter()
                .any(|m| m.contains("match[0].ip.value") && m.contains(bad)),
            "{bad}: {e:?}"
        );
    }
}

/// A set element of the element proptests: addresses, a CIDR, a range; warned of: a CIDR
/// with host bits; refused: not an address, or of the other family.
fn item(k: &u8) -> String {
    match k {
        0..=7 => format!("10.9.0.{k}"),
        8 => "10.9.0.0/30".to_string(),
        9 => "10.9.0.4-10.9.0.6".to_string(),
        10 => "10.9.0.1/30".to_string(),
        11 => "10.9.0.300".to_string(),
        12 => "fd00::1".to_string(),
        _ => "not an address".to_string(),
    }
}

proptest::proptest! {
    /// A compilation patched where only a set's inline elements changed equals the whole
    /// compilation of the new objects (the rule's copy of the set included), and it is made
    /// whenever neither side has an error or a warning: the agent's fast path is taken for
    /// every such change, and never hides what the whole compilation would refuse or warn of.
    #[test]
    fn a_patched_compilation_equals_the_whole_one(
        old in proptest::collection::vec(0u8..14, 0..8),
        new in proptest::collection::vec(0u8..14, 0..8),
    ) {
        let doc = |v: &[u8]| {
            let e: Vec<String> = v.iter().map(|k| format!("{{\"key\": \"{}\"}}", item(k))).collect();
            objects(&with_set(&format!("[{}]", e.join(","))))
        };
        let (old_objs, new_objs) = (doc(&old), doc(&new));
        let Ok(before) = compile(&old_objs) else { return Ok(()); };
        let sets = [(old_objs[0].origin.clone(), "s".to_string())];
        let refs: Vec<&PolicyObject> = new_objs.iter().collect();
        let patched = patch_elements(before.clone(), &refs, &sets);
        let whole = compile(&new_objs);
        match (&patched, &whole) {
            (Some(p), Ok(w)) => proptest::prop_assert_eq!(p, w),
            (Some(_), Err(e)) => proptest::prop_assert!(false, "patched what the whole refuses: {e}"),
            (None, Ok(w)) => proptest::prop_assert!(
                !w.warnings.is_empty() || !before.warnings.is_empty(),
                "not patched: {old:?} -> {new:?}"
            ),
            (None, Err(_)) => {}
        }
    }
}

proptest::proptest! {
    /// Validating only the sets whose elements changed, on an object whose earlier version
    /// was valid, refuses exactly what validating the whole refuses, with the same errors in
    /// the same order.
    #[test]
    fn validating_the_changed_sets_refuses_what_the_whole_does(
        new in proptest::collection::vec(0u8..14, 0..8),
    ) {
        let e: Vec<String> = new.iter().map(|k| format!("{{\"key\": \"{}\"}}", item(k))).collect();
        let objs = objects(&with_set(&format!("[{}]", e.join(","))));
        let quick = validate_sets(&objs[0], &["s".to_string()]).expect("decided by the set");
        let whole = validate(&objs[0]);
        proptest::prop_assert_eq!(
            quick.map_err(|e| e.to_string()),
            whole.map(drop).map_err(|e| e.to_string())
        );
    }
}
