//! The processes under test: a free port for their metrics, `GET` on it, and the agent
//! enforcing the bench peer's gateway configuration in a gateway namespace.

use std::time::{Duration, Instant};

use crate::cluster::{self, ApiServer, Proc};
use crate::probe::Gateway;

pub use peerwall_testkit::kube::free_port;

/// `GET path` on a local HTTP endpoint; the body, if it answered.
pub fn get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(c, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut out = String::new();
    c.read_to_string(&mut out).ok()?;
    Some(out)
}

/// An agent and where its metrics are served.
pub struct Agent {
    pub proc: Proc,
    pub metrics: String,
}

/// `peerwall agent --source kube --netns GW` for the bench peer, with `backend` and `pins`.
pub fn start_agent(
    server: &ApiServer,
    gw: &Gateway,
    backend: &str,
    pins: &str,
    name: &str,
) -> Agent {
    let metrics = format!("127.0.0.1:{}", free_port());
    let selector = format!("peerwall.io/remote-cluster-id={}", cluster::PEER);
    // JSON lines with the engine's applies (debug): what `trace` splits samples by.
    let proc = server.peerwall_logging(
        name,
        &[
            "agent",
            "--source",
            "kube",
            "--netns",
            gw.gw.name(),
            "--backend",
            backend,
            "--selector",
            &selector,
            "--host",
            "bench",
            "--pin-dir",
            pins,
            "--metrics-addr",
            &metrics,
            "--interval-ms",
            "200",
            "--log-format",
            "json",
            // Room for every pod's address, as the operator of a cluster this size sets it
            // (the default holds 65536): changes then stay in place.
            "--host-table-size",
            &host_table().to_string(),
        ],
        "info,peerwall_enforce::enforcement=debug,kube=warn",
    );
    Agent { proc, metrics }
}

/// Hosts per exact-match map for the run's pods (`PEERWALL_BENCH_PODS`, as `main.rs` reads
/// it): twice as many, a power of two.
fn host_table() -> u32 {
    let pods: u32 = std::env::var("PEERWALL_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    pods.saturating_mul(2)
        .clamp(1024, 1 << 24)
        .next_power_of_two()
}

/// The backends to measure: `PEERWALL_BENCH_BACKENDS` (comma-separated), both by default.
pub fn backends() -> Vec<&'static str> {
    std::env::var("PEERWALL_BENCH_BACKENDS")
        .unwrap_or_else(|_| "nftables,bpf".into())
        .split(',')
        .filter_map(|b| match b.trim() {
            "nftables" => Some("nftables"),
            "bpf" => Some("bpf"),
            _ => None,
        })
        .collect()
}

/// Wait for the agent's `/readyz` (its first full sync in force); how long that took.
pub fn wait_ready(a: &mut Agent, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = a.proc.child.try_wait() {
            panic!("the agent exited ({status}) before it was ready");
        }
        // The body is "ready\n" or "not ready\n".
        if get(&a.metrics, "/readyz").is_some_and(|b| b.ends_with("\r\n\r\nready\n")) {
            return started.elapsed();
        }
        assert!(started.elapsed() < limit, "the agent never became ready");
        std::thread::sleep(Duration::from_millis(2));
    }
}
