use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kube::api::DynamicObject;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// A slice as the API server keeps it: its spec, uid and generation.
fn shown(s: &protection::Slice<String>, uid: &str, generation: i64) -> Shown {
    let mut o: DynamicObject = serde_json::from_value(spill::slice_object(
        "liqo-tenant-a",
        "cfg",
        &BTreeMap::new(),
        s,
    ))
    .expect("a slice object");
    o.metadata.uid = Some(uid.into());
    o.metadata.generation = Some(generation);
    Shown {
        name: s.name.clone(),
        version: version_of(&o.metadata),
        object: Arc::new(o),
    }
}

/// A set's layouts over many passes, each taken from the last where it serves and laid out
/// anew otherwise, against laying out from nothing kept at every pass: the same writes,
/// deletions and count. Between passes the elements change or not, the writes land (each a
/// new generation, a new uid where the slice is new) or fail, and someone edits a slice.
#[test]
fn a_layout_kept_is_the_layout_laying_out_again_finds() {
    let mut rng = StdRng::seed_from_u64(0x51ce);
    let (mut served, mut computed) = (0, 0);
    for case in 0..40 {
        let mut elements: BTreeSet<String> = (0..rng.random_range(1..2500))
            .map(|i| format!("10.{case}.{}.{}", i / 256, i % 256))
            .collect();
        let mut objects: Vec<Shown> = Vec::new();
        let mut kept: Option<LaidOut> = None;
        let mut uids = 0;
        for pass in 0..30 {
            match rng.random_range(0..4) {
                // A pod relabelled: one address leaves or joins.
                0 => {
                    let a = format!("10.{case}.200.{}", rng.random_range(0..256));
                    if !elements.remove(&a) {
                        elements.insert(a);
                    }
                }
                // Someone edits a slice (its generation moves).
                1 if !objects.is_empty() => {
                    let k = rng.random_range(0..objects.len());
                    let mut s = slice_of(&objects[k].object);
                    s.addresses.insert(format!("10.{case}.250.{pass}"));
                    let generation = objects[k].object.metadata.generation.unwrap_or(0) + 1;
                    let uid = objects[k].object.metadata.uid.clone().unwrap_or_default();
                    objects[k] = shown(&s, &uid, generation);
                }
                _ => {}
            }
            let moved = || spill::Moved {
                set: "own_1".into(),
                elements: elements.iter().cloned().collect(),
            };
            let taken = BTreeSet::new();
            let fresh = laid_out("cfg", moved(), &objects, &taken, None);
            let laid = laid_out("cfg", moved(), &objects, &taken, kept.as_ref());
            assert_eq!(laid.result, fresh.result, "case {case} pass {pass}");
            if kept.as_ref().is_some_and(|k| *k == laid) {
                served += 1;
            } else {
                computed += 1;
            }
            // The writes land (or, one time in five, fail), the deletions too.
            if rng.random_bool(0.8) {
                for w in &laid.result.write {
                    match objects.iter().position(|o| o.name == w.name) {
                        Some(i) => {
                            let o = &objects[i].object.metadata;
                            let (uid, generation) =
                                (o.uid.clone().unwrap_or_default(), o.generation.unwrap_or(0));
                            objects[i] = shown(w, &uid, generation + 1);
                        }
                        None => {
                            uids += 1;
                            objects.push(shown(w, &format!("u{uids}"), 1));
                        }
                    }
                }
                objects.retain(|o| !laid.result.delete.contains(&o.name));
            }
            kept = Some(laid);
        }
    }
    assert!(
        served > 300 && computed > 300,
        "{served} served, {computed} computed"
    );
}

#[test]
fn a_slice_without_a_version_is_never_taken_as_unchanged() {
    let s = protection::Slice {
        name: "cfg-own-1-00000000-0000".into(),
        set: "own_1".into(),
        addresses: ["10.0.0.1".to_string()].into(),
    };
    let mut o = shown(&s, "u", 1);
    o.version = None;
    let moved = || spill::Moved {
        set: "own_1".into(),
        elements: vec!["10.0.0.1".into()],
    };
    let objects = [o];
    let first = laid_out("cfg", moved(), &objects, &BTreeSet::new(), None);
    assert!(first.result.write.is_empty(), "it holds the set already");
    // Kept, but its slices' versions unknown: laid out again, and found the same.
    let again = laid_out("cfg", moved(), &objects, &BTreeSet::new(), Some(&first));
    assert_eq!(again.result, first.result);
    assert_eq!(again.slices, vec![(String::new(), String::new())]);
    assert!(!first.serves(&moved().elements, &[(s.name.clone(), String::new())]));
}

/// A plan made from the last one (the spec's size by difference, the object's JSON taken
/// from it where the object is the same) is the plan made from nothing, whatever changed:
/// moved sets' elements alone (the size by difference, the same object), or a chain too (the
/// size measured, the object serialized again).
#[tokio::test]
async fn a_plan_from_the_last_one_is_the_plan_made_afresh() {
    let (client, _requests) = super::super::fake_api::client();
    let (ctx, _w) = Ctx::for_tests(client);
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "liqo-tenant-a", "uid": "u1"}
    }))
    .expect("a namespace");
    let set = |name: &str, base: u32, n: u32| {
        serde_json::json!({"name": name, "keyType": "ipv4_addr", "elements": (0..n)
            .map(|i| serde_json::json!({"key": std::net::Ipv4Addr::from(base + i).to_string()}))
            .collect::<Vec<_>>()})
    };
    let spec_of = |first: u32, priority: i32| -> FirewallConfigurationSpec {
        serde_json::from_value(serde_json::json!({"table": {"name": "t", "family": "INET",
            "chains": [{"name": "c", "type": "filter", "hook": "forward", "priority": priority,
                        "policy": "accept", "rules": {"filterRules": [
                {"name": "r", "action": "drop", "match": [{"op": "eq", "ip": {"value": "@a", "position": "src"}}]}]}}],
            "sets": [set("a", first, 4000), set("b", 0x0b00_0000, 4000)]}}))
        .expect("a spec")
    };
    let labels = BTreeMap::new();
    let plan_of = |spec: &FirewallConfigurationSpec,
                   prior: Option<(&FirewallConfigurationSpec, &Plan)>| {
        plan(
            &ctx,
            &ns,
            "cfg",
            spec.clone(),
            &labels,
            &HashMap::new(),
            prior,
        )
        .expect("a plan")
    };
    let first = spec_of(0x0a00_0000, 0);
    let (p1, _) = plan_of(&first, None);
    assert!(p1.moved > 0, "the sets are too large to stay inline");
    for (what, next) in [
        ("moved elements changed", spec_of(0x0a00_0001, 0)),
        ("a chain changed", spec_of(0x0a00_0001, 7)),
    ] {
        let (from_last, _) = plan_of(&next, Some((&first, &p1)));
        let (afresh, _) = plan_of(&next, None);
        assert_eq!(
            (from_last.asked_bytes, from_last.bytes, from_last.digest),
            (afresh.asked_bytes, afresh.bytes, afresh.digest),
            "{what}"
        );
        assert_eq!(
            from_last.asked_bytes,
            peerwall_intent::size::json_len(&next),
            "{what}"
        );
        assert_eq!(
            from_last.digest == p1.digest,
            what == "moved elements changed",
            "{what}: the object is the same only where moved elements alone changed"
        );
    }
}
