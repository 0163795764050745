//! [`InNetns`]: any [`Backend`] owned by a thread that entered another network namespace (a
//! gateway pod's). Every call runs on that thread, so `nft` (its child), netlink, the FIB and
//! program attachments all target that namespace, while the caller's own sockets (API server
//! connection, `/metrics`) stay where it runs. bpffs is a mount, not part of the network
//! namespace: bpf pins stay under the host's `/sys/fs/bpf`.

use std::os::fd::AsRawFd;
use std::sync::mpsc;

use peerwall_policy::ir::Policy;

use crate::{Backend, Drift, EventError, EventSource, HostInterface, RuleCounter};

/// Why a call into another namespace failed.
#[derive(Debug, thiserror::Error)]
pub enum InNetnsError<E: std::error::Error + 'static> {
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
    /// The backend itself failed.
    #[error(transparent)]
    Backend(E),
}

type Job<B> = Box<dyn FnOnce(&mut B) + Send>;

/// A backend living on a thread inside network namespace `ns`: a name (`/run/netns/<ns>`, as
/// `ip netns` makes them) or a path to a namespace file (`/proc/<pid>/ns/net`, a pod's).
pub struct InNetns<B: Backend> {
    ns: String,
    name: &'static str,
    tx: mpsc::Sender<Job<B>>,
}

impl<B: Backend + 'static> InNetns<B> {
    /// Start a thread in `ns` and build the backend there with `make`. The thread holds the
    /// namespace alive until the backend is dropped.
    pub fn spawn(
        ns: &str,
        make: impl FnOnce() -> Result<B, B::Error> + Send + 'static,
    ) -> Result<Self, InNetnsError<B::Error>> {
        let enter = |source| InNetnsError::Enter {
            ns: ns.to_string(),
            source,
        };
        let path = if ns.starts_with('/') {
            std::path::PathBuf::from(ns)
        } else {
            std::path::Path::new("/run/netns").join(ns)
        };
        let file = std::fs::File::open(path).map_err(enter)?;
        let (tx, rx) = mpsc::channel::<Job<B>>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<&'static str, InNetnsError<B::Error>>>();
        let owned = ns.to_string();
        std::thread::Builder::new()
            .name(format!("enforcer-{ns}"))
            .spawn(move || {
                // SAFETY: setns on a valid namespace fd; affects only this thread.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let source = std::io::Error::last_os_error();
                    // The receiver only goes away if the caller gave up waiting.
                    let _ = ready_tx.send(Err(InNetnsError::Enter { ns: owned, source }));
                    return;
                }
                let mut backend = match make() {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = ready_tx.send(Err(InNetnsError::Backend(e)));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(backend.name()));
                for job in rx {
                    job(&mut backend);
                }
            })
            .map_err(enter)?;
        let name = ready_rx
            .recv()
            .map_err(|_| InNetnsError::Gone(ns.to_string()))??;
        Ok(Self {
            ns: ns.to_string(),
            name,
            tx,
        })
    }

    /// Run `f` on the backend, in the namespace.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut B) -> R + Send + 'static,
    ) -> Result<R, InNetnsError<B::Error>> {
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
        f: impl FnOnce(&mut B) -> Result<R, B::Error> + Send + 'static,
    ) -> Result<R, InNetnsError<B::Error>> {
        self.call(f)?.map_err(InNetnsError::Backend)
    }
}

impl<B: Backend + 'static> Backend for InNetns<B> {
    type Report = B::Report;
    type Error = InNetnsError<B::Error>;

    fn name(&self) -> &'static str {
        self.name
    }

    fn apply(&mut self, policy: &Policy) -> Result<Self::Report, Self::Error> {
        let p = policy.clone();
        self.call_backend(move |b| b.apply(&p))
    }

    fn update_sets(
        &mut self,
        policy: &Policy,
        changes: &[peerwall_policy::ir::SetChange],
    ) -> Result<Self::Report, Self::Error> {
        let (p, c) = (policy.clone(), changes.to_vec());
        self.call_backend(move |b| b.update_sets(&p, &c))
    }

    fn delete(&mut self) -> Result<Vec<String>, Self::Error> {
        self.call_backend(|b| b.delete())
    }

    fn counters(&mut self) -> Result<Vec<RuleCounter>, Self::Error> {
        self.call_backend(|b| b.counters())
    }

    fn drift(&mut self) -> Result<Vec<Drift>, Self::Error> {
        self.call_backend(|b| b.drift())
    }

    fn repair(&mut self) -> Result<Vec<Drift>, Self::Error> {
        self.call_backend(|b| b.repair())
    }

    fn allow_all(&mut self) -> Result<bool, Self::Error> {
        self.call_backend(|b| b.allow_all())
    }

    fn conntrack(&mut self) -> Result<Option<(u64, u64)>, Self::Error> {
        self.call_backend(|b| b.conntrack())
    }

    fn flows(&mut self) -> Result<Vec<crate::Flow>, Self::Error> {
        self.call_backend(|b| b.flows())
    }

    fn end_flows(&mut self, flows: &[crate::Flow]) -> Result<usize, Self::Error> {
        let flows = flows.to_vec();
        self.call_backend(move |b| b.end_flows(&flows))
    }

    fn events(&mut self) -> Result<Box<dyn EventSource>, EventError> {
        // Made on the namespace's thread (NFLOG and interface-name sockets belong to the
        // namespace they are made in), read from any.
        self.call(|b| b.events()).map_err(|e| EventError::Io {
            what: "opening the event source in the enforcer's namespace",
            source: std::io::Error::other(e.to_string()),
        })?
    }

    fn environment(&self) -> Vec<HostInterface> {
        // A namespace whose thread is gone has no interfaces to follow.
        self.call(|b| b.environment()).unwrap_or_default()
    }

    fn release_boot(&mut self, table: &str, tunnel: &str) -> Result<bool, Self::Error> {
        let (table, tunnel) = (table.to_string(), tunnel.to_string());
        self.call_backend(move |b| b.release_boot(&table, &tunnel))
    }
}
