//! How the datapath is loaded: [`LoadOptions`] (the flow table's size, how long ended flows
//! stay ended) and the globals the loader writes into the object for them.

/// The datapath's global holding how long an ended flow stays ended after its last packet.
pub(super) const ENDED_IDLE_NS: &str = "ENDED_IDLE_NS";

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
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            flows: None,
            ended_secs: (peerwall_common::FLOW_IDLE_NS / 1_000_000_000) as u32,
        }
    }
}

impl LoadOptions {
    /// [`ended_secs`](Self::ended_secs) in nanoseconds, within the datapath's bound.
    pub(super) fn ended_idle_ns(&self) -> u64 {
        (u64::from(self.ended_secs) * 1_000_000_000).min(peerwall_common::ENDED_IDLE_MAX_NS)
    }
}
