//! The kernel's connection tracking as the nftables backend reads and ends it: ctnetlink on a
//! socket in the backend's network namespace ([`crate::netlink::ctnetlink`]: one walk of the
//! kernel's table per listing, one lookup per deletion), and the namespace's
//! `nf_conntrack_tcp_loose` switch.

use std::process::Command;

use peerwall_backend::Flow;

use crate::error::NftError;
use crate::netlink::ctnetlink;
use crate::netlink::socket::Socket;

/// How to reach the kernel's conntrack: in this network namespace or in a named one.
#[derive(Clone, Debug, Default)]
pub struct Conntrack {
    netns: Option<String>,
}

/// The switch that lets conntrack pick up a TCP connection from a packet other than a SYN.
const TCP_LOOSE: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_loose";

/// Connections deleted per datagram: each answer is a buffer of its own in the socket's
/// receive queue (about 1 KiB of its 208 KiB default), and an ICMP connection takes four
/// requests; 32 keep the answers of one datagram within the queue (256 overran it: ENOBUFS).
const DELETES_PER_SEND: usize = 32;

impl Conntrack {
    /// Conntrack in `netns` (None: this one).
    pub fn new(netns: Option<String>) -> Self {
        Self { netns }
    }

    fn socket(&self, action: &str) -> Result<Socket, NftError> {
        Socket::open(self.netns.as_deref()).map_err(netlink(action))
    }

    /// Every tracked connection of both families (one dump).
    pub fn list(&self) -> Result<Vec<ctnetlink::Tracked>, NftError> {
        const ACTION: &str = "listing tracked connections (ctnetlink dump)";
        let sock = self.socket(ACTION)?;
        sock.send(&ctnetlink::dump_request(1))
            .map_err(netlink(ACTION))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut flows = Vec::new();
        loop {
            let n = sock.recv(&mut buf).map_err(netlink(ACTION))?;
            let part = ctnetlink::parse_dump(&buf[..n]).ok_or_else(|| {
                netlink(ACTION)(std::io::Error::other("netlink answer cut short"))
            })?;
            if let Some(e) = part.error {
                return Err(netlink(ACTION)(std::io::Error::from_raw_os_error(-e)));
            }
            flows.extend(part.flows);
            if part.done {
                return Ok(flows);
            }
        }
    }

    /// Stop conntrack from picking up TCP connections mid-stream in this namespace, so that
    /// an ended connection's next segment is `invalid`, not the start of a new one.
    pub(crate) fn no_pickup(&self) -> Result<(), NftError> {
        match &self.netns {
            None => std::fs::write(TCP_LOOSE, "0").map_err(|source| NftError::Sysctl {
                path: TCP_LOOSE.into(),
                source,
            }),
            Some(ns) => {
                let out = Command::new("ip")
                    .args(["netns", "exec", ns, "sh", "-c"])
                    .arg(format!("echo 0 > {TCP_LOOSE}"))
                    .output()
                    .map_err(|source| NftError::Spawn {
                        program: "ip".into(),
                        source,
                    })?;
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

    /// Delete these connections' entries (mid-stream pickup off first, where this process
    /// may write the switch); how many existed.
    ///
    /// The switch is a file under `/proc/sys`, which container runtimes mount read-only in an
    /// unprivileged container (the DaemonSet's agent, the sidecar): there it cannot be
    /// written, and the deletion goes on without it (a warning says so once) — ending the
    /// entries is what revokes; the switch only makes a later mid-stream segment `invalid`
    /// instead of `new` for the policy in force to judge.
    pub fn end(&self, flows: &[Flow]) -> Result<usize, NftError> {
        if flows.is_empty() {
            return Ok(0);
        }
        if let Err(e) = self.no_pickup() {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(error = %e, "conntrack may pick connections up mid-stream here (the switch is read-only in this container); ending them anyway");
            });
        }
        self.delete(flows)
    }

    /// Delete these connections' entries, one lookup each (no walk of the table, and the
    /// mid-stream switch left as it is); how many existed.
    pub fn delete(&self, flows: &[Flow]) -> Result<usize, NftError> {
        const ACTION: &str = "ending tracked connections (ctnetlink delete)";
        if flows.is_empty() {
            return Ok(0);
        }
        let sock = self.socket(ACTION)?;
        let mut ended = std::collections::BTreeSet::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut seq = 1u32;
        for (c, chunk) in flows.chunks(DELETES_PER_SEND).enumerate() {
            let (bytes, sent) = ctnetlink::delete_requests(chunk, seq);
            seq = seq.wrapping_add(sent.len() as u32);
            sock.send(&bytes).map_err(netlink(ACTION))?;
            let mut waiting: std::collections::BTreeMap<u32, usize> = sent.into_iter().collect();
            while !waiting.is_empty() {
                let n = sock.recv(&mut buf).map_err(netlink(ACTION))?;
                let answers = crate::netlink::message::answers(&buf[..n]).ok_or_else(|| {
                    netlink(ACTION)(std::io::Error::other("netlink answer cut short"))
                })?;
                for a in answers {
                    let Some(i) = waiting.remove(&a.seq) else {
                        continue;
                    };
                    match -a.error {
                        0 => {
                            ended.insert(c * DELETES_PER_SEND + i);
                        }
                        // No such connection: already gone, or an ICMP request type it
                        // was not.
                        libc::ENOENT => {}
                        e => return Err(netlink(ACTION)(std::io::Error::from_raw_os_error(e))),
                    }
                }
            }
        }
        Ok(ended.len())
    }
}

fn netlink(action: &str) -> impl FnOnce(std::io::Error) -> NftError + '_ {
    move |source| NftError::Netlink {
        action: action.to_string(),
        source,
    }
}

/// Connections as the forward hook sees them (what a policy judges), with the original tuple
/// of each one NAT rewrote (what its deletion must name): seen → original.
pub fn as_seen(
    tracked: Vec<ctnetlink::Tracked>,
) -> (Vec<Flow>, std::collections::HashMap<Flow, Flow>) {
    let rewritten = tracked
        .iter()
        .filter(|t| t.seen != t.orig)
        .map(|t| (t.seen, t.orig))
        .collect();
    (tracked.into_iter().map(|t| t.seen).collect(), rewritten)
}
