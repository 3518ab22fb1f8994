//go:build tools

// Package tools pins the external-provisioner command for hack/tools.sh.
package tools

import _ "github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner"
