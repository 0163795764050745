//! What a host command may do here: this process's effective capabilities
//! (`/proc/self/status`, `CapEff`), checked before the command looks at anything, so that
//! "not allowed to look" is never reported as "nothing found" and no advice is given that a
//! user without the privileges could not follow.

use super::CliError;

/// `CAP_NET_ADMIN`: nftables tables, tc/tcx attachments, conntrack.
const CAP_NET_ADMIN: u32 = 12;
/// `CAP_SYS_ADMIN`: bpf before `CAP_BPF`, entering another network or mount namespace.
const CAP_SYS_ADMIN: u32 = 21;
/// `CAP_BPF`: bpf maps and programs (pins).
const CAP_BPF: u32 = 39;

/// What a host command touches besides nftables in its own network namespace.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Needs {
    /// A bpf datapath: pinned (its pin directory exists) or asked for (`--backend bpf`).
    pub bpf: bool,
    /// Another network namespace (`--netns`, `--gateway`).
    pub netns: bool,
}

/// The effective capability set from a `/proc/<pid>/status` text.
fn effective(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// What a host command lacks of what it `needs`, by name (empty: nothing).
fn missing(eff: u64, needs: Needs) -> Vec<&'static str> {
    let has = |c: u32| eff & (1u64 << c) != 0;
    let mut out = Vec::new();
    if !has(CAP_NET_ADMIN) {
        out.push("CAP_NET_ADMIN (nftables tables, tc links, conntrack)");
    }
    if needs.bpf && !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        out.push("CAP_BPF or CAP_SYS_ADMIN (the bpf datapath's pins)");
    }
    if needs.netns && !has(CAP_SYS_ADMIN) {
        out.push("CAP_SYS_ADMIN (entering another network namespace)");
    }
    out
}

/// Refuse `command` (exit 1, before it looks at anything) unless this process holds what it
/// `needs`: `CAP_NET_ADMIN`, plus `CAP_BPF` (or `CAP_SYS_ADMIN`) for a bpf datapath and
/// `CAP_SYS_ADMIN` for another network namespace. Root holds them all.
pub(super) fn require(command: &str, needs: Needs) -> Result<(), CliError> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let lacking = match effective(&status) {
        Some(eff) => missing(eff, needs),
        None => vec!["its capabilities could not be read from /proc/self/status"],
    };
    if lacking.is_empty() {
        return Ok(());
    }
    Err(CliError::Runtime(anyhow::anyhow!(
        "peerwall {command}: not permitted: this process lacks {}; run it as root (sudo peerwall \
         {command} …) or in the agent's pod (kubectl -n peerwall-system exec ds/peerwall-agent -- \
         peerwall {command} …)",
        lacking.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_are_read_and_named_as_needed() {
        let all = Needs {
            bpf: true,
            netns: true,
        };
        let root = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert_eq!(effective(root), Some(0x1ff_ffff_ffff));
        assert!(missing(0x1ff_ffff_ffff, all).is_empty());
        let user = "CapEff:\t0000000000000000\n";
        let m = missing(effective(user).unwrap(), all);
        assert_eq!(m.len(), 3, "{m:?}");
        assert!(m[0].starts_with("CAP_NET_ADMIN"));
        // nftables in its own namespace (the nftables sidecar): NET_ADMIN is enough.
        assert!(missing(1 << CAP_NET_ADMIN, Needs::default()).is_empty());
        assert_eq!(missing(0, Needs::default()).len(), 1);
        // The bpf sidecar (NET_ADMIN, BPF, PERFMON): its own pins, no other namespace.
        let sidecar = (1 << CAP_NET_ADMIN) | (1 << CAP_BPF);
        assert!(missing(
            sidecar,
            Needs {
                bpf: true,
                netns: false
            }
        )
        .is_empty());
        assert_eq!(
            missing(sidecar, all),
            ["CAP_SYS_ADMIN (entering another network namespace)"]
        );
        assert_eq!(effective("Name:\tx\n"), None);
    }
}
