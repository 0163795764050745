//! The bpf backend's guard ([`peerwall_backend_bpf::backend::Guard`]): an nftables table that
//! drops what arrives on an interface the datapath is meant to filter but is not attached to.
//!
//! The datapath filters an interface from the moment its tc link is attached, which the agent
//! does at the interface poll after the device appears. A device made again under its name
//! (Liqo's userspace WireGuard creates `liqo-tunnel` anew each time its gateway container
//! starts, `pkg/gateway/tunnel/wireguard/netlink.go`, `createLinkUserspace`) would otherwise
//! forward everything from the peer until that poll, and for as long as no agent runs. The
//! table is kernel state: it holds while the agent is away.
//!
//! One rule per pattern, in a chain at prerouting before conntrack (priority −300, `raw`):
//! `iifname "liqo-tunnel*" iif != { 7, 12 } drop`. nftables matches the name, the kernel
//! keeps the ifindexes as numbers, so a device made again under the name (a new ifindex) is
//! dropped until the datapath is attached to it and the agent lets it through. With no
//! interface attached the rule has no ifindex test. Base chains decide independently (an
//! accept elsewhere does not skip this one), and the chain's policy is accept: it drops
//! nothing the datapath filters.
//!
//! The table carries no ownership marker: it is not one of peerwall's policy tables, and no
//! policy may name it. `peerwall delete --backend bpf` removes it; so does the emergency
//! switch (`peerwall allow-all on`), which lets everything through; the agent puts it back.
//!
//! Checking is cheap: the ruleset's generation (one netlink request) tells whether any
//! transaction committed since the table was last written; only then is the ruleset listed.

use peerwall_backend::BackendError;
use peerwall_backend_bpf::backend::Guard;
use peerwall_backend_nftables::netlink::{message::nfproto, Session};
use peerwall_backend_nftables::{Nft, Runner};
use peerwall_policy::ir::TableFamily;

/// The guard's table (family `inet`).
pub const TABLE: &str = peerwall_backend_bpf::backend::GUARD_TABLE;

const NFT: &str = peerwall_backend_nftables::NAME;

/// A pattern nftables cannot take inside its double quotes.
#[derive(Debug, thiserror::Error)]
#[error("interface pattern {0:?}: a double quote or backslash cannot be written into an nftables rule; name the interfaces without them")]
pub struct UnquotablePattern(pub String);

/// The script that makes the guard what `patterns` and `attached` say, in one transaction
/// (the table created if missing, deleted, and written again: never a moment without it).
pub fn script(patterns: &[String], attached: &[u32]) -> Result<String, UnquotablePattern> {
    let mut rules = String::new();
    for p in patterns {
        if p.contains(['"', '\\']) {
            return Err(UnquotablePattern(p.clone()));
        }
        let not_attached = if attached.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = attached.iter().map(u32::to_string).collect();
            format!(" iif != {{ {} }}", list.join(", "))
        };
        rules.push_str(&format!(
            "    iifname \"{p}\"{not_attached} counter drop comment \"peerwall: not attached to the bpf datapath yet\"\n"
        ));
    }
    Ok(format!(
        "table inet {TABLE} {{\n}}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n  chain guard {{\n    type filter hook prerouting priority raw; policy accept;\n{rules}  }}\n}}\n"
    ))
}

/// The guard as last written, with the ruleset's generation right after.
#[derive(Debug, Default)]
pub struct NftGuard {
    nft: Option<Nft>,
    session: Option<Session>,
    written: Option<Written>,
}

#[derive(Debug, PartialEq)]
struct Written {
    patterns: Vec<String>,
    attached: Vec<u32>,
    generation: Option<u32>,
}

impl NftGuard {
    fn parts(&mut self) -> (&Nft, &mut Session) {
        let nft = self.nft.get_or_insert_with(Nft::host);
        let session = self.session.get_or_insert_with(|| Session::new(None));
        (nft, session)
    }
}

impl Guard for NftGuard {
    fn keep(&mut self, patterns: &[String], attached: &[u32]) -> Result<bool, BackendError> {
        let last = self.written.take();
        let (nft, session) = self.parts();
        let generation = session.generation().ok();
        let same = last
            .as_ref()
            .is_some_and(|w| w.patterns == patterns && w.attached == attached);
        // Written as wanted and nothing committed since: still there.
        if same && generation.is_some() && last.as_ref().is_some_and(|w| w.generation == generation)
        {
            self.written = last;
            return Ok(false);
        }
        // Unchanged, but something committed since: is the table there? (A change is
        // written without asking: the script replaces whatever is there.)
        let there = same
            && nft
                .list_ruleset_terse()
                .map_err(BackendError::host(NFT, "listing tables"))?
                .kernel_tables()
                .iter()
                .any(|t| t.family == "inet" && t.name == TABLE);
        let missing = same && !there;
        if !there {
            let text =
                script(patterns, attached).map_err(BackendError::host(NFT, "writing the guard"))?;
            nft.apply_text(&text).map_err(BackendError::host(
                NFT,
                "writing the guard of interfaces not attached yet",
            ))?;
        }
        let generation = session.generation().ok();
        self.written = Some(Written {
            patterns: patterns.to_vec(),
            attached: attached.to_vec(),
            generation,
        });
        Ok(missing)
    }

    fn release(&mut self) -> Result<(), BackendError> {
        if self.written.is_none() && self.session.is_some() {
            // Released before and not written since.
            return Ok(());
        }
        self.written = None;
        let (_, session) = self.parts();
        session
            .delete_table(nfproto(TableFamily::Inet), TABLE)
            .map(|_there| ())
            .map_err(BackendError::host(NFT, "deleting the guard"))
    }
}

/// Delete the guard in this namespace, there or not (`peerwall delete`, the emergency switch).
pub fn remove() -> Result<(), BackendError> {
    NftGuard::default().release()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pattern_drops_what_arrives_on_interfaces_not_attached() {
        let s = script(&["liqo-tunnel*".into(), "liqo.*".into()], &[7, 12]).unwrap();
        assert!(s.starts_with("table inet peerwall-guard {\n}\ndelete table inet peerwall-guard\n"));
        assert!(s.contains("type filter hook prerouting priority raw; policy accept;"));
        assert!(s.contains("iifname \"liqo-tunnel*\" iif != { 7, 12 } counter drop"));
        assert!(s.contains("iifname \"liqo.*\" iif != { 7, 12 } counter drop"));
    }

    #[test]
    fn with_nothing_attached_every_matching_interface_is_dropped() {
        let s = script(&["liqo-tunnel".into()], &[]).unwrap();
        assert!(s.contains("iifname \"liqo-tunnel\" counter drop"), "{s}");
        assert!(!s.contains("iif !="), "{s}");
    }

    #[test]
    fn a_pattern_nftables_cannot_quote_is_refused() {
        let e = script(&["a\"b".into()], &[]).unwrap_err();
        assert!(e.to_string().contains("\"a\\\"b\""), "{e}");
    }
}
