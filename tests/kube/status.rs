//! `peerwall status` against the API server: what the agents wrote, read back per peer.

use std::time::Duration;

use kube::api::{DynamicObject, PostParams};
use kube::ResourceExt;
use serde_json::json;

use crate::common::*;
use crate::support::*;

/// `peerwall status --output json` (exit status, parsed rows).
pub(crate) fn status(server: &ApiServer) -> (bool, serde_json::Value) {
    let o = std::process::Command::new(peerwall())
        .args(["status", "--output", "json", "--minutes", "5"])
        .env("KUBECONFIG", &server.kubeconfig)
        .output()
        .unwrap();
    let rows = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "status output: {e}\n{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    (o.status.success(), rows)
}

/// Peer cluster1's gateway configuration enforced by an agent with events: `status` says it is
/// enforced on that host with its backend and generation, and counts the packets its rule
/// dropped; peer other has a tenant namespace but no configuration, so `status` says so and
/// exits non-zero. An invalid edit shows up as the last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_each_peers_protection() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    install_crd(&client).await;
    let _agent = agent_with(
        &server,
        &t.gateway,
        "gw-status",
        "peerwall.io/target=gateway",
        &["--events", "--drop-summary-secs", "1"],
    );
    tenant_namespace(&client, "cluster1").await;
    tenant_namespace(&client, "other").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, "gw-status").await;
    // One denied ping. Its drop reaches the status exactly once, whenever the kernel delivers
    // its event (the agent summarizes events as they arrive, every second here), and the
    // rule's own counter agrees.
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    let cluster1 = |rows: &serde_json::Value| {
        rows.as_array()?
            .iter()
            .find(|r| r["peer"] == "cluster1")
            .cloned()
    };
    let rows = eventually(
        "the drop in the status",
        Duration::from_secs(30),
        || async {
            let (ok, rows) = status(&server);
            assert!(!ok, "a peer without configuration: non-zero exit");
            (cluster1(&rows)?["drops"].as_u64()? > 0).then_some(rows)
        },
    )
    .await;
    let counter = || {
        let o = in_ns(
            &t.gateway,
            "nft",
            &["list", "chain", "ip", "table_name", "filter_chain_name"],
        );
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(counter().contains("counter packets 1 "), "{}", counter());
    assert_eq!(cluster1(&rows).unwrap()["drops"], 1, "{rows}");
    // Two more at once (two flows): a summary of two packets, whose Event is not folded into
    // the first one's series (that would count 1 × 2).
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2")));
        }
    });
    let rows = eventually(
        "three drops in the status",
        Duration::from_secs(30),
        || async {
            let (_, rows) = status(&server);
            (cluster1(&rows)?["drops"].as_u64()? >= 3).then_some(rows)
        },
    )
    .await;
    assert!(counter().contains("counter packets 3 "), "{}", counter());
    // Three more summary periods: still three, none summarized twice.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for rows in [&rows, &status(&server).1] {
        assert_eq!(cluster1(rows).unwrap()["drops"], 3, "{rows}");
    }
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let a = rows.iter().find(|r| r["peer"] == "cluster1").unwrap();
    assert_eq!(a["enforced"], true, "{a}");
    assert_eq!(a["namespace"], "liqo-tenant-cluster1");
    assert_eq!(a["audit"], false);
    assert_eq!(
        a["hosts"],
        json!([{"host": "gw-status", "backend": "nftables", "state": "Applied", "current": true, "message": null}])
    );
    assert_eq!(a["generation"], 1);
    let other = rows.iter().find(|r| r["peer"] == "other").unwrap();
    assert_eq!(other["enforced"], false);
    assert_eq!(other["configurations"], json!([]));
    // The text table says the same.
    let o = std::process::Command::new(peerwall())
        .args(["status"])
        .env("KUBECONFIG", &server.kubeconfig)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("gw-status (nftables)") && text.contains("no configuration"),
        "{text}"
    );
    // An invalid edit: the host errs, the last good spec stays, status shows the error.
    let mut bad = api.get(&name).await.unwrap();
    bad.data["spec"]["table"]["chains"][0]["rules"]["filterRules"][0]["match"][1]["ip"]["value"] =
        json!("10.20.1.300");
    api.replace(&name, &PostParams::default(), &bad)
        .await
        .unwrap();
    eventually(
        "the error in the status",
        Duration::from_secs(30),
        || async {
            let (_, rows) = status(&server);
            let a = rows
                .as_array()?
                .iter()
                .find(|r| r["peer"] == "cluster1")?
                .clone();
            (a["enforced"] == false && a["last_error"].as_str()?.contains("10.20.1.300"))
                .then_some(())
        },
    )
    .await;
}
