//! The control plane at scale, through the real API server (`cargo xtask bench-control`, root).
//!
//! etcd + kube-apiserver v1.20 on loopback, peerwall's CRDs, a Liqo tenant whose consumer
//! offloaded `PEERWALL_BENCH_PODS` pods (default 100 000) with addresses; `peerwall controller`
//! publishes them as AddressSet slices, and `peerwall agent --source kube --netns GW` enforces
//! the peer's gateway configuration in a gateway namespace (`liqo-tunnel` in, `liqo.bench00`
//! out). Probes are UDP streams from behind the tunnel that carry their destination; the
//! receiver stamps the first and last packet reaching each pod address, on the same clock as
//! the API calls. Each backend has its own gateway namespace and pins, kept through the run.
//! - **one pod**: a pod gets its address (status update) → the first probe packet reaches it,
//!   through API server + controller + agent (`PEERWALL_BENCH_SAMPLES`, default 40, per
//!   backend), every backend's samples before any churn, in alternating blocks
//!   (`PEERWALL_BENCH_BLOCKS`, default 4), one agent at a time ([`one_pod`]);
//!
//! then for each backend:
//! - **churn**: 1000 pods in 10 s (500 offloaded, 500 deleted, interleaved): every new pod
//!   reached, and no packet reaches a deleted pod after this agent reported the slice without
//!   it applied (status `Applied` at that generation, seen by a watch);
//! - **restart**: the agent restarted → `/readyz` (its first full sync in force);
//! - peak RSS of the agent and of the controller.
//!
//! `PEERWALL_BENCH_LOGS=<dir>` keeps the controller's log there (`controller.log`: each pass's
//! laps at debug; at trace, when a pod's change arrived, its slices pass started, its slices
//! were planned and each was applied, with its size and the apply's round trip), to read
//! where the controller's part went.
//!
//! Writes the `control` section of docs/bench.md.

#[path = "../doc/mod.rs"]
mod doc;

mod agent;
mod cluster;
mod floor;
mod one_pod;
mod probe;
#[path = "../shared/published.rs"]
mod published;
mod report;
#[path = "../shared/stats.rs"]
mod stats;
#[path = "../shared/tenant.rs"]
mod tenant;
#[path = "../shared/topology.rs"]
mod topology;
mod trace;

use std::collections::{BTreeMap, BTreeSet};

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::runtime::watcher;
use kube::Client;

use agent::{free_port, wait_ready, Agent};
use cluster::{pod_ip, ApiServer};
use probe::Gateway;

use stats::{env_usize, ms, percentile};

/// A version of a slice as the watch saw it, and when.
#[derive(Clone, Debug)]
pub(crate) struct SliceSeen {
    pub(crate) at: Instant,
    name: String,
    generation: i64,
    pub(crate) addresses: BTreeSet<Ipv4Addr>,
    /// This agent's `Applied` condition: its observed generation.
    applied: Option<i64>,
}

/// Wait until the agent has reported every slice applied at its generation (its first
/// conditions, one status write per slice, are a burst of writes the API server serves
/// before the samples' own), at most `limit`; how long that took.
async fn settle(log: &Mutex<Vec<SliceSeen>>, limit: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let done = log.lock().is_ok_and(|l| {
            let mut latest: BTreeMap<&str, &SliceSeen> = BTreeMap::new();
            for s in l.iter() {
                latest.insert(&s.name, s);
            }
            !latest.is_empty() && latest.values().all(|s| s.applied == Some(s.generation))
        });
        if done || t0.elapsed() >= limit {
            return t0.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Record every version of the tenant's slices; `applied` is the condition of the agent
/// running `backend`. Every backend's agent reports as host `bench`, and a condition names its
/// backend: an agent of the other backend rewrites every slice's condition when it starts, and
/// the samples wait for that ([`settle`]), not for the condition the last agent left.
fn watch_slices(
    client: &Client,
    backend: &'static str,
    log: Arc<Mutex<Vec<SliceSeen>>>,
) -> tokio::task::JoinHandle<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        cluster::TENANT,
        &peerwall::k8s::address_set_resource(),
    );
    tokio::spawn(async move {
        let mut s = watcher(api, watcher::Config::default()).boxed();
        while let Some(ev) = s.next().await {
            let at = Instant::now();
            let o = match ev {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
                _ => continue,
            };
            let applied = o
                .data
                .pointer("/status/conditions")
                .and_then(|c| c.as_array())
                .and_then(|c| {
                    c.iter().find(|c| {
                        c["host"] == "bench" && c["type"] == "Applied" && c["backend"] == backend
                    })
                })
                .and_then(|c| c["observedGeneration"].as_i64());
            let seen = SliceSeen {
                at,
                name: o.metadata.name.clone().unwrap_or_default(),
                generation: o.metadata.generation.unwrap_or_default(),
                addresses: o.data["spec"]["addresses"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.as_str().and_then(|a| a.parse().ok()))
                    .collect(),
                applied,
            };
            if let Ok(mut l) = log.lock() {
                l.push(seen);
            }
        }
    })
}

/// When this agent was first seen reporting `ip`'s removal applied: the first slice version
/// without it (after one with it), then the first version whose `Applied` condition covers
/// that generation.
fn removal_reported(log: &[SliceSeen], ip: Ipv4Addr) -> Option<Instant> {
    let holder = log.iter().rev().find(|s| s.addresses.contains(&ip))?;
    let without = log.iter().find(|s| {
        s.name == holder.name && s.generation > holder.generation && !s.addresses.contains(&ip)
    })?;
    log.iter()
        .find(|s| s.name == holder.name && s.applied.is_some_and(|g| g >= without.generation))
        .map(|s| s.at)
}

struct Row {
    backend: &'static str,
    /// One pod from the directory source.
    dir_one_pod: Vec<Duration>,
    /// Medians of the one-pod samples' parts: controller, agent, after ([`trace`]).
    parts: [Option<Duration>; 3],
    /// The API server's floor beside the samples: a write seen by a watch ([`floor`]).
    floor: Vec<Duration>,
    /// The same for a write of a full slice ([`floor::Floor::block`]).
    slice_floor: Vec<Duration>,
    /// The same for a write of a slice of one address.
    small_floor: Vec<Duration>,
    /// The slowest one-pod samples, split, with the agent's log meanwhile.
    slowest: Vec<String>,
    one_pod: Vec<Duration>,
    /// Each one-pod block's p50, in the order the blocks ran.
    block_p50: Vec<Duration>,
    churn_adds: Vec<Duration>,
    churn_missing: usize,
    removals: usize,
    removals_checked: usize,
    violations: usize,
    restart: Duration,
    first_sync: Duration,
    agent_rss: f64,
}

/// `live`'s churn and restart after every backend's one-pod samples (`one`), into its row.
async fn measure(
    rt_client: &Client,
    server: &ApiServer,
    live: &mut one_pod::Live,
    one: one_pod::OnePod,
    pods: u32,
    next: &mut u32,
    round: u32,
) -> Row {
    let backend = live.backend;
    let (agent, _) = live.start(server);
    // Every slice version from here on: the churn's removals are checked against them.
    let log = Arc::new(Mutex::new(Vec::new()));
    let watch = watch_slices(rt_client, backend, log.clone());
    settle(&log, Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let gw = &live.gw;
    let slowest = trace::slowest(&one.splits, &one.log, 3);
    for s in &slowest {
        println!("{backend}: slow sample: {s}");
    }
    // Churn: 500 new pods and 500 deletions, one every 10 ms.
    let adds: Vec<u32> = (0..500).map(|k| *next + k).collect();
    *next += 500;
    // Pods of the initial population, different ones for every backend.
    let step = (pods - 1) / 500;
    let dels: Vec<u32> = (0..500u32).map(|k| k * step + round % step).collect();
    let all: Vec<Ipv4Addr> = adds.iter().chain(&dels).map(|&i| pod_ip(i)).collect();
    gw.probe(&all);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut started_at: BTreeMap<u32, Instant> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for k in 0..500 {
        tick.tick().await;
        started_at.insert(adds[k], cluster::offload_timed(rt_client, adds[k]).await);
        tick.tick().await;
        cluster::remove(rt_client, dels[k]).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && adds.iter().any(|&i| gw.arrival(pod_ip(i)).is_none()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let the last reports arrive, and any late packet to a deleted pod show up.
    tokio::time::sleep(Duration::from_secs(3)).await;
    gw.probe(&[]);
    watch.abort();
    let mut churn_adds = Vec::new();
    let mut churn_missing = 0;
    for &i in &adds {
        match gw.arrival(pod_ip(i)) {
            Some((first, _)) => churn_adds.push(first.saturating_duration_since(started_at[&i])),
            None => churn_missing += 1,
        }
    }
    let log = log.lock().map(|l| l.clone()).unwrap_or_default();
    let (mut checked, mut violations) = (0, 0);
    for &i in &dels {
        let ip = pod_ip(i);
        if let Some(reported) = removal_reported(&log, ip) {
            checked += 1;
            if gw.arrival(ip).is_some_and(|(_, last)| last > reported) {
                violations += 1;
            }
        }
    }
    println!(
        "{backend}: churn adds p50 {} ms p99 {} ms, {churn_missing} missing; removals checked {checked}/500, {violations} delivered after their removal was reported",
        ms(percentile(&churn_adds, 0.5)),
        ms(percentile(&churn_adds, 0.99))
    );
    live.stop(agent);
    let (again, restart) = live.start(server);
    println!("{backend}: restart in force after {} ms", ms(restart));
    live.stop(again);
    // Pins and their slot metadata under /run (a plain remove_dir_all leaves the latter).
    let _ = peerwall_backend_select::installed::forget_pins(std::path::Path::new(&live.pins));
    println!(
        "{backend}: the API server's floor, a write seen by a watch: p50 {} ms; a full slice's: p50 {} ms; a slice of one address: p50 {} ms",
        ms(percentile(&one.floor, 0.5)),
        ms(percentile(&one.slice_floor, 0.5)),
        ms(percentile(&one.small_floor, 0.5))
    );
    Row {
        backend,
        dir_one_pod: Vec::new(),
        parts: [
            trace::median_of(&one.splits, |s| s.controller),
            trace::median_of(&one.splits, |s| s.agent),
            trace::median_of(&one.splits, |s| s.after),
        ],
        slowest,
        one_pod: one.samples,
        block_p50: one.block_p50,
        floor: one.floor,
        slice_floor: one.slice_floor,
        small_floor: one.small_floor,
        churn_adds,
        churn_missing,
        removals: dels.len(),
        removals_checked: checked,
        violations,
        restart,
        first_sync: live.first_sync,
        agent_rss: live.rss,
    }
}

/// The directory source at the same scale: the controller's configuration and slices as
/// files, one more pod = one slice file rewritten (written aside, renamed in), timed to its
/// first packet.
async fn measure_dir(
    server: &ApiServer,
    backend: &'static str,
    pods: u32,
    next: &mut u32,
) -> Vec<Duration> {
    use peerwall::protection::{self, Options, Peer, PeerSets};
    let gw = Gateway::new();
    let dir = server.dir.join(format!("dir-{backend}"));
    std::fs::create_dir_all(&dir).expect("policy dir");
    let peer = Peer {
        id: cluster::PEER.into(),
        tenant_namespace: cluster::TENANT.into(),
        sources: vec![probe::SENDER_CIDR.parse().expect("CIDR")],
    };
    let opts = Options {
        tunnel: protection::DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: peerwall::protection::LIQO_PING_PORT,
        own_namespace_only: false,
        inline_budget: peerwall_protection::spill::INLINE_BUDGET,
    };
    let write = |name: &str, v: serde_json::Value| {
        let tmp = dir.join(".next.tmp");
        std::fs::write(&tmp, v.to_string()).expect("write");
        std::fs::rename(&tmp, dir.join(format!("{name}.yaml"))).expect("rename");
    };
    write(
        "gateway",
        protection::gateway_object(&peer, &PeerSets::default(), &opts),
    );
    let mut offloaded: BTreeSet<std::net::IpAddr> =
        (0..pods).map(|i| std::net::IpAddr::V4(pod_ip(i))).collect();
    let mut slices = protection::layout("offloaded", &[], &offloaded);
    for s in &slices {
        write(&s.name, protection::address_set_object(&peer, s));
    }
    let pins = format!("/sys/fs/bpf/pwctldir{}", std::process::id());
    let metrics = format!("127.0.0.1:{}", free_port());
    let source = format!("dir:{}", dir.display());
    let proc = server.peerwall(
        &format!("dir-agent-{backend}"),
        &[
            "agent",
            "--source",
            &source,
            "--netns",
            gw.gw.name(),
            "--backend",
            backend,
            "--pin-dir",
            &pins,
            "--metrics-addr",
            &metrics,
            "--interval-ms",
            "200",
        ],
    );
    let mut agent = Agent { proc, metrics };
    tokio::task::block_in_place(|| wait_ready(&mut agent, Duration::from_secs(120)));
    let mut out = Vec::new();
    for _ in 0..env_usize("PEERWALL_BENCH_SAMPLES", 40) {
        let ip = pod_ip(*next);
        *next += 1;
        gw.probe(&[ip]);
        tokio::time::sleep(Duration::from_millis(20)).await;
        offloaded.insert(std::net::IpAddr::V4(ip));
        let changed = protection::layout("offloaded", &slices, &offloaded);
        let tmp = dir.join(".next.tmp");
        let s = &changed[0];
        std::fs::write(&tmp, protection::address_set_object(&peer, s).to_string()).expect("write");
        let t0 = Instant::now();
        std::fs::rename(&tmp, dir.join(format!("{}.yaml", s.name))).expect("rename");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some((first, _)) = gw.arrival(ip) {
                out.push(first.saturating_duration_since(t0));
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pod {ip} never reached from the directory source"
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        for c in changed {
            if let Some(old) = slices.iter_mut().find(|x| x.name == c.name) {
                *old = c;
            } else {
                slices.push(c);
            }
        }
    }
    println!(
        "{backend}: directory source, one pod p50 {} ms, p99 {} ms",
        ms(percentile(&out, 0.5)),
        ms(percentile(&out, 0.99))
    );
    drop(agent);
    // Pins and their slot metadata under /run (a plain remove_dir_all leaves the latter).
    let _ = peerwall_backend_select::installed::forget_pins(std::path::Path::new(&pins));
    out
}

fn main() {
    assert!(
        unsafe { libc::geteuid() } == 0,
        "the control-plane benchmark needs root (network namespaces)"
    );
    let pods = env_usize("PEERWALL_BENCH_PODS", 100_000) as u32;
    assert!(
        pods >= 1501,
        "PEERWALL_BENCH_PODS: at least 1501 (each backend deletes 500 of them)"
    );
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
        let created = cluster::offload_many(&client, 0..pods).await;
        println!(
            "{pods} offloaded pods created in {:.1} s",
            created.as_secs_f64()
        );
        let cmetrics = format!("127.0.0.1:{}", free_port());
        let started = Instant::now();
        // `PEERWALL_BENCH_LOGS=<dir>`: the controller logs at debug (its passes' laps) and its
        // log is kept there, to read where the controller's part went.
        let logs = std::env::var_os("PEERWALL_BENCH_LOGS").map(std::path::PathBuf::from);
        let filter = match logs {
            Some(_) => "debug,peerwall_kube::controller=trace,kube=warn,hyper=warn,tower=warn",
            None => "info,kube=warn",
        };
        let controller = server.peerwall_logging(
            "controller",
            &["controller", "--metrics-addr", &cmetrics],
            filter,
        );
        while cluster::published(&client).await < pods as usize {
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "the controller did not publish every pod"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let controller_sync = started.elapsed();
        println!(
            "controller: {pods} addresses published as slices in {:.2} s",
            controller_sync.as_secs_f64()
        );
        let mut next = pods;
        let mut lives: Vec<one_pod::Live> =
            backends.iter().map(|b| one_pod::Live::new(b)).collect();
        let samples = one_pod::measure_all(&client, &server, &mut lives, pods, &mut next).await;
        let mut rows = Vec::new();
        for (round, (live, one)) in lives.iter_mut().zip(samples).enumerate() {
            let mut row = measure(&client, &server, live, one, pods, &mut next, round as u32).await;
            row.dir_one_pod = measure_dir(&server, live.backend, pods, &mut next).await;
            rows.push(row);
        }
        let controller_rss = controller.peak_rss_mib();
        if let Some(dir) = &logs {
            let to = dir.join("controller.log");
            if let Err(e) = std::fs::copy(controller.log_path(), &to) {
                eprintln!(
                    "could not keep the controller's log in {}: {e}",
                    to.display()
                );
            }
        }
        drop(controller);
        report::report(
            pods,
            created,
            controller_sync,
            controller_rss,
            &rows,
            backends.len() == 2,
        );
    });
}
