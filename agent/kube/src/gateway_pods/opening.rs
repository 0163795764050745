//! Opening one gateway's enforcer on its thread, inside the gateway pod's network namespace:
//! the boot policy in force first, the bpf datapath's turn to load ([`super::gate`]), the
//! enforcer opened and its programs verified, the gateway's handle recorded. The gateway's
//! policy source lists meanwhile (`agent::run_opening`): nothing is applied before
//! [`Opening::open`] returns.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;

use super::{gate, handles};
use crate::enforcement::{Boot, Enforcement};
use crate::metrics::AgentMetrics;

/// What opening a gateway's enforcer needs, moved onto the gateway's thread.
pub(super) struct Opening {
    /// The gateway's backend (bpf: its pins under the gateway's directory).
    pub backend: peerwall_backend_select::Settings,
    /// The gateway pod's network namespace (a `/proc/<pid>/ns/net` path).
    pub ns: String,
    /// The node's turns to load a bpf datapath (None: nftables, which opens in milliseconds).
    pub gate: Option<Arc<gate::Gate>>,
    /// The peer's boot policy, in force until the peer's configuration is.
    pub boot: Option<Boot>,
    pub metrics: Arc<Mutex<AgentMetrics>>,
    pub audit: bool,
    pub events: bool,
    /// The gateway's pin directory name and its handle (`peerwall … --gateway`).
    pub pin_name: String,
    pub handle: handles::Handle,
    /// Where no turn to load is free: enforce the policy through nftables meanwhile and hand
    /// over once the datapath loaded (`crate::enforcement::Loading`).
    pub bridge: bool,
}

impl Opening {
    /// The gateway's enforcement, its boot policy held.
    pub(super) fn open(mut self) -> anyhow::Result<Enforcement> {
        let (backend, ns) = (&self.backend, &self.ns);
        // A bpf gateway may wait for its turn: its boot policy goes in first, as the nftables
        // table the bpf backend would hold it in, unless a datapath pinned for it still
        // filters (a restarted agent: what is in force stays). Before the load, not beside
        // it: the load asks which families the kernel tracks here, and the boot table's
        // tracking is part of the answer.
        let filtering = self.gate.is_some()
            && peerwall_backend_select::installed::still_filtering(&backend.pin_dir);
        if let (Some(_), Some(b), false) = (&self.gate, self.boot.as_mut(), filtering) {
            hold_boot_early(b, backend, ns);
        }
        // Where the datapath must be loaded from scratch (no spare ready: maps created and
        // programs verified, hundreds of milliseconds, longer behind other gateways' turns),
        // the policy goes in through nftables meanwhile.
        let bridge = self.bridge && !filtering;
        let turn = match self.gate.clone() {
            None => None,
            Some(g) => {
                let free = g.try_take();
                if bridge && (free.is_none() || !peerwall_backend_select::spare_datapath_ready()) {
                    drop(free);
                    match self.open_bridge() {
                        Ok(nft) => return self.bridged(nft),
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "could not open nftables to enforce the policy while the datapath loads: the boot policy holds until it is loaded");
                        }
                    }
                    Some(g.wait(gate::LONGEST_WAIT))
                } else {
                    Some(free.unwrap_or_else(|| g.wait(gate::LONGEST_WAIT)))
                }
            }
        };
        let (backend, ns) = (&self.backend, &self.ns);
        let mut enforcer = peerwall_backend_select::open(backend, Some(ns))
            .with_context(|| format!("starting the enforcer in {ns}"))?;
        // The verifier now, in the turn. A failure here is the first apply's to report: it
        // loads again.
        if let Err(e) = enforcer.warm_up() {
            tracing::warn!(error = %format!("{e:#}"), "could not verify the datapath before the policy arrived; the first apply tries again");
        }
        drop(turn);
        let mut enforcement = Enforcement::new(enforcer, self.metrics)
            .audit_all(self.audit)
            .with_boot(self.boot);
        // At once, not after the policy source's first listing: the tunnel may come up
        // meanwhile (held already where it went in before the load).
        enforcement.hold_boot();
        if let Err(e) = handles::write(Path::new(handles::HANDLES), &self.pin_name, &self.handle) {
            tracing::warn!(gateway = %self.handle.pod, error = %e, "could not record the gateway for `peerwall … --gateway`");
        }
        if self.events {
            if let Err(e) = enforcement.start_events() {
                tracing::error!(error = %e, "no events from this gateway");
            }
        }
        Ok(enforcement)
    }
}

impl Opening {
    /// An nftables enforcer in the gateway's namespace, to enforce its policy while its
    /// datapath loads.
    fn open_bridge(&self) -> anyhow::Result<Box<dyn peerwall_backend::Backend>> {
        let nft = peerwall_backend_select::Settings {
            kind: peerwall_backend_select::BackendKind::Nftables,
            events: None,
            ..self.backend.clone()
        };
        peerwall_backend_select::open(&nft, Some(&self.ns))
            .with_context(|| format!("starting the nftables enforcer of the start in {}", self.ns))
    }

    /// The gateway's enforcement through nftables, its datapath loading on a thread of its
    /// own (in its turn) to take over once loaded.
    fn bridged(self, bridge: Box<dyn peerwall_backend::Backend>) -> anyhow::Result<Enforcement> {
        let ns = self.ns.clone();
        let (settings, gate) = (self.backend.clone(), self.gate.clone());
        let load = move |stop: &AtomicBool| -> anyhow::Result<Box<dyn peerwall_backend::Backend>> {
            let stopped = || anyhow::anyhow!("the gateway stopped before its datapath was loaded");
            let turn = gate.map(|g| g.wait_unless(gate::LONGEST_WAIT, stop));
            if stop.load(Ordering::SeqCst) {
                return Err(stopped());
            }
            let mut enforcer = peerwall_backend_select::open(&settings, Some(&ns))
                .with_context(|| format!("starting the enforcer in {ns}"))?;
            if let Err(e) = enforcer.warm_up() {
                tracing::warn!(error = %format!("{e:#}"), "could not verify the datapath before taking over; its first apply tries again");
            }
            drop(turn);
            // Its pins go with it: the gateway's own may be removed already.
            if stop.load(Ordering::SeqCst) {
                if let Err(e) = enforcer.delete() {
                    tracing::warn!(error = %format!("{e:#}"), "could not remove the pins of a datapath loaded for a gateway that stopped");
                }
                return Err(stopped());
            }
            Ok(enforcer)
        };
        let loading = crate::enforcement::Loading::spawn(
            format!("load-{}", self.pin_name),
            self.events,
            load,
        )
        .context("starting the datapath's load")?;
        tracing::info!(
            "the datapath must load (no spare ready, or no turn free): nftables enforces the policy until it is loaded"
        );
        let mut enforcement = Enforcement::new(bridge, self.metrics)
            .audit_all(self.audit)
            .with_boot(self.boot)
            .with_loading(loading);
        enforcement.hold_boot();
        if let Err(e) = handles::write(Path::new(handles::HANDLES), &self.pin_name, &self.handle) {
            tracing::warn!(gateway = %self.handle.pod, error = %e, "could not record the gateway for `peerwall … --gateway`");
        }
        Ok(enforcement)
    }
}

/// Put `boot` in force in the namespace `ns` through an nftables enforcer, as the bpf backend
/// holds it until its datapath filters the tunnel (and releases it then, by name).
fn hold_boot_early(boot: &mut Boot, s: &peerwall_backend_select::Settings, ns: &str) {
    let nft = peerwall_backend_select::Settings {
        kind: peerwall_backend_select::BackendKind::Nftables,
        events: None,
        ..s.clone()
    };
    let held =
        peerwall_backend_select::open(&nft, Some(ns)).and_then(|mut b| boot.hold_in(b.as_mut()));
    match held {
        Ok(true) => tracing::info!("boot policy held in nftables while the gateway waits for its turn to load the datapath"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %format!("{e:#}"), "could not hold the boot policy before loading the datapath (held once it is loaded)"),
    }
}
