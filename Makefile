# Harvester CSI driver (serialized hotplug fork).
SHELL := /usr/bin/env bash
comma := ,
GO ?= go
# One version for everything: the VERSION file (SemVer, no "v"). The binary, the image tag and the chart's
# appVersion (its default image tag) are v$(VERSION); the chart's version is $(VERSION). `make set-version`
# changes all of them; tests/chart fails when Chart.yaml and VERSION disagree.
override VERSION := $(strip $(shell cat VERSION))
TAG := v$(VERSION)
# The commit (-dirty when the tree has changes), never a tag name: the version comes from VERSION only.
COMMIT ?= $(shell git describe --always --dirty --abbrev=12 --exclude='*' 2>/dev/null || echo unknown)
LDFLAGS := -s -w -X main.version=$(TAG) -X main.commit=$(COMMIT)
TEST_FLAGS ?= -race -count=1 -timeout 40m
# The Helm chart's tests and tools are a separate Go module (Helm needs newer Kubernetes modules than the
# driver); -mod=mod lets that module follow changes of the main go.mod. No -race: nothing concurrent there.
CHART_TEST_FLAGS ?= -count=1 -timeout 20m
# The image: $(REGISTRY)/$(IMAGE_REPO):$(TAG). Releases go to Docker Hub under the chart's default repository
# (no registry prefix, so Rancher's system default registry applies); REGISTRY=<host> builds for a mirror.
REGISTRY ?=
IMAGE_REPO ?= harvester-csi/harvester-csi-driver
# BENCH selects one benchmark: churn (the wave workload), scale (1,000 volumes on 50 VMs), burst (20 volumes at
# once) or lab (the lab's default scenario in both KubeVirt modes, as root; docs/benchmarks.md, "The lab").
BENCH ?=
BENCH_PATTERN := $(if $(filter churn,$(BENCH)),BenchmarkChurn,$(if $(filter scale,$(BENCH)),BenchmarkScale,$(if $(filter burst,$(BENCH)),BenchmarkPublishBurst,$(if $(filter lab,$(BENCH)),BenchmarkLab,.))))
BENCH_PKGS := $(if $(filter churn scale,$(BENCH)),./tests/bench/,$(if $(filter burst,$(BENCH)),./tests/integration/,$(if $(filter lab,$(BENCH)),./cmd/hcsi-lab/,./tests/... ./cmd/hcsi-lab/)))
# BENCH_ARGS go to the benchmark binary, e.g. BENCH_ARGS='-args -churn.waves=2' (with BENCH=churn) or '-args -scale.duration=20m' (BENCH=scale).
BENCH_ARGS ?=
IMAGE ?= $(if $(REGISTRY),$(REGISTRY:%/=%)/)$(IMAGE_REPO):$(TAG)
# Architectures of `make release` (the Dockerfile cross-compiles with BuildKit's TARGETARCH; both bases are
# multi-architecture indexes).
PLATFORMS ?= linux/amd64,linux/arm64
# Where `make release` writes: the chart archive, index.yaml, images.txt and (without PUSH) the image as an
# OCI archive. CHART_REPO_URL is the URL the chart repository is served from (index.yaml's chart URLs).
DIST ?= dist
CHART_REPO_URL ?=
# PUSH=true: push the multi-architecture image to $(REGISTRY) instead of writing the OCI archive.
PUSH ?=

.PHONY: help
help: ## Show this help.
	@grep -hE '^[a-z][a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-10s %s\n",$$1,$$2}'

.PHONY: build
build: ## Build bin/harvester-csi-driver (static).
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/harvester-csi-driver ./cmd/harvester-csi-driver

.PHONY: tools
tools: ## Build (once, cached) the upstream binaries the tests run.
	@bash hack/tools.sh >/dev/null

.PHONY: os-deps
os-deps: ## Install (as root) the OS tools the tests and the lab need: mkfs/fsck/mount/losetup (hack/os-deps.sh).
	@bash hack/os-deps.sh

.PHONY: test
test: os-deps tools test-chart ## Run every test (builds its own kube-apiserver, etcd, attacher on first use).
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) $(GO) test $(TEST_FLAGS) ./...

.PHONY: test-chart
test-chart: tools ## Test the Helm chart: lint, render, API-server dry-run, upgrade from upstream, RBAC.
	cd tests/chart && HCSI_TOOLS_BIN=$$(bash ../../hack/tools.sh) $(GO) test -mod=mod $(CHART_TEST_FLAGS) ./...

.PHONY: bench
bench: tools ## Run the benchmarks (BENCH=churn, scale, burst or lab for one; results under bench/results/).
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) $(GO) test -run '^$$' -bench '$(BENCH_PATTERN)' -benchtime=1x -count=1 -timeout 120m $(BENCH_PKGS) $(BENCH_ARGS)

.PHONY: manifests
manifests: ## Regenerate deploy/ from the chart with default values (a test fails when it is stale).
	cd tests/chart && $(GO) run -mod=mod ./cmd/chartctl manifests

.PHONY: chart
chart: ## Lint the chart (default and ci/ values) and package it into bin/.
	cd tests/chart && $(GO) run -mod=mod ./cmd/chartctl lint && $(GO) run -mod=mod ./cmd/chartctl package ../../bin

.PHONY: version
version: ## Print the version (from the VERSION file).
	@echo $(TAG)

.PHONY: set-version
set-version: ## Set the version everywhere: make set-version NEW=0.3.1 (VERSION, Chart.yaml, the image list in docs, deploy/rke2).
	@[[ "$(NEW)" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$$ ]] || { echo "NEW=<major.minor.patch[-pre]> is required, got '$(NEW)'" >&2; exit 2; }
	echo "$(NEW)" > VERSION
	sed -i -e 's/^version: .*/version: $(NEW)/' -e 's/^appVersion: .*/appVersion: "v$(NEW)"/' charts/harvester-csi-driver/Chart.yaml
	[ ! -f docs/install.md ] || sed -i 's#^$(IMAGE_REPO):$(TAG)$$#$(IMAGE_REPO):v$(NEW)#' docs/install.md
	sed -i 's#^\(          tag: \)v.*#\1v$(NEW)#' deploy/rke2/harvester-csi-driver-helmchartconfig.yaml

.PHONY: image
image: ## Build the image for this machine's architecture (IMAGE; needs Docker with BuildKit).
	docker build --build-arg VERSION=$(TAG) --build-arg COMMIT=$(COMMIT) -t $(IMAGE) .

.PHONY: images
images: ## List every image the chart deploys with its default values (what an air-gapped registry must mirror).
	@cd tests/chart && $(GO) run -mod=mod ./cmd/chartctl images

.PHONY: release
release: release-image release-chart ## Build the multi-arch image and package the chart with index.yaml into DIST/.

.PHONY: release-image
release-image: ## The image for PLATFORMS: pushed with PUSH=true, else an OCI archive in DIST/ (docker buildx).
	mkdir -p $(DIST)
	docker buildx build --platform $(PLATFORMS) --build-arg VERSION=$(TAG) --build-arg COMMIT=$(COMMIT) -t $(IMAGE) \
		$(if $(filter true,$(PUSH)),--push,--output type=oci$(comma)dest=$(DIST)/harvester-csi-driver-$(TAG).oci.tar) .

.PHONY: release-chart
release-chart: ## Lint and package the chart, write index.yaml (CHART_REPO_URL) and images.txt into DIST/.
	cd tests/chart && $(GO) run -mod=mod ./cmd/chartctl release $(abspath $(DIST)) $(VERSION) $(CHART_REPO_URL)

.PHONY: lint
lint: ## gofmt, go vet, and a tidy go.mod (the main module stays lean).
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...
	$(GO) mod tidy -diff

LAB_FLAGS ?=

.PHONY: lab
lab: os-deps build tools ## Run the local Harvester-in-a-box lab (as root; LAB_FLAGS="--quick", see docs/lab.md).
	CGO_ENABLED=0 $(GO) build -trimpath -o bin/hcsi-lab ./cmd/hcsi-lab
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) ./bin/hcsi-lab $(LAB_FLAGS)
