//! Destination rewrites of prerouting's NAT. eBPF twin: `ebpf/src/view.rs`.

/// Value of the `VIEW` tries (key: an [`crate::AddrKeyData`] whose `chain` field holds the input
/// ifindex, BE): the destination prefix a packet arriving there is seen in by the forward hook
/// once prerouting's NAT ran (a DNAT, or the un-SNAT of a reply). The datapath keeps the host
/// bits of the destination beyond `prefix_len` and replaces the others with `to`'s.
/// Eq twin: `ebpf/src/view.rs`. 20 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewTarget {
    /// Replacement network, BE (IPv4 in the first 4 bytes).
    pub to: [u8; 16],
    /// Length of the rewritten prefix (0..=32 or 0..=128), native endian.
    pub prefix_len: u32,
}
