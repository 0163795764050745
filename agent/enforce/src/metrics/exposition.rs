//! The Prometheus text exposition of the agents' and the controller's state, and their
//! `/events` answers: what [`super::http`] serves.

use std::fmt::Write as _;

use peerwall_backend::RuleCounter;

use super::{AgentMetrics, ControllerMetrics, GatewayMetrics, APPLY_BUCKETS};

/// What a component exposes on `/metrics` and `/readyz`.
pub trait Exposition {
    /// Prometheus text exposition.
    fn render(&self) -> String;
    /// Whether `/readyz` answers ready.
    fn ready(&self) -> bool;
    /// `/events?after=N`: NDJSON of the events numbered after N, and the next mark; None when
    /// the component has no events.
    fn events_after(&self, after: u64) -> Option<(String, u64)> {
        let _ = after;
        None
    }
}

/// `peerwall_build_info`: the release and commit of the process exposing it, first in every
/// exposition (one sample; the label values change only with the binary).
fn build_info() -> String {
    format!(
        "# HELP peerwall_build_info The peerwall release and the commit this process was built from (always 1).\n# TYPE peerwall_build_info gauge\npeerwall_build_info{{version=\"{}\",commit=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION"),
        crate::GIT_COMMIT
    )
}

impl Exposition for AgentMetrics {
    fn render(&self) -> String {
        build_info() + &AgentMetrics::render(self)
    }

    fn events_after(&self, after: u64) -> Option<(String, u64)> {
        self.events.on.then(|| self.events.ndjson_after(after))
    }
    fn ready(&self) -> bool {
        self.ready && !self.source_down
    }
}

impl AgentMetrics {
    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        render_families(vec![self.families("")])
    }

    // size: a list: one entry per metric family, in the order they are exposed.
    /// The metric families, each sample's labels prefixed with `scope` (`gateway="x",` or
    /// empty), in a fixed order so that several agents' families merge index by index.
    fn families(&self, scope: &str) -> Vec<Family> {
        let b = self.backend;
        let base = format!("{scope}backend=\"{b}\"");
        let bare = scope.trim_end_matches(',').to_string();
        let mut apply = Vec::new();
        for (i, le) in APPLY_BUCKETS.iter().enumerate() {
            apply.push(sample(
                "_bucket",
                format!("{base},le=\"{le}\""),
                self.apply_buckets[i],
            ));
        }
        apply.push(sample(
            "_bucket",
            format!("{base},le=\"+Inf\""),
            self.apply_count,
        ));
        apply.push(sample("_sum", base.clone(), self.apply_sum));
        apply.push(sample("_count", base.clone(), self.apply_count));
        let rule = |r: &RuleCounter| {
            format!(
                "{scope}table=\"{}\",chain=\"{}\",rule=\"{}\"",
                esc(&r.table),
                esc(&r.chain),
                esc(&r.rule)
            )
        };
        vec![
            Family::new(
                "peerwall_policy_generation",
                "gauge",
                "Policies applied since the agent started.",
            )
            .with(sample("", base.clone(), self.generation)),
            Family::new(
                "peerwall_apply_seconds",
                "histogram",
                "Time to validate, compile and apply a policy.",
            )
            .with_all(apply),
            Family::new(
                "peerwall_apply_errors_total",
                "counter",
                "Applies the kernel refused (the previous policy stayed).",
            )
            .with(sample("", base.clone(), self.apply_errors)),
            Family::new(
                "peerwall_invalid_policies_total",
                "counter",
                "Policy changes refused by validation (the previous policy stayed).",
            )
            .with(sample("", bare.clone(), self.invalid_policies)),
            Family::new(
                "peerwall_drift_repairs_total",
                "counter",
                "Tables restored after someone deleted or edited them.",
            )
            .with(sample("", bare.clone(), self.drift_repairs)),
            Family::new(
                "peerwall_set_updates_total",
                "counter",
                "Applies that changed only the elements of address sets (AddressSet slices), without recompiling.",
            )
            .with(sample("", bare.clone(), self.set_updates)),
            Family::new(
                "peerwall_flows_ended_total",
                "counter",
                "Tracked connections ended because a NetworkPolicy change no longer allows them.",
            )
            .with(sample("", bare.clone(), self.flows_ended)),
            Family::new(
                "peerwall_flow_end_errors_total",
                "counter",
                "NetworkPolicy changes after which the connections they no longer allow could not be listed or ended.",
            )
            .with(sample("", bare, self.flow_end_errors)),
            Family::new(
                "peerwall_rule_packets_total",
                "counter",
                "Packets that hit a rule (policy: the chain policy decided).",
            )
            .with_all(
                self.rules
                    .iter()
                    .map(|r| sample("", rule(r), r.packets))
                    .collect(),
            ),
            Family::new(
                "peerwall_rule_bytes_total",
                "counter",
                "Bytes that hit a rule.",
            )
            .with_all(
                self.rules
                    .iter()
                    .map(|r| sample("", rule(r), r.bytes))
                    .collect(),
            ),
            Family::new(
                "peerwall_source_connected",
                "gauge",
                "1 while the policy source answers (the Kubernetes watches); 0 while the API server is away (the last good policy stays in force, /readyz fails).",
            )
            .with(sample("", base.clone(), u8::from(!self.source_down))),
            Family::new(
                "peerwall_conntrack_entries",
                "gauge",
                "Flows in the connection-tracking table the datapath relies on (bpf: its flow table, or the kernel's conntrack of the namespace where it reads that for TCP and UDP; nftables: the kernel's conntrack of the namespace).",
            )
            .with_all(
                self.conntrack
                    .iter()
                    .map(|(e, _)| sample("", base.clone(), e))
                    .collect(),
            ),
            Family::new(
                "peerwall_conntrack_capacity",
                "gauge",
                "Capacity of that table: when full, bpf evicts the least recently used flow (its next packet is classified as new), the kernel's conntrack refuses new flows.",
            )
            .with_all(
                self.conntrack
                    .iter()
                    .map(|(_, c)| sample("", base.clone(), c))
                    .collect(),
            ),
            Family::new(
                "peerwall_datapath_loading",
                "gauge",
                "1 while a gateway's bpf datapath loads (waiting for its turn on the node's CPUs) and nftables enforces the same policy meanwhile; stays 1 where the load failed (logged; nftables keeps enforcing).",
            )
            .with(sample("", base.clone(), u8::from(self.loading))),
            Family::new(
                "peerwall_allow_all",
                "gauge",
                "1 while the emergency switch (peerwall allow-all on) lets every packet through.",
            )
            .with(sample("", base.clone(), u8::from(self.allow_all))),
            Family::new(
                "peerwall_drops_total",
                "counter",
                "Packets dropped, rejected or (verdict=\"audit\") that an audited chain would have dropped, per rule, as counted by events (--events).",
            )
            .with_all(
                self.events
                    .drops
                    .iter()
                    .map(|((t, c, r, v), n)| {
                        sample(
                            "",
                            format!(
                                "{scope}table=\"{}\",chain=\"{}\",rule=\"{}\",verdict=\"{v}\"",
                                esc(t),
                                esc(c),
                                esc(r)
                            ),
                            n,
                        )
                    })
                    .collect(),
            ),
        ]
    }
}

/// One metric family of the exposition: its samples are `(name suffix, labels, value)`.
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<(&'static str, String, String)>,
}

impl Family {
    fn new(name: &'static str, kind: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind,
            help,
            samples: Vec::new(),
        }
    }
    fn with(mut self, s: (&'static str, String, String)) -> Self {
        self.samples.push(s);
        self
    }
    fn with_all(mut self, s: Vec<(&'static str, String, String)>) -> Self {
        self.samples.extend(s);
        self
    }
}

fn sample(
    suffix: &'static str,
    labels: String,
    value: impl std::fmt::Display,
) -> (&'static str, String, String) {
    (suffix, labels, value.to_string())
}

/// Text of several agents' families (same order in each): HELP and TYPE once per family.
fn render_families(sets: Vec<Vec<Family>>) -> String {
    let mut s = String::new();
    let Some(first) = sets.first() else {
        return s;
    };
    for (i, f) in first.iter().enumerate() {
        let _ = writeln!(
            s,
            "# HELP {} {}\n# TYPE {} {}",
            f.name, f.help, f.name, f.kind
        );
        for set in &sets {
            for (suffix, labels, value) in
                set.get(i).map(|f| f.samples.as_slice()).unwrap_or_default()
            {
                let braces = if labels.is_empty() {
                    String::new()
                } else {
                    format!("{{{labels}}}")
                };
                let _ = writeln!(s, "{}{suffix}{braces} {value}", f.name);
            }
        }
    }
    s
}

impl Exposition for GatewayMetrics {
    /// Every gateway's events, merged in number order.
    fn events_after(&self, after: u64) -> Option<(String, u64)> {
        let next = crate::events::last_number();
        let mut all: Vec<(u64, peerwall_backend::Event)> = Vec::new();
        let mut on = self.events;
        for m in self.gateways.values() {
            if let Ok(m) = m.lock() {
                on |= m.events.on;
                let (evs, _) = m.events.after(after);
                all.extend(
                    evs.into_iter()
                        .filter(|(n, _)| *n <= next)
                        .map(|(n, e)| (n, e.clone())),
                );
            }
        }
        all.sort_by_key(|(n, _)| *n);
        on.then(|| (crate::events::ndjson(all.iter().map(|(_, e)| e)), next))
    }

    fn render(&self) -> String {
        let mut sets = Vec::new();
        for (peer, m) in &self.gateways {
            if let Ok(m) = m.lock() {
                sets.push(m.families(&format!("gateway=\"{}\",", esc(peer))));
            }
        }
        let mut s = build_info();
        s.push_str(&format!(
            "# HELP peerwall_gateways Liqo gateway pods enforced in on this node.\n# TYPE peerwall_gateways gauge\npeerwall_gateways {}\n",
            self.gateways.len()
        ));
        if let Some(chained) = self.cni_boot {
            s.push_str(&format!(
                "# HELP peerwall_cni_boot_chained Whether peerwall-boot is in the node's CNI chain (--cni-boot): new gateway pods get their boot policy at sandbox creation.\n# TYPE peerwall_cni_boot_chained gauge\npeerwall_cni_boot_chained {}\n",
                u8::from(chained)
            ));
        }
        if sets.is_empty() {
            sets.push(
                AgentMetrics::default()
                    .families("")
                    .into_iter()
                    .map(|mut f| {
                        f.samples.clear();
                        f
                    })
                    .collect(),
            );
        }
        s.push_str(&render_families(sets));
        s
    }
    fn ready(&self) -> bool {
        self.synced
            && self
                .gateways
                .values()
                .all(|m| m.lock().map(|m| m.ready).unwrap_or(false))
    }
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Exposition for ControllerMetrics {
    fn render(&self) -> String {
        let mut s = build_info();
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
                "peerwall_controller_address_set_writes_total",
                "counter",
                "AddressSet slices written (created or changed).",
                self.slice_writes,
            ),
            (
                "peerwall_controller_address_set_deletes_total",
                "counter",
                "Empty AddressSet slices deleted once every agent applied their emptying.",
                self.slice_deletes,
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
                "peerwall_controller_unprotected_gateways",
                "gauge",
                "Liqo gateway pods with no ready peerwall agent on their node and no sidecar (their traffic is not filtered).",
                self.unprotected_gateways,
            ),
            (
                "peerwall_controller_unenforced_peers",
                "gauge",
                "Peers whose gateway configuration no host has applied past the grace period (their traffic is not filtered by it).",
                self.unenforced_peers,
            ),
            (
                "peerwall_controller_reconcile_errors_total",
                "counter",
                "Reconciles that failed (retried with backoff).",
                self.reconcile_errors,
            ),
            (
                "peerwall_controller_too_large_total",
                "counter",
                "FirewallConfigurations not written: larger than etcd stores (1.5 MiB) even with every address set moved into AddressSets; the previous version stays in force, and the controller's error names the object and its size.",
                self.too_large,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// docs/metrics.md lists every metric family the agent (both modes) and the controller
    /// expose, each with its type and its help text word for word, and nothing else.
    #[test]
    fn the_metrics_page_lists_every_metric_as_exposed() {
        let page = include_str!("../../../../docs/metrics.md");
        let node = GatewayMetrics {
            cni_boot: Some(true),
            ..Default::default()
        };
        let text = [
            node.render(),
            AgentMetrics::default().render(),
            ControllerMetrics::default().render(),
        ]
        .concat();
        let mut exposed = std::collections::BTreeSet::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# HELP ") else {
                continue;
            };
            let (name, help) = rest.split_once(' ').unwrap();
            let kind = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("# TYPE {name} ")))
                .unwrap();
            let row = format!("| `{name}` | {kind} |");
            let found = page.lines().find(|l| l.starts_with(&row));
            let row = found.unwrap_or_else(|| panic!("docs/metrics.md has no row {row}"));
            assert!(
                row.ends_with(&format!("| {help} |")),
                "{name}: {help:?} / {row}"
            );
            exposed.insert(name.to_string());
        }
        let listed: std::collections::BTreeSet<String> = page
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split_once('`').map(|(n, _)| n.to_string()))
            .collect();
        assert_eq!(listed, exposed);
    }

    /// Every process names its release and commit, as `peerwall version` does.
    #[test]
    fn every_exposition_names_the_release() {
        let line = format!(
            "peerwall_build_info{{version=\"{}\",commit=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::GIT_COMMIT
        );
        for text in [
            GatewayMetrics::default().render(),
            Exposition::render(&AgentMetrics::default()),
            ControllerMetrics::default().render(),
        ] {
            assert!(text.lines().any(|l| l == line), "{text}");
        }
    }

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
        assert!(s.contains("peerwall_invalid_policies_total 0"));
    }

    #[test]
    fn gateways_share_help_lines_and_carry_their_peer() {
        let mut a = AgentMetrics {
            backend: "bpf",
            generation: 2,
            ..Default::default()
        };
        a.ready = true;
        let b = AgentMetrics {
            backend: "bpf",
            generation: 5,
            ..Default::default()
        };
        let mut g = GatewayMetrics {
            synced: true,
            ..Default::default()
        };
        g.gateways.insert("peer-a".into(), Arc::new(Mutex::new(a)));
        g.gateways.insert("peer-b".into(), Arc::new(Mutex::new(b)));
        let s = Exposition::render(&g);
        assert_eq!(
            s.matches("# TYPE peerwall_policy_generation gauge").count(),
            1
        );
        assert!(s.contains("peerwall_policy_generation{gateway=\"peer-a\",backend=\"bpf\"} 2"));
        assert!(s.contains("peerwall_policy_generation{gateway=\"peer-b\",backend=\"bpf\"} 5"));
        assert!(s.contains("peerwall_invalid_policies_total{gateway=\"peer-b\"} 0"));
        assert!(s.contains("peerwall_gateways 2"));
        assert!(!g.ready(), "peer-b has applied nothing yet");
    }

    #[test]
    fn gateway_mode_events_answer_before_the_first_gateway_when_on() {
        let off = GatewayMetrics::default();
        assert_eq!(off.events_after(0), None, "events off: 404");
        let on = GatewayMetrics {
            events: true,
            ..Default::default()
        };
        let (body, _) = on.events_after(0).expect("events on: answered");
        assert!(body.is_empty(), "no gateway yet, no event: {body}");
    }
}
