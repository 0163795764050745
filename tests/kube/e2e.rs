//! End to end: controller, agents, consumers.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::*;
use peerwall_testkit::prelude::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_pod_is_reachable_through_its_consumers_tunnel_only() {
    // Two peerings: consumer a and consumer b each reach the provider through their own gateway
    // (own tunnel, own agent selecting its peer's configuration), as Liqo runs one gateway per peer.
    let ta = Topology::new();
    let tb = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
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

/// Peer a's gateway (a [`Topology`]) enforced by an agent of one backend, with the controller,
/// on an API server of its own. Dropped in field order: processes, then the server, the pins
/// and the namespaces.
struct PeerGateway {
    _controller: Proc,
    _agent: Proc,
    client: kube::Client,
    server: ApiServer,
    _pins: BpfPins,
    t: Topology,
}

impl PeerGateway {
    /// `backend`'s agent for peer a's gateway objects; `tag` names its pin directory.
    async fn start(backend: &str, tag: &str) -> Self {
        Self::start_with(backend, tag, &[]).await
    }

    /// [`Self::start`] with `controller_extra` on the controller's command line.
    async fn start_with(backend: &str, tag: &str, controller_extra: &[&str]) -> Self {
        let t = Topology::new();
        let pins = BpfPins {
            dir: format!(
                "/sys/fs/bpf/peerwall-kube-{tag}-{}-{backend}",
                std::process::id()
            ),
            ns: t.gateway.name().to_string(),
        };
        let server = api_server();
        let client = server.client().await;
        server.install_crds();
        let extra: Vec<&str> = if backend == "bpf" {
            vec!["--backend", "bpf", "--pin-dir", &pins.dir]
        } else {
            vec![]
        };
        let agent = agent_with(
            &server,
            &t.gateway,
            "gw",
            "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=a",
            &extra,
        );
        let mut args = vec!["controller", "--metrics-addr", "127.0.0.1:0"];
        args.extend_from_slice(controller_extra);
        let controller = server.peerwall("controller", &args);
        Self {
            _controller: controller,
            _agent: agent,
            client,
            server,
            _pins: pins,
            t,
        }
    }
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
    let g = PeerGateway::start(backend, "np").await;
    let (t, client) = (&g.t, g.client.clone());
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
    let connects =
        |src: &'static str, dst: &'static str| move || tcp_connects(&t.consumer, src, dst, 8080);
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

/// ClusterNetworkPolicies hold across the tunnel on both backends, through the real API server
/// and the controller: the provider's pod `shop/cart` runs on consumer a (a Liqo virtual node;
/// its packets come through a's tunnel from its address there) and reaches the provider's
/// `shop/api` and `shop/db`, which a NetworkPolicy isolates (only `app=api` may reach it).
/// Each case is checked before the ClusterNetworkPolicies (the path works, or the
/// NetworkPolicy refuses) and after, by real TCP connections:
/// - an Admin Deny: api 8080, open before, refused (api 9001 stays open);
/// - an Admin Accept over the NetworkPolicy's isolation: db 5432 and 5434, refused before,
///   open;
/// - a Pass: db 5433, passed on by a higher-priority Admin policy to the NetworkPolicy, which
///   refuses it where the Accept would have taken it;
/// - a Baseline Deny: api 9000 (no NetworkPolicy isolates api) refused, and open again once a
///   NetworkPolicy selects api and allows it (Baseline acts only where none isolates).
/// `peerwall verdict --cluster --trace` on the cluster as `kubectl get` shows it names the tier,
/// policy and rule that decided each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_network_policies_hold_across_the_tunnel_on_both_backends() {
    for backend in ["nftables", "bpf"] {
        cluster_network_policies_hold(backend).await;
    }
}

async fn cluster_network_policies_hold(backend: &str) {
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use kube::api::{Api, DynamicObject, PostParams};
    let g = PeerGateway::start(backend, "cnp").await;
    let (t, client) = (&g.t, g.client.clone());
    let (api_ip, db_ip, cart_ip) = ("10.20.1.3", "10.20.3.1", "10.10.1.68");
    let _listeners: Vec<Listener> = [
        (api_ip, 8080),
        (api_ip, 9000),
        (api_ip, 9001),
        (db_ip, 5432),
        (db_ip, 5433),
        (db_ip, 5434),
    ]
    .into_iter()
    .map(|(ip, port)| Listener::tcp(&t.provider, ip, port))
    .collect();
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    liqo_configuration(&client, "a", &["10.10.0.0/16"]).await;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "liqo-a", "labels": {
                "liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "a"}}}))
            .unwrap(),
        )
        .await
        .unwrap();
    namespace(&client, "shop", json!({})).await;
    pod(
        &client,
        "shop",
        "api",
        api_ip,
        json!({"app": "api"}),
        Some("worker"),
    )
    .await;
    pod(
        &client,
        "shop",
        "db",
        db_ip,
        json!({"app": "db"}),
        Some("worker"),
    )
    .await;
    pod(
        &client,
        "shop",
        "cart",
        cart_ip,
        json!({"app": "cart"}),
        Some("liqo-a"),
    )
    .await;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "shop");
    let np = |name: &str, app: &str, from: serde_json::Value| -> NetworkPolicy {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"podSelector": {"matchLabels": {"app": app}}, "ingress": [from]}}))
        .unwrap()
    };
    nps.create(
        &PostParams::default(),
        &np(
            "db-from-api",
            "db",
            json!({"from": [{"podSelector": {"matchLabels": {"app": "api"}}}]}),
        ),
    )
    .await
    .unwrap();
    let connects = |dst: &'static str, port: u16| {
        let c = t.consumer.name().to_string();
        move || {
            let o = Command::new("ip")
                .args(["netns", "exec", &c, "timeout", "3", "socat", "-T", "1", "-"])
                .arg(format!(
                    "TCP4:{dst}:{port},bind={cart_ip},connect-timeout=1"
                ))
                .output();
            o.is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"))
        }
    };
    // Before: cart reaches api on every port (its own pod on a: protection lets it through),
    // and the NetworkPolicy keeps it from db.
    wait_until(
        &format!("{backend}: cart reaches api"),
        30,
        connects(api_ip, 8080),
    );
    for port in [9000, 9001] {
        wait_until(
            &format!("{backend}: cart reaches api:{port}"),
            10,
            connects(api_ip, port),
        );
    }
    for port in [5432, 5433, 5434] {
        wait_until(
            &format!("{backend}: the NetworkPolicy isolates db:{port}"),
            30,
            || !connects(db_ip, port)(),
        );
    }
    // The ClusterNetworkPolicies (their CRD installed by the controller).
    let cnps = cluster_network_policies(&client).await;
    let subject = |app: &str| {
        json!({"pods": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}},
                        "podSelector": {"matchLabels": {"app": app}}}})
    };
    let cart = json!([{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "cart"}}}}]);
    let tcp = |port: u16| json!([{"tcp": {"destinationPort": {"number": port}}}]);
    for (name, spec) in [
        (
            "db-5433-to-owners",
            json!({"tier": "Admin", "priority": 10, "subject": subject("db"),
            "ingress": [{"name": "owners-decide", "action": "Pass", "from": cart, "protocols": tcp(5433)}]}),
        ),
        (
            "cart-reaches-db",
            json!({"tier": "Admin", "priority": 20, "subject": subject("db"),
            "ingress": [{"name": "cart", "action": "Accept", "from": cart}]}),
        ),
        (
            "no-cart-to-api-8080",
            json!({"tier": "Admin", "priority": 30, "subject": subject("api"),
            "ingress": [{"name": "http", "action": "Deny", "from": cart, "protocols": tcp(8080)}]}),
        ),
        (
            "api-9000-closed-by-default",
            json!({"tier": "Baseline", "priority": 100, "subject": subject("api"),
            "ingress": [{"name": "9000", "action": "Deny", "from": [{"namespaces": {}}], "protocols": tcp(9000)}]}),
        ),
    ] {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": name}, "spec": spec}))
        .unwrap();
        cnps.create(&PostParams::default(), &obj).await.unwrap();
    }
    wait_until(
        &format!("{backend}: the Admin Deny refuses api:8080"),
        30,
        || !connects(api_ip, 8080)(),
    );
    wait_until(
        &format!("{backend}: the Admin Accept opens db:5432 over the NetworkPolicy"),
        30,
        connects(db_ip, 5432),
    );
    assert!(connects(db_ip, 5434)(), "{backend}: Admin Accept, db:5434");
    assert!(
        !connects(db_ip, 5433)(),
        "{backend}: the Pass leaves db:5433 to the NetworkPolicy, which refuses it"
    );
    assert!(
        !connects(api_ip, 9000)(),
        "{backend}: the Baseline Deny, api:9000 (no NetworkPolicy isolates api)"
    );
    assert!(
        connects(api_ip, 9001)(),
        "{backend}: api:9001, named by no policy"
    );
    // `verdict --cluster --trace` on the cluster as it is.
    let snapshot = g
        .server
        .kubectl()
        .args([
            "get",
            "namespaces,nodes,pods,networkpolicies,configurations.networking.liqo.io,clusternetworkpolicies.policy.networking.k8s.io",
            "-A",
            "-o",
            "yaml",
        ])
        .output()
        .unwrap();
    assert!(
        snapshot.status.success(),
        "{}",
        String::from_utf8_lossy(&snapshot.stderr)
    );
    let file = std::env::temp_dir().join(format!("pw-cnp-{}-{backend}.yaml", std::process::id()));
    std::fs::write(&file, &snapshot.stdout).unwrap();
    for (to, port, verdict, step) in [
        (
            "shop/api",
            8080,
            "drop",
            "Admin tier: denied by ClusterNetworkPolicy no-cart-to-api-8080, rule 0",
        ),
        (
            "shop/db",
            5432,
            "accept",
            "Admin tier: accepted by ClusterNetworkPolicy cart-reaches-db, rule 0",
        ),
        (
            "shop/db",
            5433,
            "drop",
            "NetworkPolicies: isolated by shop/db-from-api and no rule allows it: denied",
        ),
        (
            "shop/api",
            9000,
            "drop",
            "Baseline tier: denied by ClusterNetworkPolicy api-9000-closed-by-default, rule 0",
        ),
    ] {
        let o = Command::new(peerwall())
            .args(["verdict", "--cluster"])
            .arg(&file)
            .args([
                "--from",
                "shop/cart",
                "--to",
                to,
                "--dport",
                &port.to_string(),
            ])
            .args(["--trace", "--output", "json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["verdict"]["verdict"], verdict, "{to}:{port}: {v}");
        let steps = v["trace"]["ingress"]["steps"].to_string();
        assert!(steps.contains(step), "{to}:{port}: {steps}");
        if port == 5433 {
            assert!(
                steps.contains("Admin tier: passed on by ClusterNetworkPolicy db-5433-to-owners"),
                "{steps}"
            );
        }
    }
    let _ = std::fs::remove_file(&file);
    // A NetworkPolicy selects api and allows 9000 from cart: the Baseline no longer applies.
    nps.create(
        &PostParams::default(),
        &np(
            "api-from-cart",
            "api",
            json!({"from": [{"podSelector": {"matchLabels": {"app": "cart"}}}],
                   "ports": [{"protocol": "TCP", "port": 9000}]}),
        ),
    )
    .await
    .unwrap();
    wait_until(
        &format!("{backend}: a NetworkPolicy opens what the Baseline closed"),
        30,
        connects(api_ip, 9000),
    );
    assert!(
        !connects(api_ip, 8080)(),
        "{backend}: the Admin Deny stays first"
    );
}

/// Configurations too large for etcd hold as written: with a budget far below the objects'
/// size (`--inline-budget-bytes`, as etcd's 1.5 MiB is to a tier of 100,000 pods), the
/// controller moves the gateway configuration's and the NetworkPolicy tier's sets into
/// AddressSets, counted in each set's `addressSets`; the agent enforces them whole. A
/// NetworkPolicy isolating 201 pods (one reachable through the topology, 200 more that only
/// grow its set) still refuses what it does not allow, on both backends: without the slices
/// its isolation set would be empty and the pod open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_too_large_to_keep_inline_hold_from_address_sets_on_both_backends() {
    for backend in ["nftables", "bpf"] {
        sets_from_address_sets_hold(backend).await;
    }
}

async fn sets_from_address_sets_hold(backend: &str) {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use kube::api::{Api, ListParams, PostParams};
    let g = PeerGateway::start_with(backend, "spill", &["--inline-budget-bytes", "1500"]).await;
    let (t, client) = (&g.t, g.client.clone());
    let _db = Listener::tcp_echo(&t.provider, "10.20.1.3", 8080);
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    liqo_configuration(&client, "a", &["10.10.0.0/16"]).await;
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    pod(
        &client,
        "app-a",
        "db",
        "10.20.1.3",
        json!({"app": "db"}),
        None,
    )
    .await;
    let mut isolated = vec!["10.20.1.3".to_string()];
    for i in 0..200 {
        // Every other address: the tier writes a run of addresses as one range.
        let ip = format!("10.20.{}.{}", 2 + i / 100, (i % 100) * 2 + 1);
        pod(
            &client,
            "app-a",
            &format!("db-{i}"),
            &ip,
            json!({"app": "db"}),
            None,
        )
        .await;
        isolated.push(ip);
    }
    let connects = |src: &'static str| move || tcp_connects(&t.consumer, src, "10.20.1.3", 8080);
    wait_until(
        &format!("{backend}: the offloaded pod reachable"),
        30,
        connects("10.10.1.68"),
    );
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "app-a");
    nps.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "db-ingress", "namespace": "app-a"},
            "spec": {"podSelector": {"matchLabels": {"app": "db"}},
                     "ingress": [{"from": [{"ipBlock": {"cidr": "10.10.1.67/32"}}],
                                  "ports": [{"protocol": "TCP", "port": 8080}]}]}}))
        .unwrap(),
    )
    .await
    .unwrap();
    wait_until(
        &format!("{backend}: 10.10.1.68 denied by the policy"),
        30,
        || !connects("10.10.1.68")(),
    );
    assert!(connects("10.10.1.67")(), "{backend}: the allowed source");
    // What the API holds: the tier's largest set (the pods the policy isolates) moved out
    // and counted, the small one (the allowed source) inline; the slices hold every pod the
    // policy isolates.
    let tiers = fwc_api(&client, "liqo-tenant-a");
    let tier = tiers.get("peerwall-networkpolicy").await.unwrap();
    let sets = tier.data["spec"]["table"]["sets"]
        .as_array()
        .unwrap()
        .clone();
    let (moved, inline): (Vec<_>, Vec<_>) = sets.iter().partition(|s| s["fromAddressSets"] == true);
    assert_eq!(moved.len(), 1, "{backend}: {sets:?}");
    assert!(
        moved[0]["addressSets"].as_u64() == Some(1) && moved[0].get("elements").is_none(),
        "{backend}: {}",
        moved[0]
    );
    assert!(
        inline
            .iter()
            .any(|s| s["elements"][0]["key"] == "10.10.1.67"),
        "{backend}: {inline:?}"
    );
    let slices = slice_api(&client, "liqo-tenant-a")
        .list(&ListParams::default().labels("peerwall.io/configuration=peerwall-networkpolicy"))
        .await
        .unwrap();
    let mut held: Vec<String> = slices
        .items
        .iter()
        .flat_map(|o| o.data["spec"]["addresses"].as_array().unwrap().clone())
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    held.sort();
    held.dedup();
    for ip in &isolated {
        assert!(
            held.contains(ip),
            "{backend}: {ip} in no slice of the tier: {held:?}"
        );
    }
    // The gateway configuration's sets moved too (its rules alone outgrow the budget).
    let gw = tiers.get("peerwall-gateway").await.unwrap();
    let moved = gw.data["spec"]["table"]["sets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["addressSets"].as_u64().is_some())
        .count();
    assert!(moved > 0, "{backend}: {}", gw.data["spec"]["table"]["sets"]);
    applied(&tiers, "peerwall-networkpolicy", "gw").await;
    // The 200 pods gone: the tier fits again, its set comes back inline, and its slices are
    // deleted once the host applied the tier that no longer takes them. The policy holds
    // throughout.
    for i in 0..200 {
        delete_pod(&client, "app-a", &format!("db-{i}")).await;
    }
    let slices_of_tier = || async {
        slice_api(&client, "liqo-tenant-a")
            .list(&ListParams::default().labels("peerwall.io/configuration=peerwall-networkpolicy"))
            .await
            .ok()
            .map(|l| l.items.len())
    };
    eventually(
        "the tier's slices deleted",
        Duration::from_secs(30),
        || async { (slices_of_tier().await? == 0).then_some(()) },
    )
    .await;
    let tier = tiers.get("peerwall-networkpolicy").await.unwrap();
    let sets = tier.data["spec"]["table"]["sets"]
        .as_array()
        .unwrap()
        .clone();
    assert!(
        sets.iter().all(|s| s.get("fromAddressSets").is_none()
            && s.get("addressSets").is_none()
            && s["elements"].as_array().is_some_and(|e| !e.is_empty())),
        "{backend}: {sets:?}"
    );
    applied(&tiers, "peerwall-networkpolicy", "gw").await;
    assert!(
        !connects("10.10.1.68")(),
        "{backend}: the policy still refuses 10.10.1.68 with its set inline again"
    );
    assert!(connects("10.10.1.67")(), "{backend}: and allows 10.10.1.67");
}
