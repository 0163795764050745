//! The names behind a slot's ids: which table, chain and rules each chain id and rule bit of
//! a slot stands for. The loader writes them beside the pins (bpffs holds only BPF objects)
//! under `/run/peerwall/<pin dir>/slot<N>.json`; inspect and events read them.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::BpfError;

/// Names of a slot's chains and rules, written by the loader.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SlotMeta {
    /// Per chain id: (table, chain, rule names in bit order).
    pub chains: Vec<ChainMeta>,
}

/// Names of one chain.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ChainMeta {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule names by bit.
    pub rules: Vec<String>,
}

/// Where slot metadata lives: `META_ROOT/<pin dir>/slot<N>.json`.
pub const META_ROOT: &str = "/run/peerwall";

/// Where the metadata of a pin directory's slot lives.
pub fn meta_path(pin_dir: &Path, slot: u32) -> PathBuf {
    let rel = pin_dir.strip_prefix("/").unwrap_or(pin_dir);
    Path::new(META_ROOT)
        .join(rel)
        .join(format!("slot{slot}.json"))
}

/// Record the names of what was written into `slot`.
pub fn write_meta(pin_dir: &Path, slot: u32, meta: &SlotMeta) -> Result<(), BpfError> {
    let path = meta_path(pin_dir, slot);
    let io = |source| BpfError::Io {
        path: path.clone(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let text = serde_json::to_string(meta).map_err(|e| io(std::io::Error::other(e)))?;
    std::fs::write(&path, text).map_err(io)
}
