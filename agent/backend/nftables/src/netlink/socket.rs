//! The socket edge: a `NETLINK_NETFILTER` socket in this network namespace or a named one
//! (`ip netns`), one batch sent, the kernel's answers read.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::message::{answers, Answer};

/// `NETLINK_NETFILTER`.
const NETLINK_NETFILTER: libc::c_int = 12;
/// How long the kernel may take to answer a batch.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// A netfilter netlink socket.
pub struct Socket(OwnedFd);

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// A `NETLINK_NETFILTER` socket in this thread's network namespace.
pub(crate) fn netfilter_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(last_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Socket {
    /// A socket in this thread's network namespace.
    fn here() -> std::io::Result<Self> {
        let sock = Self(netfilter_socket()?);
        let timeout = libc::timeval {
            tv_sec: ANSWER_WITHIN.as_secs() as libc::time_t,
            tv_usec: 0,
        };
        // SAFETY: `timeout` is a valid timeval of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                sock.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(last_error());
        }
        Ok(sock)
    }

    /// A socket in the network namespace `netns` names (`/run/netns/<name>`), or in this
    /// thread's when None. A socket stays in the namespace it was made in: a short-lived
    /// thread enters the namespace, makes it, and ends.
    pub fn open(netns: Option<&str>) -> std::io::Result<Self> {
        let Some(name) = netns else {
            return Self::here();
        };
        let ns = std::fs::File::open(std::path::Path::new("/run/netns").join(name))?;
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on a valid namespace fd; it changes only this thread.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(last_error());
                }
                Self::here()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("netlink socket thread panicked")))
        })
    }

    /// Send `bytes` whole.
    pub fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        // SAFETY: `bytes` is a live buffer of the length passed.
        let sent = unsafe { libc::send(self.0.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        if sent < 0 {
            return Err(last_error());
        }
        if sent as usize != bytes.len() {
            return Err(std::io::Error::other(format!(
                "netlink took {sent} of {} bytes",
                bytes.len()
            )));
        }
        Ok(())
    }

    /// Receive one datagram into `buf` (waiting at most the socket's answer time); its length.
    pub fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: `buf` is a live, writable buffer of the length passed.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(last_error());
        }
        Ok(n as usize)
    }

    /// Send `batch` and wait for the answers to the messages numbered `acked`: Ok when each
    /// was acknowledged; the first error otherwise (the kernel then applied none of the
    /// batch).
    pub fn transact(&self, batch: &[u8], acked: &[u32]) -> std::io::Result<()> {
        self.send(batch)?;
        let mut waiting: std::collections::BTreeSet<u32> = acked.iter().copied().collect();
        let mut buf = vec![0u8; 64 * 1024];
        while !waiting.is_empty() {
            // SAFETY: `buf` is a live, writable buffer of the length passed.
            let n =
                unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(last_error());
            }
            let got = answers(&buf[..n as usize])
                .ok_or_else(|| std::io::Error::other("netlink answer cut short"))?;
            for Answer { seq, error } in got {
                // Only this batch's answers count (a kept socket may hold none other, but a
                // stray one must not fail or complete this batch).
                if !waiting.remove(&seq) {
                    continue;
                }
                if error != 0 {
                    return Err(std::io::Error::from_raw_os_error(-error));
                }
            }
        }
        Ok(())
    }
}
