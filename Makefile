# Harvester CSI driver (serialized hotplug fork).
SHELL := /usr/bin/env bash
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS := -s -w -X main.version=$(VERSION) -X main.commit=$(COMMIT)
TEST_FLAGS ?= -race -count=1 -timeout 40m

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
test: tools ## Run every test (builds its own kube-apiserver, etcd, attacher on first use).
	HCSI_TOOLS_BIN=$$(bash hack/tools.sh) $(GO) test $(TEST_FLAGS) ./...

.PHONY: lint
lint: ## gofmt and go vet.
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...

.PHONY: lab
lab: ## Run the local Harvester-in-a-box lab with churn (not implemented yet: see README).
	@echo "make lab: the local lab is not implemented yet (tracked in its own issue)"; exit 1
