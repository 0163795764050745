//! Putting `peerwall-boot` into the node's CNI chain, keeping it there, and taking it out
//! (the files of the node; the DaemonSet mounts the runtime's CNI directories at the same
//! paths).
//!
//! Chaining a plugin that cannot run on the node would fail every pod's sandbox there, so
//! the binary is first run as the runtime will run it: in the node's mount namespace (the
//! node's libraries), with `CNI_COMMAND=VERSION`; and `nft`, which it runs, is looked for
//! there too. Either failing leaves the chain untouched and says why.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use super::chain::{self, ChainError, PLUGIN};

/// Where the runtime's CNI files are, and which pods get the boot policy.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The runtime's CNI binary directory (`/opt/cni/bin`).
    pub bin_dir: PathBuf,
    /// The runtime's CNI configuration directory (`/etc/cni/net.d`).
    pub conf_dir: PathBuf,
    /// Pod name prefixes whose sandboxes get the boot policy (Liqo's gateways: `gw-`).
    pub pod_name_prefixes: Vec<String>,
    /// The node's mount namespace, where the check runs: with `hostPID`, that of the
    /// agent's parent, the container runtime's shim (`/proc/<ppid>/ns/mnt`).
    pub host_mnt: PathBuf,
}

/// Why the plugin is not in the chain.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The configuration cannot take it.
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// A file could not be read or written.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The plugin, or `nft`, does not run on the node.
    #[error("{what} does not run on the node (in its mount namespace {}): {why}", mnt.display())]
    NotOnNode {
        /// What was run.
        what: String,
        /// The node's mount namespace.
        mnt: PathBuf,
        /// What happened.
        why: String,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> InstallError + 'a {
    move |source| InstallError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

impl Settings {
    /// The plugin's binary on the node.
    pub fn binary(&self) -> PathBuf {
        self.bin_dir.join(PLUGIN)
    }

    /// The configuration file the runtime uses now.
    fn file_in_force(&self) -> Result<PathBuf, InstallError> {
        let names: Vec<String> = std::fs::read_dir(&self.conf_dir)
            .map_err(io("reading", &self.conf_dir))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        chain::in_force(&names)
            .map(|n| self.conf_dir.join(n))
            .ok_or_else(|| {
                ChainError::NoConfig {
                    dir: self.conf_dir.display().to_string(),
                }
                .into()
            })
    }
}

/// The node's lock over peerwall's CNI files, held while they are read and written: an
/// ending agent and its successor never interleave their edits (released when dropped).
fn lock(s: &Settings) -> Result<std::fs::File, InstallError> {
    let path = s.bin_dir.join(".peerwall-boot.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io("opening the lock", &path))?;
    // SAFETY: flock(2) on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io("locking", &path)(std::io::Error::last_os_error()));
    }
    Ok(f)
}

/// Copy this binary in as the plugin (when it differs), check it runs on the node, and chain
/// it. Returns the configuration file it is chained in.
pub fn install(s: &Settings) -> Result<PathBuf, InstallError> {
    let _held = lock(s)?;
    let me = std::env::current_exe().map_err(io("locating", Path::new("/proc/self/exe")))?;
    let bin = s.binary();
    let ours = std::fs::read(&me).map_err(io("reading", &me))?;
    if std::fs::read(&bin).ok().as_deref() != Some(ours.as_slice()) {
        write_atomically(&bin, &ours, 0o755)?;
    }
    check_on_node(s)?;
    chain_in(s).map(|(file, _)| file)
}

/// Chain the plugin into the file in force if it is not there (a network plugin rewrote its
/// file, or another file came first). Returns the file and whether it was written.
pub fn keep(s: &Settings) -> Result<(PathBuf, bool), InstallError> {
    let _held = lock(s)?;
    chain_in(s)
}

/// [`keep`] under the lock.
fn chain_in(s: &Settings) -> Result<(PathBuf, bool), InstallError> {
    let bin = s.binary();
    if !bin.exists() {
        return Err(io("finding the plugin", &bin)(std::io::Error::from(
            std::io::ErrorKind::NotFound,
        )));
    }
    let file = s.file_in_force()?;
    let name = file.display().to_string();
    let text = std::fs::read_to_string(&file).map_err(io("reading", &file))?;
    match chain::chained(&name, &text, &chain::entry(&s.pod_name_prefixes))? {
        None => Ok((file, false)),
        Some(new) => {
            let mode = std::fs::metadata(&file)
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or(0o644);
            write_atomically(&file, new.as_bytes(), mode)?;
            Ok((file, true))
        }
    }
}

/// Take the plugin out of every configuration file, then remove its binary (in that order:
/// a chain naming a missing binary fails every sandbox). Returns the files changed.
pub fn uninstall(s: &Settings) -> Result<Vec<PathBuf>, InstallError> {
    let _held = lock(s)?;
    let mut changed = Vec::new();
    for e in std::fs::read_dir(&s.conf_dir)
        .map_err(io("reading", &s.conf_dir))?
        .flatten()
    {
        let path = e.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        if let Some(new) = chain::unchained(&path.display().to_string(), &text) {
            let mode = std::fs::metadata(&path)
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or(0o644);
            write_atomically(&path, new.as_bytes(), mode)?;
            changed.push(path);
        }
    }
    match std::fs::remove_file(s.binary()) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io("removing", &s.binary())(e))
        }
        _ => {}
    }
    Ok(changed)
}

/// Whether the plugin is chained now (for the metric).
pub fn chained_now(s: &Settings) -> bool {
    s.file_in_force()
        .ok()
        .and_then(|f| {
            std::fs::read_to_string(&f)
                .ok()
                .map(|t| chain::is_chained(&f.display().to_string(), &t))
        })
        .unwrap_or(false)
        && s.binary().exists()
}

/// Run the plugin (`CNI_COMMAND=VERSION`) and `nft --version` in the node's mount namespace.
fn check_on_node(s: &Settings) -> Result<(), InstallError> {
    let bin = s.binary();
    let version = run_on_node(
        s,
        std::process::Command::new(&bin)
            .env("CNI_COMMAND", "VERSION")
            .env_remove("CNI_ARGS"),
    )
    .map_err(|why| InstallError::NotOnNode {
        what: bin.display().to_string(),
        mnt: s.host_mnt.clone(),
        why,
    })?;
    if !version.contains("supportedVersions") {
        return Err(InstallError::NotOnNode {
            what: bin.display().to_string(),
            mnt: s.host_mnt.clone(),
            why: format!("CNI_COMMAND=VERSION printed {version:?}"),
        });
    }
    run_on_node(s, std::process::Command::new("nft").arg("--version")).map_err(|why| {
        InstallError::NotOnNode {
            what: "nft (the plugin puts the boot policy in force with it: install nftables on the node)".into(),
            mnt: s.host_mnt.clone(),
            why,
        }
    })?;
    Ok(())
}

/// Standard output of `cmd` run in the node's mount namespace, or why it failed.
fn run_on_node(s: &Settings, cmd: &mut std::process::Command) -> Result<String, String> {
    let mnt = std::fs::File::open(&s.host_mnt).map_err(|e| format!("opening: {e}"))?;
    // Run in the agent's own mount namespace, the check would find the mounted binary and
    // the image's `nft`, and prove nothing about the node.
    let id = |p: &Path| std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok();
    if id(&s.host_mnt).is_none() || id(&s.host_mnt) == id(Path::new("/proc/self/ns/mnt")) {
        return Err(
            "it is the agent's own mount namespace, not the node's (is the agent its container's first process, with hostPID?)"
                .into(),
        );
    }
    let fd = mnt.as_raw_fd();
    // SAFETY: between fork and exec only setns(2) runs, which is async-signal-safe, on a
    // descriptor opened before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Write `bytes` to `path` through a temporary file in the same directory and a rename: the
/// runtime reads either the old file or the new one, never half of one.
fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<(), InstallError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    // Per process: two agents on a node (one ending, one starting) never share a half-written
    // file.
    let tmp = dir.join(format!(
        ".{}.peerwall-tmp-{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let mut f = std::fs::File::create(&tmp).map_err(io("writing", &tmp))?;
    f.write_all(bytes).map_err(io("writing", &tmp))?;
    f.sync_all().map_err(io("writing", &tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(io("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("renaming into", path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's CNI directories in a temporary directory (removed at the end).
    struct Dirs(PathBuf);

    impl Dirs {
        fn new(name: &str) -> (Self, Settings) {
            let root =
                std::env::temp_dir().join(format!("peerwall-cni-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            let s = Settings {
                bin_dir: root.join("bin"),
                conf_dir: root.join("net.d"),
                pod_name_prefixes: vec!["gw-".into()],
                host_mnt: PathBuf::from("/proc/self/ns/mnt"),
            };
            std::fs::create_dir_all(&s.bin_dir).unwrap();
            std::fs::create_dir_all(&s.conf_dir).unwrap();
            (Self(root), s)
        }
    }

    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const BRIDGE: &str =
        r#"{"cniVersion": "0.4.0", "name": "pods", "plugins": [{"type": "bridge"}]}"#;

    #[test]
    fn keep_chains_once_and_uninstall_takes_out_then_removes_the_binary() {
        let (_d, s) = Dirs::new("keep");
        let conf = s.conf_dir.join("10-pods.conflist");
        std::fs::write(&conf, BRIDGE).unwrap();
        std::fs::write(s.conf_dir.join("99-later.conflist"), BRIDGE).unwrap();
        // No binary: nothing is chained (a chain naming a missing binary fails every pod).
        assert!(matches!(keep(&s), Err(InstallError::Io { .. })));
        assert!(!chained_now(&s));
        std::fs::write(s.binary(), b"plugin").unwrap();
        assert_eq!(keep(&s).unwrap(), (conf.clone(), true));
        assert_eq!(keep(&s).unwrap(), (conf.clone(), false));
        assert!(chained_now(&s));
        let text = std::fs::read_to_string(&conf).unwrap();
        assert!(text.contains("\"peerwall-boot\"") && text.contains("\"gw-\""));
        // Only the file in force is chained; no temporary file is left behind.
        assert_eq!(
            std::fs::read_to_string(s.conf_dir.join("99-later.conflist")).unwrap(),
            BRIDGE
        );
        let names: Vec<String> = std::fs::read_dir(&s.conf_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // A network plugin rewrites its file: chained again.
        std::fs::write(&conf, BRIDGE).unwrap();
        assert!(!chained_now(&s));
        assert_eq!(keep(&s).unwrap(), (conf.clone(), true));
        assert_eq!(uninstall(&s).unwrap(), vec![conf.clone()]);
        assert!(!s.binary().exists());
        let back: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&conf).unwrap()).unwrap();
        assert_eq!(
            back,
            serde_json::from_str::<serde_json::Value>(BRIDGE).unwrap()
        );
        // Nothing left to take out.
        assert_eq!(uninstall(&s).unwrap(), Vec::<PathBuf>::new());
    }

    #[test]
    fn the_check_refuses_the_agents_own_mount_namespace() {
        let (_d, s) = Dirs::new("own");
        std::fs::write(s.binary(), b"plugin").unwrap();
        let e = check_on_node(&s).unwrap_err().to_string();
        assert!(e.contains("the agent's own mount namespace"), "{e}");
        let empty = Settings {
            conf_dir: s.conf_dir.join("none"),
            ..s.clone()
        };
        assert!(keep(&empty).unwrap_err().to_string().contains("reading"));
    }
}
