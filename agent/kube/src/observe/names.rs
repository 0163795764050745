//! Pure part of the cluster-wide `peerwall observe`: the pods behind an event's addresses
//! ([`AddressBook`], from the cluster as the controller sees it), the filters that need them
//! ([`PodFilter`]), and the time order of events merged from several agents ([`Merge`]).
//!
//! A gateway's hooks see a remote pod by the peer's own address (before Liqo's remapping: what
//! crosses the tunnel), and a local pod by its own; two peers, or a peer and this cluster, may
//! use the same addresses (that is why Liqo remaps). So an address is named only where it is
//! unambiguous for the event: the end that faces the tunnel (the input interface for the
//! source, the output interface for the destination) is looked up among the pods of the event's
//! peer (from its table's name) running there, the other end among this cluster's pods; an
//! address that still matches two pods is left unnamed rather than guessed.

use std::collections::{BTreeMap, BinaryHeap};
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use peerwall_backend::Event;

use crate::netpol;

/// One pod behind an address.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Holder {
    /// `namespace/name`.
    name: String,
    /// The peer it runs on, as table names spell it (non-alphanumerics as `_`); None: here.
    peer: Option<String>,
}

/// A peer id as peerwall's table names spell it.
fn table_spelling(peer: &str) -> String {
    peer.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The peer of a peerwall table (`peerwall_<peer>`, `peerwall_boot_<peer>`, `pwnp_<peer>`), as
/// table names spell it; None for any other table.
pub fn table_peer(table: &str) -> Option<&str> {
    ["peerwall_boot_", netpol::tier::TABLE_PREFIX, "peerwall_"]
        .iter()
        .find_map(|p| table.strip_prefix(p))
        .filter(|p| !p.is_empty())
}

/// Which end of an event faces the tunnel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Remote,
    Local,
    Unknown,
}

/// The pods behind addresses.
#[derive(Clone, Debug, Default)]
pub struct AddressBook {
    by_ip: BTreeMap<IpAddr, Vec<Holder>>,
    /// Prefixes of the tunnel interfaces (`liqo-tunnel` covers `liqo-tunnel1..`).
    tunnels: Vec<String>,
}

impl AddressBook {
    /// Every pod of `cluster` by the addresses a gateway sees it with; `tunnels`: prefixes of
    /// the tunnel interfaces' names.
    pub fn new(cluster: &netpol::Cluster, tunnels: &[&str]) -> Self {
        let mut by_ip: BTreeMap<IpAddr, Vec<Holder>> = BTreeMap::new();
        for pod in &cluster.pods {
            for ip in &pod.ips {
                by_ip.entry(*ip).or_default().push(Holder {
                    name: pod.key(),
                    peer: pod.peer.as_deref().map(table_spelling),
                });
            }
        }
        Self {
            by_ip,
            tunnels: tunnels.iter().map(|t| t.to_string()).collect(),
        }
    }

    fn faces_tunnel(&self, interface: &str) -> bool {
        !interface.is_empty()
            && self
                .tunnels
                .iter()
                .any(|t| interface.starts_with(t.as_str()))
    }

    fn lookup(&self, ip: IpAddr, end: End, peer: Option<&str>) -> Option<&str> {
        let all = self.by_ip.get(&ip)?;
        let only = |keep: &dyn Fn(&Holder) -> bool| {
            let mut it = all.iter().filter(|h| keep(h));
            match (it.next(), it.next()) {
                (Some(h), None) => Some(h.name.as_str()),
                _ => None,
            }
        };
        let preferred: Option<&str> = match end {
            End::Remote => only(&|h| match (peer, &h.peer) {
                (Some(p), Some(q)) => p == q,
                (None, Some(_)) => true,
                _ => false,
            }),
            End::Local => only(&|h| h.peer.is_none()),
            End::Unknown => None,
        };
        preferred.or_else(|| {
            // Where the preferred side has nobody at this address, a name only if one pod in
            // the whole cluster holds it.
            let side_has = |h: &Holder| match end {
                End::Remote => h.peer.is_some(),
                End::Local => h.peer.is_none(),
                End::Unknown => false,
            };
            (!all.iter().any(side_has)).then(|| only(&|_| true))?
        })
    }

    /// The pods behind `e`'s source and destination, where known.
    pub fn names(&self, e: &Event) -> (Option<&str>, Option<&str>) {
        let peer = table_peer(&e.table);
        let (src_end, dst_end) = if self.faces_tunnel(&e.iif) {
            (End::Remote, End::Local)
        } else if self.faces_tunnel(&e.oif) {
            (End::Local, End::Remote)
        } else {
            (End::Unknown, End::Unknown)
        };
        (
            self.lookup(e.src, src_end, peer),
            self.lookup(e.dst, dst_end, peer),
        )
    }
}

/// The filters of a cluster-wide `observe` that need the pods' names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFilter {
    /// `--from-pod namespace/name`: the source is this pod.
    pub from_pod: Option<String>,
    /// `--to-pod namespace/name`: the destination is this pod.
    pub to_pod: Option<String>,
    /// `--namespace`: either end is a pod of this namespace.
    pub namespace: Option<String>,
    /// `--peer`: the event is of this peer's tables.
    pub peer: Option<String>,
}

impl PodFilter {
    /// Whether the event, whose ends are the pods `src` and `dst` (where known), passes.
    pub fn keeps(&self, e: &Event, src: Option<&str>, dst: Option<&str>) -> bool {
        let in_ns = |n: Option<&str>, ns: &str| {
            n.and_then(|n| n.split_once('/'))
                .is_some_and(|(pod_ns, _)| pod_ns == ns)
        };
        self.from_pod.as_deref().is_none_or(|p| src == Some(p))
            && self.to_pod.as_deref().is_none_or(|p| dst == Some(p))
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| in_ns(src, ns) || in_ns(dst, ns))
            && self
                .peer
                .as_deref()
                .is_none_or(|p| table_peer(&e.table) == Some(table_spelling(p).as_str()))
    }
}

/// One event of one agent, ordered by time (then by agent and arrival, so that equal times
/// keep each agent's order).
#[derive(Clone, Debug)]
pub struct Sourced {
    /// The event.
    pub event: Event,
    /// The node of the agent that reported it.
    pub node: String,
    /// Arrival number.
    pub seq: u64,
}

impl Sourced {
    fn key(&self) -> (SystemTime, &str, u64) {
        (self.event.time, self.node.as_str(), self.seq)
    }
}

impl PartialEq for Sourced {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl Eq for Sourced {}
impl PartialOrd for Sourced {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Sourced {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Reversed: `BinaryHeap` is a max-heap and the oldest goes first.
        other.key().cmp(&self.key())
    }
}

/// Events from several agents in time order: each is held for `hold` after its own time, so
/// that another agent's slightly older event, arriving later, still goes before it.
#[derive(Debug)]
pub struct Merge {
    heap: BinaryHeap<Sourced>,
    hold: Duration,
    seq: u64,
}

impl Merge {
    /// A merge holding events for `hold`.
    pub fn new(hold: Duration) -> Self {
        Self {
            heap: BinaryHeap::new(),
            hold,
            seq: 0,
        }
    }

    /// Take an event of the agent on `node`.
    pub fn push(&mut self, node: &str, event: Event) {
        self.seq += 1;
        self.heap.push(Sourced {
            event,
            node: node.to_string(),
            seq: self.seq,
        });
    }

    /// The events whose hold is over at `now`, oldest first.
    pub fn ready(&mut self, now: SystemTime) -> Vec<Sourced> {
        let mut out = Vec::new();
        while let Some(top) = self.heap.peek() {
            if top.event.time + self.hold > now {
                break;
            }
            out.extend(self.heap.pop());
        }
        out
    }

    /// Every event left, oldest first.
    pub fn drain(&mut self) -> Vec<Sourced> {
        let mut out = Vec::with_capacity(self.heap.len());
        while let Some(s) = self.heap.pop() {
            out.push(s);
        }
        out
    }
}

#[cfg(test)]
mod tests;
