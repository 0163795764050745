//! Where a tc packet's IP header starts: after the link-layer header the kernel measured when
//! the packet arrived (`sk_buff.mac_len`: 14 on Ethernet devices such as veth and Geneve, 0 on
//! WireGuard and TUN, which have none). tcx hands the program the packet from its link-layer
//! header on, so one entry reads that length and serves every device type: a gateway verifies
//! one tc program instead of one per device type (`cargo xtask bench-peers`, the start of many
//! gateways on one node). The kernel's `sk_buff` comes from `bpf_cast_to_kern_ctx`, which the
//! loader resolves ([`peerwall_common::kfunc::CAST_TO_KERN_CTX`]), and `mac_len`'s offset from
//! the kernel's BTF ([`crate::maps::skb_mac_len_off`]).

use aya_ebpf::bindings::__sk_buff;
use core::ffi::c_void;
use peerwall_common::kfunc::CAST_TO_KERN_CTX;

use crate::maps::skb_mac_len_off;

/// The packet's link-layer header length, or None where the kernel offers no cast (the loader
/// attaches the entries by device type there, and never this one).
#[inline(always)]
pub(crate) fn mac_len(skb: *mut __sk_buff) -> Option<u32> {
    // SAFETY: the loader rewrites this call into `bpf_cast_to_kern_ctx` (or `r0 = 0`), whose
    // signature this is; the context is the program's own.
    let k = unsafe {
        let cast: unsafe extern "C" fn(*mut c_void) -> *const u8 =
            core::mem::transmute(CAST_TO_KERN_CTX as usize);
        cast(skb.cast())
    };
    if k.is_null() {
        return None;
    }
    // SAFETY: `k` is this packet's `struct sk_buff`, trusted by the verifier; `mac_len` is the
    // `__u16` at the offset the loader read from this kernel's BTF.
    let len = unsafe { core::ptr::read_volatile(k.add(skb_mac_len_off() as usize).cast::<u16>()) };
    Some(u32::from(len))
}
