//! Writing a whole array map through its memory mapped into the agent (arrays created
//! `BPF_F_MMAPABLE`), else in one system call (`BPF_MAP_UPDATE_BATCH`, Linux 5.6), instead
//! of one `BPF_MAP_UPDATE_ELEM` per index. A slot written whole resets every index of its
//! arrays (`RULES<s>` alone has 65536) and zeroes its per-CPU counters: about 83,000 system
//! calls per load, one by one, which a node with dozens of gateways pays per gateway (`cargo
//! xtask bench-peers`). Kernels without batch operations on arrays get the loop.

use std::os::fd::{AsFd, AsRawFd};

use aya::maps::{Map, MapData};
use aya::Pod;

use super::{map_err, BpfError};

/// `BPF_MAP_UPDATE_BATCH` (`include/uapi/linux/bpf.h`, `enum bpf_cmd`).
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// The `batch` member of the kernel's `union bpf_attr` (`include/uapi/linux/bpf.h`): every
/// field native-endian, pointers as u64, no padding between fields (two u32 after four u64,
/// then two u64). The kernel reads only the first `size_of` bytes it is given.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    /// In: how many elements; out: how many the kernel updated.
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Write `values` (already laid out as the kernel expects them, `per_elem` bytes each) at
/// indices `0..count` of the array behind `fd`. Any failure (a kernel without batch updates
/// on arrays answers EINVAL or ENOTSUPP) leaves the caller to write one index at a time, which
/// names the index that fails.
fn update_batch(
    fd: std::os::fd::BorrowedFd<'_>,
    count: u32,
    values: &[u8],
    per_elem: usize,
) -> Result<(), std::io::Error> {
    if values.len() != per_elem * count as usize {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let keys: Vec<u32> = (0..count).collect();
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count,
        map_fd: fd.as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` is the kernel's batch attribute; its pointers point into `keys` and
    // `values`, which outlive the call and hold `count` elements each; the kernel only reads
    // them (and writes `attr.count`).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_UPDATE_BATCH,
            &mut attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The bytes of `v` (a `Pod`: no padding the kernel could see uninitialised).
fn bytes_of<V: Pod>(v: &V) -> &[u8] {
    // SAFETY: `V: Pod` is plain old data of `size_of::<V>()` bytes.
    unsafe { std::slice::from_raw_parts((v as *const V).cast::<u8>(), std::mem::size_of::<V>()) }
}

/// Write `values` to indices `0..len` of `map`, an array or per-CPU array, in one system
/// call; false where the kernel cannot (the caller then writes one index at a time).
fn batched(map: &Map, name: &str, len: u32, values: &[u8], per_elem: usize) -> bool {
    let (Map::Array(data) | Map::PerCpuArray(data)) = map else {
        return false;
    };
    match update_batch(data.fd().as_fd(), len, values, per_elem) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(map = name, error = %e, "no batch update: one index at a time");
            false
        }
    }
}

/// Write `values` (`per_elem` bytes each, `count` of them) into the array behind `data` through
/// its memory mapped into this process, where the map was created `BPF_F_MMAPABLE`: one copy,
/// no system call per element (the batch update copies and updates index by index, 17 ms for
/// `RULES<s>`' 65536). The kernel lays an mmapable array's values out from offset 0, each
/// `value_size` rounded up to 8 bytes. False where the map is not mmapable or the mapping fails.
fn mapped(data: &MapData, count: u32, values: &[u8], per_elem: usize) -> bool {
    let Ok(info) = data.info() else {
        return false;
    };
    if info.map_flags() & super::mapping::BPF_F_MMAPABLE == 0
        || info.max_entries() != count
        || info.value_size() as usize != per_elem
        || values.len() != per_elem * count as usize
    {
        return false;
    }
    let stride = per_elem.next_multiple_of(8);
    let len = stride * count as usize;
    if len == 0 {
        return true;
    }
    let p = match super::mapping::map_values(data, len, true) {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(error = %e, "no mapping of an mmapable array: a batch update instead");
            return false;
        }
    };
    let base = p.cast::<u8>();
    for (i, v) in values.chunks_exact(per_elem).enumerate() {
        // SAFETY: `i * stride + per_elem <= len`: within the mapping; `v` is `per_elem` bytes
        // of this process's memory, not overlapping the mapping.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), base.add(i * stride), per_elem) };
    }
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(p, len) };
    true
}

/// Set every index of the array map `map` (`name`): `value(i)` at index `i`.
pub(super) fn fill_array<V: Pod>(
    map: &mut Map,
    name: &str,
    value: impl Fn(u32) -> V,
) -> Result<(), BpfError> {
    // The typed view checks the value size against the map's.
    let len = aya::maps::Array::<&mut MapData, V>::try_from(&mut *map)
        .map_err(map_err(name))?
        .len();
    let mut values = Vec::with_capacity(len as usize * std::mem::size_of::<V>());
    for i in 0..len {
        values.extend_from_slice(bytes_of(&value(i)));
    }
    if let Map::Array(data) = &*map {
        if mapped(data, len, &values, std::mem::size_of::<V>()) {
            return Ok(());
        }
    }
    if batched(map, name, len, &values, std::mem::size_of::<V>()) {
        return Ok(());
    }
    let mut typed: aya::maps::Array<&mut MapData, V> =
        aya::maps::Array::try_from(&mut *map).map_err(map_err(name))?;
    for i in 0..len {
        typed.set(i, value(i), 0).map_err(map_err(name))?;
    }
    Ok(())
}

/// Zero every index of the per-CPU array map `map` (`name`) of `V` on each of `ncpus`
/// possible CPUs.
pub(super) fn zero_percpu_array<V: Pod + Default>(
    map: &mut Map,
    name: &str,
    ncpus: usize,
) -> Result<(), BpfError> {
    // The typed view checks the value size against the map's.
    let len = aya::maps::PerCpuArray::<&mut MapData, V>::try_from(&mut *map)
        .map_err(map_err(name))?
        .len();
    // The kernel lays a per-CPU value out as one 8-byte-aligned copy per possible CPU.
    let per_cpu = std::mem::size_of::<V>().next_multiple_of(8);
    let per_elem = per_cpu * ncpus;
    let values = vec![0u8; per_elem * len as usize];
    if batched(map, name, len, &values, per_elem) {
        return Ok(());
    }
    let mut typed: aya::maps::PerCpuArray<&mut MapData, V> =
        aya::maps::PerCpuArray::try_from(&mut *map).map_err(map_err(name))?;
    for i in 0..len {
        let zero =
            aya::maps::PerCpuValues::try_from(vec![V::default(); ncpus]).map_err(|source| {
                BpfError::Io {
                    path: name.into(),
                    source,
                }
            })?;
        typed.set(i, zero, 0).map_err(map_err(name))?;
    }
    Ok(())
}
