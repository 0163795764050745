//! Who may put an address in a peer's allowlist: the controller's `offloaded` sets against
//! objects anyone with pod rights can write (issue "No silent accept, no bypass").
//!
//! - A pod's `liqo.io/remote-cluster-id` label never moves it to another peer: the namespace's
//!   owner decides (a Namespace label takes a cluster-scoped verb, a pod label does not).
//! - A hostNetwork pod's address is its node's: it never enters a set.
//! - A pod being deleted keeps its place until it has finished (its object removed).
//!
//! Each negative check is made after a later positive change was seen, so a controller that
//! had not processed the events yet cannot pass it.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use crate::support::*;

async fn set_is(client: &kube::Client, tenant: &str, want: &[&str], what: &str) {
    let want = ips(want);
    eventually(what, Duration::from_secs(15), || async {
        (gateway_set(client, tenant, "offloaded").await? == want).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_namespaces_owner_puts_its_pods_in_a_peers_set() {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let mut controller = server.peerwall("controller", &["controller"]);
    tenant_namespace(&client, "a").await;
    tenant_namespace(&client, "b").await;
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    namespace(&client, "app-b", json!({"liqo.io/remote-cluster-id": "b"})).await;
    namespace(&client, "team-x", json!({})).await;
    pod(&client, "app-a", "web", "10.200.0.5", json!({}), None).await;
    // In a's namespace, claiming b: neither a's nor b's.
    pod(
        &client,
        "app-a",
        "claims-b",
        "10.200.0.6",
        json!({"liqo.io/remote-cluster-id": "b"}),
        None,
    )
    .await;
    // In a namespace nobody owns, claiming b: nobody's.
    pod(
        &client,
        "team-x",
        "claims-b",
        "10.200.0.7",
        json!({"liqo.io/remote-cluster-id": "b"}),
        None,
    )
    .await;
    // Labelled with its own namespace's owner: narrowing to the same peer keeps it.
    pod(
        &client,
        "app-a",
        "says-a",
        "10.200.0.8",
        json!({"liqo.io/remote-cluster-id": "a"}),
        None,
    )
    .await;
    // hostNetwork in a's namespace: its status carries the node's address.
    let api: Api<Pod> = Api::namespaced(client.clone(), "app-a");
    let host: Pod = serde_json::from_value(json!({
        "metadata": {"name": "hostnet"},
        "spec": {"hostNetwork": true, "containers": [{"name": "c", "image": "registry.invalid/app"}]},
    }))
    .unwrap();
    running(&api, &host, "192.168.77.1").await;
    // b's own pod, created last: once b's set holds exactly it, every earlier pod was seen.
    pod(&client, "app-b", "own", "10.200.1.1", json!({}), None).await;
    set_is(
        &client,
        "liqo-tenant-b",
        &["10.200.1.1"],
        "b's set: its own pod only",
    )
    .await;
    set_is(
        &client,
        "liqo-tenant-a",
        &["10.200.0.5", "10.200.0.8"],
        "a's set: no pod claiming b, no node address",
    )
    .await;

    // A pod being deleted (held by a finalizer, as a kubelet holds it through its grace
    // period) stays in the set until its object is gone.
    let leaving: Pod = serde_json::from_value(json!({
        "metadata": {"name": "leaving", "finalizers": ["peerwall.test/hold"]},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/app"}]},
    }))
    .unwrap();
    running(&api, &leaving, "10.200.0.9").await;
    set_is(
        &client,
        "liqo-tenant-a",
        &["10.200.0.5", "10.200.0.8", "10.200.0.9"],
        "the pod that will leave",
    )
    .await;
    api.delete("leaving", &DeleteParams::default())
        .await
        .unwrap();
    assert!(api
        .get("leaving")
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_some());
    // A later pod is seen, the terminating one still in.
    pod(&client, "app-a", "later", "10.200.0.10", json!({}), None).await;
    set_is(
        &client,
        "liqo-tenant-a",
        &["10.200.0.5", "10.200.0.8", "10.200.0.9", "10.200.0.10"],
        "a terminating pod kept, a later one added",
    )
    .await;
    // Finished: its address leaves.
    api.patch_status(
        "leaving",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    set_is(
        &client,
        "liqo-tenant-a",
        &["10.200.0.5", "10.200.0.8", "10.200.0.10"],
        "a finished pod removed",
    )
    .await;
    api.patch(
        "leaving",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    controller.stop();
}
