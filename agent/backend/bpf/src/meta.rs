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

/// Where the digest of a slot's contents lives: beside its names, `slot<N>.digest`. It is
/// written only once the slot holds those contents whole and is live, and removed before any
/// write to the slot: a loader opening the pins later (the CLI, a restarted agent) leaves a
/// live slot as it is when it is to write the same contents again (counters kept, no
/// switch), and never takes a slot written in part, or changed since, for the same.
pub fn digest_path(pin_dir: &Path, slot: u32) -> PathBuf {
    meta_path(pin_dir, slot).with_extension("digest")
}

/// The recorded digest of `slot`'s contents, if any.
pub fn read_digest(pin_dir: &Path, slot: u32) -> Option<String> {
    std::fs::read_to_string(digest_path(pin_dir, slot)).ok()
}

/// Forget `slot`'s digest (before writing to it). An error other than "none recorded" is
/// returned: a stale digest left behind could name contents the slot no longer holds.
pub fn clear_digest(pin_dir: &Path, slot: u32) -> Result<(), BpfError> {
    let path = digest_path(pin_dir, slot);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(BpfError::Io { path, source: e }),
        _ => Ok(()),
    }
}

/// Record `digest` for `slot` (best effort: without it the next loader rewrites the slot).
pub fn write_digest(pin_dir: &Path, slot: u32, digest: &str) {
    let path = digest_path(pin_dir, slot);
    if let Err(e) = std::fs::write(&path, digest) {
        tracing::debug!(path = %path.display(), error = %e, "slot digest not recorded");
    }
}

/// SHA-256 of a slot's contents as this build's loader writes them (every chain, map entry and
/// view, in this build's layout), hex. The entries of a lookup map are taken as a set (their
/// order in the compiled lists may differ between processes; the maps they fill do not).
pub fn digest(policy: &crate::maps::BpfPolicy) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    struct Feed(Sha256);
    impl Write for Feed {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.update(s.as_bytes());
            Ok(())
        }
    }
    let mut h = Feed(Sha256::new());
    h.0.update(env!("CARGO_PKG_VERSION").as_bytes());
    // Debug shows every field of every entry: the whole of what is written.
    fn set<T: std::fmt::Debug>(h: &mut Feed, name: &str, entries: &[T]) {
        let mut e: Vec<String> = entries.iter().map(|x| format!("{x:?}")).collect();
        e.sort_unstable();
        let _ = write!(h, "{name}:{}:", e.len());
        for x in e {
            let _ = write!(h, "{x};");
        }
    }
    for c in &policy.chains {
        let _ = write!(
            h,
            "chain {} {} {} {:?} {:?} {} {:?} {:?} {:?} {};",
            c.id, c.table, c.chain, c.hook, c.policy, c.audit, c.rules, c.masks, c.ct, c.counters
        );
        set(&mut h, "proto", &c.proto);
        set(&mut h, "src", &c.src);
        set(&mut h, "dst", &c.dst);
        set(&mut h, "sport", &c.sport);
        set(&mut h, "dport", &c.dport);
        set(&mut h, "iif", &c.iif);
        set(&mut h, "oif", &c.oif);
    }
    let _ = write!(h, "hooks {:?};", policy.hooks);
    set(&mut h, "views", &policy.views);
    h.0.finalize().iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}
