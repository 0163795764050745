//! A bpf gateway's start on a busy node: its policy in force through nftables while its
//! datapath waits for its turn to load, then handed over to the datapath.
//!
//! A node's gateways load their bpf datapaths a few at a time (`peerwall_kube`'s
//! `gateway_pods::gate`, one load per CPU: maps created, programs verified). After a node's
//! reboot, the last of 50 gateways waited 7.4 s behind its boot policy, which drops every
//! packet from the tunnel, allowed or not (`cargo xtask bench-peers`). A gateway that finds
//! no free turn opens an nftables enforcer in its namespace instead, and applies its policy
//! there as soon as the policy source has listed, in milliseconds; its datapath loads on a
//! thread of its own meanwhile ([`Loading`]). Both enforcers render the same policy and the
//! reference evaluator judges both (`tests/differential.rs`), so what passes meanwhile is
//! what the policy allows: the hand-over changes which kernel code decides, not the verdict.
//!
//! The hand-over ([`Enforcement::take_over`]), once the load is done: the datapath applies the
//! policy in force, and only then does the nftables enforcer withdraw its tables
//! ([`peerwall_backend::Enforce::withdraw`]): for a moment both filter (a packet passes both
//! only if the policy allows it), never neither. A refused apply keeps nftables in force and
//! is tried again; a load that fails leaves nftables enforcing the policy, logged as an error
//! and shown by `peerwall_datapath_loading`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use peerwall_backend::Backend;

use super::Enforcement;

/// How long after a refused hand-over it is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// A datapath loading on a thread of its own while the enforcement's backend (nftables)
/// keeps its policy in force. Dropped (the gateway stopped), it tells the load to give up and
/// waits for its thread: a load that ends after its gateway's pins were removed would pin
/// them again.
pub struct Loading {
    rx: mpsc::Receiver<anyhow::Result<Box<dyn Backend>>>,
    since: Instant,
    /// Loaded; its first apply was refused, tried again from the instant.
    ready: Option<(Box<dyn Backend>, Instant)>,
    /// Read the datapath's events once it took over (the bridge has none).
    events: bool,
    cancel: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Loading {
    /// Run `load` on a thread named `name`; the enforcement takes its backend over once it
    /// returns. `load` is given the flag set once the gateway stopped: it should give up, and
    /// remove what it made. `events`: start reading the datapath's events then.
    pub fn spawn(
        name: String,
        events: bool,
        load: impl FnOnce(&AtomicBool) -> anyhow::Result<Box<dyn Backend>> + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let span = tracing::Span::current();
        let thread = {
            let cancel = cancel.clone();
            std::thread::Builder::new().name(name).spawn(move || {
                let _e = span.enter();
                // The receiver is gone when the gateway stopped meanwhile: nothing to hand over.
                let _ = tx.send(load(&cancel));
            })?
        };
        Ok(Self {
            rx,
            since: Instant::now(),
            ready: None,
            events,
            cancel,
            thread: Some(thread),
        })
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the thread loading the datapath panicked");
            }
        }
        // A datapath loaded and never handed over (the gateway stopped first) is attached to
        // nothing: its pins go, so that none is left half-loaded.
        let loaded = self.ready.take().map(|(b, _)| b);
        for mut b in loaded
            .into_iter()
            .chain(self.rx.try_recv().ok().and_then(Result::ok))
        {
            if let Err(e) = b.delete() {
                tracing::warn!(error = %format!("{e:#}"), "could not remove the pins of a datapath loaded for a gateway that stopped");
            }
        }
    }
}

impl Enforcement {
    /// Enforce through the current backend (nftables) until `loading`'s datapath takes over
    /// ([`Enforcement::take_over`]).
    pub fn with_loading(mut self, loading: Loading) -> Self {
        let name = self.backend.name();
        self.update(|m| {
            m.loading = true;
            m.backend = name;
        });
        self.loading = Some(loading);
        self
    }

    /// Whether a datapath is still loading to take over from the backend in force.
    pub fn loading(&self) -> bool {
        self.loading.is_some()
    }

    /// The backend's name as conditions and `peerwall status` show it: while the datapath
    /// loads (or after its load failed), which enforces meanwhile and what became of the load.
    pub fn backend_name(&self) -> &'static str {
        if self.loading.is_some() {
            "nftables (bpf loading)"
        } else if self.load_failed {
            "nftables (bpf failed to load)"
        } else {
            self.backend.name()
        }
    }

    /// Hand over to the loaded datapath, if its load is done: it applies the policy in force,
    /// then the nftables enforcer withdraws. True when it took over now. Called by the
    /// agent's loop until it did; cheap while the load runs.
    pub fn take_over(&mut self) -> bool {
        let Some(l) = self.loading.as_mut() else {
            return false;
        };
        if l.ready.is_none() {
            let loaded = match l.rx.try_recv() {
                Err(mpsc::TryRecvError::Empty) => return false,
                Ok(r) => r,
                Err(mpsc::TryRecvError::Disconnected) => {
                    Err(anyhow::anyhow!("the thread loading it ended"))
                }
            };
            match loaded {
                Ok(b) => l.ready = Some((b, Instant::now())),
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), backend = self.backend.name(), "the datapath could not load; the policy stays in force through the backend that enforces it meanwhile");
                    self.loading = None;
                    self.load_failed = true;
                    return false;
                }
            }
        }
        // The policy in force carries the boot tables while the peer's own table is not in
        // it (`with_boot_tables`): the datapath enforces them as the bridge did, and the
        // bridge's copy goes with its other tables.
        let Some((mut next, at)) = l.ready.take() else {
            return false;
        };
        if at > Instant::now() {
            l.ready = Some((next, at));
            return false;
        }
        // The interfaces as they are before the apply lists them: one that appears while the
        // datapath applies (a gateway's Geneve link plumbed meanwhile) differs from this, so
        // the next upkeep applies again and attaches to it. Read after the apply, it would
        // count as seen and stay unattached, behind the guard, until some other change.
        let env = next.environment();
        if let Some(policy) = &self.enforced {
            if let Err(e) = next.apply(policy) {
                tracing::warn!(error = %format!("{e:#}"), retry_secs = RETRY.as_secs(), "the loaded datapath refused the policy in force; nftables keeps enforcing it");
                l.ready = Some((next, Instant::now() + RETRY));
                return false;
            }
        }
        let (since, events) = (l.since, l.events);
        self.loading = None;
        let mut bridge = std::mem::replace(&mut self.backend, next);
        // Nothing applied yet: the bridge holds at most the boot policy, which the datapath
        // holds (and releases) from now on.
        if self.enforced.is_some() {
            if let Err(e) = bridge.withdraw() {
                tracing::warn!(error = %format!("{e:#}"), "the nftables tables of the start stay (they enforce the same policy as the datapath)");
            }
        }
        drop(bridge);
        if let Some(b) = self.boot.as_mut() {
            b.held = false;
        }
        self.hold_boot();
        self.last_env = Some(env);
        self.counters_read = None;
        let name = self.backend.name();
        self.update(|m| {
            m.loading = false;
            m.backend = name;
        });
        tracing::info!(
            backend = name,
            ms = since.elapsed().as_secs_f64() * 1e3,
            applied = self.enforced.is_some(),
            "the datapath took over from nftables"
        );
        if events {
            if let Err(e) = self.start_events() {
                tracing::error!(error = %e, "no events from this gateway");
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_loading_tells_its_load_to_stop_and_waits_for_it() {
        let (ended_tx, ended) = mpsc::channel();
        let loading = Loading::spawn("load-test".into(), false, move |stop| {
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            // What a load does once told: removes what it made, then ends.
            std::thread::sleep(Duration::from_millis(50));
            ended_tx.send(()).unwrap();
            Err(anyhow::anyhow!("stopped"))
        })
        .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(ended.try_recv().is_err(), "the load runs until told");
        drop(loading);
        assert!(
            ended.try_recv().is_ok(),
            "the drop returned before the load had ended"
        );
    }
}
