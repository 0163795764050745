//! Connection tracking: state numbers, the flow key (original direction) and a flow's state.
//! eBPF twins: `ebpf/src/conntrack.rs`, `ebpf/src/flow.rs`.

/// Conntrack state numbers (index into the per-chain ct bitmaps).
pub mod ct {
    /// First packet of a flow.
    pub const NEW: u32 = 0;
    /// Flow seen both ways.
    pub const ESTABLISHED: u32 = 1;
    /// ICMP error about a known flow.
    pub const RELATED: u32 = 2;
    /// Not tracked (never produced by the datapath: no notrack support).
    pub const UNTRACKED: u32 = 3;
    /// Unclassifiable (bad TCP flags, unsolicited ICMP replies, errors about unknown flows).
    pub const INVALID: u32 = 4;
    /// States per chain (slots reserved for alignment).
    pub const SLOTS: u32 = 8;
}

/// Connection-tracking key, original direction. Addresses BE (IPv4 in the first 4 bytes),
/// ports BE (ICMP: id in `sport`, 0 in `dport`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowKey {
    /// Source address, BE.
    pub src: [u8; 16],
    /// Destination address, BE.
    pub dst: [u8; 16],
    /// Source port / ICMP id, BE.
    pub sport: [u8; 2],
    /// Destination port, BE.
    pub dport: [u8; 2],
    /// IP protocol.
    pub proto: u8,
    /// [`crate::family`] code.
    pub family: u8,
    /// Zero.
    pub _pad: [u8; 2],
}

/// Connection-tracking state of a flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowState {
    /// Last packet, `bpf_ktime_get_ns`.
    pub last_seen_ns: u64,
    /// 1 once a packet was seen in the reply direction.
    pub replied: u8,
    /// 1 once user space ended the flow (a policy change no longer allows it): its packets,
    /// either way, are `invalid` until it expires, and none of them starts it again.
    pub ended: u8,
    /// Zero.
    pub _pad: [u8; 6],
}
