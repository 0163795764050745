#!/usr/bin/env bash
# Carried from the shared recipe (docs/kube-apiserver.md); used by `cargo xtask kube-build` / `kube-up` and tests/kube.rs.
# Starts etcd + kube-apiserver (+ kube-controller-manager for namespace deletion and garbage
# collection) on 127.0.0.1 with fresh certificates. Prints the kubeconfig path when ready.
# Usage: start-apiserver.sh BIN_DIR RUN_DIR [API_PORT [ETCD_PORT]]   Stop: kill $(cat RUN_DIR/*.pid)
# etcd listens on ETCD_PORT (default API_PORT+10000) and the next port.
set -euo pipefail
BIN=${1:?BIN_DIR}; R=${2:?RUN_DIR}; PORT=${3:-16443}
ETCD=${4:-$((PORT + 10000))}; PEER=$((ETCD + 1))
mkdir -p "$R/pki"; rm -rf "$R/etcd-data"; P="$R/pki"
o() { openssl "$@" 2>/dev/null; }
o req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 365 -subj /CN=test-ca
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$P/server.ext"
o req -newkey rsa:2048 -nodes -keyout "$P/apiserver.key" -out "$P/apiserver.csr" -subj /CN=kube-apiserver
o x509 -req -in "$P/apiserver.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/apiserver.crt" -days 365 -extfile "$P/server.ext"
printf 'extendedKeyUsage=clientAuth\n' > "$P/client.ext"
o req -newkey rsa:2048 -nodes -keyout "$P/admin.key" -out "$P/admin.csr" -subj "/O=system:masters/CN=admin"
o x509 -req -in "$P/admin.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/admin.crt" -days 365 -extfile "$P/client.ext"
o genrsa -out "$P/sa.key" 2048; o rsa -in "$P/sa.key" -pubout -out "$P/sa.pub"
etcd --name t --data-dir "$R/etcd-data" \
  --listen-client-urls "http://127.0.0.1:$ETCD" --advertise-client-urls "http://127.0.0.1:$ETCD" \
  --listen-peer-urls "http://127.0.0.1:$PEER" --initial-advertise-peer-urls "http://127.0.0.1:$PEER" \
  --initial-cluster "t=http://127.0.0.1:$PEER" > "$R/etcd.log" 2>&1 &
echo $! > "$R/etcd.pid"
"$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$PORT" --insecure-port=0 \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range=10.96.0.0/24 --authorization-mode=RBAC \
  --disable-admission-plugins=ServiceAccount --allow-privileged=true > "$R/apiserver.log" 2>&1 &
echo $! > "$R/apiserver.pid"
cat > "$R/kubeconfig" <<K
apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$P/ca.crt"}}]
users: [{name: admin, user: {client-certificate: "$P/admin.crt", client-key: "$P/admin.key"}}]
contexts: [{name: t, context: {cluster: t, user: admin}}]
current-context: t
K
for _ in $(seq 600); do
  if curl -s --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" "https://127.0.0.1:$PORT/readyz" | grep -qx ok; then
    "$BIN/kube-controller-manager" --kubeconfig="$R/kubeconfig" \
      --controllers=namespace,garbagecollector,serviceaccount,serviceaccount-token \
      --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
      --leader-elect=false --secure-port=0 --port=0 > "$R/kcm.log" 2>&1 &
    echo $! > "$R/kcm.pid"
    echo "$R/kubeconfig"; exit 0
  fi
  sleep 0.1
done
echo "kube-apiserver not ready; see $R/apiserver.log" >&2; exit 1
