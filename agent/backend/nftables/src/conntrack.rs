//! The kernel's connection tracking as the nftables backend reads and ends it: the
//! `conntrack` tool (conntrack-tools) in the backend's network namespace, and the namespace's
//! `nf_conntrack_tcp_loose` switch. Listing parsing is pure ([`parse_listing`]).

use std::net::IpAddr;
use std::process::{Command, Stdio};

use peerwall_backend::Flow;
use peerwall_policy::ir::eval::proto;

use crate::error::NftError;

/// How to run `conntrack`: in this network namespace or in a named one.
#[derive(Clone, Debug, Default)]
pub struct Conntrack {
    netns: Option<String>,
}

/// The switch that lets conntrack pick up a TCP connection from a packet other than a SYN.
const TCP_LOOSE: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_loose";

impl Conntrack {
    /// `conntrack` in `netns` (None: this one).
    pub fn new(netns: Option<String>) -> Self {
        Self { netns }
    }

    fn command(&self) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "conntrack"]);
                c
            }
            None => Command::new("conntrack"),
        }
    }

    /// Run `conntrack args`: Ok(stdout) on success, Ok(None) when it found nothing to act on.
    fn run(&self, args: &[&str]) -> Result<Option<String>, NftError> {
        let out = self
            .command()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| NftError::Spawn {
                program: "conntrack (the conntrack package)".into(),
                source,
            })?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            return Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()));
        }
        if stderr.contains("0 flow entries") || stderr.contains("No such file") {
            return Ok(None);
        }
        Err(NftError::Failed {
            action: format!("conntrack {}", args.join(" ")),
            status: out.status.to_string(),
            stderr: stderr.trim().to_string(),
        })
    }

    /// Every tracked connection of both families.
    pub fn list(&self) -> Result<Vec<Flow>, NftError> {
        let mut flows = Vec::new();
        for family in ["ipv4", "ipv6"] {
            if let Some(text) = self.run(&["-L", "-f", family])? {
                flows.extend(parse_listing(&text));
            }
        }
        Ok(flows)
    }

    /// Stop conntrack from picking up TCP connections mid-stream in this namespace, so that
    /// an ended connection's next segment is `invalid`, not the start of a new one.
    fn no_pickup(&self) -> Result<(), NftError> {
        let io = |source| NftError::Spawn {
            program: TCP_LOOSE.into(),
            source,
        };
        match &self.netns {
            None => std::fs::write(TCP_LOOSE, "0").map_err(io),
            Some(ns) => {
                let out = Command::new("ip")
                    .args(["netns", "exec", ns, "sh", "-c"])
                    .arg(format!("echo 0 > {TCP_LOOSE}"))
                    .output()
                    .map_err(io)?;
                if out.status.success() {
                    Ok(())
                } else {
                    Err(NftError::Failed {
                        action: format!("writing {TCP_LOOSE}"),
                        status: out.status.to_string(),
                        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                    })
                }
            }
        }
    }

    /// Delete these connections' entries (mid-stream pickup off first); how many existed.
    pub fn end(&self, flows: &[Flow]) -> Result<usize, NftError> {
        if flows.is_empty() {
            return Ok(0);
        }
        self.no_pickup()?;
        let mut ended = 0;
        for f in flows {
            let (src, dst) = (f.src.to_string(), f.dst.to_string());
            let (sport, dport) = (f.sport.to_string(), f.dport.to_string());
            let family = if f.src.is_ipv6() { "ipv6" } else { "ipv4" };
            let mut args = vec!["-D", "-f", family, "-s", &src, "-d", &dst];
            let name = proto_name(f.proto);
            match f.proto {
                proto::TCP | proto::UDP | proto::SCTP => {
                    args.extend(["-p", name, "--sport", &sport, "--dport", &dport]);
                }
                proto::ICMP => args.extend(["-p", name, "--icmp-id", &sport]),
                proto::ICMPV6 => args.extend(["-p", name, "--icmpv6-id", &sport]),
                _ => {}
            }
            if self.run(&args)?.is_some() {
                ended += 1;
            }
        }
        Ok(ended)
    }
}

fn proto_name(p: u8) -> &'static str {
    match p {
        proto::TCP => "tcp",
        proto::UDP => "udp",
        proto::SCTP => "sctp",
        proto::ICMP => "icmp",
        proto::ICMPV6 => "icmpv6",
        _ => "",
    }
}

/// The connections in `conntrack -L` output, by their original direction (the first `src=`,
/// `dst=`, `sport=`/`dport=` or ICMP `id=` of each line; the protocol number is the second
/// field).
pub fn parse_listing(text: &str) -> Vec<Flow> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.next()?;
            let proto: u8 = words.next()?.parse().ok()?;
            let first = |key: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(key))
                    .map(str::to_string)
            };
            let src: IpAddr = first("src=")?.parse().ok()?;
            let dst: IpAddr = first("dst=")?.parse().ok()?;
            let port = |key: &str| first(key).and_then(|v| v.parse::<u16>().ok());
            let (sport, dport) = match proto {
                proto::ICMP | proto::ICMPV6 => (port("id=")?, 0),
                _ => (port("sport=").unwrap_or(0), port("dport=").unwrap_or(0)),
            };
            Some(Flow {
                src,
                dst,
                proto,
                sport,
                dport,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_give_the_original_direction() {
        let text = "\
tcp      6 431999 ESTABLISHED src=10.10.1.68 dst=10.20.1.3 sport=40000 dport=8080 src=10.20.1.3 dst=10.10.1.68 sport=8080 dport=40000 [ASSURED] mark=0 use=1
icmp     1 29 src=10.0.0.1 dst=10.0.0.2 type=8 code=0 id=4660 src=10.0.0.2 dst=10.0.0.1 type=0 code=0 id=4660 mark=0 use=1
sctp     132 119 ESTABLISHED src=fd00::1 dst=fd01::2 sport=1024 dport=5000 src=fd01::2 dst=fd00::1 sport=5000 dport=1024 [ASSURED] mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 3 flow entries have been shown.
";
        let flows = parse_listing(text);
        assert_eq!(flows.len(), 3);
        assert_eq!(
            flows[0],
            Flow {
                src: "10.10.1.68".parse().unwrap(),
                dst: "10.20.1.3".parse().unwrap(),
                proto: 6,
                sport: 40000,
                dport: 8080,
            }
        );
        assert_eq!(
            (flows[1].proto, flows[1].sport, flows[1].dport),
            (1, 4660, 0)
        );
        assert_eq!(flows[2].src, "fd00::1".parse::<IpAddr>().unwrap());
        assert_eq!((flows[2].proto, flows[2].dport), (132, 5000));
    }
}
