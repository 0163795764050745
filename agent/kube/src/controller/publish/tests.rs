use super::*;
use crate::controller::fake_api;
use peerwall_intent::types::{AddressSet, FirewallConfiguration};

fn peer() -> crate::protection::Peer {
    crate::protection::Peer {
        id: "alpha".into(),
        tenant_namespace: "liqo-tenant-alpha".into(),
        sources: vec!["10.200.0.0/16".parse().expect("cidr")],
    }
}

fn opts() -> crate::protection::Options {
    crate::protection::boot::default_options()
}

fn tenant() -> Namespace {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "liqo-tenant-alpha", "uid": "u-1"},
    }))
    .expect("namespace")
}

/// The gateway configuration as the pure crate builds it.
fn built() -> Value {
    crate::protection::gateway_object(&peer(), &Default::default(), &opts())
}

fn gateway() -> FirewallConfiguration {
    typed(built(), Some(owned_by_namespace(&tenant()))).expect("reads as a FirewallConfiguration")
}

/// What the API server would show after `object` was applied, as the controller's cache reads
/// it (untyped), with `edit` done to it.
fn shown(object: &FirewallConfiguration, edit: impl FnOnce(&mut Value)) -> Seen<'static> {
    let mut v = serde_json::to_value(object).expect("JSON");
    v["metadata"]["resourceVersion"] = json!("7");
    edit(&mut v);
    Seen::of_dynamic(&serde_json::from_value::<DynamicObject>(v).expect("object")).into_owned()
}

#[tokio::test]
async fn an_object_the_cache_already_shows_is_not_written_again() {
    let (client, requests) = fake_api::client();
    let api: Api<FirewallConfiguration> = Api::namespaced(client, "liqo-tenant-alpha");
    let object = gateway();
    // Others' labels beside peerwall's change nothing.
    let seen = shown(&object, |v| {
        v["metadata"]["labels"]["team"] = json!("net");
    });
    assert!(!publish(
        &api,
        Some(&seen),
        built(),
        Some(owned_by_namespace(&tenant()))
    )
    .await
    .expect("publish"));
    assert!(requests.lock().expect("log").is_empty());
}

#[tokio::test]
async fn a_changed_spec_a_removed_label_or_no_object_is_written_by_server_side_apply() {
    let object = gateway();
    let cases: Vec<(&str, Option<Seen>)> = vec![
        ("absent", None),
        (
            "spec edited by hand",
            Some(shown(&object, |v| {
                v["spec"]["table"]["chains"] = json!([]);
            })),
        ),
        (
            "peer label removed",
            Some(shown(&object, |v| {
                v["metadata"]["labels"]
                    .as_object_mut()
                    .expect("labels")
                    .remove(crate::PEER);
            })),
        ),
    ];
    for (case, seen) in cases {
        let (client, requests) = fake_api::client();
        let api: Api<FirewallConfiguration> = Api::namespaced(client, "liqo-tenant-alpha");
        assert!(
            publish(
                &api,
                seen.as_ref(),
                built(),
                Some(owned_by_namespace(&tenant()))
            )
            .await
            .expect("publish"),
            "{case}"
        );
        let requests = requests.lock().expect("log").clone();
        assert_eq!(requests.len(), 1, "{case}: {requests:?}");
        let r = &requests[0];
        assert_eq!(r.method, "PATCH", "{case}");
        assert_eq!(
            r.uri,
            "/apis/peerwall.io/v1alpha1/namespaces/liqo-tenant-alpha/firewallconfigurations/peerwall-gateway?&force=true&fieldManager=peerwall-controller",
            "{case}"
        );
        assert_eq!(r.content_type, "application/apply-patch+yaml", "{case}");
        assert_eq!(r.body["kind"], "FirewallConfiguration", "{case}");
        assert_eq!(
            r.body["metadata"]["ownerReferences"][0]["uid"], "u-1",
            "{case}"
        );
        assert_eq!(r.body["metadata"]["labels"][crate::PEER], "alpha", "{case}");
        assert_eq!(
            r.body["spec"],
            serde_json::to_value(&object).expect("JSON")["spec"],
            "{case}"
        );
    }
}

#[test]
fn an_object_that_does_not_read_as_its_kind_is_refused_before_any_write() {
    // A misspelt field: the API server would prune it silently; here it is an error.
    let mut body = crate::protection::address_set_object(
        &peer(),
        &crate::protection::Slice {
            name: "offloaded-alpha-0".into(),
            set: "offloaded_alpha".into(),
            addresses: ["10.0.0.1".parse().expect("ip")].into(),
        },
    );
    assert!(typed::<AddressSet>(body.clone(), None).is_ok());
    body["spec"]["adresses"] = json!(["10.0.0.2"]);
    let err = typed::<AddressSet>(body, None).expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("liqo-tenant-alpha/offloaded-alpha-0") && text.contains("adresses"),
        "{text}"
    );
}
