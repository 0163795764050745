//! What a pinned link is attached to, as the kernel says: its program and the device it
//! filters (`BPF_OBJ_GET_INFO_BY_FD` on the pin). A link pin outlives its device: when an
//! interface is deleted, the kernel detaches its tcx and XDP links (they report device 0) but
//! their pins stay. So a pin's existence says nothing about enforcement; these reads do.

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::BpfError;

/// `BPF_OBJ_GET` (`include/uapi/linux/bpf.h`, `enum bpf_cmd`).
const BPF_OBJ_GET: libc::c_long = 7;
/// `BPF_OBJ_GET_INFO_BY_FD`.
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// `enum bpf_link_type`: the link kinds whose info starts with the device's ifindex.
const LINK_TYPE_XDP: u32 = 6;
const LINK_TYPE_TCX: u32 = 11;
const LINK_TYPE_NETKIT: u32 = 13;

/// The `BPF_OBJ_GET` member of `union bpf_attr` (native byte order, 24 bytes; the trailing
/// padding is zero as the kernel requires).
#[repr(C, align(8))]
#[derive(Default)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

/// The `info` member of `union bpf_attr` (native byte order, 16 bytes).
#[repr(C, align(8))]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The head of `struct bpf_link_info` (native byte order): `type`, `id`, `prog_id`, 4 bytes of
/// padding (the union that follows is 8-aligned), then the union, whose `xdp`, `tcx` and
/// `netkit` members all start with the device's `ifindex` (0 once the device is gone). 32
/// bytes of the kernel's struct: it fills what fits and leaves the rest.
#[repr(C, align(8))]
#[derive(Default)]
struct LinkInfoHead {
    link_type: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    ifindex: u32,
    attach_type: u32,
    _rest: u64,
}

/// A pinned link as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkState {
    /// The link's id (`bpftool link show id N`).
    pub id: u32,
    /// The program it runs.
    pub prog_id: u32,
    /// The device it filters; `None`: detached (its device is gone), or not a device link.
    pub ifindex: Option<u32>,
}

fn bpf(cmd: libc::c_long, attr: *mut u8, size: usize) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` points to a live, initialised `union bpf_attr` member of `size` bytes
    // that the kernel reads (and for info, the buffer it points to, writes).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The link pinned at `pin`, as the kernel reports it now.
pub fn link_state(pin: &Path) -> Result<LinkState, BpfError> {
    let err = |source: std::io::Error| BpfError::Io {
        path: pin.to_path_buf(),
        source,
    };
    let path = CString::new(pin.as_os_str().as_bytes())
        .map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    let mut get = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        ..Default::default()
    };
    let fd = bpf(
        BPF_OBJ_GET,
        (&mut get as *mut ObjGetAttr).cast(),
        std::mem::size_of::<ObjGetAttr>(),
    )
    .map_err(err)?;
    // SAFETY: BPF_OBJ_GET returned a new file descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut head = LinkInfoHead::default();
    let mut info = InfoAttr {
        bpf_fd: std::os::fd::AsRawFd::as_raw_fd(&fd) as u32,
        info_len: std::mem::size_of::<LinkInfoHead>() as u32,
        info: (&mut head as *mut LinkInfoHead) as u64,
    };
    bpf(
        BPF_OBJ_GET_INFO_BY_FD,
        (&mut info as *mut InfoAttr).cast(),
        std::mem::size_of::<InfoAttr>(),
    )
    .map_err(err)?;
    let device_link = matches!(
        head.link_type,
        LINK_TYPE_XDP | LINK_TYPE_TCX | LINK_TYPE_NETKIT
    );
    Ok(LinkState {
        id: head.id,
        prog_id: head.prog_id,
        ifindex: (device_link && head.ifindex != 0).then_some(head.ifindex),
    })
}

/// Whether any link pinned under `pin_dir` still filters a device that exists (in whichever
/// network namespace): while one does, the datapath still has traffic to judge and its pins
/// must stay. A link whose pin cannot be read counts as attached (fail closed).
pub fn filters_a_device(pin_dir: &Path) -> bool {
    let Ok(dir) = std::fs::read_dir(pin_dir.join("links")) else {
        return false;
    };
    dir.flatten()
        .any(|e| link_state(&e.path()).map_or(true, |s| s.ifindex.is_some()))
}
