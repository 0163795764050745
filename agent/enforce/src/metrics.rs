//! What the agent and the controller know about themselves: their state ([`AgentMetrics`],
//! [`GatewayMetrics`], [`ControllerMetrics`]), which the engine and the controllers update;
//! how it is shown ([`exposition`]: Prometheus text, `/events`); where it is served ([`http`]:
//! `/metrics`, `/healthz`, `/readyz`, `/events` over hyper, from a thread of its own).
//!
//! Labels are bounded by the policy itself (table, chain and rule names of the applied policy);
//! nothing per packet or per address.

pub mod exposition;
pub mod http;

pub use exposition::Exposition;
pub use http::{serve, serve_agent, serve_endpoints, Endpoints, EVENTS_NEXT_HEADER};

use std::sync::{Arc, Mutex};

use peerwall_backend::RuleCounter;

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
    /// Applies that changed only set elements (address slices, in O(changes)).
    pub set_updates: u64,
    /// Connections ended because a NetworkPolicy change no longer allows them.
    pub flows_ended: u64,
    /// Failures to list or end connections after a NetworkPolicy change.
    pub flow_end_errors: u64,
    /// Rule counters of the applied policy.
    pub rules: Vec<RuleCounter>,
    /// Whether a policy is in force.
    pub ready: bool,
    /// The backend's recent events and drop counts ([`crate::events`]).
    pub events: crate::events::EventLog,
    /// The emergency switch is on: nothing is enforced.
    pub allow_all: bool,
    /// Connection-tracking table fill: (entries, capacity).
    pub conntrack: Option<(u64, u64)>,
    /// A gateway's bpf datapath is loading while nftables enforces its policy meanwhile
    /// ([`crate::enforcement::Loading`]).
    pub loading: bool,
    /// The policy source does not answer (the API server is away): not ready, the last good
    /// policy stays in force.
    pub source_down: bool,
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
}

/// The agent in gateway-pod mode: one [`AgentMetrics`] per gateway enforced on this node,
/// labelled `gateway="<peer cluster id>"` (bounded by the peers whose gateways run here).
#[derive(Debug, Default)]
pub struct GatewayMetrics {
    /// The node's gateway pods have been listed.
    pub synced: bool,
    /// Each enforced gateway's metrics, by peer cluster id.
    pub gateways: std::collections::BTreeMap<String, Shared>,
    /// The agent runs with events on: `/events` answers (empty) before the first gateway.
    pub events: bool,
    /// With `--cni-boot`: whether `peerwall-boot` is in the node's CNI chain.
    pub cni_boot: Option<bool>,
}

/// Shared metrics.
pub type Shared = Arc<Mutex<AgentMetrics>>;

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
    /// AddressSet slices written.
    pub slice_writes: u64,
    /// Empty AddressSet slices deleted.
    pub slice_deletes: u64,
    /// NetworkPolicies applied.
    pub network_policy_writes: u64,
    /// NetworkPolicies removed.
    pub network_policy_removals: u64,
    /// Reconciles that failed (retried).
    pub reconcile_errors: u64,
    /// Configurations not written: too large for etcd with every address set moved into
    /// AddressSets (their previous version stays in force).
    pub too_large: u64,
    /// Liqo gateway pods without enforcement (no ready agent on their node, no sidecar) for
    /// longer than the grace period.
    pub unprotected_gateways: u64,
    /// Peers whose gateway configuration no host has applied past the grace period.
    pub unenforced_peers: u64,
}
