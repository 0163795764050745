use super::*;
use crate::controller::fake_api;
use serde_json::json;

fn namespace(name: &str, labels: serde_json::Value) -> Namespace {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "uid": format!("uid-{name}"), "labels": labels},
    }))
    .expect("namespace")
}

/// The offloaded NetworkPolicy of `ns` (offloaded by `peer`) as the controller writes it.
fn managed(ns: &Namespace, peer: &str) -> NetworkPolicy {
    typed(
        protection::offloaded_network_policy(&ns.name_any(), peer, &[], &[]),
        Some(owned_by_namespace(ns)),
    )
    .expect("reads as a NetworkPolicy")
}

#[tokio::test]
async fn an_offloaded_namespaces_policy_edited_by_hand_is_written_back_and_only_it() {
    let (client, requests) = fake_api::client();
    let (ctx, mut w) = Ctx::for_tests(client);
    let shop = namespace("shop", json!({crate::REMOTE_CLUSTER_ID: "alpha"}));
    let blog = namespace("blog", json!({crate::REMOTE_CLUSTER_ID: "alpha"}));
    let other = namespace("other", json!({crate::REMOTE_CLUSTER_ID: "beta"}));
    let plain = namespace("plain", json!({}));
    // shop's policy edited by hand (its ingress opened to all); blog's as written; the other
    // peer's edited too (not this peer's pass); a same-named policy where nothing is offloaded.
    let mut edited = managed(&shop, "alpha");
    if let Some(spec) = edited.spec.as_mut() {
        spec.ingress = Some(vec![Default::default()]);
    }
    let mut other_edited = managed(&other, "beta");
    if let Some(spec) = other_edited.spec.as_mut() {
        spec.ingress = Some(vec![Default::default()]);
    }
    let mut users = managed(&plain, "alpha");
    users.metadata.labels = None;
    for ns in [&shop, &blog, &other, &plain] {
        w.namespace(ns.clone());
    }
    for np in [edited, managed(&blog, "alpha"), other_edited, users] {
        w.network_policy(np);
    }
    let exceptions = exceptions_for(&ctx, "alpha", &netpol::Cluster::default());
    refresh_offloaded("alpha", &ctx, &exceptions)
        .await
        .expect("refresh");
    let requests = requests.lock().expect("log").clone();
    assert_eq!(requests.len(), 1, "{requests:?}");
    let r = &requests[0];
    assert_eq!(r.method, "PATCH");
    assert!(
        r.uri.starts_with(
            "/apis/networking.k8s.io/v1/namespaces/shop/networkpolicies/peerwall-offloaded?"
        ),
        "{}",
        r.uri
    );
    assert_eq!(
        r.body["spec"],
        serde_json::to_value(managed(&shop, "alpha")).expect("JSON")["spec"]
    );
    assert_eq!(r.body["metadata"]["ownerReferences"][0]["uid"], "uid-shop");
    assert_eq!(
        ctx.metrics.lock().expect("metrics").network_policy_writes,
        1
    );
}

#[tokio::test]
async fn a_policy_found_as_it_should_be_is_compared_again_once_its_version_moves() {
    let (client, requests) = fake_api::client();
    let (ctx, mut w) = Ctx::for_tests(client);
    let blog = namespace("blog", json!({crate::REMOTE_CLUSTER_ID: "alpha"}));
    w.namespace(blog.clone());
    let mut as_written = managed(&blog, "alpha");
    as_written.metadata.resource_version = Some("5".into());
    w.network_policy(as_written.clone());
    let exceptions = exceptions_for(&ctx, "alpha", &netpol::Cluster::default());
    let pass = || refresh_offloaded("alpha", &ctx, &exceptions);
    pass().await.expect("first pass");
    pass().await.expect("same version");
    assert!(requests.lock().expect("log").is_empty(), "nothing to write");
    assert_eq!(ctx.offloaded_said.lock().expect("said").len(), 1);
    // Edited by hand: a new version, compared again, written back.
    let mut edited = as_written;
    edited.metadata.resource_version = Some("6".into());
    if let Some(spec) = edited.spec.as_mut() {
        spec.ingress = Some(vec![Default::default()]);
    }
    w.network_policy(edited);
    pass().await.expect("after the edit");
    let written = requests.lock().expect("log").clone();
    assert_eq!(written.len(), 1, "{written:?}");
    assert_eq!(
        written[0].body["spec"],
        serde_json::to_value(managed(&blog, "alpha")).expect("JSON")["spec"]
    );
}
