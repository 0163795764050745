//! [`InNetns`]: any [`Backend`] owned by a thread that entered another network namespace (a
//! gateway pod's). Every call runs on that thread, so `nft` (its child), netlink, the FIB and
//! program attachments all target that namespace, while the caller's own sockets (API server
//! connection, `/metrics`) stay where it runs. bpffs is a mount, not part of the network
//! namespace: bpf pins stay under the host's `/sys/fs/bpf`.

use std::os::fd::AsRawFd;
use std::sync::mpsc;

use peerwall_policy::ir::Policy;

use crate::{
    Backend, BackendError, Drift, Enforce, EventError, EventSource, Fault, HoldBoot, HostInterface,
    Observe, Report, Revoke, RuleCounter,
};

/// Why a call into another namespace failed before the backend could answer.
#[derive(Debug, thiserror::Error)]
pub enum InNetnsError {
    /// The namespace could not be opened or entered.
    #[error("entering network namespace {ns}: {source}")]
    Enter {
        /// Namespace name.
        ns: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The thread owning the backend is gone.
    #[error("the enforcer thread in network namespace {0} ended")]
    Gone(String),
}

type Job = Box<dyn FnOnce(&mut dyn Backend) + Send>;

/// A backend living on a thread inside network namespace `ns`: a name (`/run/netns/<ns>`, as
/// `ip netns` makes them) or a path to a namespace file (`/proc/<pid>/ns/net`, a pod's).
pub struct InNetns {
    ns: String,
    name: &'static str,
    tx: mpsc::Sender<Job>,
}

impl InNetns {
    /// Start a thread in `ns` and build the backend there with `make` (errors as `make`
    /// gives them; entering the namespace fails as [`BackendError`] of backend `backend`).
    /// The thread holds the namespace alive until the backend is dropped.
    pub fn spawn(
        ns: &str,
        backend: &'static str,
        make: impl FnOnce() -> Result<Box<dyn Backend>, BackendError> + Send + 'static,
    ) -> Result<Self, BackendError> {
        let enter = |source| {
            BackendError::host(backend, "entering the network namespace")(InNetnsError::Enter {
                ns: ns.to_string(),
                source,
            })
        };
        let path = if ns.starts_with('/') {
            std::path::PathBuf::from(ns)
        } else {
            std::path::Path::new("/run/netns").join(ns)
        };
        let file = std::fs::File::open(path).map_err(enter)?;
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<&'static str, BackendError>>();
        let owned = ns.to_string();
        std::thread::Builder::new()
            .name(format!("enforcer-{ns}"))
            .spawn(move || {
                // SAFETY: setns on a valid namespace fd; affects only this thread.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let source = std::io::Error::last_os_error();
                    // The receiver only goes away if the caller gave up waiting.
                    let _ = ready_tx.send(Err(BackendError::host(
                        backend,
                        "entering the network namespace",
                    )(InNetnsError::Enter {
                        ns: owned,
                        source,
                    })));
                    return;
                }
                let mut made = match make() {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(made.name()));
                for job in rx {
                    job(made.as_mut());
                }
            })
            .map_err(enter)?;
        let name = ready_rx.recv().map_err(|_| {
            BackendError::host(backend, "starting")(InNetnsError::Gone(ns.to_string()))
        })??;
        Ok(Self {
            ns: ns.to_string(),
            name,
            tx,
        })
    }

    /// Run `f` on the backend, in the namespace.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Backend) -> R + Send + 'static,
    ) -> Result<R, InNetnsError> {
        let (rtx, rrx) = mpsc::channel();
        let gone = || InNetnsError::Gone(self.ns.clone());
        self.tx
            .send(Box::new(move |b| {
                // The caller waits on the receiver below; it cannot be gone.
                let _ = rtx.send(f(b));
            }))
            .map_err(|_| gone())?;
        rrx.recv().map_err(|_| gone())
    }

    fn call_backend<R: Send + 'static>(
        &self,
        action: &'static str,
        f: impl FnOnce(&mut dyn Backend) -> Result<R, BackendError> + Send + 'static,
    ) -> Result<R, BackendError> {
        self.call(f).map_err(|e| BackendError {
            backend: self.name,
            action,
            fault: Fault::Host,
            source: Box::new(e),
        })?
    }
}

impl Enforce for InNetns {
    fn name(&self) -> &'static str {
        self.name
    }

    fn apply(&mut self, policy: &Policy) -> Result<Report, BackendError> {
        let p = policy.clone();
        self.call_backend("applying", move |b| b.apply(&p))
    }

    fn update_sets(
        &mut self,
        policy: &Policy,
        changes: &[peerwall_policy::ir::SetChange],
    ) -> Result<Report, BackendError> {
        let (p, c) = (policy.clone(), changes.to_vec());
        self.call_backend("updating sets", move |b| b.update_sets(&p, &c))
    }

    fn adopt(&mut self, policy: &Policy) -> Result<(), BackendError> {
        let p = policy.clone();
        self.call_backend("adopting", move |b| b.adopt(&p))
    }

    fn warm_up(&mut self) -> Result<(), BackendError> {
        self.call_backend("warming up", |b| b.warm_up())
    }

    fn delete(&mut self) -> Result<Vec<String>, BackendError> {
        self.call_backend("deleting", |b| b.delete())
    }

    fn withdraw(&mut self) -> Result<Vec<String>, BackendError> {
        self.call_backend("withdrawing", |b| b.withdraw())
    }

    fn repair(&mut self) -> Result<Vec<Drift>, BackendError> {
        self.call_backend("repairing drift", |b| b.repair())
    }

    fn environment(&self) -> Vec<HostInterface> {
        // A namespace whose thread is gone has no interfaces to follow.
        self.call(|b| b.environment()).unwrap_or_default()
    }

    fn classifies_before_nat(&self) -> bool {
        // Fixed per backend; a namespace whose thread is gone answers as nftables would.
        self.call(|b| b.classifies_before_nat()).unwrap_or(false)
    }
}

impl Observe for InNetns {
    fn counters(&mut self) -> Result<Vec<RuleCounter>, BackendError> {
        self.call_backend("reading rule counters", |b| b.counters())
    }

    fn drift(&mut self) -> Result<Vec<Drift>, BackendError> {
        self.call_backend("reading drift", |b| b.drift())
    }

    fn allow_all(&mut self) -> Result<bool, BackendError> {
        self.call_backend("reading the switch", |b| b.allow_all())
    }

    fn conntrack(&mut self) -> Result<Option<(u64, u64)>, BackendError> {
        self.call_backend("reading the flow table", |b| b.conntrack())
    }

    fn flows(&mut self) -> Result<Vec<crate::Flow>, BackendError> {
        self.call_backend("listing connections", |b| b.flows())
    }

    fn events(&mut self) -> Result<Box<dyn EventSource>, EventError> {
        // Made on the namespace's thread (NFLOG and interface-name sockets belong to the
        // namespace they are made in), read from any.
        self.call(|b| b.events()).map_err(|e| EventError::Io {
            what: "opening the event source in the enforcer's namespace",
            source: std::io::Error::other(e.to_string()),
        })?
    }
}

impl Revoke for InNetns {
    fn end_flows(&mut self, flows: &[crate::Flow]) -> Result<usize, BackendError> {
        let flows = flows.to_vec();
        self.call_backend("ending connections", move |b| b.end_flows(&flows))
    }

    fn ended_flows(&mut self) -> Result<Vec<crate::Flow>, BackendError> {
        self.call_backend("listing ended connections", |b| b.ended_flows())
    }

    fn release_flows(&mut self, flows: &[crate::Flow]) -> Result<usize, BackendError> {
        let flows = flows.to_vec();
        self.call_backend("releasing ended connections", move |b| {
            b.release_flows(&flows)
        })
    }
}

impl HoldBoot for InNetns {
    fn release_boot(&mut self, table: &str, tunnel: &str) -> Result<bool, BackendError> {
        let (table, tunnel) = (table.to_string(), tunnel.to_string());
        self.call_backend("releasing the boot table", move |b| {
            b.release_boot(&table, &tunnel)
        })
    }

    fn hold_boot(&mut self, boot: &Policy, tunnel: &str) -> Result<bool, BackendError> {
        let (boot, tunnel) = (boot.clone(), tunnel.to_string());
        self.call_backend("holding the boot policy", move |b| {
            b.hold_boot(&boot, &tunnel)
        })
    }

    fn hold_boot_alone(&mut self, boot: &Policy, tunnel: &str) -> Result<bool, BackendError> {
        let (boot, tunnel) = (boot.clone(), tunnel.to_string());
        self.call_backend("holding the boot policy", move |b| {
            b.hold_boot_alone(&boot, &tunnel)
        })
    }
}
