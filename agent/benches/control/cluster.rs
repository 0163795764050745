//! The cluster side: a real etcd + kube-apiserver on loopback (Debian's v1.20 build from the
//! cache), peerwall's CRDs and Liqo's `Configuration` CRD, a Liqo tenant with its
//! `Configuration` and an offloaded namespace, pods with addresses,
//! and peerwall processes with their peak memory.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

pub const PEER: &str = "bench";
pub const TENANT: &str = "liqo-tenant-bench";
pub const OFFLOADED: &str = "offloaded-bench";

pub use peerwall_testkit::kube::{ApiServer, Proc};

/// A real API server with peerwall's CRDs established, running this build's peerwall.
pub fn api_server() -> ApiServer {
    ApiServer::start_with_crds(env!("CARGO_BIN_EXE_peerwall"))
}

/// A client that waits long for big lists (100k pods).
pub async fn client(server: &ApiServer) -> Client {
    let mut cfg = server.config().await;
    cfg.read_timeout = Some(Duration::from_secs(300));
    Client::try_from(cfg).expect("client")
}

/// The tenant namespace of the peer and the namespace it offloaded.
pub async fn peering(client: &Client) {
    crate::tenant::peering(client, PEER, TENANT, OFFLOADED, crate::probe::SENDER_CIDR).await;
}

/// Pod number `i`'s address.
pub fn pod_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a20_0000 + i)
}

fn pod_name(i: u32) -> String {
    format!("p{i}")
}

/// Create offloaded pod `i` and give it its address (the kubelet's status update).
pub async fn offload(client: &Client, i: u32) {
    offload_timed(client, i).await;
}

/// [`offload`], returning when the address was given (just before the status update).
pub async fn offload_timed(client: &Client, i: u32) -> Instant {
    let pods: Api<Pod> = Api::namespaced(client.clone(), OFFLOADED);
    let body = json!({
        "metadata": {"name": pod_name(i)},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x"}]},
    });
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(body).expect("pod"),
    )
    .await
    .expect("create pod");
    let ip = pod_ip(i).to_string();
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    let at = Instant::now();
    pods.patch_status(
        &pod_name(i),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .expect("pod status");
    at
}

/// Delete offloaded pod `i` (at once: no kubelet runs here).
pub async fn remove(client: &Client, i: u32) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), OFFLOADED);
    pods.delete(&pod_name(i), &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
}

/// Offload pods `range`, 64 requests in flight.
pub async fn offload_many(client: &Client, range: std::ops::Range<u32>) -> Duration {
    let started = Instant::now();
    futures::stream::iter(range)
        .map(|i| offload(client, i))
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    started.elapsed()
}

/// Addresses of the `offloaded` set over all published slices.
pub async fn published(client: &Client) -> usize {
    crate::published::offloaded(client, Some(TENANT)).await
}
