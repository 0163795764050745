//! The listing read as nft 1.0 prints it (handles, counters with values, merged sets with
//! per-element counters and comments), and the questions asked of it.

use serde_json::{json, Value};

use crate::json::read;
use crate::listing::Listing;
use crate::model::{AUTO_SET_PREFIX, DIGEST_PREFIX, MARKER_CHAIN, MARKER_PREFIX};
use peerwall_backend::EventKind;
use peerwall_policy::ir::TableFamily;

/// A kernel listing of our table `t` (a merged rule over set `<auto>m0`, a plain counting
/// rule) and Liqo's table, with `packets` on every counter.
fn kernel(packets: u64) -> Vec<Value> {
    let merged = format!("{AUTO_SET_PREFIX}m0");
    let prefix = crate::events::prefix(EventKind::Drop, "t", "fwd", Some("deny-rest"));
    let counter = json!({"counter": {"packets": packets, "bytes": packets * 100}});
    vec![
        json!({"metainfo": {"version": "1.0.6", "json_schema_version": 1}}),
        json!({"table": {"family": "inet", "name": "t", "handle": 3}}),
        json!({"table": {"family": "ip", "name": "liqo", "handle": 4}}),
        json!({"chain": {"family": "inet", "table": "t", "name": MARKER_CHAIN, "handle": 1}}),
        json!({"chain": {"family": "inet", "table": "t", "name": "fwd", "handle": 2,
            "type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}}),
        json!({"chain": {"family": "ip", "table": "liqo", "name": "fwd", "handle": 1,
            "type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}}),
        json!({"set": {"family": "inet", "table": "t", "name": merged, "handle": 5,
            "type": "ipv4_addr", "stmt": [{"counter": null}], "elem": [
                {"elem": {"val": "10.0.0.1", "comment": "a", "counter": counter["counter"]}},
                {"elem": {"val": "10.0.0.2", "comment": "b", "counter": counter["counter"]}},
                {"elem": {"val": "10.0.0.3", "comment": "a", "counter": counter["counter"]}}]}}),
        json!({"rule": {"family": "inet", "table": "t", "chain": MARKER_CHAIN, "handle": 6,
            "comment": format!("{MARKER_PREFIX}ns/fc"), "expr": [counter]}}),
        json!({"rule": {"family": "inet", "table": "t", "chain": MARKER_CHAIN, "handle": 7,
            "comment": format!("{DIGEST_PREFIX}00ff"), "expr": [counter]}}),
        json!({"rule": {"family": "inet", "table": "t", "chain": "fwd", "handle": 8,
            "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip",
                "field": "daddr"}}, "right": format!("@{merged}")}}, counter, {"accept": null}]}}),
        json!({"rule": {"family": "inet", "table": "t", "chain": "fwd", "handle": 9,
            "comment": "deny-rest", "expr": [counter,
                {"log": {"prefix": prefix, "group": 7}}, {"drop": null}]}}),
        json!({"rule": {"family": "ip", "table": "liqo", "chain": "fwd", "handle": 2,
            "comment": "liqo", "expr": [counter, {"accept": null}]}}),
    ]
}

fn listing(packets: u64) -> Listing {
    read::listing(&kernel(packets)).expect("reads")
}

#[test]
fn owners_come_from_the_marker_and_foreign_tables_have_none() {
    let tables = listing(0).kernel_tables();
    let owner = |n: &str| tables.iter().find(|t| t.name == n).map(|t| t.owner.clone());
    assert_eq!(owner("t"), Some(Some("ns/fc".to_string())));
    assert_eq!(owner("liqo"), Some(None));
}

#[test]
fn counters_add_up_a_merged_rule_per_element_and_skip_foreign_tables() {
    let l = listing(3);
    assert_eq!(
        l.merged_counting_sets(),
        [("inet".into(), "t".into(), format!("{AUTO_SET_PREFIX}m0"))]
    );
    let c = l.rule_counters(&l.sets);
    let got: Vec<(&str, u64, u64)> = c
        .iter()
        .map(|c| (c.rule.as_str(), c.packets, c.bytes))
        .collect();
    assert_eq!(got, [("a", 6, 600), ("b", 3, 300), ("deny-rest", 3, 300)]);
    assert!(c.iter().all(|c| c.table == "t" && c.chain == "fwd"));
    // Without the merged set's elements the merged rule has no name to count by.
    let plain = l.rule_counters(&[]);
    assert_eq!(plain.len(), 1, "{plain:?}");
}

#[test]
fn a_tables_structure_ignores_counters_and_elements_but_not_edits() {
    let before = listing(0).table(TableFamily::Inet, "t").expect("t");
    assert_eq!(
        Some(before.clone()),
        listing(99).table(TableFamily::Inet, "t")
    );
    assert!(listing(0).table(TableFamily::Ip, "t").is_none());
    assert_eq!(before.tables.len(), 1);
    assert_eq!(before.rules.len(), 4, "liqo's rule is not part of t");
    // A rule's verdict edited behind our back is a different structure.
    let mut edited = kernel(0);
    edited[10]["rule"]["expr"][2] = json!({"accept": null});
    let edited = read::listing(&edited).expect("reads");
    assert_ne!(Some(before), edited.table(TableFamily::Inet, "t"));
}

#[test]
fn outline_digest_elements_and_log_statements() {
    let l = listing(1);
    let t = l.of_table(TableFamily::Inet, "t").expect("t");
    let outline = t.outline();
    assert_eq!(outline["fwd"], [None, Some("deny-rest".to_string())]);
    assert_eq!(outline[MARKER_CHAIN].len(), 2);
    assert_eq!(t.digest(), Some("00ff"));
    let e = &t.elements()[&format!("{AUTO_SET_PREFIX}m0")];
    assert_eq!(e.len(), 3);
    assert!(e.iter().all(|x| !x.contains("counter")), "{e:?}");
    assert!(crate::events::logs_events(&l, 7));
    assert!(!crate::events::logs_events(&l, 8));
    let names = crate::events::Names::of_listing(&l);
    assert_eq!(names.len(), 1);
    assert!(names
        .values()
        .all(|r| r.rule.as_deref() == Some("deny-rest")));
}

#[test]
fn a_malformed_object_is_an_error_naming_it() {
    let mut k = kernel(0);
    k[10]["rule"]
        .as_object_mut()
        .expect("object")
        .remove("chain");
    let e = read::listing(&k).expect_err("no chain").to_string();
    assert!(e.contains("rule.chain") && e.contains("deny-rest"), "{e}");
    // Kinds the backend does not read are skipped, whatever they hold; a map is read (as a
    // set: dispatch maps are peerwall's), so a malformed one is an error.
    let mut k = kernel(0);
    k.push(json!({"flowtable": {"weird": true}}));
    assert!(read::listing(&k).is_ok());
    let mut k = kernel(0);
    k.push(json!({"map": {"weird": true}}));
    let e = read::listing(&k)
        .expect_err("a map without family")
        .to_string();
    assert!(e.contains("set.family") && e.contains("weird"), "{e}");
}
