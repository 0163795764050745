//! Types shared by the peerwall eBPF datapath (`ebpf/`) and user space (`agent/`).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding fields, so both sides agree on
//! the byte layout; every padding field must be zero (keys are compared byte for byte).
//! Byte order is stated per field: "BE" fields hold network byte order, others are host order.
//! The `user` feature adds `aya::Pod` impls for user space.
//!
//! One module per concern, as `ebpf/src`: [`maps`], [`classify`], [`view`], [`conntrack`],
//! [`cache`], [`pair`], [`probe`], [`events`], [`lines`], [`kfunc`]; each item (not `kfunc`'s, which only the
//! loader and the datapath's kfunc calls name) is re-exported here by name.
#![no_std]

pub mod cache;
pub mod classify;
pub mod conntrack;
pub mod events;
pub mod kfunc;
pub mod lines;
pub mod maps;
pub mod pair;
pub mod probe;
pub mod view;

pub use cache::{
    fold_key6, verdict_may_serve, verdict_set, verdict_tag, verdict_until_hint, verdict_way_free,
    CachedVerdict, CpuVerdict4, CpuVerdictTags, CpuVerdicts4, FreshLine, VerdictKey4,
    CACHED_COUNTERS, CPU_VERDICT_SETS, CPU_VERDICT_SET_BITS, CPU_VERDICT_TAG_SETS,
    CPU_VERDICT_WAYS, VERDICT_FRESH_LANES, VERDICT_HINT_SHIFT,
};
pub use classify::{
    constrained, dim, ActionCode, AddrKeyData, Bitmap, ChainInfo, DimMasks, HookChains, IfKey,
    PortKeyData, ProtoKey, RuleInfo, ADDR_KEY_FIXED_BITS, PORT_KEY_FIXED_BITS,
};
pub use conntrack::{
    ct, flow_seen_idle, flow_seen_idle_stamp, flow_seen_pair_slot, flow_seen_pair_slot_of_words,
    flow_seen_slot, flow_seen_slot_of_words, flow_seen_stamp, flow_words, new_flow_slot,
    open_slots, seen_line_of, FlowKey, FlowState, NewFlowSlot, SeenLine, ENDED_IDLE_MAX_NS,
    FLOW_IDLE_NS, FLOW_SEEN_AHEAD, FLOW_SEEN_LANES, FLOW_SEEN_LINES, FLOW_SEEN_PAIRS,
    FLOW_SEEN_SHIFT, FLOW_SEEN_SLOTS, NEW_FLOW_SLOTS,
};
pub use events::{event, EventConfig, EventFlow, FlowEvent};
pub use lines::{
    host_line_entries, host_line_entry, host_line_key, host_line_of, host_lines_for, host_table,
    HostLine, HOST_LINES_ON, HOST_LINE_OVERFLOW, HOST_LINE_SLOTS, HOST_TABLES,
};
pub use maps::{
    counter_owner, family, flags, hook, map, routes, start_index, Config, Counter, IfaceInfo,
    RouteMirror, COUNTERS_DEFAULT, HOOKS, HOOK_SLOTS, HOST_TABLE_DEFAULT, LOCAL_MAX, MAX_CHAINS,
    MAX_COUNTERS, MAX_HOOK_CHAINS, MAX_RULES, NO_COMMON_LRU, PROBE_MAGIC, START_ENTRIES, WORDS,
};
pub use pair::{pair_set, PairDrop, PairDrops, PAIR_DROP_SETS, PAIR_DROP_SET_BITS, PAIR_DROP_WAYS};
pub use probe::ProbeRecord;
pub use view::ViewTarget;

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all these types are repr(C), Copy, made only of integers and byte arrays, with
    // explicit padding fields: every bit pattern is valid.
    unsafe impl aya::Pod for Bitmap {}
    unsafe impl aya::Pod for SeenLine {}
    unsafe impl aya::Pod for HostLine {}
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
    unsafe impl aya::Pod for CpuVerdictTags {}
    unsafe impl aya::Pod for PairDrops {}
    unsafe impl aya::Pod for FreshLine {}
    unsafe impl aya::Pod for ProbeRecord {}
}

#[cfg(test)]
mod tests;
