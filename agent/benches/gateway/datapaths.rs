//! The datapaths compared and the policies they enforce, installed and removed.

use std::collections::{BTreeSet, HashSet};
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use peerwall::protection::{self, Options, PeerSets};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Datapath {
    None,
    ConntrackOnly,
    TcEmpty,
    /// The empty tc program with the bpf backend's guard beside it (`inet peerwall-guard`, as
    /// the agent writes it for the tunnel attached: `peerwall_backend_select::guard`): what
    /// the guard adds to every packet of a bpf gateway, against `TcEmpty` in the same round.
    TcEmptyGuard,
    TcHash,
    /// One lookup per fact the protection policy decides a new packet on (`peerwall_facts`:
    /// its connection's pair stamp, its source among the peer's CIDRs, its destination among
    /// the offloaded pods), nothing else: what no tc datapath enforcing that policy can beat
    /// on a flood of new flows; floods only.
    TcFacts,
    /// The one-hash-lookup limit on a gateway whose kernel conntrack is on (Liqo's remapping
    /// NAT, as `ConntrackOnly`): what any tc program doing as little costs there, the bound
    /// for the conntrack-on bpf rows.
    TcHashConntrack,
    /// A bpf program at netfilter's forward hook (`BPF_PROG_TYPE_NETFILTER`, after conntrack)
    /// doing what `NftSetConntrack` does: the packet's conntrack state read from it, one hash
    /// lookup of the destination (`nf_limit.rs`). What a bpf datapath that takes the kernel's
    /// conntrack result instead of finding it from tc costs at least; floods only.
    NfHashConntrack,
    /// The nftables twin of `TcHashConntrack`, beside Liqo's NAT chains: one forward chain of
    /// one rule, one set lookup of the policy's allowed destinations (of the allowed (source,
    /// destination) pairs where the policy depends on the source), everything else from the
    /// tunnel dropped. What any nftables filter deciding this traffic costs at least on a
    /// conntrack-on gateway: the bound for the `PeerwallNftConntrack` rows.
    NftSetConntrack,
    PeerwallNft,
    /// peerwall nftables with address dispatch off (`RenderOptions::linear`): every rule of a
    /// long run of lookups looked up in turn. Only where dispatch changes the rendering.
    PeerwallNftLinear,
    /// peerwall nftables beside Liqo's remapping NAT chains (as `ConntrackOnly`): on new flows
    /// the NAT hooks' work is the gateway's, whatever filters; the row `PeerwallBpfConntrack`
    /// is compared with.
    PeerwallNftConntrack,
    /// The same without the decided-flow cache (`RenderOptions::no_flow_cache`): every packet
    /// of a flow conntrack never saw answered walks the chains. Only where the cache changes
    /// the rendering.
    PeerwallNftNoCacheConntrack,
    PeerwallBpf,
    /// peerwall bpf on a gateway whose kernel conntrack is on (Liqo's remapping NAT), as
    /// `ConntrackOnly`: the same baseline the nftables row has.
    PeerwallBpfConntrack,
    /// The same gateway, the bpf datapath reading the kernel's connection table for TCP and
    /// UDP (`--bpf-conntrack kernel`) instead of keeping its own: one table, the kernel's.
    PeerwallBpfKernelCt,
    PeerwallXdp,
    /// `peerwall agent --events` over the nftables / bpf datapath: the same policy, every drop
    /// reported (NFLOG / ring buffer, rate-limited) and read by the running agent.
    PeerwallNftEvents,
    PeerwallBpfEvents,
    LiqoNft,
    IptablesRules,
    IptablesIpset,
}

impl Datapath {
    pub(crate) const ALL: [Datapath; 19] = [
        Datapath::None,
        Datapath::ConntrackOnly,
        Datapath::TcEmpty,
        Datapath::TcEmptyGuard,
        Datapath::TcHash,
        Datapath::NftSetConntrack,
        Datapath::PeerwallNft,
        Datapath::PeerwallNftLinear,
        Datapath::PeerwallNftConntrack,
        Datapath::PeerwallNftNoCacheConntrack,
        Datapath::PeerwallBpf,
        Datapath::PeerwallBpfConntrack,
        Datapath::PeerwallBpfKernelCt,
        Datapath::PeerwallXdp,
        Datapath::PeerwallNftEvents,
        Datapath::PeerwallBpfEvents,
        Datapath::LiqoNft,
        Datapath::IptablesRules,
        Datapath::IptablesIpset,
    ];
    pub(crate) fn label(self) -> &'static str {
        match self {
            Datapath::None => "no filter (baseline)",
            Datapath::ConntrackOnly => "no filter, conntrack on (Liqo's remapping NAT)",
            Datapath::TcEmpty => "limit: empty tcx program",
            Datapath::TcEmptyGuard => "limit: empty tcx program and the bpf backend's guard",
            Datapath::TcHash => "limit: tcx, one hash lookup",
            Datapath::TcFacts => "limit: tcx, one lookup per fact the policy tests",
            Datapath::TcHashConntrack => "limit: tcx, one hash lookup, conntrack on",
            Datapath::NftSetConntrack => "limit: nftables, one set lookup, conntrack on",
            Datapath::NfHashConntrack => {
                "limit: bpf after conntrack (netfilter hook), one hash lookup, conntrack on"
            }
            Datapath::PeerwallNft => "peerwall nftables",
            Datapath::PeerwallNftLinear => "peerwall nftables, no address dispatch",
            Datapath::PeerwallNftConntrack => "peerwall nftables, conntrack on (Liqo's NAT)",
            Datapath::PeerwallNftNoCacheConntrack => {
                "peerwall nftables, conntrack on, no decided-flow cache"
            }
            Datapath::PeerwallBpf => "peerwall bpf (tcx)",
            Datapath::PeerwallBpfConntrack => "peerwall bpf (tcx), conntrack on",
            Datapath::PeerwallBpfKernelCt => "peerwall bpf (tcx), conntrack on, the kernel's table",
            Datapath::PeerwallXdp => "peerwall bpf + XDP",
            Datapath::PeerwallNftEvents => "peerwall nftables, agent --events",
            Datapath::PeerwallBpfEvents => "peerwall bpf (tcx), agent --events",
            Datapath::LiqoNft => "Liqo style: nft rule per IP",
            Datapath::IptablesRules => "iptables rule per IP",
            Datapath::IptablesIpset => "iptables + ipset",
        }
    }

    /// The same datapath without events, for the rows that report events.
    pub(crate) fn without_events(self) -> Option<Datapath> {
        match self {
            Datapath::PeerwallNftEvents => Some(Datapath::PeerwallNft),
            Datapath::PeerwallBpfEvents => Some(Datapath::PeerwallBpf),
            _ => None,
        }
    }

    /// Limits of any tc datapath, and the cost of conntrack alone: not filters, measured for
    /// reference only.
    pub(crate) fn is_limit(self) -> bool {
        matches!(
            self,
            Datapath::TcEmpty
                | Datapath::TcEmptyGuard
                | Datapath::TcHash
                | Datapath::TcFacts
                | Datapath::TcHashConntrack
                | Datapath::NftSetConntrack
                | Datapath::NfHashConntrack
                | Datapath::ConntrackOnly
        )
    }
}

/// A policy under test: peerwall's FirewallConfiguration plus the other renderings.
pub(crate) struct Policy {
    pub(crate) name: String,
    pub(crate) allowed: Vec<(Ipv4Addr, u16)>,
    pub(crate) denied: Vec<(Ipv4Addr, u16)>,
    /// The sources of `allowed` and `denied`, index by index, when the policy depends on them
    /// (None: random addresses of the peer's 172.16.0.0/16).
    pub(crate) sources: Option<(Vec<Ipv4Addr>, Vec<Ipv4Addr>)>,
    pub(crate) fwc: serde_json::Value,
    /// Liqo / iptables rule-per-IP renderings, one line per rule (without the chain prefix).
    pub(crate) nft_rules: Vec<String>,
    pub(crate) ipt_rules: Vec<String>,
    /// ipset members (None: not expressible).
    pub(crate) ipset: Option<Vec<Ipv4Addr>>,
}

pub(crate) fn fwc_doc(spec: impl serde::Serialize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "peerwall.io/v1alpha1",
        "kind": "FirewallConfiguration",
        "metadata": {"name": "bench", "namespace": "liqo-tenant-bench", "labels": {"peerwall.io/target": "gateway"}},
        "spec": spec,
    })
}

pub(crate) fn unique_hosts(rng: &mut StdRng, n: usize, base: u32, bits: u32) -> Vec<Ipv4Addr> {
    let mut seen = HashSet::with_capacity(n);
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let a = base | rng.random_range(1..(1u32 << bits) - 1);
        if seen.insert(a) {
            v.push(Ipv4Addr::from(a));
        }
    }
    v
}

/// Provider protection for N offloaded pods (10.32.0.0/11); denied traffic goes to 10.64.0.0/11.
pub(crate) fn protection_policy(n: usize, seed: u64) -> Policy {
    let mut rng = StdRng::seed_from_u64(seed ^ n as u64);
    let pods = unique_hosts(&mut rng, n, 0x0a20_0000, 21);
    let sets = PeerSets {
        offloaded: pods.iter().map(|&a| a.into()).collect::<BTreeSet<_>>(),
        ..Default::default()
    };
    let spec = protection::gateway_spec(
        "bench",
        &[crate::traffic::SOURCES.parse().expect("CIDR")],
        &sets,
        &Options {
            tunnel: TUNNEL.into(),
            block_leaf_to_leaf: false,
            audit: false,
            liqo_ping_port: peerwall::protection::LIQO_PING_PORT,
            own_namespace_only: false,
            inline_budget: peerwall_protection::spill::INLINE_BUDGET,
        },
    );
    let pick = |rng: &mut StdRng, v: &[Ipv4Addr]| v[rng.random_range(0..v.len())];
    let allowed = (0..1024).map(|_| (pick(&mut rng, &pods), 8080)).collect();
    let denied = (0..1024)
        .map(|_| {
            (
                Ipv4Addr::from(0x0a40_0000 | rng.random_range(1..(1u32 << 21) - 1)),
                8080,
            )
        })
        .collect();
    Policy {
        name: match n {
            n if n >= 1000 => format!("{}k pods", n / 1000),
            n => format!("{n} pods"),
        },
        allowed,
        denied,
        sources: None,
        fwc: fwc_doc(spec),
        nft_rules: pods
            .iter()
            .map(|p| format!("iifname \"{TUNNEL}\" ip daddr {p} accept"))
            .chain([format!("iifname \"{TUNNEL}\" drop")])
            .collect(),
        ipt_rules: pods
            .iter()
            .map(|p| format!("-i {TUNNEL} -d {p} -j ACCEPT"))
            .chain([format!("-i {TUNNEL} -j DROP")])
            .collect(),
        ipset: Some(pods),
    }
}

/// 63 allow rules over CIDRs and address ranges with UDP port ranges, then default deny.
pub(crate) fn mixed_policy(seed: u64) -> Policy {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6464);
    let mut rules = vec![];
    let (mut nft, mut ipt) = (vec![], vec![]);
    let mut allowed = vec![];
    for i in 0..63u32 {
        let net = Ipv4Addr::new(10, 100 + i as u8, 0, 0);
        let (lo, hi) = (1000 + i as u16 * 10, 1005 + i as u16 * 10);
        let (value, nft_addr, ipt_addr) = if i % 2 == 0 {
            (
                format!("{net}/16"),
                format!("ip daddr {net}/16"),
                format!("-d {net}/16"),
            )
        } else {
            let end = Ipv4Addr::new(10, 100 + i as u8, 127, 255);
            (
                format!("{net}-{end}"),
                format!("ip daddr {net}-{end}"),
                format!("-m iprange --dst-range {net}-{end}"),
            )
        };
        rules.push(
            serde_json::json!({"name": format!("r{i}"), "action": "accept", "match": [
                {"op": "eq", "dev": {"value": TUNNEL, "position": "in"}},
                {"op": "eq", "ip": {"value": value, "position": "dst"}},
                {"op": "eq", "proto": {"value": "udp"}},
                {"op": "eq", "port": {"value": format!("{lo}-{hi}"), "position": "dst"}},
            ]}),
        );
        nft.push(format!(
            "iifname \"{TUNNEL}\" {nft_addr} udp dport {lo}-{hi} accept"
        ));
        ipt.push(format!(
            "-i {TUNNEL} {ipt_addr} -p udp --dport {lo}:{hi} -j ACCEPT"
        ));
        for _ in 0..16 {
            let a = Ipv4Addr::new(
                10,
                100 + i as u8,
                rng.random_range(0..128),
                rng.random_range(1..255),
            );
            allowed.push((a, rng.random_range(lo..=hi)));
        }
    }
    rules.push(serde_json::json!({"name": "default_deny", "action": "drop", "match": [{"op": "eq", "dev": {"value": TUNNEL, "position": "in"}}]}));
    nft.push(format!("iifname \"{TUNNEL}\" drop"));
    ipt.push(format!("-i {TUNNEL} -j DROP"));
    let denied = (0..1024)
        .map(|_| {
            (
                Ipv4Addr::new(10, 99, rng.random_range(0..255), rng.random_range(1..255)),
                1000,
            )
        })
        .collect();
    let spec = serde_json::json!({"table": {"name": "peerwall_mixed", "family": "INET", "chains": [{
        "name": "from_peer", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
        "rules": {"filterRules": rules}}]}});
    Policy {
        name: "mixed 64 rules".into(),
        allowed,
        denied,
        sources: None,
        fwc: fwc_doc(spec),
        nft_rules: nft,
        ipt_rules: ipt,
        ipset: None,
    }
}

/// The controller's NetworkPolicy tier for the peer of the cluster `bench-netpol` builds (10 000
/// pods, a fifth of each namespace's on the peer's virtual node, `policies` NetworkPolicies on a UDP named port),
/// as the controller computes it (`netpol::tier::tier`). Traffic: the peer's pods (10.20.x,
/// through the tunnel) to local pods (10.10.x) on 8080/UDP, split into allowed and denied by
/// the reference evaluator on the compiled tier. No rule-per-IP rendering expresses it.
pub(crate) fn netpol_policy(policies: usize, seed: u64) -> Policy {
    use peerwall::netpol;
    use peerwall_policy::ir;
    // A fifth of every namespace's pods on the peer (bench-netpol's every fifth pod lands in
    // namespaces whose policies never admit it: nothing would be allowed).
    let c = np_cluster::cluster(10_000, policies, netpol::Protocol::Udp, |i| {
        (i / np_cluster::NAMESPACES).is_multiple_of(5)
    });
    let tier = netpol::tier::tier(&c, np_cluster::PEER, false);
    let fwc = fwc_doc(&tier.spec);
    let obj = peerwall_intent::load::object_from_json(
        fwc.clone(),
        peerwall_intent::load::Group::Peerwall,
    )
    .expect("the tier loads");
    let compiled = peerwall_policy::compile::compile(&[obj])
        .expect("the tier compiles")
        .policy;
    let v4 = |p: &netpol::Pod| {
        p.ips.iter().find_map(|a| match a {
            std::net::IpAddr::V4(a) => Some(*a),
            std::net::IpAddr::V6(_) => None,
        })
    };
    let remote: Vec<Ipv4Addr> = c
        .pods
        .iter()
        .filter(|p| p.peer.is_some())
        .filter_map(|p| v4(p))
        .collect();
    let local: Vec<Ipv4Addr> = c
        .pods
        .iter()
        .filter(|p| p.peer.is_none())
        .filter_map(|p| v4(p))
        .collect();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x4e50);
    let (mut allowed, mut denied) = (Vec::new(), Vec::new());
    let (mut from_a, mut from_d) = (Vec::new(), Vec::new());
    let mut tries = 0;
    while (allowed.len() < 1024 || denied.len() < 1024) && tries < 1_000_000 {
        tries += 1;
        let src = remote[rng.random_range(0..remote.len())];
        let dst = local[rng.random_range(0..local.len())];
        let pkt = ir::eval::Packet {
            src: src.into(),
            dst: dst.into(),
            proto: ir::eval::proto::UDP,
            sport: 40000,
            dport: 8080,
            iif: Some(TUNNEL.into()),
            oif: Some(GENEVE.into()),
            ct_state: ir::CtState::New,
        };
        match ir::evaluate(&compiled, &pkt).verdict {
            ir::VerdictAction::Accept if allowed.len() < 1024 => {
                allowed.push((dst, 8080));
                from_a.push(src);
            }
            ir::VerdictAction::Drop if denied.len() < 1024 => {
                denied.push((dst, 8080));
                from_d.push(src);
            }
            _ => {}
        }
    }
    assert!(
        allowed.len() == 1024 && denied.len() == 1024,
        "the tier allows {} and denies {} of the pairs tried",
        allowed.len(),
        denied.len()
    );
    Policy {
        name: format!("{policies} NetworkPolicies"),
        allowed,
        denied,
        sources: Some((from_a, from_d)),
        fwc,
        nft_rules: Vec::new(),
        ipt_rules: Vec::new(),
        ipset: None,
    }
}

/// `NftSetConntrack`'s table: one rule, `ip daddr != @allowed drop` for the tunnel's packets,
/// or `ip saddr . ip daddr != @allowed drop` where the policy depends on the source (one
/// lookup of a concatenated key, as a pair hash would be).
fn nft_set_limit(p: &Policy) -> String {
    let (key, typ, elements): (&str, &str, BTreeSet<String>) = match &p.sources {
        None => (
            "ip daddr",
            "ipv4_addr",
            p.allowed.iter().map(|(a, _)| a.to_string()).collect(),
        ),
        Some((from, _)) => (
            "ip saddr . ip daddr",
            "ipv4_addr . ipv4_addr",
            from.iter()
                .zip(&p.allowed)
                .map(|(s, (d, _))| format!("{s} . {d}"))
                .collect(),
        ),
    };
    let elements: Vec<String> = elements.into_iter().collect();
    format!(
        "table ip limit_bench {{\n set allowed {{\n  type {typ}\n  elements = {{ {} }}\n }}\n chain filter_limit {{\n  type filter hook forward priority 0; policy accept;\n  iifname \"{TUNNEL}\" {key} != @allowed drop\n }}\n}}\n",
        elements.join(", ")
    )
}

/// Install a datapath with a policy in the gateway; returns the load time.
pub(crate) fn install(lab: &Lab, dp: Datapath, p: &Policy) -> Option<Duration> {
    let file = lab.dir.join("policy.yaml");
    // Every window starts from empty connection tables, the kernel's as the datapath's own
    // (new pins): the floods of the rows before leave hundreds of thousands of entries in the
    // gateway's kernel table, which the kernel-table row would otherwise inherit (its sweep
    // stamps them all, and every packet then asks the kernel), and no other row would.
    for family in ["ipv4", "ipv6"] {
        in_ns(&lab.gw, "conntrack", &["-F", "-f", family]);
    }
    let started = Instant::now();
    match dp {
        Datapath::None => {}
        Datapath::ConntrackOnly => {
            // A Liqo gateway always tracks connections: its remapping tables are NAT chains
            // with DNAT/SNAT rules (Liqo's
            // `pkg/liqo-controller-manager/networking/external-network/remapping/cidr.go`). An empty NAT chain does *not* turn
            // conntrack on (the kernel enables it for the namespace when a rule needs it), so
            // these chains hold one remapping each, for CIDRs the benchmark's traffic never
            // uses: every packet is tracked, none is translated.
            let s = "table ip liqo_nat_bench {\n chain pre {\n  type nat hook prerouting priority dstnat; policy accept;\n  ip daddr 192.0.2.0/24 dnat to 198.51.100.1\n }\n chain post {\n  type nat hook postrouting priority srcnat; policy accept;\n  ip saddr 192.0.2.0/24 snat to 198.51.100.1\n }\n}\n";
            std::fs::write(&file, s).expect("write");
            in_ns(&lab.gw, "nft", &["-f", &file.to_string_lossy()]);
        }
        // A hash of destinations cannot tell a denied pair from an allowed one when the
        // policy depends on the source too: no such limit there.
        Datapath::TcHash
        | Datapath::TcFacts
        | Datapath::TcHashConntrack
        | Datapath::NfHashConntrack
            if p.sources.is_some() =>
        {
            return None
        }
        Datapath::NfHashConntrack => {
            install(lab, Datapath::ConntrackOnly, p)?;
            let allowed: Vec<Ipv4Addr> = p.allowed.iter().map(|(a, _)| *a).collect();
            lab.gw
                .run_in(move || super::nf_limit::install(&allowed))
                .expect("bench namespace")
                .expect("hooking the netfilter limit");
        }
        Datapath::TcHashConntrack => {
            install(lab, Datapath::ConntrackOnly, p)?;
            install(lab, Datapath::TcHash, p)?;
        }
        Datapath::NftSetConntrack => {
            install(lab, Datapath::ConntrackOnly, p)?;
            std::fs::write(&file, nft_set_limit(p)).expect("write");
            in_ns(&lab.gw, "nft", &["-f", &file.to_string_lossy()]);
        }
        Datapath::TcEmptyGuard => {
            install(lab, Datapath::TcEmpty, p)?;
            let ifindex = in_ns(
                &lab.gw,
                "cat",
                &[&format!("/sys/class/net/{TUNNEL}/ifindex")],
            );
            let ifindex: u32 = ifindex.trim().parse().expect("the tunnel's ifindex");
            let patterns = ["liqo-tunnel*".to_string(), "liqo.*".to_string()];
            let s = peerwall_backend_select::guard::script(&patterns, &[ifindex])
                .expect("the agent's default patterns");
            std::fs::write(&file, s).expect("write");
            in_ns(&lab.gw, "nft", &["-f", &file.to_string_lossy()]);
        }
        Datapath::TcEmpty | Datapath::TcHash | Datapath::TcFacts => {
            let pins = std::path::PathBuf::from(lab.pins());
            let allowed: Vec<Ipv4Addr> = p.allowed.iter().map(|(a, _)| *a).collect();
            lab.gw
                .run_in(move || {
                    let mut b = peerwall_backend_bpf::loader::Datapath::load_with(
                        &pins,
                        &peerwall_backend_bpf::loader::LoadOptions::with_baselines(),
                    )?;
                    match dp {
                        Datapath::TcHash => {
                            b.fill_bare_hash(&allowed)?;
                            b.attach_baseline("peerwall_hash", TUNNEL)
                        }
                        Datapath::TcFacts => {
                            b.fill_bare_hash(&allowed)?;
                            // The policy's anti-spoofing sources (`protection_policy`).
                            b.fill_bare(&[crate::traffic::SOURCES.parse().expect("CIDR")])?;
                            b.attach_baseline("peerwall_facts", TUNNEL)
                        }
                        _ => b.attach_baseline("peerwall_empty", TUNNEL),
                    }
                })
                .expect("bench namespace")
                .expect("attaching the baseline program");
        }
        Datapath::PeerwallNft => {
            std::fs::write(&file, serde_yaml::to_string(&p.fwc).expect("yaml")).expect("write");
            in_ns(
                &lab.gw,
                peerwall_bin(),
                &["apply", "-f", &file.to_string_lossy()],
            );
        }
        Datapath::PeerwallNftLinear => {
            let linear = peerwall_backend_nftables::RenderOptions {
                linear: true,
                ..Default::default()
            };
            apply_rendered(lab, rendered_otherwise(p, linear)?);
        }
        Datapath::PeerwallNftNoCacheConntrack => {
            let no_cache = peerwall_backend_nftables::RenderOptions {
                no_flow_cache: true,
                ..Default::default()
            };
            let tables = rendered_otherwise(p, no_cache)?;
            install(lab, Datapath::ConntrackOnly, p)?;
            apply_rendered(lab, tables);
        }
        // As deployed: under the agent, whose route watcher keeps the local-address mirror.
        Datapath::PeerwallBpf | Datapath::PeerwallXdp => {
            let extra: &[&str] = if dp == Datapath::PeerwallXdp {
                &["--xdp"]
            } else {
                &[]
            };
            let agent = deployed::bpf_agent(lab, p, extra)?;
            *lab.agent.borrow_mut() = Some(agent);
        }
        Datapath::PeerwallBpfKernelCt => {
            install(lab, Datapath::ConntrackOnly, p)?;
            let Some(agent) = deployed::bpf_agent(lab, p, &["--bpf-conntrack", "kernel"]) else {
                uninstall(lab, Datapath::ConntrackOnly);
                return None;
            };
            *lab.agent.borrow_mut() = Some(agent);
        }
        // The datapath's own tables beside the kernel's (`--bpf-conntrack own`; the default,
        // `auto`, reads the kernel's table there: the row after it).
        Datapath::PeerwallBpfConntrack => {
            install(lab, Datapath::ConntrackOnly, p)?;
            let Some(agent) = deployed::bpf_agent(lab, p, &["--bpf-conntrack", "own"]) else {
                uninstall(lab, Datapath::ConntrackOnly);
                return None;
            };
            *lab.agent.borrow_mut() = Some(agent);
        }
        Datapath::PeerwallNftConntrack => {
            install(lab, Datapath::ConntrackOnly, p)?;
            install(lab, Datapath::PeerwallNft, p)?;
        }
        // The events agent is timed to its policy in force by a stream to a denied address
        // from the peer's range; a policy that depends on the source has no such address.
        Datapath::PeerwallNftEvents | Datapath::PeerwallBpfEvents if p.sources.is_some() => {
            return None;
        }
        Datapath::PeerwallNftEvents | Datapath::PeerwallBpfEvents => {
            let agent = events_agent(lab, dp, p);
            let load = started.elapsed();
            *lab.agent.borrow_mut() = Some(agent);
            return Some(load);
        }
        Datapath::LiqoNft if p.nft_rules.is_empty() => return None,
        Datapath::IptablesRules if p.ipt_rules.is_empty() => return None,
        Datapath::LiqoNft => {
            let mut s = String::from("table inet liqo_bench {\n chain liqo_fwd {\n  type filter hook forward priority 0; policy accept;\n");
            for r in &p.nft_rules {
                s.push_str("  ");
                s.push_str(r);
                s.push('\n');
            }
            s.push_str(" }\n}\n");
            std::fs::write(&file, s).expect("write");
            in_ns(&lab.gw, "nft", &["-f", &file.to_string_lossy()]);
        }
        Datapath::IptablesRules | Datapath::IptablesIpset => {
            let mut s = String::from("*filter\n:FORWARD ACCEPT [0:0]\n");
            if dp == Datapath::IptablesIpset {
                let members = p.ipset.as_ref()?;
                let mut set = format!(
                    "create offloaded hash:ip maxelem {}\n",
                    (members.len() * 2).max(1024)
                );
                for m in members {
                    set.push_str(&format!("add offloaded {m}\n"));
                }
                let sf = lab.dir.join("ipset.txt");
                std::fs::write(&sf, set).expect("write");
                let o = Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        lab.gw.name(),
                        "ipset",
                        "restore",
                        "-file",
                        &sf.to_string_lossy(),
                    ])
                    .output()
                    .expect("ipset");
                assert!(
                    o.status.success(),
                    "ipset restore: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                s.push_str(&format!("-A FORWARD -i {TUNNEL} -m set --match-set offloaded dst -j ACCEPT\n-A FORWARD -i {TUNNEL} -j DROP\n"));
            } else {
                for r in &p.ipt_rules {
                    s.push_str("-A FORWARD ");
                    s.push_str(r);
                    s.push('\n');
                }
            }
            s.push_str("COMMIT\n");
            let mut c = Command::new("ip")
                .args(["netns", "exec", lab.gw.name(), "iptables-legacy-restore"])
                .stdin(Stdio::piped())
                .spawn()
                .expect("iptables-legacy-restore");
            c.stdin
                .take()
                .expect("stdin")
                .write_all(s.as_bytes())
                .expect("write");
            assert!(
                c.wait().expect("wait").success(),
                "iptables-legacy-restore failed"
            );
        }
    }
    Some(started.elapsed())
}

/// `p` rendered with `opts`; None where that is the default rendering (the row would repeat
/// peerwall nftables').
fn rendered_otherwise(
    p: &Policy,
    opts: peerwall_backend_nftables::RenderOptions,
) -> Option<Vec<peerwall_backend_nftables::RenderedTable>> {
    let yaml = serde_yaml::to_string(&p.fwc).expect("yaml");
    let objs = peerwall_intent::load::parse_all(&yaml, "bench").expect("parses");
    let policy = peerwall_policy::compile::compile(&objs.objects)
        .expect("compiles")
        .policy;
    let rendered = peerwall_backend_nftables::render_policy(&policy, opts);
    (rendered != peerwall_backend_nftables::render_policy(&policy, Default::default()))
        .then_some(rendered)
}

/// Tables applied in the gateway by the nftables backend.
fn apply_rendered(lab: &Lab, tables: Vec<peerwall_backend_nftables::RenderedTable>) {
    let mut b = peerwall_backend_nftables::NftBackend::new(
        peerwall_backend_nftables::Nft::in_netns(lab.gw.name()),
    );
    b.apply_rendered(tables).expect("apply");
}

pub(crate) fn uninstall(lab: &Lab, dp: Datapath) {
    match dp {
        Datapath::None => {}
        Datapath::PeerwallNft | Datapath::PeerwallNftLinear => {
            in_ns(&lab.gw, peerwall_bin(), &["delete"]);
        }
        Datapath::PeerwallNftEvents | Datapath::PeerwallBpfEvents => {
            // The agent leaves its policy in force when it stops (fail closed): delete it.
            lab.agent.borrow_mut().take();
            uninstall(lab, dp.without_events().unwrap_or(dp));
        }
        Datapath::PeerwallBpf
        | Datapath::PeerwallXdp
        | Datapath::TcEmpty
        | Datapath::TcHash
        | Datapath::TcFacts => {
            // The row was what it says only if the mirror held through it. The agent leaves
            // its policy in force when it stops (fail closed): delete it.
            if let Some(agent) = lab.agent.borrow_mut().take() {
                assert!(
                    deployed::mirror_answers(lab),
                    "{}: the local-address mirror lapsed during the measurement",
                    dp.label()
                );
                drop(agent);
            }
            nsenter(
                &lab.gw,
                peerwall_bin(),
                &["delete", "--backend", "bpf", "--pin-dir", &lab.pins()],
            );
        }
        Datapath::TcHashConntrack => {
            uninstall(lab, Datapath::TcHash);
            uninstall(lab, Datapath::ConntrackOnly);
        }
        Datapath::NfHashConntrack => {
            super::nf_limit::remove();
            uninstall(lab, Datapath::ConntrackOnly);
        }
        Datapath::NftSetConntrack => {
            in_ns(&lab.gw, "nft", &["delete", "table", "ip", "limit_bench"]);
            uninstall(lab, Datapath::ConntrackOnly);
        }
        Datapath::TcEmptyGuard => {
            in_ns(
                &lab.gw,
                "nft",
                &["delete", "table", "inet", "peerwall-guard"],
            );
            uninstall(lab, Datapath::TcEmpty);
        }
        Datapath::PeerwallBpfConntrack | Datapath::PeerwallBpfKernelCt => {
            uninstall(lab, Datapath::PeerwallBpf);
            uninstall(lab, Datapath::ConntrackOnly);
        }
        Datapath::PeerwallNftConntrack | Datapath::PeerwallNftNoCacheConntrack => {
            uninstall(lab, Datapath::PeerwallNft);
            uninstall(lab, Datapath::ConntrackOnly);
        }
        Datapath::LiqoNft => {
            in_ns(&lab.gw, "nft", &["delete", "table", "inet", "liqo_bench"]);
        }
        Datapath::ConntrackOnly => {
            // The row is only what it says if the traffic was tracked.
            let tracked = in_ns(
                &lab.gw,
                "cat",
                &["/proc/sys/net/netfilter/nf_conntrack_count"],
            );
            assert!(
                tracked.trim().parse::<u64>().unwrap_or(0) > 0,
                "conntrack was not on in the gateway (nf_conntrack_count {tracked:?})"
            );
            in_ns(&lab.gw, "nft", &["delete", "table", "ip", "liqo_nat_bench"]);
        }
        Datapath::IptablesRules | Datapath::IptablesIpset => {
            in_ns(&lab.gw, "iptables-legacy", &["-F", "FORWARD"]);
            if dp == Datapath::IptablesIpset {
                in_ns(&lab.gw, "ipset", &["destroy", "offloaded"]);
            }
        }
    }
}
