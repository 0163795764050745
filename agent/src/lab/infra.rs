//! The lab's machinery: what it must undo (namespaces, processes, pins, directories), the
//! namespaces and children it starts, WireGuard tunnel ends, listeners, shell helpers.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use peerwall_netns::NetNs;

/// Something the lab must undo.
#[derive(Debug)]
pub(super) enum Undo {
    Netns(String),
    Pid(u32),
    Dir(PathBuf),
    Pins(PathBuf),
}

pub(super) type Registry = Arc<Mutex<Vec<Undo>>>;

pub(super) fn undo_all(reg: &Registry) {
    if let Ok(mut g) = reg.lock() {
        undo_items(&mut g);
    }
}

/// Undo everything registered (the caller holds the registry's lock, so nothing new can be
/// started meanwhile).
pub(super) fn undo_items(registered: &mut Vec<Undo>) {
    let items: Vec<Undo> = registered.drain(..).rev().collect();
    // Processes first (agents, wireguard-go, listeners), then namespaces and files.
    for u in &items {
        if let Undo::Pid(pid) = u {
            // SAFETY: plain kill(2) on the process group of a child we started.
            unsafe { libc::kill(-(*pid as i32), libc::SIGTERM) };
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    for u in &items {
        match u {
            Undo::Pid(pid) => {
                // SAFETY: as above.
                unsafe { libc::kill(-(*pid as i32), libc::SIGKILL) };
            }
            Undo::Pins(p) => {
                let _ = peerwall_backend_select::installed::forget_pins(p);
            }
            Undo::Dir(d) => {
                let _ = std::fs::remove_dir_all(d);
            }
            Undo::Netns(n) => {
                let _ = Command::new("ip")
                    .args(["netns", "del", n])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

pub(super) struct Lab {
    pub(super) reg: Registry,
    pub(super) bin: PathBuf,
    pub(super) children: Vec<Child>,
    pub(super) keep: bool,
    pub(super) tag: String,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("--keep: namespaces of lab {} left in place", self.tag);
            return;
        }
        undo_all(&self.reg);
        for c in &mut self.children {
            let _ = c.wait();
        }
    }
}

pub(super) fn sh(program: &str, args: &[&str]) -> Result<String> {
    let o = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !o.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

pub(super) fn wg_keys() -> Result<(String, String)> {
    let private = sh("wg", &["genkey"])?.trim().to_string();
    let mut c = Command::new("wg")
        .arg("pubkey")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("wg pubkey (apt-get install wireguard-tools)")?;
    c.stdin
        .take()
        .context("wg stdin")?
        .write_all(private.as_bytes())?;
    let public = String::from_utf8(c.wait_with_output()?.stdout)?;
    Ok((private, public.trim().to_string()))
}

impl Lab {
    pub(super) fn netns(&self, role: &str) -> Result<NetNs> {
        let ns = NetNs::new(&format!("pwlab-{}", role))?;
        if let Ok(mut g) = self.reg.lock() {
            g.push(Undo::Netns(ns.name().to_string()));
        }
        Ok(ns)
    }

    pub(super) fn spawn(&mut self, mut c: Command) -> Result<()> {
        use std::os::unix::process::CommandExt;
        // Registered under the lock: an interrupt (which takes the lock to clean up, then exits)
        // can never miss a process started concurrently.
        let mut g = self
            .reg
            .lock()
            .map_err(|_| anyhow::anyhow!("lab registry poisoned"))?;
        // Own process group: stopping it stops everything it started (a shell's background
        // wireguard-go, socat's per-connection children).
        let child = c
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {c:?}"))?;
        g.push(Undo::Pid(child.id()));
        drop(g);
        self.children.push(child);
        Ok(())
    }

    /// One end of a WireGuard tunnel: `wireguard-go` plus its configuration, in a private mount
    /// namespace so that its control socket (`/var/run/wireguard/<dev>.sock`, a path shared by
    /// all network namespaces) does not collide with the other gateways' `liqo-tunnel`.
    pub(super) fn tunnel_end(
        &mut self,
        ns: &NetNs,
        dev: &str,
        key: &Path,
        peer: &str,
        endpoint: &str,
        allowed: &str,
    ) -> Result<()> {
        let script = format!(
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard || exit 1
WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1 wireguard-go -f {dev} &
pid=$!
for i in $(seq 200); do [ -S /var/run/wireguard/{dev}.sock ] && break; sleep 0.02; done
wg set {dev} listen-port 51820 private-key {key} peer {peer} endpoint {endpoint} allowed-ips {allowed} || {{ kill $pid; exit 1; }}
wait $pid",
            key = key.display()
        );
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            ns.name(),
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
        ]);
        self.spawn(c)?;
        for _ in 0..250 {
            let configured = in_ns(ns.name(), &["ip", "link", "show", dev], None).is_some();
            if configured {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("wireguard-go did not create {dev} (apt-get install wireguard-go wireguard-tools)")
    }

    pub(super) fn listeners(&mut self, ns: &NetNs, ip: &str) -> Result<()> {
        let mut tcp = Command::new("ip");
        tcp.args([
            "netns",
            "exec",
            ns.name(),
            "socat",
            &format!("TCP4-LISTEN:8080,bind={ip},reuseaddr,fork"),
            "SYSTEM:echo ok",
        ]);
        self.spawn(tcp)?;
        let mut udp = Command::new("ip");
        udp.args([
            "netns",
            "exec",
            ns.name(),
            "socat",
            &format!("UDP4-RECVFROM:9090,bind={ip},fork"),
            // Echo: no program to start per datagram.
            "PIPE",
        ]);
        self.spawn(udp)
    }
}

pub(super) fn in_ns(ns: &str, args: &[&str], stdin: Option<&str>) -> Option<String> {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    let mut child = c.spawn().ok()?;
    if let (Some(input), Some(mut p)) = (stdin, child.stdin.take()) {
        let _ = p.write_all(input.as_bytes());
    }
    let o = child.wait_with_output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}
