#!/usr/bin/env bash
# Builds the upstream binaries the tests run (kube-apiserver, etcd,
# kube-controller-manager, csi-attacher) from the pinned modules under tools/
# and caches them, keyed by the pinned versions and the Go version, so only the
# first run on a machine pays the multi-minute build.
# Prints the directory that holds the binaries.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${HCSI_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/harvester-csi-driver/tools}
key=$( (go version; cat "$root"/tools/*/go.mod "$root"/tools/*/go.sum "$root"/tools/kube/cmd/*/main.go) | sha256sum | cut -c1-16)
bin=$cache/$key
mkdir -p "$bin"

build() { # module-dir binary package
	local dir=$1 name=$2 pkg=$3
	if [ -x "$bin/$name" ]; then return; fi
	echo "building $name (first run on this machine; cached in $bin)" >&2
	(cd "$root/tools/$dir" && CGO_ENABLED=0 go build -trimpath -o "$bin/$name.tmp" "$pkg")
	mv "$bin/$name.tmp" "$bin/$name"
}

build kube etcd ./cmd/etcd
build kube kube-apiserver ./cmd/kube-apiserver
build kube kube-controller-manager ./cmd/kube-controller-manager
build attacher csi-attacher github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher
echo "$bin"
