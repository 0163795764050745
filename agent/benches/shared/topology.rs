//! A gateway's namespaces as the control-plane benchmarks build them: a sender behind the
//! gateway's `liqo-tunnel`, the gateway (forwarding, pods routed out of its Geneve-named
//! link) and a receiver that answers for every pod address (a local route).

use peerwall_netns::NetNs;

/// Pod addresses (routed to the receiver).
pub const POD_CIDR: &str = "10.32.0.0/11";
/// The sender's range (the peer's pod CIDR in Liqo's `Configuration`).
pub const SENDER_CIDR: &str = "172.16.0.0/16";

/// The three namespaces, deleted on drop.
pub struct Topology {
    pub snd: NetNs,
    pub gw: NetNs,
    pub rcv: NetNs,
}

fn ok(r: Result<std::process::Output, peerwall_netns::NetnsError>) {
    r.expect("setting up the gateway");
}

impl Topology {
    /// Namespaces named after `prefix`; the gateway's link to the pods is `geneve`.
    pub fn new(prefix: &str, geneve: &str) -> Self {
        let snd = NetNs::new(&format!("{prefix}-snd")).expect("netns");
        let gw = NetNs::new(&format!("{prefix}-gw")).expect("netns");
        let rcv = NetNs::new(&format!("{prefix}-rcv")).expect("netns");
        snd.veth("eth0", &gw, "liqo-tunnel").expect("veth");
        gw.veth(geneve, &rcv, "eth0").expect("veth");
        ok(snd.ip(&["addr", "add", "172.16.0.1/30", "dev", "eth0"]));
        ok(gw.ip(&["addr", "add", "172.16.0.2/30", "dev", "liqo-tunnel"]));
        ok(gw.ip(&["addr", "add", "172.16.1.1/30", "dev", geneve]));
        ok(rcv.ip(&["addr", "add", "172.16.1.2/30", "dev", "eth0"]));
        ok(snd.ip(&["route", "add", "default", "via", "172.16.0.2"]));
        ok(gw.ip(&["route", "add", POD_CIDR, "via", "172.16.1.2"]));
        ok(rcv.ip(&["route", "add", "default", "via", "172.16.1.1"]));
        ok(rcv.ip(&["route", "add", "local", POD_CIDR, "dev", "lo"]));
        gw.sysctl("net.ipv4.ip_forward", "1").expect("sysctl");
        for ns in [&gw, &rcv] {
            for k in ["all", "default"] {
                ns.sysctl(&format!("net.ipv4.conf.{k}.rp_filter"), "0")
                    .expect("sysctl");
            }
        }
        Topology { snd, gw, rcv }
    }
}
