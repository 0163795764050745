//! Reaching a pod's network namespace from the node: through a process of that pod.
//!
//! Every container of a pod, and its sandbox (`pause`) process, runs in the cgroup the kubelet
//! made for the pod, whose path names the pod UID (`.../pod<uid>/...` with the cgroupfs driver,
//! `...-pod<uid_with_underscores>.slice` with the systemd driver, cgroup v1 and v2 alike).
//! With `hostPID`, `/proc/<pid>/ns/net` of such a process *is* the pod's network namespace.
//! This works with any CNI and any runtime (nothing depends on where the runtime keeps its
//! namespace files or on the pod IP being unique on the node) and sees the pod as soon as its
//! sandbox exists, before its containers start.

use std::path::{Path, PathBuf};

/// Whether a `/proc/<pid>/cgroup` text places the process in the pod with `uid`.
pub fn cgroup_in_pod(cgroup: &str, uid: &str) -> bool {
    let dashed = format!("pod{uid}");
    let underscored = format!("pod{}", uid.replace('-', "_"));
    cgroup.lines().any(|line| {
        let path = line.splitn(3, ':').nth(2).unwrap_or_default();
        path.split('/').any(|seg| {
            [&dashed, &underscored].iter().any(|p| {
                seg == p.as_str()
                    || seg
                        .strip_suffix(".slice")
                        .is_some_and(|s| s.ends_with(&format!("-{p}")) || s == p.as_str())
            })
        })
    })
}

/// The network namespace of the pod with `uid`: `/proc/<pid>/ns/net` of the lowest-numbered
/// process in its cgroup (the sandbox, which lives as long as the pod's namespace). `proc` is
/// the procfs mount (`/proc`; with `hostPID` the node's processes).
pub fn pod_netns(proc: &Path, uid: &str) -> Option<PathBuf> {
    let mut pids: Vec<u32> = std::fs::read_dir(proc)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.into_iter().find_map(|pid| {
        let dir = proc.join(pid.to_string());
        let cg = std::fs::read_to_string(dir.join("cgroup")).ok()?;
        let ns = dir.join("ns/net");
        (cgroup_in_pod(&cg, uid) && std::fs::metadata(&ns).is_ok()).then_some(ns)
    })
}

/// The namespace identity (device and inode) of a `ns/net` file, to tell a recreated
/// namespace from the one enforced in.
pub fn netns_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5f0c1d2e-aaaa-bbbb-cccc-0123456789ab";

    #[test]
    fn cgroupfs_v1_paths() {
        let cg = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/0123abcd\n4:memory:/kubepods/besteffort/pod{UID}/0123abcd\n"
        );
        assert!(cgroup_in_pod(&cg, UID));
        let rooted = format!("3:cpu,cpuacct:/peerwall-node/kubepods/pod{UID}/ff\n");
        assert!(cgroup_in_pod(&rooted, UID));
    }

    #[test]
    fn systemd_driver_and_v2_paths() {
        let u = UID.replace('-', "_");
        let cg = format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/cri-containerd-01.scope\n");
        assert!(cgroup_in_pod(&cg, UID));
        let guaranteed = format!("0::/kubepods.slice/kubepods-pod{u}.slice/x.scope\n");
        assert!(cgroup_in_pod(&guaranteed, UID));
    }

    #[test]
    fn other_pods_and_prefixes_do_not_match() {
        let other = "4:memory:/kubepods/besteffort/pod5f0c1d2e-aaaa-bbbb-cccc-0123456789ac/x\n";
        assert!(!cgroup_in_pod(other, UID));
        // A UID that is a prefix of another must not match it.
        let longer = format!("4:memory:/kubepods/pod{UID}0/x\n");
        assert!(!cgroup_in_pod(&longer, UID));
        assert!(!cgroup_in_pod("0::/user.slice/session-1.scope\n", UID));
    }

    #[test]
    fn finds_own_process_by_its_cgroup() {
        // This process's own cgroup line names no pod; the lookup must come back empty rather
        // than pick an unrelated namespace.
        assert_eq!(pod_netns(Path::new("/proc"), UID), None);
    }
}
