//! `peerwall agent --source kube` in a gateway namespace, both backends.

use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;

use crate::support::*;
use peerwall_testkit::prelude::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_enforces_through_the_bpf_backend_in_a_gateway_namespace() {
    let t = Topology::new();
    let pins = BpfPins {
        dir: format!("/sys/fs/bpf/peerwall-kube-test-{}", std::process::id()),
        ns: t.gateway.name().to_string(),
    };
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let _agent = agent_with(
        &server,
        &t.gateway,
        "gw-bpf",
        "peerwall.io/target=gateway",
        &[
            "--backend",
            "bpf",
            "--pin-dir",
            &pins.dir,
            "--interfaces",
            "liqo-tunnel,liqo.*",
            "--events",
            "--drop-summary-secs",
            "1",
        ],
    );
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, "gw-bpf").await;
    // The programs are attached in the gateway's namespace (tc link pinned by interface name).
    assert!(
        std::path::Path::new(&pins.dir)
            .join("links/tc-liqo-tunnel")
            .exists(),
        "tc link pinned"
    );
    // The policy is not in nftables: its only table is the bpf backend's guard (which drops
    // what arrives on an interface the datapath is not attached to yet).
    assert_eq!(
        nft_tables(&t.gateway).trim(),
        "table inet peerwall-guard",
        "the policy in the datapath, the guard alone in nftables"
    );
    assert_thesis_block_enforced(&t.consumer);
    // What was dropped shows up as an Event on the object, with the flow and the rule.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "liqo-tenant-cluster1");
    eventually("a Dropped event", Duration::from_secs(15), || async {
        let _ = ping(&t.consumer, "10.10.1.67", "10.20.1.2");
        let list = events.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| {
                let note = e.note.as_deref().unwrap_or_default();
                e.reason.as_deref() == Some("Dropped")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                    && note.contains("from 10.10.1.67 to 10.20.1.2")
                    && note.contains("by rule table_name/filter_chain_name/drop_traffic")
            })
            .then_some(())
    })
    .await;
    // Deleting the object empties the maps, then releases the finalizer.
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the object to be gone", Duration::from_secs(20), || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "nothing enforced any more"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_applies_reports_status_and_cleans_up() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let _agent = agent(&server, &t.gateway, "gw-test", "peerwall.io/target=gateway");
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, "gw-test").await;
    let o = api.get(&name).await.unwrap();
    assert!(
        o.finalizers()
            .iter()
            .any(|f| f == "peerwall.io/agent-gw-test"),
        "{:?}",
        o.finalizers()
    );
    let table = o.data["spec"]["table"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        nft_tables(&t.gateway).contains(&table),
        "{}",
        nft_tables(&t.gateway)
    );
    assert_thesis_block_enforced(&t.consumer);

    // The emergency switch: the agent keeps it, and the condition says so until it is off.
    let o = peerwall_in(&t.gateway, &["allow-all", "on", "--backend", "nftables"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    eventually(
        "the switch in the condition",
        Duration::from_secs(20),
        || async {
            let c = condition(&api, &name, "gw-test").await?;
            (c.0 == "Applied" && c.1.contains("emergency switch is on")).then_some(())
        },
    )
    .await;
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "everything passes while the switch is on"
    );
    let o = peerwall_in(&t.gateway, &["allow-all", "off", "--backend", "nftables"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    eventually(
        "the plain Applied condition",
        Duration::from_secs(20),
        || async {
            let c = condition(&api, &name, "gw-test").await?;
            (c.0 == "Applied" && c.1.is_empty()).then_some(())
        },
    )
    .await;
    assert_thesis_block_enforced(&t.consumer);

    // An invalid edit: Error with the field path, the last good spec stays in force.
    api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"table": {"chains": [{
        "name": "block", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
        "rules": {"filterRules": [{"action": "drop", "match": [{"op": "eq", "ip": {"value": "10.20.1.300", "position": "dst"}}]}]}}]}}})))
        .await
        .unwrap();
    let (_, msg, _, _) = eventually("the Error condition", Duration::from_secs(20), || async {
        let c = condition(&api, &name, "gw-test").await?;
        (c.0 == "Error" && c.2 == c.3).then_some(c)
    })
    .await;
    assert!(
        msg.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value")
            && msg.contains("10.20.1.300"),
        "{msg}"
    );
    assert!(msg.contains("stays in force"), "{msg}");
    assert_thesis_block_enforced(&t.consumer);
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "liqo-tenant-cluster1");
    eventually("a NotApplied event", Duration::from_secs(10), || async {
        let list = events.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("NotApplied")
                    && e.note
                        .as_deref()
                        .unwrap_or_default()
                        .contains("10.20.1.300")
            })
            .then_some(())
    })
    .await;

    // A misspelt field (`ctState` for `ctstate`): the CRD keeps it instead of pruning it, so
    // the agent refuses the object with a did-you-mean. Pruned (the CRD before it preserved
    // unknown fields), the accept rule below lost its state test and accepted every packet
    // from 10.10.1.67 before the drop: the blocked ping passed.
    api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"table": {"chains": [{
        "name": "filter_chain_name", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
        "rules": {"filterRules": [
            {"name": "replies", "action": "accept", "match": [
                {"op": "eq", "ip": {"value": "10.10.1.67", "position": "src"}, "ctState": {"value": ["established"]}}]},
            {"name": "drop_traffic", "action": "drop", "match": [
                {"op": "eq", "ip": {"value": "10.10.1.67", "position": "src"}},
                {"op": "eq", "ip": {"value": "10.20.1.2", "position": "dst"}}]}]}}]}}})))
        .await
        .unwrap();
    let stored = api.get(&name).await.unwrap();
    assert_eq!(
        stored.data["spec"]["table"]["chains"][0]["rules"]["filterRules"][0]["match"][0]["ctState"],
        json!({"value": ["established"]}),
        "the API server kept the unknown field"
    );
    let (_, msg, _, _) = eventually(
        "the Error condition on the misspelt field",
        Duration::from_secs(20),
        || async {
            let c = condition(&api, &name, "gw-test").await?;
            (c.0 == "Error" && c.2 == c.3 && c.1.contains("ctState")).then_some(c)
        },
    )
    .await;
    assert!(
        msg.contains("spec.table.chains[0].rules.filterRules[0].match[0]")
            && msg.contains("did you mean `ctstate`"),
        "{msg}"
    );
    assert_thesis_block_enforced(&t.consumer);

    // The blocked destination in a named set; then an edit of that set's elements alone
    // (what a NetworkPolicy tier's relabel is), one of them invalid: the agent validates just
    // the changed set (`check_since`) and refuses it as the whole validation would, with the
    // element's path and value, the last good spec in force.
    let with_set = |elements: Vec<&str>| {
        let elements: Vec<serde_json::Value> =
            elements.into_iter().map(|e| json!({"key": e})).collect();
        json!({"spec": {"table": {
            "sets": [{"name": "blocked", "keyType": "ipv4_addr", "elements": elements}],
            "chains": [{"name": "filter_chain_name", "type": "filter", "hook": "forward",
                "priority": 0, "policy": "accept", "rules": {"filterRules": [
                    {"name": "drop_traffic", "action": "drop", "match": [
                        {"op": "eq", "ip": {"value": "10.10.1.67", "position": "src"}},
                        {"op": "eq", "ip": {"value": "@blocked", "position": "dst"}}]}]}}]}}})
    };
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(with_set(vec!["10.20.1.2"])),
    )
    .await
    .unwrap();
    eventually("Applied with the set", Duration::from_secs(20), || async {
        let c = condition(&api, &name, "gw-test").await?;
        (c.0 == "Applied" && c.2 == c.3).then_some(())
    })
    .await;
    assert_thesis_block_enforced(&t.consumer);
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(with_set(vec!["10.20.1.2", "10.20.1.300"])),
    )
    .await
    .unwrap();
    let (_, msg, _, _) = eventually(
        "the Error condition on the set element",
        Duration::from_secs(20),
        || async {
            let c = condition(&api, &name, "gw-test").await?;
            (c.0 == "Error" && c.2 == c.3).then_some(c)
        },
    )
    .await;
    assert!(
        msg.contains("spec.table.sets[0].elements[1].key")
            && msg.contains("10.20.1.300")
            && msg.contains("stays in force"),
        "{msg}"
    );
    assert_thesis_block_enforced(&t.consumer);

    // Someone deletes the table: the agent restores it.
    in_ns(&t.gateway, "nft", &["delete", "table", "inet", &table]);
    eventually("drift repair", Duration::from_secs(10), || async {
        nft_tables(&t.gateway).contains(&table).then_some(())
    })
    .await;

    // Deleting the object removes the table, then the finalizer lets the object go.
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the object to be gone", Duration::from_secs(20), || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        !nft_tables(&t.gateway).contains(&table),
        "{}",
        nft_tables(&t.gateway)
    );
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "nothing enforced any more"
    );
}

/// Who may steer a gateway: the thesis's blocking rule, labelled for peer cluster1's gateway,
/// written where it may not steer it (a namespace nobody designated; the tenant namespace of
/// another peer) is ignored: nothing changes in the kernel (the blocked flow still passes),
/// the object gets a warning Event saying why and neither finalizer nor condition. The same
/// object in cluster1's own tenant namespace is enforced (the check is sensitive).
async fn objects_from_other_namespaces_are_ignored(backend: &str) {
    let t = Topology::new();
    let pins = BpfPins {
        dir: format!(
            "/sys/fs/bpf/peerwall-kube-trust-{backend}-{}",
            std::process::id()
        ),
        ns: t.gateway.name().to_string(),
    };
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let host = format!("gw-trust-{backend}");
    let mut extra = vec!["--backend", backend];
    if backend == "bpf" {
        extra.extend(["--pin-dir", &pins.dir, "--interfaces", "liqo-tunnel,liqo.*"]);
    }
    let _agent = agent_with(
        &server,
        &t.gateway,
        &host,
        "peerwall.io/target=gateway",
        &extra,
    );
    namespace(&client, "team-x", json!({})).await;
    tenant_namespace(&client, "other").await;
    tenant_namespace(&client, "cluster1").await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
    for (ns, why) in [
        ("team-x", "namespace \"team-x\" is not designated for gateway objects"),
        (
            "liqo-tenant-other",
            "is the Liqo tenant namespace of peer \"other\", but this object is labelled peerwall.io/remote-cluster-id=\"cluster1\"",
        ),
    ] {
        let api = fwc_api(&client, ns);
        let mut v = thesis_block();
        v["metadata"]["namespace"] = json!(ns);
        let obj: DynamicObject = serde_json::from_value(v).unwrap();
        let name = obj.name_any();
        api.create(&PostParams::default(), &obj).await.unwrap();
        let note = eventually(
            &format!("{backend}: an Ignored event on {ns}/{name}"),
            Duration::from_secs(30),
            || async {
                let list = events.list(&Default::default()).await.ok()?;
                list.items.iter().find_map(|e| {
                    let r = e.regarding.as_ref()?;
                    (e.reason.as_deref() == Some("Ignored")
                        && e.type_.as_deref() == Some("Warning")
                        && r.namespace.as_deref() == Some(ns)
                        && r.name.as_deref() == Some(name.as_str()))
                    .then(|| e.note.clone().unwrap_or_default())
                })
            },
        )
        .await;
        assert!(note.contains(why), "{backend}: {note}");
        // Nothing enforced: the flow the object would block passes, no table, and the object
        // carries neither this host's finalizer nor a condition.
        assert!(
            ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
            "{backend}: {ns}'s object blocked traffic"
        );
        if backend == "nftables" {
            assert!(
                nft_tables(&t.gateway).trim().is_empty(),
                "{backend}: {}",
                nft_tables(&t.gateway)
            );
        }
        let o = api.get(&name).await.unwrap();
        assert!(o.finalizers().is_empty(), "{:?}", o.finalizers());
        assert!(
            o.data.pointer("/status/conditions").is_none(),
            "{}",
            o.data["status"]
        );
    }
    // The same object in cluster1's own tenant namespace is taken.
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, &host).await;
    assert_thesis_block_enforced(&t.consumer);
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the object to be gone", Duration::from_secs(20), || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_agent_ignores_gateway_objects_from_other_namespaces() {
    objects_from_other_namespaces_are_ignored("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpf_agent_ignores_gateway_objects_from_other_namespaces() {
    objects_from_other_namespaces_are_ignored("bpf").await;
}

/// A NAT rule in a peerwall object is refused by an agent not told to enforce packet changes:
/// an Error condition naming the rule's field path, nothing in the kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packet_changing_rules_are_refused_unless_enabled() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let _agent = agent(&server, &t.gateway, "gw-nat", "peerwall.io/target=gateway");
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let mut v = thesis_block();
    v["metadata"]["name"] = json!("redirect");
    v["spec"]["table"]["name"] = json!("redirect");
    v["spec"]["table"]["chains"] = json!([{
        "name": "dnat", "type": "nat", "hook": "prerouting", "priority": -100, "policy": "accept",
        "rules": {"natRules": [{"name": "steal", "natType": "dnat", "to": "10.20.1.3",
            "match": [{"op": "eq", "ip": {"value": "10.20.1.2", "position": "dst"}}]}]}
    }]);
    let obj: DynamicObject = serde_json::from_value(v).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
    let (_, msg, _, _) = eventually("the Error condition", Duration::from_secs(30), || async {
        let c = condition(&api, "redirect", "gw-nat").await?;
        (c.0 == "Error").then_some(c)
    })
    .await;
    assert!(
        msg.contains("spec.table.chains[0].rules.natRules[0]: a NAT rule")
            && msg.contains("--allow-packet-changes"),
        "{msg}"
    );
    assert!(
        !nft_tables(&t.gateway).contains("redirect"),
        "{}",
        nft_tables(&t.gateway)
    );
}

/// A failed apply is tried again by itself: a foreign nftables table holds the name the
/// object's table needs (peerwall refuses to touch it: the apply fails, Error condition); once
/// its owner removes it, the agent applies the object without any further change through the
/// API (it retries with backoff).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_apply_is_retried_without_an_api_change() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let _agent = agent(
        &server,
        &t.gateway,
        "gw-retry",
        "peerwall.io/target=gateway",
    );
    tenant_namespace(&client, "cluster1").await;
    // The fault: someone else's table with the name the object's table needs.
    let nft = |args: &[&str]| {
        let o = in_ns(&t.gateway, "nft", args);
        assert!(
            o.status.success(),
            "nft {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    nft(&["add", "table", "ip", "table_name"]);
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    let (_, msg, _, _) = eventually("the failed apply", Duration::from_secs(30), || async {
        let c = condition(&api, &name, "gw-retry").await?;
        (c.0 == "Error").then_some(c)
    })
    .await;
    assert!(msg.contains("not owned by peerwall"), "{msg}");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "not enforced while the apply fails"
    );
    // The fault clears; nothing is written to the API, the agent gets there by itself.
    nft(&["delete", "table", "ip", "table_name"]);
    eventually("the retried apply", Duration::from_secs(30), || async {
        let c = condition(&api, &name, "gw-retry").await?;
        (c.0 == "Applied").then_some(())
    })
    .await;
    assert_thesis_block_enforced(&t.consumer);
}

/// What `kubectl args` printed, which must succeed.
fn kubectl_out(server: &ApiServer, args: &[&str]) -> String {
    let out = server.kubectl().args(args).output().expect("kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The API server's count of lists it read through to etcd, of custom resources and of
/// namespaces (`etcd_request_duration_seconds_count{operation="list"}`).
fn etcd_lists(server: &ApiServer) -> u64 {
    kubectl_out(server, &["get", "--raw", "/metrics"])
        .lines()
        .filter(|l| l.starts_with("etcd_request_duration_seconds_count{operation=\"list\""))
        .filter(|l| l.contains("unstructured.Unstructured") || l.contains("core.Namespace"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Every custom resource kind the API server serves listed once through `kubectl get`: the
/// first request for a kind creates its watch cache (apiextensions-apiserver builds a kind's
/// storage lazily), which fills with a list from etcd of its own.
fn warm_watch_caches(server: &ApiServer) {
    let kinds = kubectl_out(
        server,
        &["get", "crd", "-o", "jsonpath={.items[*].metadata.name}"],
    )
    .split_whitespace()
    .collect::<Vec<_>>()
    .join(",");
    assert!(!kinds.is_empty(), "no custom resource kinds served");
    kubectl_out(server, &["get", kinds.as_str(), "-A"]);
}

/// Every gateway of every node lists at start: from the API server's watch cache, never read
/// through to etcd, where a label-selected list decodes every object of the kind (50 gateways
/// starting kept a 2-core API server busy for 12 s, `cargo xtask bench-peers`). Seen in the
/// API server's own etcd counters: a kube-rs watcher pages by default, and a paged list
/// silently loses `resourceVersion=0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_lists_from_the_watch_cache_not_etcd() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    // The API server creates a custom resource's watch cache at the first request for that
    // kind, from any client, and the cache fills with its own list from etcd. The
    // controller-manager's garbage collector and quota controllers discover new kinds and list
    // them when they get to it (a busy machine made that land after the agent started), so
    // every served custom kind is listed here first, creating every cache before counting;
    // then the counter settles (unchanged over a second), however loaded the machine.
    warm_watch_caches(&server);
    let mut before = etcd_lists(&server);
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = etcd_lists(&server);
        if now == before {
            break;
        }
        before = now;
    }
    // Sensitivity: a list without resourceVersion=0 is counted.
    kubectl_out(
        &server,
        &[
            "get",
            "firewallconfigurations.peerwall.io",
            "-A",
            "--chunk-size=10",
        ],
    );
    let counted = etcd_lists(&server);
    assert!(
        counted > before,
        "a read through is not counted: {before} → {counted}"
    );
    let _agent = agent(&server, &t.gateway, "gw-test", "peerwall.io/target=gateway");
    applied(&api, &name, "gw-test").await;
    assert_thesis_block_enforced(&t.consumer);
    assert_eq!(
        etcd_lists(&server),
        counted,
        "the agent read lists through to etcd"
    );
}

/// An object that carries this host's finalizer but is no longer selected here (its labels
/// changed while the agent was away) is released when the agent starts again: otherwise its
/// deletion would hang forever. The release comes after the agent's first round (it keeps no
/// new gateway behind its boot policy), and the object it still selects keeps its finalizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_releases_objects_it_no_longer_selects() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let mut kept = thesis_block();
    kept["metadata"]["name"] = json!("kept");
    kept["spec"]["table"]["name"] = json!("kept_table");
    for o in [thesis_block(), kept] {
        let obj: DynamicObject = serde_json::from_value(o).unwrap();
        api.create(&PostParams::default(), &obj).await.unwrap();
    }
    let name = thesis_block()["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let finalizer = "peerwall.io/agent-gw-test";
    let has = |o: &DynamicObject| o.finalizers().iter().any(|f| f == finalizer);
    {
        let _agent = agent(&server, &t.gateway, "gw-test", "peerwall.io/target=gateway");
        applied(&api, &name, "gw-test").await;
        applied(&api, "kept", "gw-test").await;
        assert!(has(&api.get(&name).await.unwrap()));
    }
    // While the agent is away, the object stops being selected here.
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"peerwall.io/target": "elsewhere"}}})),
    )
    .await
    .unwrap();
    assert!(
        has(&api.get(&name).await.unwrap()),
        "still held before the restart"
    );
    let _agent = agent(&server, &t.gateway, "gw-test", "peerwall.io/target=gateway");
    eventually(
        "the stale finalizer released",
        Duration::from_secs(30),
        || async { (!has(&api.get(&name).await.ok()?)).then_some(()) },
    )
    .await;
    assert!(
        has(&api.get("kept").await.unwrap()),
        "the selected one stays held"
    );
    // And its deletion completes.
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the object to be gone", Duration::from_secs(20), || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
}
