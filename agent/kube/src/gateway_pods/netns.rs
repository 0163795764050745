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

/// The network namespace of the pod with `uid`: `/proc/<pid>/ns/net` of the process in its
/// cgroup that started first (the sandbox, which lives as long as the pod's namespace; its
/// containers start after it). Not the lowest pid: pids wrap (32768 by default on small
/// nodes), and a container's process may then have a lower pid than the sandbox and exit
/// before it. `proc` is the procfs mount (`/proc`; with `hostPID` the node's processes).
pub fn pod_netns(proc: &Path, uid: &str) -> Option<PathBuf> {
    std::fs::read_dir(proc)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let dir = proc.join(pid.to_string());
            let cg = std::fs::read_to_string(dir.join("cgroup")).ok()?;
            let ns = dir.join("ns/net");
            if !cgroup_in_pod(&cg, uid) || std::fs::metadata(&ns).is_err() {
                return None;
            }
            let started = start_time(&std::fs::read_to_string(dir.join("stat")).ok()?)?;
            Some(((started, pid), ns))
        })
        .min_by_key(|(order, _)| *order)
        .map(|(_, ns)| ns)
}

/// A process's start time (clock ticks after boot: `starttime`, field 22 of
/// `/proc/<pid>/stat`). The command name (field 2) may hold spaces and parentheses, so the
/// fields are counted from its closing parenthesis.
pub fn start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name: field 22 is the 20th.
    rest.split_whitespace().nth(19)?.parse().ok()
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
    fn start_time_counts_fields_after_the_command_name() {
        let stat =
            "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(start_time(stat), Some(987_654));
        assert_eq!(start_time("12 (x) S 1"), None);
    }

    /// A fake procfs: each process with its cgroup line, start time and `ns/net` file.
    fn fake_proc(procs: &[(u32, &str, u64)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "pw-fake-proc-{}-{}",
            std::process::id(),
            procs.len()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (pid, uid, started) in procs {
            let p = dir.join(pid.to_string());
            std::fs::create_dir_all(p.join("ns")).unwrap();
            std::fs::write(p.join("ns/net"), "").unwrap();
            std::fs::write(
                p.join("cgroup"),
                format!("4:memory:/kubepods/besteffort/pod{uid}/c{pid}\n"),
            )
            .unwrap();
            std::fs::write(
                p.join("stat"),
                format!("{pid} (p) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {started} 1 1"),
            )
            .unwrap();
        }
        dir
    }

    #[test]
    fn the_sandbox_is_the_pods_first_started_process_not_its_lowest_pid() {
        // Pids wrapped: the sandbox (started first) has pid 32000, a container of the pod
        // started after it has pid 300; another pod's process started earlier still.
        let other = "11111111-2222-3333-4444-555555555555";
        let proc = fake_proc(&[(300, UID, 5_000), (32_000, UID, 4_000), (7, other, 10)]);
        assert_eq!(
            pod_netns(&proc, UID),
            Some(proc.join("32000/ns/net")),
            "the sandbox, not the lowest pid"
        );
        std::fs::remove_dir_all(&proc).unwrap();
    }

    #[test]
    fn finds_own_process_by_its_cgroup() {
        // This process's own cgroup line names no pod; the lookup must come back empty rather
        // than pick an unrelated namespace.
        assert_eq!(pod_netns(Path::new("/proc"), UID), None);
    }
}
