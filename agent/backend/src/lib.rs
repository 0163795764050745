//! What every backend shares: the reports it gives back and the network namespaces it may
//! enforce in. Implementations: `peerwall-backend-nftables` (one atomic nft transaction) and
//! `peerwall-backend-bpf` (tc/XDP programs over maps; the programs themselves are `ebpf/`).

pub mod netns;

use serde::Serialize;

/// Packet and byte counts of one rule (`table/chain/rule`), as either backend reads them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleCounter {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule name.
    pub rule: String,
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}
