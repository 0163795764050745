//! How the datapath is loaded: [`LoadOptions`] (the flow table's size, how long ended flows
//! stay ended, whose connection table TCP and UDP use) and the globals the loader writes into
//! the object for them.

/// The datapath's global holding how long an ended flow stays ended after its last packet.
pub(super) const ENDED_IDLE_NS: &str = "ENDED_IDLE_NS";
/// The datapath's globals of the kernel-conntrack mode (`ebpf/src/kernel_ct.rs`).
pub(super) const KERNEL_CT: &str = "KERNEL_CT";
pub(super) const NF_CONN_STATUS_OFF: &str = "NF_CONN_STATUS_OFF";

/// Whose connection table the datapath reads for TCP and UDP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Conntrack {
    /// The kernel's where its conntrack kfuncs are there, else its own.
    #[default]
    Auto,
    /// The kernel's (`bpf_skb_ct_lookup`): one table for the kernel and the filter, where
    /// the kernel tracks connections (a Liqo gateway: its NAT). Loading fails without the
    /// kfuncs.
    Kernel,
    /// The datapath's own tables (`FLOWS`, `FLOWS_NEW`), as where the kernel tracks nothing.
    Own,
}

/// How [`Datapath::load_with`](super::Datapath::load_with) loads the object.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// The flow table (`FLOWS`, the datapath's conntrack) has this many entries instead of the
    /// default 65536. The size is the map's when it is created: a table already pinned keeps
    /// its own (see [`Datapath::flow_table`](super::Datapath::flow_table)).
    pub flows: Option<u32>,
    /// A flow user space ended ([`Datapath::end_flows`](super::Datapath::end_flows)) stays ended until neither side has
    /// sent for this long (the agent's `--ended-connection-secs`; 0: it is gone at once, and
    /// its next packet is judged as a new flow's); at most 12 hours
    /// ([`peerwall_common::ENDED_IDLE_MAX_NS`]).
    pub ended_secs: u32,
    /// Whose connection table TCP and UDP packets take their state from.
    pub conntrack: Conntrack,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            flows: None,
            ended_secs: (peerwall_common::FLOW_IDLE_NS / 1_000_000_000) as u32,
            conntrack: Conntrack::Own,
        }
    }
}

impl LoadOptions {
    /// [`ended_secs`](Self::ended_secs) in nanoseconds, within the datapath's bound.
    pub(super) fn ended_idle_ns(&self) -> u64 {
        (u64::from(self.ended_secs) * 1_000_000_000).min(peerwall_common::ENDED_IDLE_MAX_NS)
    }
}
