//! Real-kernel verdict engines: ask a kernel what it does with one packet.
//!
//! - [`nft`]: `--engine nftables`, the nftables rendering in a scratch gateway namespace;
//! - [`bpf`]: `--engine bpf`, the eBPF datapath under BPF_PROG_TEST_RUN;
//! - [`packet`] crafts probe packets, [`sock`] sends and captures them.
//!
//! Both answer like the reference evaluator (`peerwall_policy::ir::evaluate`): the
//! differential tests hold all three against each other.

pub mod bpf;
pub mod nft;
pub mod packet;
pub mod sock;

use peerwall_backend_nftables::NftError;
use peerwall_netns::NetnsError;
use peerwall_policy::ir::Packet;

pub use nft::NftProbe;

/// Why a probe could not be run or answered.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Namespace plumbing failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// nft failed.
    #[error(transparent)]
    Nft(#[from] NftError),
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Socket {
        /// What was attempted.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
    /// The packet cannot be reproduced in a scratch kernel.
    #[error("cannot probe this packet: {0}")]
    Unsupported(String),
    /// Observation and counters disagree (a bug in peerwall or an unexpected kernel behaviour).
    #[error(
        "kernel observation ({observed}) disagrees with rule counters ({counted}) for {packet}"
    )]
    Inconsistent {
        /// What the wire showed.
        observed: &'static str,
        /// What counters showed.
        counted: &'static str,
        /// Packet.
        packet: String,
    },
    /// The bpf datapath failed.
    #[error(transparent)]
    Bpf(peerwall_backend_bpf::loader::BpfError),
    /// The backend layer failed (the kernel-conntrack probe's sweep of the kernel's table).
    #[error(transparent)]
    Backend(#[from] peerwall_backend::BackendError),
    /// Output of `ip` was not understood.
    #[error("could not read interface {0} from `ip -j link`")]
    Link(String),
}

/// Interface names a set of packets needs.
pub fn interfaces_of<'a>(packets: impl IntoIterator<Item = &'a Packet>) -> Vec<String> {
    let mut v: Vec<String> = packets
        .into_iter()
        .flat_map(|p| p.iif.iter().chain(p.oif.iter()).cloned())
        .collect();
    v.sort();
    v.dedup();
    v
}
