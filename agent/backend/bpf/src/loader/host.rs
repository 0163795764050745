//! The host side: its interfaces (name, index, link-layer length) and the bpf filesystem.

use std::ffi::CStr;
use std::path::{Path, PathBuf};

use super::BpfError;

/// An interface of this network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIface {
    /// Name.
    pub name: String,
    /// Index.
    pub ifindex: u32,
    /// Bytes before the IP header: 14 for Ethernet, 0 for L3 devices (WireGuard, TUN).
    pub l2_len: u32,
}

/// Interfaces of the calling thread's network namespace (netlink via `if_nameindex`, device
/// type via `SIOCGIFHWADDR`), so it works on a thread that entered another namespace.
pub fn host_ifaces() -> std::io::Result<Vec<HostIface>> {
    // SAFETY: if_nameindex returns a heap array terminated by a zero entry, freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        // SAFETY: within the array until the terminating entry.
        let e = unsafe { &*list.add(i) };
        if e.if_index == 0 || e.if_name.is_null() {
            break;
        }
        // SAFETY: if_name is a NUL-terminated string owned by the array.
        let name = unsafe { CStr::from_ptr(e.if_name) }
            .to_string_lossy()
            .into_owned();
        out.push((name, e.if_index));
        i += 1;
    }
    // SAFETY: `list` came from if_nameindex.
    unsafe { libc::if_freenameindex(list) };
    // SAFETY: plain socket(2) call for the ioctl below; closed on drop via OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut ifaces = Vec::new();
    for (name, ifindex) in out {
        // SAFETY: ifreq is plain old data; zeroed is a valid start.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes().take(15)) {
            *d = s as libc::c_char;
        }
        // SAFETY: SIOCGIFHWADDR fills ifr_hwaddr of a valid ifreq.
        let rc = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                libc::SIOCGIFHWADDR,
                &mut req,
            )
        };
        // SAFETY: the union member ifru_hwaddr is what SIOCGIFHWADDR wrote.
        let family = unsafe { req.ifr_ifru.ifru_hwaddr.sa_family };
        let l2_len = if rc == 0 && family == libc::ARPHRD_ETHER {
            14
        } else {
            0
        };
        ifaces.push(HostIface {
            name,
            ifindex,
            l2_len,
        });
    }
    Ok(ifaces)
}

/// Interfaces whose names match a pattern (`name`, or `prefix*`).
pub fn matching<'a>(ifaces: &'a [HostIface], patterns: &[String]) -> Vec<&'a HostIface> {
    ifaces
        .iter()
        .filter(|i| {
            patterns.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => i.name.starts_with(prefix),
                None => i.name == *p,
            })
        })
        .collect()
}

/// Whether `path` lies on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    // SAFETY: statfs on a NUL-terminated path into a zeroed struct.
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    rc == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

/// Make sure `/sys/fs/bpf` is a bpf filesystem (mounting it when absent); returns it.
pub fn ensure_bpffs() -> Result<PathBuf, BpfError> {
    let root = PathBuf::from("/sys/fs/bpf");
    if is_bpffs(&root) {
        return Ok(root);
    }
    std::fs::create_dir_all(&root).map_err(|source| BpfError::Io {
        path: root.clone(),
        source,
    })?;
    let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
    let (src, target, fstype) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
    // SAFETY: mount(2) with NUL-terminated strings and no data.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 || !is_bpffs(&root) {
        return Err(BpfError::NoBpffs(root));
    }
    tracing::info!("mounted bpffs on /sys/fs/bpf");
    Ok(root)
}
