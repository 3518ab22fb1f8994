# Harvester CSI driver (serialized hotplug fork).
SHELL := /usr/bin/env bash
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS := -s -w -X main.version=$(VERSION) -X main.commit=$(COMMIT)
TEST_FLAGS ?= -race -count=1 -timeout 40m
# The Helm chart's tests and tools are a separate Go module (Helm needs newer Kubernetes modules than the
# driver); -mod=mod lets that module follow changes of the main go.mod. No -race: nothing concurrent there.
CHART_TEST_FLAGS ?= -count=1 -timeout 20m
IMAGE ?= harvester-csi/harvester-csi-driver:$(VERSION)

.PHONY: help
help: ## Show this help.
	@grep -hE '^[a-z][a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-10s %s\n",$$1,$$2}'

.PHONY: build
build: ## Build bin/harvester-csi-driver (static).
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/harvester-csi-driver ./cmd/harvester-csi-driver

.PHONY: tools
tools: ## Build (once, cached) the upstream binaries the tests run.
	@bash hack/tools.sh >/dev/null

.PHONY: test
test: tools test-chart ## Run every test (builds its own kube-apiserver, etcd, attacher on first use).
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) $(GO) test $(TEST_FLAGS) ./...

.PHONY: test-chart
test-chart: tools ## Test the Helm chart: lint, render, API-server dry-run, upgrade from upstream, RBAC.
	cd tests/chart && HCSI_TOOLS_BIN=$$(bash ../../hack/tools.sh) $(GO) test -mod=mod $(CHART_TEST_FLAGS) ./...

.PHONY: bench
bench: tools ## Run the Go benchmarks only (no tests).
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) $(GO) test -run '^$$' -bench . -benchmem -count=1 -timeout 40m ./...

.PHONY: manifests
manifests: ## Regenerate deploy/ from the chart with default values.
	cd tests/chart && $(GO) run -mod=mod ./cmd/chartctl manifests

.PHONY: chart
chart: ## Lint the chart (default and ci/ values) and package it into bin/.
	cd tests/chart && $(GO) run -mod=mod ./cmd/chartctl lint && $(GO) run -mod=mod ./cmd/chartctl package ../../bin

.PHONY: image
image: ## Build the container image (IMAGE=harvester-csi/harvester-csi-driver:<version>; needs Docker with BuildKit).
	docker build --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) -t $(IMAGE) .

.PHONY: lint
lint: ## gofmt, go vet, and a tidy go.mod (the main module stays lean).
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...
	$(GO) mod tidy -diff

LAB_FLAGS ?=

.PHONY: lab
lab: build tools ## Run the local Harvester-in-a-box lab (as root; LAB_FLAGS="--quick", see docs/lab.md).
	CGO_ENABLED=0 $(GO) build -trimpath -o bin/hcsi-lab ./cmd/hcsi-lab
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) ./bin/hcsi-lab $(LAB_FLAGS)
