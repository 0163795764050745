//! A peer's gateway FirewallConfiguration: default deny from the peer's tunnel, its offloaded
//! pods and our pods it runs allowed, replies and Liqo's tunnel check, anti-spoofing, the
//! ProtectionPolicies' openings and closings, and its options.

use crate::namespaces;

use crate::GATEWAY_CONFIG;

use crate::exceptions;
use crate::index::Kind;
use crate::peers::Peer;
use crate::peers::PeerSets;
use peerwall_intent::types as api;
use serde_json::Value;
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::net::IpAddr;

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
    /// How large the controller lets a configuration's JSON grow before it moves its largest
    /// address sets into AddressSets ([`crate::spill`]; [`crate::spill::INLINE_BUDGET`] by
    /// default).
    pub inline_budget: usize,
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
pub(crate) fn addr_set(
    name: String,
    keys: impl Iterator<Item = String>,
    v6: bool,
    from_address_sets: bool,
) -> api::Set {
    api::Set {
        from_address_sets,
        address_sets: None,
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
pub(crate) fn set_of(name: String, ips: &BTreeSet<IpAddr>, v6: bool) -> api::Set {
    addresses_set(name, ips, v6, true)
}

/// A set of the addresses of `ips` of one family.
pub(crate) fn addresses_set(
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
pub(crate) fn inline_set(name: String, ips: &BTreeSet<IpAddr>, v6: bool) -> api::Set {
    addresses_set(name, ips, v6, false)
}

/// Name of the gateway configuration's set of the peer's source CIDRs (`sources`, `sources6`).
pub const SOURCES_SET: &str = "sources";

/// Name of the gateway configuration's rule that drops everything from the peer's tunnel while
/// Liqo's `Configuration` of the peer (its CIDRs, hence anti-spoofing) is not known.
pub const NO_CONFIGURATION_RULE: &str = "no_liqo_configuration";

/// An inline set of the CIDRs of one family (never filled from AddressSets).
pub(crate) fn cidr_set(name: String, cidrs: &[ipnet::IpNet], v6: bool) -> api::Set {
    let keys = cidrs
        .iter()
        .filter(|c| matches!(c, ipnet::IpNet::V6(_)) == v6)
        .map(ToString::to_string);
    addr_set(name, keys, v6, false)
}

pub(crate) fn eq(m: api::Match) -> api::Match {
    api::Match {
        op: Some(api::MatchOperation::Eq),
        ..m
    }
}

/// A match on the address set `@set` in position `pos`.
pub(crate) fn in_set(set: String, pos: api::MatchPosition) -> api::Match {
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

pub(crate) fn ctstate(states: Vec<api::CtState>) -> api::Match {
    eq(api::Match {
        ctstate: Some(api::MatchCtState { value: states }),
        ..Default::default()
    })
}

pub(crate) fn l4(p: peerwall_netpol::Protocol) -> api::L4Proto {
    match p {
        peerwall_netpol::Protocol::Tcp => api::L4Proto::Tcp,
        peerwall_netpol::Protocol::Udp => api::L4Proto::Udp,
        peerwall_netpol::Protocol::Sctp => api::L4Proto::Sctp,
    }
}

/// The port matches of a port list, one group per protocol (`.tcp`, …: the protocol and a
/// comma-separated list of its ports, or the protocol alone when one entry takes every port);
/// an empty list is one group matching every packet.
pub(crate) fn port_groups(ports: &[exceptions::PortRange]) -> Vec<(String, Vec<api::Match>)> {
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
/// the peer's offloaded pods on its ports (replies never match: they are not new), and packets
/// conntrack does not track at all. Liqo's `gw-notrack` FirewallConfiguration (its chart's
/// `templates/liqo-notrack-firewallconfiguration.yaml`, `networking.notrack.enabled`) takes
/// every UDP packet to or from the Geneve port out of conntrack in the gateway, whatever its
/// interface: a peer's datagram to port 6091 is `untracked`, never `new`, and a closing that
/// tested `new` alone let it through to `to_offloaded`. The bpf datapath never sees the state
/// `untracked` (it classifies before netfilter): there the packet is `new`.
pub fn close_rules(c: &exceptions::Close) -> Vec<(String, Vec<api::Match>)> {
    let mut out = Vec::new();
    for v6 in [false, true] {
        let sfx = if v6 { "6" } else { "" };
        for (group, ports) in port_groups(&c.closing.ports) {
            let mut m = vec![
                ctstate(vec![api::CtState::New, api::CtState::Untracked]),
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

// size: the gateway chain's rules in the order the kernel evaluates them: one place to read what a
// peer's gateway lets through.
/// The gateway FirewallConfiguration `spec` for one peer: named sets of its offloaded pods
/// (and of our pods it runs), and one forward chain whose rules all test the tunnel first.
/// Every slice-filled set also takes AddressSet slices (`fromAddressSets`): the controller
/// publishes the addresses as slices ([`crate::layout`]) and passes empty inline sets; small setups
/// and tests may pass the addresses inline. What `d` declares (consumer protection by
/// namespace, ProtectionPolicies) is inline; its switches are the ones in force.
///
/// Order of the forward chain: invalid packets, spoofed sources (everything, while `sources`
/// is empty: Liqo's `Configuration` not seen), closings, leaf-to-leaf,
/// offloaded pods, openings, our pods (by namespace, or all of them), replies, default deny.
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
    let mut names = vec![(Kind::Offloaded, &s.offloaded), (Kind::Remote, &s.remote)];
    if settings.block_leaf_to_leaf {
        names.push((Kind::Elsewhere, &s.elsewhere));
    }
    let mut sets: Vec<api::Set> = names
        .iter()
        .flat_map(|(kind, ips)| {
            [
                set_of(kind.base_name().to_string(), ips, false),
                set_of(kind.v6_name(), ips, true),
            ]
        })
        .collect();
    // First of all: a packet from the tunnel that conntrack calls invalid (a segment of a
    // connection peerwall ended, which no accept rule without a state test may take as new;
    // a reply to nothing) reaches no accept rule.
    let mut rules = vec![rule(
        "invalid".into(),
        api::FilterAction::Drop,
        vec![ctstate(vec![api::CtState::Invalid])],
    )];
    // Anti-spoofing: from the tunnel, only the peer's own CIDRs (both families: a family the
    // peer has no CIDR of has no legitimate source at all). Before Liqo's `Configuration` of
    // the peer is seen its CIDRs are unknown, so no source can be told from a spoofed one:
    // everything from the tunnel is dropped (Liqo's tunnel check goes to the gateway itself,
    // the input chain, and still passes). Liqo creates the Configuration and waits for its
    // status before it creates the gateways (`pkg/liqoctl/network/handler.go`, `RunConnect`
    // → `initNetworkConfigs`), so a peering that carries traffic has one.
    if sources.is_empty() {
        rules.push(rule(
            NO_CONFIGURATION_RULE.into(),
            api::FilterAction::Drop,
            vec![],
        ));
    } else {
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
                    priority: Some(peerwall_intent::tiers::PROTECTION),
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
pub(crate) fn to_gateway_chain(
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
        priority: Some(peerwall_intent::tiers::PROTECTION),
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
    peerwall_intent::object::object(
        peerwall_intent::load::KIND,
        &peer.tenant_namespace,
        GATEWAY_CONFIG,
        &peerwall_intent::labels::for_gateway(&peer.id),
        gateway_spec_with(&peer.id, &peer.sources, s, opts, d),
    )
}
