use super::*;
use kube::api::WatchEvent;
use serde_json::json;

use peerwall_intent::load::{self, Group};

/// A FirewallConfiguration as the API server sends it, with `spec`.
fn object(spec: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "peerwall.io/v1alpha1",
        "kind": "FirewallConfiguration",
        "metadata": {"name": "fc", "namespace": "liqo-tenant-p1", "generation": 3, "uid": "u1"},
        "spec": spec,
        "status": {"conditions": [{"host": "n1", "type": "Applied", "status": "True"}]},
    })
}

fn good_spec() -> serde_json::Value {
    json!({"table": {"name": "t", "family": "INET", "chains": [{
        "name": "c", "type": "filter", "hook": "forward", "priority": 0, "policy": "drop",
        "rules": {"filterRules": [{"name": "r", "action": "accept",
            "match": [{"op": "eq", "ip": {"value": "10.0.0.0/8", "position": "src"}}]}]}
    }]}})
}

/// The watched object's refusal, which must be the loader's for the same JSON.
fn refused_as_the_loader(obj: &serde_json::Value, w: &ConfigObject) -> String {
    let typed = crate::to_policy_object(w).expect_err("refused").to_string();
    let loader = load::object_from_json(obj.clone(), Group::Peerwall)
        .expect_err("refused")
        .to_string();
    assert_eq!(typed, loader);
    typed
}

/// A watch line as the API server writes it (Go's `metav1.WatchEvent`: `type`, then
/// `object`), read as kube's watcher reads it.
fn watched(obj: &serde_json::Value) -> ConfigObject {
    let line = format!(r#"{{"type":"MODIFIED","object":{obj}}}"#);
    match serde_json::from_str::<WatchEvent<ConfigObject>>(&line).expect("the event reads") {
        WatchEvent::Modified(o) => o,
        other => panic!("not the event written: {other:?}"),
    }
}

#[test]
fn a_spec_that_reads_is_typed_and_gives_the_loaders_object() {
    let obj = object(good_spec());
    let w = watched(&obj);
    assert!(matches!(w.spec, Spec::Read(_)), "{:?}", w.spec);
    assert_eq!(w.metadata.generation, Some(3));
    assert_eq!(w.api_version(), Some("peerwall.io/v1alpha1"));
    assert_eq!(w.table_name().as_deref(), Some("t"));
    let typed = crate::to_policy_object(&w).expect("loads");
    let loader = load::object_from_json(obj.clone(), Group::Peerwall).expect("loads");
    assert_eq!(typed, loader);
    assert_eq!(typed.origin.0, "liqo-tenant-p1/fc");
    // The whole object as JSON is what was sent.
    assert_eq!(w.to_json().expect("json"), obj);
}

#[test]
fn a_spec_that_does_not_read_is_kept_and_refused_with_its_field_path() {
    // A misspelt field (the CRD keeps unknown fields below spec so that this is refused, not
    // pruned), a value of the wrong type, a wrong enum spelling.
    let mut misspelt = good_spec();
    misspelt["table"]["chains"][0]["rules"]["filterRules"][0]["matches"] =
        misspelt["table"]["chains"][0]["rules"]["filterRules"][0]["match"].take();
    let mut mistyped = good_spec();
    mistyped["table"]["chains"][0]["priority"] = json!("high");
    let mut bad_enum = good_spec();
    bad_enum["table"]["chains"][0]["policy"] = json!("allow");
    for spec in [misspelt, mistyped, bad_enum] {
        let obj = object(spec);
        let w = watched(&obj);
        assert!(matches!(w.spec, Spec::Unread(_)), "{:?}", w.spec);
        assert_eq!(w.table_name().as_deref(), Some("t"));
        let typed = refused_as_the_loader(&obj, &w);
        assert!(typed.contains("spec.table.chains[0]"), "{typed}");
        assert_eq!(w.to_json().expect("json"), obj);
    }
}

#[test]
fn an_object_without_spec_or_name_is_refused_as_the_loader_refuses_it() {
    let mut no_spec = object(json!(null));
    no_spec.as_object_mut().expect("object").remove("spec");
    let mut no_name = object(good_spec());
    no_name["metadata"]
        .as_object_mut()
        .expect("metadata")
        .remove("name");
    for obj in [no_spec, no_name] {
        refused_as_the_loader(&obj, &watched(&obj));
    }
}

#[test]
fn list_items_without_their_kind_and_liqo_objects_read() {
    let mut item = object(good_spec());
    let o = item.as_object_mut().expect("object");
    o.remove("apiVersion");
    o.remove("kind");
    let list = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfigurationList",
        "metadata": {"resourceVersion": "7"}, "items": [item]});
    let l: kube::core::ObjectList<ConfigObject> =
        serde_json::from_str(&list.to_string()).expect("the list reads");
    assert!(l.items[0].types.is_none());
    assert!(matches!(l.items[0].spec, Spec::Read(_)));
    // Liqo's group keys and loads as Liqo's.
    let mut liqo = object(good_spec());
    liqo["apiVersion"] = json!("networking.liqo.io/v1beta1");
    let w = watched(&liqo);
    assert_eq!(crate::group_of(&w), Group::Liqo);
    assert_eq!(
        crate::to_policy_object(&w).expect("loads"),
        load::object_from_json(liqo, Group::Liqo).expect("loads")
    );
}

#[test]
fn an_address_set_reads_typed_and_refuses_as_the_loader() {
    let good = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "AddressSet",
        "metadata": {"name": "s", "namespace": "liqo-tenant-p1"},
        "spec": {"firewallConfiguration": "fc", "set": "pods", "addresses": ["10.0.0.1"]}});
    let w: SliceObject = serde_json::from_str(&good.to_string()).expect("reads");
    assert!(matches!(w.spec, Spec::Read(_)));
    let typed = crate::check_slice(&w).expect("valid");
    let loader = load::address_set_from_json(good.clone()).expect("loads");
    assert_eq!(
        typed,
        peerwall_policy::sliced::check_slice(&loader).expect("valid")
    );
    assert_eq!(typed.origin.0, "liqo-tenant-p1/s");
    // A misspelt field: kept, refused with the loader's field path.
    let mut bad = good.clone();
    bad["spec"]["address"] = bad["spec"]["addresses"].take();
    let w: SliceObject = serde_json::from_str(&bad.to_string()).expect("reads");
    assert!(matches!(w.spec, Spec::Unread(_)));
    let refused = crate::check_slice(&w).expect_err("refused").to_string();
    let loader = load::address_set_from_json(bad)
        .expect_err("refused")
        .to_string();
    assert_eq!(refused, loader);
    assert!(refused.contains("address"), "{refused}");
}

#[test]
fn an_answer_skips_the_spec_and_keeps_the_status() {
    let obj = object(good_spec());
    let a: Answer = serde_json::from_str(&obj.to_string()).expect("reads");
    assert!(matches!(a.spec, Spec::Read(_)));
    assert_eq!(
        a.status
            .as_ref()
            .and_then(|s| s.pointer("/conditions/0/host")),
        Some(&json!("n1"))
    );
}

#[test]
fn an_event_whose_object_precedes_its_type_is_an_error_not_an_object() {
    // serde buffers an adjacently tagged event's content when the tag comes second, and a raw
    // spec cannot be read from that buffer: such a line is a watch error (retried, the policy
    // in force stays), never an object read without its spec. The API server writes the type
    // first (the test above).
    let line = format!(r#"{{"object":{},"type":"MODIFIED"}}"#, object(good_spec()));
    assert!(serde_json::from_str::<WatchEvent<ConfigObject>>(&line).is_err());
}
