#!/usr/bin/env bash
# Builds upstream's Harvester CSI driver (github.com/harvester/harvester-csi-driver)
# at a tag, for the lab's side-by-side comparison (hcsi-lab --compare PATH).
# Upstream's module is not served by the module proxy, but its repository
# vendors every dependency, so a clone and Go are enough. Nothing of upstream
# enters this repository: the clone goes to a temporary directory (or SRC, an
# existing clone or bare mirror), the binary to OUT.
#
#   hack/build-upstream.sh [TAG] [OUT]     default v0.2.9 and bin/upstream-csi-driver-TAG
#   SRC=/path/to/clone hack/build-upstream.sh
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
tag=${1:-v0.2.9}
out=${2:-$root/bin/upstream-csi-driver-$tag}
repo=${UPSTREAM_REPO:-https://github.com/harvester/harvester-csi-driver}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${SRC:-}" ]; then
	git clone --quiet --no-checkout "$SRC" "$work/src"
else
	git clone --quiet --no-checkout --filter=blob:none "$repo" "$work/src"
fi
git -C "$work/src" -c advice.detachedHead=false checkout --quiet "$tag"
commit=$(git -C "$work/src" rev-parse --short=12 HEAD)
mkdir -p "$(dirname "$out")"
# Its main package is the repository root; -mod=vendor builds from vendor/
# only, so no module download happens.
(cd "$work/src" && CGO_ENABLED=0 GOFLAGS=-mod=vendor go build -trimpath \
	-ldflags "-X github.com/harvester/harvester-csi-driver/pkg/version.Version=$tag -X github.com/harvester/harvester-csi-driver/pkg/version.GitCommit=$commit" -o "$out.tmp" .)
mv "$out.tmp" "$out"
echo "built upstream $tag ($commit): $out" >&2
echo "$out"
