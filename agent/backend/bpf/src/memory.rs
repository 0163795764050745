//! The kernel memory a pinned datapath holds: the sum of its maps' `memlock`, as the kernel
//! reports it for each map fd (`/proc/self/fdinfo`, the figure `bpftool map show` prints).
//! One pin directory is one datapath (one gateway in the DaemonSet's gateway-pods mode), so this
//! is what each gateway costs the node, whether or not traffic fills its tables (most of them
//! are preallocated).

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use aya::maps::MapData;
use serde::Serialize;

use crate::error::BpfError;

/// The memory of the maps pinned in one directory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PinnedMemory {
    /// Bytes of kernel memory charged to them (`memlock`).
    pub bytes: u64,
    /// Maps counted.
    pub maps: usize,
    /// The largest maps, by name, with their bytes (at most five, largest first).
    pub largest: Vec<(String, u64)>,
}

/// The five largest of `all` (name, bytes), largest first, names breaking ties.
fn largest(mut all: Vec<(String, u64)>) -> Vec<(String, u64)> {
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(5);
    all
}

/// `memlock` of a map, from its fd's fdinfo.
fn memlock(map: &MapData) -> Option<u64> {
    let fd = map.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The memory of the maps pinned directly in `pin_dir` (not its subdirectories: other
/// gateways' datapaths). Pins that are not maps (programs, links) are skipped.
pub fn pinned_memory(pin_dir: &Path) -> Result<PinnedMemory, BpfError> {
    let dir = std::fs::read_dir(pin_dir).map_err(|source| BpfError::Io {
        path: pin_dir.to_path_buf(),
        source,
    })?;
    let mut m = PinnedMemory::default();
    let mut all = Vec::new();
    for e in dir.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let Ok(map) = MapData::from_pin(e.path()) else {
            continue;
        };
        if let Some(b) = memlock(&map) {
            m.bytes += b;
            m.maps += 1;
            all.push((e.file_name().to_string_lossy().into_owned(), b));
        }
    }
    m.largest = largest(all);
    Ok(m)
}

/// The memory of `maps` (name, map), by the same `memlock` figure: every map a loaded
/// datapath holds, pinned or not ([`crate::loader::Datapath::memory`]).
pub fn of_maps<'a>(maps: impl Iterator<Item = (&'a str, &'a aya::maps::Map)>) -> PinnedMemory {
    use aya::maps::Map;
    let mut m = PinnedMemory::default();
    let mut all = Vec::new();
    for (name, map) in maps {
        let data = match map {
            Map::Array(d)
            | Map::PerCpuArray(d)
            | Map::HashMap(d)
            | Map::PerCpuHashMap(d)
            | Map::LruHashMap(d)
            | Map::PerCpuLruHashMap(d)
            | Map::LpmTrie(d)
            | Map::RingBuf(d)
            | Map::ProgramArray(d) => d,
            _ => continue,
        };
        if let Some(b) = memlock(data) {
            m.bytes += b;
            m.maps += 1;
            all.push((name.to_string(), b));
        }
    }
    m.largest = largest(all);
    m
}

/// The memory of every BPF map loaded on the node (all network namespaces, all owners, pinned
/// or held only by a process's or a program's reference), by the same `memlock` figure: what
/// a pin directory's sum cannot show, the maps nobody pinned (a program's per-CPU scratch, a
/// table the agent created and holds open). Maps that go away while being read are skipped.
pub fn node_memory() -> PinnedMemory {
    let mut m = PinnedMemory::default();
    let mut all = Vec::new();
    for info in aya::maps::loaded_maps().flatten() {
        let Ok(map) = MapData::from_id(info.id()) else {
            continue;
        };
        if let Some(b) = memlock(&map) {
            m.bytes += b;
            m.maps += 1;
            let name = info.name_as_str().unwrap_or("?").to_string();
            all.push((name, b));
        }
    }
    m.largest = largest(all);
    m
}

/// `12.3 MiB in 57 maps (largest: FLOWS_NEW 4.0 MiB, …)`.
pub fn text(m: &PinnedMemory) -> String {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let largest: Vec<String> = m
        .largest
        .iter()
        .map(|(n, b)| format!("{n} {:.1} MiB", mib(*b)))
        .collect();
    format!(
        "{:.1} MiB in {} maps (largest: {})",
        mib(m.bytes),
        m.maps,
        largest.join(", ")
    )
}
