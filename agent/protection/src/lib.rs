//! Provider and consumer protection, as pure functions from a snapshot of the cluster to the
//! objects peerwall's controller keeps in place (the thesis's Liqo Security Agent, chapters 3–4,
//! plus the consumer side it left as future work).
//!
//! For every peer cluster (a Liqo tenant namespace), one gateway FirewallConfiguration: traffic
//! arriving from that peer's tunnel is dropped unless
//! - it goes to a pod the peer offloaded here (provider protection), or
//! - it comes from one of our pods the peer runs for us (consumer protection; optionally not
//!   towards our pods offloaded to *other* peers: leaf-to-leaf blocking).
//!
//! Replies to connections our side opened (conntrack `established`/`related`) pass before the
//! default deny: provider pods reach consumer pods, the consumer still opens nothing but what
//! it offloaded. Established connections survive a pod's removal from a set until conntrack
//! forgets them, as with Kubernetes NetworkPolicy implementations.
//!
//! Address lists are named sets, so a pod added or removed is one set-element change in the
//! kernel. For every offloaded namespace, a NetworkPolicy allowing egress only to namespaces of
//! the same consumer and to DNS.
//!
//! No kube types here: the controller converts API objects into [`World`] at the edge.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

pub mod boot;
pub mod coverage;
pub mod enforcement;
pub mod exceptions;
pub mod index;
pub mod namespaces;
pub mod publish;

use peerwall_intent::types as api;
use serde_json::{json, Value};

/// Liqo labels the decisions depend on (same strings as the agent's `k8s` constants). Liqo:
/// `pkg/consts/namespace_mapping.go` (`RemoteClusterID`), `pkg/consts/core.go`
/// (`TenantNamespaceLabel`).
const REMOTE_CLUSTER_ID: &str = "liqo.io/remote-cluster-id";
const TENANT_NAMESPACE: &str = "liqo.io/tenant-namespace";

pub use peerwall_intent::labels::{MANAGED_BY, MANAGER, PEER, TARGET, TARGET_GATEWAY};
/// Name of the gateway FirewallConfiguration in each tenant namespace.
pub const GATEWAY_CONFIG: &str = "peerwall-gateway";

/// A namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Namespace {
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// A pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `status.podIPs` (or `status.podIP`).
    pub ips: Vec<IpAddr>,
    /// Phase Succeeded/Failed, or being deleted: its IP may already belong to someone else.
    pub gone: bool,
}

/// A node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// What the controller sees.
#[derive(Clone, Debug, Default)]
pub struct World {
    /// All namespaces.
    pub namespaces: Vec<Namespace>,
    /// All pods.
    pub pods: Vec<Pod>,
    /// Virtual nodes (Liqo's `liqo.io/type=virtual-node`).
    pub virtual_nodes: Vec<Node>,
    /// Per peer (cluster id): how its CIDRs are remapped here, from Liqo's `Configuration` in
    /// its tenant namespace.
    pub remaps: BTreeMap<String, Vec<Remap>>,
    /// Per peer: the source CIDRs its packets may carry through the tunnel
    /// ([`configuration_sources`]); a peer without any is not checked for spoofing.
    pub sources: BTreeMap<String, Vec<ipnet::IpNet>>,
}

/// One remapped CIDR of a peer, from Liqo's `Configuration` (`networking.liqo.io/v1beta1`):
/// the NetworkPolicy tier and protection read the same ones.
pub use peerwall_netpol::Remap;

/// The remaps of one Liqo `Configuration` (its labels and its JSON body): the peer it is for
/// (label `liqo.io/remote-cluster-id`, Liqo's `external-network/route/k8s.go`
/// `GetRemoteClusterID`) and, position by position, `spec.remote.cidr.{pod,external}` against
/// `status.remote.cidr.{pod,external}`. Identity mappings (no overlap) are left out; an entry
/// that does not parse, or whose two prefixes differ in length, is skipped (Liqo never
/// writes one).
pub fn configuration_remaps(
    labels: &BTreeMap<String, String>,
    body: &Value,
) -> Option<(String, Vec<Remap>)> {
    let peer = labels.get(REMOTE_CLUSTER_ID)?.clone();
    let mut out = Vec::new();
    for kind in ["pod", "external"] {
        let list = |side: &str| -> Vec<Option<ipnet::IpNet>> {
            body.pointer(&format!("/{side}/remote/cidr/{kind}"))
                .and_then(Value::as_array)
                .map(|v| {
                    v.iter()
                        .map(|c| c.as_str().and_then(|s| s.parse().ok()))
                        .collect()
                })
                .unwrap_or_default()
        };
        for (real, seen) in list("spec").into_iter().zip(list("status")) {
            if let (Some(real), Some(seen)) = (real, seen) {
                if real != seen && real.prefix_len() == seen.prefix_len() {
                    out.push(Remap { real, seen });
                }
            }
        }
    }
    Some((peer, out))
}

/// The peer a Liqo `Configuration` is for and its pod and external CIDRs as this cluster sees
/// them: `status.remote.cidr.{pod,external}` (remapped where they overlap ours), else
/// `spec.remote.cidr.{pod,external}`. Entries that do not parse are skipped.
pub fn configuration_cidrs(
    labels: &BTreeMap<String, String>,
    body: &Value,
) -> Option<(String, Vec<ipnet::IpNet>)> {
    let peer = labels.get(REMOTE_CLUSTER_ID)?.clone();
    let mut out = Vec::new();
    for kind in ["pod", "external"] {
        let seen = configuration_list(body, "status", kind);
        out.extend(if seen.is_empty() {
            configuration_list(body, "spec", kind)
        } else {
            seen
        });
    }
    out.sort();
    out.dedup();
    Some((peer, out))
}

/// The CIDRs of a `Configuration`'s `{side}.remote.cidr.{kind}` that parse.
fn configuration_list(body: &Value, side: &str, kind: &str) -> Vec<ipnet::IpNet> {
    body.pointer(&format!("/{side}/remote/cidr/{kind}"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str()?.parse().ok())
        .collect()
}

/// The peer a Liqo `Configuration` is for and the source CIDRs its packets may carry through
/// the tunnel: its pod and external CIDRs, both its own (`spec.remote.cidr`, what the
/// gateway's forward hook sees before Liqo's SNAT at postrouting) and as seen here
/// (`status.remote.cidr`, remapped where they overlap ours). Entries that do not parse are
/// skipped.
pub fn configuration_sources(
    labels: &BTreeMap<String, String>,
    body: &Value,
) -> Option<(String, Vec<ipnet::IpNet>)> {
    let peer = labels.get(REMOTE_CLUSTER_ID)?.clone();
    let mut out: Vec<ipnet::IpNet> = Vec::new();
    for side in ["spec", "status"] {
        for kind in ["pod", "external"] {
            out.extend(configuration_list(body, side, kind));
        }
    }
    out.sort();
    out.dedup();
    Some((peer, out))
}

/// `ip` (as this cluster sees it) as it crosses `remaps`' peer's tunnel.
fn real_address(remaps: &[Remap], ip: IpAddr) -> IpAddr {
    remaps.iter().find_map(|r| r.to_real(ip)).unwrap_or(ip)
}

/// Liqo's tunnel interfaces: `liqo-tunnel`, and `liqo-tunnel1`, … in multi-tunnel gateways
/// (a trailing `*` is a prefix match). Liqo: `pkg/gateway/tunnel/const.go`
/// (`TunnelInterfaceName`) and `pkg/gateway/tunnel/netlink.go` (`GetTunnelName`).
pub const DEFAULT_TUNNEL: &str = "liqo-tunnel*";

/// Options of the gateway configuration.
#[derive(Clone, Debug)]
pub struct Options {
    /// The tunnel interface in the gateway: a name, or a prefix ending in `*`
    /// ([`DEFAULT_TUNNEL`]).
    pub tunnel: String,
    /// Drop traffic from our pods on this peer towards our pods on other peers.
    pub block_leaf_to_leaf: bool,
    /// Publish the configurations in audit mode (`spec.audit`): what they would drop is
    /// reported, not dropped.
    pub audit: bool,
    /// The UDP port Liqo's gateways check their tunnel with (Liqo's gateway flag
    /// `--ping-port`, [`LIQO_PING_PORT`] by default): the one thing from the tunnel the
    /// gateway itself takes besides replies.
    pub liqo_ping_port: u16,
    /// Consumer protection by namespace: our pods a peer runs reach only their own
    /// namespace's pods here ([`namespaces`]); `false`: every pod here.
    pub own_namespace_only: bool,
}

impl Options {
    /// The per-peer switches these options set (ProtectionPolicies may override them).
    pub fn settings(&self) -> exceptions::Settings {
        exceptions::Settings {
            audit: self.audit,
            block_leaf_to_leaf: self.block_leaf_to_leaf,
            own_namespace_only: self.own_namespace_only,
        }
    }
}

/// What a peer's gateway configuration merges besides its slice-filled address sets: consumer
/// protection's per-namespace sets and what the ProtectionPolicies say for the peer (their
/// switches override the [`Options`]'). Published inline.
#[derive(Clone, Debug)]
pub struct Declared {
    /// Our namespaces with pods on the peer ([`namespaces::namespace_sets`]).
    pub namespaces: BTreeMap<String, namespaces::NsSets>,
    /// The ProtectionPolicies, resolved for the peer.
    pub exceptions: exceptions::ForPeer,
}

impl Declared {
    /// Nothing declared: the options' switches, no namespace known.
    pub fn defaults(opts: &Options) -> Self {
        Self {
            namespaces: BTreeMap::new(),
            exceptions: exceptions::ForPeer::defaults(opts.settings()),
        }
    }
}

/// Liqo's default `--ping-port`: its connection checker listens on UDP 0.0.0.0:12345 in every
/// gateway and pings the peer gateway's tunnel address there
/// (`pkg/gateway/connection/flags.go`, `conncheck/conncheck.go`).
pub const LIQO_PING_PORT: u16 = 12345;

/// A peer cluster: its id and tenant namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Peer {
    /// Cluster id.
    pub id: String,
    /// Tenant namespace (where its gateway configuration lives).
    pub tenant_namespace: String,
    /// The source CIDRs its packets may carry through the tunnel (its pod and external
    /// CIDRs, its own and as seen here: [`configuration_sources`]). Empty: not known (no
    /// `Configuration` yet), sources are not checked.
    pub sources: Vec<ipnet::IpNet>,
}

/// Address sets of one peer's gateway configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSets {
    /// Pods the peer offloaded to us.
    pub offloaded: BTreeSet<IpAddr>,
    /// Our pods running on the peer, by the addresses the gateway's forward hook sees on
    /// packets from them: the peer's own (a remapped pod IP translated back, since Liqo's
    /// gateway SNATs what comes from the tunnel only at postrouting).
    pub remote: BTreeSet<IpAddr>,
    /// Our pods running on other peers.
    pub elsewhere: BTreeSet<IpAddr>,
}

fn is_tenant(ns: &Namespace) -> bool {
    ns.labels.get(TENANT_NAMESPACE).map(String::as_str) == Some("true")
}

/// The peers: tenant namespaces that name a remote cluster.
pub fn peers(world: &World) -> Vec<Peer> {
    let mut out: Vec<Peer> = world
        .namespaces
        .iter()
        .filter(|n| is_tenant(n))
        .filter_map(|n| {
            n.labels.get(REMOTE_CLUSTER_ID).map(|id| Peer {
                id: id.clone(),
                tenant_namespace: n.name.clone(),
                sources: world.sources.get(id).cloned().unwrap_or_default(),
            })
        })
        .collect();
    out.sort();
    out
}

/// The consumer an offloaded namespace belongs to (a non-tenant namespace naming a cluster).
pub fn offloaded_namespace_owner(ns: &Namespace) -> Option<&str> {
    if is_tenant(ns) {
        return None;
    }
    ns.labels.get(REMOTE_CLUSTER_ID).map(String::as_str)
}

/// Address sets for every peer, from one snapshot.
pub fn sets(world: &World) -> BTreeMap<String, PeerSets> {
    let ns_owner: BTreeMap<&str, Option<&str>> = world
        .namespaces
        .iter()
        .map(|n| (n.name.as_str(), offloaded_namespace_owner(n)))
        .collect();
    let tenant: BTreeSet<&str> = world
        .namespaces
        .iter()
        .filter(|n| is_tenant(n))
        .map(|n| n.name.as_str())
        .collect();
    let vnode_peer: BTreeMap<&str, &str> = world
        .virtual_nodes
        .iter()
        .filter_map(|n| {
            n.labels
                .get(REMOTE_CLUSTER_ID)
                .map(|id| (n.name.as_str(), id.as_str()))
        })
        .collect();
    let mut out: BTreeMap<String, PeerSets> = peers(world)
        .into_iter()
        .map(|p| (p.id, PeerSets::default()))
        .collect();
    for pod in &world.pods {
        if pod.gone || pod.ips.is_empty() || tenant.contains(pod.namespace.as_str()) {
            continue;
        }
        // Ours, running on a peer through its virtual node.
        if let Some(peer) = pod.node.as_deref().and_then(|n| vnode_peer.get(n)) {
            let remaps = world.remaps.get(*peer).map_or(&[][..], Vec::as_slice);
            for (id, s) in out.iter_mut() {
                if id == peer {
                    s.remote
                        .extend(pod.ips.iter().map(|ip| real_address(remaps, *ip)));
                } else {
                    s.elsewhere.extend(pod.ips.iter().copied());
                }
            }
            continue;
        }
        // Offloaded to us by a consumer: labeled, or in a namespace the consumer owns.
        let owner = pod
            .labels
            .get(REMOTE_CLUSTER_ID)
            .map(String::as_str)
            .or_else(|| ns_owner.get(pod.namespace.as_str()).copied().flatten());
        if let Some(s) = owner.and_then(|o| out.get_mut(o)) {
            s.offloaded.extend(pod.ips.iter().copied());
        }
    }
    out
}

/// What the API currently holds for one peer's gateway configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// The `offloaded` addresses in its spec.
    pub offloaded: BTreeSet<IpAddr>,
    /// Every host reports `Applied` for the current generation (or no host enforces it).
    pub settled: bool,
}

/// IP reuse across tenants: an address joins peer `p`'s `offloaded` set only once no other
/// peer's published configuration lists it and that removal is enforced everywhere (settled).
/// An address another peer still wants stays with that peer. Returns the sets to publish and
/// whether something was held back (the caller retries shortly).
pub fn gate_reuse(
    desired: &BTreeMap<String, PeerSets>,
    published: &BTreeMap<String, Published>,
) -> (BTreeMap<String, PeerSets>, bool) {
    let mut held = false;
    let mut out = desired.clone();
    for (id, s) in out.iter_mut() {
        let mine = published.get(id).map(|p| &p.offloaded);
        s.offloaded.retain(|ip| {
            if mine.is_some_and(|m| m.contains(ip)) {
                return true;
            }
            let blocked = published
                .iter()
                .any(|(other, p)| other != id && (p.offloaded.contains(ip) || !p.settled));
            held |= blocked;
            !blocked
        });
    }
    (out, held)
}

/// nftables table name of a peer's configuration.
pub fn table_name(peer: &str) -> String {
    let clean: String = peer
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("peerwall_{clean}")
}

/// An address set of one family: `keys` are its elements (addresses or CIDRs);
/// `from_address_sets`: it also takes AddressSet slices.
fn addr_set(
    name: String,
    keys: impl Iterator<Item = String>,
    v6: bool,
    from_address_sets: bool,
) -> api::Set {
    api::Set {
        from_address_sets,
        name,
        key_type: Some(if v6 {
            api::SetDataType::Ipv6Addr
        } else {
            api::SetDataType::Ipv4Addr
        }),
        data_type: None,
        elements: keys
            .map(|key| api::SetElement { key, data: None })
            .collect(),
    }
}

/// A set of pod addresses of one family, filled from AddressSet slices.
fn set_of(name: String, ips: &BTreeSet<IpAddr>, v6: bool) -> api::Set {
    addresses_set(name, ips, v6, true)
}

/// A set of the addresses of `ips` of one family.
fn addresses_set(
    name: String,
    ips: &BTreeSet<IpAddr>,
    v6: bool,
    from_address_sets: bool,
) -> api::Set {
    let keys = ips
        .iter()
        .filter(|ip| ip.is_ipv6() == v6)
        .map(ToString::to_string);
    addr_set(name, keys, v6, from_address_sets)
}

/// A set of addresses of one family, inline only (published with the configuration).
fn inline_set(name: String, ips: &BTreeSet<IpAddr>, v6: bool) -> api::Set {
    addresses_set(name, ips, v6, false)
}

/// Name of the gateway configuration's set of the peer's source CIDRs (`sources`, `sources6`).
pub const SOURCES_SET: &str = "sources";

/// An inline set of the CIDRs of one family (never filled from AddressSets).
fn cidr_set(name: String, cidrs: &[ipnet::IpNet], v6: bool) -> api::Set {
    let keys = cidrs
        .iter()
        .filter(|c| matches!(c, ipnet::IpNet::V6(_)) == v6)
        .map(ToString::to_string);
    addr_set(name, keys, v6, false)
}

fn eq(m: api::Match) -> api::Match {
    api::Match {
        op: Some(api::MatchOperation::Eq),
        ..m
    }
}

/// A match on the address set `@set` in position `pos`.
fn in_set(set: String, pos: api::MatchPosition) -> api::Match {
    eq(api::Match {
        ip: Some(api::MatchIp {
            value: format!("@{set}"),
            position: Some(pos),
        }),
        ..Default::default()
    })
}

/// The gateway FirewallConfiguration `spec` for one peer with nothing declared besides
/// `opts` ([`Declared::defaults`]).
pub fn gateway_spec(
    peer: &str,
    sources: &[ipnet::IpNet],
    s: &PeerSets,
    opts: &Options,
) -> api::FirewallConfigurationSpec {
    gateway_spec_with(peer, sources, s, opts, &Declared::defaults(opts))
}

fn ctstate(states: Vec<api::CtState>) -> api::Match {
    eq(api::Match {
        ctstate: Some(api::MatchCtState { value: states }),
        ..Default::default()
    })
}

fn l4(p: peerwall_netpol::Protocol) -> api::L4Proto {
    match p {
        peerwall_netpol::Protocol::Tcp => api::L4Proto::Tcp,
        peerwall_netpol::Protocol::Udp => api::L4Proto::Udp,
        peerwall_netpol::Protocol::Sctp => api::L4Proto::Sctp,
    }
}

/// The port matches of a port list, one group per protocol (`.tcp`, …: the protocol and a
/// comma-separated list of its ports, or the protocol alone when one entry takes every port);
/// an empty list is one group matching every packet.
fn port_groups(ports: &[exceptions::PortRange]) -> Vec<(String, Vec<api::Match>)> {
    if ports.is_empty() {
        return vec![(String::new(), vec![])];
    }
    let mut by_proto: BTreeMap<peerwall_netpol::Protocol, Option<Vec<(u16, u16)>>> =
        BTreeMap::new();
    for p in ports {
        let e = by_proto.entry(p.protocol).or_insert_with(|| Some(vec![]));
        match (p.range, e.as_mut()) {
            (None, _) => *e = None,
            (Some(r), Some(v)) => v.push(r),
            (Some(_), None) => {}
        }
    }
    by_proto
        .into_iter()
        .map(|(proto, ranges)| {
            let mut m = vec![eq(api::Match {
                proto: Some(api::MatchProto { value: l4(proto) }),
                ..Default::default()
            })];
            if let Some(mut r) = ranges {
                r.sort();
                r.dedup();
                let list: Vec<String> = r
                    .iter()
                    .map(|(a, b)| {
                        if a == b {
                            a.to_string()
                        } else {
                            format!("{a}-{b}")
                        }
                    })
                    .collect();
                m.push(eq(api::Match {
                    port: Some(api::MatchPort {
                        value: list.join(","),
                        position: Some(api::MatchPosition::Dst),
                    }),
                    ..Default::default()
                }));
            }
            (format!(".{}", proto.name().to_ascii_lowercase()), m)
        })
        .collect()
}

/// The gateway rules (name, matches after the tunnel's) of an opening for the peer's own pods
/// and/or our pods it runs: towards the opening's set, on its ports; from our pods only
/// (`@remote`) when the peer's other pods are not opened. None for an opening of offloaded
/// pods only (their NetworkPolicy carries it).
pub fn open_rules(o: &exceptions::Open) -> Vec<(String, Vec<api::Match>)> {
    use peerwall_intent::protection::From;
    let from = &o.opening.from;
    if !from.contains(&From::PeerPods) && !from.contains(&From::OwnPods) {
        return vec![];
    }
    let mut out = Vec::new();
    for v6 in [false, true] {
        let sfx = if v6 { "6" } else { "" };
        for (group, ports) in port_groups(&o.opening.ports) {
            let mut m = Vec::new();
            if !from.contains(&From::PeerPods) {
                m.push(in_set(format!("remote{sfx}"), api::MatchPosition::Src));
            }
            m.push(in_set(o.set_name(v6), api::MatchPosition::Dst));
            m.extend(ports);
            out.push((format!("{}{group}", o.set_name(v6)), m));
        }
    }
    out
}

/// The gateway rules (name, matches after the tunnel's) of a closing: new connections towards
/// the peer's offloaded pods on its ports (replies never match: they are not new).
pub fn close_rules(c: &exceptions::Close) -> Vec<(String, Vec<api::Match>)> {
    let mut out = Vec::new();
    for v6 in [false, true] {
        let sfx = if v6 { "6" } else { "" };
        for (group, ports) in port_groups(&c.closing.ports) {
            let mut m = vec![
                ctstate(vec![api::CtState::New]),
                in_set(format!("offloaded{sfx}"), api::MatchPosition::Dst),
            ];
            m.extend(ports);
            out.push((
                format!("close{sfx}.{}.{}{group}", c.policy, c.closing.name),
                m,
            ));
        }
    }
    out
}

/// The gateway FirewallConfiguration `spec` for one peer: named sets of its offloaded pods
/// (and of our pods it runs), and one forward chain whose rules all test the tunnel first.
/// Every slice-filled set also takes AddressSet slices (`fromAddressSets`): the controller
/// publishes the addresses as slices ([`layout`]) and passes empty inline sets; small setups
/// and tests may pass the addresses inline. What `d` declares (consumer protection by
/// namespace, ProtectionPolicies) is inline; its switches are the ones in force.
///
/// Order of the forward chain: spoofed sources, closings, leaf-to-leaf, offloaded pods,
/// openings, our pods (by namespace, or all of them), replies, default deny.
pub fn gateway_spec_with(
    peer: &str,
    sources: &[ipnet::IpNet],
    s: &PeerSets,
    opts: &Options,
    d: &Declared,
) -> api::FirewallConfigurationSpec {
    use api::MatchPosition::{Dst, Src};
    let settings = d.exceptions.settings;
    let from_tunnel = eq(api::Match {
        dev: Some(api::MatchDev {
            value: opts.tunnel.clone(),
            position: Some(api::MatchDevPosition::In),
            wildcard: false,
        }),
        ..Default::default()
    });
    let rule = |name: String, action: api::FilterAction, extra: Vec<api::Match>| {
        let mut m = vec![from_tunnel.clone()];
        m.extend(extra);
        api::FilterRule {
            name: Some(name),
            r#match: m,
            action: Some(action),
            value: None,
            counter: None,
        }
    };
    let mut names = vec![("offloaded", &s.offloaded), ("remote", &s.remote)];
    if settings.block_leaf_to_leaf {
        names.push(("elsewhere", &s.elsewhere));
    }
    let mut sets: Vec<api::Set> = names
        .iter()
        .flat_map(|(name, ips)| {
            [
                set_of(name.to_string(), ips, false),
                set_of(format!("{name}6"), ips, true),
            ]
        })
        .collect();
    let mut rules = Vec::new();
    // Anti-spoofing: from the tunnel, only the peer's own CIDRs (both families: a family the
    // peer has no CIDR of has no legitimate source at all).
    if !sources.is_empty() {
        for (sfx, v6) in [("", false), ("6", true)] {
            sets.push(cidr_set(format!("{SOURCES_SET}{sfx}"), sources, v6));
            rules.push(rule(
                format!("spoofed{sfx}"),
                api::FilterAction::Drop,
                vec![api::Match {
                    op: Some(api::MatchOperation::Neq),
                    ip: Some(api::MatchIp {
                        value: format!("@{SOURCES_SET}{sfx}"),
                        position: Some(Src),
                    }),
                    ..Default::default()
                }],
            ));
        }
    }
    for c in &d.exceptions.close {
        for (name, m) in close_rules(c) {
            rules.push(rule(name, api::FilterAction::Drop, m));
        }
    }
    for sfx in ["", "6"] {
        if settings.block_leaf_to_leaf {
            rules.push(rule(
                format!("leaf_to_leaf{sfx}"),
                api::FilterAction::Drop,
                vec![
                    in_set(format!("remote{sfx}"), Src),
                    in_set(format!("elsewhere{sfx}"), Dst),
                ],
            ));
        }
    }
    for sfx in ["", "6"] {
        rules.push(rule(
            format!("to_offloaded{sfx}"),
            api::FilterAction::Accept,
            vec![in_set(format!("offloaded{sfx}"), Dst)],
        ));
    }
    for o in &d.exceptions.open {
        let r = open_rules(o);
        if r.is_empty() {
            continue;
        }
        for v6 in [false, true] {
            sets.push(inline_set(o.set_name(v6), &o.addresses, v6));
        }
        for (name, m) in r {
            rules.push(rule(name, api::FilterAction::Accept, m));
        }
    }
    if settings.own_namespace_only {
        for (ns, n) in &d.namespaces {
            for v6 in [false, true] {
                let (own, home) = (
                    namespaces::set_name("own", ns, v6),
                    namespaces::set_name("home", ns, v6),
                );
                sets.push(inline_set(own.clone(), &n.own, v6));
                sets.push(inline_set(home.clone(), &n.home, v6));
                rules.push(rule(
                    own.clone(),
                    api::FilterAction::Accept,
                    vec![in_set(own, Src), in_set(home, Dst)],
                ));
            }
        }
    } else {
        for sfx in ["", "6"] {
            rules.push(rule(
                format!("from_own_pods{sfx}"),
                api::FilterAction::Accept,
                vec![in_set(format!("remote{sfx}"), Src)],
            ));
        }
    }
    rules.push(rule(
        "replies".into(),
        api::FilterAction::Accept,
        vec![ctstate(vec![
            api::CtState::Established,
            api::CtState::Related,
        ])],
    ));
    rules.push(rule("default_deny".into(), api::FilterAction::Drop, vec![]));
    api::FirewallConfigurationSpec {
        table: api::Table {
            name: Some(table_name(peer)),
            family: Some(api::TableFamily::Inet),
            sets,
            chains: vec![
                api::Chain {
                    name: Some("from_peer".into()),
                    type_: Some(api::ChainType::Filter),
                    hook: Some(api::ChainHook::Forward),
                    priority: Some(0),
                    policy: Some(api::ChainPolicy::Accept),
                    rules: api::RulesSet {
                        filter_rules: Some(rules),
                        ..Default::default()
                    },
                },
                to_gateway_chain(rule, opts.liqo_ping_port),
            ],
        },
        audit: settings.audit,
    }
}

/// The gateway itself (input hook): from the peer's tunnel it takes replies to what it opened
/// and Liqo's tunnel check (UDP to `ping_port`, the peer gateway's pings; the pongs to ours
/// are replies), and nothing else.
fn to_gateway_chain(
    rule: impl Fn(String, api::FilterAction, Vec<api::Match>) -> api::FilterRule,
    ping_port: u16,
) -> api::Chain {
    let rules = vec![
        rule(
            "gateway_replies".into(),
            api::FilterAction::Accept,
            vec![eq(api::Match {
                ctstate: Some(api::MatchCtState {
                    value: vec![api::CtState::Established, api::CtState::Related],
                }),
                ..Default::default()
            })],
        ),
        rule(
            "liqo_tunnel_check".into(),
            api::FilterAction::Accept,
            vec![
                eq(api::Match {
                    proto: Some(api::MatchProto {
                        value: api::L4Proto::Udp,
                    }),
                    ..Default::default()
                }),
                eq(api::Match {
                    port: Some(api::MatchPort {
                        value: ping_port.to_string(),
                        position: Some(api::MatchPosition::Dst),
                    }),
                    ..Default::default()
                }),
            ],
        ),
        rule("gateway_deny".into(), api::FilterAction::Drop, vec![]),
    ];
    api::Chain {
        name: Some("to_gateway".into()),
        type_: Some(api::ChainType::Filter),
        hook: Some(api::ChainHook::Input),
        priority: Some(0),
        policy: Some(api::ChainPolicy::Accept),
        rules: api::RulesSet {
            filter_rules: Some(rules),
            ..Default::default()
        },
    }
}

/// The whole gateway FirewallConfiguration of a peer as the controller publishes it
/// (`peerwall.io/v1alpha1`, in the peer's tenant namespace, with peerwall's labels); the
/// controller adds the owner reference.
pub fn gateway_object(peer: &Peer, s: &PeerSets, opts: &Options) -> Value {
    gateway_object_with(peer, s, opts, &Declared::defaults(opts))
}

/// [`gateway_object`] with what `d` declares ([`gateway_spec_with`]).
pub fn gateway_object_with(peer: &Peer, s: &PeerSets, opts: &Options, d: &Declared) -> Value {
    json!({
        "apiVersion": peerwall_intent::load::API_VERSION,
        "kind": peerwall_intent::load::KIND,
        "metadata": {
            "name": GATEWAY_CONFIG,
            "namespace": peer.tenant_namespace,
            "labels": {
                TARGET: TARGET_GATEWAY,
                PEER: peer.id,
                MANAGED_BY: MANAGER,
            },
        },
        "spec": gateway_spec_with(&peer.id, &peer.sources, s, opts, d),
    })
}

/// The names of the sets of a gateway configuration, each with the addresses of `s` it holds.
pub fn set_contents<'a>(s: &'a PeerSets, opts: &Options) -> Vec<(String, BTreeSet<IpAddr>)> {
    let mut names: Vec<(&str, &'a BTreeSet<IpAddr>)> =
        vec![("offloaded", &s.offloaded), ("remote", &s.remote)];
    if opts.block_leaf_to_leaf {
        names.push(("elsewhere", &s.elsewhere));
    }
    names
        .into_iter()
        .flat_map(|(name, ips)| {
            [
                (
                    name.to_string(),
                    ips.iter().filter(|i| i.is_ipv4()).copied().collect(),
                ),
                (
                    format!("{name}6"),
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
    json!({
        "apiVersion": peerwall_intent::load::API_VERSION,
        "kind": peerwall_intent::load::ADDRESS_SET_KIND,
        "metadata": {
            "name": slice.name,
            "namespace": peer.tenant_namespace,
            "labels": {
                TARGET: TARGET_GATEWAY,
                PEER: peer.id,
                MANAGED_BY: MANAGER,
                SET_LABEL: slice.set,
            },
        },
        "spec": {
            "firewallConfiguration": GATEWAY_CONFIG,
            "set": slice.set,
            "addresses": slice.addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
        },
    })
}

/// Name of the NetworkPolicy in each offloaded namespace.
pub const NETWORK_POLICY: &str = "peerwall-offloaded";

/// The NetworkPolicy the controller keeps in the offloaded namespace `namespace` of
/// `consumer`, whose pod and external CIDRs as seen here are `home`, with the openings of the
/// consumer's ProtectionPolicies for offloaded pods (the controller adds the owner reference).
pub fn offloaded_network_policy(
    namespace: &str,
    consumer: &str,
    home: &[ipnet::IpNet],
    open: &[&exceptions::Open],
) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": NETWORK_POLICY,
            "namespace": namespace,
            "labels": { MANAGED_BY: MANAGER, REMOTE_CLUSTER_ID: consumer },
        },
        "spec": network_policy_spec(consumer, home, open),
    })
}

/// A selector as the API writes it.
fn selector_json(s: &peerwall_netpol::Selector) -> Value {
    let mut out = serde_json::Map::new();
    if !s.labels.is_empty() {
        out.insert("matchLabels".into(), json!(s.labels));
    }
    if !s.exprs.is_empty() {
        let exprs: Vec<Value> = s
            .exprs
            .iter()
            .map(|r| {
                let mut e = json!({ "key": r.key, "operator": r.op.name() });
                if !r.values.is_empty() {
                    e["values"] = json!(r.values);
                }
                e
            })
            .collect();
        out.insert("matchExpressions".into(), Value::Array(exprs));
    }
    Value::Object(out)
}

/// The egress rule of an opening: its selectors (provider pods only) and ports (`endPort`
/// for ranges: NetworkPolicy's, beta since Kubernetes 1.22).
fn opening_egress(o: &exceptions::Open) -> Value {
    let mut rule = json!({ "to": [{
        "namespaceSelector": selector_json(&o.opening.namespaces),
        "podSelector": selector_json(&o.opening.pods),
    }]});
    if !o.opening.ports.is_empty() {
        let ports: Vec<Value> = o
            .opening
            .ports
            .iter()
            .map(|p| {
                let mut e = json!({ "protocol": p.protocol.name() });
                match p.range {
                    Some((a, b)) if a == b => e["port"] = json!(a),
                    Some((a, b)) => {
                        e["port"] = json!(a);
                        e["endPort"] = json!(b);
                    }
                    None => {}
                }
                e
            })
            .collect();
        rule["ports"] = Value::Array(ports);
    }
    rule
}

/// The spec of [`offloaded_network_policy`]: egress to the consumer's other offloaded
/// namespaces, to DNS, home (the consumer's own pods and external CIDR: reflected services,
/// leaf-to-leaf, through the tunnel, by the addresses this cluster sees them at), and what the
/// ProtectionPolicies open to offloaded pods.
pub fn network_policy_spec(
    consumer: &str,
    home: &[ipnet::IpNet],
    open: &[&exceptions::Open],
) -> Value {
    let mut egress = vec![
        json!({ "to": [{ "namespaceSelector": { "matchExpressions": [
            { "key": REMOTE_CLUSTER_ID, "operator": "In", "values": [consumer] },
            { "key": TENANT_NAMESPACE, "operator": "DoesNotExist" },
        ]}}]}),
        json!({ "to": [{ "namespaceSelector": {}, "podSelector": { "matchLabels": { "k8s-app": "kube-dns" }}}],
          "ports": [{ "protocol": "UDP", "port": 53 }, { "protocol": "TCP", "port": 53 }] }),
    ];
    if !home.is_empty() {
        egress.push(json!({ "to": home
            .iter()
            .map(|c| json!({ "ipBlock": { "cidr": c.trunc().to_string() } }))
            .collect::<Vec<_>>() }));
    }
    egress.extend(open.iter().map(|o| opening_egress(o)));
    json!({
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": egress,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::compile::{validate, PolicyObject};

    fn many(n: u32) -> BTreeSet<IpAddr> {
        (0..n)
            .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0x0a14_0000 + i)))
            .collect()
    }

    #[test]
    fn slices_are_bounded_and_a_change_rewrites_only_the_slices_it_touches() {
        let all = many(2500);
        let first = layout("offloaded", &[], &all);
        assert_eq!(first.len(), 3);
        assert!(first.iter().all(|s| s.addresses.len() <= 1000));
        assert_eq!(first.iter().map(|s| s.addresses.len()).sum::<usize>(), 2500);
        // One pod gone, one new: at most two slices rewritten, nothing else moves.
        let mut next = all.clone();
        let gone = *next.iter().nth(10).unwrap();
        next.remove(&gone);
        next.insert("10.21.0.1".parse().unwrap());
        let changed = layout("offloaded", &first, &next);
        assert!(changed.len() <= 2, "{}", changed.len());
        let mut merged: BTreeMap<String, Slice> =
            first.iter().map(|s| (s.name.clone(), s.clone())).collect();
        for c in changed {
            merged.insert(c.name.clone(), c);
        }
        let union: BTreeSet<IpAddr> = merged
            .values()
            .flat_map(|s| s.addresses.iter().copied())
            .collect();
        assert_eq!(union, next);
        for s in &first {
            let now = &merged[&s.name];
            assert!(now
                .addresses
                .iter()
                .all(|a| s.addresses.contains(a) || !all.contains(a)));
        }
        // Everything gone: slices come back empty (deleted by the caller once settled).
        let emptied = layout("offloaded", &first, &BTreeSet::new());
        assert_eq!(emptied.len(), 3);
        assert!(emptied.iter().all(|s| s.addresses.is_empty()));
    }

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
    fn ns(name: &str, kv: &[(&str, &str)]) -> Namespace {
        Namespace {
            name: name.into(),
            labels: labels(kv),
        }
    }
    fn pod(ns: &str, name: &str, ip: &str) -> Pod {
        Pod {
            namespace: ns.into(),
            name: name.into(),
            ips: vec![ip.parse().unwrap()],
            ..Default::default()
        }
    }
    fn ips(v: &[&str]) -> BTreeSet<IpAddr> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn world() -> World {
        World {
            namespaces: vec![
                ns(
                    "liqo-tenant-a",
                    &[(TENANT_NAMESPACE, "true"), (REMOTE_CLUSTER_ID, "a")],
                ),
                ns(
                    "liqo-tenant-b",
                    &[(TENANT_NAMESPACE, "true"), (REMOTE_CLUSTER_ID, "b")],
                ),
                ns("app-a", &[(REMOTE_CLUSTER_ID, "a")]),
                ns("local", &[]),
            ],
            pods: vec![
                pod("app-a", "web", "10.200.0.5"),
                pod("app-a", "web6", "fd00::5"),
                Pod {
                    labels: labels(&[(REMOTE_CLUSTER_ID, "b")]),
                    ..pod("local", "shadow", "10.200.0.6")
                },
                pod("local", "plain", "10.200.0.7"),
                pod("liqo-tenant-a", "gateway", "10.200.0.8"),
                Pod {
                    node: Some("liqo-c".into()),
                    ..pod("local", "mine-on-c", "10.99.0.1")
                },
                Pod {
                    gone: true,
                    ..pod("app-a", "done", "10.200.0.9")
                },
                Pod {
                    ips: vec![],
                    ..pod("app-a", "pending", "10.0.0.1")
                },
            ],
            virtual_nodes: vec![Node {
                name: "liqo-c".into(),
                labels: labels(&[(REMOTE_CLUSTER_ID, "a")]),
            }],
            remaps: BTreeMap::new(),
            sources: BTreeMap::new(),
        }
    }

    /// Peer `a`'s pod CIDR 10.200.0.0/16 overlaps ours and is seen here as 10.71.0.0/16: our pod
    /// running on `a` (reflected with 10.71.4.9) is listed by the address its packets carry
    /// through the tunnel and in the gateway's forward hook, 10.200.4.9. Other peers' sets,
    /// and addresses outside the remapped CIDR, keep the addresses this cluster uses.
    #[test]
    fn configuration_remaps_pair_spec_and_status_by_position() {
        let body = json!({
            "spec": {"remote": {"cidr": {"pod": ["10.200.0.0/16"], "external": ["10.70.0.0/16"]}}},
            "status": {"remote": {"cidr": {"pod": ["10.71.0.0/16"], "external": ["10.70.0.0/16"]}}},
        });
        let (peer, r) = configuration_remaps(&labels(&[(REMOTE_CLUSTER_ID, "a")]), &body).unwrap();
        assert_eq!(peer, "a");
        assert_eq!(
            r,
            vec![Remap {
                real: "10.200.0.0/16".parse().unwrap(),
                seen: "10.71.0.0/16".parse().unwrap(),
            }]
        );
        assert!(configuration_remaps(&labels(&[]), &body).is_none());
    }

    #[test]
    fn remote_pods_are_listed_by_the_address_the_forward_hook_sees() {
        let mut w = world();
        w.pods.push(Pod {
            node: Some("liqo-c".into()),
            ..pod("local", "remapped-on-a", "10.71.4.9")
        });
        w.remaps.insert(
            "a".into(),
            vec![Remap {
                real: "10.200.0.0/16".parse().unwrap(),
                seen: "10.71.0.0/16".parse().unwrap(),
            }],
        );
        let s = sets(&w);
        assert_eq!(s["a"].remote, ips(&["10.99.0.1", "10.200.4.9"]));
        assert_eq!(s["b"].elsewhere, ips(&["10.99.0.1", "10.71.4.9"]));
        let r = Remap {
            real: "10.200.0.0/16".parse().unwrap(),
            seen: "10.71.0.0/17".parse().unwrap(),
        };
        assert_eq!(
            r.to_real("10.71.0.1".parse().unwrap()),
            None,
            "lengths differ"
        );
        let r6 = Remap {
            real: "fd00:1::/64".parse().unwrap(),
            seen: "fd00:2::/64".parse().unwrap(),
        };
        assert_eq!(
            r6.to_real("fd00:2::7".parse().unwrap()),
            Some("fd00:1::7".parse().unwrap())
        );
    }

    #[test]
    fn sets_follow_namespaces_labels_and_virtual_nodes() {
        let s = sets(&world());
        assert_eq!(s["a"].offloaded, ips(&["10.200.0.5", "fd00::5"]));
        assert_eq!(s["b"].offloaded, ips(&["10.200.0.6"]));
        assert_eq!(s["a"].remote, ips(&["10.99.0.1"]));
        assert_eq!(s["b"].elsewhere, ips(&["10.99.0.1"]));
        assert!(s["b"].remote.is_empty());
    }

    #[test]
    fn gateway_spec_is_valid_and_default_denies() {
        for leaf in [false, true] {
            let s = &sets(&world())["a"];
            let spec = gateway_spec(
                "a-1",
                &[],
                s,
                &Options {
                    tunnel: "liqo-tunnel".into(),
                    block_leaf_to_leaf: leaf,
                    audit: false,
                    liqo_ping_port: LIQO_PING_PORT,
                    own_namespace_only: false,
                },
            );
            let doc = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
                "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
            let obj: PolicyObject = peerwall_intent::load::object_from_json(
                doc,
                peerwall_intent::load::Group::Peerwall,
            )
            .unwrap();
            validate(&obj).unwrap();
            let compiled = peerwall_policy::compile::compile(&[obj]).unwrap();
            let t = &compiled.policy.tables[0];
            assert_eq!(t.name, "peerwall_a_1");
            let rules = &t.chains[0].rules;
            assert_eq!(rules.last().unwrap().name, "default_deny");
            assert_eq!(rules.len(), if leaf { 8 } else { 6 });
            assert_eq!(rules[rules.len() - 2].name, "replies");
        }
    }

    /// Peer `a`'s gateway configuration (tunnel `liqo-tunnel*`, Liqo's default tunnel check)
    /// for `sources` and `s`, compiled as an agent compiles it.
    fn compiled_gateway(sources: &[ipnet::IpNet], s: &PeerSets) -> peerwall_policy::ir::Policy {
        let spec = gateway_spec(
            "a",
            sources,
            s,
            &Options {
                tunnel: DEFAULT_TUNNEL.into(),
                block_leaf_to_leaf: false,
                audit: false,
                liqo_ping_port: LIQO_PING_PORT,
                own_namespace_only: false,
            },
        );
        let doc = json!({"apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
            "metadata": {"name": "g", "namespace": "liqo-tenant-a"}, "spec": spec});
        let obj =
            peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
                .unwrap();
        peerwall_policy::compile::compile(&[obj]).unwrap().policy
    }

    /// Anti-spoofing as data: from the tunnel, a source outside the peer's CIDRs is dropped by
    /// `spoofed` before any allowance (even towards the peer's own offloaded pods); a source
    /// inside reaches them as before; IPv6 from a peer with no IPv6 CIDR is spoofed too; what
    /// does not come from the tunnel is not checked.
    #[test]
    fn spoofed_sources_from_the_tunnel_are_dropped_first() {
        use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};
        let s = PeerSets {
            offloaded: ips(&["10.20.1.2", "fd20::2"]),
            ..Default::default()
        };
        let sources: Vec<ipnet::IpNet> = vec!["10.10.0.0/16".parse().unwrap()];
        let policy = compiled_gateway(&sources, &s);
        let verdict = |src: &str, dst: &str, iif: &str, ct: CtState| {
            let v = evaluate(
                &policy,
                &Packet {
                    src: src.parse().unwrap(),
                    dst: dst.parse().unwrap(),
                    proto: 6,
                    sport: 40000,
                    dport: 80,
                    iif: Some(iif.into()),
                    oif: Some("liqo.x".into()),
                    ct_state: ct,
                },
            );
            (v.verdict, v.rule.unwrap_or_default())
        };
        let t = "liqo-tunnel";
        assert_eq!(
            verdict("10.10.1.5", "10.20.1.2", t, CtState::New),
            (VerdictAction::Accept, "to_offloaded".into())
        );
        for ct in [CtState::New, CtState::Established] {
            assert_eq!(
                verdict("10.99.1.5", "10.20.1.2", t, ct),
                (VerdictAction::Drop, "spoofed".into())
            );
        }
        assert_eq!(
            verdict("fd10::5", "fd20::2", t, CtState::New),
            (VerdictAction::Drop, "spoofed6".into())
        );
        // Not from the tunnel: not this chain's business.
        assert_eq!(
            verdict("10.99.1.5", "10.20.1.2", "eth0", CtState::New).0,
            VerdictAction::Accept
        );
        // No Configuration yet: no source check, the pod is reachable as before.
        let plain = gateway_spec(
            "a",
            &[],
            &s,
            &Options {
                tunnel: "liqo-tunnel".into(),
                block_leaf_to_leaf: false,
                audit: false,
                liqo_ping_port: LIQO_PING_PORT,
                own_namespace_only: false,
            },
        );
        assert!(!serde_json::to_string(&plain).unwrap().contains("spoofed"));
    }

    /// The gateway itself, as data: from the tunnel only Liqo's tunnel check and replies
    /// reach it; from elsewhere (the nodes, the underlay) nothing is checked.
    #[test]
    fn the_gateway_takes_only_the_tunnel_check_and_replies_from_the_tunnel() {
        use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};
        let policy = compiled_gateway(&[], &PeerSets::default());
        let to_gateway = |iif: &str, proto: u8, dport: u16, ct: CtState| {
            let v = evaluate(
                &policy,
                &Packet {
                    src: "169.254.18.2".parse().unwrap(),
                    dst: "169.254.18.1".parse().unwrap(),
                    proto,
                    sport: 12345,
                    dport,
                    iif: Some(iif.into()),
                    oif: None,
                    ct_state: ct,
                },
            );
            (v.verdict, v.rule.unwrap_or_default())
        };
        let t = "liqo-tunnel";
        assert_eq!(
            to_gateway(t, 17, LIQO_PING_PORT, CtState::New),
            (VerdictAction::Accept, "liqo_tunnel_check".into())
        );
        assert_eq!(
            to_gateway(t, 6, 22, CtState::New),
            (VerdictAction::Drop, "gateway_deny".into())
        );
        assert_eq!(
            to_gateway(t, 17, 53, CtState::New),
            (VerdictAction::Drop, "gateway_deny".into())
        );
        assert_eq!(
            to_gateway(t, 6, 22, CtState::Established).0,
            VerdictAction::Accept
        );
        assert_eq!(
            to_gateway("eth0", 6, 22, CtState::New).0,
            VerdictAction::Accept
        );
    }

    #[test]
    fn configuration_sources_hold_own_and_seen_cidrs() {
        let body = json!({"spec": {"remote": {"cidr": {"pod": ["10.20.0.0/16"], "external": ["10.30.0.0/16"]}}},
            "status": {"remote": {"cidr": {"pod": ["10.71.0.0/16"], "external": ["10.72.0.0/16"]}}}});
        let (peer, s) = configuration_sources(&labels(&[(REMOTE_CLUSTER_ID, "c")]), &body).unwrap();
        assert_eq!(peer, "c");
        let want: Vec<ipnet::IpNet> = [
            "10.20.0.0/16",
            "10.30.0.0/16",
            "10.71.0.0/16",
            "10.72.0.0/16",
        ]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
        assert_eq!(s, want);
    }

    fn desired(v: &[(&str, &[&str])]) -> BTreeMap<String, PeerSets> {
        v.iter()
            .map(|(peer, a)| {
                let s = PeerSets {
                    offloaded: ips(a),
                    ..Default::default()
                };
                (peer.to_string(), s)
            })
            .collect()
    }

    fn published(v: &[(&str, &[&str], bool)]) -> BTreeMap<String, Published> {
        v.iter()
            .map(|(peer, a, settled)| {
                let p = Published {
                    offloaded: ips(a),
                    settled: *settled,
                };
                (peer.to_string(), p)
            })
            .collect()
    }

    #[test]
    fn reused_ip_waits_until_the_old_tenant_released_it() {
        let want = desired(&[("a", &[]), ("b", &["10.0.0.5"])]);
        // a still publishes the address: b must wait; a drops it at once.
        let (out, held) = gate_reuse(
            &want,
            &published(&[("a", &["10.0.0.5"], true), ("b", &[], true)]),
        );
        assert!(held);
        assert!(out["b"].offloaded.is_empty());
        assert!(out["a"].offloaded.is_empty());
        // a removed it but its agents have not enforced that yet: still wait.
        assert!(gate_reuse(&want, &published(&[("a", &[], false), ("b", &[], true)])).1);
        // enforced: b gets it.
        let (out, held) = gate_reuse(&want, &published(&[("a", &[], true), ("b", &[], true)]));
        assert!(!held);
        assert_eq!(out["b"].offloaded, ips(&["10.0.0.5"]));
    }

    #[test]
    fn an_address_two_tenants_claim_stays_with_its_holder() {
        let want = desired(&[("a", &["10.0.0.5"]), ("b", &["10.0.0.5"])]);
        let (out, held) = gate_reuse(&want, &published(&[("a", &["10.0.0.5"], true)]));
        assert!(held);
        assert_eq!(out["a"].offloaded, ips(&["10.0.0.5"]));
        assert!(out["b"].offloaded.is_empty());
    }

    #[test]
    fn network_policy_names_the_consumer() {
        let np = network_policy_spec("a", &[], &[]);
        assert_eq!(
            np["egress"][0]["to"][0]["namespaceSelector"]["matchExpressions"][0]["values"][0],
            "a"
        );
        assert_eq!(
            offloaded_namespace_owner(&ns(
                "liqo-tenant-a",
                &[(TENANT_NAMESPACE, "true"), (REMOTE_CLUSTER_ID, "a")]
            )),
            None
        );
        assert_eq!(
            offloaded_namespace_owner(&ns("x", &[(REMOTE_CLUSTER_ID, "a")])),
            Some("a")
        );
    }

    /// The offloaded namespaces' NetworkPolicy (what the controller writes on a provider),
    /// judged as a label-aware CNI judges it: an offloaded pod calls home (its consumer's pods and
    /// external CIDR, by the addresses seen here) and reaches its consumer's other offloaded
    /// namespaces and DNS; not another consumer, its CIDRs, nor the provider's own pods.
    #[test]
    fn offloaded_pods_call_home_and_nowhere_else() {
        use peerwall_netpol::eval::{decide, Flow};
        use peerwall_netpol::testing::labels;
        use peerwall_netpol::{Cluster, Pod};
        use std::net::IpAddr;
        let pod_at = |ns: &str, name: &str, ip: &str, l: &[(&str, &str)]| Pod {
            namespace: ns.into(),
            name: name.into(),
            labels: labels(l),
            ips: vec![ip.parse().unwrap()],
            ..Default::default()
        };
        let home_a: Vec<ipnet::IpNet> = vec![
            "10.10.0.0/16".parse().unwrap(),
            "10.110.0.0/16".parse().unwrap(),
        ];
        let home_b: Vec<ipnet::IpNet> = vec!["10.71.0.0/16".parse().unwrap()];
        let policy_of = |ns: &str, consumer: &str, home: &[ipnet::IpNet]| {
            peerwall_netpol::read::policy_json(offloaded_network_policy(ns, consumer, home, &[]))
                .unwrap()
        };
        let ns_labels = |name: &str, extra: &[(&str, &str)]| {
            let mut l = labels(extra);
            l.insert("kubernetes.io/metadata.name".into(), name.into());
            (name.to_string(), l)
        };
        let build = |home_a: &[ipnet::IpNet]| Cluster {
            namespaces: [
                ns_labels("offload-a", &[("liqo.io/remote-cluster-id", "a")]),
                ns_labels("offload-a2", &[("liqo.io/remote-cluster-id", "a")]),
                ns_labels("offload-b", &[("liqo.io/remote-cluster-id", "b")]),
                ns_labels("local", &[]),
                ns_labels("kube-system", &[]),
            ]
            .into_iter()
            .collect(),
            pods: vec![
                pod_at("offload-a", "p", "10.20.1.10", &[]),
                pod_at("offload-a2", "q", "10.20.1.11", &[]),
                pod_at("offload-b", "r", "10.20.2.10", &[]),
                pod_at("local", "s", "10.20.3.10", &[]),
                pod_at(
                    "kube-system",
                    "dns",
                    "10.20.0.10",
                    &[("k8s-app", "kube-dns")],
                ),
            ],
            policies: vec![
                policy_of("offload-a", "a", home_a),
                policy_of("offload-a2", "a", home_a),
                policy_of("offload-b", "b", &home_b),
            ],
            remaps: Default::default(),
        };
        let c = build(&home_a);
        let p = c.pod("offload-a/p").unwrap();
        let to = |dst: &str, proto: u8, dport: u16| -> bool {
            let pod = c.pods.iter().find(|x| x.key() == dst);
            let ip: IpAddr = pod.map_or_else(|| dst.parse().unwrap(), |x| x.ips[0]);
            decide(
                &c,
                &Flow {
                    src: p.ips[0],
                    dst: ip,
                    proto,
                    dport,
                    src_pod: Some(p),
                    dst_pod: pod,
                },
            )
            .allowed()
        };
        assert!(to("10.10.5.5", 6, 80), "its consumer's pods");
        assert!(to("10.110.0.7", 6, 443), "its consumer's external CIDR");
        assert!(
            to("offload-a2/q", 6, 80),
            "its consumer's other offloaded namespace"
        );
        assert!(to("kube-system/dns", 17, 53), "DNS");
        assert!(!to("kube-system/dns", 6, 80), "only DNS of kube-dns");
        assert!(!to("10.71.1.1", 6, 80), "another consumer's CIDR");
        assert!(
            !to("offload-b/r", 6, 80),
            "another consumer's offloaded pod"
        );
        assert!(!to("local/s", 6, 80), "the provider's own pods");
        // Without the consumer's CIDRs (the policy before this fix) the pod cannot call home.
        let old = build(&[]);
        let f = Flow {
            src: p.ips[0],
            dst: "10.10.5.5".parse().unwrap(),
            proto: 6,
            dport: 80,
            src_pod: old.pod("offload-a/p"),
            dst_pod: None,
        };
        assert!(!decide(&old, &f).allowed());
    }
}
