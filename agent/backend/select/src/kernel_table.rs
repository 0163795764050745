//! The kernel's connection table for the bpf backend's kernel-conntrack mode
//! ([`peerwall_backend_bpf::backend::KernelTable`]): listed and ended over ctnetlink, as the
//! nftables backend does it ([`peerwall_backend_nftables::conntrack::Conntrack`]), in the
//! namespace the backend's thread is in.

use std::collections::HashMap;

use peerwall_backend::{BackendError, Flow};
use peerwall_backend_bpf::backend::KernelTable;
use peerwall_backend_nftables::conntrack::Conntrack;

const NAME: &str = peerwall_backend_bpf::backend::NAME;

/// `IPPROTO_UDP`.
const UDP: u8 = 17;

/// ctnetlink in this namespace; a rewritten connection (Liqo's remapping NAT) is listed as
/// the forward hook sees it and ended by its original tuple.
#[derive(Debug, Default)]
pub struct CtTable {
    ct: Conntrack,
    /// The last listing's rewritten connections: as seen → original tuple.
    listed: HashMap<Flow, Flow>,
    /// What keeps the kernel tracking ([`crate::tracking`]).
    tracking: crate::tracking::Tracking,
}

impl KernelTable for CtTable {
    fn flows(&mut self) -> Result<Vec<Flow>, BackendError> {
        let tracked = self
            .ct
            .list()
            .map_err(BackendError::host(NAME, "listing the kernel's connections"))?;
        let (seen, rewritten) = peerwall_backend_nftables::conntrack::as_seen(tracked);
        self.listed = rewritten;
        Ok(seen)
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

    fn keep_tracking(&mut self, v4: bool, v6: bool) -> Result<Vec<&'static str>, BackendError> {
        self.tracking.keep(v4, v6)
    }
}

/// Whether the kernel tracks connections of a family in this namespace (a NAT rule or a
/// conntrack match of that family makes it; a Liqo gateway's remapping does): a datagram
/// from a socket of its own over loopback, then whether ctnetlink can delete its entry (one
/// lookup of its tuple; a listing walked the whole table, every namespace's buckets, twice
/// per gateway load: `cargo xtask bench-peers`). IPv4 with `v6` false, IPv6 with it true;
/// false where loopback cannot carry it (down, or without the family's address).
pub fn tracks(v6: bool) -> bool {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket};
    let lo: IpAddr = if v6 {
        Ipv6Addr::LOCALHOST.into()
    } else {
        Ipv4Addr::LOCALHOST.into()
    };
    let Ok(sock) = UdpSocket::bind((lo, 0)) else {
        return false;
    };
    let Ok(from) = sock.local_addr() else {
        return false;
    };
    // The discard port: nobody answers, the entry is made by the datagram alone.
    if sock.send_to(b"peerwall", (lo, 9)).is_err() {
        return false;
    }
    let probe = Flow {
        src: lo,
        dst: lo,
        proto: UDP,
        sport: from.port(),
        dport: 9,
    };
    Conntrack::default()
        .delete(&[probe])
        .is_ok_and(|deleted| deleted == 1)
}
