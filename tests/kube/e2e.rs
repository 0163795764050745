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
    let server = api_server();
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

    // Consumer a offloads a namespace with one pod, before Liqo's Configuration of a is
    // there: a's sources cannot be checked, so nothing from a's tunnel passes, and `status`
    // says so. (Liqo creates the Configuration before the gateways: in a real peering this
    // window only exists when the controller has not read it yet.)
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    pod(&client, "app-a", "web", pod_ip, json!({}), None).await;
    eventually(
        "the pod in a's offloaded set",
        Duration::from_secs(20),
        || async {
            gateway_set(&client, "liqo-tenant-a", "offloaded")
                .await?
                .contains(pod_ip)
                .then_some(())
        },
    )
    .await;
    applied(
        &fwc_api(&client, "liqo-tenant-a"),
        "peerwall-gateway",
        "gw-a",
    )
    .await;
    assert!(
        !ping(&ta.consumer, "10.10.1.67", pod_ip),
        "no Liqo Configuration of a: a's tunnel stays closed, even towards a's own pod"
    );
    let (_, rows) = crate::status::status(&server);
    let row_a = rows
        .as_array()
        .and_then(|r| r.iter().find(|r| r["peer"] == "a"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(row_a["tunnel_closed"], true, "{rows}");
    let started = Instant::now();
    liqo_configuration(&client, "a", &["10.10.0.0/16"]).await;
    liqo_configuration(&client, "b", &["10.10.0.0/16"]).await;
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
    eprintln!(
        "offloaded pod reachable {:?} after Liqo's Configuration appeared",
        started.elapsed()
    );
    assert!(
        !ping(&tb.consumer, "10.10.1.67", pod_ip),
        "b's tunnel still denies a's pod"
    );
    assert!(
        !ping(&ta.consumer, "10.10.1.67", "10.20.1.3"),
        "a reaches only what it offloaded"
    );
}

/// A provider's own NetworkPolicies hold for traffic from its consumer's tunnel, on both
/// backends, through the real API server: created, edited, a pod relabelled, each changing
/// packets through the gateway. The consumer's pods are addresses here (ipBlock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_policies_hold_across_the_tunnel_on_both_backends() {
    for backend in ["nftables", "bpf"] {
        network_policies_hold(backend).await;
    }
}

async fn network_policies_hold(backend: &str) {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use kube::api::{Api, Patch, PatchParams, PostParams};
    let t = Topology::new();
    let pins = BpfPins {
        dir: format!(
            "/sys/fs/bpf/peerwall-kube-np-{}-{backend}",
            std::process::id()
        ),
        ns: t.gateway.name().to_string(),
    };
    let server = api_server();
    let client = server.client().await;
    install_crd(&client).await;
    let extra: Vec<&str> = if backend == "bpf" {
        vec!["--backend", "bpf", "--pin-dir", &pins.dir]
    } else {
        vec![]
    };
    let _agent = agent_with(
        &server,
        &t.gateway,
        "gw",
        "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=a",
        &extra,
    );
    let _controller = server.peerwall(
        "controller",
        &["controller", "--metrics-addr", "127.0.0.1:0"],
    );
    let _web = Listener::tcp(&t.provider, "10.20.1.2", 8080);
    let _db = Listener::tcp_echo(&t.provider, "10.20.1.3", 8080);
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    liqo_configuration(&client, "a", &["10.10.0.0/16"]).await;
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    pod(
        &client,
        "app-a",
        "web",
        "10.20.1.2",
        json!({"app": "web"}),
        None,
    )
    .await;
    pod(
        &client,
        "app-a",
        "db",
        "10.20.1.3",
        json!({"app": "db"}),
        None,
    )
    .await;
    let connects = |src: &'static str, dst: &'static str| {
        let ns = t.consumer.name().to_string();
        move || {
            let o = Command::new("ip")
                .args([
                    "netns", "exec", &ns, "timeout", "3", "socat", "-T", "1", "-",
                ])
                .arg(format!("TCP4:{dst}:8080,bind={src},connect-timeout=1"))
                .output();
            o.is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"))
        }
    };
    // Offloaded and no policy yet: both consumer pods reach both pods.
    wait_until(
        "offloaded pods reachable",
        20,
        connects("10.10.1.68", "10.20.1.3"),
    );
    // The other pod's address may reach the agent in a later update, and one connection
    // attempt on a loaded machine may time out: waited for too, as the first.
    wait_until(
        "the other offloaded pod reachable",
        20,
        connects("10.10.1.67", "10.20.1.2"),
    );
    // A policy: db takes TCP 8080 from 10.10.1.67 only.
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "app-a");
    let policy = |cidrs: &[&str]| -> NetworkPolicy {
        let from: Vec<serde_json::Value> = cidrs
            .iter()
            .map(|c| json!({"ipBlock": {"cidr": c}}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "db-ingress", "namespace": "app-a"},
            "spec": {"podSelector": {"matchLabels": {"app": "db"}},
                     "ingress": [{"from": from, "ports": [{"protocol": "TCP", "port": 8080}]}]}}))
        .unwrap()
    };
    nps.create(&PostParams::default(), &policy(&["10.10.1.67/32"]))
        .await
        .unwrap();
    wait_until(
        &format!("{backend}: 10.10.1.68 denied by the policy"),
        20,
        || !connects("10.10.1.68", "10.20.1.3")(),
    );
    assert!(
        connects("10.10.1.67", "10.20.1.3")(),
        "{backend}: the allowed source"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "{backend}: ICMP is no port the policy names"
    );
    assert!(
        connects("10.10.1.68", "10.20.1.2")(),
        "{backend}: a pod no policy selects stays open"
    );
    // Edited: 10.10.1.68 is allowed too.
    nps.patch(
        "db-ingress",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"ingress": [{"from": [
            {"ipBlock": {"cidr": "10.10.1.67/32"}}, {"ipBlock": {"cidr": "10.10.1.68/32"}}],
            "ports": [{"protocol": "TCP", "port": 8080}]}]}})),
    )
    .await
    .unwrap();
    wait_until(
        &format!("{backend}: the edit allows 10.10.1.68"),
        20,
        connects("10.10.1.68", "10.20.1.3"),
    );
    // Revoked: a connection .68 holds open stops passing, either way, once the edit takes
    // the allowance back (conntrack entry / bpf flow ended; without that its packets would
    // pass as established).
    let mut held = Session::tcp(&t.consumer, "10.10.1.68", "10.20.1.3", 8080)
        .unwrap_or_else(|| panic!("{backend}: .68 connects while allowed"));
    assert!(
        held.echoes("before", Duration::from_secs(3)),
        "{backend}: the held connection carries data while allowed"
    );
    nps.replace("db-ingress", &PostParams::default(), &{
        let mut p = policy(&["10.10.1.67/32"]);
        p.metadata.resource_version = nps
            .get("db-ingress")
            .await
            .unwrap()
            .metadata
            .resource_version;
        p
    })
    .await
    .unwrap();
    wait_until(
        &format!("{backend}: the allowance of 10.10.1.68 is taken back"),
        20,
        || !connects("10.10.1.68", "10.20.1.3")(),
    );
    assert!(
        !held.echoes("after", Duration::from_secs(3)),
        "{backend}: the connection the policy no longer allows still carries data"
    );
    drop(held);
    assert!(
        connects("10.10.1.67", "10.20.1.3")(),
        "{backend}: the connection still allowed opens"
    );
    // Relabelled: db is selected by no policy any more; ICMP passes again.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "app-a");
    pods.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "other"}}})),
    )
    .await
    .unwrap();
    wait_until(
        &format!("{backend}: the relabelled pod is open"),
        20,
        || ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
    );
    // And the policy selects it again under its new name: denied again.
    pods.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "db"}}})),
    )
    .await
    .unwrap();
    wait_until(&format!("{backend}: isolated again"), 20, || {
        !ping(&t.consumer, "10.10.1.67", "10.20.1.3")
    });
}
