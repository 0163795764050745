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

/// How many addresses the controller puts in one slice before it starts another: the most
/// the API accepts ([`peerwall_intent::types::MAX_SLICE_ADDRESSES`]). Every pod added or
/// removed rewrites its whole slice through the API server, so a smaller slice is a cheaper
/// write (Kubernetes' EndpointSlice controller fills to 100). Measured end to end with
/// `cargo xtask bench-control` at 100k pods, slices of 100 were slower than slices of 1000 on
/// every row: each slice is also an object the agent reports a condition on, lists, merges and
/// (in a directory) watches, and ten times as many of them cost more than the smaller writes
/// saved.
pub const SLICE_FILL: usize = peerwall_intent::types::MAX_SLICE_ADDRESSES;

/// Label naming the set an AddressSet fills (besides `spec.set`, for selection).
pub const SET_LABEL: &str = "peerwall.io/set";

/// One AddressSet slice of a configuration's set: of addresses (the gateway configuration's
/// pod sets), or of any element an AddressSet takes (`A = String`: addresses, CIDRs, ranges,
/// the sets [`crate::spill`] moves out of a configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice<A = IpAddr> {
    /// Object name.
    pub name: String,
    /// Set it fills.
    pub set: String,
    /// Addresses (at most [`peerwall_intent::types::MAX_SLICE_ADDRESSES`]).
    pub addresses: BTreeSet<A>,
}

/// Name of slice number `n` of set `set`.
pub fn slice_name(set: &str, n: usize) -> String {
    format!("{GATEWAY_CONFIG}-{set}-{n:04}")
}

/// A slice that already exists takes new addresses only while it holds fewer than this; a
/// slice opened for new addresses fills up to [`SLICE_FILL`]. An address added rewrites its
/// whole slice through the API server, at a cost that grows with the slice (`cargo xtask
/// bench-control`'s full-slice row against its floor). Pods come and go everywhere, so after a
/// while every slice has a few holes. Refilled emptiest first, they would all stay near
/// [`SLICE_FILL`], and every new pod would rewrite a full slice. With this rule, a new pod's
/// address goes to a slice that is at most half full, or to a new slice. This costs at most
/// twice the fewest slices: every slice but the newest holds at least half, or took no
/// address since it fell below half.
pub const REFILL_BELOW: usize = SLICE_FILL / 2;

/// The slices with room, emptiest first, ties by key: where the next new address goes. An
/// existing slice has room below [`REFILL_BELOW`] addresses, a slice opened here below
/// [`SLICE_FILL`]. Each choice is O(log slices), so placing n addresses over a set of s slices
/// costs O(n log s), not O(n s) (at 100k pods there are 1000 slices).
pub(crate) struct Room<K: Ord + Clone>(BTreeSet<(usize, K, usize)>);

impl<K: Ord + Clone> Room<K> {
    /// The existing slices of `sizes` (key, addresses held) that have room.
    pub(crate) fn new(sizes: impl IntoIterator<Item = (K, usize)>) -> Self {
        Self(
            sizes
                .into_iter()
                .filter(|(_, len)| *len < REFILL_BELOW)
                .map(|(k, len)| (len, k, REFILL_BELOW))
                .collect(),
        )
    }

    /// The slice the next address goes to, counted with it; `None` when no slice has room
    /// (the caller opens a new one).
    pub(crate) fn take(&mut self) -> Option<K> {
        let (len, k, cap) = self.0.pop_first()?;
        if len + 1 < cap {
            self.0.insert((len + 1, k.clone(), cap));
        }
        Some(k)
    }

    /// A new slice `k`, opened with one address.
    pub(crate) fn opened(&mut self, k: K) {
        if 1 < SLICE_FILL {
            self.0.insert((1, k, SLICE_FILL));
        }
    }
}

/// Lay the `desired` addresses of set `set` over its `current` slices, EndpointSlice style:
/// an address that left is taken out of its slice, an address that stays never moves, a new
/// address fills the slice with the most room (`Room`: an existing slice below
/// [`REFILL_BELOW`], one opened here below [`SLICE_FILL`]) or a new slice. Returns
/// only the slices whose content changes (an emptied slice comes back empty: the caller
/// deletes it once every agent has applied its removal). A change of k addresses rewrites at
/// most k slices.
pub fn layout(set: &str, current: &[Slice], desired: &BTreeSet<IpAddr>) -> Vec<Slice> {
    layout_named(
        set,
        current,
        desired,
        |n| slice_name(set, n),
        &BTreeSet::new(),
    )
}

/// [`layout`] for elements of any type, a new slice number `n` named `name(n)`, never a
/// name in `taken` (another set's slices).
pub fn layout_named<A: Ord + Clone>(
    set: &str,
    current: &[Slice<A>],
    desired: &BTreeSet<A>,
    name: impl Fn(usize) -> String,
    taken: &BTreeSet<String>,
) -> Vec<Slice<A>> {
    let mut slices: Vec<Slice<A>> = current.to_vec();
    let mut changed: BTreeSet<usize> = BTreeSet::new();
    let mut placed: BTreeSet<A> = BTreeSet::new();
    for (i, sl) in slices.iter_mut().enumerate() {
        let before = sl.addresses.len();
        // An address listed twice (a lost race) stays in its first slice only.
        sl.addresses
            .retain(|a| desired.contains(a) && !placed.contains(a));
        placed.extend(sl.addresses.iter().cloned());
        if sl.addresses.len() != before {
            changed.insert(i);
        }
    }
    let mut new: Vec<A> = desired.difference(&placed).cloned().collect();
    new.reverse();
    let mut room = Room::new(slices.iter().map(|s| s.addresses.len()).enumerate());
    while let Some(a) = new.pop() {
        let i = match room.take() {
            Some(i) => i,
            None => {
                let used: BTreeSet<&str> = slices.iter().map(|s| s.name.as_str()).collect();
                let n = (0..)
                    .find(|n| {
                        let candidate = name(*n);
                        !used.contains(candidate.as_str()) && !taken.contains(&candidate)
                    })
                    .unwrap_or_default();
                slices.push(Slice {
                    name: name(n),
                    set: set.to_string(),
                    addresses: BTreeSet::new(),
                });
                room.opened(slices.len() - 1);
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
