//! The kernel keeps tracking connections where the bpf datapath reads its table.
//!
//! The kernel tracks a family's connections in a network namespace while anything there uses
//! conntrack: a NAT chain (Liqo's remapping), a `ct` match (the boot policy's replies rule).
//! The datapath's kernel mode (`--bpf-conntrack kernel|auto`) is chosen when it loads, from
//! what the kernel tracks then; if the users of conntrack went away afterwards (the boot table
//! is released after the first apply, before Liqo's NAT is there; an operator deletes Liqo's
//! tables), the kernel would stop tracking, every packet would look new to the datapath and
//! replies would be dropped until a restart. So while the datapath reads the kernel's table
//! for a family, that family's table [`TABLE`] holds one rule with a `ct state` match in a
//! chain no hook runs: the kernel tracks as long as it is there, and no packet ever traverses
//! it (`nft_ct`'s init takes conntrack for the namespace's family, whatever the chain).
//!
//! The table carries no ownership marker: it is not one of peerwall's policy tables (the
//! boot policy's "peerwall's tables already enforce here" does not count it), and no policy
//! may name it. `peerwall delete --backend bpf` removes it.
//!
//! Checking is cheap: the ruleset's generation (one netlink request) tells whether any
//! transaction committed since the table was last seen; only then is the ruleset listed.

use peerwall_backend::BackendError;
use peerwall_backend_nftables::netlink::{message::nfproto, Session};
use peerwall_backend_nftables::{Nft, Runner};
use peerwall_policy::ir::TableFamily;

/// The table (family `ip` and/or `ip6`) that keeps the kernel tracking.
pub const TABLE: &str = peerwall_backend_bpf::backend::KEEP_TRACKING_TABLE;

const NFT: &str = peerwall_backend_nftables::NAME;

/// The families' tables, with the generation they were last seen in.
#[derive(Debug)]
pub struct Tracking {
    nft: Nft,
    session: Session,
    /// The ruleset's generation when both families were last found as wanted.
    seen: Option<(u32, bool, bool)>,
}

impl Default for Tracking {
    fn default() -> Self {
        Self {
            nft: Nft::host(),
            session: Session::new(None),
            seen: None,
        }
    }
}

/// The script that creates `family`'s table (`ip` or `ip6`).
pub fn script(family: &str) -> String {
    format!(
        "table {family} {TABLE} {{\n  chain hold {{\n    ct state invalid comment \"peerwall: keeps the kernel tracking connections, the bpf datapath reads its table; never run\"\n  }}\n}}\n"
    )
}

impl Tracking {
    /// Make sure the kernel tracks IPv4 (`v4`) and IPv6 (`v6`) connections here: create the
    /// families' tables that are missing. Ok(the families it created).
    pub fn keep(&mut self, v4: bool, v6: bool) -> Result<Vec<&'static str>, BackendError> {
        if !v4 && !v6 {
            return Ok(Vec::new());
        }
        let generation = self.session.generation().ok();
        if let (Some(g), Some((seen, s4, s6))) = (generation, self.seen) {
            if g == seen && (s4 || !v4) && (s6 || !v6) {
                return Ok(Vec::new());
            }
        }
        let listing = self
            .nft
            .list_ruleset_terse()
            .map_err(BackendError::host(NFT, "listing tables"))?;
        let tables = listing.kernel_tables();
        let have = |family: &str| tables.iter().any(|t| t.family == family && t.name == TABLE);
        let missing: Vec<&'static str> = [(v4, "ip"), (v6, "ip6")]
            .into_iter()
            .filter(|&(want, family)| want && !have(family))
            .map(|(_, family)| family)
            .collect();
        if !missing.is_empty() {
            let text: String = missing.iter().map(|f| script(f)).collect();
            self.nft.apply_text(&text).map_err(BackendError::host(
                NFT,
                "creating the table that keeps the kernel tracking connections",
            ))?;
        }
        // What the listing saw holds for the generation read before it, not for one read
        // after: a table deleted between the listing and a later read would be vouched for
        // by a generation that already has it gone, and never put back. After creating a
        // table the generation is our own commit's: the next call lists once more.
        self.seen = if missing.is_empty() {
            generation.map(|g| (g, v4 || have("ip"), v6 || have("ip6")))
        } else {
            None
        };
        Ok(missing)
    }

    /// Delete both families' tables, there or not.
    pub fn release(&mut self) -> Result<(), BackendError> {
        self.seen = None;
        for family in [TableFamily::Ip, TableFamily::Ip6] {
            self.session
                .delete_table(nfproto(family), TABLE)
                .map_err(BackendError::host(
                    NFT,
                    "deleting the table that keeps the kernel tracking connections",
                ))?;
        }
        Ok(())
    }
}
