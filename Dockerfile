# syntax=docker/dockerfile:1
#
# harvester-csi-driver image: one static binary plus the filesystem tools the node plugin runs (mkfs, fsck,
# resize, blkid, mount, nsenter, mount.nfs). The same image serves the controller (run as non-root by the
# chart) and the node plugin (privileged).
#
#   make image                      # this machine's architecture, tagged and stamped v$(cat VERSION)
#   make release PUSH=true          # linux/amd64 and linux/arm64 with docker buildx (see docs/install.md)
#   docker build --build-arg VERSION=v$(cat VERSION) --build-arg COMMIT=$(git rev-parse --short HEAD) -t IMAGE .
#
# The build stage runs on the build machine's platform and cross-compiles for BuildKit's TARGETARCH, so a
# multi-platform build needs no emulation.
#
# Base images are pinned by tag and by the digest of their multi-architecture index; bump both together.

FROM --platform=$BUILDPLATFORM golang:1.26.8-bookworm@sha256:dc9ad6c05acc7a88e5b71bde60a5fe3bd4b9f0db209011711b464107438a8107 AS build
ARG TARGETOS=linux
ARG TARGETARCH
ARG VERSION=dev
ARG COMMIT=unknown
WORKDIR /src
ENV CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
# Modules first: this layer is reused until go.mod/go.sum change.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY cmd ./cmd
COPY pkg ./pkg
COPY internal ./internal
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    GOOS=$TARGETOS GOARCH=$TARGETARCH CGO_ENABLED=0 \
    go build -trimpath \
      -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT}" \
      -o /out/harvester-csi-driver ./cmd/harvester-csi-driver

FROM debian:13.6-slim@sha256:020c0d20b9880058cbe785a9db107156c3c75c2ac944a6aa7ab59f2add76a7bd
ARG VERSION=dev
ARG COMMIT=unknown
# e2fsprogs: mkfs.ext4, e2fsck, resize2fs. xfsprogs: mkfs.xfs, xfs_repair, xfs_growfs.
# util-linux and mount: blkid, lsblk, findmnt, nsenter, mount, umount. nfs-common: mount.nfs for RWX volumes.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates e2fsprogs xfsprogs util-linux mount nfs-common \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/harvester-csi-driver /usr/bin/harvester-csi-driver
LABEL org.opencontainers.image.title="harvester-csi-driver" \
      org.opencontainers.image.description="CSI driver for Kubernetes guest clusters on Harvester" \
      org.opencontainers.image.source="https://github.com/harvester-csi/harvester-csi-driver" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.licenses="Apache-2.0"
# Runs as root by default: the node plugin must (mounts, mkfs). The chart runs the controller as UID 65532.
ENTRYPOINT ["/usr/bin/harvester-csi-driver"]
