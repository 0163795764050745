//! The kernel's connection table for the bpf backend's kernel-conntrack mode
//! ([`peerwall_backend_bpf::backend::KernelTable`]): listed and ended over ctnetlink, as the
//! nftables backend does it ([`peerwall_backend_nftables::conntrack::Conntrack`]), in the
//! namespace the backend's thread is in.

use std::collections::HashMap;

use peerwall_backend::{BackendError, Flow};
use peerwall_backend_bpf::backend::KernelTable;
use peerwall_backend_nftables::conntrack::Conntrack;

const NAME: &str = peerwall_backend_bpf::backend::NAME;

/// ctnetlink in this namespace; a rewritten connection (Liqo's remapping NAT) is listed as
/// the forward hook sees it and ended by its original tuple.
#[derive(Debug, Default)]
pub struct CtTable {
    ct: Conntrack,
    /// The last listing's rewritten connections: as seen → original tuple.
    listed: HashMap<Flow, Flow>,
}

impl KernelTable for CtTable {
    fn flows(&mut self) -> Result<Vec<Flow>, BackendError> {
        let tracked = self
            .ct
            .list()
            .map_err(BackendError::host(NAME, "listing the kernel's connections"))?;
        self.listed = tracked
            .iter()
            .filter(|t| t.seen != t.orig)
            .map(|t| (t.seen, t.orig))
            .collect();
        Ok(tracked.into_iter().map(|t| t.seen).collect())
    }

    fn end(&mut self, flows: &[Flow]) -> Result<usize, BackendError> {
        let orig: Vec<Flow> = flows
            .iter()
            .map(|f| self.listed.get(f).copied().unwrap_or(*f))
            .collect();
        self.ct
            .end(&orig)
            .map_err(BackendError::host(NAME, "ending the kernel's connections"))
    }
}
