#!/usr/bin/env bash
# Builds the upstream binaries the tests run (kube-apiserver, etcd,
# kube-controller-manager, the CSI sidecars and KubeVirt's control plane) from the pinned modules under tools/
# and caches them, keyed by the pinned versions and the Go version, so only the
# first run on a machine pays the multi-minute build.
# Prints the directory that holds the binaries.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${HCSI_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/harvester-csi-driver/tools}
gover=$(go version)

# Each tools module is cached under its own key, so pinning a new binary does
# not rebuild the others; the printed directory links them all together.
links=()
build() { # module-dir binary package
	local dir=$1 name=$2 pkg=$3 key out
	key=$( (echo "$gover"; cat "$root/tools/$dir/go.mod" "$root/tools/$dir/go.sum"; cat "$root/tools/$dir"/cmd/*/*.go 2>/dev/null || true) | sha256sum | cut -c1-16)
	out=$cache/$dir-$key
	if [ ! -x "$out/$name" ]; then
		echo "building $name (first run on this machine; cached in $out)" >&2
		mkdir -p "$out"
		(cd "$root/tools/$dir" && CGO_ENABLED=0 go build -trimpath -o "$out/$name.tmp" "$pkg")
		mv "$out/$name.tmp" "$out/$name"
	fi
	links+=("$out/$name")
}

build kube etcd ./cmd/etcd
build kube kube-apiserver ./cmd/kube-apiserver
build kube kube-controller-manager ./cmd/kube-controller-manager
build attacher csi-attacher github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher
build resizer csi-resizer github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer
build snapshotter csi-snapshotter github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter
build scheduler kube-scheduler ./cmd/kube-scheduler
build provisioner csi-provisioner github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner
build kubelet hollow-kubelet ./cmd/hollow-kubelet
build kubelet csi-registrar ./cmd/csi-registrar
# KubeVirt's virt-controller, virt-api and manifest generator, one tools module
# per tag that builds from the module proxy; the binaries carry the tag in
# their names so every version can sit in one bin directory.
for kv in "$root"/tools/kubevirt-v*/; do
	kv=$(basename "$kv")
	ver=${kv#kubevirt-}
	build "$kv" "virt-controller-$ver" ./cmd/virt-controller
	build "$kv" "virt-api-$ver" ./cmd/virt-api
	build "$kv" "kubevirt-manifests-$ver" ./cmd/kubevirt-manifests
done

bin=$cache/bin-$(printf '%s\n' "${links[@]}" | sha256sum | cut -c1-16)
mkdir -p "$bin"
for l in "${links[@]}"; do ln -sfn "$l" "$bin/$(basename "$l")"; done
echo "$bin"
