//! Events in the ring buffer, their rate limits and per-flow state. eBPF twin:
//! `ebpf/src/events.rs`.

/// [`FlowEvent::kind`] values.
pub mod event {
    /// Dropped.
    pub const DROP: u8 = 1;
    /// Rejected (dropped, ICMP answer sent).
    pub const REJECT: u8 = 2;
    /// Would have been dropped by an audited chain; accepted.
    pub const AUDIT_DROP: u8 = 3;
    /// Would have been rejected by an audited chain; accepted.
    pub const AUDIT_REJECT: u8 = 4;
    /// First packet of a flow, accepted (flow log).
    pub const ACCEPT: u8 = 5;
    /// `rule` of an event decided by the chain policy.
    pub const POLICY: u32 = u32::MAX;
}

/// One event in the `EVENTS` ring buffer. eBPF twin: `ebpf/src/events.rs` writes it. Native
/// byte order (both ends run on the same host) except the addresses, which are as on the wire.
/// 88 bytes, no implicit padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowEvent {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the event.
    pub ts_ns: u64,
    /// Packets of this flow and kind since its last event, this one included.
    pub packets: u64,
    /// Their bytes (IP total length).
    pub bytes: u64,
    /// Source address, BE (IPv4 in the first 4 bytes).
    pub src: [u8; 16],
    /// Destination address as the forward hook sees it, BE.
    pub dst: [u8; 16],
    /// Source port (ICMP: echo id), host order.
    pub sport: u16,
    /// Destination port, host order.
    pub dport: u16,
    /// Input ifindex.
    pub iif: u32,
    /// Output ifindex (0: delivered to the gateway, or unknown).
    pub oif: u32,
    /// Chain id (of the slot of `epoch`).
    pub chain: u32,
    /// Rule index in the chain, or [`event::POLICY`].
    pub rule: u32,
    /// [`crate::Config::active`] when it happened: which slot's names apply.
    pub epoch: u32,
    /// [`crate::family`] code.
    pub family: u8,
    /// IP protocol.
    pub proto: u8,
    /// [`crate::ct`] state number.
    pub state: u8,
    /// [`event`] kind.
    pub kind: u8,
    /// Zero.
    pub _pad: [u8; 4],
}

/// Event rate limits (`EVENT_CONF[0]`), written by the loader.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventConfig {
    /// At most one event per flow and kind in this interval; the packets in between are
    /// counted in the next event.
    pub flow_interval_ns: u64,
    /// Events per second per CPU (token bucket refill).
    pub rate: u32,
    /// Bucket size.
    pub burst: u32,
}

/// Per-flow event state (`EVENT_FLOWS`, LRU, keyed by [`crate::FlowKey`] with the kind in `_pad[0]`
/// and the chain id in `_pad[1]`). eBPF twin: the same struct, written by `ebpf/src/events.rs`
/// (`note`) for every packet it counts; read by user space (`agent/backend/bpf/src/events.rs`),
/// which sends the packets counted since the last event of a flow that went quiet (the end of
/// a burst: no later packet would report them) and deletes its entry. Host byte order; 56
/// bytes, no implicit padding (`_pad` makes the tail explicit).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventFlow {
    /// When the flow's last event was sent (0: never), `bpf_ktime_get_ns`.
    pub last_ns: u64,
    /// Packets since.
    pub packets: u64,
    /// Bytes since.
    pub bytes: u64,
    /// When the latest of them was counted, `bpf_ktime_get_ns`.
    pub seen_ns: u64,
    /// The latest one's input ifindex.
    pub iif: u32,
    /// Its output ifindex (0: unknown).
    pub oif: u32,
    /// Rule index in the chain, or [`event::POLICY`].
    pub rule: u32,
    /// [`crate::Config::active`] when it was counted (which slot's names apply).
    pub epoch: u32,
    /// Source port (ICMP: echo id), host order, as in [`FlowEvent`].
    pub sport: u16,
    /// Destination port (ICMP: type), host order, as in [`FlowEvent`].
    pub dport: u16,
    /// [`crate::ct`] state number.
    pub state: u8,
    /// Zero.
    pub _pad: [u8; 3],
}
