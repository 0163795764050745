//! The scratch gateway: a namespace whose interfaces carry the packet's interface names, each
//! a veth to an "outside" namespace where nothing answers, with the policy loaded (a counter on
//! every rule) and the routes a probe needs.

use crate::sock::LinkSocket;
use crate::ProbeError;
use peerwall_backend_nftables::{self as nftables, render, Nft, NftBackend};
use peerwall_netns::NetNs;
use peerwall_policy::ir::{Policy, Test};
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use super::{Link, NftProbe, GW_V4, GW_V6};

pub(super) fn link_info(ns: &NetNs, dev: &str) -> Result<([u8; 6], i32), ProbeError> {
    let out = ns.ip(&["-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|_| ProbeError::Link(dev.to_string()))?;
    let addr = v[0]["address"]
        .as_str()
        .ok_or_else(|| ProbeError::Link(dev.to_string()))?;
    let mut mac = [0u8; 6];
    let parts: Vec<&str> = addr.split(':').collect();
    if parts.len() != 6 {
        return Err(ProbeError::Link(dev.to_string()));
    }
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).map_err(|_| ProbeError::Link(dev.to_string()))?;
    }
    let idx = v[0]["ifindex"]
        .as_i64()
        .ok_or_else(|| ProbeError::Link(dev.to_string()))?;
    Ok((mac, idx as i32))
}

pub(super) fn policy_uses_ct(policy: &Policy) -> bool {
    policy
        .tables
        .iter()
        .flat_map(|t| &t.chains)
        .flat_map(|c| &c.rules)
        .flat_map(|r| &r.matches)
        .any(|m| matches!(m.test, Test::CtState(_)))
}

/// Whether the kernel would route this address at all (martians are dropped before any hook).
pub(super) fn routable(a: &IpAddr) -> bool {
    match a {
        IpAddr::V4(v) => {
            !(v.is_unspecified()
                || v.is_loopback()
                || v.is_multicast()
                || v.is_broadcast()
                || v.octets()[0] == 0
                || v.octets()[0] >= 240)
        }
        IpAddr::V6(v) => {
            let s = v.segments();
            !(v.is_unspecified()
                || v.is_loopback()
                || v.is_multicast()
                || (s[0] & 0xffc0) == 0xfe80
                || v.to_ipv4_mapped().is_some())
        }
    }
}

impl NftProbe {
    /// Build a scratch gateway with interfaces `ifnames` and load `policy` into it, a counter
    /// on every rule (which rule decided is read from them).
    pub fn new(policy: &Policy, ifnames: &[String]) -> Result<Self, ProbeError> {
        Self::build(
            policy,
            ifnames,
            render::RenderOptions {
                force_counters: true,
                ..render::RenderOptions::default()
            },
        )
    }

    /// Build a scratch gateway with `policy` rendered as the agent deploys it (counters where
    /// the policy asks for them, the decided-flow cache on): [`NftProbe::fate`] then says what
    /// the kernel did with a packet, from what it delivered alone.
    pub fn deployed(policy: &Policy, ifnames: &[String]) -> Result<Self, ProbeError> {
        Self::build(policy, ifnames, render::RenderOptions::default())
    }

    fn build(
        policy: &Policy,
        ifnames: &[String],
        opts: render::RenderOptions,
    ) -> Result<Self, ProbeError> {
        let gw = NetNs::new("pwv-gw")?;
        let outside = NetNs::new("pwv-out")?;
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
            ("net.ipv4.icmp_ratelimit", "0"),
            ("net.ipv6.icmp.ratelimit", "0"),
            ("net.ipv6.conf.default.addr_gen_mode", "1"),
            // Only the probe may cross our chains: no ICMP redirects for hairpinned packets
            // (IPv6 sends none without a link-local address, which addr_gen_mode 1 prevents).
            ("net.ipv4.conf.all.send_redirects", "0"),
            ("net.ipv4.conf.default.send_redirects", "0"),
        ] {
            gw.sysctl(k, v)?;
        }
        outside.sysctl("net.ipv6.conf.default.addr_gen_mode", "1")?;
        gw.ip(&["addr", "add", &format!("{GW_V4}/32"), "dev", "lo"])?;
        gw.add_local_address(&format!("{GW_V6}/128"), "lo")?;
        let mut names: Vec<String> = ifnames.to_vec();
        names.sort();
        names.dedup();
        let mut drop_script = String::from("table netdev pwv_quiet {\n");
        let mut peers = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let peer = format!("pwv{i}");
            gw.veth_down(name, &outside, &peer)?;
            gw.ip(&["link", "set", name, "addrgenmode", "none"])?;
            outside.ip(&["link", "set", &peer, "addrgenmode", "none"])?;
            gw.ip(&["link", "set", name, "up"])?;
            outside.ip(&["link", "set", &peer, "up"])?;
            gw.sysctl(
                &format!("net.ipv4.conf.{}.rp_filter", name.replace('.', "/")),
                "0",
            )?;
            drop_script.push_str(&format!(
                "chain c{i} {{\ntype filter hook ingress device \"{peer}\" priority 0; policy drop;\n}}\n"
            ));
            peers.push((name.clone(), peer));
        }
        drop_script.push_str("}\n");
        // Nothing in the outside namespace answers: frames are captured, then dropped.
        Nft::in_netns(outside.name()).apply_text(&drop_script)?;
        let mut links = BTreeMap::new();
        for (name, peer) in peers {
            let (gw_mac, _) = link_info(&gw, &name)?;
            let (peer_mac, idx) = link_info(&outside, &peer)?;
            let sock = outside
                .run_in(move || LinkSocket::bind(idx))?
                .map_err(|source| ProbeError::Socket {
                    what: "binding a packet socket",
                    source,
                })?;
            links.insert(
                name,
                Link {
                    peer_mac,
                    gw_mac,
                    peer: sock,
                },
            );
        }
        let mut backend = NftBackend::new(Nft::in_netns(gw.name()));
        backend.apply_rendered(nftables::render_policy(policy, opts))?;
        // Only probes may move the counters: whatever the scratch gateway itself sends (echo
        // replies, resets, ICMP errors, possibly late under load) is dropped at the very start
        // of the output hook, before any chain of the policy (output and postrouting) sees it.
        // A reject is then confirmed by the kernel's count of unreachables it generated.
        Nft::in_netns(gw.name()).apply_text(
            "table inet pwv_quiet_out {\nchain out {\ntype filter hook output priority -2147483648; policy drop;\n}\n}\n",
        )?;
        Ok(Self {
            policy: policy.clone(),
            uses_ct: policy_uses_ct(policy),
            links,
            raw: HashMap::new(),
            backend,
            counted: opts.force_counters,
            marker: std::process::id().wrapping_mul(2_654_435_761),
            _outside: outside,
            gw,
        })
    }

    /// Name of the scratch gateway namespace.
    pub fn gateway_netns(&self) -> &str {
        self.gw.name()
    }
}
