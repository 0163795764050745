//! Network namespaces that clean up after themselves, and running code inside them.
//!
//! Used by the nftables verdict engine (a scratch gateway per query), the gateway lab, the
//! tests and the benchmarks.
//! Names are unique per process and call, so parallel users never collide.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Failures creating or using a namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// A command could not be started.
    #[error("could not run {program}: {source}")]
    Spawn {
        /// Program.
        program: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A command failed.
    #[error("`{command}` failed: {stderr}")]
    Failed {
        /// Command line.
        command: String,
        /// Its stderr.
        stderr: String,
    },
    /// An address was added but the kernel did not install its local route in time.
    #[error("{address} on {dev}: no local route after {waited_ms} ms")]
    NotLocal {
        /// Address with prefix length.
        address: String,
        /// Device.
        dev: String,
        /// How long we waited.
        waited_ms: u128,
    },
    /// Entering the namespace failed.
    #[error("entering network namespace {name}: {source}")]
    Enter {
        /// Namespace.
        name: String,
        /// Cause.
        source: std::io::Error,
    },
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Run a command, failing with its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<Output, NetnsError> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| NetnsError::Spawn {
            program: program.to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetnsError::Failed {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out)
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Create `PREFIX-PID-N`, unique in this process.
    pub fn new(prefix: &str) -> Result<Self, NetnsError> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        run("ip", &["netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Leave the namespace in place (no deletion on drop); returns its name.
    pub fn persist(self) -> String {
        let name = self.name.clone();
        std::mem::forget(self);
        name
    }

    /// Name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n NAME ARGS...`.
    pub fn ip(&self, args: &[&str]) -> Result<Output, NetnsError> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// A veth pair, both ends up: `name` here, `peer` in `other`.
    pub fn veth(&self, name: &str, other: &NetNs, peer: &str) -> Result<(), NetnsError> {
        self.veth_down(name, other, peer)?;
        self.ip(&["link", "set", name, "up"])?;
        other.ip(&["link", "set", peer, "up"]).map(|_| ())
    }

    /// [`veth`](Self::veth) with both ends left down (to set what must be set before a link
    /// comes up, such as `addrgenmode`).
    pub fn veth_down(&self, name: &str, other: &NetNs, peer: &str) -> Result<(), NetnsError> {
        self.ip(&[
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            other.name(),
        ])
        .map(|_| ())
    }

    /// Add `address` (with its prefix length) to `dev` without duplicate address detection,
    /// and return once packets to it are delivered locally.
    ///
    /// For IPv6 the kernel inserts an address's local route from its addrconf workqueue, even
    /// with `nodad`: `ip addr add` returns before it, and a packet sent in that window is
    /// routed as if the address did not exist. IPv4 inserts it within the request.
    pub fn add_local_address(&self, address: &str, dev: &str) -> Result<(), NetnsError> {
        const PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
        if !address.contains(':') {
            return self.ip(&["addr", "add", address, "dev", dev]).map(|_| ());
        }
        self.ip(&["addr", "add", address, "dev", dev, "nodad"])?;
        let host = address.split('/').next().unwrap_or(address);
        let started = std::time::Instant::now();
        loop {
            let out = self.ip(&["-6", "route", "show", "table", "local", host, "dev", dev])?;
            if !out.stdout.iter().all(u8::is_ascii_whitespace) {
                return Ok(());
            }
            if started.elapsed() > PATIENCE {
                return Err(NetnsError::NotLocal {
                    address: address.to_string(),
                    dev: dev.to_string(),
                    waited_ms: started.elapsed().as_millis(),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// `ip netns exec NAME PROGRAM ARGS...`.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<Output, NetnsError> {
        let mut full = vec!["netns", "exec", self.name.as_str(), program];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// Set a sysctl inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<(), NetnsError> {
        self.exec("sysctl", &["-q", "-w", &format!("{key}={value}")])
            .map(|_| ())
    }

    /// Run `f` on a thread that has entered this namespace (sockets it opens live there).
    pub fn run_in<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, NetnsError> {
        let path = format!("/run/netns/{}", self.name);
        let name = self.name.clone();
        let file = File::open(&path).map_err(|source| NetnsError::Enter {
            name: name.clone(),
            source,
        })?;
        let handle = std::thread::spawn(move || {
            // SAFETY: setns on a valid namespace fd affects only this (new) thread.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        });
        match handle.join() {
            Ok(r) => r.map_err(|source| NetnsError::Enter { name, source }),
            Err(_) => Err(NetnsError::Enter {
                name,
                source: std::io::Error::other("thread panicked"),
            }),
        }
    }
}

/// This thread inside a namespace ([`NetNs::enter`]); back in the namespace it came from on
/// drop.
#[derive(Debug)]
pub struct Entered {
    back: File,
}

impl Drop for Entered {
    fn drop(&mut self) {
        // SAFETY: setns on a valid namespace fd affects only this thread. Failing to return
        // cannot be reported from drop; the thread would stay inside, so it is stopped rather
        // than left to act in the wrong namespace.
        if unsafe { libc::setns(self.back.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            panic!(
                "could not return to the thread's network namespace: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

impl NetNs {
    /// Move the calling thread into this namespace until the guard is dropped (then back).
    /// For a syscall whose namespace is the caller's (BPF_PROG_TEST_RUN runs a tc program on
    /// the caller's namespace's loopback device); only this thread moves.
    pub fn enter(&self) -> Result<Entered, NetnsError> {
        let err = |source| NetnsError::Enter {
            name: self.name.clone(),
            source,
        };
        let back = File::open("/proc/thread-self/ns/net").map_err(err)?;
        let target = File::open(format!("/run/netns/{}", self.name)).map_err(err)?;
        // SAFETY: setns on a valid namespace fd affects only this thread.
        if unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(Entered { back })
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
