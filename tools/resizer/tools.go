//go:build tools

// Package tools pins the external-resizer command for hack/tools.sh.
package tools

import _ "github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer"
