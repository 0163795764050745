//! `peerwall agent --source kube` in a gateway namespace, both backends.

use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;

use crate::common::*;
use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_enforces_through_the_bpf_backend_in_a_gateway_namespace() {
    let t = Topology::new();
    let pins = BpfPins {
        dir: format!("/sys/fs/bpf/peerwall-kube-test-{}", std::process::id()),
        ns: t.gateway.name().to_string(),
    };
    let server = api_server();
    let client = server.client().await;
    install_crd(&client).await;
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
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
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
    assert!(
        nft_tables(&t.gateway).trim().is_empty(),
        "no nftables involved"
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
    install_crd(&client).await;
    let _agent = agent(&server, &t.gateway, "gw-test", "peerwall.io/target=gateway");
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
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
