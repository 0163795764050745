//! The one-pod samples of every backend, in alternating blocks: a pod gets its address
//! (status update) → the first probe packet reaches it, through API server + controller +
//! agent.
//!
//! Every backend's samples are taken before any backend's churn, in blocks ordered A B, B A,
//! A B, … with one agent running at a time (started for its block, stopped after it). Measured
//! one backend after the other, the second was the slower whichever it was (the controller's
//! part 20.7 against 33.4 ms, docs/benchmarking.md): the API server's state after a round's
//! churn, restart and time is not the state before it. In alternating blocks both backends
//! meet the same states. An agent started for a block rewrites every slice's condition (it
//! names its backend); a block's samples start once those writes are seen ([`crate::settle`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Client;

use crate::agent::{start_agent, wait_ready, Agent};
use crate::cluster::{self, pod_ip, ApiServer};
use crate::probe::Gateway;
use crate::stats::{env_usize, ms};
use crate::{floor, settle, trace, watch_slices};

/// A backend's gateway namespace and pins, kept across its blocks and its churn.
pub struct Live {
    pub backend: &'static str,
    pub gw: Gateway,
    pub pins: String,
    /// The agent's start at the first block: its first full sync in force.
    pub first_sync: Duration,
    /// Peak RSS over every agent process of this backend (MiB).
    pub rss: f64,
    /// Agent processes started so far (each gets its own log name).
    starts: u32,
}

impl Live {
    pub fn new(backend: &'static str) -> Self {
        Self {
            backend,
            gw: Gateway::new(),
            pins: format!("/sys/fs/bpf/pwctl{}-{backend}", std::process::id()),
            first_sync: Duration::ZERO,
            rss: 0.0,
            starts: 0,
        }
    }

    /// Start this backend's agent; how long until it was in force.
    pub fn start(&mut self, server: &ApiServer) -> (Agent, Duration) {
        self.starts += 1;
        let name = format!("agent-{}-{}", self.backend, self.starts);
        let mut agent = start_agent(server, &self.gw, self.backend, &self.pins, &name);
        let took = tokio::task::block_in_place(|| wait_ready(&mut agent, Duration::from_secs(120)));
        (agent, took)
    }

    /// Stop `agent`, keeping its peak RSS.
    pub fn stop(&mut self, agent: Agent) {
        self.rss = self.rss.max(agent.proc.peak_rss_mib());
        drop(agent);
    }
}

/// One backend's samples over all its blocks.
#[derive(Default)]
pub struct OnePod {
    pub samples: Vec<Duration>,
    pub splits: Vec<trace::Split>,
    /// Every block's agent log, on the bench's clock.
    pub log: Vec<trace::LogLine>,
    /// The API server's floors around each block ([`floor::Floor::block`]).
    pub floor: Vec<Duration>,
    pub slice_floor: Vec<Duration>,
    pub small_floor: Vec<Duration>,
    /// Each block's one-pod p50, in the order the blocks ran.
    pub block_p50: Vec<Duration>,
}

/// Blocks per backend (`PEERWALL_BENCH_BLOCKS`, default 4).
pub fn blocks() -> usize {
    env_usize("PEERWALL_BENCH_BLOCKS", 4).max(1)
}

/// The samples of every backend in `lives`, in alternating blocks; `next` is the next pod
/// index never used.
pub async fn measure_all(
    client: &Client,
    server: &ApiServer,
    lives: &mut [Live],
    pods: u32,
    next: &mut u32,
) -> Vec<OnePod> {
    let samples = env_usize("PEERWALL_BENCH_SAMPLES", 40);
    let blocks = blocks();
    let per_block = samples.div_ceil(blocks);
    let mut out: Vec<OnePod> = lives.iter().map(|_| OnePod::default()).collect();
    for b in 0..blocks {
        let mut order: Vec<usize> = (0..lives.len()).collect();
        if b % 2 == 1 {
            order.reverse();
        }
        for i in order {
            block(
                client,
                server,
                &mut lives[i],
                b == 0,
                pods,
                per_block,
                next,
                &mut out[i],
            )
            .await;
        }
    }
    for (live, o) in lives.iter().zip(&out) {
        println!(
            "{}: one pod p50 {} ms, p99 {} ms ({} samples in {blocks} blocks)",
            live.backend,
            ms(crate::percentile(&o.samples, 0.5)),
            ms(crate::percentile(&o.samples, 0.99)),
            o.samples.len()
        );
    }
    out
}

/// One block of `n` samples on `live`'s agent, started for it and stopped after it.
#[allow(clippy::too_many_arguments)]
async fn block(
    client: &Client,
    server: &ApiServer,
    live: &mut Live,
    first: bool,
    pods: u32,
    n: usize,
    next: &mut u32,
    out: &mut OnePod,
) {
    let backend = live.backend;
    let (agent, took) = live.start(server);
    if first {
        live.first_sync = took;
        println!("{backend}: agent in force after {} ms", ms(took));
        default_deny_holds(&live.gw, backend, pods).await;
    }
    // Every slice version from here on: the samples are split by them (`trace`).
    let clock = trace::Clock::now();
    let log = Arc::new(Mutex::new(Vec::new()));
    let watch = watch_slices(client, backend, log.clone());
    let settled = settle(&log, Duration::from_secs(120)).await;
    println!(
        "{backend}: every slice's Applied condition (this backend's) at its generation {} ms after the watch began",
        ms(settled)
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Floor writes in two blocks, before and after the samples (after the agent's first
    // conditions and the controller's reaction to them have settled): one block alone once
    // caught a busy spell (21 ms against 4.4 in the other backend's round); a write before
    // each sample slowed the sample after it (p50 12.4 -> 17.7 ms at 5000 pods).
    let mut floor_probe = floor::Floor::start(client).await;
    let floors = n.div_ceil(4).max(1);
    floor_probe
        .block(
            floors,
            true,
            &mut out.floor,
            &mut out.slice_floor,
            &mut out.small_floor,
        )
        .await;
    let mut traced = Vec::new();
    for _ in 0..n {
        let i = *next;
        *next += 1;
        let ip = pod_ip(i);
        live.gw.probe(&[ip]);
        let t0 = cluster::offload_timed(client, i).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some((first, _)) = live.gw.arrival(ip) {
                out.samples.push(first.saturating_duration_since(t0));
                traced.push(trace::Sample { ip, t0, first });
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{backend}: pod {ip} never reached"
            );
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    floor_probe
        .block(
            floors,
            false,
            &mut out.floor,
            &mut out.slice_floor,
            &mut out.small_floor,
        )
        .await;
    drop(floor_probe);
    live.gw.probe(&[]);
    let taken = &out.samples[out.samples.len() - n..];
    let p50 = crate::percentile(taken, 0.5);
    out.block_p50.push(p50);
    println!(
        "{backend}: block of {n}: one pod p50 {} ms, max {} ms",
        ms(p50),
        ms(crate::percentile(taken, 1.0))
    );
    watch.abort();
    let agent_log = trace::agent_log(&agent.proc.log(), clock);
    let seen = log.lock().map(|l| l.clone()).unwrap_or_default();
    out.splits
        .extend(traced.iter().map(|s| trace::split(*s, &seen, &agent_log)));
    out.log.extend(agent_log);
    live.stop(agent);
}

/// Default deny holds: an address no pod has is not reached, an offloaded one is. (The last
/// pod of the initial population is never deleted by the churn.)
async fn default_deny_holds(gw: &Gateway, backend: &str, pods: u32) {
    let (stranger, known) = (std::net::Ipv4Addr::new(10, 63, 255, 1), pod_ip(pods - 1));
    gw.probe(&[stranger, known]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        gw.arrival(known).is_some(),
        "{backend}: an offloaded pod is not reached"
    );
    assert!(
        gw.arrival(stranger).is_none(),
        "{backend}: an address no pod has is reached: the gateway does not enforce"
    );
    gw.probe(&[]);
}
