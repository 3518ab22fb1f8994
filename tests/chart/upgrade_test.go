package chart

import (
	"path/filepath"
	"reflect"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// immutablePaths are the fields of upstream's objects that an existing object
// keeps for good: `helm upgrade` fails (or, for names, deletes and recreates
// the object) if this chart renders them differently.
var immutablePaths = map[string][][]string{
	"Deployment":          {{"metadata", "namespace"}, {"spec", "selector"}},
	"DaemonSet":           {{"metadata", "namespace"}, {"spec", "selector"}},
	"CSIDriver":           {{"spec", "attachRequired"}, {"spec", "podInfoOnMount"}, {"spec", "fsGroupPolicy"}},
	"StorageClass":        {{"provisioner"}, {"parameters"}, {"reclaimPolicy"}, {"volumeBindingMode"}},
	"VolumeSnapshotClass": {{"driver"}, {"deletionPolicy"}, {"parameters"}},
	"ServiceAccount":      {{"metadata", "namespace"}},
	"ClusterRole":         {},
	"ClusterRoleBinding":  {},
}

// TestUpgradeCompatibleWithUpstreamShape compares, field by field, the
// objects of the upstream chart's shape (testdata/upstream-shape) with this
// chart's defaults. TestAgainstAPIServer/upgrade-from-upstream does the real
// `helm upgrade`; this test names the field when it would fail.
func TestUpgradeCompatibleWithUpstreamShape(t *testing.T) {
	upstream, err := render.Load(filepath.Join("testdata", "upstream-shape"))
	if err != nil {
		t.Fatal(err)
	}
	ours := renderSet(t, valueSet{name: "default"})
	for _, up := range renderWith(t, upstream, nil) {
		paths, ok := immutablePaths[up.GetKind()]
		if !ok {
			t.Fatalf("no immutable fields known for upstream kind %s", up.GetKind())
		}
		o := ours.find(up.GetKind(), up.GetName())
		if o == nil {
			t.Errorf("upstream %s %q is not rendered by this chart: helm upgrade would delete it", up.GetKind(), up.GetName())
			continue
		}
		for _, p := range paths {
			want, _, _ := unstructured.NestedFieldNoCopy(up.Object, p...)
			got, _, _ := unstructured.NestedFieldNoCopy(o.Object, p...)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s %s: %v = %v, upstream has %v", up.GetKind(), up.GetName(), p, got, want)
			}
		}
	}
	// CSIDriver.spec.volumeLifecycleModes is immutable too; upstream leaves it to the API default.
	if modes, _, _ := unstructured.NestedStringSlice(ours.must(t, "CSIDriver", driverName).Object, "spec", "volumeLifecycleModes"); !reflect.DeepEqual(modes, []string{"Persistent"}) {
		t.Errorf("CSIDriver volumeLifecycleModes %v, want the API default [Persistent]", modes)
	}
}
