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
# not rebuild the others; the printed directory links them all together. The
# key covers the Go version, the module's go.mod and go.sum, and the sources
# of its cmd/ (or, after the package, only the source globs given, relative to
# the module: for binaries of one module that share no source).
links=()
build() { # module-dir binary package [source-glob...]
	local dir=$1 name=$2 pkg=$3 key out
	shift 3
	local srcs=("$@")
	[ ${#srcs[@]} -gt 0 ] || srcs=('cmd/*/*.go')
	# shellcheck disable=SC2068 # the globs expand here, in the module
	key=$(cd "$root/tools/$dir" && (echo "$gover"; cat go.mod go.sum; cat ${srcs[@]} 2>/dev/null || true) | sha256sum | cut -c1-16)
	out=$cache/$dir-$key
	if [ ! -x "$out/$name" ]; then
		mkdir -p "$out"
		if legacy=$(legacy_kubevirt_dir "$dir" "$name") && [ -x "$legacy/$name" ]; then
			ln -f "$legacy/$name" "$out/$name" 2>/dev/null || cp "$legacy/$name" "$out/$name"
		else
			echo "building $name (first run on this machine; cached in $out)" >&2
			# Its own temporary name: test packages started at once may
			# build the same binary side by side; the last rename wins.
			(cd "$root/tools/$dir" && CGO_ENABLED=0 go build -trimpath -o "$out/$name.tmp.$$" "$pkg")
			mv "$out/$name.tmp.$$" "$out/$name"
		fi
	fi
	links+=("$out/$name")
}

# legacy_kubevirt_dir prints the cache directory a KubeVirt module's
# virt-controller and virt-api were built in before the manifest generator's
# source moved to tools/kubevirt-cmd: one key then covered all three
# binaries, the generator's own main.go (as of legacy_rev) included. Only
# the controller binaries are taken over: the generator is built anew. The
# key is computed over today's go.mod, go.sum and controller sources, so a
# directory it names holds these very builds; reusing them spares CI the half
# hour that rebuilding KubeVirt's control plane costs.
legacy_rev=c647d531a6ca7d81d49654b271fec9be13474d74
legacy_kubevirt_dir() { # module-dir binary
	local dir=$1 gen=tools/$1/cmd/kubevirt-manifests/main.go key
	case $2 in virt-controller-* | virt-api-*) ;; *) return 1 ;; esac
	git -C "$root" cat-file -e "$legacy_rev:$gen" 2>/dev/null || return 1
	key=$(cd "$root/tools/$dir" && (echo "$gover"; cat go.mod go.sum; git -C "$root" show "$legacy_rev:$gen"; cat cmd/virt-api/*.go cmd/virt-controller/*.go) | sha256sum | cut -c1-16)
	[ -d "$cache/$dir-$key" ] && echo "$cache/$dir-$key"
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
# their names so every version can sit in one bin directory. The generator's
# source is shared (tools/kubevirt-cmd, linked from each module), so it
# has a key of its own: changing it does not rebuild the control plane.
for kv in "$root"/tools/kubevirt-v*/; do
	kv=$(basename "$kv")
	ver=${kv#kubevirt-}
	build "$kv" "virt-controller-$ver" ./cmd/virt-controller 'cmd/virt-api/*.go' 'cmd/virt-controller/*.go'
	build "$kv" "virt-api-$ver" ./cmd/virt-api 'cmd/virt-api/*.go' 'cmd/virt-controller/*.go'
	build "$kv" "kubevirt-manifests-$ver" ./cmd/kubevirt-manifests 'cmd/kubevirt-manifests/*.go'
done

bin=$cache/bin-$(printf '%s\n' "${links[@]}" | sha256sum | cut -c1-16)
mkdir -p "$bin"
for l in "${links[@]}"; do ln -sfn "$l" "$bin/$(basename "$l")"; done
echo "$bin"
