#!/usr/bin/env bash
# The operating-system tools `make test` and `make lab` need, and the Debian
# package of each: the node service formats, checks, grows and mounts real
# loop devices, and the lab's databases use XFS where ext4 cannot grow online.
# As root, missing packages are installed (apt-get); otherwise one line names
# them and the tests that need them skip with that reason (the lab refuses to
# start). .ci/run installs nothing itself: tests/chart checks that.
#
# Usage: hack/os-deps.sh [--check]   (--check: only report, exit 1 if missing)
set -euo pipefail

# command:package
tools=(
	losetup:mount
	mount:mount
	umount:mount
	blkid:util-linux
	fsck:util-linux
	mkfs.ext4:e2fsprogs
	e2fsck:e2fsprogs
	resize2fs:e2fsprogs
	mkfs.xfs:xfsprogs
	xfs_growfs:xfsprogs
	xfs_repair:xfsprogs
)

missing=()
for t in "${tools[@]}"; do
	cmd=${t%%:*} pkg=${t#*:}
	if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1; then
		[[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
	fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "${1-}" = --check ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
	echo "os-deps: missing packages: ${missing[*]} (install them as root, e.g. apt-get install ${missing[*]}; tests that need them skip, the lab refuses to start)" >&2
	[ "${1-}" = --check ] && exit 1
	exit 0
fi
echo "os-deps: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
