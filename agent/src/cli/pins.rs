//! Which pin directory a host command acts on when `--pin-dir` is not given: the one the last
//! `peerwall apply --backend bpf --pin-dir DIR` left in this network namespace. `apply`
//! records it under [`REMEMBERED`] keyed by the namespace's identity (device and inode of its
//! `ns/net` file, which `/run/netns/<name>` bind-mounts share), so `counters`, `inspect`,
//! `allow-all`, `delete` and `observe --kernel` find those pins without the flag being repeated.
//! `/run` is a tmpfs: the record goes with a reboot, as the pins do.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where the records are: one file per network namespace, holding the pin directory.
pub const REMEMBERED: &str = "/run/peerwall/pin-dirs";

/// The default pin directory.
fn default_dir() -> &'static Path {
    Path::new(peerwall_backend_select::PIN_DIR)
}

/// The identity of the network namespace this thread is in.
fn netns_key() -> Option<String> {
    let m = std::fs::metadata("/proc/thread-self/ns/net").ok()?;
    Some(format!("{}-{}", m.dev(), m.ino()))
}

/// Record `pin_dir` as this network namespace's (the default clears the record). Failing to
/// record changes nothing in force: a later command then needs `--pin-dir`, and says so.
pub fn remember(pin_dir: &Path) {
    remember_in(Path::new(REMEMBERED), netns_key(), pin_dir, default_dir());
}

fn remember_in(records: &Path, key: Option<String>, pin_dir: &Path, default: &Path) {
    let Some(key) = key else {
        return;
    };
    let file = records.join(key);
    if pin_dir == default {
        let _ = std::fs::remove_file(&file);
        return;
    }
    let written = std::fs::create_dir_all(records)
        .and_then(|()| std::fs::write(&file, pin_dir.as_os_str().as_encoded_bytes()));
    if let Err(e) = written {
        tracing::warn!(error = %e, record = %file.display(), "could not record this namespace's pin directory: later commands need --pin-dir");
    }
}

/// The pin directory a command given `pin_dir` acts on: `pin_dir` itself unless it is the
/// default and holds no datapath while this namespace's recorded one does.
pub fn resolve(pin_dir: &Path) -> PathBuf {
    resolve_in(Path::new(REMEMBERED), netns_key(), pin_dir, default_dir())
}

fn resolve_in(records: &Path, key: Option<String>, pin_dir: &Path, default: &Path) -> PathBuf {
    let pinned = peerwall_backend_select::installed::bpf_pinned;
    if pin_dir != default || pinned(pin_dir) {
        return pin_dir.to_path_buf();
    }
    let recorded = key
        .and_then(|k| std::fs::read(records.join(k)).ok())
        .map(|b| PathBuf::from(String::from_utf8_lossy(&b).into_owned()));
    match recorded {
        Some(r) if pinned(&r) => {
            tracing::info!(pin_dir = %r.display(), "the pins this network namespace's last apply left (no --pin-dir given)");
            r
        }
        _ => pin_dir.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_directory_is_used_only_where_the_default_holds_nothing() {
        let tmp = std::env::temp_dir().join(format!("peerwall-pins-{}", std::process::id()));
        let records = tmp.join("records");
        let pins = tmp.join("pins");
        // The default directory, holding no datapath.
        let default = tmp.join("default");
        std::fs::create_dir_all(&pins).unwrap();
        let key = || Some("7-42".to_string());
        // Recorded, but no datapath there yet: the default stays.
        remember_in(&records, key(), &pins, &default);
        assert_eq!(resolve_in(&records, key(), &default, &default), default);
        // A datapath there (its ALLOW_ALL pin): found.
        std::fs::write(pins.join(peerwall_common::map::ALLOW_ALL), b"").unwrap();
        assert_eq!(resolve_in(&records, key(), &default, &default), pins);
        // Another namespace, or a directory given explicitly: unchanged.
        assert_eq!(
            resolve_in(&records, Some("7-43".into()), &default, &default),
            default
        );
        let other = tmp.join("other");
        assert_eq!(resolve_in(&records, key(), &other, &default), other);
        // Applying with the default again clears the record.
        remember_in(&records, key(), &default, &default);
        assert_eq!(resolve_in(&records, key(), &default, &default), default);
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
