//! A Liqo peering as the controller finds it: the peer's tenant namespace with Liqo's
//! `Configuration` (the peer's pods in `pod_cidr`) and a namespace the peer offloaded
//! (`bench-control`, `bench-peers`, `bench-events`).

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, PostParams};
use kube::Client;
use serde_json::json;

/// Create tenant namespace `tenant` and offloaded namespace `offloaded` of `peer`, and Liqo's
/// `Configuration` of the peer.
pub async fn peering(client: &Client, peer: &str, tenant: &str, offloaded: &str, pod_cidr: &str) {
    let ns: Api<Namespace> = Api::all(client.clone());
    for (name, labels) in [
        (
            tenant,
            json!({"liqo.io/tenant-namespace": "true", "liqo.io/remote-cluster-id": peer}),
        ),
        (offloaded, json!({"liqo.io/remote-cluster-id": peer})),
    ] {
        let body = json!({"metadata": {"name": name, "labels": labels}});
        ns.create(
            &PostParams::default(),
            &serde_json::from_value(body).expect("ns"),
        )
        .await
        .expect("namespace");
    }
    let configs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        tenant,
        &peerwall::k8s::liqo_configuration_resource(),
    );
    let cfg = serde_yaml::from_str(&peerwall_testkit::liqo::configuration(peer, &[pod_cidr]))
        .expect("Liqo's Configuration");
    configs
        .create(&PostParams::default(), &cfg)
        .await
        .expect("Liqo's Configuration");
    // The default service account is not needed: the ServiceAccount admission is off.
}
