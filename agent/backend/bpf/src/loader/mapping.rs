//! An array map's values mapped into the agent (maps created `BPF_F_MMAPABLE`): the kernel lays
//! them out from offset 0, each `value_size` rounded up to 8 bytes. Read or written in place
//! instead of one system call per index.

use std::os::fd::{AsFd, AsRawFd};

use aya::maps::MapData;

/// `BPF_F_MMAPABLE` (`include/uapi/linux/bpf.h`): an array whose values user space can map.
pub(super) const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Map the first `len` bytes of the array behind `d`, shared, writable when `write`. The
/// caller unmaps it (`libc::munmap(p, len)`) and accesses only those bytes.
pub(super) fn map_values(
    d: &MapData,
    len: usize,
    write: bool,
) -> Result<*mut libc::c_void, std::io::Error> {
    let prot = if write {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: a new shared mapping of the map's fd; the kernel checks `len` against the map's
    // values and the protection against the map's flags; no memory of this process is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED,
            d.fd().as_fd().as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p)
}
