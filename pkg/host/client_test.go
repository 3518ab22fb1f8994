package host

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestInformerCacheDropsManagedFieldsAndLastApplied(t *testing.T) {
	vm := &kubevirtv1.VirtualMachine{}
	vm.Name = "vm-1"
	vm.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}
	vm.Annotations = map[string]string{lastApplied: "{...}", "harvesterhci.io/keep": "yes"}
	out, err := trimObject(vm)
	if err != nil {
		t.Fatal(err)
	}
	got := out.(*kubevirtv1.VirtualMachine)
	if got.ManagedFields != nil || got.Annotations[lastApplied] != "" || got.Annotations["harvesterhci.io/keep"] != "yes" || got.Name != "vm-1" {
		t.Fatalf("trimmed to %+v", got.ObjectMeta)
	}
}
