//! The API server stopped and started under a running agent: enforcement never stops (the last
//! good policy stays in force), the agent reports not ready while the API server is away,
//! reconnects by itself and resyncs a change made meanwhile.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;

use crate::support::*;
use peerwall_testkit::prelude::*;

/// The agent's `/readyz` and `/metrics`, at the address its log names.
fn agent_get(agent: &Proc, path: &str) -> (u16, String) {
    let log = agent.log();
    let Some(addr) = log
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics="))
        .map(|a| a.trim_matches('"').to_string())
    else {
        return (0, String::new());
    };
    let o = Command::new("curl")
        .args([
            "-s",
            "-m",
            "2",
            "-w",
            "\n%{http_code}",
            &format!("http://{addr}{path}"),
        ])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Stop the API server (SIGKILL, as a crash would) and return its command line.
fn stop_apiserver(server: &ApiServer) -> Vec<String> {
    let pid: i32 = std::fs::read_to_string(server.dir.join("apiserver.pid"))
        .expect("apiserver.pid")
        .trim()
        .parse()
        .expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    // SAFETY: kill(2) on the API server this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the API server to exit", 10, || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(" Z "))
    });
    args
}

/// Start it again, same flags (same etcd: the objects are still there).
fn start_apiserver(server: &ApiServer, args: &[String]) {
    let log = std::fs::File::create(server.dir.join("apiserver-2.log")).expect("log");
    let child = Command::new(&args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("kube-apiserver");
    std::fs::write(server.dir.join("apiserver.pid"), child.id().to_string()).expect("pid");
    std::mem::forget(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_keeps_enforcing_through_an_api_server_outage_and_resyncs() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let agent = agent(
        &server,
        &t.gateway,
        "gw-outage",
        "peerwall.io/target=gateway",
    );
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: kube::api::DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, "gw-outage").await;
    assert_thesis_block_enforced(&t.consumer);
    wait_until("the agent ready", 20, || {
        agent_get(&agent, "/readyz").0 == 200
    });

    // The API server goes away.
    let args = stop_apiserver(&server);
    let down = Instant::now();
    wait_until("the agent to report not ready", 30, || {
        agent_get(&agent, "/readyz").0 == 503
    });
    let (_, m) = agent_get(&agent, "/metrics");
    assert!(
        m.lines()
            .any(|l| l.starts_with("peerwall_source_connected") && l.ends_with(" 0")),
        "{m}"
    );
    // Meanwhile the last good policy stays in force, and keeps doing so.
    while down.elapsed() < Duration::from_secs(5) {
        assert_thesis_block_enforced(&t.consumer);
    }
    assert!(
        agent.log().contains("watch error"),
        "the agent did not notice:\n{}",
        agent.log()
    );

    // Back: the agent reconnects by itself, reports ready, and applies a change made right
    // after the API server returned (block pod3 instead of pod2).
    start_apiserver(&server, &args);
    let client = server.client().await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let started = Instant::now();
    while api.get(&name).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the API server did not come back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Enforcement never stopped while the agent was reconnecting.
    assert_thesis_block_enforced(&t.consumer);
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"table": {"chains": [{
            "name": "filter_chain_name", "hook": "forward", "policy": "accept", "priority": 0,
            "type": "filter", "rules": {"filterRules": [{"name": "drop_traffic", "counter": true,
            "action": "drop", "match": [
                {"op": "eq", "ip": {"value": "10.10.1.67", "position": "src"}},
                {"op": "eq", "ip": {"value": "10.20.1.3", "position": "dst"}}]}]}}]}}})),
    )
    .await
    .unwrap();
    // The agent's watches retry with kube-runtime's default backoff (800 ms doubling, jittered,
    // up to 30 s): after an outage of 5 s and more plus the server's restart, the next try may
    // come most of 30 s after the server is back. Bounded by that, not by `applied`'s 20 s.
    applied_within(&api, &name, "gw-outage", Duration::from_secs(45)).await;
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "pod2 open again"
    );
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.3"),
        "pod3 now blocked"
    );
    wait_until("the agent ready again", 30, || {
        agent_get(&agent, "/readyz").0 == 200
    });
    let (_, m) = agent_get(&agent, "/metrics");
    assert!(
        m.lines()
            .any(|l| l.starts_with("peerwall_source_connected") && l.ends_with(" 1")),
        "{m}"
    );
}

/// Every slice of a tenant: name → (generation, addresses).
async fn slice_versions(
    client: &kube::Client,
    tenant: &str,
) -> std::collections::BTreeMap<String, (i64, std::collections::BTreeSet<String>)> {
    slice_api(client, tenant)
        .list(&Default::default())
        .await
        .expect("list slices")
        .items
        .into_iter()
        .map(|s| {
            let g = s.metadata.generation.unwrap_or_default();
            let a = slice_addresses(&s, "offloaded");
            (s.name_any(), (g, a))
        })
        .collect()
}

/// The controller through an API server outage: nothing it published is rewritten while its
/// watches come back (a cold or relisting cache never empties a set), and a change made
/// afterwards is published without any version of any slice losing an address that stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_never_empties_a_set_through_an_api_server_outage() {
    use futures::StreamExt;
    use kube::runtime::watcher;
    use std::sync::{Arc, Mutex};

    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let metrics = format!("127.0.0.1:{}", free_port());
    let controller = server.peerwall("controller", &["controller", "--metrics-addr", &metrics]);
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    for (name, ip) in [
        ("web", "10.200.0.5"),
        ("db", "10.200.0.6"),
        ("cache", "10.200.0.7"),
    ] {
        pod(&client, "app-a", name, ip, json!({}), None).await;
    }
    let want = ips(&["10.200.0.5", "10.200.0.6", "10.200.0.7"]);
    eventually("the offloaded set", Duration::from_secs(30), || async {
        gateway_set(&client, "liqo-tenant-a", "offloaded")
            .await
            .filter(|s| *s == want)
    })
    .await;
    let before = slice_versions(&client, "liqo-tenant-a").await;

    // The API server goes away for a while; the controller's watches fail and retry.
    let args = stop_apiserver(&server);
    let down = Instant::now();
    wait_until("the controller to notice", 30, || {
        controller.log().contains("watch error")
    });
    while down.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(200));
    }
    start_apiserver(&server, &args);
    let client = server.client().await;
    let started = Instant::now();
    while slice_api(&client, "liqo-tenant-a")
        .list(&Default::default())
        .await
        .is_err()
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the API server did not come back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // From here, every version of every slice is recorded.
    type Versions = Vec<(String, std::collections::BTreeSet<String>)>;
    let seen: Arc<Mutex<Versions>> = Arc::default();
    let (listed_tx, mut listed) = tokio::sync::watch::channel(false);
    let watch = {
        let (api, seen) = (slice_api(&client, "liqo-tenant-a"), seen.clone());
        tokio::spawn(async move {
            let mut s = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = s.next().await {
                match ev {
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                        let a = slice_addresses(&o, "offloaded");
                        seen.lock().unwrap().push((o.name_any(), a));
                    }
                    Ok(watcher::Event::InitDone) => {
                        let _ = listed_tx.send(true);
                    }
                    _ => {}
                }
            }
        })
    };
    listed.wait_for(|l| *l).await.unwrap();
    // Let the controller reconnect, relist and reconcile (its watches back off up to seconds).
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        slice_versions(&client, "liqo-tenant-a").await,
        before,
        "the controller rewrote its slices after the outage though nothing changed"
    );

    // A change after the outage: db goes, api comes.
    delete_pod(&client, "app-a", "db").await;
    pod(&client, "app-a", "api", "10.200.0.8", json!({}), None).await;
    let want = ips(&["10.200.0.5", "10.200.0.7", "10.200.0.8"]);
    eventually("the change published", Duration::from_secs(30), || async {
        gateway_set(&client, "liqo-tenant-a", "offloaded")
            .await
            .filter(|s| *s == want)
    })
    .await;
    watch.abort();
    // No version of the slice holding web and cache ever lost them.
    let versions = seen.lock().unwrap().clone();
    let stays = ips(&["10.200.0.5", "10.200.0.7"]);
    let holders: std::collections::BTreeSet<&String> = versions
        .iter()
        .filter(|(_, a)| a.iter().any(|x| stays.contains(x)))
        .map(|(n, _)| n)
        .collect();
    for (name, a) in &versions {
        if holders.contains(name) {
            for ip in &stays {
                let held_before = before.get(name).is_some_and(|(_, b)| b.contains(ip));
                assert!(
                    !held_before || a.contains(ip),
                    "{name} lost {ip} in a version: {a:?}"
                );
            }
        }
    }
    assert!(versions.len() > before.len(), "the watch saw the change");
}
