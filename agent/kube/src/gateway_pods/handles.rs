//! Where each gateway this node enforces in can be reached from the command line: one small
//! JSON file per gateway pod under `/run/peerwall/gateways/` (pod, UID, pin directory), written
//! when the DaemonSet's agent starts enforcing in it and removed when it stops. `peerwall
//! allow-all|counters|inspect|delete --gateway PEER`, run in the agent's pod (`kubectl exec
//! ds/peerwall-agent -- …`), reads it and finds the pod's network namespace the way the agent
//! does (by UID, through `/proc`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The directory of the handles.
pub const HANDLES: &str = "/run/peerwall/gateways";

/// One gateway pod being enforced in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handle {
    /// The peer it tunnels to.
    pub peer: String,
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The pod's UID (finds its network namespace).
    pub uid: String,
    /// Its bpf pin directory.
    pub pins: PathBuf,
}

/// Record `h` under `dir` (as `<pin name>.json`, written whole and renamed).
pub fn write(dir: &Path, name: &str, h: &Handle) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec(h).unwrap_or_default())?;
    std::fs::rename(tmp, dir.join(format!("{name}.json")))
}

/// Forget the gateway recorded as `name`.
pub fn remove(dir: &Path, name: &str) {
    let _ = std::fs::remove_file(dir.join(format!("{name}.json")));
}

/// Names of the handles under `dir` that no gateway accounts for any more: not in `keep` (the
/// gateways this node sees or drains) and without a pin directory under `pins` (those are
/// removed with their pins). An nftables gateway has no pins, so its handle is found only here
/// when its pod went while the agent was down.
pub fn orphans(dir: &Path, pins: &Path, keep: &std::collections::BTreeSet<String>) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            file.strip_suffix(".json")
                .filter(|n| !n.starts_with('.'))
                .map(str::to_string)
        })
        .filter(|name| !keep.contains(name) && !pins.join(name).exists())
        .collect();
    out.sort();
    out
}

/// The handles of `peer`'s gateways recorded under `dir`.
pub fn of_peer(dir: &Path, peer: &str) -> Vec<Handle> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<Handle> = entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice::<Handle>(&b).ok())
        .filter(|h| h.peer == peer)
        .collect();
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
    out
}

/// The network namespace (a `/proc/<pid>/ns/net` path) and pin directory of `peer`'s gateway
/// on this node, or why there is none.
pub fn resolve(dir: &Path, proc: &Path, peer: &str) -> Result<(PathBuf, PathBuf), String> {
    let handles = of_peer(dir, peer);
    if handles.is_empty() {
        return Err(format!(
            "no gateway of peer {peer:?} is enforced on this node (no handle in {}): run this in the agent pod of the node the gateway runs on (kubectl get pods -A -l networking.liqo.io/component=gateway -o wide)",
            dir.display()
        ));
    }
    let live: Vec<(PathBuf, &Handle)> = handles
        .iter()
        .filter_map(|h| Some((super::netns::pod_netns(proc, &h.uid)?, h)))
        .collect();
    match live.as_slice() {
        [(ns, h)] => Ok((ns.clone(), h.pins.clone())),
        [] => Err(format!(
            "the gateway pod of peer {peer:?} ({}) has no running process on this node",
            handles[0].pod
        )),
        _ => Err(format!(
            "several gateway pods of peer {peer:?} run on this node ({}): use --netns /proc/<pid>/ns/net and --pin-dir",
            live.iter().map(|(_, h)| h.pod.as_str()).collect::<Vec<_>>().join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_written_found_by_peer_and_removed() {
        let dir = std::env::temp_dir().join(format!("pw-handles-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let h = |peer: &str, uid: &str| Handle {
            peer: peer.into(),
            pod: format!("liqo-tenant-{peer}/gw"),
            uid: uid.into(),
            pins: PathBuf::from(format!("/sys/fs/bpf/peerwall/gateways/{peer}_{uid}")),
        };
        write(&dir, "a_1", &h("a", "1")).unwrap();
        write(&dir, "b_2", &h("b", "2")).unwrap();
        assert_eq!(of_peer(&dir, "a"), vec![h("a", "1")]);
        // No process of that UID here: named as such.
        let e = resolve(&dir, &dir, "a").unwrap_err();
        assert!(e.contains("has no running process"), "{e}");
        let e = resolve(&dir, &dir, "c").unwrap_err();
        assert!(e.contains("no gateway of peer \"c\""), "{e}");
        remove(&dir, "a_1");
        assert!(of_peer(&dir, "a").is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn orphans_are_handles_neither_kept_nor_pinned() {
        let root = std::env::temp_dir().join(format!("pw-orphans-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (dir, pins) = (root.join("handles"), root.join("pins"));
        let h = |peer: &str, uid: &str| Handle {
            peer: peer.into(),
            pod: format!("liqo-tenant-{peer}/gw"),
            uid: uid.into(),
            pins: pins.join(format!("{peer}_{uid}")),
        };
        for (peer, uid) in [("a", "1"), ("b", "2"), ("c", "3")] {
            write(&dir, &format!("{peer}_{uid}"), &h(peer, uid)).unwrap();
        }
        // b's pins are still there (the pin sweep removes them with the handle); a is kept.
        std::fs::create_dir_all(pins.join("b_2")).unwrap();
        std::fs::write(dir.join(".d_4.tmp"), b"{}").unwrap();
        let keep = ["a_1".to_string()].into_iter().collect();
        assert_eq!(orphans(&dir, &pins, &keep), vec!["c_3".to_string()]);
        assert!(orphans(&root.join("none"), &pins, &keep).is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
