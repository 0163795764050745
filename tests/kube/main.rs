//! The Kubernetes side against a real kube-apiserver (v1.20.2 built from Debian's source by
//! `cargo xtask kube-build`, started on loopback per test): webhook, deploy manifests,
//! provider-protection controller, agent status/finalizer, and the end-to-end promise (a pod
//! offloaded by consumer A becomes reachable through A's tunnel and only A's).

mod support;

// The gateway fleet of `cargo xtask bench-peers`: its namespaces, probes and pin watch.
#[allow(dead_code)]
#[path = "../../agent/benches/peers/attached.rs"]
mod attached;
#[allow(dead_code)]
#[path = "../../agent/benches/peers/fleet.rs"]
mod fleet;
#[allow(dead_code)]
#[path = "../../agent/benches/peers/pods.rs"]
mod pods;
#[allow(dead_code)]
#[path = "../../agent/benches/shared/published.rs"]
mod published;
#[allow(dead_code)]
#[path = "../../agent/benches/shared/tenant.rs"]
mod tenant;
#[allow(dead_code)]
#[path = "../../agent/benches/shared/topology.rs"]
mod topology;

mod agent;
mod controller;
mod deploy;
mod e2e;
mod liqo;
mod membership;
mod monitoring;
mod node;
mod outage;
mod size;
mod start_bridge;
mod status;
mod try_page;
mod webhook;
