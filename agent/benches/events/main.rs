//! An event flood through the real API server, for minutes (`cargo xtask reliability`, root).
//!
//! etcd + kube-apiserver v1.20 on loopback, peerwall's CRDs, a Liqo tenant whose consumer
//! offloaded `PEERWALL_FLOOD_PODS` pods (default 10 000); `peerwall controller` publishes them,
//! `peerwall agent --source kube --netns GW` enforces the peer's gateway configuration. Then,
//! for `PEERWALL_FLOOD_MINUTES` (default 10) per backend, 10 000 API writes a minute: an
//! offloaded pod created and given its address (two writes), the oldest flood pod deleted, and
//! the tenant namespace's annotations patched (an event for every watcher of tenant
//! namespaces). Every 10 s a sample: the resident memory of the controller and of the agent,
//! and one more pod's time from its address to its first packet through the gateway; all the
//! while a stream towards an address no pod has, which must never arrive. At the end, the
//! least-squares slope of memory (MiB per minute) and latency (ms per minute) and the first
//! and last quarter's means; the run fails when memory or latency grows beyond bounds (see
//! [`judge`]). One JSON row per backend goes to `$CARGO_TARGET_TMPDIR/reliability/` for
//! docs/reliability.md.

#[path = "../control/agent.rs"]
#[allow(dead_code)]
mod agent;
#[path = "../control/cluster.rs"]
mod cluster;
#[path = "../control/probe.rs"]
mod probe;
#[path = "../shared/published.rs"]
mod published;
#[path = "../shared/tenant.rs"]
mod tenant;
#[path = "../shared/topology.rs"]
mod topology;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use serde_json::json;

use agent::{free_port, get, start_agent, Agent};
use cluster::{pod_ip, ApiServer, Proc};
use probe::Gateway;

/// API writes per minute.
const WRITES_PER_MIN: u64 = 10_000;
/// Writes per flood cycle: pod created, its status, a pod deleted, the namespace patched.
const WRITES_PER_CYCLE: u64 = 4;
/// Flood pods alive at once (the oldest is deleted as each new one comes).
const LIVE: u32 = 1000;
/// Between samples.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident memory now (VmRSS), MiB.
fn rss_mib(p: &Proc) -> f64 {
    std::fs::read_to_string(format!("/proc/{}/status", p.child.id()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// One sample of the run.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Sample {
    /// Minutes since the flood started.
    minute: f64,
    controller_mib: f64,
    agent_mib: f64,
    /// One pod: its address given → its first packet through the gateway.
    pod_ms: f64,
}

/// Least-squares slope of `y` over `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

/// Mean of `f` over the first and over the last quarter of `samples`.
fn quarters(samples: &[Sample], f: impl Fn(&Sample) -> f64) -> (f64, f64) {
    let q = (samples.len() / 4).max(1);
    let mean = |s: &[Sample]| s.iter().map(&f).sum::<f64>() / s.len().max(1) as f64;
    (mean(&samples[..q]), mean(&samples[samples.len() - q..]))
}

/// What a backend's flood run showed.
#[derive(Debug, serde::Serialize)]
struct FloodRow {
    backend: &'static str,
    minutes: u64,
    writes: u64,
    pods_at_start: u32,
    samples: Vec<Sample>,
    controller_mib_per_min: f64,
    agent_mib_per_min: f64,
    pod_ms_per_min: f64,
    controller_mib: (f64, f64),
    agent_mib: (f64, f64),
    pod_ms: (f64, f64),
    /// Packets towards the address no pod has that arrived (must be 0).
    stranger_reached: bool,
}

/// Flat enough: memory in the last quarter within 25 % + 16 MiB of the first quarter's, the
/// one-pod latency within 3× + 50 ms of it; the stranger never reached.
fn judge(r: &FloodRow) -> Vec<String> {
    let mut bad = Vec::new();
    for (what, (first, last)) in [
        ("controller memory", r.controller_mib),
        ("agent memory", r.agent_mib),
    ] {
        if last > first * 1.25 + 16.0 {
            bad.push(format!("{what} grew from {first:.1} to {last:.1} MiB"));
        }
    }
    let (first, last) = r.pod_ms;
    if last > first * 3.0 + 50.0 {
        bad.push(format!(
            "one pod to first packet grew from {first:.1} to {last:.1} ms"
        ));
    }
    if r.stranger_reached {
        bad.push("an address no pod has was reached".into());
    }
    bad
}

/// Flood workers, each with its share of the rate and its own range of pods (one cycle's
/// writes are sequential, and take longer than the rate's gap on their own).
const WORKERS: u32 = 4;

/// One flood worker: cycles of writes at its share of [`WRITES_PER_MIN`] until `until`, on pods
/// from `first`; returns the writes made.
async fn flood_worker(client: Client, first: u32, until: Instant) -> u64 {
    let ns: Api<Namespace> = Api::all(client.clone());
    let gap =
        Duration::from_micros(60_000_000 * WRITES_PER_CYCLE * u64::from(WORKERS) / WRITES_PER_MIN);
    let mut tick = tokio::time::interval(gap);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (mut next, mut writes) = (first, 0u64);
    while Instant::now() < until {
        tick.tick().await;
        cluster::offload(&client, next).await;
        writes += 2;
        if next >= first + LIVE / WORKERS {
            cluster::remove(&client, next - LIVE / WORKERS).await;
            writes += 1;
        }
        let patch = json!({"metadata": {"annotations": {"peerwall.io/flood": next.to_string()}}});
        ns.patch(
            cluster::TENANT,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("namespace patch");
        writes += 1;
        next += 1;
    }
    writes
}

/// The flood: [`WORKERS`] workers on pods from `first` until `until`; the writes made.
async fn flood(client: Client, first: u32, until: Instant) -> u64 {
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(flood_worker(client.clone(), first + w * 250_000, until)))
        .collect();
    let mut writes = 0;
    for w in workers {
        writes += w.await.expect("flood worker");
    }
    writes
}

async fn run(
    client: &Client,
    server: &ApiServer,
    controller: &Proc,
    backend: &'static str,
    pods: u32,
    next: &mut u32,
) -> FloodRow {
    let minutes = env_u64("PEERWALL_FLOOD_MINUTES", 10);
    let gw = Gateway::new();
    let pins = format!("/sys/fs/bpf/pwflood{}", std::process::id());
    let Agent {
        proc: agent,
        metrics,
    } = start_agent(server, &gw, backend, &pins, &format!("agent-{backend}"));
    let started = Instant::now();
    while !get(&metrics, "/readyz").is_some_and(|b| b.ends_with("\r\n\r\nready\n")) {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{backend}: the agent never became ready:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The flood's pods and the samples' pods: ranges of their own.
    let flood_first = *next;
    *next += 1_000_000;
    let stranger = Ipv4Addr::new(10, 63, 255, 1);
    let until = Instant::now() + Duration::from_secs(60 * minutes);
    let flooding = tokio::spawn(flood(client.clone(), flood_first, until));
    let t0 = Instant::now();
    let mut samples = Vec::new();
    while Instant::now() < until {
        let i = *next;
        *next += 1;
        let ip = pod_ip(i);
        gw.probe(&[stranger, ip]);
        let given = cluster::offload_timed(client, i).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let pod_ms = loop {
            if let Some((first, _)) = gw.arrival(ip) {
                break first.saturating_duration_since(given).as_secs_f64() * 1e3;
            }
            assert!(
                Instant::now() < deadline,
                "{backend}: pod {ip} not reached 30 s after its address under the flood"
            );
            tokio::time::sleep(Duration::from_micros(500)).await;
        };
        let s = Sample {
            minute: t0.elapsed().as_secs_f64() / 60.0,
            controller_mib: rss_mib(controller),
            agent_mib: rss_mib(&agent),
            pod_ms,
        };
        println!(
            "{backend}: {:5.2} min  controller {:6.1} MiB  agent {:6.1} MiB  one pod {:7.1} ms",
            s.minute, s.controller_mib, s.agent_mib, s.pod_ms
        );
        samples.push(s);
        tokio::time::sleep(SAMPLE_EVERY.saturating_sub(Duration::from_millis(pod_ms as u64))).await;
    }
    let writes = flooding.await.expect("flood");
    let stranger_reached = gw.arrival(stranger).is_some();
    gw.probe(&[]);
    drop(agent);
    // Pins and their slot metadata under /run (a plain remove_dir_all leaves the latter).
    let _ = peerwall_backend_select::installed::forget_pins(std::path::Path::new(&pins));
    let pts = |f: fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.minute, f(s))).collect()
    };
    FloodRow {
        backend,
        minutes,
        writes,
        pods_at_start: pods,
        controller_mib_per_min: slope(&pts(|s| s.controller_mib)),
        agent_mib_per_min: slope(&pts(|s| s.agent_mib)),
        pod_ms_per_min: slope(&pts(|s| s.pod_ms)),
        controller_mib: quarters(&samples, |s| s.controller_mib),
        agent_mib: quarters(&samples, |s| s.agent_mib),
        pod_ms: quarters(&samples, |s| s.pod_ms),
        samples,
        stranger_reached,
    }
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "the event flood needs root (network namespaces)"
    );
    let pods = env_u64("PEERWALL_FLOOD_PODS", 10_000) as u32;
    let backends = agent::backends();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("reliability");
    std::fs::create_dir_all(&out).expect("report dir");
    let mut failed = Vec::new();
    rt.block_on(async {
        let server = cluster::api_server();
        let client = cluster::client(&server).await;
        cluster::peering(&client).await;
        cluster::offload_many(&client, 0..pods).await;
        let cmetrics = format!("127.0.0.1:{}", free_port());
        let controller =
            server.peerwall("controller", &["controller", "--metrics-addr", &cmetrics]);
        let started = Instant::now();
        while cluster::published(&client).await < pods as usize {
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "the controller did not publish every pod"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut next = pods;
        for b in backends {
            let row = run(&client, &server, &controller, b, pods, &mut next).await;
            println!(
                "{b}: {} writes in {} min; slopes: controller {:+.2} MiB/min, agent {:+.2} MiB/min, one pod {:+.2} ms/min",
                row.writes, row.minutes, row.controller_mib_per_min, row.agent_mib_per_min, row.pod_ms_per_min
            );
            failed.extend(judge(&row).into_iter().map(|e| format!("{b}: {e}")));
            std::fs::write(
                out.join(format!("flood-{b}.json")),
                serde_json::to_string_pretty(&row).expect("json"),
            )
            .expect("write row");
        }
    });
    assert!(failed.is_empty(), "not flat under the flood: {failed:#?}");
}
