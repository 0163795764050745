//! The arguments of the kernel's conntrack lookup kfunc (`kernel_ct.rs`), kept in `WORK`
//! (`maps.rs`): kernel-facing structs, their twins `struct bpf_sock_tuple` and
//! `struct bpf_ct_opts`.

/// `struct bpf_sock_tuple`: IPv4 uses the first 12 bytes (saddr, daddr, sport, dport), IPv6
/// all 36; network byte order.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct SockTuple {
    pub(crate) words: [u32; 9],
}

/// `struct bpf_ct_opts`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CtOpts {
    /// `BPF_F_CURRENT_NETNS` (-1): the packet's own namespace.
    pub(crate) netns_id: i32,
    /// Out: why the lookup found nothing.
    pub(crate) error: i32,
    pub(crate) l4proto: u8,
    /// Out: which of the connection's tuples matched (0 original, 1 reply).
    pub(crate) dir: u8,
    pub(crate) ct_zone_id: u16,
    pub(crate) ct_zone_dir: u8,
    pub(crate) reserved: [u8; 3],
}
