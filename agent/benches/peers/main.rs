//! Many peers on one node (`cargo xtask bench-peers`, root): the DaemonSet's gateway-pod mode
//! with the real agent binary, N Liqo gateways on the node.
//!
//! etcd + kube-apiserver v1.20 on loopback with peerwall's CRDs, `peerwall controller`, and per
//! peer a Liqo tenant (its `Configuration`), an offloaded namespace of
//! `PEERWALL_BENCH_PEER_PODS` pods (default 1000) with addresses, and a gateway pod
//! (Liqo's labels, `--remote-cluster-id`, scheduled on this node) whose sandbox is a process in
//! the gateway's network namespace (`fleet.rs`: `liqo-tunnel`, a Geneve-named link, Liqo's NAT).
//! `peerwall agent --source kube --gateway-pods` finds them as on a node. For each N of
//! `PEERWALL_BENCH_PEERS` (default 1,10,50) and each backend (`PEERWALL_BENCH_BACKENDS`):
//! - **start**: the agent started beside N running gateways → every gateway enforces its
//!   peer's policy (per gateway, the first probe to its peer's pod that arrives after the last
//!   probe to an address no pod has did; probes every 2 ms from behind each tunnel);
//! - **one more gateway**: a gateway pod's sandbox (its network namespace) appears beside the
//!   N enforced ones → it enforces;
//! - the agent's peak RSS, and (bpf) the kernel memory one gateway's pinned maps hold, as
//!   `peerwall inspect` reports it, and every BPF map on the node (pinned or not) per gateway:
//!   the node's total with the N + 1 gateways enforcing less its total before the agent
//!   started, over N + 1.
//!
//! Writes the `peers` section of docs/bench.md (a full run: every N and both backends).

mod attached;
#[path = "../doc/mod.rs"]
mod doc;
mod fleet;
mod loads;
mod pods;
#[path = "../shared/published.rs"]
mod published;
#[path = "../shared/tenant.rs"]
mod tenant;
#[path = "../shared/topology.rs"]
mod topology;

use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Client;

use fleet::{Gateway, Probes};
use loads::Loads;
use peerwall_testkit::kube::{free_port, ApiServer, Proc};
use pods::{delete_gateway_pod, gateway_pod, peering, pod_ip};

/// This node's name (the gateway pods' `spec.nodeName`, the agent's `--host`).
const NODE: &str = "bench-node";
/// Longest wait for gateways to enforce.
const PATIENCE: Duration = Duration::from_secs(600);

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Wait until each gateway of `which` enforces; when each did, from `since`.
fn wait_enforced(probes: &Probes, which: &[usize], since: Instant, agent: &Proc) -> Vec<Duration> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let at: Vec<Option<Instant>> = which
            .iter()
            .map(|&i| probes.of(i).enforced(Duration::from_millis(300)))
            .collect();
        if at.iter().all(Option::is_some) {
            return at
                .into_iter()
                .map(|t| t.map_or(Duration::ZERO, |t| t.saturating_duration_since(since)))
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "gateways {:?} not enforced after {PATIENCE:?}; agent log:\n{}",
            which
                .iter()
                .zip(&at)
                .filter(|(_, a)| a.is_none())
                .map(|(i, _)| *i)
                .collect::<Vec<_>>(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The longest the agent is given to settle before "one more gateway" is measured.
const SETTLE_MAX: Duration = Duration::from_secs(30);

/// Busy and total CPU time of the node so far (`/proc/stat`'s `cpu` line, clock ticks).
fn node_cpu() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    let total: u64 = f.iter().take(8).sum();
    (total.saturating_sub(idle), total)
}

/// Wait until the node has settled after the agent started its gateways (their first rounds,
/// the status they write through the API server): its CPUs busy under a third over a second
/// (the probes behind every tunnel included), at most [`SETTLE_MAX`]. Returns how long that
/// took and how busy the node was over its last second.
fn settle() -> (Duration, f64) {
    let began = Instant::now();
    let mut last = node_cpu();
    let mut busy = 1.0;
    while began.elapsed() < SETTLE_MAX {
        std::thread::sleep(Duration::from_secs(1));
        let now = node_cpu();
        busy = now.0.saturating_sub(last.0) as f64 / now.1.saturating_sub(last.1).max(1) as f64;
        last = now;
        if busy < 1.0 / 3.0 {
            break;
        }
    }
    (began.elapsed(), busy)
}

/// One measurement's results.
struct Row {
    backend: String,
    n: usize,
    /// Agent start → each of the N gateways enforced (sorted).
    start: Vec<Duration>,
    /// All enforced → the agent settled ([`settle`]).
    settled: Duration,
    /// One more gateway's sandbox appearing → enforced.
    one_more: Duration,
    /// Whether that gateway's load took the spare datapath the agent made ahead (bpf).
    one_more_spare: Option<bool>,
    /// Datagrams to each of the N gateways' allowed pod lost from the agent's start until
    /// that gateway was enforced (sorted), and the one more gateway's from its sandbox on.
    lost_start: Vec<u64>,
    lost_one_more: u64,
    rss_mib: f64,
    /// `peerwall inspect`'s kernel memory line of one gateway (bpf).
    memory: Option<String>,
    /// Every BPF map on the node per gateway, bytes (bpf; see the module comment).
    node_per_gateway: Option<u64>,
    /// The datapath loads the agent made (bpf).
    loads: Option<Loads>,
    /// Agent start → each gateway's datapath in force (bpf; sorted, `attached.rs`).
    in_force: Option<Vec<Duration>>,
}

/// `kernel memory …` as `peerwall inspect` prints it for the first gateway's pins.
fn gateway_memory(pins: &std::path::Path, gw: &Gateway) -> Option<String> {
    let dir = std::fs::read_dir(pins.join("gateways"))
        .ok()?
        .flatten()
        .next()?
        .path();
    let out = gw
        .gw
        .exec(
            env!("CARGO_BIN_EXE_peerwall"),
            &["inspect", "--pin-dir", dir.to_str()?],
        )
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with("kernel memory"))
        .map(|l| l.trim_start_matches("kernel memory ").to_string())
}

fn measure(
    rt: &tokio::runtime::Runtime,
    server: &ApiServer,
    client: &Client,
    backend: &str,
    n: usize,
) -> Row {
    let tag = format!("peerwall-peers-{}-{backend}-{n}", std::process::id());
    let cgroups = std::path::PathBuf::from("/sys/fs/cgroup/pids").join(&tag);
    let pins = std::path::PathBuf::from("/sys/fs/bpf").join(&tag);
    // N gateways and one more, each forwarding to a pod of its own peer.
    let mut gws: Vec<Gateway> = (0..=n).map(|i| Gateway::new(i, pod_ip(i, 0))).collect();
    let probes = Probes::start(&gws);
    for (i, gw) in gws.iter_mut().enumerate().take(n) {
        rt.block_on(gateway_pod(client, i, NODE, gw, &cgroups));
    }
    // Every gateway forwards both probes before the agent (no policy yet).
    std::thread::sleep(Duration::from_millis(500));
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = vec![
        "agent",
        "--source",
        "kube",
        "--gateway-pods",
        "--host",
        NODE,
        "--backend",
        backend,
        "--metrics-addr",
        &metrics,
    ];
    // Both backends: the agent keeps its gateways' handles there.
    let pins_arg = pins.to_string_lossy().to_string();
    args.extend(["--pin-dir", &pins_arg]);
    for i in 0..=n {
        probes.reset(i);
    }
    let maps_before = peerwall_backend_bpf::memory::node_memory();
    let started = Instant::now();
    let attached = (backend == "bpf").then(|| attached::Attached::watch(pins.clone(), started));
    // The loader's debug lines say how long each gateway's maps and verification took.
    let agent = server.peerwall_logging(
        &format!("agent-{backend}-{n}"),
        &args,
        "info,kube=warn,peerwall_backend_bpf::loader=debug,peerwall_kube::agent=debug",
    );
    let which: Vec<usize> = (0..n).collect();
    let mut start = wait_enforced(&probes, &which, started, &agent);
    start.sort();
    let mut lost_start: Vec<u64> = which.iter().map(|&i| probes.of(i).allowed_lost()).collect();
    lost_start.sort();
    let in_force = attached.map(|a| a.wait(n, PATIENCE));
    if let Some(t) = &in_force {
        eprintln!(
            "{backend:>8} N={n:<3} start → every datapath in force {:?}",
            t.last()
        );
    }
    eprintln!(
        "{backend:>8} N={n:<3} start → all enforced {:?} (first {:?})",
        start.last().copied().unwrap_or_default(),
        start.first().copied().unwrap_or_default()
    );
    // "Beside N running": once the agent has settled after starting them (their first
    // rounds, status writes and stale-finalizer releases done), not in the middle of that.
    let (settled, busy) = settle();
    eprintln!(
        "{backend:>8} N={n:<3} node settled {settled:?} after the last gateway ({:.0}% busy)",
        busy * 100.0
    );
    probes.reset(n);
    let spares =
        || Loads::spares_taken(&std::fs::read_to_string(agent.log_path()).unwrap_or_default());
    let spares_before = spares();
    let at = rt.block_on(gateway_pod(client, n, NODE, &mut gws[n], &cgroups));
    let one_more = wait_enforced(&probes, &[n], at, &agent)[0];
    let one_more_spare = (backend == "bpf").then(|| spares() > spares_before);
    let lost_one_more = probes.of(n).allowed_lost();
    eprintln!("{backend:>8} N={n:<3} one more gateway enforced {one_more:?} (took the spare: {one_more_spare:?})");
    let rss_mib = agent.peak_rss_mib();
    let loads = (backend == "bpf")
        .then(|| Loads::of(&std::fs::read_to_string(agent.log_path()).unwrap_or_default()));
    let node_per_gateway = (backend == "bpf").then(|| {
        let now = peerwall_backend_bpf::memory::node_memory();
        now.bytes.saturating_sub(maps_before.bytes) / (n as u64 + 1)
    });
    let memory = (backend == "bpf")
        .then(|| gateway_memory(&pins, &gws[0]))
        .flatten();
    // Kept for reading where the time went (`PEERWALL_BENCH_LOGS=<dir>`).
    if let Some(dir) = std::env::var_os("PEERWALL_BENCH_LOGS") {
        let to = std::path::Path::new(&dir).join(format!("agent-{backend}-{n}.log"));
        if let Err(e) = std::fs::copy(agent.log_path(), &to) {
            eprintln!("could not keep the agent's log in {}: {e}", to.display());
        }
    }
    drop(agent);
    for i in 0..=n {
        rt.block_on(delete_gateway_pod(client, i));
    }
    drop(probes);
    drop(gws);
    attached::remove_pin_root(&pins);
    let _ = std::fs::remove_dir(&cgroups);
    Row {
        backend: backend.to_string(),
        n,
        start,
        settled,
        one_more,
        one_more_spare,
        lost_start,
        lost_one_more,
        rss_mib,
        memory,
        node_per_gateway,
        loads,
        in_force,
    }
}

/// Start → the last of the N gateways' datapaths in force ("–" if one never was).
fn in_force_all(r: &Row) -> String {
    match &r.in_force {
        Some(t) if t.len() >= r.n => ms(t.last().copied().unwrap_or_default()),
        Some(t) => format!("{} of {} never", r.n - t.len(), r.n),
        None => "–".to_string(),
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20))
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn report(rows: &[Row], pods: usize, setup: Duration, controller_rss: f64) -> String {
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mut md = String::from("## Many peers on one node (`cargo xtask bench-peers`)\n\n");
    md.push_str(&format!(
        "Generated on {date} ({} cores). The DaemonSet's gateway-pod mode (`peerwall agent --source kube --gateway-pods`, the release binary) on a node with N Liqo gateway pods, each its own network namespace with `liqo-tunnel`, a Geneve-named link and a NAT rule (so its kernel tracks connections, as Liqo's remapping makes it), each peer with {pods} offloaded pods (the controller's provider protection: the gateway forwards from the tunnel to its peer's pods only). A real API server and `peerwall controller`, stopped once it published every peer's configuration and addresses (peak RSS {controller_rss:.0} MiB), so that what is measured is the node's agent; no kubelet: each gateway pod's sandbox is a process in its namespace, in the pod's cgroup, where the agent looks for it. *Enforced*: the first probe to the peer's pod that arrives after the last probe to an address no pod has did (probes every 2 ms behind every tunnel, counted where they arrive), whichever enforcer it is: on bpf, a gateway that finds no turn to load its datapath free has nftables enforce its policy until the datapath takes over (the loads' table below says how many, and when every datapath was in force). *Start*: from starting the agent beside N running gateways; *one more*: from a gateway pod's sandbox (its network namespace) appearing beside them (the agent acts on the pod from then on; its status turns Running just after); on bpf, whether its load took *the spare* datapath the agent makes ahead once no load runs (maps created, programs verified: a second gateway arriving before the next spare is made loads its own, which the loads' table below prices), once the node has settled after the agent started them (their first rounds and the status they write through the API server: the node's CPUs under a third busy over a second, the probes included, at most 30 s; *settled*: how long after the last gateway was enforced). *Every BPF map on the node per gateway*: the `memlock` of all the node's maps (pinned or held open only, `bpftool map show`'s figure) with the N + 1 gateways enforcing, less before the agent started, over N + 1; *its pins*: what `peerwall inspect` counts for one gateway. Setting up the peers took {:.0} s.\n\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        setup.as_secs_f64()
    ));
    md.push_str("| backend | gateways N | start → first enforced | start → median | start → all enforced | settled | one more gateway | agent peak RSS | kernel memory of one gateway (its pins) | every BPF map on the node per gateway |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n");
    for r in rows {
        let mid = r.start.get(r.start.len() / 2).copied().unwrap_or_default();
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} MiB | {} | {} |\n",
            r.backend,
            r.n,
            ms(r.start.first().copied().unwrap_or_default()),
            ms(mid),
            ms(r.start.last().copied().unwrap_or_default()),
            ms(r.settled),
            match r.one_more_spare {
                Some(true) => format!("{} (the spare)", ms(r.one_more)),
                Some(false) => format!("{} (loaded its own)", ms(r.one_more)),
                None => ms(r.one_more),
            },
            r.rss_mib,
            r.memory.as_deref().unwrap_or("–"),
            r.node_per_gateway.map_or("–".to_string(), mib),
        ));
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if rows.iter().any(|r| r.loads.is_some()) {
        md.push_str(&format!("\nThe bpf datapath's own part of a gateway's start, from the agent's loader (each load in its own gateway's thread, {cpus} at a time, one per CPU): the median over the run's loads of creating the object's maps and of verifying its program, and the least time N such loads take on this node's CPUs (*floor*: their sum times ⌈N ÷ CPUs⌉, a load running on one CPU), against start → every datapath in force (each gateway's tunnel link pinned, watched from outside the agent) and start → all enforced. A gateway that finds no turn to load free has nftables enforce its policy until its datapath is loaded and takes over (`--no-start-bridge` turns that off): *bridged*, how many did, and how many of them handed over to their datapath:\n\n| gateways N | loads | maps created (median) | program verified (median) | floor for N | bridged (handed over) | start → every datapath in force | start → all enforced |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n"));
        for r in rows {
            let Some(l) = &r.loads else { continue };
            md.push_str(&format!(
                "| {} | {} | {:.1} ms | {:.1} ms | {} | {} ({}) | {} | {} |\n",
                r.n,
                l.verified.len(),
                Loads::median(&l.maps),
                Loads::median(&l.verified),
                ms(l.floor(r.n, cpus)),
                l.bridged,
                l.took_over,
                in_force_all(r),
                ms(r.start.last().copied().unwrap_or_default()),
            ));
        }
    }
    md.push_str(&format!("\nAllowed traffic lost while the gateways start: datagrams to each gateway's allowed pod (one every {} ms per gateway, from behind its tunnel) that never reached it, from the agent's start until the gateway was enforced (what a node's reboot costs each gateway that comes back before the agent does: the boot policy drops its traffic until the agent enforces), and for the one more gateway from its sandbox appearing:\n\n| backend | gateways N | lost at the start, all gateways | per gateway, median | per gateway, most | one more gateway |\n|---|---:|---:|---:|---:|---:|\n", fleet::PERIOD.as_millis()));
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.n,
            r.lost_start.iter().sum::<u64>(),
            r.lost_start
                .get(r.lost_start.len() / 2)
                .copied()
                .unwrap_or(0),
            r.lost_start.last().copied().unwrap_or(0),
            r.lost_one_more,
        ));
    }
    md.push_str("\nGoals (issue \"Scale where Liqo grows\"), as this run measured them:\n\n| goal | target | measured | |\n|---|---:|---:|---|\n");
    let largest = rows.iter().map(|r| r.n).max().unwrap_or(0);
    for r in rows.iter().filter(|r| r.n == largest) {
        let all = r.start.last().copied().unwrap_or_default();
        let verdict = |ok: bool| if ok { "meets" } else { "misses" };
        md.push_str(&format!(
            "| {} at N = {}: start → all enforced | ≤ 3 s | {} | {} |\n",
            r.backend,
            r.n,
            ms(all),
            verdict(all <= Duration::from_secs(3))
        ));
        if let Some(l) = &r.loads {
            md.push_str(&format!(
                "| {} at N = {}: start → every datapath in force ({} gateways enforced by nftables until theirs took over) | – | {} (floor {}) | – |\n",
                r.backend,
                r.n,
                l.took_over,
                in_force_all(r),
                ms(l.floor(r.n, std::thread::available_parallelism().map_or(1, |n| n.get()))),
            ));
        }
        md.push_str(&format!(
            "| {}: one more gateway beside {} | ≤ 200 ms | {} | {} |\n",
            r.backend,
            r.n,
            ms(r.one_more),
            verdict(r.one_more <= Duration::from_millis(200))
        ));
        md.push_str(&format!(
            "| {} at N = {}: agent peak RSS | ≤ 200 MiB | {:.0} MiB | {} |\n",
            r.backend,
            r.n,
            r.rss_mib,
            verdict(r.rss_mib <= 200.0)
        ));
        if let Some(b) = r.node_per_gateway {
            md.push_str(&format!(
                "| {} at N = {}: every BPF map on the node per gateway | ≤ 16 MiB | {} | {} |\n",
                r.backend,
                r.n,
                mib(b),
                verdict(b <= 16 << 20)
            ));
        }
    }
    md
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "bench-peers needs root");
    let sizes: Vec<usize> = env_list("PEERWALL_BENCH_PEERS", "1,10,50")
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    let backends = env_list("PEERWALL_BENCH_BACKENDS", "nftables,bpf");
    let pods: usize = std::env::var("PEERWALL_BENCH_PEER_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let largest = sizes.iter().copied().max().unwrap_or(1);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let server = ApiServer::start_with_crds(env!("CARGO_BIN_EXE_peerwall"));
    let client = rt.block_on(server.client());
    let setup_started = Instant::now();
    // The largest N's gateways and one more: peers 0..=largest.
    rt.block_on(async {
        futures::stream::iter(0..=largest)
            .map(|i| peering(&client, i, pods))
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await
    });
    let cmetrics = format!("127.0.0.1:{}", free_port());
    let controller = server.peerwall("controller", &["controller", "--metrics-addr", &cmetrics]);
    let want = (largest + 1) * pods;
    let deadline = Instant::now() + PATIENCE;
    while rt.block_on(published::offloaded(&client, None)) < want {
        assert!(
            Instant::now() < deadline,
            "the controller did not publish every peer's pods:\n{}",
            controller.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let setup = setup_started.elapsed();
    eprintln!("{} peers of {pods} pods set up in {setup:?}", largest + 1);
    // What the agents need is published; the controller goes, so that what is measured is the
    // node's agent (the controller reacts to every status the agents write, and at this scale
    // it took more than one of the 2 cores doing so: bench-control measures it).
    let controller_rss = controller.peak_rss_mib();
    drop(controller);
    let mut rows = Vec::new();
    for &n in &sizes {
        for b in &backends {
            rows.push(measure(&rt, &server, &client, b, n));
        }
    }
    let md = report(&rows, pods, setup, controller_rss);
    print!("{md}");
    let full = std::env::var_os("PEERWALL_BENCH_PEERS").is_none()
        && std::env::var_os("PEERWALL_BENCH_BACKENDS").is_none();
    if full {
        doc::write_section("peers", md.trim_end()).expect("write docs/bench.md");
    }
}
