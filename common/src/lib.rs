//! Types shared by the peerwall eBPF datapath (`ebpf/`) and user space (`agent/`).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding fields, so both sides agree on
//! the byte layout; every padding field must be zero (keys are compared byte for byte).
//! Byte order is stated per field: "BE" fields hold network byte order, others are host order.
//! The `user` feature adds `aya::Pod` impls for user space.
//!
//! One module per concern, as `ebpf/src`: [`maps`], [`classify`], [`view`], [`conntrack`],
//! [`cache`], [`probe`], [`events`], [`kfunc`]; everything is re-exported here.
#![no_std]

pub mod cache;
pub mod classify;
pub mod conntrack;
pub mod events;
pub mod kfunc;
pub mod maps;
pub mod probe;
pub mod view;

pub use cache::*;
pub use classify::*;
pub use conntrack::*;
pub use events::*;
pub use maps::*;
pub use probe::*;
pub use view::*;

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all these types are repr(C), Copy, made only of integers and byte arrays, with
    // explicit padding fields: every bit pattern is valid.
    unsafe impl aya::Pod for Bitmap {}
    unsafe impl aya::Pod for AddrKeyData {}
    unsafe impl aya::Pod for PortKeyData {}
    unsafe impl aya::Pod for ProtoKey {}
    unsafe impl aya::Pod for FlowEvent {}
    unsafe impl aya::Pod for EventConfig {}
    unsafe impl aya::Pod for EventFlow {}
    unsafe impl aya::Pod for IfKey {}
    unsafe impl aya::Pod for DimMasks {}
    unsafe impl aya::Pod for ChainInfo {}
    unsafe impl aya::Pod for RuleInfo {}
    unsafe impl aya::Pod for HookChains {}
    unsafe impl aya::Pod for ViewTarget {}
    unsafe impl aya::Pod for Counter {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for IfaceInfo {}
    unsafe impl aya::Pod for RouteMirror {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for VerdictKey4 {}
    unsafe impl aya::Pod for FlowState {}
    unsafe impl aya::Pod for NewFlowSlot {}
    unsafe impl aya::Pod for CachedVerdict {}
    unsafe impl aya::Pod for CpuVerdicts4 {}
    unsafe impl aya::Pod for ProbeRecord {}
}

#[cfg(test)]
mod tests;
