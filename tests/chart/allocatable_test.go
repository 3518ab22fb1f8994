package chart

import (
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// The CSIDriver asks kubelet to refresh the node's volume count
// (nodeAllocatableUpdatePeriodSeconds) on Kubernetes 1.33 and later, where
// the field exists (KEP-4876, feature gate MutableCSINodeAllocatableCount,
// on by default from 1.35), never below the API's minimum of 10 s, and not
// at all when the value is 0; node.maxVolumesPerNode caps the count.
func TestNodeAllocatableCount(t *testing.T) {
	for _, tc := range []struct {
		name, kube string
		vals       map[string]interface{}
		period     int64 // 0: the field is absent
		maxArg     string
	}{
		{name: "1.35, defaults", kube: "v1.35.0", period: 60},
		{name: "1.33", kube: "v1.33.2", period: 60},
		{name: "1.32", kube: "v1.32.5"},
		{name: "1.35, off", kube: "v1.35.0", vals: map[string]interface{}{"node": map[string]interface{}{"allocatableUpdatePeriodSeconds": 0}}},
		{name: "1.35, below the minimum", kube: "v1.35.0", vals: map[string]interface{}{"node": map[string]interface{}{"allocatableUpdatePeriodSeconds": 3}}, period: 10},
		{name: "capped", kube: "v1.35.0", vals: map[string]interface{}{"node": map[string]interface{}{"maxVolumesPerNode": 40}}, period: 60, maxArg: "40"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			manifest, err := render.TemplateFor(loadChart(t), tc.vals, tc.kube)
			if err != nil {
				t.Fatal(err)
			}
			objs, err := render.Objects(manifest)
			if err != nil {
				t.Fatal(err)
			}
			r := &rendered{objects: objs}
			cd := r.must(t, "CSIDriver", driverName)
			period, found, _ := unstructured.NestedFieldNoCopy(cd.Object, "spec", "nodeAllocatableUpdatePeriodSeconds")
			if (tc.period != 0) != found || found && sprint(period) != sprint(tc.period) {
				t.Errorf("nodeAllocatableUpdatePeriodSeconds %v (set: %t), want %d", period, found, tc.period)
			}
			args, _, _ := unstructured.NestedSlice(r.must(t, "DaemonSet", nodeName).Object, "spec", "template", "spec", "containers")
			got := ""
			for _, c := range args {
				c := c.(map[string]interface{})
				if c["name"] != "harvester-csi-driver" {
					continue
				}
				var list []string
				for _, a := range c["args"].([]interface{}) {
					list = append(list, a.(string))
				}
				got, _ = argValue(list, "max-volumes-per-node")
			}
			if got != tc.maxArg {
				t.Errorf("--max-volumes-per-node=%q, want %q", got, tc.maxArg)
			}
		})
	}
}
