//! The address sets as AddressSet slices: their contents, names and layout (O(changes)
//! per pod), and the objects the controller writes.

use crate::gateway::Options;
use crate::index::Kind;
use crate::peers::Peer;
use crate::peers::PeerSets;
use crate::GATEWAY_CONFIG;
use serde_json::Value;
use std::collections::BTreeSet;
use std::net::IpAddr;

/// The names of the sets of a gateway configuration, each with the addresses of `s` it holds.
pub fn set_contents<'a>(s: &'a PeerSets, opts: &Options) -> Vec<(String, BTreeSet<IpAddr>)> {
    let mut names: Vec<(Kind, &'a BTreeSet<IpAddr>)> =
        vec![(Kind::Offloaded, &s.offloaded), (Kind::Remote, &s.remote)];
    if opts.block_leaf_to_leaf {
        names.push((Kind::Elsewhere, &s.elsewhere));
    }
    names
        .into_iter()
        .flat_map(|(kind, ips)| {
            [
                (
                    kind.base_name().to_string(),
                    ips.iter().filter(|i| i.is_ipv4()).copied().collect(),
                ),
                (
                    kind.v6_name(),
                    ips.iter().filter(|i| i.is_ipv6()).copied().collect(),
                ),
            ]
        })
        .collect()
}

/// Label naming the set an AddressSet fills (besides `spec.set`, for selection).
pub const SET_LABEL: &str = "peerwall.io/set";

/// One AddressSet slice of a gateway configuration's set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    /// Object name.
    pub name: String,
    /// Set it fills.
    pub set: String,
    /// Addresses (at most [`peerwall_intent::types::MAX_SLICE_ADDRESSES`]).
    pub addresses: BTreeSet<IpAddr>,
}

/// Name of slice number `n` of set `set`.
pub fn slice_name(set: &str, n: usize) -> String {
    format!("{GATEWAY_CONFIG}-{set}-{n:04}")
}

/// Lay the `desired` addresses of set `set` over its `current` slices, EndpointSlice style:
/// an address that left is taken out of its slice, an address that stays never moves, a new
/// address fills the slice with the most room or a new slice. Returns only the slices whose
/// content changes (an emptied slice comes back empty: the caller deletes it once every agent
/// has applied its removal). A change of k addresses rewrites at most k slices.
pub fn layout(set: &str, current: &[Slice], desired: &BTreeSet<IpAddr>) -> Vec<Slice> {
    use peerwall_intent::types::MAX_SLICE_ADDRESSES;
    let mut slices: Vec<Slice> = current.to_vec();
    let mut changed: BTreeSet<usize> = BTreeSet::new();
    let mut placed: BTreeSet<IpAddr> = BTreeSet::new();
    for (i, sl) in slices.iter_mut().enumerate() {
        let before = sl.addresses.len();
        // An address listed twice (a lost race) stays in its first slice only.
        sl.addresses
            .retain(|a| desired.contains(a) && !placed.contains(a));
        placed.extend(sl.addresses.iter().copied());
        if sl.addresses.len() != before {
            changed.insert(i);
        }
    }
    let mut new: Vec<IpAddr> = desired.difference(&placed).copied().collect();
    new.reverse();
    while let Some(a) = new.pop() {
        let room = slices
            .iter()
            .enumerate()
            .filter(|(_, s)| s.addresses.len() < MAX_SLICE_ADDRESSES)
            .min_by_key(|(_, s)| s.addresses.len())
            .map(|(i, _)| i);
        let i = match room {
            Some(i) => i,
            None => {
                let used: BTreeSet<&str> = slices.iter().map(|s| s.name.as_str()).collect();
                let n = (0..)
                    .find(|n| !used.contains(slice_name(set, *n).as_str()))
                    .unwrap_or_default();
                slices.push(Slice {
                    name: slice_name(set, n),
                    set: set.to_string(),
                    addresses: BTreeSet::new(),
                });
                slices.len() - 1
            }
        };
        slices[i].addresses.insert(a);
        changed.insert(i);
    }
    changed.into_iter().map(|i| slices[i].clone()).collect()
}

/// Every slice of a peer's gateway configuration, laid out from scratch (what the controller
/// publishes for `s` when nothing is published yet).
pub fn peer_slices(s: &PeerSets, opts: &Options) -> Vec<Slice> {
    set_contents(s, opts)
        .into_iter()
        .flat_map(|(set, ips)| layout(&set, &[], &ips))
        .collect()
}

/// An AddressSet as the controller publishes it (in the peer's tenant namespace, with the
/// gateway configuration's labels so that the peer's agents select it).
pub fn address_set_object(peer: &Peer, slice: &Slice) -> Value {
    let mut labels = peerwall_intent::labels::for_gateway(&peer.id);
    labels.insert(SET_LABEL.into(), slice.set.clone());
    peerwall_intent::object::object(
        peerwall_intent::load::ADDRESS_SET_KIND,
        &peer.tenant_namespace,
        &slice.name,
        &labels,
        peerwall_intent::types::AddressSetSpec {
            firewall_configuration: GATEWAY_CONFIG.into(),
            set: slice.set.clone(),
            addresses: slice.addresses.iter().map(ToString::to_string).collect(),
        },
    )
}
