//! The route watcher: the pinned `LOCAL` trie and `ROUTES` lease kept in step with the
//! namespace's routing. It subscribes to rtnetlink's link, address, route, rule, netconf and
//! nexthop notifications before its first dump (nothing changes unseen between the two), then
//! re-reads the whole state after every notification (a few dumps, well under a millisecond
//! on a gateway) and every 5 s anyway, and renews the lease every
//! [`routes::RENEW_NS`]. Changing the mirror's prefixes, it first withdraws the lease, so the
//! datapath asks the FIB while the trie is rewritten; stopping, it withdraws it for good. A
//! second process on the same pins (a one-shot `peerwall apply` beside the agent) leaves the
//! maps to the lease's holder while the lease holds, and takes over once it runs out.
//!
//! The sockets are opened in the namespace of the thread that calls [`RouteWatch::start`]
//! (a netlink socket stays in the namespace it was made in), and the watcher's thread reads
//! them from anywhere.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{Array, Map, MapData};
use ipnet::IpNet;
use peerwall_common::{map, routes, AddrKeyData, RouteMirror};

use super::rtnl::{self, Message};
use super::{mirror, Closed, Family, Snapshot};
use crate::error::map_err;
use crate::loader::{addr_key, ktime_ns as monotonic_ns};
use crate::BpfError;

/// A full re-read even without notifications (one missed would otherwise last).
const RESYNC: Duration = Duration::from_secs(5);
/// How long the thread waits for a notification before renewing and checking for stop.
const TICK_MS: i32 = 100;

/// The running watcher; dropping it stops the thread and withdraws the lease.
#[derive(Debug)]
pub struct RouteWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RouteWatch {
    /// Mirror the current namespace's routing into the maps pinned in `pin_dir`: the first
    /// sync now (its failure is returned), then a thread keeps it current.
    pub fn start(pin_dir: &Path) -> Result<Self, BpfError> {
        let io_err = |source| BpfError::Io {
            path: PathBuf::from("rtnetlink"),
            source,
        };
        let events = Socket::open(&rtnl::GROUPS).map_err(io_err)?;
        let dump = Socket::open(&[]).map_err(io_err)?;
        let mut state = Mirror::open(pin_dir)?;
        state.sync(&dump)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("route-watch".into())
            .spawn(move || watch(&events, &dump, &mut state, &flag))
            .map_err(io_err)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for RouteWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: sync on notifications and every [`RESYNC`], renew the lease, withdraw it on
/// stop.
fn watch(events: &Socket, dump: &Socket, state: &mut Mirror, stop: &AtomicBool) {
    let mut synced = Instant::now();
    let mut renewed = Instant::now();
    let renew_every = Duration::from_nanos(routes::RENEW_NS);
    while !stop.load(Ordering::Relaxed) {
        let changed = match events.drain(TICK_MS) {
            Ok(n) => n > 0,
            // ENOBUFS: notifications were lost; read everything again.
            Err(e) => {
                tracing::debug!(error = %e, "route notifications lost; reading the routing state again");
                true
            }
        };
        // Not holding the maps: another watcher's lease; take them over once it runs out.
        if changed || synced.elapsed() >= RESYNC || !state.holding {
            if let Err(e) = state.sync(dump) {
                tracing::warn!(error = %e, "cannot read the routing state: the datapath asks the FIB");
                let _ = state.withdraw();
            }
            synced = Instant::now();
            renewed = synced;
        } else if renewed.elapsed() >= renew_every {
            if let Err(e) = state.renew() {
                tracing::warn!(error = %e, "cannot renew the route mirror's lease");
            }
            renewed = Instant::now();
        }
    }
    if let Err(e) = state.withdraw() {
        tracing::warn!(error = %e, "cannot withdraw the route mirror's lease");
    }
}

/// The maps, the token this watcher writes its lease under, and what it last logged.
struct Mirror {
    local: LpmTrie<MapData, AddrKeyData, u32>,
    lease: Array<MapData, RouteMirror>,
    token: u32,
    families: u32,
    /// The last sync wrote the maps (no other watcher held them).
    holding: bool,
    /// Why each family was last closed (None: open), for logging changes only.
    last: [Option<Option<Closed>>; 2],
}

impl Mirror {
    fn open(pin_dir: &Path) -> Result<Self, BpfError> {
        let open = |name: &str| {
            MapData::from_pin(pin_dir.join(name)).map_err(|source| BpfError::Map {
                map: name.to_string(),
                source,
            })
        };
        let local =
            LpmTrie::try_from(Map::LpmTrie(open(map::LOCAL)?)).map_err(map_err(map::LOCAL))?;
        let lease =
            Array::try_from(Map::Array(open(map::ROUTES)?)).map_err(map_err(map::ROUTES))?;
        Ok(Self {
            local,
            lease,
            token: (std::process::id().rotate_left(16) ^ monotonic_ns() as u32) | 1,
            families: 0,
            holding: false,
            last: [None, None],
        })
    }

    /// Whether another watcher (a second process on the same pins) holds a live lease: this
    /// one then leaves the maps alone until it runs out or is withdrawn.
    fn someone_else_holds(&self) -> Result<bool, BpfError> {
        let l = self.lease.get(&0, 0).map_err(map_err(map::ROUTES))?;
        Ok(l.owner != self.token && l.families != 0 && l.until_ns > monotonic_ns())
    }

    /// Read the routing state and write the mirror (unless another watcher holds it).
    fn sync(&mut self, dump: &Socket) -> Result<(), BpfError> {
        self.holding = false;
        if self.someone_else_holds()? {
            return Ok(());
        }
        self.holding = true;
        let mut families = 0;
        let mut want = BTreeSet::new();
        for (family, bit) in [(Family::V4, routes::V4), (Family::V6, routes::V6)] {
            let snap = snapshot(dump, family).map_err(|source| BpfError::Io {
                path: PathBuf::from(format!("rtnetlink {family} dump")),
                source,
            })?;
            let verdict = mirror(&snap);
            self.log_change(family, &verdict);
            if let Ok(prefixes) = verdict {
                families |= bit;
                want.extend(prefixes);
            }
        }
        // What the trie holds, read back rather than remembered: whatever wrote it last (an
        // earlier agent, a hand with bpftool) is corrected here.
        let keys: Vec<_> = self.local.keys().filter_map(Result::ok).collect();
        let have: BTreeSet<IpNet> = keys.iter().filter_map(prefix_of).collect();
        if have != want || keys.len() != have.len() {
            self.withdraw()?;
            for k in keys
                .iter()
                .filter(|k| prefix_of(k).is_none_or(|p| !want.contains(&p)))
            {
                let _ = self.local.remove(k);
            }
            for new in want.difference(&have) {
                self.local
                    .insert(&addr_key(0, new), 1, 0)
                    .map_err(map_err(map::LOCAL))?;
            }
        }
        self.families = families;
        self.renew()
    }

    /// Write the lease for the families open now, for [`routes::LEASE_NS`] from now.
    fn renew(&mut self) -> Result<(), BpfError> {
        if self.someone_else_holds()? {
            return Ok(());
        }
        let lease = RouteMirror {
            families: self.families,
            owner: self.token,
            until_ns: if self.families == 0 {
                0
            } else {
                monotonic_ns() + routes::LEASE_NS
            },
        };
        self.lease.set(0, lease, 0).map_err(map_err(map::ROUTES))
    }

    /// No family's path from the mirror (only a lease of this watcher's own is withdrawn).
    fn withdraw(&mut self) -> Result<(), BpfError> {
        if self.someone_else_holds()? {
            return Ok(());
        }
        self.lease
            .set(0, RouteMirror::default(), 0)
            .map_err(map_err(map::ROUTES))
    }

    fn log_change(&mut self, family: Family, verdict: &Result<Vec<IpNet>, Closed>) {
        let i = usize::from(family == Family::V6);
        let now = verdict.as_ref().err().cloned();
        if self.last[i].as_ref() == Some(&now) {
            return;
        }
        match &now {
            None => {
                tracing::info!(%family, "packet paths from the local-address mirror (no FIB lookup)")
            }
            Some(why) => tracing::info!(%family, reason = %why, "packet paths from the FIB"),
        }
        self.last[i] = Some(now);
    }
}

/// The prefix a `LOCAL` key stands for (None: not one the watcher writes).
pub(crate) fn prefix_of(k: &aya::maps::lpm_trie::Key<AddrKeyData>) -> Option<IpNet> {
    let d = k.data();
    let len = k
        .prefix_len()
        .checked_sub(peerwall_common::ADDR_KEY_FIXED_BITS)?;
    if d.chain != [0; 4] {
        return None;
    }
    let addr: std::net::IpAddr = match u32::from_be_bytes(d.family) {
        f if f == u32::from(peerwall_common::family::V4) => {
            std::net::Ipv4Addr::new(d.addr[0], d.addr[1], d.addr[2], d.addr[3]).into()
        }
        f if f == u32::from(peerwall_common::family::V6) => std::net::Ipv6Addr::from(d.addr).into(),
        _ => return None,
    };
    let net = IpNet::new(addr, u8::try_from(len).ok()?).ok()?;
    // A key with host bits set is not one the watcher wrote.
    (net.trunc() == net && addr_key(0, &net).data().addr == d.addr).then_some(net)
}

/// Routes, rules and forwarding of `family`.
fn snapshot(dump: &Socket, family: Family) -> io::Result<Snapshot> {
    let mut s = Snapshot::default();
    for kind in [
        rtnl::msg::GETROUTE,
        rtnl::msg::GETRULE,
        rtnl::msg::GETNETCONF,
    ] {
        for m in dump.dump(kind, family)? {
            match m {
                Message::Route(f, r) if f == family => s.routes.push(r),
                Message::Rule(f, r) if f == family => s.rules.push(r),
                Message::Forwarding(f, x) if f == family => s.forwarding.push(x),
                _ => {}
            }
        }
    }
    Ok(s)
}

/// A `NETLINK_ROUTE` socket of the calling thread's namespace.
struct Socket {
    fd: OwnedFd,
    seq: std::cell::Cell<u32>,
}

impl Socket {
    /// Open one, a member of `groups` (none: for dumps).
    fn open(groups: &[u32]) -> io::Result<Self> {
        // SAFETY: plain socket(2); the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned by socket(2), owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; zeroed is its unbound value.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: `sa` is a sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        for g in groups {
            // SAFETY: `g` is a u32, the option's type.
            let rc = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_NETLINK,
                    libc::NETLINK_ADD_MEMBERSHIP,
                    (g as *const u32).cast(),
                    4,
                )
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(Self {
            fd,
            seq: std::cell::Cell::new(1),
        })
    }

    /// Dump `kind` of `family`: every message until `NLMSG_DONE`.
    fn dump(&self, kind: u16, family: Family) -> io::Result<Vec<Message>> {
        let seq = self.seq.get().wrapping_add(1);
        self.seq.set(seq);
        let req = rtnl::dump_request(kind, family, seq);
        // SAFETY: `req` is a readable buffer of its length.
        let rc = unsafe { libc::send(self.fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = self.recv(&mut buf, 0)?;
            let msgs = rtnl::parse(&buf[..n]).map_err(io::Error::other)?;
            let done = msgs.contains(&Message::Done);
            out.extend(msgs.into_iter().filter(|m| *m != Message::Done));
            if done || n == 0 {
                return Ok(out);
            }
        }
    }

    /// Wait up to `timeout_ms` for notifications, then read all that are queued; how many
    /// datagrams were read.
    fn drain(&self, timeout_ms: i32) -> io::Result<usize> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc <= 0 {
            return Ok(0);
        }
        let mut buf = vec![0u8; 1 << 16];
        let mut n = 0;
        loop {
            match self.recv(&mut buf, libc::MSG_DONTWAIT) {
                Ok(_) => n += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(n),
                Err(e) => return Err(e),
            }
        }
    }

    fn recv(&self, buf: &mut [u8], flags: i32) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is writable for its length.
            let rc = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    flags,
                )
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}
