//! The cost of events: `peerwall agent --events` enforcing the policy in the gateway, reading
//! and counting every event its datapath reports while the traffic runs.

use std::io::{Read as _, Write as _};
use std::net::Ipv4Addr;
use std::time::Duration;

use super::control::{time_until_enforced, Agent};
use super::deployed::{policy_dir, METRICS_ADDR};
use super::*;

/// Start `peerwall agent --events` on `p` (a directory source) and wait until the policy is in
/// force.
pub(crate) fn events_agent(lab: &Lab, dp: Datapath, p: &Policy) -> Agent {
    let dir = policy_dir(lab, "events-policies", p);
    let backend = match dp {
        Datapath::PeerwallBpfEvents => "bpf",
        _ => "nftables",
    };
    let mut agent = None;
    time_until_enforced(lab, Ipv4Addr::new(10, 64, 0, 9), || {
        agent = Some(Agent::spawn(
            lab,
            &dir,
            backend,
            METRICS_ADDR,
            &["--events", "--events-addr", METRICS_ADDR],
        ));
    });
    agent.expect("the agent started")
}

/// How many events the agent in the gateway has read so far (its `/events` mark).
pub(crate) fn events_seen(lab: &Lab) -> u64 {
    lab.gw
        .run_in(|| -> std::io::Result<u64> {
            let mut s = std::net::TcpStream::connect(METRICS_ADDR)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(
                s,
                "GET /events?after={} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                u64::MAX
            )?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("x-peerwall-next:")
                        .and_then(|v| v.trim().parse().ok())
                })
                .unwrap_or(0))
        })
        .expect("bench namespace")
        .expect("the agent's /events")
}
