#!/usr/bin/env bash
# Removes everything start-node.sh created: the kubelet first (so it restarts nothing), every
# process in the node's cgroup (containers, pod sandboxes), containerd's shims, the control
# plane, mounts under RUN_DIR, the cgroups and the network namespace.
# Usage: stop-node.sh RUN_DIR NETNS
set -uo pipefail
R=${1:?RUN_DIR}; NS=${2:?NETNS}
kill_pidfile() { [ -f "$R/$1.pid" ] && kill -9 "$(cat "$R/$1.pid")" 2>/dev/null; }
kill_pidfile kubelet
# Processes in the pods' cgroups (repeat: a dying shim may reap-and-restart nothing, but be sure).
for _ in 1 2 3; do
  pids=$(cat /sys/fs/cgroup/pids/"$NS"/**/cgroup.procs /sys/fs/cgroup/pids/"$NS"/cgroup.procs 2>/dev/null; \
         find /sys/fs/cgroup/pids/"$NS" -name cgroup.procs -exec cat {} + 2>/dev/null)
  [ -n "$pids" ] || break
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null
  sleep 0.2
done
for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $R/containerd.sock"); do kill -9 "$p" 2>/dev/null; done
for p in proxy scheduler kcm containerd apiserver etcd; do kill_pidfile "$p"; done
# Anything else started with this run directory on its command line.
pkill -9 -f -- "$R/" 2>/dev/null
sleep 0.3
# Mounts under RUN_DIR (rootfs overlays, pod namespaces, volume tmpfs), deepest first.
awk -v r="$R" '$5 ~ "^"r {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
  umount -l "$m" 2>/dev/null
done
for c in /sys/fs/cgroup/*/"$NS"; do
  [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
done
ip netns del "$NS" 2>/dev/null
# The node's CNI files (start-node.sh) and what the DaemonSet's --cni-boot left, if it was
# not uninstalled.
rm -f /etc/cni/net.d/10-pods.conflist /etc/cni/net.d/.10-pods.conflist.peerwall-tmp-* \
  /opt/cni/bin/peerwall-boot /opt/cni/bin/.peerwall-boot.peerwall-tmp-* /opt/cni/bin/.peerwall-boot.lock
[ -f "$R/cni/added" ] && xargs -r rm -f < "$R/cni/added"
rmdir /etc/cni/net.d /etc/cni /opt/cni/bin /opt/cni 2>/dev/null
rm -rf "$R"
exit 0
