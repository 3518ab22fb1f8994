//go:build tools

// Package tools pins the csi-snapshotter command for hack/tools.sh.
package tools

import _ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter"
