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
    assert_eq!(
        written,
        [
            "/apis/peerwall.io/v1alpha1/namespaces/liqo-tenant-alpha/firewallconfigurations/peerwall-gateway",
            "/apis/peerwall.io/v1alpha1/namespaces/liqo-tenant-alpha/firewallconfigurations/peerwall-networkpolicy",
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
