//! A NetworkPolicy label change through the real API server (`cargo xtask bench-netpol`, after
//! the in-process benchmark; root).
//!
//! etcd + kube-apiserver v1.20 on loopback, peerwall's CRDs, a Liqo peer whose consumer
//! offloaded `PEERWALL_BENCH_NP_PODS` pods (default 10 000) into 100 namespaces, labelled and
//! with a named port as `bench-netpol`'s cluster, and `PEERWALL_BENCH_NP_POLICIES`
//! NetworkPolicies (default 1000) over them: every pod is isolated, reachable only from pods
//! of this cluster, never from the peer's tunnel. `peerwall controller` derives the peer's
//! gateway configuration and NetworkPolicy tier, `peerwall agent --source kube --netns GW`
//! enforces both in a gateway namespace, and a UDP probe stream from behind the tunnel
//! (`control/probe.rs`) is stamped at the receiver, on the clock of the API calls.
//!
//! For each backend, `PEERWALL_BENCH_SAMPLES` times (default 40), one pod at a time:
//! - **open**: the pod relabelled so that no policy selects it (a label patch) → the first
//!   probe packet reaching it: API server → controller (its index by difference, the tier) →
//!   the tier's FirewallConfiguration → agent → kernel;
//! - **close**: the label put back → the last packet that reached it.
//!
//! Beside the samples, the API server's floor (a write seen by a watch, `control/floor.rs`):
//! a change crosses two such hops (the pod to the controller, the tier to the agent).
//!
//! Writes the `netpol-api` section of docs/bench.md, when both backends
//! (`PEERWALL_BENCH_BACKENDS`) and both budgets (`PEERWALL_BENCH_BUDGETS`: `whole`,
//! `default`) were measured.

#[path = "../control/agent.rs"]
#[allow(dead_code)]
mod agent;
#[path = "../control/cluster.rs"]
#[allow(dead_code)]
mod cluster;
#[path = "../doc/mod.rs"]
mod doc;
#[path = "../control/floor.rs"]
// The full slice's floor is a row of bench-control's table; this bench writes no slice.
#[allow(dead_code)]
mod floor;
#[path = "../control/probe.rs"]
#[allow(dead_code)]
mod probe;
#[path = "../shared/published.rs"]
#[allow(dead_code)]
mod published;
#[path = "../shared/stats.rs"]
mod stats;
#[path = "../shared/tenant.rs"]
mod tenant;
#[path = "../shared/topology.rs"]
mod topology;

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

/// Namespaces of the cluster (as `bench-netpol`'s).
const NAMESPACES: usize = 100;

use stats::{env_usize, ms, percentile};

fn ns_name(n: usize) -> String {
    format!("np{n}")
}

/// Pod `i`'s namespace and app label: what the policies of that namespace select.
fn app_of(i: usize) -> String {
    format!("a{}", i % 50)
}

/// The namespaces, each offloaded by the peer (its pods are the peer's, reachable through
/// its tunnel where no policy isolates them) and labelled `team`.
async fn namespaces(client: &Client) {
    let api: Api<Namespace> = Api::all(client.clone());
    for n in 0..NAMESPACES {
        let body = json!({"metadata": {"name": ns_name(n), "labels": {
            "liqo.io/remote-cluster-id": cluster::PEER, "team": format!("t{}", n % 10)}}});
        api.create(
            &PostParams::default(),
            &serde_json::from_value(body).expect("namespace"),
        )
        .await
        .expect("namespace");
    }
}

/// Pod `i`: in `np{i % 100}`, labelled `app`, `tier`, with a container port `http` 8080,
/// Running at its address.
async fn pod(client: &Client, i: usize) {
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns_name(i % NAMESPACES));
    let body = json!({
        "metadata": {"name": format!("p{i}"), "labels": {"app": app_of(i), "tier": format!("x{}", i % 7)}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x",
            "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]}]},
    });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(body).expect("pod"),
    )
    .await
    .expect("create pod");
    let ip = cluster::pod_ip(i as u32).to_string();
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    api.patch_status(
        &format!("p{i}"),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .expect("pod status");
}

/// Policy `j` (as `bench-netpol`'s): in `np{j % 100}`, selects `app: a{j % 50}` and takes
/// its port `http` from `tier: x{j % 7}` pods of the namespaces of `team: t{j % 10}`.
async fn policy(client: &Client, j: usize) {
    let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns_name(j % NAMESPACES));
    let body = json!({
        "metadata": {"name": format!("np{j}")},
        "spec": {"podSelector": {"matchLabels": {"app": format!("a{}", j % 50)}},
            "ingress": [{"from": [{
                "namespaceSelector": {"matchLabels": {"team": format!("t{}", j % 10)}},
                "podSelector": {"matchLabels": {"tier": format!("x{}", j % 7)}}}],
                "ports": [{"protocol": "TCP", "port": "http"}]}]},
    });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(body).expect("policy"),
    )
    .await
    .expect("create policy");
}

/// Set pod `i`'s `app` label to `app`; when the patch was sent.
async fn relabel(client: &Client, i: usize, app: &str) -> Instant {
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns_name(i % NAMESPACES));
    let at = Instant::now();
    api.patch(
        &format!("p{i}"),
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": app}}})),
    )
    .await
    .expect("relabel");
    at
}

struct Row {
    backend: &'static str,
    /// The controller's `--inline-budget-bytes`.
    budget: usize,
    open: Vec<Duration>,
    close: Vec<Duration>,
    floor: Vec<Duration>,
    agent_rss: f64,
}

/// Wait until `ip` is reached (true) or `limit` passes.
async fn reached(gw: &probe::Gateway, ip: std::net::Ipv4Addr, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if gw.arrival(ip).is_some() {
            return true;
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    false
}

async fn measure(
    client: &Client,
    server: &cluster::ApiServer,
    backend: &'static str,
    pods: usize,
    round: usize,
) -> Row {
    let gw = probe::Gateway::new();
    let pins = format!("/sys/fs/bpf/pwnpapi{}", std::process::id());
    let mut agent = agent::start_agent(server, &gw, backend, &pins, &format!("agent-{backend}"));
    tokio::task::block_in_place(|| agent::wait_ready(&mut agent, Duration::from_secs(180)));
    // The policies hold: an isolated pod is not reached from the tunnel.
    let first = round * 1000 + 1;
    let isolated = cluster::pod_ip(first as u32);
    gw.probe(&[isolated]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        gw.arrival(isolated).is_none(),
        "{backend}: a pod the policies isolate is reached from the tunnel"
    );
    let mut floor_probe = floor::Floor::start(client).await;
    let mut floor = Vec::new();
    for _ in 0..10 {
        floor.push(floor_probe.write_seen().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let samples = env_usize("PEERWALL_BENCH_SAMPLES", 40);
    let (mut open, mut close) = (Vec::new(), Vec::new());
    // The first sample only shows the whole path in force (the controller's first passes may
    // still be settling): not counted.
    for k in 0..=samples {
        // A different pod each time, spread over namespaces, never one sampled before.
        let i = (first + k * 101) % pods;
        let ip = cluster::pod_ip(i as u32);
        gw.probe(&[ip]);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            gw.arrival(ip).is_none(),
            "{backend}: pod {ip} reached before its relabel"
        );
        let t0 = relabel(client, i, "unselected").await;
        if std::env::var("PEERWALL_BENCH_LOGS").is_ok() {
            println!(
                "RELABEL open {ip} sent by {}",
                chrono::Utc::now().format("%H:%M:%S%.3f")
            );
        }
        assert!(
            reached(&gw, ip, Duration::from_secs(20)).await,
            "{backend}: pod {ip} never reached once no policy selects it"
        );
        let (first_at, _) = gw.arrival(ip).expect("reached");
        if std::env::var("PEERWALL_BENCH_LOGS").is_ok() {
            println!(
                "OPEN after {} ms",
                ms(first_at.saturating_duration_since(t0))
            );
        }
        if k > 0 {
            open.push(first_at.saturating_duration_since(t0));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t1 = relabel(client, i, &app_of(i)).await;
        if std::env::var("PEERWALL_BENCH_LOGS").is_ok() {
            println!(
                "RELABEL close {ip} sent by {}",
                chrono::Utc::now().format("%H:%M:%S%.3f")
            );
        }
        // Closed once packets stop arriving: the last one marks when.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (_, last) = gw.arrival(ip).expect("reached");
            if last.elapsed() >= Duration::from_millis(300) {
                if k > 0 {
                    close.push(last.saturating_duration_since(t1));
                }
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{backend}: pod {ip} still reached after the policies select it again"
            );
        }
    }
    gw.probe(&[]);
    for _ in 0..10 {
        floor.push(floor_probe.write_seen().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(floor_probe);
    println!(
        "{backend}: open p50 {} p99 {} ms; close p50 {} p99 {} ms; floor p50 {} ms",
        ms(percentile(&open, 0.5)),
        ms(percentile(&open, 0.99)),
        ms(percentile(&close, 0.5)),
        ms(percentile(&close, 0.99)),
        ms(percentile(&floor, 0.5)),
    );
    let agent_rss = agent.proc.peak_rss_mib();
    if std::env::var("PEERWALL_BENCH_LOGS").is_ok() {
        let l = agent.proc.log();
        let lines: Vec<&str> = l.lines().collect();
        for x in &lines[lines.len().saturating_sub(60)..] {
            println!("AGENT {x}");
        }
    }
    drop(agent);
    let _ = peerwall_backend_select::installed::forget_pins(std::path::Path::new(&pins));
    Row {
        backend,
        budget: 0,
        open,
        close,
        floor,
        agent_rss,
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "meets"
    } else {
        "misses"
    }
}

fn report(pods: usize, policies: usize, controller_rss: f64, rows: &[Row], write: bool) {
    let (whole, small) = (
        peerwall::protection::spill::WHOLE_OBJECT_BUDGET,
        peerwall::protection::spill::INLINE_BUDGET,
    );
    let mut md = format!(
        "## A NetworkPolicy label change through the API server (`cargo xtask bench-netpol`)\n\n\
         Real etcd + kube-apiserver v1.20 on loopback, {pods} pods a peer offloaded into 100 \
         namespaces and {policies} NetworkPolicies over them (the cluster of the table above: \
         every pod isolated, reachable from pods of this cluster only, never from the peer's \
         tunnel), `peerwall controller` deriving the peer's gateway configuration and \
         NetworkPolicy tier, one agent (`--source kube --netns`) enforcing both; a UDP probe \
         stream from behind the tunnel, stamped at the receiver. *Open*: a pod relabelled so \
         that no policy selects it → the first probe packet reaching it. *Close*: the label \
         put back → the last packet that reached it. Each crosses the API server twice (the \
         pod to the controller, the tier to the agent); *floor*: one write seen by a watch on \
         this machine, measured beside the samples. Two controllers in turn: with `--inline-budget-bytes \
         {whole}` (two thirds of etcd's request limit, the default before: the tier's sets \
         inline, so a label change rewrites the whole tier), and as deployed, the default \
         {small} (the sets of pods in AddressSets: a label change writes the slice holding \
         the pod). \
         Controller peak RSS {controller_rss:.0} MiB.\n\n\
         | backend | controller's `--inline-budget-bytes` | open p50 (ms) | open p99 (ms) | close p50 (ms) | close p99 (ms) | floor p50 (ms) | samples | agent peak RSS (MiB) | p50 ≤ 50 ms, p99 ≤ 200 ms |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    );
    for r in rows {
        let p50 = percentile(&r.open, 0.5).max(percentile(&r.close, 0.5));
        let p99 = percentile(&r.open, 0.99).max(percentile(&r.close, 0.99));
        md.push_str(&format!(
            "| {} | {}{} | {} | {} | {} | {} | {} | {} | {:.0} | {} |\n",
            r.backend,
            r.budget,
            if r.budget == peerwall::protection::spill::INLINE_BUDGET {
                " (default)"
            } else {
                ""
            },
            ms(percentile(&r.open, 0.5)),
            ms(percentile(&r.open, 0.99)),
            ms(percentile(&r.close, 0.5)),
            ms(percentile(&r.close, 0.99)),
            ms(percentile(&r.floor, 0.5)),
            r.open.len(),
            r.agent_rss,
            verdict(p50 <= Duration::from_millis(50) && p99 <= Duration::from_millis(200)),
        ));
    }
    println!("{md}");
    if write {
        match doc::write_section("netpol-api", &md) {
            Ok(p) => println!("wrote {}", p.display()),
            Err(e) => eprintln!("could not write docs/bench.md: {e}"),
        }
    }
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "the NetworkPolicy benchmark needs root (network namespaces)"
    );
    let pods = env_usize("PEERWALL_BENCH_NP_PODS", 10_000);
    let policies = env_usize("PEERWALL_BENCH_NP_POLICIES", 1_000);
    let backends = agent::backends();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = cluster::api_server();
        let client = cluster::client(&server).await;
        cluster::peering(&client).await;
        namespaces(&client).await;
        let t0 = Instant::now();
        futures::stream::iter(0..pods)
            .map(|i| pod(&client, i))
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await;
        futures::stream::iter(0..policies)
            .map(|j| policy(&client, j))
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await;
        println!(
            "{pods} pods and {policies} NetworkPolicies created in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        let mut rows = Vec::new();
        let mut controller_rss: f64 = 0.0;
        let mut round = 0;
        // With the budget that keeps the tier's sets inline up to etcd's bound (a label change
        // rewrites the whole tier), then as deployed (the sets of pods in AddressSets: a label
        // change writes the slice holding the pod).
        let budgets = budgets();
        for &budget in &budgets {
            let cmetrics = format!("127.0.0.1:{}", agent::free_port());
            let started = Instant::now();
            let budget_arg = budget.to_string();
            let controller = server.peerwall_logging(
                &format!("controller-{budget}"),
                &[
                    "controller",
                    "--metrics-addr",
                    &cmetrics,
                    "--inline-budget-bytes",
                    &budget_arg,
                ],
                "info,kube=warn,peerwall_kube::controller=debug",
            );
            let configs: Api<kube::api::DynamicObject> = Api::namespaced_with(
                client.clone(),
                cluster::TENANT,
                &peerwall::k8s::fwc_resource(),
            );
            while configs
                .get_opt(peerwall::netpol::tier::TIER_CONFIG)
                .await
                .ok()
                .flatten()
                .is_none()
            {
                assert!(
                    started.elapsed() < Duration::from_secs(600),
                    "the controller did not publish the NetworkPolicy tier"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            println!(
                "controller (--inline-budget-bytes {budget}): the NetworkPolicy tier published {:.2} s after start",
                started.elapsed().as_secs_f64()
            );
            for b in &backends {
                let mut row = measure(&client, &server, b, pods, round).await;
                row.budget = budget;
                rows.push(row);
                round += 1;
            }
            controller_rss = controller_rss.max(controller.peak_rss_mib());
            if std::env::var("PEERWALL_BENCH_LOGS").is_ok() {
                let l = controller.log();
                let lines: Vec<&str> = l.lines().collect();
                for x in &lines[lines.len().saturating_sub(60)..] {
                    println!("CTRL {x}");
                }
            }
            drop(controller);
        }
        report(
            pods,
            policies,
            controller_rss,
            &rows,
            backends.len() == 2 && budgets.len() == 2,
        );
    });
}

/// The controllers' `--inline-budget-bytes` measured in turn (`PEERWALL_BENCH_BUDGETS`:
/// `whole`, `default` or both, the default): only a run of both writes docs/bench.md.
fn budgets() -> Vec<usize> {
    let wanted = std::env::var("PEERWALL_BENCH_BUDGETS").unwrap_or_else(|_| "whole,default".into());
    wanted
        .split(',')
        .filter_map(|b| match b.trim() {
            "whole" => Some(peerwall::protection::spill::WHOLE_OBJECT_BUDGET),
            "default" => Some(peerwall::protection::spill::INLINE_BUDGET),
            _ => None,
        })
        .collect()
}
