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
    pub(super) expect: bool,
}

/// Outcome of the three probes of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Probes {
    pub(super) icmp: bool,
    pub(super) tcp: bool,
    pub(super) udp: bool,
}

impl Probes {
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
