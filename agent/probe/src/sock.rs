//! Minimal packet sockets: AF_PACKET taps/injectors bound to one interface, and raw IP
//! sockets that see what the local stack accepts (after the input hook).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Frame direction as reported by AF_PACKET.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Received by the interface.
    Incoming,
    /// Sent by this host.
    Outgoing,
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// An AF_PACKET socket bound to one interface (all protocols).
#[derive(Debug)]
pub struct LinkSocket {
    fd: OwnedFd,
    ifindex: i32,
}

impl LinkSocket {
    /// Open and bind to `ifindex` (in the calling thread's network namespace).
    pub fn bind(ifindex: i32) -> io::Result<Self> {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2) call; the fd is owned immediately.
        let raw = cvt(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                i32::from(proto),
            )
        })?;
        // SAFETY: `raw` is a fresh, valid descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_ll is plain old data; zero is a valid initial state.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex;
        // SAFETY: the pointer and length describe `sll`, which outlives the call.
        cvt(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        })?;
        Ok(Self { fd, ifindex })
    }

    /// Transmit a complete Ethernet frame out of the interface.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: the buffer is valid for `frame.len()` bytes.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receive one frame if one is queued.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<(usize, Direction)>> {
        // SAFETY: zeroed sockaddr_ll is valid; recvfrom writes at most `len` bytes of it.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes; `sll`/`len` as above.
        let n = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
                std::ptr::addr_of_mut!(sll).cast(),
                &mut len,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            };
        }
        let dir = if sll.sll_pkttype == libc::PACKET_OUTGOING {
            Direction::Outgoing
        } else {
            Direction::Incoming
        };
        Ok(Some((n as usize, dir)))
    }

    /// Interface index.
    pub fn ifindex(&self) -> i32 {
        self.ifindex
    }
}

/// A raw IP socket for one protocol: receives copies of packets delivered locally.
/// IPv4 raw sockets return the IP header; IPv6 raw sockets return only the payload.
#[derive(Debug)]
pub struct RawIpSocket {
    fd: OwnedFd,
    /// Whether this is an IPv6 socket.
    pub v6: bool,
}

impl RawIpSocket {
    /// Open for `proto` in the calling thread's namespace.
    pub fn open(v6: bool, proto: u8) -> io::Result<Self> {
        let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
        // SAFETY: plain socket(2) call; the fd is owned immediately.
        let raw = cvt(unsafe {
            libc::socket(
                family,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                i32::from(proto),
            )
        })?;
        // SAFETY: fresh descriptor owned by nobody else.
        Ok(Self {
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
            v6,
        })
    }

    /// Receive one packet if queued.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            };
        }
        Ok(Some(n as usize))
    }
}
