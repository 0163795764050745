//! End to end: controller, agents, consumers.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::*;
use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_pod_is_reachable_through_its_consumers_tunnel_only() {
    // Two peerings: consumer a and consumer b each reach the provider through their own gateway
    // (own tunnel, own agent selecting its peer's configuration), as Liqo runs one gateway per peer.
    let ta = Topology::new();
    let tb = Topology::new();
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
    let _agent_a = agent(
        &server,
        &ta.gateway,
        "gw-a",
        "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=a",
    );
    let _agent_b = agent(
        &server,
        &tb.gateway,
        "gw-b",
        "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=b",
    );
    let _controller = server.peerwall(
        "controller",
        &["controller", "--metrics-addr", "127.0.0.1:0"],
    );
    let pod_ip = "10.20.1.2";
    assert!(
        ping(&ta.consumer, "10.10.1.67", pod_ip) && ping(&tb.consumer, "10.10.1.67", pod_ip),
        "open before peering"
    );
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    namespace(&client, "liqo-tenant-b", tenant_labels("b")).await;
    applied(
        &fwc_api(&client, "liqo-tenant-a"),
        "peerwall-gateway",
        "gw-a",
    )
    .await;
    applied(
        &fwc_api(&client, "liqo-tenant-b"),
        "peerwall-gateway",
        "gw-b",
    )
    .await;
    assert!(
        !ping(&ta.consumer, "10.10.1.67", pod_ip),
        "default deny on a's tunnel"
    );
    assert!(
        !ping(&tb.consumer, "10.10.1.67", pod_ip),
        "default deny on b's tunnel"
    );

    // Consumer a offloads a namespace with one pod.
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    let started = Instant::now();
    pod(&client, "app-a", "web", pod_ip, json!({}), None).await;
    eventually(
        "the pod to be reachable through a's tunnel",
        Duration::from_secs(10),
        || async {
            let ns = ta.consumer.name().to_string();
            tokio::task::spawn_blocking(move || {
                Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &ns,
                        "ping",
                        "-c",
                        "1",
                        "-W",
                        "1",
                        "-I",
                        "10.10.1.67",
                        pod_ip,
                    ])
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false)
            })
            .await
            .ok()?
            .then_some(())
        },
    )
    .await;
    eprintln!("offloaded pod reachable after {:?}", started.elapsed());
    assert!(
        !ping(&tb.consumer, "10.10.1.67", pod_ip),
        "b's tunnel still denies a's pod"
    );
    assert!(
        !ping(&ta.consumer, "10.10.1.67", "10.20.1.3"),
        "a reaches only what it offloaded"
    );
}
