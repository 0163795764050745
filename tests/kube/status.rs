//! `peerwall status` against the API server: what the agents wrote, read back per peer.

use std::time::Duration;

use kube::api::{DynamicObject, PostParams};
use kube::ResourceExt;
use serde_json::json;

use crate::support::*;
use peerwall_testkit::prelude::*;

/// `peerwall status --output json` (exit status, parsed peers).
pub(crate) fn status(server: &ApiServer) -> (bool, serde_json::Value) {
    let (code, v) = status_json(server);
    (code == Some(0), v["peers"].clone())
}

/// `peerwall status --output json` (exit code, the whole output: components and peers).
fn status_json(server: &ApiServer) -> (Option<i32>, serde_json::Value) {
    let o = std::process::Command::new(peerwall())
        .args(["status", "--output", "json", "--minutes", "5"])
        .env("KUBECONFIG", &server.kubeconfig)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "status output: {e}\n{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    (o.status.code(), v)
}

/// `peerwall status` as text (exit code, stdout).
fn status_text(server: &ApiServer) -> (Option<i32>, String) {
    let o = std::process::Command::new(peerwall())
        .args(["status"])
        .env("KUBECONFIG", &server.kubeconfig)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

/// The health `peerwall status` gave the component `name`.
fn health_of(v: &serde_json::Value, name: &str) -> String {
    v["components"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .map(|c| c["health"].as_str().unwrap_or_default().to_string())
        .unwrap_or_else(|| panic!("no component {name} in {v}"))
}

/// The user's report, on a real API server: `deploy/` applied as shipped, nothing running it
/// (no node, and no workload controller: the DaemonSet schedules no pod, the Deployments have
/// no ready replica, the webhook never wrote its CA). `status` says each of those, names no peer,
/// and exits 3 (a finding, not "could not ask": 1). Before the install, every part is
/// missing; with a bad kubeconfig context, it could not ask at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_what_of_a_half_installed_cluster_does_not_run() {
    let server = api_server();
    let (code, before) = status_json(&server);
    assert_eq!(code, Some(3), "{before}");
    assert_eq!(health_of(&before, "agents"), "error", "{before}");
    assert_eq!(health_of(&before, "peerwall-controller"), "error");
    assert_eq!(health_of(&before, "crd FirewallConfiguration"), "error");
    crate::deploy::kubectl(
        &server,
        &["apply", "-k", &repo("deploy").to_string_lossy()],
        None,
    );
    // This controller-manager runs no workload controllers: no pod exists, as where nothing
    // can run them.
    let (_, v) = status_json(&server);
    let (code, _) = status_json(&server);
    assert_eq!(code, Some(3), "{v}");
    for (name, health) in [
        ("agents", "error"),
        ("peerwall-controller", "error"),
        ("peerwall-webhook", "error"),
        ("webhook registration", "error"),
        ("crd FirewallConfiguration", "ok"),
        ("crd AddressSet", "ok"),
        ("crd ProtectionPolicy", "ok"),
    ] {
        assert_eq!(health_of(&v, name), health, "{name}: {v}");
    }
    assert_eq!(v["peers"], json!([]), "{v}");
    let (code, text) = status_text(&server);
    for said in [
        "0/0: no agent pods",
        "0/1 ready",
        "0/2 ready",
        "no caBundle",
        "no Liqo tenant namespace",
    ] {
        assert!(text.contains(said), "{said:?} not in:\n{text}");
    }
    assert_eq!(code, Some(3));
    // The same binary as a kubectl plugin: `kubectl peerwall status`.
    let plugins = server.dir.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::os::unix::fs::symlink(peerwall(), plugins.join("kubectl-peerwall")).unwrap();
    let path = format!(
        "{}:{}",
        plugins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = std::process::Command::new(kube_bin_dir().join("kubectl"))
        .args(["peerwall", "status"])
        .env("KUBECONFIG", &server.kubeconfig)
        .env("PATH", path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("0/0: no agent pods"),
        "kubectl peerwall status: {text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(3));
    // --kubeconfig and --context as kubectl's: a context the file lacks cannot ask (1).
    let o = std::process::Command::new(peerwall())
        .args(["status", "--kubeconfig"])
        .arg(&server.kubeconfig)
        .args(["--context", "no-such-context"])
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no-such-context"), "{err}");
    let o = std::process::Command::new(peerwall())
        .args(["status", "--kubeconfig"])
        .arg(&server.kubeconfig)
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
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
    server.install_crds();
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
    // `kubectl get` says where each configuration is and how it stands (the CRD's printer
    // columns, as deploy/common/crd.yaml ships them).
    let got = crate::deploy::kubectl(
        &server,
        &["get", "pwfc", "-n", "liqo-tenant-cluster1"],
        None,
    );
    let header: Vec<&str> = got
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "PEER",
            "TARGET",
            "AUDIT",
            "GENERATION",
            "HOST",
            "STATE",
            "AGE"
        ],
        "{got}"
    );
    // AUDIT is blank: the field is left out when off.
    let line = got.lines().nth(1).unwrap_or_default();
    let row: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        row[..6],
        [
            name.as_str(),
            "cluster1",
            "gateway",
            "1",
            "gw-status",
            "Applied"
        ],
        "{got}"
    );
    // The agent runs outside Kubernetes here (no DaemonSet): named, a warning.
    let (_, all) = status_json(&server);
    assert_eq!(health_of(&all, "agents"), "warning", "{all}");
    let other = rows.iter().find(|r| r["peer"] == "other").unwrap();
    assert_eq!(other["enforced"], false);
    assert_eq!(other["configurations"], json!([]));
    // The text table says the same.
    let (_, text) = status_text(&server);
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
