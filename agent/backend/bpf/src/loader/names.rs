//! What the loader records beside the pins, under `/run/peerwall` (bpffs holds only BPF
//! objects): the names behind a slot's ids, and the digest of its contents bound to its maps.

use super::{map, map_err, Datapath};
use crate::error::BpfError;
use crate::maps::BpfPolicy;

impl Datapath {
    /// `digest` bound to this instance of `slot`'s maps (its `HOOKS` map's kernel id, never
    /// reused while the machine runs): pins removed and created anew never match a digest the
    /// old ones left in `/run`.
    pub(super) fn slot_digest(&mut self, slot: u32, digest: &str) -> Result<String, BpfError> {
        let name = format!("{}{slot}", map::HOOKS);
        let id = match self.map(&name)? {
            aya::maps::Map::Array(d) => d.info().map_err(map_err(map::HOOKS))?.id(),
            _ => return Err(BpfError::MissingMap(name)),
        };
        Ok(format!("{id}:{digest}"))
    }

    /// Names for `peerwall inspect`; the maps alone hold only ids. Best effort: a read-only
    /// /run must not stop enforcement.
    pub(super) fn write_names(&self, slot: u32, new: &BpfPolicy) {
        let meta = crate::meta::SlotMeta {
            chains: new
                .chains
                .iter()
                .map(|c| crate::meta::ChainMeta {
                    table: c.table.clone(),
                    chain: c.chain.clone(),
                    rules: c.rules.iter().map(|r| r.name.clone()).collect(),
                })
                .collect(),
        };
        if let Err(e) = crate::meta::write_meta(&self.pin_dir, slot, &meta) {
            tracing::warn!(error = %e, "cannot record chain and rule names for inspect");
        }
    }
}
