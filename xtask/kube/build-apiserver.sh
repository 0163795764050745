#!/usr/bin/env bash
# Carried from the shared recipe (docs/kube-apiserver.md); used by `cargo xtask kube-build` / `kube-up` and tests/kube.rs.
# Builds a real kube-apiserver (and kube-controller-manager) v1.20.2 from Debian bookworm's
# `kubernetes` source package (upstream tree with vendored Go deps; no Go module proxy used).
# Usage: build-apiserver.sh OUT_DIR     (about 14 minutes on 2 cores, 1.4 GB peak memory, 2.2 GB disk)
# Result: OUT_DIR/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kube-proxy} and
# OUT_DIR/kubectl, the client of the server's version (the tests run `kubectl apply -k deploy/`),
# taken from Debian's own binary package of the same source (kubernetes-client, v1.20.2), which
# saves building it; and
# OUT_DIR/pause, the pod sandbox binary compiled statically from build/pause/linux/pause.c. Idempotent: builds only
# the binaries that are missing.
set -euo pipefail
OUT=${1:?usage: build-apiserver.sh OUT_DIR}
WHAT=""
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
  [ -x "$OUT/$b" ] || WHAT="$WHAT cmd/$b"
done
[ -n "$WHAT" ] || [ ! -x "$OUT/pause" ] || [ ! -x "$OUT/kubectl" ] || exit 0
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
mkdir -p "$OUT" "$W/apt/lists/partial" "$W/src"
export DEBIAN_FRONTEND=noninteractive
PKGS="golang-go etcd-server rsync openssl gcc libc6-dev golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev"
# shellcheck disable=SC2086
apt-get install -y --no-install-recommends $PKGS >/dev/null 2>&1 || {
  apt-get update -qq && apt-get install -y --no-install-recommends $PKGS >/dev/null; }
# Reuse the mirror this machine's apt already uses, for the matching source list.
URI=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$URI" ] || URI=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$URI" ] || { echo "no Debian apt source found" >&2; exit 1; }
printf 'deb-src %s bookworm main\n' "$URI" > "$W/apt/sources.list"
APTO=(-o "Dir::Etc::SourceList=$W/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$W/apt/lists")
apt-get "${APTO[@]}" update -qq
(cd "$W/src" && apt-get "${APTO[@]}" source --download-only kubernetes >/dev/null)
tar -C "$W/src" -xzf "$W"/src/kubernetes_*.orig.tar.gz
K=$(ls -d "$W"/src/kubernetes-*/)
# The vendored reflect2 1.0.1 crashes under Go 1.19 ("fatal error: fault" on the first custom
# resource create); Debian's reflect2 1.0.2 and json-iterator 1.1.12 fix it.
V="$K/vendor/github.com"
rm -rf "$V/modern-go/reflect2" "$V/json-iterator/go"
cp -rL /usr/share/gocode/src/github.com/modern-go/reflect2 "$V/modern-go/reflect2"
cp -rL /usr/share/gocode/src/github.com/json-iterator/go "$V/json-iterator/go"
find "$V/modern-go/reflect2" "$V/json-iterator/go" \( -name '*_test.go' -o -name go.mod \) -delete
# `make` builds in GOPATH mode (plain `go build -mod=vendor` fails on go.mod); it needs rsync.
if [ -n "$WHAT" ]; then
  (cd "$K" && GOCACHE="$W/gocache" GOPROXY=off KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean \
    make WHAT="${WHAT# }" GOLDFLAGS="-s -w" >/dev/null)
  for b in $WHAT; do cp "$K/_output/bin/${b#cmd/}" "$OUT/"; done
fi
# kubectl: Debian's binary package, unpacked here (not installed: another kubectl may own
# /usr/bin/kubectl), checked to be the server's version.
if [ ! -x "$OUT/kubectl" ]; then
  (cd "$W" && { apt-get download kubernetes-client >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get download kubernetes-client >/dev/null; }; })
  dpkg-deb -x "$W"/kubernetes-client_*.deb "$W/kc"
  V=$("$W/kc/usr/bin/kubectl" version --client)
  case "$V" in *'GitVersion:"v1.20.2"'*) ;; *) echo "Debian's kubernetes-client is not v1.20.2: $V" >&2; exit 1 ;; esac
  cp "$W/kc/usr/bin/kubectl" "$OUT/kubectl"
fi
# The pod sandbox ("pause") binary from the same tree, static, for the pause image.
if [ ! -x "$OUT/pause" ]; then
  gcc -Os -static -Wall -Werror -DVERSION=v1.20.2-peerwall -o "$OUT/pause.tmp" "$K/build/pause/linux/pause.c"
  strip "$OUT/pause.tmp" && mv "$OUT/pause.tmp" "$OUT/pause"
fi
"$OUT/kube-apiserver" --version
