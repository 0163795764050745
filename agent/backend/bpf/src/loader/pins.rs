//! Pins under the bpffs directory: link pin names, what is attached, removal, and the
//! emergency switch of a pinned datapath.

use peerwall_common::map;
use std::path::Path;

use aya::maps::{Array, MapData};
use aya::programs::links::{FdLink, PinnedLink};

use super::{map_err, BpfError};

/// Pin name of a link: bpffs refuses names with a dot, so `liqo.abc` is pinned as
pub fn link_pin_name(kind: &str, ifname: &str) -> String {
    format!("{kind}-{}", ifname.replace('.', ":"))
}

/// Attached programs of a pin directory, as `kind:interface`, from its pinned links whose
/// device still exists (a link whose interface was deleted is pinned but filters nothing).
pub fn attached_in(pin_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(pin_dir.join("links"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    super::linkinfo::link_state(&e.path()).is_ok_and(|s| s.ifindex.is_some())
                })
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    parse_link_pin_name(&n).map(|(k, i)| format!("{k}:{i}"))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Decode a link pin name into (kind, interface name).
pub fn parse_link_pin_name(pin: &str) -> Option<(&str, String)> {
    let (kind, name) = pin.split_once('-')?;
    Some((kind, name.replace(':', ".")))
}

/// Pin a link (it must be a bpf_link) so that it outlives this process.
pub(super) fn pin_link<E: std::fmt::Display>(
    link: Result<FdLink, E>,
    path: &Path,
) -> Result<(), BpfError> {
    let fd = link.map_err(|e| BpfError::Program {
        what: format!("{} is not a bpf_link: {e}", path.display()),
        source: aya::programs::ProgramError::NotAttached,
    })?;
    fd.pin(path).map_err(|source| BpfError::Pin {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(())
}

/// Unpin verdict caches pinned by an older peerwall whose entries have another layout
/// (`CachedVerdict` grew a field: the new object would otherwise reuse them, and the verifier
/// refuse its reads past their end) or another definition (flags: a cache pinned before it
/// had per-CPU LRU lists would be adopted as it is, and a flood of new flows would contend on
/// its shared list until the next reboot). Caches only: dropping one costs each flow one
/// classification. Programs still attached keep the old map until they are replaced.
///
/// Also the table of flows not replied yet (`FLOWS_NEW`) when it is not this release's
/// direct-mapped array of `new_flow_slots` slots (an older peerwall pinned an LRU hash; or
/// another `--flow-table-size`, whose slots the datapath's index would not match): those flows
/// had no answer yet; an answer arriving after the swap is classified as a new flow of its
/// own. And the per-flow event state (`EVENT_FLOWS`) and conntrack's `FLOW_SEEN` stamps of
/// another layout. The established flows' table is never dropped. Returns the pins removed.
pub(super) fn drop_stale_caches(
    pin_dir: &Path,
    new_flow_slots: u32,
) -> Result<Vec<String>, BpfError> {
    let value = std::mem::size_of::<peerwall_common::CachedVerdict>() as u32;
    let mut removed = Vec::new();
    for (name, key) in [
        (
            map::VERDICTS4,
            std::mem::size_of::<peerwall_common::VerdictKey4>(),
        ),
        (
            map::VERDICTS6,
            std::mem::size_of::<peerwall_common::FlowKey>(),
        ),
    ] {
        drop_pin_unless(pin_dir, name, &mut removed, |info| {
            info.value_size() == value
                && info.key_size() == key as u32
                && info.map_flags() == peerwall_common::NO_COMMON_LRU
        })?;
    }
    // The per-flow event state, when an older peerwall pinned it with fewer fields
    // (`EventFlow` grew the latest packet's): dropping it costs each flow an early event.
    drop_pin_unless(pin_dir, map::EVENT_FLOWS, &mut removed, |info| {
        info.value_size() as usize == std::mem::size_of::<peerwall_common::EventFlow>()
    })?;
    drop_pin_unless(pin_dir, map::FLOWS_NEW, &mut removed, |info| {
        matches!(info.map_type(), Ok(aya::maps::MapType::Array))
            && info.value_size() as usize == std::mem::size_of::<peerwall_common::NewFlowSlot>()
            && info.max_entries() == new_flow_slots
    })?;
    // `FLOW_SEEN` of an older peerwall: one `u16` per entry, not mapped (`SeenLine`), or
    // entries of 32 stamps without the pair stamps. Its programs, while still attached, keep
    // their own copy: the shortcut stays off until none is (`seen.rs`, `arm_flow_seen`), and
    // the load disarms it before attaching anything (`distrust_new_seen`).
    drop_pin_unless(pin_dir, map::FLOW_SEEN, &mut removed, |info| {
        info.value_size() as usize == std::mem::size_of::<peerwall_common::SeenLine>()
            && info.max_entries() == peerwall_common::FLOW_SEEN_LINES
    })?;
    Ok(removed)
}

/// Remove the pin of map `name` under `pin_dir`, if there is one and `fits` refuses its
/// definition; the path removed goes to `removed`.
fn drop_pin_unless(
    pin_dir: &Path,
    name: &str,
    removed: &mut Vec<String>,
    fits: impl Fn(&aya::maps::MapInfo) -> bool,
) -> Result<(), BpfError> {
    let path = pin_dir.join(name);
    if !path.exists() {
        return Ok(());
    }
    let info = MapData::from_pin(&path)
        .and_then(|d| d.info())
        .map_err(map_err(name))?;
    if !fits(&info) {
        std::fs::remove_file(&path).map_err(|source| BpfError::Io {
            path: path.clone(),
            source,
        })?;
        removed.push(path.display().to_string());
    }
    Ok(())
}

/// Remove every pin under `pin_dir` (links first: that detaches the programs), then the dir
/// unless it holds other datapaths' pin directories (left in place).
pub fn remove_pins(pin_dir: &Path) -> Result<Vec<String>, BpfError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BpfError::Io { path, source }
    };
    let mut removed = Vec::new();
    let links = pin_dir.join("links");
    if links.exists() {
        for e in std::fs::read_dir(&links).map_err(io(&links))? {
            let p = e.map_err(io(&links))?.path();
            // Unpinning the link detaches it.
            let l = PinnedLink::from_pin(&p).map_err(|source| BpfError::Link {
                path: p.clone(),
                source,
            })?;
            l.unpin().map_err(|source| BpfError::Io {
                path: p.clone(),
                source,
            })?;
            removed.push(p.display().to_string());
        }
        std::fs::remove_dir(&links).map_err(io(&links))?;
    }
    if pin_dir.exists() {
        let mut others = false;
        for e in std::fs::read_dir(pin_dir).map_err(io(pin_dir))? {
            let p = e.map_err(io(pin_dir))?.path();
            // A directory holds another datapath's pins (the gateway-pod mode keeps each
            // gateway's under `gateways/`): not this one's to remove.
            if p.is_dir() {
                others = true;
                continue;
            }
            std::fs::remove_file(&p).map_err(io(&p))?;
            removed.push(p.display().to_string());
        }
        if !others {
            std::fs::remove_dir(pin_dir).map_err(io(pin_dir))?;
        }
    }
    // The slots' names live beside, under /run (bpffs holds only BPF objects).
    if let Some(meta) = crate::meta::meta_path(pin_dir, 0).parent() {
        match std::fs::remove_dir_all(meta) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(meta)(e)),
            _ => {}
        }
        // And the directories above it that held only it (a non-empty one stays).
        for dir in meta.ancestors().skip(1) {
            if !dir.starts_with(crate::meta::META_ROOT) || std::fs::remove_dir(dir).is_err() {
                break;
            }
        }
    }
    Ok(removed)
}

/// Flip the emergency switch of a pinned datapath without loading anything.
pub fn set_allow_all_pinned(pin_dir: &Path, on: bool) -> Result<(), BpfError> {
    let path = pin_dir.join(map::ALLOW_ALL);
    let data = MapData::from_pin(&path).map_err(|source| BpfError::Map {
        map: path.display().to_string(),
        source,
    })?;
    let map = aya::maps::Map::Array(data);
    let mut m: Array<MapData, u32> = Array::try_from(map).map_err(map_err(map::ALLOW_ALL))?;
    m.set(0, u32::from(on), 0).map_err(map_err(map::ALLOW_ALL))
}

impl super::Datapath {
    /// The kernel memory of every map this datapath's object holds open, pinned or not (the
    /// pins alone are what `peerwall inspect` can see from outside the agent).
    pub fn memory(&self) -> crate::memory::PinnedMemory {
        crate::memory::of_maps(self.ebpf.maps())
    }
}
