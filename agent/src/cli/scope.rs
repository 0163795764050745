//! Where a command that touches this host acts, and what it finds there.
//!
//! - The network namespace is the one the command runs in, or `--netns NAME` ([`enter_netns`]).
//! - bpf pins go to the host's bpffs however the command was started ([`host_bpffs`]):
//!   `ip netns exec` gives it a private mount namespace with a fresh `/sys`, where a bpffs
//!   mounted by peerwall (and every pin in it, and so every program attachment) vanishes when
//!   the command exits. The command moves to the host's mount namespace instead, or refuses.
//! - Commands acting on "what is installed here" (allow-all, delete, counters, inspect,
//!   observe) find out which backend that is (`peerwall_backend_select::installed`) instead
//!   of assuming one.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};

use super::{input, runtime, BackendKind, CliError};

/// Move this process (and the `nft` it runs) into network namespace `ns`: an `ip netns` name
/// or a path to a namespace file (`/proc/<pid>/ns/net`).
pub(super) fn enter_netns(ns: &str) -> Result<(), CliError> {
    let path = if ns.starts_with('/') {
        PathBuf::from(ns)
    } else {
        PathBuf::from("/run/netns").join(ns)
    };
    let f = std::fs::File::open(&path)
        .with_context(|| {
            format!(
                "--netns {ns}: opening network namespace {} (`ip netns list` shows the names)",
                path.display()
            )
        })
        .map_err(input)?;
    // SAFETY: setns on a valid namespace descriptor; affects this thread, which is the only one.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(runtime(anyhow!(
            "--netns {ns}: entering network namespace {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    tracing::debug!(netns = ns, "entered network namespace");
    Ok(())
}

/// The nearest existing directory of `path` (what a pin directory will be created under).
fn existing_ancestor(path: &Path) -> &Path {
    path.ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"))
}

/// The mount namespace of a process, as its `ns` link reads (`mnt:[4026531841]`).
fn mount_ns(pid: u32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok()
}

/// The parent of a process (`/proc/<pid>/stat`'s fourth field).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (second field) is in parentheses and may hold spaces: read after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The process whose mount namespace this command should use for pins, when it is not its
/// own: PID 1's (the host's) when readable, else the nearest ancestor's that differs (the
/// shell that ran `ip netns exec`, where PID 1 hides its namespaces). None: this command runs
/// in that namespace already, or nothing tells.
fn outer_mount_ns() -> Option<u32> {
    let own = mount_ns(std::process::id())?;
    if let Some(host) = mount_ns(1) {
        return (host != own).then_some(1);
    }
    let mut pid = std::process::id();
    while let Some(parent) = parent_of(pid).filter(|p| *p > 1) {
        match mount_ns(parent) {
            Some(ns) if ns != own => return Some(parent),
            Some(_) => pid = parent,
            None => return None,
        }
    }
    None
}

/// Make sure pins under `pin_dir` land where they outlive this command: on a bpffs of the
/// host's mount namespace. In a private mount namespace without bpffs there (`ip netns exec`),
/// move to the host's (PID 1's) mount namespace, where bpffs is (or, with `create`, will be
/// mounted); refuse (exit 2) when that is not possible.
/// Call before any other thread exists (entering a mount namespace requires it) and after
/// relative input paths were read (the working directory is restored when it exists there).
/// `create`: the command pins (apply); without it, a host without bpffs simply has nothing
/// pinned.
pub(super) fn host_bpffs(pin_dir: &Path, create: bool) -> Result<(), CliError> {
    if peerwall_backend_select::is_bpffs(existing_ancestor(pin_dir)) {
        return Ok(());
    }
    let Some(outer) = outer_mount_ns() else {
        // The host's own mount namespace (or nothing to compare): bpffs mounted here stays.
        return Ok(());
    };
    let outer_root = PathBuf::from(format!("/proc/{outer}/root"));
    let host_view = outer_root.join(pin_dir.strip_prefix("/").unwrap_or(pin_dir));
    let private = format!(
        "this command runs in a private mount namespace (as `ip netns exec` makes) where {} is \
         not on a bpf filesystem: pins made here would vanish when it exits, and the datapath \
         with them",
        existing_ancestor(pin_dir).display()
    );
    if !create && !peerwall_backend_select::is_bpffs(existing_ancestor(&host_view)) {
        // The host has no bpffs: nothing is pinned anywhere, nothing to find there.
        return Ok(());
    }
    let cwd = std::env::current_dir().ok();
    let f = std::fs::File::open(format!("/proc/{outer}/ns/mnt"))
        .with_context(|| format!("{private}; opening the mount namespace of process {outer}"))
        .map_err(input)?;
    // SAFETY: setns on a valid mount-namespace descriptor; the process is single-threaded.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNS) } != 0 {
        return Err(input(anyhow!(
            "{private}; entering the mount namespace of process {outer} failed ({}). Run `peerwall … \
             --netns NAME` or `nsenter --net=/run/netns/NAME peerwall …` instead",
            std::io::Error::last_os_error()
        )));
    }
    if let Some(cwd) = cwd {
        // Entering a mount namespace resets the working directory to its root.
        let _ = std::env::set_current_dir(cwd);
    }
    tracing::info!(
        pin_dir = %pin_dir.display(),
        mount_ns_of = outer,
        "pins go to the outer mount namespace: this command was started in a private one (ip netns exec)"
    );
    Ok(())
}

/// The backends a command acts on: the one asked for when it is installed, else every one
/// found. Nothing to act on is bad input (exit 2) naming what was looked for.
pub(super) fn backends_to_act_on(
    asked: Option<BackendKind>,
    pin_dir: &Path,
    what: &str,
) -> Result<Vec<BackendKind>, CliError> {
    let found = peerwall_backend_select::installed(pin_dir);
    let chosen: Vec<BackendKind> = match asked {
        Some(b) => found.backends().into_iter().filter(|f| *f == b).collect(),
        None => found.backends(),
    };
    if chosen.is_empty() {
        let asked = asked.map_or(String::new(), |b| format!(" for --backend {b}"));
        return Err(input(anyhow!(
            "nothing to {what}{asked}: found {} (is this the gateway's network namespace? \
             `--netns NAME` acts in another one)",
            found.describe(pin_dir)
        )));
    }
    tracing::info!(found = %found.describe(pin_dir), "installed here");
    Ok(chosen)
}
