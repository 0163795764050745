//! The provider/consumer-protection controller.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::ResourceExt;
use serde_json::json;

use crate::support::*;

/// One scenario on one API server, long on purpose: each step (default deny, offloaded pods,
/// virtual nodes, NetworkPolicies, metrics, a restart, an IP moving between tenants) starts from
/// the state the previous one left, which is what the controller must handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_keeps_gateway_sets_and_network_policies_in_sync() {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let controller_args = [
        "controller",
        "--block-leaf-to-leaf",
        "--metrics-addr",
        metrics_addr.as_str(),
    ];
    let mut controller = server.peerwall("controller", &controller_args);
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    namespace(&client, "liqo-tenant-b", tenant_labels("b")).await;
    // Default deny from the moment the peering exists.
    for t in ["liqo-tenant-a", "liqo-tenant-b"] {
        let s = eventually("the gateway configuration", Duration::from_secs(20), || {
            gateway_set(&client, t, "offloaded")
        })
        .await;
        assert!(s.is_empty());
    }
    let gw = fwc_api(&client, "liqo-tenant-a")
        .get("peerwall-gateway")
        .await
        .unwrap();
    assert_eq!(gw.labels()["peerwall.io/target"], "gateway");
    assert_eq!(gw.labels()["peerwall.io/remote-cluster-id"], "a");
    assert!(
        !gw.labels()
            .keys()
            .any(|k| k.starts_with("networking.liqo.io/")),
        "nothing Liqo's gateway or fabric selects: {:?}",
        gw.labels()
    );
    assert_eq!(gw.owner_references()[0].kind, "Namespace");
    let rules: Vec<String> = gw.data["spec"]["table"]["chains"][0]["rules"]["filterRules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(rules.last().map(String::as_str), Some("default_deny"));
    assert!(rules.contains(&"leaf_to_leaf".to_string()), "{rules:?}");
    // Someone with write access removes the default deny: the controller writes it back (a
    // new generation of the spec is compared again, not taken for what it last wrote).
    let last = rules.len() - 1;
    fwc_api(&client, "liqo-tenant-a")
        .patch(
            "peerwall-gateway",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(json!([{
                    "op": "remove",
                    "path": format!("/spec/table/chains/0/rules/filterRules/{last}"),
                }]))
                .unwrap(),
            ),
        )
        .await
        .unwrap();
    eventually(
        "the default deny written back",
        Duration::from_secs(20),
        || async {
            let gw = fwc_api(&client, "liqo-tenant-a")
                .get("peerwall-gateway")
                .await
                .ok()?;
            let names: Vec<&str> = gw.data["spec"]["table"]["chains"][0]["rules"]["filterRules"]
                .as_array()?
                .iter()
                .filter_map(|r| r["name"].as_str())
                .collect();
            (names.last() == Some(&"default_deny")).then_some(())
        },
    )
    .await;

    // Offloaded namespaces and labeled pods; pods without an IP yet are left out.
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    namespace(&client, "local", json!({})).await;
    pod(&client, "app-a", "web", "10.200.0.5", json!({}), None).await;
    pod(&client, "app-a", "db", "10.200.0.6", json!({}), None).await;
    namespace(
        &client,
        "offloaded-b",
        json!({"liqo.io/remote-cluster-id": "b"}),
    )
    .await;
    pod(
        &client,
        "offloaded-b",
        "shadow-b",
        "10.200.0.7",
        json!({"liqo.io/remote-cluster-id": "b", "liqo.io/managed-by": "shadowpod"}),
        None,
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "app-a");
    pods.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "pending"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})).unwrap()).await.unwrap();
    eventually("a's set", Duration::from_secs(10), || async {
        (gateway_set(&client, "liqo-tenant-a", "offloaded").await?
            == ips(&["10.200.0.5", "10.200.0.6"]))
        .then_some(())
    })
    .await;
    eventually("b's set", Duration::from_secs(10), || async {
        (gateway_set(&client, "liqo-tenant-b", "offloaded").await? == ips(&["10.200.0.7"]))
            .then_some(())
    })
    .await;
    // Consumer side: our pod on a's virtual node.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "liqo-a", "labels": {"liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "a"}}})).unwrap()).await.unwrap();
    pod(
        &client,
        "local",
        "mine",
        "10.99.0.1",
        json!({}),
        Some("liqo-a"),
    )
    .await;
    eventually("consumer-side sets", Duration::from_secs(10), || async {
        let remote = gateway_set(&client, "liqo-tenant-a", "remote").await?;
        let elsewhere = gateway_set(&client, "liqo-tenant-b", "elsewhere").await?;
        (remote == ips(&["10.99.0.1"]) && elsewhere == ips(&["10.99.0.1"])).then_some(())
    })
    .await;
    // The controller's metrics say the same.
    let scrape = |path: &'static str| {
        let addr = metrics_addr.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut c = std::net::TcpStream::connect(&addr).ok()?;
                write!(c, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
                let mut out = String::new();
                c.read_to_string(&mut out).ok()?;
                Some(out)
            })
            .await
            .ok()
            .flatten()
            .unwrap_or_default()
        }
    };
    assert!(scrape("/readyz").await.ends_with("ready\n"));
    eventually("controller metrics", Duration::from_secs(10), || async {
        let m = scrape("/metrics").await;
        (m.contains("peerwall_controller_peers 2\n")
            && m.contains("peerwall_controller_offloaded_addresses 3\n")
            && !m.contains("peerwall_controller_gateway_writes_total 0\n"))
        .then_some(())
    })
    .await;
    // NetworkPolicy for the offloaded namespace only.
    let np: Api<NetworkPolicy> = Api::namespaced(client.clone(), "app-a");
    let p = eventually("the NetworkPolicy", Duration::from_secs(10), || async {
        np.get_opt("peerwall-offloaded").await.ok()?
    })
    .await;
    let spec = serde_json::to_value(p.spec.unwrap()).unwrap();
    assert_eq!(spec["policyTypes"], json!(["Egress"]));
    assert_eq!(
        spec["egress"][0]["to"][0]["namespaceSelector"]["matchExpressions"][0]["values"],
        json!(["a"])
    );
    let local_np: Api<NetworkPolicy> = Api::namespaced(client.clone(), "local");
    assert!(local_np
        .get_opt("peerwall-offloaded")
        .await
        .unwrap()
        .is_none());

    // Restart: changes made while the controller was down are resynced (stale IPs removed).
    controller.stop();
    delete_pod(&client, "app-a", "db").await;
    let mut controller = server.peerwall("controller-2", &controller_args);
    eventually("resync after restart", Duration::from_secs(15), || async {
        (gateway_set(&client, "liqo-tenant-a", "offloaded").await? == ips(&["10.200.0.5"]))
            .then_some(())
    })
    .await;

    // IP reuse: 10.200.0.5 moves from a's pod to a pod of b. It must leave a's set before it
    // appears in b's; watch every version of every slice (one watch: one order of events).
    let violation = Arc::new(AtomicBool::new(false));
    let seen_in_b = Arc::new(AtomicBool::new(false));
    let watch = {
        let (violation, seen_in_b) = (violation.clone(), seen_in_b.clone());
        let api: Api<DynamicObject> =
            Api::all_with(client.clone(), &peerwall::k8s::address_set_resource());
        tokio::spawn(async move {
            // (namespace, slice) → holds the address.
            let mut has = std::collections::BTreeMap::new();
            let mut s = watcher(api, watcher::Config::default()).boxed();
            while let Some(Ok(ev)) = s.next().await {
                let (objs, deleted) = match ev {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) => (vec![o], false),
                    watcher::Event::Delete(o) => (vec![o], true),
                    _ => continue,
                };
                for o in objs {
                    let x = !deleted && slice_addresses(&o, "offloaded").contains("10.200.0.5");
                    has.insert((o.namespace().unwrap_or_default(), o.name_any()), x);
                }
                let tenant_has = |t: &str| has.iter().any(|((ns, _), x)| ns == t && *x);
                if tenant_has("liqo-tenant-b") {
                    seen_in_b.store(true, Ordering::SeqCst);
                    if tenant_has("liqo-tenant-a") {
                        violation.store(true, Ordering::SeqCst);
                    }
                }
            }
        })
    };
    namespace(&client, "app-b", json!({"liqo.io/remote-cluster-id": "b"})).await;
    pod(&client, "app-b", "new", "10.200.0.5", json!({}), None).await;
    // The controller has seen the new pod and holds its address back (its metric says so)
    // before the check: not a fixed wait that a slow controller would pass.
    eventually("the address held back", Duration::from_secs(15), || async {
        let m = scrape("/metrics").await;
        (m.contains("peerwall_controller_held_back_addresses ")
            && !m.contains("peerwall_controller_held_back_addresses 0\n"))
        .then_some(())
    })
    .await;
    assert_eq!(
        gateway_set(&client, "liqo-tenant-b", "offloaded")
            .await
            .unwrap(),
        ips(&["10.200.0.7"]),
        "held back while a's pod holds it"
    );
    assert!(gateway_set(&client, "liqo-tenant-a", "offloaded")
        .await
        .unwrap()
        .contains("10.200.0.5"));
    delete_pod(&client, "app-a", "web").await;
    eventually(
        "the address to move to b",
        Duration::from_secs(15),
        || async {
            let a = gateway_set(&client, "liqo-tenant-a", "offloaded").await?;
            let b = gateway_set(&client, "liqo-tenant-b", "offloaded").await?;
            (a.is_empty() && b == ips(&["10.200.0.5", "10.200.0.7"])).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch.abort();
    assert!(seen_in_b.load(Ordering::SeqCst), "the watch saw b's update");
    assert!(
        !violation.load(Ordering::SeqCst),
        "an address was in two tenants' sets at once"
    );

    // A namespace that stops being offloaded loses its NetworkPolicy.
    let nsapi: Api<Namespace> = Api::all(client.clone());
    nsapi
        .patch(
            "app-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"liqo.io/remote-cluster-id": null}}})),
        )
        .await
        .unwrap();
    eventually(
        "the NetworkPolicy to go",
        Duration::from_secs(10),
        || async {
            np.get_opt("peerwall-offloaded")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;

    // The peering torn down, its tenant namespace deleted: the slices go with the namespace's
    // content. They carry no owner reference (none is needed for that, and the API server's
    // handling of one was a tenth of each slice write on a pod's way to the gateways).
    let slices: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "liqo-tenant-b",
        &peerwall::k8s::address_set_resource(),
    );
    let written = slices.list(&Default::default()).await.unwrap().items;
    assert!(!written.is_empty(), "b's addresses are published as slices");
    assert!(
        written.iter().all(|s| s.owner_references().is_empty()),
        "{written:?}"
    );
    nsapi
        .delete("liqo-tenant-b", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "b's slices to go with its tenant namespace",
        Duration::from_secs(60),
        || async {
            slices
                .list(&Default::default())
                .await
                .ok()?
                .items
                .is_empty()
                .then_some(())
        },
    )
    .await;
    controller.stop();
}

/// A peer whose pod CIDR overlaps ours: Liqo's `Configuration` says its 10.200.0.0/16 is seen
/// here as 10.71.0.0/16, and Liqo's virtual kubelet reflects our pod running there with a
/// remapped IP. The gateway's forward hook sees that pod's packets with the peer's own address
/// (Liqo SNATs at postrouting), so that is what the `remote` set must hold; before Liqo's
/// Configuration exists the controller can only list the reflected address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_pods_behind_a_remapped_cidr_are_listed_by_their_tunnel_address() {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let configs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "liqo-tenant-a",
        &peerwall::k8s::liqo_configuration_resource(),
    );
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let _controller = server.peerwall(
        "controller",
        &["controller", "--metrics-addr", metrics_addr.as_str()],
    );
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "liqo-a", "labels": {"liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "a"}}})).unwrap()).await.unwrap();
    namespace(&client, "local", json!({})).await;
    pod(
        &client,
        "local",
        "mine",
        "10.71.4.9",
        json!({}),
        Some("liqo-a"),
    )
    .await;
    eventually("the reflected address", Duration::from_secs(20), || async {
        (gateway_set(&client, "liqo-tenant-a", "remote").await? == ips(&["10.71.4.9"]))
            .then_some(())
    })
    .await;
    let cfg: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "networking.liqo.io/v1beta1",
        "kind": "Configuration",
        "metadata": {"name": "a", "labels": {"liqo.io/remote-cluster-id": "a"}},
        "spec": {"remote": {"cidr": {"pod": ["10.200.0.0/16"], "external": ["10.70.0.0/16"]}}},
    }))
    .unwrap();
    let versions_before = configs.create(&PostParams::default(), &cfg).await.unwrap();
    configs
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"remote": {"cidr": {"pod": ["10.71.0.0/16"], "external": ["10.72.0.0/16"]}}}})),
        )
        .await
        .unwrap();
    eventually(
        "the address behind the tunnel",
        Duration::from_secs(20),
        || async {
            (gateway_set(&client, "liqo-tenant-a", "remote").await? == ips(&["10.200.4.9"]))
                .then_some(())
        },
    )
    .await;
    // Calling home: the NetworkPolicy of a's offloaded namespace lets its pods reach a's pods
    // and external CIDR as seen here (the Configuration's status: remapped).
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "app-a");
    let home = eventually("the call-home rule", Duration::from_secs(20), || {
        let nps = nps.clone();
        async move {
            let np = nps.get_opt("peerwall-offloaded").await.ok().flatten()?;
            let egress = serde_json::to_value(&np.spec).ok()?["egress"].clone();
            egress
                .as_array()?
                .iter()
                .find(|r| r.to_string().contains("ipBlock"))
                .cloned()
        }
    })
    .await;
    assert_eq!(
        home,
        json!({"to": [{"ipBlock": {"cidr": "10.71.0.0/16"}}, {"ipBlock": {"cidr": "10.72.0.0/16"}}]})
    );
    // Liqo's object is only read.
    let after = configs.get("a").await.unwrap();
    assert!(after.finalizers().is_empty());
    assert_eq!(
        after.metadata.generation,
        versions_before.metadata.generation
    );
}

/// A Liqo gateway pod on a node where no peerwall agent is ready (and with no sidecar) is
/// named: a Warning Event `Unprotected` on the pod and `peerwall_controller_unprotected_gateways`;
/// a gateway with a ready agent on its node and one with a peerwall sidecar are not. An agent
/// becoming ready on the node clears the gauge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_an_agent_on_its_node_is_reported() {
    use k8s_openapi::api::core::v1::Event;
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let _controller = server.peerwall(
        "controller",
        &[
            "controller",
            "--metrics-addr",
            metrics_addr.as_str(),
            "--unprotected-grace-secs",
            "1",
        ],
    );
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    namespace(&client, "peerwall-system", json!({})).await;
    let gw_labels =
        json!({"networking.liqo.io/component": "gateway", "networking.liqo.io/active": "true"});
    pod(
        &client,
        "liqo-tenant-a",
        "gw-bare",
        "10.0.0.1",
        gw_labels.clone(),
        Some("node-bare"),
    )
    .await;
    pod(
        &client,
        "liqo-tenant-a",
        "gw-covered",
        "10.0.0.2",
        gw_labels.clone(),
        Some("node-agent"),
    )
    .await;
    // A sidecar gateway: peerwall runs inside it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "liqo-tenant-a");
    let side: Pod = serde_json::from_value(json!({
        "metadata": {"name": "gw-sidecar", "labels": gw_labels},
        "spec": {"nodeName": "node-bare", "containers": [
            {"name": "gateway", "image": "liqo/gateway"},
            {"name": "peerwall", "image": "peerwall"}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &side).await.unwrap();
    let agent_labels = json!({"app.kubernetes.io/name": "peerwall-agent"});
    pod(
        &client,
        "peerwall-system",
        "agent-1",
        "10.0.1.1",
        agent_labels.clone(),
        Some("node-agent"),
    )
    .await;
    let agents: Api<Pod> = Api::namespaced(client.clone(), "peerwall-system");
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
    agents
        .patch_status("agent-1", &PatchParams::default(), &Patch::Merge(&ready))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(client.clone(), "liqo-tenant-a");
    let unprotected = || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await.ok()?;
            let names: Vec<String> = list
                .items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("Unprotected"))
                .filter_map(|e| e.involved_object.name.clone())
                .collect();
            (!names.is_empty()).then_some(names)
        }
    };
    let named = eventually(
        "the Unprotected event",
        Duration::from_secs(30),
        unprotected,
    )
    .await;
    assert_eq!(named, ["gw-bare"], "only the gateway nothing enforces in");
    let metric = || {
        let addr = metrics_addr.clone();
        async move {
            let body = reqwest_like_get(&addr, "/metrics")?;
            body.lines()
                .find_map(|l| l.strip_prefix("peerwall_controller_unprotected_gateways "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        }
    };
    assert_eq!(metric().await, Some(1));
    // An agent becomes ready on the bare node: nothing is unprotected any more.
    pod(
        &client,
        "peerwall-system",
        "agent-2",
        "10.0.1.2",
        agent_labels,
        Some("node-bare"),
    )
    .await;
    agents
        .patch_status("agent-2", &PatchParams::default(), &Patch::Merge(&ready))
        .await
        .unwrap();
    eventually("the gauge to clear", Duration::from_secs(30), || async {
        (metric().await == Some(0)).then_some(())
    })
    .await;
}

/// GET `path` from `addr` over plain HTTP/1.1: the body, when the server answered 200.
fn reqwest_like_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// CNI companions: a user's NetworkPolicy that names pods running on a peer by label gets a
/// companion (same podSelector, the remote pods' addresses as ipBlocks) that follows the
/// remote pods and disappears with the need; the user's policy is never modified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn companion_policies_follow_remote_pods() {
    let (_server, client, _controller) = controller_with_peer_and_shop().await;
    web_here_api_on_p1(&client).await;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "shop");
    let user: NetworkPolicy = serde_json::from_value(json!({
        "metadata": {"name": "web-from-api", "namespace": "shop"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "api"}}}],
                              "ports": [{"protocol": "TCP", "port": 8080}]}]}}))
    .unwrap();
    nps.create(&PostParams::default(), &user).await.unwrap();
    let companion = eventually("the companion", Duration::from_secs(20), || {
        let nps = nps.clone();
        async move { nps.get_opt("peerwall-web-from-api").await.ok().flatten() }
    })
    .await;
    let spec = serde_json::to_value(&companion.spec).unwrap();
    assert_eq!(spec["podSelector"], json!({"matchLabels": {"app": "web"}}));
    assert_eq!(
        spec["ingress"],
        json!([{"from": [{"ipBlock": {"cidr": "10.20.0.7/32"}}],
                "ports": [{"protocol": "TCP", "port": 8080}]}])
    );
    assert_eq!(
        companion.labels()["peerwall.io/companion-of"],
        "web-from-api"
    );
    let mine = nps.get("web-from-api").await.unwrap();
    assert_eq!(
        mine.metadata.generation,
        Some(1),
        "the user's policy is never modified"
    );
    // A second remote pod joins the companion.
    pod(
        &client,
        "shop",
        "api-2",
        "10.20.0.8",
        json!({"app": "api"}),
        Some("liqo-p1"),
    )
    .await;
    eventually("the companion to follow", Duration::from_secs(20), || {
        let nps = nps.clone();
        async move {
            let c = nps.get_opt("peerwall-web-from-api").await.ok().flatten()?;
            let from = serde_json::to_value(&c.spec).ok()?["ingress"][0]["from"].clone();
            (from.as_array()?.len() == 2).then_some(())
        }
    })
    .await;
    // The user's policy gone: so is the companion.
    nps.delete("web-from-api", &Default::default())
        .await
        .unwrap();
    eventually("the companion to go", Duration::from_secs(20), || {
        let nps = nps.clone();
        async move {
            nps.get_opt("peerwall-web-from-api")
                .await
                .ok()
                .and_then(|c| c.is_none().then_some(()))
        }
    })
    .await;
}

/// A CNI that enforces ClusterNetworkPolicy itself sees remote pods as bare addresses: an Admin
/// Accept naming them by label does not match there, and a NetworkPolicy isolating the local
/// pod then refuses what the Admin tier accepts. The controller keeps a companion beside that
/// NetworkPolicy (the conjunction of both selectors, the remote pods as ipBlocks with the
/// rule's ports), owned by it, and removes it when the ClusterNetworkPolicy goes. Where no
/// NetworkPolicy isolates, none is written (it would isolate the pod).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_accepts_of_remote_pods_get_a_companion_where_a_networkpolicy_isolates() {
    let (_server, client, _controller) = controller_with_peer_and_shop().await;
    web_here_api_on_p1(&client).await;
    let cnps = cluster_network_policies(&client).await;
    let cnp: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": "metrics-from-api"},
        "spec": {"tier": "Admin", "priority": 20,
                 "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}}},
                 "ingress": [{"action": "Accept",
                              "from": [{"pods": {"namespaceSelector": {},
                                                 "podSelector": {"matchLabels": {"app": "api"}}}}],
                              "protocols": [{"tcp": {"destinationPort": {"number": 9090}}}]}]},
    }))
    .unwrap();
    cnps.create(&PostParams::default(), &cnp).await.unwrap();
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "shop");
    let ours = move |nps: Api<NetworkPolicy>| async move {
        nps.list(
            &kube::api::ListParams::default()
                .labels("peerwall.io/companion-of-clusternetworkpolicy=metrics-from-api"),
        )
        .await
        .ok()
        .map(|l| l.items)
    };
    // Nothing isolates shop/web yet: no companion, even once the tier has the accept.
    eventually(
        "the tier with the admin accept",
        Duration::from_secs(60),
        || {
            let api = fwc_api(&client, "liqo-tenant-p1");
            async move {
                let t = api.get_opt("peerwall-networkpolicy").await.ok().flatten()?;
                t.data["spec"]
                    .to_string()
                    .contains("admin:metrics-from-api")
                    .then_some(())
            }
        },
    )
    .await;
    assert_eq!(ours(nps.clone()).await.unwrap().len(), 0);
    // A NetworkPolicy isolates shop/web for ingress (TCP 8080 from anyone).
    let np: NetworkPolicy = serde_json::from_value(json!({
        "metadata": {"name": "web-in", "namespace": "shop"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "ingress": [{"ports": [{"protocol": "TCP", "port": 8080}]}]}}))
    .unwrap();
    let np = nps.create(&PostParams::default(), &np).await.unwrap();
    let companion = eventually("the companion", Duration::from_secs(30), || {
        let nps = nps.clone();
        async move { ours(nps).await?.into_iter().next() }
    })
    .await;
    let spec = serde_json::to_value(&companion.spec).unwrap();
    assert_eq!(spec["podSelector"], json!({"matchLabels": {"app": "web"}}));
    assert_eq!(spec["policyTypes"], json!(["Ingress"]));
    assert_eq!(
        spec["ingress"],
        json!([{"from": [{"ipBlock": {"cidr": "10.20.0.7/32"}}],
                "ports": [{"protocol": "TCP", "port": 9090}]}])
    );
    assert_eq!(companion.labels()["peerwall.io/companion-of"], "web-in");
    // The name docs/clusternetworkpolicy.md shows.
    assert_eq!(
        companion.name_any(),
        "peerwall-cnp-metrics-from-api-for-web-in-bc810e0131944690"
    );
    let owners = companion
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(owners[0].uid, np.uid().unwrap());
    // The ClusterNetworkPolicy gone: so is the companion; the user's policy stays as written.
    cnps.delete("metrics-from-api", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the companion to go", Duration::from_secs(30), || {
        let nps = nps.clone();
        async move { ours(nps).await?.is_empty().then_some(()) }
    })
    .await;
    assert_eq!(
        nps.get("web-in").await.unwrap().metadata.generation,
        Some(1)
    );
}

/// SCTP ports are enforced like TCP and UDP ones: an SCTP policy reaches the tier as an
/// `sctp` protocol match with its port, and nothing reports it as not enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sctp_policies_reach_the_tier_like_tcp_ones() {
    use k8s_openapi::api::core::v1::Event;
    let (_server, client, controller) = controller_with_peer_and_shop().await;
    pod(
        &client,
        "shop",
        "web",
        "10.10.0.5",
        json!({"app": "web"}),
        None,
    )
    .await;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "shop");
    for (name, proto) in [("sctp-in", "SCTP"), ("tcp-in", "TCP")] {
        let np: NetworkPolicy = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                     "ingress": [{"ports": [{"protocol": proto, "port": 9000}]}]}}))
        .unwrap();
        nps.create(&PostParams::default(), &np).await.unwrap();
    }
    let tier = eventually(
        "the tier with both policies",
        Duration::from_secs(30),
        || {
            let api = fwc_api(&client, "liqo-tenant-p1");
            async move {
                let t = api.get_opt("peerwall-networkpolicy").await.ok().flatten()?;
                let rules = t.data["spec"]["table"]["chains"][0]["rules"]["filterRules"].clone();
                let text = rules.to_string();
                (text.contains("shop/sctp-in:ingress[0]")
                    && text.contains("shop/tcp-in:ingress[0]"))
                .then_some(rules)
            }
        },
    )
    .await;
    let sctp = tier
        .as_array()
        .unwrap()
        .iter()
        .find(|r| {
            r["name"]
                .as_str()
                .unwrap_or("")
                .starts_with("shop/sctp-in:ingress[0]")
        })
        .unwrap();
    let text = sctp["match"].to_string();
    assert!(text.contains(r#""proto":{"value":"sctp"}"#), "{text}");
    assert!(text.contains("9000"), "{text}");
    let events: Api<Event> = Api::namespaced(client.clone(), "shop");
    let list = events.list(&Default::default()).await.unwrap();
    assert!(
        list.items
            .iter()
            .all(|e| e.reason.as_deref() != Some("NotEnforced")),
        "{:?}",
        list.items
    );
    assert!(
        !controller.log().contains("shop/sctp-in"),
        "{}",
        controller.log()
    );
}

/// Peer `p1`'s virtual node, `shop/web` (app=web, 10.10.0.5) running here and `shop/api`
/// (app=api, 10.20.0.7) running on `p1`.
async fn web_here_api_on_p1(client: &kube::Client) {
    use k8s_openapi::api::core::v1::Node;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "liqo-p1", "labels": {
                "liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "p1"}}}))
            .unwrap(),
        )
        .await
        .unwrap();
    pod(
        client,
        "shop",
        "web",
        "10.10.0.5",
        json!({"app": "web"}),
        Some("worker"),
    )
    .await;
    pod(
        client,
        "shop",
        "api",
        "10.20.0.7",
        json!({"app": "api"}),
        Some("liqo-p1"),
    )
    .await;
}

/// A server with peerwall's CRDs, a running controller, peer `p1`'s tenant namespace and an
/// empty namespace `shop`.
async fn controller_with_peer_and_shop() -> (ApiServer, kube::Client, Proc) {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let controller = server.peerwall(
        "controller",
        &["controller", "--metrics-addr", "127.0.0.1:0"],
    );
    namespace(&client, "liqo-tenant-p1", tenant_labels("p1")).await;
    namespace(&client, "shop", json!({})).await;
    (server, client, controller)
}

/// An API server with peerwall's CRDs and a controller whose grace periods are 2 s.
async fn controller_with_short_grace() -> (ApiServer, kube::Client, Proc) {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let controller = server.peerwall(
        "controller",
        &[
            "controller",
            "--metrics-addr",
            "127.0.0.1:0",
            "--unprotected-grace-secs",
            "2",
        ],
    );
    (server, client, controller)
}

/// A peer's gateway configuration that no host applies is reported as not enforced once the
/// grace period is over (a `NotEnforced` condition of host `peerwall-controller`, a Warning
/// Event, `peerwall_controller_unenforced_peers`), and the condition goes once an agent
/// applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_configuration_no_host_applies_is_reported_not_enforced() {
    use k8s_openapi::api::core::v1::Event;
    let (server, client, _controller) = controller_with_short_grace().await;
    namespace(&client, "liqo-tenant-p1", tenant_labels("p1")).await;
    let api = fwc_api(&client, "liqo-tenant-p1");
    let controller_condition = |o: &DynamicObject| {
        o.data
            .pointer("/status/conditions")
            .and_then(|c| c.as_array())
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c["host"] == "peerwall-controller")
                    .cloned()
            })
    };
    let cond = eventually("the NotEnforced condition", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let o = api.get_opt("peerwall-gateway").await.ok().flatten()?;
            controller_condition(&o)
        }
    })
    .await;
    assert_eq!(cond["type"], "NotEnforced", "{cond}");
    assert_eq!(cond["status"], "True", "{cond}");
    let events: Api<Event> = Api::namespaced(client.clone(), "liqo-tenant-p1");
    eventually("the NotEnforced event", Duration::from_secs(20), || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await.ok()?;
            list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some("NotEnforced")
                    && e.involved_object.name.as_deref() == Some("peerwall-gateway")
            })
        }
    })
    .await;
    // An agent applies it: the controller takes its condition back.
    let gw = peerwall_netns::NetNs::new("pwt-ne").expect("netns");
    let _agent = agent_with(
        &server,
        &gw,
        "gw1",
        "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=p1",
        &[],
    );
    eventually("the condition taken back", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let o = api.get_opt("peerwall-gateway").await.ok().flatten()?;
            let conds = o.data.pointer("/status/conditions")?.as_array()?.clone();
            (conds
                .iter()
                .any(|c| c["host"] == "gw1" && c["type"] == "Applied")
                && controller_condition(&o).is_none())
            .then_some(())
        }
    })
    .await;
}

/// A ProtectionPolicy, as a provider admin uses it: created, its opening merged into the
/// peer's gateway configuration (rule and set of the selected provider pod) and into the
/// offloaded namespace's NetworkPolicy, with a status per peer; edited, followed; an invalid
/// edit (no webhook here) leaves the last good generation in force and says so; removed,
/// gone from both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protection_policies_are_merged_followed_and_reported_per_peer() {
    let (_server, client, _controller) = controller_with_peer_and_shop().await;
    namespace(&client, "monitoring", json!({})).await;
    namespace(
        &client,
        "app-p1",
        json!({"liqo.io/remote-cluster-id": "p1"}),
    )
    .await;
    pod(
        &client,
        "monitoring",
        "prometheus",
        "10.20.5.10",
        json!({"app": "prometheus"}),
        None,
    )
    .await;
    pod(
        &client,
        "monitoring",
        "grafana",
        "10.20.5.11",
        json!({"app": "grafana"}),
        None,
    )
    .await;
    let pp: Api<peerwall_intent::ProtectionPolicy> = Api::all(client.clone());
    let policy = |port: serde_json::Value, protocol: &str| {
        json!({
            "apiVersion": "peerwall.io/v1alpha1", "kind": "ProtectionPolicy",
            "metadata": {"name": "open-metrics"},
            "spec": {"peers": ["p1"], "open": [{
                "name": "prometheus", "from": ["PeerPods", "Offloaded"],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app": "prometheus"}},
                "ports": [{"protocol": protocol, "port": port}]}]}})
    };
    pp.create(
        &PostParams::default(),
        &serde_json::from_value(policy(json!(9090), "TCP")).unwrap(),
    )
    .await
    .unwrap();
    let gw = fwc_api(&client, "liqo-tenant-p1");
    let rule_with = |port: &'static str| {
        let gw = gw.clone();
        move || {
            let gw = gw.clone();
            async move {
                let o = gw.get_opt("peerwall-gateway").await.ok().flatten()?;
                let rules = o.data["spec"]["table"]["chains"][0]["rules"]["filterRules"].clone();
                let rule = rules
                    .as_array()?
                    .iter()
                    .find(|r| r["name"] == "open.open-metrics.prometheus.tcp")?
                    .clone();
                rule["match"].to_string().contains(port).then_some(o)
            }
        }
    };
    let o = eventually(
        "the opening in the gateway",
        Duration::from_secs(30),
        rule_with("9090"),
    )
    .await;
    assert_eq!(
        set_elements(&o, "open.open-metrics.prometheus"),
        ["10.20.5.10".to_string()].into()
    );
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "app-p1");
    let np_has = |needle: &'static str, want: bool| {
        let nps = nps.clone();
        move || {
            let nps = nps.clone();
            async move {
                let np = nps.get_opt("peerwall-offloaded").await.ok().flatten()?;
                let text = serde_json::to_string(&np.spec).ok()?;
                (text.contains(needle) == want).then_some(text)
            }
        }
    };
    let text = eventually(
        "the opening in the offloaded NetworkPolicy",
        Duration::from_secs(30),
        np_has("prometheus", true),
    )
    .await;
    assert!(text.contains("9090"), "{text}");
    let status = eventually("the status per peer", Duration::from_secs(30), || {
        let pp = pp.clone();
        async move {
            let s = pp.get("open-metrics").await.ok()?.status?;
            (!s.peers.is_empty()).then_some(s)
        }
    })
    .await;
    assert_eq!(status.peers.len(), 1, "{status:?}");
    let p = &status.peers[0];
    assert_eq!(
        (
            p.peer.as_str(),
            p.gateway_rules,
            p.selected_addresses,
            p.network_policy_rules
        ),
        ("p1", 2, 1, 1),
        "{status:?}"
    );
    assert!(status.error.is_none(), "{status:?}");
    // Edited: followed.
    pp.patch(
        "open-metrics",
        &PatchParams::default(),
        &Patch::Merge(policy(json!(9091), "TCP")),
    )
    .await
    .unwrap();
    eventually(
        "the edit in the gateway",
        Duration::from_secs(30),
        rule_with("9091"),
    )
    .await;
    // An invalid edit: refused in status, the last good generation stays in force.
    pp.patch(
        "open-metrics",
        &PatchParams::default(),
        &Patch::Merge(policy(json!(9092), "ICMP")),
    )
    .await
    .unwrap();
    let error = eventually("the refusal in status", Duration::from_secs(30), || {
        let pp = pp.clone();
        async move { pp.get("open-metrics").await.ok()?.status?.error }
    })
    .await;
    assert!(
        error.contains("spec.open[0].ports[0].protocol")
            && error.contains("ICMP")
            && error.contains("stays in force"),
        "{error}"
    );
    let o = gw.get("peerwall-gateway").await.unwrap();
    assert!(o.data["spec"].to_string().contains("9091"), "{:?}", o.data);
    // Removed: gone from the gateway and the NetworkPolicy.
    pp.delete("open-metrics", &Default::default())
        .await
        .unwrap();
    eventually(
        "the opening gone from the gateway",
        Duration::from_secs(30),
        || {
            let gw = gw.clone();
            async move {
                let o = gw.get_opt("peerwall-gateway").await.ok().flatten()?;
                (!o.data["spec"].to_string().contains("open-metrics")).then_some(())
            }
        },
    )
    .await;
    eventually(
        "the opening gone from the NetworkPolicy",
        Duration::from_secs(30),
        np_has("prometheus", false),
    )
    .await;
    // A peer id that matches no peer (a typo): said in status and in a Warning Event, not
    // admitted silently with fewer peers than written.
    let mut typo = policy(json!(9090), "TCP");
    typo["metadata"]["name"] = json!("typo-peer");
    typo["spec"]["peers"] = json!(["p1", "p2-typo"]);
    pp.create(
        &PostParams::default(),
        &serde_json::from_value(typo).unwrap(),
    )
    .await
    .unwrap();
    let status = eventually(
        "the unknown peer in status",
        Duration::from_secs(30),
        || {
            let pp = pp.clone();
            async move {
                let s = pp.get("typo-peer").await.ok()?.status?;
                (!s.unknown_peers.is_empty()).then_some(s)
            }
        },
    )
    .await;
    assert_eq!(status.unknown_peers, ["p2-typo"], "{status:?}");
    assert_eq!(status.peers.len(), 1, "p1 still takes it: {status:?}");
    assert!(
        status
            .summary
            .as_deref()
            .unwrap_or_default()
            .contains("no such peer: p2-typo"),
        "{status:?}"
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
    eventually("an UnknownPeers event", Duration::from_secs(20), || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await.ok()?;
            list.items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("UnknownPeers")
                        && e.type_.as_deref() == Some("Warning")
                        && e.note
                            .as_deref()
                            .unwrap_or_default()
                            .contains("\"p2-typo\"")
                })
                .then_some(())
        }
    })
    .await;
}

/// A pod on `node` with `labels` in `ns`, Ready (no kubelet: its status written directly).
async fn ready_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    node: &str,
    labels: serde_json::Value,
) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "registry.invalid/x"}]},
    }))
    .unwrap();
    api.create(&PostParams::default(), &p).await.unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}]}})),
    )
    .await
    .unwrap();
}

/// "Enforced" is decided from live hosts only: an `Applied` condition of a host that runs no
/// gateway of the peer (an agent deleted, a gateway moved away) is taken out of the status,
/// and once the gateway moves to a node without an agent, the peer is `NotEnforced` although
/// the old node's agent had applied it. Before, such conditions stayed forever and the
/// configuration counted as enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditions_of_hosts_without_the_gateway_do_not_count() {
    let (_server, client, _controller) = controller_with_short_grace().await;
    namespace(&client, "peerwall-system", json!({})).await;
    namespace(&client, "liqo-tenant-p1", tenant_labels("p1")).await;
    ready_pod(
        &client,
        "peerwall-system",
        "agent-n1",
        "n1",
        json!({"app.kubernetes.io/name": "peerwall-agent"}),
    )
    .await;
    let gw_labels =
        json!({"networking.liqo.io/component": "gateway", "networking.liqo.io/active": "true"});
    ready_pod(&client, "liqo-tenant-p1", "gw-p1", "n1", gw_labels.clone()).await;
    let api = fwc_api(&client, "liqo-tenant-p1");
    let o = eventually("the gateway configuration", Duration::from_secs(20), || {
        let api = api.clone();
        async move { api.get_opt("peerwall-gateway").await.ok().flatten() }
    })
    .await;
    let generation = o.metadata.generation.unwrap();
    // What n1's agent and an agent that is gone (n-gone) once wrote.
    let applied = |host: &str| {
        json!({"host": host, "type": "Applied", "status": "True",
            "lastTransitionTime": "2026-11-28T00:00:00Z", "observedGeneration": generation})
    };
    api.patch_status(
        "peerwall-gateway",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": [applied("n-gone"), applied("n1")]}})),
    )
    .await
    .unwrap();
    let hosts = |o: &DynamicObject| -> Vec<(String, String)> {
        o.data
            .pointer("/status/conditions")
            .and_then(|c| c.as_array())
            .into_iter()
            .flatten()
            .map(|c| {
                (
                    c["host"].as_str().unwrap_or_default().to_string(),
                    c["type"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    };
    let conds = eventually(
        "the gone host's condition removed",
        Duration::from_secs(20),
        || {
            let api = api.clone();
            async move {
                let o = api.get("peerwall-gateway").await.ok()?;
                let h = hosts(&o);
                (!h.iter().any(|(x, _)| x == "n-gone")).then_some(h)
            }
        },
    )
    .await;
    assert_eq!(
        conds,
        [("n1".to_string(), "Applied".to_string())],
        "n1 runs the gateway with an agent: enforced"
    );
    // The gateway moves to n2, where no agent runs: n1's Applied no longer speaks for it.
    Api::<Pod>::namespaced(client.clone(), "liqo-tenant-p1")
        .delete(
            "gw-p1",
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    ready_pod(&client, "liqo-tenant-p1", "gw-p1-moved", "n2", gw_labels).await;
    let conds = eventually(
        "NotEnforced once the gateway moved",
        Duration::from_secs(30),
        || {
            let api = api.clone();
            async move {
                let o = api.get("peerwall-gateway").await.ok()?;
                let h = hosts(&o);
                (h == [("peerwall-controller".to_string(), "NotEnforced".to_string())]).then_some(h)
            }
        },
    )
    .await;
    assert_eq!(conds.len(), 1);
}

/// ClusterNetworkPolicies through the API server: where it serves none, the controller installs
/// their CRD (`policy.networking.k8s.io/v1alpha2`, from its own types); an Admin Deny, a
/// NetworkPolicy and a Baseline Accept land in the peer's tier in that order (replies first);
/// a policy the reader refuses (a port range the standard CRD's CEL would refuse, which this
/// 1.20 API server cannot check: CEL validation came in 1.25) is left out and reported with a
/// NotEnforced Event naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_network_policies_reach_the_tier_in_tier_order() {
    use k8s_openapi::api::core::v1::Event;
    let (_server, client, controller) = controller_with_peer_and_shop().await;
    web_here_api_on_p1(&client).await;
    let cnps = cluster_network_policies(&client).await;
    let create = |name: &str, spec: serde_json::Value| {
        let cnps = cnps.clone();
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "policy.networking.k8s.io/v1alpha2",
            "kind": "ClusterNetworkPolicy",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .unwrap();
        async move { cnps.create(&PostParams::default(), &obj).await.unwrap() }
    };
    let shop = json!({"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}}});
    create(
        "no-ssh",
        json!({"tier": "Admin", "priority": 10, "subject": shop,
               "ingress": [{"name": "ssh", "action": "Deny", "from": [{"namespaces": {}}],
                            "protocols": [{"tcp": {"destinationPort": {"number": 22}}}]}]}),
    )
    .await;
    create(
        "shop-default",
        json!({"tier": "Baseline", "priority": 500, "subject": shop,
               "ingress": [{"action": "Accept", "from": [{"pods": {"namespaceSelector": {},
                            "podSelector": {"matchLabels": {"app": "api"}}}}]}]}),
    )
    .await;
    create(
        "bad-range",
        json!({"tier": "Admin", "priority": 1, "subject": shop,
               "ingress": [{"action": "Deny", "from": [{"namespaces": {}}],
                            "protocols": [{"udp": {"destinationPort": {"range": {"start": 90, "end": 80}}}}]}]}),
    )
    .await;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "shop");
    let np: NetworkPolicy = serde_json::from_value(json!({
        "metadata": {"name": "web-in", "namespace": "shop"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "ingress": [{"ports": [{"protocol": "TCP", "port": 8080}]}]}}))
    .unwrap();
    nps.create(&PostParams::default(), &np).await.unwrap();
    let names: Vec<String> = eventually(
        "the tier with the admin, NetworkPolicy and baseline rules",
        Duration::from_secs(60),
        || {
            let api = fwc_api(&client, "liqo-tenant-p1");
            async move {
                let t = api.get_opt("peerwall-networkpolicy").await.ok().flatten()?;
                let ingress = t.data["spec"]["table"]["chains"]
                    .as_array()?
                    .iter()
                    .find(|c| c["name"] == "ingress")?
                    .clone();
                let names: Vec<String> = ingress["rules"]["filterRules"]
                    .as_array()?
                    .iter()
                    .filter_map(|r| r["name"].as_str().map(str::to_string))
                    .collect();
                let has = |p: &str| names.iter().any(|n| n.starts_with(p));
                (has("admin:no-ssh:ingress[0]")
                    && has("shop/web-in:ingress[0]")
                    && has("baseline:shop-default:ingress[0]"))
                .then_some(names)
            }
        },
    )
    .await;
    let at = |p: &str| names.iter().position(|n| n.starts_with(p)).unwrap();
    assert_eq!(names[0], "replies", "{names:?}");
    assert!(at("admin:no-ssh") < at("shop/web-in"), "{names:?}");
    assert!(at("shop/web-in") < at("baseline:shop-default"), "{names:?}");
    assert!(!names.iter().any(|n| n.contains("bad-range")), "{names:?}");
    // The refused one: an Event on it (cluster-scoped: in `default`), and the log.
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let note = eventually(
        "the NotEnforced Event of bad-range",
        Duration::from_secs(30),
        || {
            let events = events.clone();
            async move {
                events
                    .list(&Default::default())
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .find(|e| {
                        e.reason.as_deref() == Some("NotEnforced")
                            && e.involved_object.name.as_deref() == Some("bad-range")
                    })
                    .and_then(|e| e.message)
            }
        },
    )
    .await;
    assert!(
        note.contains("spec.ingress[0].protocols[0].udp.destinationPort.range"),
        "{note}"
    );
    assert!(
        controller.log().contains("bad-range"),
        "{}",
        controller.log()
    );
}
