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
