use super::*;
use crate::controller::fake_api;
use serde_json::json;

fn tenant() -> Namespace {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {
            "name": "liqo-tenant-alpha", "uid": "uid-tenant",
            "labels": {
                crate::REMOTE_CLUSTER_ID: "alpha",
                crate::TENANT_NAMESPACE: "true",
            },
        },
    }))
    .expect("namespace")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peers_pass_writes_its_gateway_and_tier_once_and_nothing_when_nothing_changed() {
    let (client, requests) = fake_api::client();
    let (ctx, mut w) = Ctx::for_tests(client);
    let ctx = Arc::new(ctx);
    w.namespace(tenant());
    reconcile_gateway(Arc::new(tenant()), ctx.clone())
        .await
        .expect("first pass");
    let first = std::mem::take(&mut *requests.lock().expect("log"));
    let written: Vec<&str> = first
        .iter()
        .filter(|r| r.method == "PATCH")
        .map(|r| r.uri.split('?').next().unwrap_or_default())
        .collect();
    // The tier first (what most passes serve); a gateway holds its boot policy until its
    // peer's protection table is in force (`Boot` in peerwall-enforce), so a tier in force
    // before it opens nothing.
    assert_eq!(
        written,
        [
            "/apis/peerwall.io/v1alpha1/namespaces/liqo-tenant-alpha/firewallconfigurations/peerwall-networkpolicy",
            "/apis/peerwall.io/v1alpha1/namespaces/liqo-tenant-alpha/firewallconfigurations/peerwall-gateway",
        ],
        "{first:?}"
    );
    for r in &first {
        assert_eq!(
            r.body["metadata"]["ownerReferences"][0]["uid"],
            "uid-tenant"
        );
        assert_eq!(r.body["metadata"]["labels"][crate::PEER], "alpha");
    }
    // The API shows what was written: the next pass writes nothing.
    for r in first {
        let mut shown = r.body.clone();
        shown["metadata"]["resourceVersion"] = json!("2");
        w.configs
            .apply_watcher_event(&kube::runtime::watcher::Event::Apply(
                serde_json::from_value::<DynamicObject>(shown).expect("object"),
            ));
    }
    reconcile_gateway(Arc::new(tenant()), ctx.clone())
        .await
        .expect("second pass");
    let second = requests.lock().expect("log").clone();
    assert!(second.is_empty(), "{second:?}");
    assert_eq!(ctx.metrics.lock().expect("metrics").gateway_writes, 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_peers_of_a_pass_share_one_view_and_any_change_makes_the_next_pass_read_anew() {
    use crate::controller::policies::shared_view;
    let (client, _requests) = fake_api::client();
    let (ctx, mut w) = Ctx::for_tests(client);
    w.namespace(tenant());
    let first = shared_view(&ctx);
    assert!(
        Arc::ptr_eq(&first, &shared_view(&ctx)),
        "nothing changed: the same view"
    );
    // A namespace relabelled: the next view shows it.
    let mut relabelled = tenant();
    relabelled
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("team".into(), "blue".into());
    w.namespace(relabelled);
    let second = shared_view(&ctx);
    assert!(!Arc::ptr_eq(&first, &second));
    assert_eq!(
        second.0.namespaces["liqo-tenant-alpha"]
            .get("team")
            .map(String::as_str),
        Some("blue")
    );
    // A pod through the watch's feed: seen by the next view too.
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "app", "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.9"},
    }))
    .expect("pod");
    ctx.pods.upsert(crate::model::PodFacts::of(&pod));
    w.changes.bump();
    let third = shared_view(&ctx);
    assert_eq!(
        third
            .0
            .pods
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["p"]
    );
}
