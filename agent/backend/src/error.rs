//! What a backend call gives back through the [`crate::Backend`] face: the report of an
//! apply, or why the call failed. Each backend keeps its own typed errors and reports; these
//! carry them to callers that drive any backend.

use std::fmt;

/// What an apply did, in the words of the backend that did it: one line a person reads
/// (nftables names the tables it created, updated, kept and removed; bpf the slot it wrote and
/// how many entries changed), and what of the policy this backend does not enforce itself
/// (each a sentence naming the rule). Callers log the warnings when they change, not on every
/// apply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The line.
    pub summary: String,
    /// What is not enforced, and why.
    pub warnings: Vec<String>,
}

impl Report {
    /// A report with no warnings.
    pub fn new(summary: impl Into<String>) -> Self {
        Self {
            summary: summary.into(),
            warnings: Vec::new(),
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary)
    }
}

/// Whose fault a failed call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// What was asked: the policy is one this backend cannot enforce, or what is installed
    /// cannot do what was asked (bad input; nothing changed).
    Input,
    /// The host: the kernel, a tool or a file refused (nothing changed).
    Host,
}

/// Why a backend call failed. The previous policy stays in force.
#[derive(Debug, thiserror::Error)]
#[error("{action} with {backend}: {source}")]
pub struct BackendError {
    /// `nftables` or `bpf`.
    pub backend: &'static str,
    /// What was attempted (`applying`, `reading rule counters`, …).
    pub action: &'static str,
    /// Whose fault it is.
    pub fault: Fault,
    /// The backend's own error.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl BackendError {
    /// A failure of the host while `backend` was doing `action`: for `map_err`.
    pub fn host<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        backend: &'static str,
        action: &'static str,
    ) -> impl FnOnce(E) -> Self {
        Self::with(Fault::Host, backend, action)
    }

    fn with<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        fault: Fault,
        backend: &'static str,
        action: &'static str,
    ) -> impl FnOnce(E) -> Self {
        move |e| Self {
            backend,
            action,
            fault,
            source: e.into(),
        }
    }

    /// What was asked of `backend` while doing `action` cannot be done: for `map_err`.
    pub fn input<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        backend: &'static str,
        action: &'static str,
    ) -> impl FnOnce(E) -> Self {
        Self::with(Fault::Input, backend, action)
    }

    /// Whether what was asked, not the host, is at fault.
    pub fn refused_input(&self) -> bool {
        self.fault == Fault::Input
    }
}
