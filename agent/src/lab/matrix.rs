//! The reachability matrix: one pair per (source pod, destination pod), probed with ICMP, a TCP
//! connect and a UDP exchange.

use super::infra::in_ns;

/// One probed pair.
#[derive(Clone, Debug)]
pub(super) struct Pair {
    pub(super) from: String,
    pub(super) ns: String,
    pub(super) src: String,
    pub(super) to: String,
    pub(super) dst: String,
    /// What the reference evaluator says of each probe's first packet, on the policy the
    /// controller generates for the gateway it crosses (protection and NetworkPolicies).
    pub(super) want: Probes,
}

/// Outcome of the three probes of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probes {
    /// ICMP echo.
    pub icmp: bool,
    /// TCP connect to 8080.
    pub tcp: bool,
    /// UDP exchange on 9090.
    pub udp: bool,
}

impl Probes {
    /// The reference evaluator's verdict on each probe's first packet from `src` to `dst`
    /// through a gateway enforcing `policy` (`inbound`: from the tunnel to the nodes).
    pub(super) fn judged(
        policy: &peerwall_policy::ir::Policy,
        src: &str,
        dst: &str,
        inbound: bool,
        geneve: &str,
    ) -> anyhow::Result<Self> {
        use peerwall_policy::ir::{eval::proto, CtState, Packet, VerdictAction};
        let (src, dst) = (src.parse()?, dst.parse()?);
        let (iif, oif) = if inbound {
            ("liqo-tunnel", geneve)
        } else {
            (geneve, "liqo-tunnel")
        };
        let passes = |proto: u8, dport: u16| {
            let pkt = Packet {
                src,
                dst,
                proto,
                sport: 40000,
                dport,
                iif: Some(iif.into()),
                oif: Some(oif.into()),
                ct_state: CtState::New,
            };
            peerwall_policy::ir::evaluate_at_ingress(policy, &pkt).verdict == VerdictAction::Accept
        };
        Ok(Self {
            icmp: passes(proto::ICMP, 0),
            tcp: passes(proto::TCP, 8080),
            udp: passes(proto::UDP, 9090),
        })
    }

    /// `icmp tcp udp` as `+`/`-`.
    pub(super) fn marks(self) -> String {
        [self.icmp, self.tcp, self.udp]
            .iter()
            .map(|&b| if b { '+' } else { '-' })
            .collect()
    }

    pub(super) fn word(self) -> &'static str {
        match (self.icmp, self.tcp, self.udp) {
            (true, true, true) => "OK",
            (false, false, false) => "FAIL",
            _ => "MIXED",
        }
    }
}
pub(super) fn probe(p: &Pair) -> Probes {
    let icmp = in_ns(
        &p.ns,
        &["ping", "-c", "1", "-W", "0.7", "-I", &p.src, &p.dst],
        None,
    )
    .is_some();
    let tcp = in_ns(
        &p.ns,
        &[
            "timeout",
            "3",
            "socat",
            "-T",
            "1",
            "-",
            &format!("TCP4:{}:8080,bind={},connect-timeout=0.7", p.dst, p.src),
        ],
        None,
    )
    .is_some_and(|o| o.contains("ok"));
    let udp = in_ns(
        &p.ns,
        &[
            "timeout",
            "3",
            "socat",
            "-T",
            "1.5",
            "-",
            &format!("UDP4:{}:9090,bind={}", p.dst, p.src),
        ],
        Some("peerwall-lab\n"),
    )
    .is_some_and(|o| o.contains("peerwall-lab"));
    Probes { icmp, tcp, udp }
}
