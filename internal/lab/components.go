package lab

import (
	"os"
	"path/filepath"
	"regexp"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
)

// components names what the lab ran, with the versions tools/ pins (what
// hack/tools.sh built): read, not written down twice, so the report cannot
// drift from the binaries.
func components(kubevirt string) map[string]string {
	root, rootErr := checkout.Root()
	pinned := func(dir, module string) string {
		if rootErr != nil {
			return "unknown"
		}
		data, err := os.ReadFile(filepath.Join(root, "tools", dir, "go.mod"))
		if err != nil {
			return "unknown"
		}
		m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?` + regexp.QuoteMeta(module) + `(?:/v\d+)?\s+(v\S+)`).FindSubmatch(data)
		if m == nil {
			return "unknown"
		}
		return string(m[1])
	}
	return map[string]string{
		"kubernetes (guest and host control planes, kubelet, scheduler)": pinned("kube", "k8s.io/kubernetes"),
		"csi-attacher":    "external-attacher " + pinned("attacher", "github.com/kubernetes-csi/external-attacher"),
		"csi-provisioner": "external-provisioner " + pinned("provisioner", "github.com/kubernetes-csi/external-provisioner"),
		"csi-resizer":     "external-resizer " + pinned("resizer", "github.com/kubernetes-csi/external-resizer"),
		"kubevirt":        kubevirtComponent(kubevirt),
	}
}

func kubevirtComponent(kubevirt string) string {
	if tag, mode, ok, err := ParseRealKubeVirt(kubevirt); ok && err == nil {
		return "virt-controller and virt-api " + tag + " (" + string(mode) + "), node agents simulated"
	}
	return "simulated (" + kubevirt + ")"
}
