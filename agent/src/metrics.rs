//! `/metrics` (Prometheus text format), `/healthz` and `/readyz` of the agent and the
//! controller, served over hyper (the webhook's HTTP stack) from a thread of its own.
//!
//! Labels are bounded by the policy itself (table, chain and rule names of the applied policy);
//! nothing per packet or per address.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};

use peerwall_backend_nftables::RuleCounter;

/// Upper bounds (seconds) of the apply latency histogram.
pub const APPLY_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// What the agent reports.
#[derive(Debug, Default, Clone)]
pub struct AgentMetrics {
    /// Backend name.
    pub backend: &'static str,
    /// Policies applied so far.
    pub generation: u64,
    /// Apply latency histogram: counts per bucket (cumulative at render time), sum, count.
    pub apply_buckets: [u64; APPLY_BUCKETS.len()],
    /// Sum of apply seconds.
    pub apply_sum: f64,
    /// Number of applies.
    pub apply_count: u64,
    /// Applies the kernel refused.
    pub apply_errors: u64,
    /// Policy changes refused by validation.
    pub invalid_policies: u64,
    /// Drift repairs (nftables).
    pub drift_repairs: u64,
    /// Rule counters of the applied policy.
    pub rules: Vec<RuleCounter>,
    /// Whether a policy is in force.
    pub ready: bool,
}

impl AgentMetrics {
    /// Record one apply's duration.
    pub fn observe_apply(&mut self, seconds: f64) {
        for (i, b) in APPLY_BUCKETS.iter().enumerate() {
            if seconds <= *b {
                self.apply_buckets[i] += 1;
            }
        }
        self.apply_sum += seconds;
        self.apply_count += 1;
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let b = self.backend;
        let _ = writeln!(s, "# HELP peerwall_policy_generation Policies applied since the agent started.\n# TYPE peerwall_policy_generation gauge\npeerwall_policy_generation{{backend=\"{b}\"}} {}", self.generation);
        let _ = writeln!(s, "# HELP peerwall_apply_seconds Time to validate, compile and apply a policy.\n# TYPE peerwall_apply_seconds histogram");
        for (i, le) in APPLY_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                s,
                "peerwall_apply_seconds_bucket{{backend=\"{b}\",le=\"{le}\"}} {}",
                self.apply_buckets[i]
            );
        }
        let _ = writeln!(s, "peerwall_apply_seconds_bucket{{backend=\"{b}\",le=\"+Inf\"}} {}\npeerwall_apply_seconds_sum{{backend=\"{b}\"}} {}\npeerwall_apply_seconds_count{{backend=\"{b}\"}} {}", self.apply_count, self.apply_sum, self.apply_count);
        let _ = writeln!(s, "# HELP peerwall_apply_errors_total Applies the kernel refused (the previous policy stayed).\n# TYPE peerwall_apply_errors_total counter\npeerwall_apply_errors_total{{backend=\"{b}\"}} {}", self.apply_errors);
        let _ = writeln!(s, "# HELP peerwall_invalid_policies_total Policy changes refused by validation (the previous policy stayed).\n# TYPE peerwall_invalid_policies_total counter\npeerwall_invalid_policies_total {}", self.invalid_policies);
        let _ = writeln!(s, "# HELP peerwall_drift_repairs_total Tables restored after someone deleted or edited them.\n# TYPE peerwall_drift_repairs_total counter\npeerwall_drift_repairs_total {}", self.drift_repairs);
        let _ = writeln!(s, "# HELP peerwall_rule_packets_total Packets that hit a rule (policy: the chain policy decided).\n# TYPE peerwall_rule_packets_total counter");
        for r in &self.rules {
            let _ = writeln!(
                s,
                "peerwall_rule_packets_total{{table=\"{}\",chain=\"{}\",rule=\"{}\"}} {}",
                esc(&r.table),
                esc(&r.chain),
                esc(&r.rule),
                r.packets
            );
        }
        let _ = writeln!(s, "# HELP peerwall_rule_bytes_total Bytes that hit a rule.\n# TYPE peerwall_rule_bytes_total counter");
        for r in &self.rules {
            let _ = writeln!(
                s,
                "peerwall_rule_bytes_total{{table=\"{}\",chain=\"{}\",rule=\"{}\"}} {}",
                esc(&r.table),
                esc(&r.chain),
                esc(&r.rule),
                r.bytes
            );
        }
        s
    }
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Shared metrics.
pub type Shared = Arc<Mutex<AgentMetrics>>;

/// What a component exposes on `/metrics` and `/readyz`.
pub trait Exposition {
    /// Prometheus text exposition.
    fn render(&self) -> String;
    /// Whether `/readyz` answers ready.
    fn ready(&self) -> bool;
}

impl Exposition for AgentMetrics {
    fn render(&self) -> String {
        AgentMetrics::render(self)
    }
    fn ready(&self) -> bool {
        self.ready
    }
}

/// What the protection controller reports.
#[derive(Debug, Default, Clone)]
pub struct ControllerMetrics {
    /// Caches synced and reconciling.
    pub ready: bool,
    /// Peer clusters (tenant namespaces) seen.
    pub peers: u64,
    /// Offloaded pod addresses published, over all peers.
    pub offloaded_addresses: u64,
    /// Addresses held back (waiting for another tenant to release them).
    pub held_back_addresses: u64,
    /// Gateway FirewallConfigurations written.
    pub gateway_writes: u64,
    /// NetworkPolicies applied.
    pub network_policy_writes: u64,
    /// NetworkPolicies removed.
    pub network_policy_removals: u64,
    /// Reconciles that failed (retried).
    pub reconcile_errors: u64,
}

impl Exposition for ControllerMetrics {
    fn render(&self) -> String {
        let mut s = String::new();
        for (name, kind, help, v) in [
            (
                "peerwall_controller_peers",
                "gauge",
                "Peer clusters (tenant namespaces).",
                self.peers,
            ),
            (
                "peerwall_controller_offloaded_addresses",
                "gauge",
                "Offloaded pod addresses in gateway configurations.",
                self.offloaded_addresses,
            ),
            (
                "peerwall_controller_held_back_addresses",
                "gauge",
                "Addresses waiting for another tenant to release them.",
                self.held_back_addresses,
            ),
            (
                "peerwall_controller_gateway_writes_total",
                "counter",
                "Gateway FirewallConfigurations written.",
                self.gateway_writes,
            ),
            (
                "peerwall_controller_network_policy_writes_total",
                "counter",
                "NetworkPolicies applied.",
                self.network_policy_writes,
            ),
            (
                "peerwall_controller_network_policy_removals_total",
                "counter",
                "NetworkPolicies removed.",
                self.network_policy_removals,
            ),
            (
                "peerwall_controller_reconcile_errors_total",
                "counter",
                "Reconciles that failed (retried with backoff).",
                self.reconcile_errors,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        s
    }
    fn ready(&self) -> bool {
        self.ready
    }
}

/// Answer one request: `/metrics` (Prometheus text), `/healthz`, `/readyz`.
fn respond<M: Exposition>(path: &str, metrics: &Mutex<M>) -> Response<Full<Bytes>> {
    let (status, ctype, body) = match path {
        "/metrics" => match metrics.lock() {
            Ok(m) => (StatusCode::OK, "text/plain; version=0.0.4", m.render()),
            Err(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                "poisoned\n".into(),
            ),
        },
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => match metrics.lock() {
            Ok(m) if m.ready() => (StatusCode::OK, "text/plain", "ready\n".into()),
            _ => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "not ready\n".into(),
            ),
        },
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    r
}

/// Serve on `addr` (hyper, HTTP/1.1, the webhook's stack) from a thread of its own with a
/// small runtime, so the synchronous directory source and the async Kubernetes sources serve
/// alike; returns the bound address.
pub fn serve<M: Exposition + Send + 'static>(
    addr: SocketAddr,
    metrics: Arc<Mutex<M>>,
) -> std::io::Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let bound = std_listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "metrics listener unusable; no metrics served");
                        return;
                    }
                };
                loop {
                    let (stream, _) = match listener.accept().await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::debug!(error = %e, "metrics accept failed");
                            continue;
                        }
                    };
                    let metrics = metrics.clone();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let r = respond(req.uri().path(), &metrics);
                            async move { Ok::<_, std::convert::Infallible>(r) }
                        });
                        if let Err(e) = hyper::server::conn::http1::Builder::new()
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                            .await
                        {
                            tracing::debug!(error = %e, "metrics request failed");
                        }
                    });
                }
            })
        })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let mut m = AgentMetrics {
            backend: "nftables",
            ..Default::default()
        };
        m.observe_apply(0.02);
        m.generation = 1;
        m.rules.push(RuleCounter {
            table: "t".into(),
            chain: "c".into(),
            rule: "r\"1".into(),
            packets: 3,
            bytes: 252,
        });
        let s = m.render();
        assert!(s.contains("peerwall_policy_generation{backend=\"nftables\"} 1"));
        assert!(s.contains("peerwall_apply_seconds_bucket{backend=\"nftables\",le=\"0.01\"} 0"));
        assert!(s.contains("peerwall_apply_seconds_bucket{backend=\"nftables\",le=\"0.025\"} 1"));
        assert!(s.contains("peerwall_apply_seconds_count{backend=\"nftables\"} 1"));
        assert!(
            s.contains("peerwall_rule_packets_total{table=\"t\",chain=\"c\",rule=\"r\\\"1\"} 3")
        );
    }
}
