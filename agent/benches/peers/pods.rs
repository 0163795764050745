//! The node's peers as Liqo makes them and the gateway-pod agent finds them: per peer a
//! tenant with Liqo's `Configuration`, an offloaded namespace of pods with addresses, and a
//! gateway pod scheduled on the node whose sandbox is a process in the gateway's namespace
//! (`bench-peers`, and `tests/kube/start_bridge.rs`).

use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

use crate::fleet::{self, Gateway};

pub fn peer(i: usize) -> String {
    format!("peer-{i:02}")
}

pub fn tenant(i: usize) -> String {
    format!("liqo-tenant-{}", peer(i))
}

/// Peer `i`'s pod `j`: 1024 addresses per peer.
pub fn pod_ip(i: usize, j: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(0x0a20_0000 + (i as u32) * 1024 + j as u32)
}

/// Peer `i`: its tenant with Liqo's `Configuration`, its offloaded namespace and `pods` pods.
pub async fn peering(client: &Client, i: usize, pods: usize) {
    let offloaded = format!("offloaded-{}", peer(i));
    crate::tenant::peering(client, &peer(i), &tenant(i), &offloaded, fleet::SENDER_CIDR).await;
    let api: Api<Pod> = Api::namespaced(client.clone(), &offloaded);
    futures::stream::iter(0..pods)
        .map(|j| {
            let api = api.clone();
            async move {
                let name = format!("p{j}");
                let body = json!({
                    "metadata": {"name": name},
                    "spec": {"nodeName": "liqo-virtual-node", "containers": [{"name": "c", "image": "x"}]},
                });
                api.create(&PostParams::default(), &serde_json::from_value(body).expect("pod"))
                    .await
                    .expect("create pod");
                let ip = pod_ip(i, j).to_string();
                let status =
                    json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                    .await
                    .expect("pod status");
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
}

/// Gateway pod of peer `i`, scheduled on `node`, its sandbox started in `gw`'s namespace; returns
/// when it is Running (the moment measured from).
pub async fn gateway_pod(
    client: &Client,
    i: usize,
    node: &str,
    gw: &mut Gateway,
    cgroups: &std::path::Path,
) -> Instant {
    let api: Api<Pod> = Api::namespaced(client.clone(), &tenant(i));
    let name = format!("gw-{}", peer(i));
    let body = json!({
        "metadata": {"name": name, "labels": {
            "networking.liqo.io/component": "gateway", "networking.liqo.io/active": "true"}},
        "spec": {"nodeName": node, "containers": [{"name": "gateway", "image": "liqo/gateway",
            "args": [format!("--remote-cluster-id={}", peer(i))]}]},
    });
    let pod = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(body).expect("pod"),
        )
        .await
        .expect("the gateway pod");
    let uid = pod.metadata.uid.expect("a UID");
    // From the sandbox's namespace appearing: the agent acts on the pod from then on, Running
    // or not (the status below comes after, as a kubelet's would).
    let at = Instant::now();
    gw.sandbox(cgroups, &uid);
    let status = json!({"status": {"phase": "Running", "podIP": "10.244.0.10"}});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("the gateway pod's status");
    at
}

pub async fn delete_gateway_pod(client: &Client, i: usize) {
    let api: Api<Pod> = Api::namespaced(client.clone(), &tenant(i));
    let _ = api
        .delete(
            &format!("gw-{}", peer(i)),
            &DeleteParams::default().grace_period(0),
        )
        .await;
}
