//! Kernel functions the datapath calls (kfuncs), by made-up helper numbers: the program calls
//! `call <number>`, and the loader rewrites each such call into a call of the kernel function
//! (its BTF id), or into `r0 = 0` where the kernel lacks it
//! (`peerwall_backend_bpf::loader::kfunc`). Far above every real helper number.

/// `bpf_skb_ct_lookup(struct __sk_buff *, struct bpf_sock_tuple *, u32, struct bpf_ct_opts *,
/// u32) -> struct nf_conn *` (tc).
pub const CT_LOOKUP_SKB: u32 = 0x7eb0_0001;
/// `bpf_xdp_ct_lookup(struct xdp_md *, ...)`, the same for XDP.
pub const CT_LOOKUP_XDP: u32 = 0x7eb0_0002;
/// `bpf_ct_release(struct nf_conn *)`: every connection a lookup returns is released.
pub const CT_RELEASE: u32 = 0x7eb0_0003;
/// `bpf_cast_to_kern_ctx(void *) -> struct sk_buff *` (tc): the kernel's own `sk_buff` of the
/// program's context, read for its `mac_len` (the tc entry of every device type).
pub const CAST_TO_KERN_CTX: u32 = 0x7eb0_0004;

/// `bpf_ct_opts.dir` of a lookup that matched the connection's reply tuple
/// (`IP_CT_DIR_REPLY`).
pub const CT_DIR_REPLY: u8 = 1;
/// `IPS_SEEN_REPLY` in `nf_conn.status`: a packet was seen in the reply direction.
pub const IPS_SEEN_REPLY: u64 = 1 << 1;
/// `IPS_EXPECTED`: the connection was expected (a helper's related connection).
pub const IPS_EXPECTED: u64 = 1 << 0;

/// `KERNEL_CT`'s bit for IPv4: its TCP and UDP take their state from the kernel's table.
pub const KERNEL_CT_V4: u32 = 1;
/// `KERNEL_CT`'s bit for IPv6.
pub const KERNEL_CT_V6: u32 = 2;
