//go:build tools

// Package tools pins the external-attacher command for hack/tools.sh.
package tools

import _ "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher"
