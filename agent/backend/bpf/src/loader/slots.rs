//! The per-slot maps a policy is written into, as a table: each map's name prefix and how its
//! contents follow from the compiled policy. Writing a slot walks the tables in order, lookups
//! first and hooks last (a chain becomes reachable only once all its maps are written), each
//! map brought from the previous contents (None: unknown, rewrite it whole) to the new ones.

use aya::maps::Map;
use ipnet::IpNet;
use peerwall_common::{map, Bitmap, ChainInfo, DimMasks, HookChains, RuleInfo};

use super::entries::{
    chain_entries, ct_entries, hook_entries, if_entries, mask_entries, owner_entries, port_entries,
    proto_entries, rule_entries, sync_array, sync_hash, sync_trie,
};
use super::layout::{Addresses, Layout};
use super::BpfError;
use crate::maps::{BpfPolicy, ChainMaps};

/// Brings one map (its handle and pin name) from `old`'s contents to `new`'s, hosts placed as
/// the layout says; returns the entries written or deleted.
type Sync = fn(&mut Map, &str, Option<&BpfPolicy>, &BpfPolicy, Layout) -> Result<usize, BpfError>;

/// One per-slot map: the prefix of its name (`<prefix><slot>`) and how to sync it.
pub(super) struct SlotMap {
    /// Name prefix ([`peerwall_common::map`]).
    pub(super) prefix: &'static str,
    /// How its contents follow from the policy.
    pub(super) sync: Sync,
}

fn src(c: &ChainMaps) -> &Vec<(IpNet, Bitmap)> {
    &c.src
}

fn dst(c: &ChainMaps) -> &Vec<(IpNet, Bitmap)> {
    &c.dst
}

/// An address dimension's prefixes (and the hosts the exact-match map has no room for), in
/// its trie.
fn prefixes(
    m: &mut Map,
    name: &str,
    (old, new): (Option<&BpfPolicy>, &BpfPolicy),
    layout: Layout,
    dim: Addresses,
) -> Result<usize, BpfError> {
    sync_trie(
        m,
        name,
        old.map(|o| layout.trie_entries(o, dim)),
        layout.trie_entries(new, dim),
    )
}

/// An address dimension's hosts, in the exact-match hash the datapath consults first.
fn hosts(
    m: &mut Map,
    name: &str,
    (old, new): (Option<&BpfPolicy>, &BpfPolicy),
    layout: Layout,
    dim: Addresses,
) -> Result<usize, BpfError> {
    sync_hash(
        m,
        name,
        old.map(|o| layout.host_entries(o, dim)),
        layout.host_entries(new, dim),
    )
}

/// The per-dimension lookup maps: addresses (prefixes in tries, hosts in the exact-match
/// hashes the datapath consults first), ports, family+protocol, interfaces, conntrack states.
pub(super) const LOOKUPS: [SlotMap; 9] = [
    SlotMap {
        prefix: map::SRC,
        sync: |m, name, old, new, l| prefixes(m, name, (old, new), l, src),
    },
    SlotMap {
        prefix: map::SRCH,
        sync: |m, name, old, new, l| hosts(m, name, (old, new), l, src),
    },
    SlotMap {
        prefix: map::DST,
        sync: |m, name, old, new, l| prefixes(m, name, (old, new), l, dst),
    },
    SlotMap {
        prefix: map::DSTH,
        sync: |m, name, old, new, l| hosts(m, name, (old, new), l, dst),
    },
    SlotMap {
        prefix: map::SPORT,
        sync: |m, name, old, new, _| {
            sync_trie(
                m,
                name,
                old.map(|o| port_entries(o, |c| &c.sport)),
                port_entries(new, |c| &c.sport),
            )
        },
    },
    SlotMap {
        prefix: map::DPORT,
        sync: |m, name, old, new, _| {
            sync_trie(
                m,
                name,
                old.map(|o| port_entries(o, |c| &c.dport)),
                port_entries(new, |c| &c.dport),
            )
        },
    },
    SlotMap {
        prefix: map::PROTO,
        sync: |m, name, old, new, _| sync_hash(m, name, old.map(proto_entries), proto_entries(new)),
    },
    SlotMap {
        prefix: map::IIF,
        sync: |m, name, old, new, _| {
            sync_hash(
                m,
                name,
                old.map(|o| if_entries(o, |c| &c.iif)),
                if_entries(new, |c| &c.iif),
            )
        },
    },
    SlotMap {
        prefix: map::OIF,
        sync: |m, name, old, new, _| {
            sync_hash(
                m,
                name,
                old.map(|o| if_entries(o, |c| &c.oif)),
                if_entries(new, |c| &c.oif),
            )
        },
    },
];

/// The conntrack-state map; arrays reset unused slots to their empty value.
pub(super) const CT: SlotMap = SlotMap {
    prefix: map::CT,
    sync: |m, name, old, new, _| {
        sync_array(m, name, old.map(ct_entries), ct_entries(new), Bitmap::EMPTY)
    },
};

/// Chain descriptions: per-dimension masks, rules, who counts where, chains, and last the hooks
/// that reach them.
pub(super) const CHAINS: [SlotMap; 5] = [
    SlotMap {
        prefix: map::MASKS,
        sync: |m, name, old, new, _| {
            sync_array(
                m,
                name,
                old.map(mask_entries),
                mask_entries(new),
                DimMasks {
                    any: Bitmap::EMPTY,
                    neg: Bitmap::EMPTY,
                },
            )
        },
    },
    SlotMap {
        prefix: map::RULES,
        sync: |m, name, old, new, _| {
            sync_array(
                m,
                name,
                old.map(rule_entries),
                rule_entries(new),
                RuleInfo {
                    action: peerwall_common::ActionCode::Drop as u8,
                    counter: 0,
                    _pad: [0; 2],
                },
            )
        },
    },
    SlotMap {
        prefix: map::OWNERS,
        sync: |m, name, old, new, l| {
            sync_array(
                m,
                name,
                old.map(|o| owner_entries(o, l.counters)),
                owner_entries(new, l.counters),
                peerwall_common::counter_owner(u32::MAX, None),
            )
        },
    },
    SlotMap {
        prefix: map::CHAINS,
        sync: |m, name, old, new, l| {
            sync_array(
                m,
                name,
                old.map(|o| chain_entries(o, l.hosts)),
                chain_entries(new, l.hosts),
                ChainInfo {
                    rules: 0,
                    policy: peerwall_common::ActionCode::Drop as u8,
                    _pad: 0,
                    counters: 0,
                    constrained: 0,
                },
            )
        },
    },
    SlotMap {
        prefix: map::HOOKS,
        sync: |m, name, old, new, _| {
            sync_array(
                m,
                name,
                old.map(hook_entries),
                hook_entries(new),
                HookChains {
                    count: 0,
                    chains: [0; peerwall_common::MAX_HOOK_CHAINS],
                },
            )
        },
    },
];
