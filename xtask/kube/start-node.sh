#!/usr/bin/env bash
# A real one-node Kubernetes cluster inside its own network namespace: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy and a kubelet over Debian's containerd,
# runc and CNI plugins (bridge + host-local), cgroup v1 with the cgroupfs driver. Everything
# it creates lives in the namespace NETNS, under RUN_DIR, and in the cgroup /NETNS; stop-node.sh
# removes all of it.
# Usage: start-node.sh BIN_DIR RUN_DIR NETNS IMAGES_DIR     (prints the kubeconfig path)
#   BIN_DIR: kube-build's output; IMAGES_DIR: `cargo xtask image`'s output (imported into
#   containerd before the kubelet starts, so nothing is pulled).
# Node: name `node-1`, address 10.250.0.1, pods 10.244.0.0/24 on bridge cni0, services 10.96.0.0/24.
set -euo pipefail
BIN=${1:?BIN_DIR}; R=${2:?RUN_DIR}; NS=${3:?NETNS}; IMAGES=${4:?IMAGES_DIR}
NODE_IP=10.250.0.1; PORT=6443
mkdir -p "$R/pki" "$R/cni" "$R/containerd" "$R/kubelet"; P="$R/pki"
in_ns() { nsenter --net="/run/netns/$NS" "$@"; }
ip netns add "$NS"
ip -n "$NS" link set lo up
# The node's address on lo (weak host model: pods reach it through cni0).
ip -n "$NS" addr add "$NODE_IP/32" dev lo
# A default route, as an uplink would give: locally sent packets to service addresses need one
# to reach kube-proxy's OUTPUT DNAT.
ip -n "$NS" route add default dev lo
in_ns sysctl -qw net.ipv4.ip_forward=1

o() { openssl "$@" 2>/dev/null; }
o req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 365 -subj /CN=node-ca
printf 'subjectAltName=IP:%s,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n' "$NODE_IP" > "$P/server.ext"
o req -newkey rsa:2048 -nodes -keyout "$P/apiserver.key" -out "$P/apiserver.csr" -subj /CN=kube-apiserver
o x509 -req -in "$P/apiserver.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/apiserver.crt" -days 365 -extfile "$P/server.ext"
printf 'extendedKeyUsage=clientAuth\n' > "$P/client.ext"
o req -newkey rsa:2048 -nodes -keyout "$P/admin.key" -out "$P/admin.csr" -subj "/O=system:masters/CN=admin"
o x509 -req -in "$P/admin.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/admin.crt" -days 365 -extfile "$P/client.ext"
o genrsa -out "$P/sa.key" 2048; o rsa -in "$P/sa.key" -pubout -out "$P/sa.pub"
cat > "$R/kubeconfig" <<K
apiVersion: v1
kind: Config
clusters: [{name: node, cluster: {server: "https://$NODE_IP:$PORT", certificate-authority: "$P/ca.crt"}}]
users: [{name: admin, user: {client-certificate: "$P/admin.crt", client-key: "$P/admin.key"}}]
contexts: [{name: node, context: {cluster: node, user: admin}}]
current-context: node
K

start() { # name command...
  local name=$1; shift
  nsenter --net="/run/netns/$NS" "$@" > "$R/$name.log" 2>&1 &
  echo $! > "$R/$name.pid"
}
start etcd etcd --name n --data-dir "$R/etcd-data" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster n=http://127.0.0.1:2380
start apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
  --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port="$PORT" --insecure-port=0 \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --kubelet-client-certificate="$P/admin.crt" --kubelet-client-key="$P/admin.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range=10.96.0.0/24 --authorization-mode=Node,RBAC --allow-privileged=true \
  --kubelet-preferred-address-types=InternalIP

# containerd: its own root, state and socket; pod namespaces mounted under its state dir. CNI
# at the standard paths (/opt/cni/bin, /etc/cni/net.d), which deploy/'s DaemonSet mounts to
# chain peerwall-boot (--cni-boot); Debian's plugins linked in from /usr/lib/cni. stop-node.sh
# removes what is added here.
mkdir -p /opt/cni/bin /etc/cni/net.d
for p in bridge host-local portmap loopback; do
  [ -e "/opt/cni/bin/$p" ] || { ln -s "/usr/lib/cni/$p" "/opt/cni/bin/$p"; echo "/opt/cni/bin/$p" >> "$R/cni/added"; }
done
cat > /etc/cni/net.d/10-pods.conflist <<C
{"cniVersion": "0.4.0", "name": "pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$R/cni-ipam", "ranges": [[{"subnet": "10.244.0.0/24"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
C
cat > "$R/containerd/config.toml" <<C
version = 2
root = "$R/containerd/root"
state = "$R/containerd/state"
[grpc]
  address = "$R/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "peerwall.local/pause:1.20.2"
  netns_mounts_under_state_dir = true
  # This machine refuses negative oom_score_adj even to root; keep pods at or above containerd's.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
C
start containerd containerd --config "$R/containerd/config.toml"
for _ in $(seq 100); do [ -S "$R/containerd.sock" ] && break; sleep 0.1; done
while read -r file name; do
  ctr --address "$R/containerd.sock" -n k8s.io images import --base-name "$name" "$IMAGES/$file.oci.tar" > /dev/null
done < "$IMAGES/names"

for _ in $(seq 600); do
  if in_ns curl -s --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" "https://$NODE_IP:$PORT/readyz" | grep -qx ok; then break; fi
  sleep 0.1
done
start kcm "$BIN/kube-controller-manager" --kubeconfig="$R/kubeconfig" \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
  --use-service-account-credentials=false --leader-elect=false --secure-port=0 --port=0 \
  --controllers='*,-nodeipam,-cloud-node-lifecycle,-route,-service,-ttl,-bootstrapsigner,-tokencleaner'
start scheduler "$BIN/kube-scheduler" --kubeconfig="$R/kubeconfig" --leader-elect=false --port=0 --secure-port=0
start proxy "$BIN/kube-proxy" --kubeconfig="$R/kubeconfig" --hostname-override=node-1 \
  --proxy-mode=iptables --cluster-cidr=10.244.0.0/16 --conntrack-max-per-core=0 \
  --bind-address="$NODE_IP" --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256

# bpffs shared, as systemd leaves it on real nodes: pods mount it with HostToContainer
# propagation (the agent's pins).
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
mount --make-shared /sys/fs/bpf
# The kubelet's cgroup root must exist in every v1 hierarchy (cpuset needs cpus and mems).
for c in /sys/fs/cgroup/*/; do mkdir -p "$c$NS"; done
cat /sys/fs/cgroup/cpuset/cpuset.cpus > "/sys/fs/cgroup/cpuset/$NS/cpuset.cpus"
cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset/$NS/cpuset.mems"
# No disk-based eviction: a test node shares the machine's disk with builds and caches, and a
# kubelet that counts them as its own pressure evicts the pods under test (and deletes their
# images, which are imported, never pulled). Disk space is reported with the logs instead.
start kubelet "$BIN/kubelet" --kubeconfig="$R/kubeconfig" --hostname-override=node-1 --node-ip="$NODE_IP" \
  --container-runtime=remote --container-runtime-endpoint="unix://$R/containerd.sock" \
  --runtime-request-timeout=5m --pod-infra-container-image=peerwall.local/pause:1.20.2 \
  --root-dir="$R/kubelet" --cert-dir="$R/kubelet/pki" --cgroup-driver=cgroupfs --cgroup-root="/$NS" \
  --fail-swap-on=false --address="$NODE_IP" --read-only-port=0 --anonymous-auth=false \
  --authentication-token-webhook=false --authorization-mode=AlwaysAllow --client-ca-file="$P/ca.crt" \
  --make-iptables-util-chains=false --image-gc-high-threshold=100 --image-gc-low-threshold=99 \
  --eviction-hard='memory.available<1Mi' \
  --node-labels=peerwall.io/gateway=true --register-node=true --resolv-conf=/etc/resolv.conf \
  --volume-plugin-dir="$R/kubelet/volume-plugins" --serialize-image-pulls=false
for _ in $(seq 600); do
  if in_ns "$BIN/kubectl" --kubeconfig="$R/kubeconfig" get node node-1 -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True; then
    echo "$R/kubeconfig"; exit 0
  fi
  kill -0 "$(cat "$R/kubelet.pid")" 2>/dev/null || break
  sleep 0.2
done
echo "node-1 not Ready; see $R/kubelet.log" >&2; exit 1
