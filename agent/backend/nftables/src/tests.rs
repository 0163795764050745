//! The backend over the in-memory [`FakeNft`]: apply, re-apply, set updates, ownership, drift
//! and repair, deletion and counters, without root or a kernel.

use peerwall_intent::load::parse_documents;
use peerwall_policy::{compile, ir};

use crate::{Drift, FakeNft, NftBackend, NftError};

fn policy(tables: &[(&str, &[&str])]) -> ir::Policy {
    let docs: String = tables
        .iter()
        .map(|(name, pods)| {
            let elems: String = pods.iter().map(|p| format!("{{key: {p}}},")).collect();
            format!(
                "---\napiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  table:\n    name: {name}\n    family: INET\n    sets: [{{name: pods, keyType: ipv4_addr, elements: [{elems}]}}]\n    chains:\n    - name: fwd\n      type: filter\n      hook: forward\n      priority: 0\n      policy: accept\n      rules:\n        filterRules:\n        - {{name: allow, action: accept, match: [{{op: eq, ip: {{value: '@pods', position: dst}}}}]}}\n        - {{name: deny, action: drop, match: [{{op: eq, dev: {{value: liqo-tunnel, position: in}}}}]}}\n"
            )
        })
        .collect();
    compile::compile(&parse_documents(&docs, "t").unwrap())
        .unwrap()
        .policy
}

fn pods(b: &NftBackend<FakeNft>, table: &str) -> usize {
    b.nft()
        .table(ir::TableFamily::Inet, table)
        .map(|t| t.sets[0].elements.len())
        .unwrap_or(0)
}

#[test]
fn apply_then_reapply_changes_nothing() {
    let mut b = NftBackend::new(FakeNft::new());
    let p = policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]);
    let r = b.apply(&p).unwrap();
    assert_eq!(r.recreated, ["b", "a"]);
    assert_eq!(b.nft().tables(), ["a", "b"]);
    let before = b.nft().transactions();
    let r = b.apply(&p).unwrap();
    assert!(!r.changed, "{r:?}");
    assert_eq!(b.nft().transactions(), before, "nothing sent");
    assert!(b.drift().unwrap().is_empty());
}

#[test]
fn a_pod_more_is_one_element_in_place() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"])])).unwrap();
    let r = b
        .apply(&policy(&[("a", &["10.0.0.1", "10.0.0.7"])]))
        .unwrap();
    assert_eq!(r.updated, ["a"]);
    assert!(r.recreated.is_empty());
    assert_eq!(r.element_changes, 1);
    assert_eq!(pods(&b, "a"), 2);
}

#[test]
fn an_element_change_is_planned_from_what_was_applied_without_listing_the_kernel() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]))
        .unwrap();
    let (listed, sent) = (b.nft().listings(), b.nft().transactions());
    let r = b
        .apply(&policy(&[("a", &["10.0.0.7"]), ("b", &["10.0.0.2"])]))
        .unwrap();
    assert_eq!(
        (r.updated.clone(), r.kept.clone()),
        (vec!["a".into()], vec!["b".into()])
    );
    assert_eq!(r.element_changes, 2, "{r:?}");
    assert_eq!(b.nft().listings(), listed, "the kernel is not listed");
    assert_eq!(b.nft().transactions(), sent + 1);
    let t = b.nft().table(ir::TableFamily::Inet, "a").unwrap();
    assert_eq!(format!("{:?}", t.sets[0].elements), "[Addr(10.0.0.7)]");
    // What it applied is what the next change is planned from.
    b.apply(&policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]))
        .unwrap();
    assert_eq!(b.nft().transactions(), sent + 2);
    assert!(b.drift().unwrap().is_empty());
}

#[test]
fn an_element_change_to_a_table_gone_behind_our_back_recreates_it() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"])])).unwrap();
    b.nft().delete_behind_our_back(ir::TableFamily::Inet, "a");
    let r = b
        .apply(&policy(&[("a", &["10.0.0.1", "10.0.0.7"])]))
        .unwrap();
    assert_eq!(r.recreated, ["a"], "{r:?}");
    assert_eq!(pods(&b, "a"), 2);
}

#[test]
fn a_tick_lists_the_ruleset_once_for_drift_and_counters() {
    use peerwall_backend::{Enforce, Observe};
    let mut b = NftBackend::new(FakeNft::new());
    NftBackend::apply(&mut b, &policy(&[("a", &["10.0.0.1"])])).unwrap();
    let listed = b.nft().listings();
    // What the agent's maintenance does each tick.
    assert!(Enforce::repair(&mut b).unwrap().is_empty());
    let counters = Observe::counters(&mut b).unwrap();
    assert!(!counters.is_empty());
    assert_eq!(b.nft().listings(), listed + 1, "one listing for both");
    // After a change, the counters list the kernel again.
    NftBackend::apply(&mut b, &policy(&[("a", &["10.0.0.1"]), ("b", &[])])).unwrap();
    let listed = b.nft().listings();
    let after = Observe::counters(&mut b).unwrap();
    assert_eq!(b.nft().listings(), listed + 1);
    assert!(after.len() > counters.len(), "{after:?}");
}

#[test]
fn a_drift_check_lists_nothing_while_the_ruleset_generation_stands() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"])])).unwrap();
    // Our own apply moved the generation: the first check lists, the next ones do not.
    let listed = b.nft().listings();
    assert!(b.repair().unwrap().is_empty());
    assert_eq!(b.nft().listings(), listed + 1);
    for _ in 0..3 {
        assert!(b.repair().unwrap().is_empty());
    }
    assert_eq!(b.nft().listings(), listed + 1, "nothing committed since");
    // A check of set elements is not vouched for by one of the structure alone...
    assert!(b.repair_full().unwrap().is_empty());
    let listed = b.nft().listings();
    assert!(b.repair_full().unwrap().is_empty());
    assert!(b.repair().unwrap().is_empty());
    assert_eq!(
        b.nft().listings(),
        listed,
        "...but by an earlier one of elements"
    );
    // Anyone's commit moves the generation: a foreign table, then a flushed set, found.
    b.nft().add_foreign(ir::TableFamily::Inet, "liqo-nat");
    assert!(b.repair().unwrap().is_empty());
    assert_eq!(b.nft().listings(), listed + 1);
    b.nft()
        .flush_set_behind_our_back(ir::TableFamily::Inet, "a", "pods");
    assert_eq!(
        b.repair_full().unwrap(),
        [Drift::Modified { table: "a".into() }]
    );
    assert_eq!(pods(&b, "a"), 1);
    // A set update of ours, then the check lists once more.
    let listed = b.nft().listings();
    b.apply(&policy(&[("a", &["10.0.0.1", "10.0.0.2"])]))
        .unwrap();
    assert!(b.repair().unwrap().is_empty());
    assert!(b.repair().unwrap().is_empty());
    assert!(
        b.nft().listings() <= listed + 2,
        "one check's listing after the apply"
    );
    b.nft().delete_behind_our_back(ir::TableFamily::Inet, "a");
    assert_eq!(b.repair().unwrap(), [Drift::Missing { table: "a".into() }]);
    assert_eq!(pods(&b, "a"), 2);
}

#[test]
fn foreign_tables_are_refused_and_nothing_changes() {
    let fake = FakeNft::new();
    fake.add_foreign(ir::TableFamily::Inet, "a");
    let mut b = NftBackend::new(fake);
    let e = b.apply(&policy(&[("a", &[])])).unwrap_err();
    assert!(matches!(e, NftError::NotOwned { .. }), "{e}");
    assert_eq!(b.nft().transactions(), 0);
    // Deleting everything of ours leaves the foreign table.
    assert!(b.delete_all().unwrap().is_empty());
    assert_eq!(b.nft().tables(), ["a"]);
}

#[test]
fn the_boot_hold_lists_once_and_sends_one_transaction_where_peerwall_has_no_table() {
    // A foreign table does not count: the hold goes ahead beside it.
    let fake = FakeNft::new();
    fake.add_foreign(ir::TableFamily::Inet, "liqo");
    let mut b = NftBackend::new(fake);
    let boot = policy(&[("boot", &[])]);
    assert!(
        b.hold_where_none(&boot).unwrap(),
        "held where nothing of ours was"
    );
    assert_eq!((b.nft().listings(), b.nft().transactions()), (1, 1));
    assert_eq!(b.nft().tables(), ["boot", "liqo"]);
    // Once a table of ours is there, nothing changes, from one listing.
    let mut again = NftBackend::new(b.into_nft());
    assert!(
        !again.hold_where_none(&boot).unwrap(),
        "peerwall's table was there"
    );
    assert_eq!((again.nft().listings(), again.nft().transactions()), (2, 1));
    // The policy that follows replaces the boot table in its one transaction.
    let r = again.apply(&policy(&[("a", &["10.0.0.1"])])).unwrap();
    assert_eq!(again.nft().transactions(), 2);
    assert_eq!(r.deleted, ["boot"]);
    assert_eq!(again.nft().tables(), ["a", "liqo"]);
    assert!(again.drift().unwrap().is_empty());
}

#[test]
fn a_backend_that_goes_on_keeps_the_boot_table_it_holds_and_one_used_alone_lists_once() {
    use peerwall_backend::HoldBoot;
    let boot = policy(&[("boot", &[])]);
    // Opened for the hold and dropped after: one listing, one transaction.
    let mut alone = NftBackend::new(FakeNft::new());
    assert!(alone.hold_boot_alone(&boot, "liqo-tunnel").unwrap());
    assert_eq!((alone.nft().listings(), alone.nft().transactions()), (1, 1));
    // The enforcing backend's hold is an apply: it repairs the table if it goes.
    let mut going_on = NftBackend::new(FakeNft::new());
    assert!(going_on.hold_boot(&boot, "liqo-tunnel").unwrap());
    going_on
        .nft()
        .delete_behind_our_back(ir::TableFamily::Inet, "boot");
    assert_eq!(going_on.repair_full().unwrap().len(), 1);
    assert_eq!(going_on.nft().tables(), ["boot"]);
}

#[test]
fn drift_is_found_and_repaired() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]))
        .unwrap();
    b.nft().delete_behind_our_back(ir::TableFamily::Inet, "a");
    b.nft()
        .flush_set_behind_our_back(ir::TableFamily::Inet, "b", "pods");
    let drift = b.drift().unwrap();
    assert_eq!(
        drift,
        [
            Drift::Missing { table: "a".into() },
            Drift::Modified { table: "b".into() }
        ]
    );
    let fixed = b.repair_full().unwrap();
    assert_eq!(fixed.len(), 2);
    assert_eq!((pods(&b, "a"), pods(&b, "b")), (1, 1));
    assert!(b.drift().unwrap().is_empty());
}

#[test]
fn a_repair_lists_the_ruleset_twice_its_checks_listing_and_the_snapshots() {
    // `nft` 1.0.6 fills its whole cache for any listing (7 s at 332 tables on 2 cores): the
    // check's one listing (elements included when compared) also serves the plan.
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]))
        .unwrap();
    for full in [true, false] {
        b.nft().delete_behind_our_back(ir::TableFamily::Inet, "a");
        let before = b.nft().listings();
        let fixed = if full { b.repair_full() } else { b.repair() }.unwrap();
        assert_eq!(fixed, [Drift::Missing { table: "a".into() }]);
        assert_eq!(b.nft().listings() - before, 2, "full: {full}");
        assert_eq!(pods(&b, "a"), 1);
    }
    // Elements compared from the same listing: a flushed set is found with no other listing.
    b.nft()
        .flush_set_behind_our_back(ir::TableFamily::Inet, "b", "pods");
    let before = b.nft().listings();
    assert_eq!(b.drift().unwrap(), [Drift::Modified { table: "b".into() }]);
    assert_eq!(b.nft().listings() - before, 1);
}

#[test]
fn periodic_repair_compares_elements_only_when_quiet() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("b", &["10.0.0.2"])])).unwrap();
    b.nft()
        .flush_set_behind_our_back(ir::TableFamily::Inet, "b", "pods");
    // Right after an apply the element listing (costly at 100k elements) is not due: the
    // periodic repair leaves the set alone and changes keep flowing...
    assert!(b.repair().unwrap().is_empty());
    assert_eq!(pods(&b, "b"), 0);
    // ...and the full comparison, when it comes, restores it.
    assert_eq!(
        b.repair_full().unwrap(),
        [Drift::Modified { table: "b".into() }]
    );
    assert_eq!(pods(&b, "b"), 1);
}

#[test]
fn tables_no_longer_wanted_are_deleted_and_counters_name_rules() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &[]), ("b", &[])])).unwrap();
    let names: Vec<String> = b
        .counters()
        .unwrap()
        .into_iter()
        .map(|c| format!("{}/{}/{}", c.table, c.chain, c.rule))
        .collect();
    assert_eq!(
        names,
        ["a/fwd/allow", "a/fwd/deny", "b/fwd/allow", "b/fwd/deny"]
    );
    let r = b.apply(&policy(&[("b", &[])])).unwrap();
    assert_eq!(r.deleted, ["a"]);
    assert_eq!(b.nft().tables(), ["b"]);
    assert_eq!(b.delete_all().unwrap(), ["b"]);
    assert!(b.nft().tables().is_empty());
}

/// A 6-rule allow-list applies as one merged rule over a counting set; counters list every
/// rule by its name (element counters added up per rule); re-applying changes nothing; the
/// compile text shows the set, its counter and its commented elements.
#[test]
fn a_merged_run_applies_counts_per_rule_and_reapplies_as_nothing() {
    let rules: String = (0..6)
        .map(|i| {
            format!(
                "        - {{name: 'allow {i}', action: accept, match: [{{op: eq, dev: {{value: liqo-tunnel, position: in}}}}, {{op: eq, ip: {{value: 10.{i}.0.0/16, position: dst}}}}, {{op: eq, proto: {{value: udp}}}}, {{op: eq, port: {{value: '{}-{}', position: dst}}}}]}}\n",
                1000 + 10 * i,
                1005 + 10 * i
            )
        })
        .collect();
    let doc = format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: m, namespace: ns}}\nspec:\n  table:\n    name: m\n    family: INET\n    chains:\n    - name: fwd\n      type: filter\n      hook: forward\n      priority: 0\n      policy: drop\n      rules:\n        filterRules:\n{rules}"
    );
    let p = compile::compile(&parse_documents(&doc, "t").unwrap())
        .unwrap()
        .policy;
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&p).unwrap();
    let t = b.nft().table(ir::TableFamily::Inet, "m").unwrap();
    assert_eq!(t.rules.len(), 1, "{:?}", t.rules);
    assert_eq!(
        t.rules[0].comment,
        "allow 0, allow 1, allow 2, allow 3, allow 4, allow 5"
    );
    let set = &t.sets[0];
    assert!(
        set.counter && set.interval && set.elements.len() == 6,
        "{set:?}"
    );
    assert_eq!(set.comments[5], "allow 5");
    let c = b.counters().unwrap();
    let names: Vec<&str> = c.iter().map(|c| c.rule.as_str()).collect();
    assert_eq!(
        names,
        ["allow 0", "allow 1", "allow 2", "allow 3", "allow 4", "allow 5"]
    );
    assert!(!b.apply(&p).unwrap().changed);
    let text = crate::text::table_text(&t);
    assert!(
        text.contains("type ipv4_addr . inet_service")
            && text.contains("\t\tcounter\n")
            && text.contains("10.5.0.0/16 . 1050-1055 comment \"allow 5\"")
            && text.contains(
                "iifname \"liqo-tunnel\" meta l4proto udp ip daddr . th dport @__pw_m0_0 accept"
            ),
        "{text}"
    );
}

#[test]
fn a_new_backend_keeps_what_is_already_in_force() {
    let mut b = NftBackend::new(FakeNft::new());
    let p = policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]);
    b.apply(&p).unwrap();
    // A new process on the same kernel: nothing applied by it yet.
    let mut again = NftBackend::new(b.into_nft());
    let before = again.nft().transactions();
    assert_eq!(again.adopt_unchanged(&p).unwrap(), ["a", "b"]);
    let r = again.apply(&p).unwrap();
    assert!(!r.changed, "{r:?}");
    assert_eq!(r.kept, ["b", "a"]);
    assert_eq!(again.nft().transactions(), before, "nothing sent");
    // Other elements, or a table changed behind its back: not taken, recreated.
    let mut third = NftBackend::new(again.into_nft());
    let other = policy(&[("a", &["10.0.0.9"]), ("b", &["10.0.0.2"])]);
    third
        .nft()
        .flush_set_behind_our_back(ir::TableFamily::Inet, "b", "pods");
    assert!(third.adopt_unchanged(&other).unwrap().is_empty());
    let r = third.apply(&other).unwrap();
    assert_eq!(r.recreated, ["b", "a"]);
}

#[test]
fn withdraw_deletes_the_tables_this_enforcer_applied_and_nothing_else() {
    let mut b = NftBackend::new(FakeNft::new());
    b.apply(&policy(&[("a", &["10.0.0.1"]), ("b", &["10.0.0.2"])]))
        .unwrap();
    b.nft().add_foreign(ir::TableFamily::Inet, "liqo");
    // One of them already gone: withdrawn is what was still there.
    b.nft().delete_behind_our_back(ir::TableFamily::Inet, "b");
    let before = b.nft().transactions();
    assert_eq!(b.withdraw_applied().unwrap(), ["a"]);
    assert_eq!(b.nft().transactions(), before + 1, "one transaction");
    assert_eq!(b.nft().tables(), ["liqo"]);
    // Nothing applied any more: nothing to withdraw, no transaction.
    assert!(b.withdraw_applied().unwrap().is_empty());
    assert_eq!(b.nft().transactions(), before + 1);
}
