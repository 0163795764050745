//! `--engine nftables`: ask the real kernel what it does with a packet.
//!
//! [`NftProbe`] builds a scratch gateway: a network namespace whose interfaces carry the names
//! the packet uses (`liqo-tunnel`, `liqo.abcdefghij`, ...), each a veth whose peer sits in a second
//! "outside" namespace where nothing answers. The policy is loaded with nft exactly as the
//! backend renders it (plus a counter on every rule). A probe is injected on the input
//! interface's peer; the kernel forwards, drops or rejects it. What arrives on the output peer
//! (or on a raw socket in the gateway, for local delivery) and the kernel's count of ICMP
//! unreachables it generated tell the fate; the rule counters tell which chain and rule decided.
//! The two must agree.
//!
//! Conntrack states are produced for real (`nft/ct.rs`). [`NftProbe::deployed`] loads the policy as
//! the agent renders it instead, counters only where the policy asks and the decided-flow cache
//! on: only the fate is read then (`nft/fate.rs`).

mod ct;
mod fate;
mod scratch;

use scratch::routable;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::packet::{self, Shape};
use crate::sock::{Direction, LinkSocket, RawIpSocket};
use crate::ProbeError;
use peerwall_backend_nftables::{Nft, NftBackend, RuleCounter};
use peerwall_netns::NetNs;
use peerwall_policy::ir::eval::{chains_on_path, proto};
use peerwall_policy::ir::{CtState, IpFamily, Packet, PacketPath, Policy, Verdict, VerdictAction};

/// Addresses the scratch gateway uses for itself (sources of its ICMP errors).
const GW_V4: &str = "192.0.2.254";
const GW_V6: &str = "2001:db8:ffff::fe";
/// How long to wait for a packet that is not coming.
const QUIET: Duration = Duration::from_millis(60);
/// How long to wait for a packet the counters say must come.
const PATIENCE: Duration = Duration::from_millis(1500);
/// How long a packet of a deployed rendering ([`NftProbe::fate`]) may take before it counts as
/// not delivered: no counter says it must come.
const UNDELIVERED: Duration = Duration::from_millis(300);

struct Link {
    peer_mac: [u8; 6],
    gw_mac: [u8; 6],
    peer: LinkSocket,
}

/// A scratch gateway with a policy loaded, answering verdict queries from the real kernel.
pub struct NftProbe {
    policy: Policy,
    uses_ct: bool,
    links: BTreeMap<String, Link>,
    raw: HashMap<(bool, u8), RawIpSocket>,
    backend: NftBackend,
    /// Every rule counts ([`NftProbe::new`]); else the rendering is the agent's
    /// ([`NftProbe::deployed`]) and only [`NftProbe::fate`] answers.
    counted: bool,
    marker: u32,
    // Dropped last: the namespaces outlive the sockets in them.
    _outside: NetNs,
    gw: NetNs,
}

impl NftProbe {
    fn counters(&self) -> Result<HashMap<(String, String, String), u64>, ProbeError> {
        Ok(self
            .backend
            .counters()?
            .into_iter()
            .map(
                |RuleCounter {
                     table,
                     chain,
                     rule,
                     packets,
                     ..
                 }| ((table, chain, rule), packets),
            )
            .collect())
    }

    /// Counters once they stop moving: packets the gateway sent in answer to an earlier probe
    /// (an echo reply, a TCP reset) must not be counted against the next one.
    fn settled_counters(&self) -> Result<HashMap<(String, String, String), u64>, ProbeError> {
        let mut last = self.counters()?;
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(2));
            let now = self.counters()?;
            if now == last {
                return Ok(now);
            }
            last = now;
        }
        Ok(last)
    }

    fn check(&self, pkt: &Packet) -> Result<(), ProbeError> {
        let unsupported = |m: String| Err(ProbeError::Unsupported(m));
        if IpFamily::of(&pkt.src) != IpFamily::of(&pkt.dst) {
            return unsupported("source and destination are of different families".into());
        }
        if pkt.src == pkt.dst {
            return unsupported("source equals destination".into());
        }
        for a in [&pkt.src, &pkt.dst] {
            if !routable(a) {
                return unsupported(format!("{a} is not a unicast address the kernel forwards"));
            }
            if a.to_string() == GW_V4 || a.to_string() == GW_V6 {
                return unsupported(format!("{a} is reserved by the scratch gateway"));
            }
        }
        if pkt.path() == PacketPath::Output {
            return unsupported("an input interface is required (--iif)".into());
        }
        for i in pkt.iif.iter().chain(pkt.oif.iter()) {
            if !self.links.contains_key(i) {
                return unsupported(format!(
                    "interface {i:?} was not created in the scratch gateway"
                ));
            }
        }
        if self.uses_ct && pkt.ct_state == CtState::Related {
            let icmp = if pkt.src.is_ipv6() {
                proto::ICMPV6
            } else {
                proto::ICMP
            };
            if pkt.proto != icmp {
                return unsupported(
                    "ct state related is reproduced with an ICMP error: use --proto icmp".into(),
                );
            }
        }
        Ok(())
    }

    fn raw_socket(&mut self, v6: bool, p: u8) -> Result<&RawIpSocket, ProbeError> {
        if !self.raw.contains_key(&(v6, p)) {
            let sock = self
                .gw
                .run_in(move || RawIpSocket::open(v6, p))?
                .map_err(|source| ProbeError::Socket {
                    what: "opening a raw socket",
                    source,
                })?;
            self.raw.insert((v6, p), sock);
        }
        self.raw
            .get(&(v6, p))
            .ok_or_else(|| ProbeError::Unsupported("raw socket vanished".into()))
    }

    /// The kernel's verdict on one packet: its action, and from the counters the chain and
    /// rule that decided (a probe built with [`NftProbe::new`]).
    pub fn verdict(&mut self, pkt: &Packet) -> Result<Verdict, ProbeError> {
        if !self.counted {
            return Err(ProbeError::Unsupported(
                "this scratch gateway renders as deployed: no rule counts every packet".into(),
            ));
        }
        self.probe(pkt, 1).map(|mut v| v.remove(0).0)
    }

    fn probe(&mut self, pkt: &Packet, times: usize) -> Result<Vec<(Verdict, u64)>, ProbeError> {
        self.check(pkt)?;
        self.marker = self.marker.wrapping_mul(1_103_515_245).wrapping_add(12345) | 1;
        let marker = self.marker;
        let iif = pkt.iif.clone().unwrap_or_default();
        let (s, d) = (pkt.src.to_string(), pkt.dst.to_string());
        let path = pkt.path();
        // Routes: destination out of OIF (or local), source back through IIF for ICMP errors.
        let local_prefix = if pkt.dst.is_ipv6() {
            format!("{d}/128")
        } else {
            format!("{d}/32")
        };
        let peer_mac = |name: &str| {
            self.links
                .get(name)
                .map(|l| {
                    l.peer_mac
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<Vec<_>>()
                        .join(":")
                })
                .unwrap_or_default()
        };
        match (&pkt.oif, path) {
            (Some(oif), PacketPath::Forward) => {
                self.gw.ip(&["route", "replace", &d, "dev", oif])?;
                self.gw.ip(&[
                    "neigh",
                    "replace",
                    &d,
                    "lladdr",
                    &peer_mac(oif),
                    "dev",
                    oif,
                    "nud",
                    "permanent",
                ])?;
            }
            _ => {
                self.gw.add_local_address(&local_prefix, "lo")?;
            }
        }
        self.gw.ip(&["route", "replace", &s, "dev", &iif])?;
        self.gw.ip(&[
            "neigh",
            "replace",
            &s,
            "lladdr",
            &peer_mac(&iif),
            "dev",
            &iif,
            "nud",
            "permanent",
        ])?;
        let result = self.send_and_judge(pkt, marker, path, times);
        // Undo per-packet state whatever happened.
        if path == PacketPath::Input {
            let _ = self.gw.ip(&["addr", "del", &local_prefix, "dev", "lo"]);
        }
        if self.uses_ct && pkt.ct_state == CtState::Untracked {
            let _ = Nft::in_netns(self.gw.name()).apply_text("delete table inet pwv_notrack\n");
        }
        result
    }

    fn send_and_judge(
        &mut self,
        pkt: &Packet,
        marker: u32,
        path: PacketPath,
        times: usize,
    ) -> Result<Vec<(Verdict, u64)>, ProbeError> {
        let shape = self.prepare_ct(pkt, marker)?;
        let v6 = pkt.src.is_ipv6();
        if path == PacketPath::Input {
            self.raw_socket(v6, pkt.proto)?;
        }
        let mut out = Vec::with_capacity(times);
        for _ in 0..times {
            out.push(if self.counted {
                (self.send_counted(pkt, marker, path, shape)?, 0)
            } else {
                self.send_observed(pkt, marker, path, shape)?
            });
        }
        Ok(out)
    }

    /// Drain anything queued from earlier probes.
    fn drain(&self, pkt: &Packet, buf: &mut [u8]) {
        for l in self.links.values() {
            while let Ok(Some(_)) = l.peer.try_recv(buf) {}
        }
        if let Some(r) = self.raw.get(&(pkt.src.is_ipv6(), pkt.proto)) {
            while let Ok(Some(_)) = r.try_recv(buf) {}
        }
    }

    /// Inject the probe on its input interface's peer.
    fn send_frame(&self, pkt: &Packet, marker: u32, shape: Shape) -> Result<(), ProbeError> {
        let iif = pkt.iif.as_deref().unwrap_or_default();
        let link = self
            .links
            .get(iif)
            .ok_or_else(|| ProbeError::Unsupported(format!("no interface {iif}")))?;
        let ip = packet::build_ip(pkt, marker, shape);
        let frame = packet::ethernet(link.peer_mac, link.gw_mac, &ip);
        link.peer.send(&frame).map_err(|source| ProbeError::Socket {
            what: "sending the probe",
            source,
        })
    }

    /// Send the probe; its verdict from the counters, checked against what arrived.
    fn send_counted(
        &mut self,
        pkt: &Packet,
        marker: u32,
        path: PacketPath,
        shape: Shape,
    ) -> Result<Verdict, ProbeError> {
        let v6 = pkt.src.is_ipv6();
        let mut buf = vec![0u8; 65536];
        self.drain(pkt, &mut buf);
        let before = self.settled_counters()?;
        let unreach_before = self.unreachables_sent(v6)?;
        self.send_frame(pkt, marker, shape)?;
        let mut observed = self.observe(pkt, marker, shape, path, QUIET, &mut buf)?;
        let after = self.counters()?;
        let counted = self.derive(pkt, &before, &after);
        // The gateway's own packets are dropped at output (see `new`), so a reject is never seen
        // on the wire: the kernel's count of unreachables it generated is the observation. It
        // also never answers an ICMP error or a packet with a corrupt checksum.
        let kernel_rejected = counted.verdict == VerdictAction::Reject
            && observed.is_none()
            && (shape.icmp_error
                || shape.bad_checksum
                || self.unreachables_sent(v6)? > unreach_before);
        if observed.is_none() && counted.verdict == VerdictAction::Accept {
            observed = self.observe(pkt, marker, shape, path, PATIENCE, &mut buf)?;
        }
        let observed = observed.unwrap_or(VerdictAction::Drop);
        let silent_reject = kernel_rejected;
        if observed != counted.verdict && !silent_reject {
            return Err(ProbeError::Inconsistent {
                observed: observed.as_str(),
                counted: counted.verdict.as_str(),
                packet: format!("{pkt:?}"),
            });
        }
        Ok(counted)
    }

    fn observe(
        &self,
        pkt: &Packet,
        marker: u32,
        shape: Shape,
        path: PacketPath,
        wait: Duration,
        buf: &mut [u8],
    ) -> Result<Option<VerdictAction>, ProbeError> {
        let deadline = Instant::now() + wait;
        let sock_err = |source| ProbeError::Socket {
            what: "receiving",
            source,
        };
        let iif_link = pkt.iif.as_deref().and_then(|i| self.links.get(i));
        let oif_link = pkt.oif.as_deref().and_then(|i| self.links.get(i));
        loop {
            if path == PacketPath::Input && self.raw_hit(pkt, marker, shape, buf)? {
                return Ok(Some(VerdictAction::Accept));
            }
            // Each tap is read once per round; a frame may be the forwarded probe (on the
            // output link) or an ICMP error about it (on the input link); both can be one link.
            let mut taps: Vec<&Link> = Vec::new();
            for l in [oif_link, iif_link].into_iter().flatten() {
                if !taps.iter().any(|t| std::ptr::eq(*t, l)) {
                    taps.push(l);
                }
            }
            for l in taps {
                let is_out = oif_link.is_some_and(|o| std::ptr::eq(o, l));
                let is_in = iif_link.is_some_and(|i| std::ptr::eq(i, l));
                while let Some((n, dir)) = l.peer.try_recv(buf).map_err(sock_err)? {
                    if dir != Direction::Incoming {
                        continue;
                    }
                    let Some(ip) = packet::strip_ethernet(&buf[..n]) else {
                        continue;
                    };
                    if is_out && packet::is_probe(ip, pkt, marker, shape) {
                        return Ok(Some(VerdictAction::Accept));
                    }
                    if is_in && packet::is_unreachable_for(ip, pkt, marker) {
                        // For local delivery the stack itself may answer (UDP port closed):
                        // the raw socket has the final word there.
                        if path == PacketPath::Input {
                            std::thread::sleep(Duration::from_millis(5));
                            if self.raw_hit(pkt, marker, shape, buf)? {
                                return Ok(Some(VerdictAction::Accept));
                            }
                        }
                        return Ok(Some(VerdictAction::Reject));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// ICMP (ICMPv6) destination-unreachable messages the gateway's stack has generated.
    /// Counted when generated, before netfilter sees them on the way out.
    fn unreachables_sent(&self, v6: bool) -> Result<u64, ProbeError> {
        let text = self
            .gw
            .run_in(move || {
                std::fs::read_to_string(if v6 {
                    "/proc/thread-self/net/snmp6"
                } else {
                    "/proc/thread-self/net/snmp"
                })
            })?
            .map_err(|source| ProbeError::Socket {
                what: "reading ICMP statistics",
                source,
            })?;
        Ok(parse_unreachables(&text, v6).unwrap_or(0))
    }

    /// Whether the gateway's raw socket received the probe (it passed the input hook).
    fn raw_hit(
        &self,
        pkt: &Packet,
        marker: u32,
        shape: Shape,
        buf: &mut [u8],
    ) -> Result<bool, ProbeError> {
        let Some(r) = self.raw.get(&(pkt.src.is_ipv6(), pkt.proto)) else {
            return Ok(false);
        };
        while let Some(n) = r.try_recv(buf).map_err(|source| ProbeError::Socket {
            what: "receiving",
            source,
        })? {
            let hit = if r.v6 {
                packet::l4_has_marker(pkt.proto, &buf[..n], pkt, marker, shape)
            } else {
                packet::is_probe(&buf[..n], pkt, marker, shape)
            };
            if hit {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Which chain and rule decided, from counter deltas along the packet's path.
    fn derive(
        &self,
        pkt: &Packet,
        before: &HashMap<(String, String, String), u64>,
        after: &HashMap<(String, String, String), u64>,
    ) -> Verdict {
        let mut last = Verdict::nothing_on_path();
        for pc in chains_on_path(&self.policy, pkt.family(), pkt.path()) {
            let hit = pc.chain.rules.iter().find(|r| {
                let key = (pc.table.name.clone(), pc.chain.name.clone(), r.name.clone());
                r.action.verdict().is_some()
                    && after.get(&key).copied().unwrap_or(0)
                        > before.get(&key).copied().unwrap_or(0)
            });
            let v = hit
                .and_then(|r| r.action.verdict())
                .unwrap_or(pc.chain.policy);
            let rule = hit.map(|r| r.name.clone());
            if !last.fold(&pc.table.name, &pc.chain.name, pc.table.audit, v, rule) {
                break;
            }
        }
        last
    }
}

/// `OutDestUnreachs` from /proc/net/snmp (header line + value line) or
/// `Icmp6OutDestUnreachs` from /proc/net/snmp6.
fn parse_unreachables(text: &str, v6: bool) -> Option<u64> {
    if v6 {
        return text.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next()? == "Icmp6OutDestUnreachs").then(|| it.next()?.parse().ok())?
        });
    }
    let mut icmp = text.lines().filter(|l| l.starts_with("Icmp:"));
    let header = icmp.next()?;
    let values = icmp.next()?;
    let idx = header
        .split_whitespace()
        .position(|h| h == "OutDestUnreachs")?;
    values.split_whitespace().nth(idx)?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn unreachables_are_parsed() {
        let v4 = "Ip: Forwarding DefaultTTL\nIp: 1 64\nIcmp: InMsgs InErrors OutMsgs OutDestUnreachs\nIcmp: 3 0 7 5\nIcmpMsg: InType3\nIcmpMsg: 1\n";
        assert_eq!(super::parse_unreachables(v4, false), Some(5));
        let v6 = "Icmp6InMsgs                     \t0\nIcmp6OutDestUnreachs            \t4\n";
        assert_eq!(super::parse_unreachables(v6, true), Some(4));
    }
}
